// Test doubles of the memory seam (buffer.h), for unit tests only.
#ifndef WEIGHTD_SERVER_MEMORY_TEST_BUFFERS_H_
#define WEIGHTD_SERVER_MEMORY_TEST_BUFFERS_H_

#include <gtest/gtest.h>

#include "server/memory/buffer.h"

namespace weightd {

// Device memory as host-side code sees it: a buffer of another kind, with
// no bytes at all. Asking it for an fd fails the test when `fd_is_a_bug`.
class FakeDeviceBuffer final : public Buffer {
 public:
  explicit FakeDeviceBuffer(bool fd_is_a_bug = true) : fd_is_a_bug_(fd_is_a_bug) {}
  uint64_t id() const override { return 1u << 30; }
  uint64_t size() const override { return 4096; }
  MemoryLocation location() const override { return {MemoryKind::kCudaDevice, 0}; }
  const uint8_t* host_data() const override { return nullptr; }
  absl::StatusOr<int> ShareableFd() const override {
    if (fd_is_a_bug_) ADD_FAILURE() << "a device buffer was asked for its fd";
    return absl::UnimplementedError("no device here");
  }

 private:
  bool fd_is_a_bug_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_MEMORY_TEST_BUFFERS_H_
