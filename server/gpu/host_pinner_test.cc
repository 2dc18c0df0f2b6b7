#include "server/gpu/host_pinner.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "common/testing/maps.h"
#include "server/gpu/cuda_errors.h"
#include "server/gpu/gpu_health.h"
#include "server/memory/host_memory.h"

namespace weightd {
namespace {

GpuDevice Gpu(int ordinal, bool read_only) {
  GpuDevice g;
  g.ordinal = ordinal;
  g.uuid = absl::StrCat("GPU-test-", ordinal);
  g.name = read_only ? "GH200" : "H100";
  g.host_register = true;
  g.host_register_read_only = read_only;
  g.pageable_memory_access = read_only;
  return g;
}

GpuInventory Gpus(std::vector<GpuDevice> devices) {
  GpuInventory inv;
  inv.cuda_built = true;
  inv.devices = std::move(devices);
  return inv;
}

TEST(ChoosePinPlanTest, ReadOnlyOnlyWhereEveryGpuTakesIt) {
  PinPlan gh200 = ChoosePinPlan(PinMode::kAuto, Gpus({Gpu(0, true), Gpu(1, true)}));
  EXPECT_EQ(gh200.method, PinMethod::kReadOnly);
  EXPECT_EQ(gh200.ordinal, 0);
  // An x86 H100: read-only registration unsupported, so the writable
  // mapping is registered.
  EXPECT_EQ(ChoosePinPlan(PinMode::kAuto, Gpus({Gpu(0, false)})).method, PinMethod::kWritable);
  // One portable registration for all: one GPU without it decides.
  PinPlan mixed = ChoosePinPlan(PinMode::kOn, Gpus({Gpu(3, true), Gpu(5, false)}));
  EXPECT_EQ(mixed.method, PinMethod::kWritable);
  EXPECT_EQ(mixed.ordinal, 3);  // the first GPU current while registering
}

TEST(ChoosePinPlanTest, NoneSaysWhyWhenItMatters) {
  GpuInventory none;
  none.unavailable = "no CUDA driver";
  PinPlan quiet = ChoosePinPlan(PinMode::kAuto, none);
  EXPECT_EQ(quiet.method, PinMethod::kNone);
  EXPECT_FALSE(quiet.log_skips);
  PinPlan asked = ChoosePinPlan(PinMode::kOn, none);
  EXPECT_EQ(asked.method, PinMethod::kNone);
  EXPECT_TRUE(asked.log_skips);
  EXPECT_EQ(asked.reason, "no CUDA driver");
  GpuDevice no_register = Gpu(1, false);
  no_register.host_register = false;
  PinPlan cannot = ChoosePinPlan(PinMode::kAuto, Gpus({Gpu(0, false), no_register}));
  EXPECT_EQ(cannot.method, PinMethod::kNone);
  EXPECT_NE(cannot.reason.find("GPU-test-1"), std::string::npos) << cannot.reason;
  EXPECT_EQ(ChoosePinPlan(PinMode::kOff, Gpus({Gpu(0, true)})).method, PinMethod::kNone);
}

// A registrar standing in for the CUDA plugin's, with the driver's rules
// that matter here: a plain registration needs a writable mapping, the
// read-only flag needs the attribute (the test says whether it holds).
struct Call {
  std::string what;
  const void* addr;
  size_t size;
  bool read_only;
  int ordinal;
  std::string perms;  // of the mapping at the time
};
std::vector<Call> calls;
bool read_only_supported = false;
bool fail_next_pin = false;

absl::Status FakePin(const void* data, size_t size, bool read_only, int ordinal) {
  const std::string perms = MappingPerms(data);
  calls.push_back({"pin", data, size, read_only, ordinal, perms});
  if (fail_next_pin) {
    fail_next_pin = false;
    return absl::UnavailableError("cudaHostRegister: cudaErrorMemoryAllocation");
  }
  if (read_only && !read_only_supported) return absl::UnavailableError("cudaErrorNotSupported");
  if (!read_only && perms.substr(0, 2) != "rw") {
    return absl::UnavailableError("cudaErrorInvalidValue");
  }
  return absl::OkStatus();
}

absl::Status FakeUnpin(const void* data, int ordinal) {
  calls.push_back({"unpin", data, 0, false, ordinal, MappingPerms(data)});
  return absl::OkStatus();
}

const CudaPluginApi* FakeApi() {
  static CudaPluginApi api = [] {
    CudaPluginApi a;
    a.abi = kCudaPluginAbi;
    a.pin = &FakePin;
    a.unpin = &FakeUnpin;
    return a;
  }();
  return &api;
}

SegmentPtr Filled(HostMemoryManager& memory, uint64_t size) {
  auto seg = memory.Allocate(size, {.purpose = "checkpoint"});
  EXPECT_TRUE(seg.ok()) << seg.status();
  std::memset((*seg)->mutable_data(), 0x3C, size);
  EXPECT_TRUE((*seg)->Seal().ok());
  return SegmentPtr(std::move(*seg));
}

class HostPinnerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    calls.clear();
    read_only_supported = false;
    fail_next_pin = false;
  }
};

// An x86 H100: the daemon's mapping, kept writable through the seal, is
// registered without the read-only flag, with the first GPU current; each
// segment once, however many holders ask; unregistered while still mapped
// when the segment goes.
TEST_F(HostPinnerTest, WritableMappingsWhereReadOnlyRegistrationIsUnsupported) {
  HostPinner pinner({.mode = PinMode::kAuto, .gpus = Gpus({Gpu(2, false)}), .api = FakeApi()});
  ASSERT_TRUE(pinner.wants_writable_mappings());
  HostMemoryManager memory({.keep_writable_mappings = pinner.wants_writable_mappings()});
  SegmentPtr a = Filled(memory, 8192), b = Filled(memory, 3 * 4096);
  if (a->registrable_mapping() == nullptr) GTEST_SKIP() << "kernel before 5.10";
  EXPECT_EQ(MappingPerms(a->data()), "rw-s");
  pinner.Pin("m", "checkpoint", {a, b, a});
  pinner.Pin("other", "checkpoint", {b});  // shared (dedupe): pinned already
  ASSERT_EQ(calls.size(), 2u);
  for (const Call& c : calls) {
    EXPECT_EQ(c.what, "pin");
    EXPECT_FALSE(c.read_only);
    EXPECT_EQ(c.ordinal, 2);
    EXPECT_EQ(c.perms, "rw-s");
  }
  EXPECT_EQ(calls[0].addr, a->data());
  EXPECT_EQ(calls[0].size, 8192u);
  EXPECT_EQ(pinner.pinned_bytes(), 8192u + 3 * 4096);
  // No other holder of the fd can write, pinned or not.
  EXPECT_EQ(::mmap(nullptr, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, a->fd(), 0), MAP_FAILED);
  EXPECT_EQ(::pwrite(a->fd(), "x", 1, 0), -1);
  const void* at = a->data();
  a.reset();
  ASSERT_EQ(calls.size(), 3u);
  EXPECT_EQ(calls[2].what, "unpin");
  EXPECT_EQ(calls[2].addr, at);
  EXPECT_EQ(calls[2].ordinal, 2);
  EXPECT_EQ(calls[2].perms, "rw-s");  // still mapped
  EXPECT_EQ(pinner.pinned_bytes(), 3 * 4096u);
  b.reset();
  EXPECT_EQ(pinner.pinned_bytes(), 0u);
}

// A GH200: the sealed read-only mapping, with the read-only flag; the
// account does not keep writable mappings.
TEST_F(HostPinnerTest, ReadOnlyRegistrationWhereEveryGpuTakesIt) {
  read_only_supported = true;
  HostPinner pinner({.mode = PinMode::kAuto, .gpus = Gpus({Gpu(0, true)}), .api = FakeApi()});
  ASSERT_FALSE(pinner.wants_writable_mappings());
  HostMemoryManager memory({.keep_writable_mappings = pinner.wants_writable_mappings()});
  SegmentPtr a = Filled(memory, 4096);
  EXPECT_EQ(a->registrable_mapping(), nullptr);
  EXPECT_EQ(MappingPerms(a->data()), "r--s");
  pinner.Pin("m", "publish", {a});
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_TRUE(calls[0].read_only);
  EXPECT_EQ(calls[0].perms, "r--s");
  EXPECT_EQ(pinner.pinned_bytes(), 4096u);
  a.reset();
  EXPECT_EQ(calls.back().what, "unpin");
  EXPECT_EQ(pinner.pinned_bytes(), 0u);
}

// Segments without a writable mapping (adopted, sealed exclusively) are
// not offered to CUDA where only writable ones register; a registration
// CUDA refuses leaves nothing to undo.
TEST_F(HostPinnerTest, WhatCannotBePinnedStaysPageable) {
  HostPinner pinner({.mode = PinMode::kOn, .gpus = Gpus({Gpu(0, false)}), .api = FakeApi()});
  HostMemoryManager read_only_memory({});  // does not keep writable mappings
  SegmentPtr adopted_like = Filled(read_only_memory, 4096);
  pinner.Pin("m", "checkpoint", {adopted_like});
  EXPECT_TRUE(calls.empty());
  EXPECT_EQ(pinner.pinned_bytes(), 0u);

  HostMemoryManager memory({.keep_writable_mappings = true});
  SegmentPtr refused = Filled(memory, 4096);
  if (refused->registrable_mapping() == nullptr) GTEST_SKIP() << "kernel before 5.10";
  fail_next_pin = true;
  pinner.Pin("m", "checkpoint", {refused});
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(pinner.pinned_bytes(), 0u);
  refused.reset();
  EXPECT_EQ(calls.size(), 1u);  // no unpin of what was never pinned
}

TEST(StickyCudaErrorTest, TheDocumentedStickyErrorsAndNoOthers) {
  for (int code : {700, 702, 710, 714, 715, 716, 717, 718, 719, 214, 226}) {
    EXPECT_TRUE(IsStickyCudaError(code)) << code;
  }
  // Out of memory, invalid value, not supported, peer access, unknown.
  for (int code : {0, 1, 2, 101, 801, 704, 999}) {
    EXPECT_FALSE(IsStickyCudaError(code)) << code;
  }
}

TEST(GpuHealthTest, AStickyErrorTakesOutThatGpuOnlyAndTheFirstErrorStays) {
  GpuHealth health;
  const GpuDevice a = Gpu(0, false), b = Gpu(1, false);
  health.NoteStickyError(a, 2, absl::UnavailableError("cudaErrorMemoryAllocation"), "push");
  EXPECT_TRUE(health.CheckUsable(a).ok());  // not sticky: nothing changes
  health.NoteStickyError(a, kCudaIllegalAddress,
                         absl::UnavailableError("cudaErrorIllegalAddress: boom"), "push");
  health.NoteStickyError(a, kCudaLaunchFailure,
                         absl::UnavailableError("cudaErrorLaunchFailure"), "export");
  absl::Status refused = health.CheckUsable(a);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.message().find("GPU-test-0"), std::string::npos) << refused;
  EXPECT_NE(refused.message().find("cudaErrorIllegalAddress: boom"), std::string::npos)
      << refused;
  EXPECT_EQ(refused.message().find("LaunchFailure"), std::string::npos) << refused;
  EXPECT_NE(health.Unavailable(a.uuid).find("during a push"), std::string::npos);
  EXPECT_TRUE(health.CheckUsable(b).ok());
  EXPECT_EQ(health.Unavailable(b.uuid), "");
}

}  // namespace
}  // namespace weightd
