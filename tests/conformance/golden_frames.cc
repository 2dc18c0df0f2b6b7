#include "tests/conformance/golden_frames.h"

#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/data_protocol.h"

namespace weightd::golden {
namespace {

std::string Run(uint8_t first, size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>(first + i);
  return s;
}

template <typename T>
std::string Bytes(const T& v) {
  return std::string(reinterpret_cast<const char*>(&v), sizeof(v));
}

std::string Offsets(const std::vector<uint64_t>& offsets) {
  std::string out;
  for (uint64_t o : offsets) out += Bytes(o);
  return out;
}

PushRequest Push(const char (&magic)[4], uint32_t num_offsets) {
  PushRequest r{};
  std::memcpy(r.magic, magic, 4);
  r.num_offsets = num_offsets;
  r.lease_id = kLeaseId;
  std::memcpy(r.token, Token().data(), 16);
  return r;
}

CudaPushTarget Target(const std::string& uuid, uint64_t size, uint32_t kind,
                      const std::string& ipc) {
  CudaPushTarget t{};
  std::memcpy(t.gpu_uuid, uuid.data(), 16);
  t.size = size;
  t.handle_kind = kind;
  std::memcpy(t.ipc_handle, ipc.data(), ipc.size());
  return t;
}

AttachReply Reply(int32_t code, uint32_t num_fds, uint32_t message_len) {
  AttachReply r{};
  std::memcpy(r.magic, kReplyMagic, 4);
  r.code = code;
  r.num_fds = num_fds;
  r.message_len = message_len;
  return r;
}

std::vector<Frame> Requests() {
  AttachRequest attach{};
  std::memcpy(attach.magic, kAttachMagic, 4);
  attach.lease_id = kLeaseId;
  std::memcpy(attach.token, Token().data(), 16);
  StageRequest stage{};
  std::memcpy(stage.magic, kStageMagic, 4);
  stage.session = kSession;
  std::memcpy(stage.token, Token().data(), 16);
  return {
      {"attach_request", "AttachRequest: lease kLeaseId, token", Bytes(attach)},
      {"push_request", "PushRequest (WDP1), default layout; the memfd rides on it",
       Bytes(Push(kPushMagic, 0))},
      {"push_request_offsets", "PushRequest (WDP1), then 3 u64 offsets",
       Bytes(Push(kPushMagic, 3)) + Offsets({0, 256, 4096})},
      {"cuda_push_request", "PushRequest (WDC1), CudaPushTarget kCudaVmmPosixFd of 2 MiB",
       Bytes(Push(kCudaPushMagic, 0)) +
           Bytes(Target(GpuUuid(), 0x200000, kCudaVmmPosixFd, ""))},
      {"cuda_push_request_ipc",
       "PushRequest (WDC1), CudaPushTarget kCudaLegacyIpc of 1 MiB, then 2 u64 offsets",
       Bytes(Push(kCudaPushMagic, 2)) +
           Bytes(Target(GpuUuid(), 0x100000, kCudaLegacyIpc, IpcHandle())) + Offsets({0, 512})},
      {"export_request", "PushRequest (WDC1), CudaPushTarget kCudaDaemonExport on the GPU",
       Bytes(Push(kCudaPushMagic, 0)) + Bytes(Target(GpuUuid(), 0, kCudaDaemonExport, ""))},
      {"export_request_host", "the same on the host twin (all-zero GPU UUID)",
       Bytes(Push(kCudaPushMagic, 0)) +
           Bytes(Target(std::string(16, '\0'), 0, kCudaDaemonExport, ""))},
      {"stage_request", "StageRequest: session kSession, token", Bytes(stage)},
  };
}

std::vector<Frame> Replies() {
  ExportInfo info{};
  info.size = 0x400000;
  info.layout_size = 0x3ff000;
  const std::string why = "no lease 7";
  return {
      {"reply_attach", "AttachReply OK with 2 fds (an attach of 2 segments)", Bytes(Reply(0, 2, 0))},
      {"reply_push", "AttachReply OK, no fds (a push done)", Bytes(Reply(0, 0, 0))},
      {"reply_staging", "AttachReply OK with 1 fd (the staging memfd)", Bytes(Reply(0, 1, 0))},
      {"reply_export", "AttachReply OK with 1 fd and an ExportInfo (4 MiB, layout 0x3ff000)",
       Bytes(Reply(0, 1, sizeof(info))) + Bytes(info)},
      {"reply_error", "AttachReply NOT_FOUND (5) with its message",
       Bytes(Reply(5, 0, static_cast<uint32_t>(why.size()))) + why},
  };
}

}  // namespace

std::string Token() { return Run(0x10, 16); }
std::string GpuUuid() { return Run(0xa0, 16); }
std::string IpcHandle() { return Run(0xc0, 64); }

std::vector<Frame> Frames() {
  std::vector<Frame> frames = Requests();
  for (Frame& f : Replies()) frames.push_back(std::move(f));
  return frames;
}

std::string Render(const std::vector<Frame>& frames) {
  std::string out =
      "# Golden data-socket frames (common/data_protocol.h), little-endian, written by\n"
      "# golden_frames_write from the protocol's structs (tests/conformance/golden_frames.cc).\n"
      "# Pinned by golden_frames_test (the structs, the C++ client) and\n"
      "# test_golden_frames.py (the Python client). Lines: NAME HEX.\n";
  for (const Frame& f : frames) {
    absl::StrAppend(&out, "\n# ", f.comment, "\n", f.name, " ", absl::BytesToHexString(f.bytes),
                    "\n");
  }
  return out;
}

absl::StatusOr<std::map<std::string, std::string>> Parse(const std::string& text) {
  std::map<std::string, std::string> out;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    std::vector<absl::string_view> parts = absl::StrSplit(line, ' ');
    if (parts.size() != 2 || parts[1].size() % 2 != 0) {
      return absl::InvalidArgumentError(absl::StrCat("bad golden frame line: ", line));
    }
    out[std::string(parts[0])] = absl::HexStringToBytes(parts[1]);
  }
  return out;
}

}  // namespace weightd::golden
