#include "client/cuda/cuda_push.h"

#include <algorithm>
#include <memory>

#include "absl/strings/str_cat.h"
#include "client/cuda/cuda_driver.h"
#include "client/data_socket.h"
#include "common/data_protocol.h"
#include "common/fd.h"
#include "common/push_layout.h"
#include "common/status_macros.h"
#include "common/unix_socket.h"

namespace weightd {
namespace {

// One CUDA VMM allocation on a device, exportable as a POSIX fd and mapped
// read-write into this process, with the device's primary context retained
// and made current. What Create acquired the destructor releases, in the
// reverse order. Not thread-safe; owned by one fetch.
class CudaAllocation {
 public:
  // At least `bytes` (one granule at least, whole granules).
  static absl::StatusOr<std::unique_ptr<CudaAllocation>> Create(const CudaDriver& d, int device,
                                                                uint64_t bytes);
  ~CudaAllocation();
  CudaAllocation(const CudaAllocation&) = delete;
  CudaAllocation& operator=(const CudaAllocation&) = delete;

  const CUuuid& uuid() const { return uuid_; }
  uint64_t size() const { return size_; }
  CUdeviceptr va() const { return va_; }
  int fd() const { return fd_.get(); }  // the exported handle

 private:
  explicit CudaAllocation(const CudaDriver& d) : d_(d) {}
  // The primary context of `device`, retained and current.
  absl::Status Enter(int device);
  // The allocation, its exported fd, and its mapping.
  absl::Status Allocate(uint64_t bytes);

  // Constant after construction.
  const CudaDriver& d_;

  // Set by Create as each is acquired.
  CUdevice dev_ = 0;
  CUuuid uuid_{};
  bool ctx_retained_ = false;
  CUmemAllocationProp prop_{};
  uint64_t size_ = 0;
  bool created_ = false;
  CUmemGenericAllocationHandle handle_{};
  UniqueFd fd_;
  CUdeviceptr va_ = 0;
  bool mapped_ = false;
};

absl::StatusOr<std::unique_ptr<CudaAllocation>> CudaAllocation::Create(const CudaDriver& d,
                                                                       int device,
                                                                       uint64_t bytes) {
  auto a = std::unique_ptr<CudaAllocation>(new CudaAllocation(d));
  WD_RETURN_IF_ERROR(a->Enter(device));
  WD_RETURN_IF_ERROR(a->Allocate(bytes));
  return a;
}

absl::Status CudaAllocation::Enter(int device) {
  WD_RETURN_IF_ERROR(
      CudaCall(d_, d_.device_get(&dev_, device), absl::StrCat("CUDA device ", device)));
  WD_RETURN_IF_ERROR(CudaCall(d_, d_.device_uuid(&uuid_, dev_), "its UUID"));
  CUcontext ctx = nullptr;
  WD_RETURN_IF_ERROR(CudaCall(d_, d_.ctx_retain(&ctx, dev_), "its primary context"));
  ctx_retained_ = true;
  return CudaCall(d_, d_.ctx_set(ctx), "making it current");
}

absl::Status CudaAllocation::Allocate(uint64_t bytes) {
  prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop_.location.id = dev_;
  prop_.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t granularity = 0;
  WD_RETURN_IF_ERROR(CudaCall(
      d_, d_.granularity(&granularity, &prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM), "granularity"));
  size_ = std::max<uint64_t>(1, (bytes + granularity - 1) / granularity) * granularity;
  WD_RETURN_IF_ERROR(CudaCall(d_, d_.create(&handle_, size_, &prop_, 0),
                              absl::StrCat("allocating ", size_, " bytes on the GPU")));
  created_ = true;
  int exported = -1;
  WD_RETURN_IF_ERROR(CudaCall(
      d_, d_.export_handle(&exported, handle_, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
      "exporting the allocation"));
  fd_ = UniqueFd(exported);
  WD_RETURN_IF_ERROR(CudaCall(d_, d_.reserve(&va_, size_, 0, 0, 0), "reserving address space"));
  WD_RETURN_IF_ERROR(CudaCall(d_, d_.map(va_, size_, 0, handle_, 0), "mapping the allocation"));
  mapped_ = true;
  CUmemAccessDesc access{};
  access.location = prop_.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return CudaCall(d_, d_.set_access(va_, size_, &access, 1), "granting access");
}

CudaAllocation::~CudaAllocation() {
  fd_.Reset();
  if (mapped_) d_.unmap(va_, size_);
  if (va_ != 0) d_.free_address(va_, size_);
  if (created_) d_.release(handle_);
  if (ctx_retained_) d_.ctx_release(dev_);
}

// The WDC1 request for `resp`'s lease into `a` (default layout).
absl::StatusOr<std::string> CudaPushRequest(const v1::FetchResponse& resp,
                                            const CudaAllocation& a) {
  WD_ASSIGN_OR_RETURN(std::string request,
                      EncodeLeaseRequest(kCudaPushMagic, resp.lease_id(), resp.token()));
  uint8_t uuid[16];
  static_assert(sizeof(uuid) == sizeof(a.uuid().bytes));
  std::copy(std::begin(a.uuid().bytes), std::end(a.uuid().bytes), uuid);
  request += EncodeCudaPushTarget(uuid, a.size(), kCudaVmmPosixFd);
  return request;
}

}  // namespace

absl::Status PushIntoCudaAndCopyBack(const v1::FetchResponse& resp, int device,
                                     std::vector<std::string>* host) {
  const CudaDriver& d = Cuda();
  if (!d.status.ok()) return d.status;
  std::vector<uint64_t> lengths;
  for (const v1::ShardTensor& t : resp.tensors()) lengths.push_back(t.length());
  WD_ASSIGN_OR_RETURN(PushLayout layout, DefaultPushLayout(lengths));
  WD_ASSIGN_OR_RETURN(std::unique_ptr<CudaAllocation> a,
                      CudaAllocation::Create(d, device, layout.size));
  WD_ASSIGN_OR_RETURN(UniqueFd conn, ConnectUnix(resp.data_socket()));
  WD_ASSIGN_OR_RETURN(std::string request, CudaPushRequest(resp, *a));
  const int send_fd = a->fd();
  uint32_t num_fds = 0;
  std::vector<UniqueFd> stray;
  WD_RETURN_IF_ERROR(Exchange(conn.get(), request, {&send_fd, 1}, &num_fds, &stray));
  host->clear();
  for (int i = 0; i < resp.tensors_size(); ++i) {
    host->emplace_back(lengths[i], '\0');
    if (lengths[i] == 0) continue;
    WD_RETURN_IF_ERROR(CudaCall(
        d, d.copy_to_host(host->back().data(), a->va() + layout.offsets[i], lengths[i]),
        absl::StrCat("copying tensor \"", resp.tensors(i).name(), "\" back")));
  }
  return absl::OkStatus();
}

}  // namespace weightd

