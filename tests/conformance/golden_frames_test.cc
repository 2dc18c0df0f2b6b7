// common/data_protocol.h's structs and the C++ client's frame encoders
// (client/data_socket.h) against golden_frames.txt.
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "absl/strings/escaping.h"
#include "client/data_socket.h"
#include "common/data_protocol.h"
#include "gtest/gtest.h"
#include "tests/conformance/golden_frames.h"

namespace weightd::golden {
namespace {

std::map<std::string, std::string> Golden() {
  std::ifstream in(WEIGHTD_GOLDEN_FRAMES);
  std::stringstream text;
  text << in.rdbuf();
  auto frames = Parse(text.str());
  EXPECT_TRUE(frames.ok()) << frames.status();
  return frames.ok() ? *frames : std::map<std::string, std::string>();
}

std::string Hex(const std::string& s) { return absl::BytesToHexString(s); }

TEST(GoldenFramesTest, TheProtocolStructsMakeTheGoldenBytes) {
  const std::map<std::string, std::string> golden = Golden();
  ASSERT_EQ(golden.size(), Frames().size());
  for (const Frame& f : Frames()) {
    auto it = golden.find(f.name);
    ASSERT_NE(it, golden.end()) << f.name << " is not in " << WEIGHTD_GOLDEN_FRAMES;
    EXPECT_EQ(Hex(it->second), Hex(f.bytes)) << f.name;
  }
}

TEST(GoldenFramesTest, TheCppClientEncodesTheGoldenRequests) {
  std::map<std::string, std::string> golden = Golden();
  uint8_t uuid[16];
  std::memcpy(uuid, GpuUuid().data(), 16);
  auto attach = EncodeLeaseRequest(kAttachMagic, kLeaseId, Token());
  ASSERT_TRUE(attach.ok());
  EXPECT_EQ(Hex(*attach), Hex(golden["attach_request"]));
  auto push = EncodeLeaseRequest(kPushMagic, kLeaseId, Token());
  ASSERT_TRUE(push.ok());
  EXPECT_EQ(Hex(*push), Hex(golden["push_request"]));
  auto cuda = EncodeLeaseRequest(kCudaPushMagic, kLeaseId, Token());
  ASSERT_TRUE(cuda.ok());
  EXPECT_EQ(Hex(*cuda + EncodeCudaPushTarget(uuid, 0x200000, kCudaVmmPosixFd)),
            Hex(golden["cuda_push_request"]));
  EXPECT_EQ(Hex(*cuda + EncodeCudaPushTarget(uuid, 0, kCudaDaemonExport)),
            Hex(golden["export_request"]));
  auto stage = EncodeStageRequest(kSession, Token());
  ASSERT_TRUE(stage.ok());
  EXPECT_EQ(Hex(*stage), Hex(golden["stage_request"]));
  // A token of another size is the daemon's fault, never sent.
  EXPECT_EQ(EncodeLeaseRequest(kAttachMagic, 1, "short").status().code(),
            absl::StatusCode::kInternal);
  EXPECT_EQ(EncodeStageRequest(1, "short").status().code(), absl::StatusCode::kInternal);
}

TEST(GoldenFramesTest, TheGoldenRepliesReadBackAsTheirFields) {
  std::map<std::string, std::string> golden = Golden();
  AttachReply reply{};
  ASSERT_GE(golden["reply_error"].size(), sizeof(reply));
  std::memcpy(&reply, golden["reply_error"].data(), sizeof(reply));
  EXPECT_EQ(std::memcmp(reply.magic, kReplyMagic, 4), 0);
  EXPECT_EQ(reply.code, 5);
  EXPECT_EQ(golden["reply_error"].substr(sizeof(reply)), "no lease 7");
  EXPECT_EQ(reply.message_len, 10u);
  ExportInfo info{};
  ASSERT_EQ(golden["reply_export"].size(), sizeof(reply) + sizeof(info));
  std::memcpy(&info, golden["reply_export"].data() + sizeof(reply), sizeof(info));
  EXPECT_EQ(info.size, 0x400000u);
  EXPECT_EQ(info.layout_size, 0x3ff000u);
}

}  // namespace
}  // namespace weightd::golden
