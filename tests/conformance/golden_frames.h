// The golden data-socket frames (golden_frames.txt): one example of every
// request and reply of common/data_protocol.h, built from its structs with
// fixed field values. golden_frames_test checks the file against these and
// against the C++ client's encoders; test_golden_frames.py checks the Python
// client's encoders (weightd/_datasock.py, weightd/_cuda) against the file —
// so both clients and the protocol header are pinned to the same bytes.
// golden_frames_write rewrites the file (only when the protocol changes on
// purpose).
#ifndef WEIGHTD_TESTS_CONFORMANCE_GOLDEN_FRAMES_H_
#define WEIGHTD_TESTS_CONFORMANCE_GOLDEN_FRAMES_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace weightd::golden {

// The field values the frames use (test_golden_frames.py spells them again).
inline constexpr uint64_t kLeaseId = 0x0807060504030201;   // bytes 01..08
inline constexpr uint64_t kSession = 0x1817161514131211;   // bytes 11..18
// Token: bytes 0x10..0x1f; GPU UUID: 0xa0..0xaf; IPC handle: 0xc0..0xff.
std::string Token();
std::string GpuUuid();
std::string IpcHandle();

struct Frame {
  std::string name;
  std::string comment;  // what it is, in the file
  std::string bytes;
};

// Every frame, in the file's order.
std::vector<Frame> Frames();

// golden_frames.txt: "# comment" lines and "name hex" lines.
std::string Render(const std::vector<Frame>& frames);
absl::StatusOr<std::map<std::string, std::string>> Parse(const std::string& text);

}  // namespace weightd::golden

#endif  // WEIGHTD_TESTS_CONFORMANCE_GOLDEN_FRAMES_H_
