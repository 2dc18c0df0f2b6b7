// A CUDA plugin without CUDA, for tests: the daemon loads it like the real
// one (WEIGHTD_CUDA_PLUGIN, cuda_plugin.h) and so runs its GPU paths --
// pinning, CUDA pushes and exports, sticky errors -- on a machine with no
// GPU. The counterpart of the fake libcuda the client tests build
// (tests/integration/test_cuda_client.py), on the daemon's side of the
// plugin seam. Never shipped (built into build/tests).
//
// Configured by the environment, read when the daemon loads it:
//   WEIGHTD_FAKE_GPUS      the GPUs, a comma-separated list of kinds:
//                            h100   an x86 H100: registers host memory, but
//                                   not read-only memory
//                                   (cudaDevAttrHostRegisterReadOnlySupported
//                                   0), no pageable memory access;
//                            gh200  a Grace Hopper: both supported.
//                          GPU i's UUID is GPU-fa4e0000-0000-0000-0000-0000000000ii.
//   WEIGHTD_FAKE_CUDA_DIR  a directory: every call is appended to calls.log
//                          there, one line each; a file sticky-<UUID> there
//                          makes the next push or export on that GPU fail
//                          with cudaErrorIllegalAddress (sticky), as a kernel
//                          gone wrong would.
//
// What it models of the driver: cudaHostRegister refuses the read-only
// flag on a GPU without read-only registration (cudaErrorNotSupported), a
// plain registration of memory not mapped writable (cudaErrorInvalidValue:
// the driver pins for writing), overlapping registrations and unregistering
// what is not registered; calls.log records the mapping's permissions at
// each pin and unpin, so a test sees which mapping was registered and that
// it was still mapped when unregistered. A push "imports" the client's fd
// (a memfd standing in for the VMM allocation) and writes every piece of
// its PushJob there at its offset, casting on the CPU (no merges:
// UNIMPLEMENTED); an export fills a memfd of its own.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "server/kernels/cast.h"
#include "common/dtype.h"
#include "common/testing/maps.h"
#include "server/gpu/cuda_errors.h"
#include "server/gpu/cuda_plugin.h"
#include "server/push/push_job.h"

namespace weightd {
namespace {

struct FakeState {
  std::mutex mu;
  std::string dir;
  std::vector<GpuDevice> gpus;
  std::map<uintptr_t, size_t> registered;  // base -> size
};

FakeState& State() {
  static FakeState* const state = new FakeState();
  return *state;
}

void Record(const std::string& line) {
  FakeState& st = State();
  if (st.dir.empty()) return;
  std::lock_guard<std::mutex> lock(st.mu);
  std::ofstream(st.dir + "/calls.log", std::ios::app) << line << "\n";
}

absl::Status CudaError(int code, absl::string_view name, absl::string_view what) {
  return absl::UnavailableError(
      absl::StrCat(what, ": ", name, " (", code, ", the fake CUDA driver)"));
}

const GpuDevice* Find(int ordinal) {
  const FakeState& st = State();
  if (ordinal < 0 || static_cast<size_t>(ordinal) >= st.gpus.size()) return nullptr;
  return &st.gpus[static_cast<size_t>(ordinal)];
}

// Whether a sticky error was asked for on `gpu` (the file is consumed).
bool StickyAsked(const GpuDevice& gpu) {
  const FakeState& st = State();
  if (st.dir.empty()) return false;
  return ::unlink((st.dir + "/sticky-" + gpu.uuid).c_str()) == 0;
}

void SetEventSink(CudaPluginEventSink) {}

GpuInventory Discover() {
  FakeState& st = State();
  GpuInventory inv;
  inv.cuda_built = true;
  if (const char* dir = std::getenv("WEIGHTD_FAKE_CUDA_DIR"); dir != nullptr) st.dir = dir;
  const char* kinds = std::getenv("WEIGHTD_FAKE_GPUS");
  st.gpus.clear();
  for (absl::string_view kind : absl::StrSplit(kinds != nullptr ? kinds : "", ',',
                                               absl::SkipEmpty())) {
    GpuDevice d;
    d.ordinal = static_cast<int>(st.gpus.size());
    uint8_t uuid[16] = {0xfa, 0x4e};
    uuid[15] = static_cast<uint8_t>(d.ordinal);
    d.uuid = FormatGpuUuid(uuid);
    d.pci_bus_id = absl::StrCat("0000:", d.ordinal + 10, ":00.0");
    d.memory_bytes = uint64_t{80} << 30;
    d.compute_major = 9;
    d.host_register = true;
    if (kind == "h100") {
      d.name = "NVIDIA H100 80GB HBM3 (fake, x86)";
    } else if (kind == "gh200") {
      d.name = "NVIDIA GH200 480GB (fake)";
      d.host_register_read_only = true;
      d.pageable_memory_access = true;
    } else {
      inv.unavailable = absl::StrCat("WEIGHTD_FAKE_GPUS: unknown kind \"", kind, "\"");
      st.gpus.clear();
      return inv;
    }
    st.gpus.push_back(d);
  }
  inv.devices = st.gpus;
  if (inv.devices.empty()) inv.unavailable = "the fake CUDA plugin was given no GPU";
  Record(absl::StrCat("discover ", inv.devices.size()));
  return inv;
}

absl::Status Pin(const void* data, size_t size, bool read_only, int ordinal) {
  const GpuDevice* gpu = Find(ordinal);
  const std::string perms = MappingPerms(data, size);
  absl::Status s;
  if (gpu == nullptr) {
    s = CudaError(101, "cudaErrorInvalidDevice", "selecting the device to pin host memory");
  } else if (read_only && !gpu->host_register_read_only) {
    s = CudaError(801, "cudaErrorNotSupported", "cudaHostRegister (portable, read-only)");
  } else if (!read_only && (perms.size() < 2 || perms[1] != 'w')) {
    // The driver pins the pages for writing: a read-only mapping fails.
    s = CudaError(1, "cudaErrorInvalidValue", "cudaHostRegister (portable)");
  } else {
    FakeState& st = State();
    std::lock_guard<std::mutex> lock(st.mu);
    const auto lo = reinterpret_cast<uintptr_t>(data);
    for (const auto& [base, len] : st.registered) {
      if (lo < base + len && base < lo + size) {
        s = CudaError(712, "cudaErrorHostMemoryAlreadyRegistered", "cudaHostRegister");
      }
    }
    if (s.ok()) st.registered[lo] = size;
  }
  Record(absl::StrCat("pin addr=", reinterpret_cast<uintptr_t>(data), " size=", size,
                      " read_only=", read_only ? 1 : 0, " device=", ordinal, " perms=", perms,
                      " ", s.ok() ? "ok" : s.ToString()));
  return s;
}

absl::Status Unpin(const void* data, int ordinal) {
  FakeState& st = State();
  absl::Status s;
  size_t size = 0;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    auto it = st.registered.find(reinterpret_cast<uintptr_t>(data));
    if (it == st.registered.end()) {
      s = CudaError(713, "cudaErrorHostMemoryNotRegistered", "cudaHostUnregister");
    } else {
      size = it->second;
      st.registered.erase(it);
    }
  }
  if (Find(ordinal) == nullptr) {
    s = CudaError(101, "cudaErrorInvalidDevice", "selecting the device to unpin host memory");
  }
  // Still mapped, as it must be until unregistered.
  Record(absl::StrCat("unpin addr=", reinterpret_cast<uintptr_t>(data), " size=", size,
                      " device=", ordinal, " perms=", size > 0 ? MappingPerms(data, size) : "",
                      " ", s.ok() ? "ok" : s.ToString()));
  return s;
}

// Writes the job's pieces into `fd`, as the GPU copies would.
absl::Status Fill(const PushJob& job, int fd) {
  std::vector<uint8_t> cast;
  for (const PushJobCopy& copy : job.copies) {
    const uint8_t* src = copy.src;
    if (copy.cast) {
      if (copy.merge >= 0) return absl::UnimplementedError("the fake CUDA plugin merges nothing");
      const size_t count = copy.length / DTypeSize(copy.src_dtype);
      cast.resize(copy.dst_length);
      if (absl::Status s = CastBuffer(copy.src_dtype, src, copy.dst_dtype, cast.data(), count);
          !s.ok()) {
        return s;
      }
      src = cast.data();
    }
    for (uint64_t done = 0; done < copy.dst_length;) {
      ssize_t w = ::pwrite(fd, src + done, copy.dst_length - done,
                           static_cast<off_t>(copy.dst_offset + done));
      if (w <= 0) {
        return absl::InvalidArgumentError(absl::StrCat("the fake GPU allocation: pwrite: ",
                                                       std::strerror(errno)));
      }
      done += static_cast<uint64_t>(w);
    }
  }
  return absl::OkStatus();
}

absl::Status Push(const PushJob& job, const CudaPushTarget& target, int fd, const GpuDevice& gpu,
                  const std::atomic<bool>* cancel, int* sticky_error) {
  if (fd < 0) {
    return absl::InvalidArgumentError("the fake CUDA plugin imports VMM fds only");
  }
  absl::Status s;
  if (StickyAsked(gpu)) {
    *sticky_error = kCudaIllegalAddress;
    s = CudaError(kCudaIllegalAddress, "cudaErrorIllegalAddress",
                  "waiting for the push's copies");
  } else {
    s = Fill(job, fd);
  }
  // The imported allocation is released however the push ended.
  Record(absl::StrCat("push gpu=", gpu.uuid, " device=", gpu.ordinal, " bytes=", job.size, " ",
                      s.ok() ? "ok" : s.ToString()));
  Record(absl::StrCat("release gpu=", gpu.uuid, " what=imported-allocation"));
  return s;
}

struct FakeExport {
  int ordinal = 0;
};

absl::Status ExportFill(const PushJob& job, const GpuDevice& gpu, const std::atomic<bool>* cancel,
                        int* fd_out, uint64_t* size_out, void** handle_out, int* sticky_error) {
  if (StickyAsked(gpu)) {
    *sticky_error = kCudaIllegalAddress;
    absl::Status s = CudaError(kCudaIllegalAddress, "cudaErrorIllegalAddress",
                               "waiting for the push's copies");
    Record(absl::StrCat("export gpu=", gpu.uuid, " device=", gpu.ordinal, " ", s.ToString()));
    return s;
  }
  constexpr uint64_t kGranularity = uint64_t{2} << 20;
  const uint64_t size = std::max<uint64_t>(1, (job.size + kGranularity - 1) / kGranularity) *
                        kGranularity;
  int fd = ::memfd_create("fake-export", MFD_CLOEXEC);
  if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    if (fd >= 0) ::close(fd);
    return absl::ResourceExhaustedError("the fake GPU is out of memory");
  }
  if (absl::Status s = Fill(job, fd); !s.ok()) {
    ::close(fd);
    return s;
  }
  Record(absl::StrCat("export gpu=", gpu.uuid, " device=", gpu.ordinal, " size=", size, " ok"));
  *fd_out = fd;
  *size_out = size;
  *handle_out = new FakeExport{gpu.ordinal};
  return absl::OkStatus();
}

absl::Status ExportRelease(void* handle) {
  auto* h = static_cast<FakeExport*>(handle);
  Record(absl::StrCat("export_release device=", h->ordinal));
  delete h;
  return absl::OkStatus();
}

}  // namespace
}  // namespace weightd

extern "C" __attribute__((visibility("default"))) const weightd::CudaPluginApi*
weightd_cuda_plugin_api() {
  static const weightd::CudaPluginApi api{weightd::kCudaPluginAbi, &weightd::SetEventSink,
                                          &weightd::Discover,      &weightd::Push,
                                          &weightd::Pin,           &weightd::Unpin,
                                          &weightd::ExportFill,    &weightd::ExportRelease};
  return &api;
}
