#include "common/grpc/status_convert.h"

#include <string>

#include "gtest/gtest.h"

namespace weightd {
namespace {

TEST(StatusConvertTest, CodesCrossUnchanged) {
  for (int code = 0; code <= 16; ++code) {
    const absl::Status s(static_cast<absl::StatusCode>(code), code == 0 ? "" : "why");
    const grpc::Status g = ToGrpcStatus(s);
    EXPECT_EQ(static_cast<int>(g.error_code()), code);
    EXPECT_EQ(FromGrpc(g), s);
  }
}

TEST(StatusConvertTest, ContextGoesBeforeTheMessage) {
  const grpc::Status g(grpc::StatusCode::UNAVAILABLE, "connection refused");
  EXPECT_EQ(FromGrpc(g, "reading from peer a:1"),
            absl::UnavailableError("reading from peer a:1: connection refused"));
  EXPECT_EQ(FromGrpc(g), absl::UnavailableError("connection refused"));
  EXPECT_TRUE(FromGrpc(grpc::Status::OK, "anything").ok());
}

TEST(StatusConvertTest, LongMessagesAreCutToTheTrailerBudget) {
  const std::string text(10 * kMaxStatusMessageBytes, 'x');
  const grpc::Status g = ToGrpcStatus(absl::InternalError(text));
  EXPECT_EQ(g.error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_LE(g.error_message().size(), kMaxStatusMessageBytes);
  EXPECT_NE(g.error_message().find("more bytes]"), std::string::npos);
}

}  // namespace
}  // namespace weightd
