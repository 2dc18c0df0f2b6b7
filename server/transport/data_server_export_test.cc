// WDC1 with handle kind kCudaDaemonExport through a real DataServer
// (export_request.cc): a buffer the daemon owns, planned by the writer of
// the device the request names, cached per fetch table and device, held
// while the connection that took it is open.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "server/transport/data_server_testing.h"

namespace weightd::testing {
namespace {

std::string ExportTarget(uint8_t uuid_byte, uint64_t size = 0) {
  CudaPushTarget t{};
  std::memset(t.gpu_uuid, uuid_byte, sizeof(t.gpu_uuid));
  t.size = size;
  t.handle_kind = kCudaDaemonExport;
  return Bytes(&t, sizeof(t));
}

ExportInfo InfoOf(const Reply& r) {
  ExportInfo info{};
  EXPECT_EQ(r.payload.size(), sizeof(info));
  std::memcpy(&info, r.payload.data(), std::min(r.payload.size(), sizeof(info)));
  return info;
}

// Exports to any GPU for the tests: "GPU-test", a memfd of `size` bytes,
// budgeted `budget` bytes by default.
class FakeGpuExporter final : public PushWriter {
 public:
  FakeGpuExporter(uint64_t size, uint64_t budget) : size_(size), budget_(budget) {}
  std::optional<absl::Status> Push(const LeaseContents&, const PushLayout&, const PushTarget&,
                                   const std::atomic<bool>*) const override {
    return std::nullopt;
  }
  std::optional<absl::StatusOr<ExportPlan>> PlanExport(
      std::shared_ptr<const LeaseContents>, const PushLayout&, const CudaPushTarget& target,
      const std::atomic<bool>*) const override {
    if (target.gpu_uuid[0] == 0) return std::nullopt;
    ExportPlan plan{.device = "GPU-test", .size = size_, .default_budget = budget_};
    plan.fill = [size = size_]() -> absl::StatusOr<std::unique_ptr<ExportedBuffer>> {
      auto out = std::make_unique<ExportedBuffer>();
      out->fd = UniqueFd(::memfd_create("gpu", MFD_CLOEXEC));
      if (::ftruncate(out->fd.get(), static_cast<off_t>(size)) != 0) {
        return absl::InternalError("ftruncate");
      }
      out->size = size;
      return out;
    };
    return plan;
  }

 private:
  const uint64_t size_;
  const uint64_t budget_;
};

class DataServerExportTest : public DataServerTest {
 protected:
  // Two leases on one fetch table: 600 and 400 bytes of one segment. The
  // fixture holds the table, as the daemon's fetch table cache does: a
  // buffer is kept after its holds end only while its table lives.
  void Leases() {
    table_ = std::make_shared<std::vector<LeaseTensor>>(
        std::vector<LeaseTensor>{{0, 0, 600}, {0, 600, 400}});
    BufferPtr buffer = HostBuffer(1000);
    a_ = leases_.Grant(LeaseContents{.buffers = {buffer}, .tensors = table_});
    b_ = leases_.Grant(LeaseContents{.buffers = {buffer}, .tensors = table_});
  }
  std::shared_ptr<const std::vector<LeaseTensor>> table_;
  LeaseGrant a_, b_;
};

TEST_F(DataServerExportTest, TheHostTwinIsFilledOnceSealedAndHeldWhileItsConnectionsAreOpen) {
  Start();
  Leases();
  UniqueFd ca = Connect(), cb = Connect();
  Reply first = Exchange(ca.get(), Header(kCudaPushMagic, a_.id, a_.token) + ExportTarget(0));
  ASSERT_TRUE(first.status.ok()) << first.status;
  ASSERT_EQ(first.fds.size(), 1u);
  const ExportInfo info = InfoOf(first);
  EXPECT_EQ(info.layout_size, 768u + 400u);
  EXPECT_GE(info.size, info.layout_size);
  EXPECT_EQ(info.size % static_cast<uint64_t>(::sysconf(_SC_PAGESIZE)), 0u);
  // Sealed against writes, and the lease at the default layout.
  EXPECT_NE(::fcntl(first.fds[0].get(), F_GET_SEALS) & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE), 0);
  std::string got(1168, '\0');
  ASSERT_EQ(::pread(first.fds[0].get(), got.data(), got.size(), 0), 1168);
  for (int k = 0; k < 600; ++k) ASSERT_EQ(static_cast<uint8_t>(got[k]), k % 251) << k;
  for (int k = 0; k < 400; ++k) ASSERT_EQ(static_cast<uint8_t>(got[768 + k]), (600 + k) % 251);
  // Another connection's export of the same table: the same buffer.
  Reply second = Exchange(cb.get(), Header(kCudaPushMagic, b_.id, b_.token) + ExportTarget(0));
  ASSERT_TRUE(second.status.ok()) << second.status;
  struct stat sa {}, sb {};
  ASSERT_EQ(::fstat(first.fds[0].get(), &sa), 0);
  ASSERT_EQ(::fstat(second.fds[0].get(), &sb), 0);
  EXPECT_EQ(sa.st_ino, sb.st_ino);
  ExportCacheStats stats = server_->export_stats();
  EXPECT_EQ(stats.fills, 1u);
  EXPECT_EQ(stats.hits, 1u);
  EXPECT_EQ(stats.held, 1u);
  EXPECT_EQ(server_->export_bytes("host"), info.size);
  // Held while a connection that took it is open; kept afterwards.
  ca.Reset();
  cb.Reset();
  EXPECT_TRUE(Eventually([&] { return server_->export_stats().held == 0; }));
  EXPECT_EQ(server_->export_stats().buffers, 1u);
}

TEST_F(DataServerExportTest, AnExportCarriesNoFdNoOffsetsAndNoSize) {
  Start();
  Leases();
  UniqueFd c = Connect();
  UniqueFd stray(::memfd_create("stray", MFD_CLOEXEC));
  const std::string want =
      "an export carries no fd, no offsets (the default layout) and size 0: the daemon owns "
      "its buffer";
  Reply with_fd = Exchange(c.get(), Header(kCudaPushMagic, a_.id, a_.token) + ExportTarget(0),
                           {stray.get()});
  EXPECT_EQ(with_fd.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(with_fd.status.message(), want);
  Reply with_size =
      Exchange(c.get(), Header(kCudaPushMagic, a_.id, a_.token) + ExportTarget(0, 4096));
  EXPECT_EQ(with_size.status.message(), want);
  const uint64_t offsets[2] = {0, 1024};
  Reply with_offsets = Exchange(c.get(), Header(kCudaPushMagic, a_.id, a_.token, 2) +
                                             ExportTarget(0) + Bytes(offsets, sizeof(offsets)));
  EXPECT_EQ(with_offsets.status.message(), want);
  EXPECT_EQ(server_->export_stats().fills, 0u);
}

TEST_F(DataServerExportTest, AGpuExportNeedsAWriterForThatDevice) {
  Start();
  Leases();
  UniqueFd c = Connect();
  Reply r = Exchange(c.get(), Header(kCudaPushMagic, a_.id, a_.token) + ExportTarget(0x42));
  EXPECT_EQ(r.status.code(), absl::StatusCode::kUnimplemented) << r.status;
  EXPECT_EQ(r.status.message(), "this data socket exports no buffer to that device");
}

TEST_F(DataServerExportTest, TheWritersBudgetHoldsUnlessTheDaemonSetsOne) {
  DataServer::Options options;
  options.push_writers = {std::make_shared<FakeGpuExporter>(8 << 20, 4 << 20)};
  options.max_export_bytes_per_uid = uint64_t{1} << 30;  // not the bound tested
  Start(std::move(options));
  Leases();
  UniqueFd c = Connect();
  Reply over = Exchange(c.get(), Header(kCudaPushMagic, a_.id, a_.token) + ExportTarget(0x42));
  EXPECT_EQ(over.status.code(), absl::StatusCode::kResourceExhausted) << over.status;
  EXPECT_NE(over.status.message().find("exceeds --device-memory-bytes (4194304 for GPU-test)"),
            std::string::npos)
      << over.status;
  server_.reset();

  options = {};
  options.push_writers = {std::make_shared<FakeGpuExporter>(8 << 20, 4 << 20)};
  options.max_export_bytes_per_uid = uint64_t{1} << 30;
  options.export_budget = 16 << 20;
  Start(std::move(options));
  c = Connect();
  Reply r = Exchange(c.get(), Header(kCudaPushMagic, b_.id, b_.token) + ExportTarget(0x42));
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(InfoOf(r).size, uint64_t{8} << 20);
  EXPECT_EQ(server_->export_bytes("GPU-test"), uint64_t{8} << 20);
}

}  // namespace
}  // namespace weightd::testing
