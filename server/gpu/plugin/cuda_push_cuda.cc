// The CUDA plugin's push and export (cuda_plugin.h; the daemon's side is
// cuda_push_writer.h): each runs a PushJob the daemon planned (push_job.h)
// in three steps — map the destination, copy-or-cast every piece on the
// job's streams, synchronize — and then releases what it set up. The
// driver API (VMM import and mapping) is reached through the runtime's
// cudaGetDriverEntryPoint-ByVersion, never by linking libcuda.so.1, so this
// daemon still starts where there is no driver.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/kernels/cuda/cuda_cast.h"
#include "common/status_macros.h"
#include "server/gpu/cuda_errors.h"
#include "server/gpu/cuda_plugin.h"
#include "server/push/push_job.h"

namespace weightd {
namespace {

// What each device's default memory pool (cudaMallocAsync: the pushes'
// cast scratch and merge factors) keeps after a push instead of handing it
// back to the driver at the next synchronization (the default threshold,
// 0): four pushes' scratch on both streams (the daemon plans a CUDA push
// on 2 streams with 32 MiB of scratch each: kCudaPushPlan in
// cuda_push_writer.cc), so back-to-back pushes do not allocate again;
// beyond it the pool trims itself.
constexpr uint64_t kPoolKeepBytes = 4 * 2 * (uint64_t{32} << 20);

// cuda_errors.h's numbers are CUDA's, in the runtime and the driver.
#define WD_SAME_CODE(ours, runtime, driver)                                  \
  static_assert(static_cast<int>(runtime) == ours && static_cast<int>(driver) == ours, \
                #runtime)
WD_SAME_CODE(kCudaEccUncorrectable, cudaErrorECCUncorrectable, CUDA_ERROR_ECC_UNCORRECTABLE);
WD_SAME_CODE(kCudaNvlinkUncorrectable, cudaErrorNvlinkUncorrectable,
             CUDA_ERROR_NVLINK_UNCORRECTABLE);
WD_SAME_CODE(kCudaContained, cudaErrorContained, CUDA_ERROR_CONTAINED);
WD_SAME_CODE(kCudaIllegalAddress, cudaErrorIllegalAddress, CUDA_ERROR_ILLEGAL_ADDRESS);
WD_SAME_CODE(kCudaLaunchTimeout, cudaErrorLaunchTimeout, CUDA_ERROR_LAUNCH_TIMEOUT);
WD_SAME_CODE(kCudaAssert, cudaErrorAssert, CUDA_ERROR_ASSERT);
WD_SAME_CODE(kCudaHardwareStackError, cudaErrorHardwareStackError,
             CUDA_ERROR_HARDWARE_STACK_ERROR);
WD_SAME_CODE(kCudaIllegalInstruction, cudaErrorIllegalInstruction,
             CUDA_ERROR_ILLEGAL_INSTRUCTION);
WD_SAME_CODE(kCudaMisalignedAddress, cudaErrorMisalignedAddress, CUDA_ERROR_MISALIGNED_ADDRESS);
WD_SAME_CODE(kCudaInvalidAddressSpace, cudaErrorInvalidAddressSpace,
             CUDA_ERROR_INVALID_ADDRESS_SPACE);
WD_SAME_CODE(kCudaInvalidPc, cudaErrorInvalidPc, CUDA_ERROR_INVALID_PC);
WD_SAME_CODE(kCudaLaunchFailure, cudaErrorLaunchFailure, CUDA_ERROR_LAUNCH_FAILED);
WD_SAME_CODE(kCudaTensorMemoryLeak, cudaErrorTensorMemoryLeak, CUDA_ERROR_TENSOR_MEMORY_LEAK);
WD_SAME_CODE(kCudaMpsClientTerminated, cudaErrorMpsClientTerminated,
             CUDA_ERROR_MPS_CLIENT_TERMINATED);
WD_SAME_CODE(kCudaExternalDevice, cudaErrorExternalDevice, CUDA_ERROR_EXTERNAL_DEVICE);
#undef WD_SAME_CODE

// The daemon's LogEvent (set_event_sink); null until it is set.
std::atomic<CudaPluginEventSink> event_sink{nullptr};

void Event(LogLevel level, absl::string_view event,
           const std::vector<std::pair<std::string, std::string>>& fields) {
  if (CudaPluginEventSink sink = event_sink.load(); sink != nullptr) sink(level, event, fields);
}

// The first sticky error (cuda_errors.h) met by the API call running on
// this thread, for its caller's `sticky_error`: every error reported below
// goes through RuntimeError or DriverError, which note it.
thread_local int sticky_seen = 0;

void NoteIfSticky(int code) {
  if (sticky_seen == 0 && IsStickyCudaError(code)) sticky_seen = code;
}

struct DriverApi {
  decltype(&::cuMemImportFromShareableHandle) import_handle = nullptr;
  decltype(&::cuMemGetAllocationPropertiesFromHandle) properties = nullptr;
  decltype(&::cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&::cuMemAddressReserve) reserve = nullptr;
  decltype(&::cuMemAddressFree) free_address = nullptr;
  decltype(&::cuMemMap) map = nullptr;
  decltype(&::cuMemUnmap) unmap = nullptr;
  decltype(&::cuMemSetAccess) set_access = nullptr;
  decltype(&::cuMemRelease) release = nullptr;
  decltype(&::cuMemGetAddressRange) address_range = nullptr;
  decltype(&::cuPointerGetAttribute) pointer_attribute = nullptr;
  decltype(&::cuGetErrorString) error_string = nullptr;
  decltype(&::cuMemCreate) create = nullptr;
  decltype(&::cuMemExportToShareableHandle) export_handle = nullptr;
  absl::Status status;
};

template <typename F>
absl::Status Resolve(const char* name, F* fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  cudaError_t err = cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found);
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || p == nullptr) {
    (void)cudaGetLastError();
    return absl::UnavailableError(absl::StrCat("the CUDA driver has no ", name, " (",
                                               cudaGetErrorString(err), ")"));
  }
  *fn = reinterpret_cast<F>(p);
  return absl::OkStatus();
}

const DriverApi& Driver() {
  static const DriverApi api = [] {
    DriverApi d;
    for (absl::Status s :
         {Resolve("cuMemImportFromShareableHandle", &d.import_handle),
          Resolve("cuMemGetAllocationPropertiesFromHandle", &d.properties),
          Resolve("cuMemGetAllocationGranularity", &d.granularity),
          Resolve("cuMemAddressReserve", &d.reserve), Resolve("cuMemAddressFree", &d.free_address),
          Resolve("cuMemMap", &d.map), Resolve("cuMemUnmap", &d.unmap),
          Resolve("cuMemSetAccess", &d.set_access), Resolve("cuMemRelease", &d.release),
          Resolve("cuMemGetAddressRange", &d.address_range),
          Resolve("cuPointerGetAttribute", &d.pointer_attribute),
          Resolve("cuGetErrorString", &d.error_string), Resolve("cuMemCreate", &d.create),
          Resolve("cuMemExportToShareableHandle", &d.export_handle)}) {
      if (!s.ok() && d.status.ok()) d.status = s;
    }
    return d;
  }();
  return api;
}

std::string DriverError(const DriverApi& d, CUresult r) {
  NoteIfSticky(static_cast<int>(r));
  const char* text = nullptr;
  if (d.error_string != nullptr) d.error_string(r, &text);
  return absl::StrCat(text != nullptr ? text : "CUDA driver error", " (", static_cast<int>(r), ")");
}

absl::Status RuntimeError(cudaError_t err, absl::string_view what) {
  NoteIfSticky(static_cast<int>(err));
  (void)cudaGetLastError();
  return absl::UnavailableError(
      absl::StrCat(what, ": ", cudaGetErrorName(err), ": ", cudaGetErrorString(err)));
}

// Undoes what was set up, in reverse order, however the push ends; every
// step's result is checked, and a failure is logged ("cuda_release_failed":
// after a sticky error every release fails, and what it held stays held by
// the dead context until the process exits).
class Cleanup {
 public:
  explicit Cleanup(std::string gpu) : gpu_(std::move(gpu)) {}
  ~Cleanup() {
    for (auto it = steps_.rbegin(); it != steps_.rend(); ++it) {
      if (std::string error = it->second(); !error.empty()) {
        Event(LogLevel::kWarning, "cuda_release_failed",
              {{"gpu", gpu_}, {"what", it->first}, {"error", error}});
      }
    }
  }
  Cleanup(const Cleanup&) = delete;
  Cleanup& operator=(const Cleanup&) = delete;
  // `step` returns "" or what went wrong.
  void Add(std::string what, std::function<std::string()> step) {
    steps_.emplace_back(std::move(what), std::move(step));
  }
  void AddRuntime(std::string what, std::function<cudaError_t()> step) {
    Add(std::move(what), [step = std::move(step)]() -> std::string {
      cudaError_t err = step();
      if (err == cudaSuccess) return "";
      NoteIfSticky(static_cast<int>(err));
      (void)cudaGetLastError();
      return absl::StrCat(cudaGetErrorName(err), ": ", cudaGetErrorString(err));
    });
  }
  void AddDriver(const DriverApi& d, std::string what, std::function<CUresult()> step) {
    Add(std::move(what), [&d, step = std::move(step)]() -> std::string {
      CUresult r = step();
      return r == CUDA_SUCCESS ? std::string() : DriverError(d, r);
    });
  }

 private:
  const std::string gpu_;
  std::vector<std::pair<std::string, std::function<std::string()>>> steps_;
};

// Selects `gpu` on this thread and, the first time, bounds its default
// memory pool's cache (kPoolKeepBytes).
absl::Status UseDevice(const GpuDevice& gpu) {
  if (cudaError_t err = cudaSetDevice(gpu.ordinal); err != cudaSuccess) {
    return RuntimeError(err, absl::StrCat("selecting ", gpu.uuid));
  }
  static std::mutex mu;
  static std::vector<int> prepared;
  std::lock_guard<std::mutex> lock(mu);
  if (std::find(prepared.begin(), prepared.end(), gpu.ordinal) != prepared.end()) {
    return absl::OkStatus();
  }
  prepared.push_back(gpu.ordinal);
  cudaMemPool_t pool = nullptr;
  cudaError_t err = cudaDeviceGetDefaultMemPool(&pool, gpu.ordinal);
  uint64_t keep = kPoolKeepBytes;
  if (err == cudaSuccess) err = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
  // Not fatal: pushes still run, allocating their scratch each time.
  Event(err == cudaSuccess ? LogLevel::kInfo : LogLevel::kWarning, "gpu_memory_pool",
        {{"gpu", gpu.uuid},
         {"release_threshold_bytes", absl::StrCat(kPoolKeepBytes)},
         {"error", err == cudaSuccess ? std::string()
                                      : RuntimeError(err, "cudaMemPoolSetAttribute").ToString()}});
  return absl::OkStatus();
}

// The device side of one push or export: kStreams-many streams (the job's),
// a cast scratch buffer per stream that casts, each merge's terms and
// factors in device memory. Everything is released by `cleanup`, in reverse
// order, once the caller is done.
struct DeviceCopies {
  std::vector<cudaStream_t> streams;
  std::vector<void*> scratch;                // per stream; null where nothing casts
  std::vector<const MergeTerm*> merge_terms;  // per PushJob::merges entry, device memory
};

absl::Status CreateStreams(int count, Cleanup& cleanup, DeviceCopies* device) {
  for (int s = 0; s < count; ++s) {
    cudaStream_t stream = nullptr;
    if (cudaError_t err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
        err != cudaSuccess) {
      return RuntimeError(err, "creating a copy stream");
    }
    device->streams.push_back(stream);
    cleanup.AddRuntime("a copy stream", [stream] { return cudaStreamDestroy(stream); });
  }
  return absl::OkStatus();
}

// A cast's source goes to a scratch buffer of its stream (raw bytes, from
// pinned memory where the checkpoint is pinned), and the kernel converts it
// into the destination on the same stream: the next piece's copy into that
// scratch waits for the kernel, in stream order.
absl::Status AllocateScratch(const PushJob& job, Cleanup& cleanup, DeviceCopies* device) {
  device->scratch.assign(device->streams.size(), nullptr);
  for (const PushJobCopy& copy : job.copies) {
    void*& scratch = device->scratch[static_cast<size_t>(copy.stream)];
    if (!copy.cast || scratch != nullptr) continue;
    // Stream-ordered (cudaMallocAsync): freeing it does not wait for the
    // whole device, so concurrent pushes do not stall each other.
    cudaStream_t stream = device->streams[static_cast<size_t>(copy.stream)];
    if (cudaError_t err = cudaMallocAsync(&scratch, job.max_cast_bytes, stream);
        err != cudaSuccess) {
      return RuntimeError(err, absl::StrCat("allocating ", job.max_cast_bytes,
                                            " bytes of GPU scratch for the push's casts"));
    }
    cleanup.AddRuntime("the push's cast scratch",
                       [p = scratch, stream] { return cudaFreeAsync(p, stream); });
  }
  return absl::OkStatus();
}

// One merge's terms and the arrays they point to, in device memory (LoRA
// factors are small; a dense patch sends its box's rows), on `stream`.
absl::StatusOr<const MergeTerm*> UploadMerge(const PushJobMerge& merge, cudaStream_t stream,
                                             Cleanup& cleanup) {
  std::vector<MergeTerm> terms(merge.terms, merge.terms + merge.num_terms);
  uint64_t floats = 0;
  for (const MergeTerm& t : terms) floats += t.x_len + t.y_len + t.v_len;
  const uint64_t terms_bytes = (terms.size() * sizeof(MergeTerm) + 255) / 256 * 256;
  void* arena = nullptr;
  if (cudaError_t err = cudaMallocAsync(&arena, terms_bytes + floats * sizeof(float), stream);
      err != cudaSuccess) {
    return RuntimeError(err, "allocating GPU memory for a merge's LoRA factors");
  }
  // Freed once every stream is synchronized (the push's end), in order
  // after its uses on `stream`.
  cleanup.AddRuntime("a merge's factors on the GPU",
                     [arena, stream] { return cudaFreeAsync(arena, stream); });
  float* at = reinterpret_cast<float*>(static_cast<uint8_t*>(arena) + terms_bytes);
  auto upload = [&at, stream](const float*& p, uint64_t n) -> cudaError_t {
    if (p == nullptr || n == 0) return cudaSuccess;
    cudaError_t err = cudaMemcpyAsync(at, p, n * sizeof(float), cudaMemcpyHostToDevice, stream);
    p = at;
    at += n;
    return err;
  };
  for (MergeTerm& t : terms) {
    for (cudaError_t err : {upload(t.x, t.x_len), upload(t.y, t.y_len), upload(t.v, t.v_len)}) {
      if (err != cudaSuccess) return RuntimeError(err, "copying a merge's factors to the GPU");
    }
  }
  if (cudaError_t err = cudaMemcpyAsync(arena, terms.data(), terms.size() * sizeof(MergeTerm),
                                        cudaMemcpyHostToDevice, stream);
      err != cudaSuccess) {
    return RuntimeError(err, "copying a merge's terms to the GPU");
  }
  // `terms` is pageable and goes out of scope: its copy must be done (a
  // pageable copy may return before its DMA ends), and the kernels of the
  // other stream must see the factors.
  if (cudaError_t err = cudaStreamSynchronize(stream); err != cudaSuccess) {
    return RuntimeError(err, "copying a merge's factors to the GPU");
  }
  return static_cast<const MergeTerm*>(arena);
}

absl::Status UploadMerges(const PushJob& job, Cleanup& cleanup, DeviceCopies* device) {
  for (const PushJobMerge& merge : job.merges) {
    WD_ASSIGN_OR_RETURN(const MergeTerm* terms,
                        UploadMerge(merge, device->streams.front(), cleanup));
    device->merge_terms.push_back(terms);
  }
  return absl::OkStatus();
}

// Queues one piece on its stream: a raw copy into the destination, or a
// copy into the stream's scratch and a cast (or merge) kernel from there.
absl::Status CopyOrCast(const PushJob& job, const PushJobCopy& copy, uint8_t* base,
                        const DeviceCopies& device) {
  cudaStream_t stream = device.streams[static_cast<size_t>(copy.stream)];
  void* to = copy.cast ? device.scratch[static_cast<size_t>(copy.stream)]
                       : base + copy.dst_offset;
  if (cudaError_t err = cudaMemcpyAsync(to, copy.src, copy.length, cudaMemcpyHostToDevice, stream);
      err != cudaSuccess) {
    return RuntimeError(err, "copying to the push's GPU allocation");
  }
  if (!copy.cast) return absl::OkStatus();
  const size_t count = copy.length / DTypeSize(copy.src_dtype);
  if (copy.merge >= 0) {
    const PushJobMerge& merge = job.merges[static_cast<size_t>(copy.merge)];
    return MergeBufferCuda(copy.src_dtype, to, copy.dst_dtype, base + copy.dst_offset, count,
                           copy.first_element, merge.row_begin, merge.cols,
                           device.merge_terms[static_cast<size_t>(copy.merge)],
                           static_cast<int>(merge.num_terms), stream);
  }
  return CastBufferCuda(copy.src_dtype, to, copy.dst_dtype, base + copy.dst_offset, count, stream);
}

// Waits for every stream: nothing is unmapped while a copy may still run,
// and the answer waits for every byte. Returns `status`, or the first
// failure to synchronize when `status` is OK.
absl::Status SyncStreams(const DeviceCopies& device, absl::Status status) {
  for (cudaStream_t stream : device.streams) {
    if (cudaError_t err = cudaStreamSynchronize(stream); err != cudaSuccess && status.ok()) {
      status = RuntimeError(err, "waiting for the push's copies");
    }
  }
  return status;
}

// Writes `job` into device memory at `base` (mapped, current device): raw
// copies on job.streams streams, casts and merges by kernels from
// per-stream scratch; once the copies are queued, synchronized before it
// returns, whatever happened.
absl::Status CopyIntoDevice(const PushJob& job, uint8_t* base, const GpuDevice& gpu,
                            const std::atomic<bool>* cancel) {
  Cleanup cleanup(gpu.uuid);
  DeviceCopies device;
  WD_RETURN_IF_ERROR(CreateStreams(std::max(job.streams, 1), cleanup, &device));
  WD_RETURN_IF_ERROR(AllocateScratch(job, cleanup, &device));
  WD_RETURN_IF_ERROR(UploadMerges(job, cleanup, &device));
  absl::Status status;
  for (const PushJobCopy& copy : job.copies) {
    if (cancel != nullptr && cancel->load(std::memory_order_relaxed)) {
      status = absl::UnavailableError("the daemon is shutting down; the push was cut short");
      break;
    }
    status = CopyOrCast(job, copy, base, device);
    if (!status.ok()) break;
  }
  return SyncStreams(device, std::move(status));
}

// Imports the client's VMM allocation from its fd and checks it is device
// memory whose size is a multiple of its granularity on `gpu`.
absl::StatusOr<CUmemGenericAllocationHandle> ImportVmm(const DriverApi& d,
                                                        const CudaPushTarget& target, int fd,
                                                        const GpuDevice& gpu, Cleanup& cleanup) {
  CUmemGenericAllocationHandle handle{};
  CUresult r = d.import_handle(&handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                               CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (r != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the push's GPU allocation cannot be imported from its fd: ", DriverError(d, r)));
  }
  cleanup.AddDriver(d, "the push's imported allocation (cuMemRelease)",
                    [&d, handle] { return d.release(handle); });
  CUmemAllocationProp prop{};
  if ((r = d.properties(&prop, handle)) != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(
        absl::StrCat("the push's GPU allocation: ", DriverError(d, r)));
  }
  // Which device it is on is asked once it is mapped (MapVmm): the id in
  // its properties may be the exporting process's ordinal, which means
  // nothing here (CUDA_VISIBLE_DEVICES differs between containers).
  if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
    return absl::InvalidArgumentError(
        absl::StrCat("the push's allocation is not device memory (location type ",
                     static_cast<int>(prop.location.type), ")"));
  }
  // The granularity is asked for the GPU the push maps it on, by this
  // process's ordinal (the exporter's id means nothing here).
  prop.location.id = gpu.ordinal;
  size_t granularity = 0;
  if ((r = d.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM)) !=
          CUDA_SUCCESS ||
      granularity == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the push's GPU allocation: no allocation granularity (",
                     r != CUDA_SUCCESS ? DriverError(d, r) : std::string("0"), ")"));
  }
  if (target.size % granularity != 0) {
    return absl::InvalidArgumentError(absl::StrCat("the push names an allocation of ", target.size,
                                                   " bytes, not a multiple of its granularity (",
                                                   granularity, ")"));
  }
  return handle;
}

// INVALID_ARGUMENT unless the device memory at `at` is on `gpu` (this
// process's ordinal); `what` names it in the message.
absl::Status CheckOnGpu(const DriverApi& d, CUdeviceptr at, const GpuDevice& gpu,
                        absl::string_view what) {
  int ordinal = -1;
  const CUresult r = d.pointer_attribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, at);
  if (r == CUDA_SUCCESS && ordinal == gpu.ordinal) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      what, " is not on ", gpu.uuid, " (",
      r != CUDA_SUCCESS ? DriverError(d, r) : absl::StrCat("device ", ordinal, " here"), ")"));
}

// Maps the imported allocation into the daemon's address space on `gpu`,
// readable and writable, and checks that it is on `gpu`.
absl::StatusOr<uint8_t*> MapVmm(const DriverApi& d, CUmemGenericAllocationHandle handle,
                                uint64_t size, const GpuDevice& gpu, Cleanup& cleanup) {
  CUdeviceptr va = 0;
  CUresult r = d.reserve(&va, size, 0, 0, 0);
  if (r != CUDA_SUCCESS) {
    return absl::UnavailableError(
        absl::StrCat("reserving ", size, " bytes of GPU address space: ", DriverError(d, r)));
  }
  cleanup.AddDriver(d, "the push's GPU address range (cuMemAddressFree)",
                    [&d, va, size] { return d.free_address(va, size); });
  if ((r = d.map(va, size, 0, handle, 0)) != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(
        absl::StrCat("mapping the push's GPU allocation (", size,
                     " bytes, as the request says): ", DriverError(d, r)));
  }
  cleanup.AddDriver(d, "the push's mapping (cuMemUnmap)",
                    [&d, va, size] { return d.unmap(va, size); });
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = gpu.ordinal;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if ((r = d.set_access(va, size, &access, 1)) != CUDA_SUCCESS) {
    return absl::UnavailableError(absl::StrCat(
        "granting the daemon access to the push's allocation: ", DriverError(d, r)));
  }
  WD_RETURN_IF_ERROR(CheckOnGpu(d, va, gpu, "the push's allocation"));
  return reinterpret_cast<uint8_t*>(va);
}

// Opens a legacy IPC handle and checks the allocation's real size and
// device against what the push names.
absl::StatusOr<uint8_t*> OpenLegacyIpc(const DriverApi& d, const CudaPushTarget& target,
                                       const GpuDevice& gpu, Cleanup& cleanup) {
  cudaIpcMemHandle_t handle;
  static_assert(sizeof(handle) == sizeof(target.ipc_handle));
  std::memcpy(&handle, target.ipc_handle, sizeof(handle));
  void* p = nullptr;
  if (cudaError_t err = cudaIpcOpenMemHandle(&p, handle, cudaIpcMemLazyEnablePeerAccess);
      err != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::InvalidArgumentError(absl::StrCat(
        "the push's legacy IPC handle cannot be opened (", cudaGetErrorString(err),
        "): legacy handles need the client in the daemon's PID namespace; use a VMM fd"));
  }
  cleanup.AddRuntime("the push's legacy IPC handle (cudaIpcCloseMemHandle)",
                     [p] { return cudaIpcCloseMemHandle(p); });
  // A copy past the allocation would be a sticky error in the daemon's
  // context: check the size the client claims against the real one.
  const CUdeviceptr at = reinterpret_cast<CUdeviceptr>(p);
  CUdeviceptr range_base = 0;
  size_t range_size = 0;
  CUresult r = d.address_range(&range_base, &range_size, at);
  if (r != CUDA_SUCCESS || at < range_base || range_size < at - range_base ||
      target.size > range_size - (at - range_base)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the push names an allocation of ", target.size, " bytes; the handle's has ",
        r == CUDA_SUCCESS ? absl::StrCat(range_size - (at - range_base)) : DriverError(d, r)));
  }
  // cudaIpcOpenMemHandle opens an allocation on whichever device it is.
  WD_RETURN_IF_ERROR(CheckOnGpu(d, at, gpu, "the push's legacy handle"));
  return static_cast<uint8_t*>(p);
}

// A checked CUDA push: maps the client's allocation (map), copies the job
// into it (copy-or-cast, synchronized), then undoes the mapping in reverse
// (cleanup).
absl::Status PushToCudaWithCuda(const PushJob& job, const CudaPushTarget& target, int fd,
                                const GpuDevice& gpu, const std::atomic<bool>* cancel) {
  WD_RETURN_IF_ERROR(UseDevice(gpu));
  const DriverApi& d = Driver();
  if (!d.status.ok()) return d.status;
  Cleanup cleanup(gpu.uuid);
  uint8_t* base = nullptr;
  if (target.handle_kind == kCudaVmmPosixFd) {
    WD_ASSIGN_OR_RETURN(CUmemGenericAllocationHandle handle,
                        ImportVmm(d, target, fd, gpu, cleanup));
    WD_ASSIGN_OR_RETURN(base, MapVmm(d, handle, target.size, gpu, cleanup));
  } else {
    WD_ASSIGN_OR_RETURN(base, OpenLegacyIpc(d, target, gpu, cleanup));
  }
  return CopyIntoDevice(job, base, gpu, cancel);
}

}  // namespace

// An export's allocation, for ExportReleaseWithCuda.
struct ExportHandle {
  CUmemGenericAllocationHandle handle{};
  int ordinal = 0;
};

absl::Status ExportFillWithCuda(const PushJob& job, const GpuDevice& gpu,
                                const std::atomic<bool>* cancel, int* fd, uint64_t* size_out,
                                void** handle_out) {
  WD_RETURN_IF_ERROR(UseDevice(gpu));
  const DriverApi& d = Driver();
  if (!d.status.ok()) return d.status;
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = gpu.ordinal;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t granularity = 0;
  CUresult r = d.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r != CUDA_SUCCESS || granularity == 0) {
    return absl::UnavailableError(absl::StrCat(
        "the allocation granularity of ", gpu.uuid, ": ",
        r != CUDA_SUCCESS ? DriverError(d, r) : std::string("0")));
  }
  const uint64_t size =
      std::max<uint64_t>(1, (job.size + granularity - 1) / granularity) * granularity;
  CUmemGenericAllocationHandle handle{};
  if ((r = d.create(&handle, size, &prop, 0)) != CUDA_SUCCESS) {
    return (r == CUDA_ERROR_OUT_OF_MEMORY ? absl::ResourceExhaustedError : absl::UnavailableError)(
        absl::StrCat("allocating ", size, " bytes on ", gpu.uuid, " for an export: ",
                     DriverError(d, r)));
  }
  bool keep = false;
  Cleanup cleanup(gpu.uuid);  // unmaps the daemon's view; releases the handle unless kept
  cleanup.AddDriver(d, "an export's allocation (cuMemRelease)", [&d, handle, &keep] {
    return keep ? CUDA_SUCCESS : d.release(handle);
  });
  CUdeviceptr va = 0;
  if ((r = d.reserve(&va, size, 0, 0, 0)) != CUDA_SUCCESS) {
    return absl::UnavailableError(
        absl::StrCat("reserving ", size, " bytes of GPU address space: ", DriverError(d, r)));
  }
  cleanup.AddDriver(d, "an export's address range (cuMemAddressFree)",
                    [&d, va, size] { return d.free_address(va, size); });
  if ((r = d.map(va, size, 0, handle, 0)) != CUDA_SUCCESS) {
    return absl::UnavailableError(absl::StrCat("mapping an export: ", DriverError(d, r)));
  }
  cleanup.AddDriver(d, "an export's mapping in the daemon (cuMemUnmap)",
                    [&d, va, size] { return d.unmap(va, size); });
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = gpu.ordinal;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if ((r = d.set_access(va, size, &access, 1)) != CUDA_SUCCESS) {
    return absl::UnavailableError(absl::StrCat("granting access to an export: ", DriverError(d, r)));
  }
  WD_RETURN_IF_ERROR(CopyIntoDevice(job, reinterpret_cast<uint8_t*>(va), gpu, cancel));
  int exported = -1;
  if ((r = d.export_handle(&exported, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)) !=
      CUDA_SUCCESS) {
    return absl::UnavailableError(absl::StrCat("exporting ", gpu.uuid, " memory as an fd: ",
                                               DriverError(d, r)));
  }
  keep = true;
  *fd = exported;
  *size_out = size;
  *handle_out = new ExportHandle{handle, gpu.ordinal};  // deleted by ExportReleaseWithCuda
  return absl::OkStatus();
}

absl::Status ExportReleaseWithCuda(void* p) {
  std::unique_ptr<ExportHandle> h(static_cast<ExportHandle*>(p));
  const DriverApi& d = Driver();
  if (!d.status.ok()) return d.status;
  // With its device current, as every call on it.
  if (cudaError_t err = cudaSetDevice(h->ordinal); err != cudaSuccess) {
    return RuntimeError(err, absl::StrCat("selecting device ", h->ordinal,
                                          " to release an export"));
  }
  if (CUresult r = d.release(h->handle); r != CUDA_SUCCESS) {
    return absl::UnavailableError(
        absl::StrCat("releasing an export (cuMemRelease): ", DriverError(d, r)));
  }
  return absl::OkStatus();
}

// The API's entry points: each reports the sticky error it met.
absl::Status PushEntry(const PushJob& job, const CudaPushTarget& target, int fd,
                       const GpuDevice& gpu, const std::atomic<bool>* cancel, int* sticky_error) {
  sticky_seen = 0;
  absl::Status s = PushToCudaWithCuda(job, target, fd, gpu, cancel);
  if (sticky_error != nullptr) *sticky_error = s.ok() ? 0 : sticky_seen;
  return s;
}

absl::Status ExportEntry(const PushJob& job, const GpuDevice& gpu,
                         const std::atomic<bool>* cancel, int* fd, uint64_t* size, void** handle,
                         int* sticky_error) {
  sticky_seen = 0;
  absl::Status s = ExportFillWithCuda(job, gpu, cancel, fd, size, handle);
  if (sticky_error != nullptr) *sticky_error = s.ok() ? 0 : sticky_seen;
  return s;
}

}  // namespace weightd

namespace weightd {
GpuInventory DiscoverGpusWithCuda();

void SetEventSink(CudaPluginEventSink sink) { event_sink.store(sink); }

// Portable: one registration for every GPU's context. `ordinal`'s device
// is made current first (the registration is made in its context).
absl::Status PinHostMemory(const void* data, size_t size, bool read_only, int ordinal) {
  if (cudaError_t err = cudaSetDevice(ordinal); err != cudaSuccess) {
    return RuntimeError(err, absl::StrCat("selecting device ", ordinal, " to pin host memory"));
  }
  unsigned flags = cudaHostRegisterPortable;
  if (read_only) flags |= cudaHostRegisterReadOnly;
  cudaError_t err = cudaHostRegister(const_cast<void*>(data), size, flags);
  if (err != cudaSuccess) {
    return RuntimeError(err, read_only ? "cudaHostRegister (portable, read-only)"
                                       : "cudaHostRegister (portable)");
  }
  return absl::OkStatus();
}

absl::Status UnpinHostMemory(const void* data, int ordinal) {
  if (cudaError_t err = cudaSetDevice(ordinal); err != cudaSuccess) {
    return RuntimeError(err, absl::StrCat("selecting device ", ordinal, " to unpin host memory"));
  }
  if (cudaError_t err = cudaHostUnregister(const_cast<void*>(data)); err != cudaSuccess) {
    return RuntimeError(err, "cudaHostUnregister");
  }
  return absl::OkStatus();
}
}  // namespace weightd

extern "C" __attribute__((visibility("default"))) const weightd::CudaPluginApi*
weightd_cuda_plugin_api() {
  static const weightd::CudaPluginApi api{weightd::kCudaPluginAbi,
                                          &weightd::SetEventSink,
                                          &weightd::DiscoverGpusWithCuda,
                                          &weightd::PushEntry,
                                          &weightd::PinHostMemory,
                                          &weightd::UnpinHostMemory,
                                          &weightd::ExportEntry,
                                          &weightd::ExportReleaseWithCuda};
  return &api;
}
