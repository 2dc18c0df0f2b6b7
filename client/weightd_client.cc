#include "client/weightd_client.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <type_traits>
#include <cstring>
#include <random>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/client_interceptor.h>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/data_protocol.h"
#ifdef WEIGHTD_CLIENT_CUDA
#include <cuda.h>
#endif
#include "common/dtype.h"
#include "common/fd.h"
#include "common/file_opener.h"
#include "common/push_layout.h"
#include "common/status_macros.h"
#include "common/unix_socket.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "proto/convert/dtype_convert.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace weightd {

// The gRPC channel and stubs, shared by a Client and its ShardSets (which
// need them to release their leases).
class ClientChannel {
 public:
  explicit ClientChannel(std::shared_ptr<grpc::Channel> channel)
      : channel(channel),
        models(v1::Models::NewStub(channel)),
        shards(v1::Shards::NewStub(channel)),
        adapters(v1::Adapters::NewStub(channel)),
        health(grpc::health::v1::Health::NewStub(channel)) {}

  std::shared_ptr<grpc::Channel> channel;
  std::string socket_path;  // the Unix socket connected to ("" over TCP)
  std::unique_ptr<v1::Models::Stub> models;
  std::unique_ptr<v1::Shards::Stub> shards;
  std::unique_ptr<v1::Adapters::Stub> adapters;
  std::unique_ptr<grpc::health::v1::Health::Stub> health;
};

namespace {

// Adds "authorization: Bearer <token>" to every call of the channel.
class BearerTokenInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit BearerTokenInterceptor(std::string header) : header_(std::move(header)) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->insert({"authorization", header_});
    }
    methods->Proceed();
  }

 private:
  const std::string header_;  // gRPC keeps a reference until the call ends
};

class BearerTokenInterceptorFactory
    : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit BearerTokenInterceptorFactory(std::string token)
      : header_(absl::StrCat("Bearer ", token)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new BearerTokenInterceptor(header_);  // gRPC owns interceptors
  }

 private:
  const std::string header_;
};

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeCredentials(
    const ClientOptions& o, grpc::ChannelArguments* args) {
  bool tls = o.tls || !o.tls_ca_file.empty() || !o.tls_cert_file.empty() ||
             !o.tls_key_file.empty();
  if (!tls) return grpc::InsecureChannelCredentials();
  if (!o.socket.empty()) {
    return absl::InvalidArgumentError("TLS is for --target HOST:PORT, not a Unix socket");
  }
  if (o.tls_cert_file.empty() != o.tls_key_file.empty()) {
    return absl::InvalidArgumentError("a client certificate needs both --tls-cert and --tls-key");
  }
  constexpr uint64_t kMaxPem = 1 << 20;
  grpc::SslCredentialsOptions ssl;
  if (!o.tls_ca_file.empty()) {
    WD_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadFileToString(o.tls_ca_file, kMaxPem));
  }
  if (!o.tls_cert_file.empty()) {
    WD_ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadFileToString(o.tls_cert_file, kMaxPem));
    WD_ASSIGN_OR_RETURN(ssl.pem_private_key, ReadFileToString(o.tls_key_file, kMaxPem));
  }
  if (!o.tls_server_name.empty()) args->SetSslTargetNameOverride(o.tls_server_name);
  return grpc::SslCredentials(ssl);
}

// Retry policy (ClientOptions::retry_deadline).
constexpr double kRetryInitialBackoffS = 0.05;
constexpr double kRetryMultiplier = 2.0;
constexpr double kRetryMaxBackoffS = 2.0;
constexpr double kRetryJitter = 0.2;

// gRPC's own retries for the read-only methods; the loop in Retrying()
// stretches them over the whole retry deadline.
constexpr char kServiceConfig[] = R"({"methodConfig": [{"name": [
  {"service": "grpc.health.v1.Health", "method": "Check"},
  {"service": "weightd.v1.Models", "method": "List"},
  {"service": "weightd.v1.Models", "method": "Get"},
  {"service": "weightd.v1.Models", "method": "Stats"},
  {"service": "weightd.v1.Models", "method": "Verify"},
  {"service": "weightd.v1.Shards", "method": "Fetch"},
  {"service": "weightd.v1.Adapters", "method": "List"}],
 "retryPolicy": {"maxAttempts": 4, "initialBackoff": "0.05s", "maxBackoff": "2s",
   "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]})";

absl::Status StatusOf(const absl::Status& s) { return s; }
template <typename T>
absl::Status StatusOf(const absl::StatusOr<T>& s) {
  return s.status();
}

// attempt(), again while it fails UNAVAILABLE and `deadline` has not passed.
// CANCELLED too: a draining daemon (SIGTERM) cancels calls that arrive on an
// open connection before any handler runs; the client cancels none of the
// calls it retries itself.
bool Retryable(const absl::Status& s) {
  return s.code() == absl::StatusCode::kUnavailable || s.code() == absl::StatusCode::kCancelled;
}

template <typename F>
auto Retrying(absl::Duration deadline, F attempt) -> decltype(attempt()) {
  auto result = attempt();
  if (deadline <= absl::ZeroDuration()) return result;
  const absl::Time start = absl::Now();
  const absl::Time end = start + deadline;
  thread_local std::minstd_rand rng(std::random_device{}());
  std::uniform_real_distribution<double> jitter(1 - kRetryJitter, 1 + kRetryJitter);
  double backoff = kRetryInitialBackoffS;
  int tries = 1;
  while (Retryable(StatusOf(result))) {
    absl::Duration left = end - absl::Now();
    if (left <= absl::ZeroDuration()) {
      absl::Status s = StatusOf(result);
      return absl::UnavailableError(absl::StrCat(s.message(), " (gave up after ", tries,
                                                 " attempts in ",
                                                 absl::FormatDuration(absl::Now() - start), ")"));
    }
    absl::SleepFor(std::min(left, absl::Seconds(backoff * jitter(rng))));
    backoff = std::min(backoff * kRetryMultiplier, kRetryMaxBackoffS);
    result = attempt();
    ++tries;
  }
  return result;
}

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

v1::DType ToProto(DType d) { return ToProtoDType(d); }

absl::StatusOr<DType> FromProto(v1::DType d) {
  std::optional<DType> dtype = DTypeFromProto(d);
  if (!dtype.has_value()) {
    return absl::InternalError(absl::StrCat("daemon sent unknown dtype ", static_cast<int>(d)));
  }
  return *dtype;
}

ModelInfo ToModelInfo(const v1::ModelInfo& m) {
  ModelInfo out;
  out.name = m.name();
  out.path = m.path();
  out.generation = m.generation();
  out.tensor_count = m.tensor_count();
  out.total_bytes = m.total_bytes();
  out.segment_bytes_4k = m.segment_bytes_4k();
  out.segment_bytes_thp = m.segment_bytes_thp();
  out.segment_bytes_hugetlb = m.segment_bytes_hugetlb();
  out.weights_id = m.weights_id();
  out.files.assign(m.files().begin(), m.files().end());
  out.adapters.assign(m.adapters().begin(), m.adapters().end());
  out.report.assign(m.report().begin(), m.report().end());
  out.readers.assign(m.readers().begin(), m.readers().end());
  for (const v1::TensorInfo& t : m.tensors()) {
    ModelTensor mt;
    mt.name = t.name();
    auto d = FromProto(t.dtype());
    mt.dtype = d.ok() ? *d : DType::kU8;
    mt.shape.assign(t.shape().begin(), t.shape().end());
    if (t.digest().size() == 16) std::memcpy(mt.digest.bytes.data(), t.digest().data(), 16);
    mt.sources.assign(t.sources().begin(), t.sources().end());
    mt.patched_by.assign(t.patched_by().begin(), t.patched_by().end());
    out.tensors.push_back(std::move(mt));
  }
  return out;
}

// Sends one data-socket request (`fds` riding on it) and reads the reply's
// header and message: the daemon's status, with the reply's fd count in
// `*num_fds`; fds arriving meanwhile are appended to `fds`. A daemon past its
// connection caps answers at once and closes, maybe before the request is
// sent: its reply says why.
absl::Status Exchange(int conn, absl::string_view request, absl::Span<const int> send_fds,
                      uint32_t* num_fds, std::vector<UniqueFd>* fds) {
  absl::Status sent = send_fds.empty() ? SendAll(conn, request.data(), request.size())
                                       : SendWithFds(conn, request, send_fds);
  AttachReply reply{};
  absl::Status got = RecvWithFds(conn, &reply, sizeof(reply), fds);
  if (!got.ok() && !sent.ok()) return sent;
  WD_RETURN_IF_ERROR_CTX(got, "reading the data socket reply");
  if (std::memcmp(reply.magic, kReplyMagic, 4) != 0) {
    return absl::InternalError("bad reply magic on the data socket");
  }
  if (reply.message_len > kMaxReplyMessage) {
    return absl::InternalError("oversized reply message on the data socket");
  }
  std::string msg(reply.message_len, '\0');
  if (!msg.empty()) WD_RETURN_IF_ERROR(RecvWithFds(conn, msg.data(), msg.size(), fds));
  if (reply.code != 0) return absl::Status(static_cast<absl::StatusCode>(reply.code), msg);
  *num_fds = reply.num_fds;
  return absl::OkStatus();
}

// Attaches the lease on the data socket and receives one fd per segment.
absl::Status CollectFds(const std::string& path, const v1::FetchResponse& resp, UniqueFd* conn,
                        std::vector<UniqueFd>* fds) {
  WD_ASSIGN_OR_RETURN(*conn, ConnectUnix(path));
  AttachRequest req{};
  std::memcpy(req.magic, kAttachMagic, 4);
  req.lease_id = resp.lease_id();
  if (resp.token().size() != sizeof(req.token)) {
    return absl::InternalError("daemon sent a lease token of the wrong size");
  }
  std::memcpy(req.token, resp.token().data(), sizeof(req.token));
  uint32_t num_fds = 0;
  WD_RETURN_IF_ERROR(Exchange(conn->get(),
                              absl::string_view(reinterpret_cast<const char*>(&req), sizeof(req)),
                              {}, &num_fds, fds));
  while (fds->size() < num_fds) {
    char byte;
    WD_RETURN_IF_ERROR(RecvWithFds(conn->get(), &byte, 1, fds));
  }
  if (fds->size() != static_cast<size_t>(resp.segment_sizes_size())) {
    return absl::InternalError(absl::StrCat("daemon passed ", fds->size(), " fds for ",
                                            resp.segment_sizes_size(), " segments"));
  }
  return absl::OkStatus();
}

// A publish session's staging memfd, writable (a StageRequest on the data
// socket at `path`; the connection is closed on return).
absl::StatusOr<UniqueFd> TakeStaging(const std::string& path, const v1::PublishSession& session) {
  if (path.empty()) {
    return absl::FailedPreconditionError(
        "the daemon named no data socket; publish with the grpc transport");
  }
  WD_ASSIGN_OR_RETURN(UniqueFd conn, ConnectUnix(path));
  StageRequest req{};
  std::memcpy(req.magic, kStageMagic, 4);
  req.session = session.session();
  const std::string token = absl::HexStringToBytes(session.token());
  if (token.size() != sizeof(req.token)) {
    return absl::InternalError("daemon sent a publish token of the wrong size");
  }
  std::memcpy(req.token, token.data(), sizeof(req.token));
  uint32_t num_fds = 0;
  std::vector<UniqueFd> fds;
  WD_RETURN_IF_ERROR(Exchange(conn.get(),
                              absl::string_view(reinterpret_cast<const char*>(&req), sizeof(req)),
                              {}, &num_fds, &fds));
  if (num_fds != 1 || fds.size() != 1) {
    return absl::InternalError(
        absl::StrCat("daemon passed ", fds.size(), " fds for a staging memfd"));
  }
  return std::move(fds[0]);
}

// The data socket to use: beside the Unix socket this client connected to
// when the daemon's lies beside its own (the directory may be mounted at
// another path here than in the daemon's container), else the daemon's path.
std::string DataSocketFor(const std::string& socket_path, const std::string& data_socket,
                          const std::string& data_socket_name) {
  if (socket_path.empty() || data_socket_name.empty()) return data_socket;
  std::string dir = socket_path;
  if (char* real = ::realpath(socket_path.c_str(), nullptr); real != nullptr) {
    dir = real;
    std::free(real);
  }
  return JoinPath(Dirname(dir), data_socket_name);
}

// Push (DESIGN §6): allocates the client's destination (a memfd, allocated
// with fallocate so its pages are the client's), has the daemon write the
// shard into it at the default layout and maps it read-write. Fills
// `offsets` (one per tensor); the connection is closed on return, which
// ends the lease.
absl::Status PushIntoNewMemfd(const v1::FetchResponse& resp, UniqueFd* memfd, MappedRegion* map,
                              std::vector<uint64_t>* offsets) {
  std::vector<uint64_t> lengths;
  for (const v1::ShardTensor& t : resp.tensors()) lengths.push_back(t.length());
  WD_ASSIGN_OR_RETURN(PushLayout layout, DefaultPushLayout(lengths));
  UniqueFd fd(::memfd_create("weightd-push", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) return ErrnoStatus(errno, "memfd_create");
  if (layout.size > 0) {
    if (::ftruncate(fd.get(), static_cast<off_t>(layout.size)) != 0) {
      return ErrnoStatus(errno, "sizing the push destination");
    }
    int err = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(layout.size));
    if (err != 0) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "allocating ", layout.size, " bytes for the push destination: ", std::strerror(err)));
    }
  }
  // The daemon takes only a destination whose size cannot change under its
  // writes.
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    return ErrnoStatus(errno, "sealing the push destination's size");
  }
  WD_ASSIGN_OR_RETURN(UniqueFd conn, ConnectUnix(resp.data_socket()));
  PushRequest req{};
  std::memcpy(req.magic, kPushMagic, 4);
  req.num_offsets = 0;  // the default layout
  req.lease_id = resp.lease_id();
  if (resp.token().size() != sizeof(req.token)) {
    return absl::InternalError("daemon sent a lease token of the wrong size");
  }
  std::memcpy(req.token, resp.token().data(), sizeof(req.token));
  const int dest = fd.get();
  uint32_t num_fds = 0;
  std::vector<UniqueFd> stray;  // a push's reply carries none
  WD_RETURN_IF_ERROR(Exchange(conn.get(),
                              absl::string_view(reinterpret_cast<const char*>(&req), sizeof(req)),
                              {&dest, 1}, &num_fds, &stray));
  WD_ASSIGN_OR_RETURN(*map, MappedRegion::Map(fd.get(), layout.size,
                                              MappedRegion::Mode::kReadWrite));
  *memfd = std::move(fd);
  *offsets = std::move(layout.offsets);
  return absl::OkStatus();
}

#ifdef WEIGHTD_CLIENT_CUDA
// The CUDA driver, found at run time (never linked: a client built with
// CUDA runs where there is none), its entry points through cuGetProcAddress.
struct CudaDriver {
  decltype(&::cuInit) init = nullptr;
  decltype(&::cuDeviceGet) device_get = nullptr;
  decltype(&::cuDeviceGetUuid) device_uuid = nullptr;
  decltype(&::cuDevicePrimaryCtxRetain) ctx_retain = nullptr;
  decltype(&::cuDevicePrimaryCtxRelease) ctx_release = nullptr;
  decltype(&::cuCtxSetCurrent) ctx_set = nullptr;
  decltype(&::cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&::cuMemCreate) create = nullptr;
  decltype(&::cuMemExportToShareableHandle) export_handle = nullptr;
  decltype(&::cuMemAddressReserve) reserve = nullptr;
  decltype(&::cuMemAddressFree) free_address = nullptr;
  decltype(&::cuMemMap) map = nullptr;
  decltype(&::cuMemUnmap) unmap = nullptr;
  decltype(&::cuMemSetAccess) set_access = nullptr;
  decltype(&::cuMemRelease) release = nullptr;
  decltype(&::cuMemcpyDtoH) copy_to_host = nullptr;
  decltype(&::cuGetErrorString) error_string = nullptr;
  absl::Status status;
};

const CudaDriver& Cuda() {
  static const CudaDriver driver = [] {
    CudaDriver d;
    void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = ::dlerror();
      d.status = absl::FailedPreconditionError(
          absl::StrCat("no CUDA driver in this process: libcuda.so.1 cannot be loaded (",
                       why != nullptr ? why : "not found", ")"));
      return d;
    }
    auto get_proc = reinterpret_cast<decltype(&::cuGetProcAddress)>(
        ::dlsym(lib, "cuGetProcAddress_v2"));
    if (get_proc == nullptr) {
      d.status = absl::FailedPreconditionError("the CUDA driver is too old (no cuGetProcAddress_v2)");
      return d;
    }
    auto resolve = [&](const char* name, auto* fn) {
      void* p = nullptr;
      CUdriverProcAddressQueryResult found{};
      if (get_proc(name, &p, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &found) != CUDA_SUCCESS ||
          p == nullptr) {
        if (d.status.ok()) {
          d.status = absl::FailedPreconditionError(absl::StrCat("the CUDA driver has no ", name));
        }
        return;
      }
      *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(p);
    };
    resolve("cuInit", &d.init);
    resolve("cuDeviceGet", &d.device_get);
    resolve("cuDeviceGetUuid", &d.device_uuid);
    resolve("cuDevicePrimaryCtxRetain", &d.ctx_retain);
    resolve("cuDevicePrimaryCtxRelease", &d.ctx_release);
    resolve("cuCtxSetCurrent", &d.ctx_set);
    resolve("cuMemGetAllocationGranularity", &d.granularity);
    resolve("cuMemCreate", &d.create);
    resolve("cuMemExportToShareableHandle", &d.export_handle);
    resolve("cuMemAddressReserve", &d.reserve);
    resolve("cuMemAddressFree", &d.free_address);
    resolve("cuMemMap", &d.map);
    resolve("cuMemUnmap", &d.unmap);
    resolve("cuMemSetAccess", &d.set_access);
    resolve("cuMemRelease", &d.release);
    resolve("cuMemcpyDtoH", &d.copy_to_host);
    resolve("cuGetErrorString", &d.error_string);
    if (d.status.ok() && d.init(0) != CUDA_SUCCESS) {
      d.status = absl::FailedPreconditionError("the CUDA driver did not start (cuInit)");
    }
    return d;
  }();
  return driver;
}

absl::Status CudaCall(const CudaDriver& d, CUresult r, absl::string_view what) {
  if (r == CUDA_SUCCESS) return absl::OkStatus();
  const char* text = nullptr;
  if (d.error_string != nullptr) d.error_string(r, &text);
  return absl::UnavailableError(
      absl::StrCat(what, ": ", text != nullptr ? text : "CUDA error", " (", static_cast<int>(r), ")"));
}

// kCuda: allocates a VMM allocation on `device`, has the daemon push the
// shard into it (WDC1, the exported fd riding along), copies each tensor
// back into `host` (one string per tensor) and frees the allocation.
absl::Status PushIntoCudaAndCopyBack(const v1::FetchResponse& resp, int device,
                                     std::vector<std::string>* host) {
  const CudaDriver& d = Cuda();
  if (!d.status.ok()) return d.status;
  std::vector<uint64_t> lengths;
  for (const v1::ShardTensor& t : resp.tensors()) lengths.push_back(t.length());
  WD_ASSIGN_OR_RETURN(PushLayout layout, DefaultPushLayout(lengths));
  CUdevice dev = 0;
  WD_RETURN_IF_ERROR(CudaCall(d, d.device_get(&dev, device), absl::StrCat("CUDA device ", device)));
  CUuuid uuid{};
  WD_RETURN_IF_ERROR(CudaCall(d, d.device_uuid(&uuid, dev), "its UUID"));
  CUcontext ctx = nullptr;
  WD_RETURN_IF_ERROR(CudaCall(d, d.ctx_retain(&ctx, dev), "its primary context"));
  std::vector<std::function<void()>> undo;
  auto cleanup = absl::MakeCleanup([&] {
    for (auto it = undo.rbegin(); it != undo.rend(); ++it) (*it)();
  });
  undo.push_back([&d, dev] { d.ctx_release(dev); });
  WD_RETURN_IF_ERROR(CudaCall(d, d.ctx_set(ctx), "making it current"));
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t granularity = 0;
  WD_RETURN_IF_ERROR(CudaCall(
      d, d.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), "granularity"));
  const uint64_t size =
      std::max<uint64_t>(1, (layout.size + granularity - 1) / granularity) * granularity;
  CUmemGenericAllocationHandle handle{};
  WD_RETURN_IF_ERROR(CudaCall(d, d.create(&handle, size, &prop, 0),
                              absl::StrCat("allocating ", size, " bytes on the GPU")));
  undo.push_back([&d, handle] { d.release(handle); });
  int exported = -1;
  WD_RETURN_IF_ERROR(CudaCall(d,
                              d.export_handle(&exported, handle,
                                              CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                              "exporting the allocation"));
  UniqueFd fd(exported);
  CUdeviceptr va = 0;
  WD_RETURN_IF_ERROR(CudaCall(d, d.reserve(&va, size, 0, 0, 0), "reserving address space"));
  undo.push_back([&d, va, size] { d.free_address(va, size); });
  WD_RETURN_IF_ERROR(CudaCall(d, d.map(va, size, 0, handle, 0), "mapping the allocation"));
  undo.push_back([&d, va, size] { d.unmap(va, size); });
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  WD_RETURN_IF_ERROR(CudaCall(d, d.set_access(va, size, &access, 1), "granting access"));

  WD_ASSIGN_OR_RETURN(UniqueFd conn, ConnectUnix(resp.data_socket()));
  PushRequest req{};
  std::memcpy(req.magic, kCudaPushMagic, 4);
  req.num_offsets = 0;  // the default layout
  req.lease_id = resp.lease_id();
  if (resp.token().size() != sizeof(req.token)) {
    return absl::InternalError("daemon sent a lease token of the wrong size");
  }
  std::memcpy(req.token, resp.token().data(), sizeof(req.token));
  CudaPushTarget target{};
  static_assert(sizeof(target.gpu_uuid) == sizeof(uuid.bytes));
  std::memcpy(target.gpu_uuid, uuid.bytes, sizeof(target.gpu_uuid));
  target.size = size;
  target.handle_kind = kCudaVmmPosixFd;
  std::string request(reinterpret_cast<const char*>(&req), sizeof(req));
  request.append(reinterpret_cast<const char*>(&target), sizeof(target));
  const int send_fd = fd.get();
  uint32_t num_fds = 0;
  std::vector<UniqueFd> stray;
  WD_RETURN_IF_ERROR(Exchange(conn.get(), request, {&send_fd, 1}, &num_fds, &stray));
  host->clear();
  for (int i = 0; i < resp.tensors_size(); ++i) {
    host->emplace_back(lengths[i], '\0');
    if (lengths[i] == 0) continue;
    WD_RETURN_IF_ERROR(CudaCall(
        d, d.copy_to_host(host->back().data(), va + layout.offsets[i], lengths[i]),
        absl::StrCat("copying tensor \"", resp.tensors(i).name(), "\" back")));
  }
  return absl::OkStatus();
}
#endif  // WEIGHTD_CLIENT_CUDA

// Streams bytes [offset, offset + length) of segment `index` into `out`.
absl::Status ReadRange(v1::Shards::Stub* stub, const v1::FetchResponse& resp, uint32_t index,
                       uint64_t offset, uint64_t length, std::string* out) {
  out->assign(length, '\0');
  if (length == 0) return absl::OkStatus();
  grpc::ClientContext ctx;
  v1::ReadRequest req;
  req.set_lease_id(resp.lease_id());
  req.set_token(resp.token());
  req.set_segment(index);
  req.set_offset(offset);
  req.set_length(length);
  auto reader = stub->Read(&ctx, req);
  v1::ReadChunk chunk;
  uint64_t got = 0;
  while (reader->Read(&chunk)) {
    if (chunk.offset() != got || chunk.data().size() > length - got) {
      ctx.TryCancel();
      reader->Finish();
      return absl::InternalError("daemon sent an out-of-order or oversized chunk");
    }
    std::memcpy(out->data() + got, chunk.data().data(), chunk.data().size());
    got += chunk.data().size();
  }
  WD_RETURN_IF_ERROR(FromGrpc(reader->Finish()));
  if (got != length) {
    return absl::DataLossError(absl::StrCat("segment ", index, ": got ", got, " of ", length,
                                            " bytes"));
  }
  return absl::OkStatus();
}

// grpc transport: tensor ranges closer than this are read as one (the
// Python client's _READ_MERGE_GAP); nothing else of a segment is read.
constexpr uint64_t kReadMergeGap = uint64_t{1} << 16;

// One Read per run of nearby tensor ranges of the same segment; returns the
// start of each tensor's bytes (nullptr for empty ones), kept in `buffers`.
absl::StatusOr<std::vector<const uint8_t*>> ReadTensorRanges(v1::Shards::Stub* stub,
                                                             const v1::FetchResponse& resp,
                                                             std::vector<std::string>* buffers) {
  struct Range {
    uint32_t segment;
    uint64_t lo, hi;
    std::vector<int> tensors;
  };
  std::vector<int> order;
  for (int i = 0; i < resp.tensors_size(); ++i) {
    if (resp.tensors(i).length() != 0) order.push_back(i);
  }
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    const v1::ShardTensor &x = resp.tensors(a), &y = resp.tensors(b);
    return std::make_pair(x.segment(), x.offset()) < std::make_pair(y.segment(), y.offset());
  });
  std::vector<Range> ranges;
  for (int i : order) {
    const v1::ShardTensor& t = resp.tensors(i);
    const uint64_t end = t.offset() + t.length();  // checked against the segment by the caller
    if (!ranges.empty() && ranges.back().segment == t.segment() &&
        t.offset() <= ranges.back().hi + kReadMergeGap) {
      ranges.back().hi = std::max(ranges.back().hi, end);
    } else {
      ranges.push_back(Range{t.segment(), t.offset(), end, {}});
    }
    ranges.back().tensors.push_back(i);
  }
  std::vector<const uint8_t*> data(resp.tensors_size(), nullptr);
  buffers->resize(ranges.size());
  for (size_t r = 0; r < ranges.size(); ++r) {
    const Range& range = ranges[r];
    WD_RETURN_IF_ERROR(ReadRange(stub, resp, range.segment, range.lo, range.hi - range.lo,
                                 &(*buffers)[r]));
    for (int i : range.tensors) {
      data[i] = reinterpret_cast<const uint8_t*>((*buffers)[r].data()) +
                (resp.tensors(i).offset() - range.lo);
    }
  }
  return data;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  std::string target;
  if (!options.socket.empty()) {
    target = "unix:" + options.socket;
  } else if (!options.target.empty()) {
    target = options.target;
  } else {
    return absl::InvalidArgumentError("give a --socket PATH or a --target HOST:PORT");
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(256 << 20);
  if (options.retry_deadline > absl::ZeroDuration()) {
    args.SetInt(GRPC_ARG_ENABLE_RETRIES, 1);
    args.SetServiceConfigJSON(kServiceConfig);
    // Reconnect to a restarted daemon within the backoff cap instead of
    // gRPC's default (1 s growing to 120 s).
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 50);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  } else {
    args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
  }
  WD_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> creds,
                      MakeCredentials(options, &args));
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  if (!options.token.empty()) {
    interceptors.push_back(std::make_unique<BearerTokenInterceptorFactory>(options.token));
  }
  auto channel = interceptors.empty()
                     ? grpc::CreateCustomChannel(target, creds, args)
                     : grpc::experimental::CreateCustomChannelWithInterceptors(
                           target, creds, args, std::move(interceptors));
  auto client_channel = std::make_shared<ClientChannel>(channel);
  client_channel->socket_path = options.socket;
  return std::unique_ptr<Client>(new Client(std::move(client_channel), options.retry_deadline));
}

Client::Client(std::shared_ptr<ClientChannel> channel, absl::Duration retry_deadline)
    : channel_(std::move(channel)), retry_deadline_(retry_deadline) {}
Client::~Client() = default;

absl::Status Client::Health() {
  return Retrying(retry_deadline_, [&]() -> absl::Status {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::health::v1::HealthCheckRequest req;
    grpc::health::v1::HealthCheckResponse resp;
    WD_RETURN_IF_ERROR(FromGrpc(channel_->health->Check(&ctx, req, &resp)));
    if (resp.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
      return absl::UnavailableError(absl::StrCat(
          "daemon reports ", grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status())));
    }
    return absl::OkStatus();
  });
}

namespace {

absl::StatusOr<v1::LoadSource> ParseSource(const std::string& source) {
  if (source == "auto" || source.empty()) return v1::LOAD_SOURCE_AUTO;
  if (source == "storage") return v1::LOAD_SOURCE_STORAGE;
  if (source == "peers") return v1::LOAD_SOURCE_PEERS;
  return absl::InvalidArgumentError(
      absl::StrCat("--source: expected auto, storage or peers, got \"", source, "\""));
}

}  // namespace

absl::StatusOr<ModelInfo> Client::Load(
    const std::string& name, const std::string& path, const std::string& profile_json,
    const std::function<void(const LoadProgressUpdate&)>& progress,
    const std::vector<std::string>& readers, const std::string& source) {
  grpc::ClientContext ctx;
  v1::LoadRequest req;
  req.set_name(name);
  req.set_path(path);
  req.set_profile_json(profile_json);
  for (const std::string& r : readers) req.add_readers(r);
  WD_ASSIGN_OR_RETURN(v1::LoadSource src, ParseSource(source));
  req.set_source(src);
  auto reader = channel_->models->Load(&ctx, req);
  v1::LoadProgress msg;
  std::optional<ModelInfo> info;
  while (reader->Read(&msg)) {
    if (msg.done()) info = ToModelInfo(msg.model());
    if (progress) {
      progress(LoadProgressUpdate{msg.bytes_done(), msg.bytes_total(), msg.tensors_done(),
                                  msg.tensors_total(), msg.current_file(),
                                  msg.bytes_from_storage(), msg.bytes_from_peers(),
                                  {msg.peers().begin(), msg.peers().end()}, msg.done()});
    }
  }
  WD_RETURN_IF_ERROR(FromGrpc(reader->Finish()));
  if (!info.has_value()) return absl::InternalError("load stream ended without a result");
  return *info;
}

absl::Status Client::Unload(const std::string& name) {
  grpc::ClientContext ctx;
  v1::UnloadRequest req;
  req.set_name(name);
  v1::UnloadResponse resp;
  return FromGrpc(channel_->models->Unload(&ctx, req, &resp));
}

absl::StatusOr<std::vector<ModelInfo>> Client::List() {
  v1::ListModelsRequest req;
  v1::ListModelsResponse resp;
  WD_RETURN_IF_ERROR(Retrying(retry_deadline_, [&] {
    grpc::ClientContext ctx;
    return FromGrpc(channel_->models->List(&ctx, req, &resp));
  }));
  std::vector<ModelInfo> out;
  for (const v1::ModelInfo& m : resp.models()) out.push_back(ToModelInfo(m));
  return out;
}

absl::StatusOr<ModelInfo> Client::GetModel(const std::string& name) {
  v1::GetModelRequest req;
  req.set_name(name);
  v1::ModelInfo resp;
  WD_RETURN_IF_ERROR(Retrying(retry_deadline_, [&] {
    grpc::ClientContext ctx;
    return FromGrpc(channel_->models->Get(&ctx, req, &resp));
  }));
  return ToModelInfo(resp);
}

absl::StatusOr<std::pair<uint64_t, uint64_t>> Client::Verify(const std::string& name) {
  v1::VerifyRequest req;
  req.set_name(name);
  v1::VerifyResponse resp;
  WD_RETURN_IF_ERROR(Retrying(retry_deadline_, [&] {
    grpc::ClientContext ctx;
    return FromGrpc(channel_->models->Verify(&ctx, req, &resp));
  }));
  return std::make_pair(resp.tensors(), resp.bytes());
}

absl::StatusOr<PeersInfo> Client::Peers() {
  v1::PeersRequest req;
  v1::PeersResponse r;
  WD_RETURN_IF_ERROR(Retrying(retry_deadline_, [&] {
    grpc::ClientContext ctx;
    return FromGrpc(channel_->models->Peers(&ctx, req, &r));
  }));
  PeersInfo out;
  out.advertise = r.advertise();
  out.peer_dns = r.peer_dns();
  out.dns_error = r.dns_error();
  out.poll_seconds = r.poll_seconds();
  for (const v1::PeerInfo& p : r.peers()) {
    PeerInfo info{p.address(), p.reachable(), p.error(), p.last_seen_unix_ms(),
                  p.polled_unix_ms(), {}};
    for (const v1::PeerModel& m : p.models()) {
      info.models.push_back({m.name(), m.generation(), m.weights_id()});
    }
    out.peers.push_back(std::move(info));
  }
  return out;
}

absl::StatusOr<DaemonStats> Client::Stats() {
  v1::StatsRequest req;
  v1::StatsResponse r;
  WD_RETURN_IF_ERROR(Retrying(retry_deadline_, [&] {
    grpc::ClientContext ctx;
    return FromGrpc(channel_->models->Stats(&ctx, req, &r));
  }));
  DaemonStats s{r.models(),     r.segments(),    r.bytes_resident(), r.materializations(),
                r.materialization_bytes(), r.cache_hits(), r.cache_misses(),
                r.leases_open(), r.bytes_served(), r.fetches(), r.applies(), r.adapters(),
                r.reserve_ready_bytes(), r.reserve_target_bytes(), r.bytes_read()};
  s.checkpoint_bytes_logical = r.checkpoint_bytes_logical();
  s.checkpoint_bytes_resident = r.checkpoint_bytes_resident();
  s.pushes = r.pushes();
  s.publishes = r.publishes();
  s.publish_bytes = r.publish_bytes();
  s.publish_seconds = r.publish_seconds();
  s.publish_sessions = r.publish_sessions();
  s.publish_staging_prepared = r.publish_staging_prepared();
  s.publish_staging_allocated = r.publish_staging_allocated();
  s.publish_staging_ahead_bytes = r.publish_staging_ahead_bytes();
  s.published_bytes_logical = r.published_bytes_logical();
  s.published_bytes_resident = r.published_bytes_resident();
  s.load_bytes_storage = r.load_bytes_storage();
  s.load_bytes_peers = r.load_bytes_peers();
  s.bytes_sent_to_peers = r.bytes_sent_to_peers();
  for (const v1::PeerTransfer& t : r.peer_transfers()) {
    s.peer_transfers.push_back({t.peer(), t.bytes(), t.failures()});
  }
  s.push_bytes = r.push_bytes();
  s.pinned_bytes = r.pinned_bytes();
  s.segment_bytes_4k = r.segment_bytes_4k();
  s.segment_bytes_thp = r.segment_bytes_thp();
  s.segment_bytes_hugetlb = r.segment_bytes_hugetlb();
  s.huge_page_fallbacks = r.huge_page_fallbacks();
  s.huge_pages = r.huge_pages();
  s.hugetlb_pages_total = r.hugetlb_pages_total();
  s.hugetlb_pages_free = r.hugetlb_pages_free();
  s.shmem_thp = r.shmem_thp();
  s.cuda_built = r.cuda_built();
  s.gpus_unavailable = r.gpus_unavailable();
  for (const v1::GpuDevice& g : r.gpus()) {
    s.gpus.push_back(GpuInfo{g.uuid(), g.name(), g.pci_bus_id(), g.memory_bytes(), g.ordinal(),
                             g.compute_major(), g.compute_minor(), g.pageable_memory_access(),
                             g.host_register(), g.host_register_read_only(),
                             g.unavailable()});
  }
  return s;
}

// Retried whole on UNAVAILABLE: a Fetch the daemon never handled granted no
// lease, and one granted by a daemon that then went away (data socket
// refused or closed, Read stream cut) died with it. Each attempt connects to
// the data socket afresh (there is no persistent data connection).
absl::StatusOr<std::unique_ptr<ShardSet>> Client::Fetch(const FetchOptions& options) {
  return Retrying(retry_deadline_, [&] { return FetchOnce(options); });
}

absl::StatusOr<std::unique_ptr<ShardSet>> Client::FetchOnce(const FetchOptions& options) {
  v1::FetchRequest req;
  req.set_model(options.model);
  req.set_generation(options.generation);
  for (int64_t d : options.mesh.shape) req.add_mesh_shape(d);
  for (int64_t c : options.mesh.coord) req.add_coord(c);
  if (options.placements.has_value()) {
    for (const Placement& p : *options.placements) req.add_placements()->set_shard_dim(p.shard_dim);
  }
  if (options.dtype.has_value()) req.set_dtype(ToProto(*options.dtype));
  for (const std::string& n : options.names) req.add_names(n);
  req.set_transport(options.transport == Transport::kGrpc ? v1::GRPC : v1::SHM);
  req.set_changed_since(options.changed_since);
  req.set_defer_casts(options.cast_on_push && !options.verify_digests &&
                      (options.transport == Transport::kPush ||
                       options.transport == Transport::kCuda));
  if (req.defer_casts()) {
    req.set_defer_merges(options.merge_on_push.value_or(options.transport == Transport::kCuda));
  }
  v1::FetchResponse resp;
  {
    grpc::ClientContext ctx;
    WD_RETURN_IF_ERROR(FromGrpc(channel_->shards->Fetch(&ctx, req, &resp)));
  }
  auto set = std::unique_ptr<ShardSet>(new ShardSet());
  set->channel_ = channel_;
  // A data socket beside the daemon's gRPC socket is looked for beside the
  // socket this client connected to: the directory may be mounted at another
  // path here than in the daemon's container.
  resp.set_data_socket(
      DataSocketFor(channel_->socket_path, resp.data_socket(), resp.data_socket_name()));
  set->lease_id_ = resp.lease_id();
  set->token_ = resp.token();
  set->generation_ = resp.generation();
  set->weights_id_ = resp.weights_id();
  // From here on the ShardSet's destructor releases the lease on any error.
  for (const v1::ShardTensor& t : resp.tensors()) {
    // A tensor cast by the push names its stored bytes, not `length`
    // bytes of its dtype (only the daemon reads them).
    if (t.segment() >= static_cast<uint32_t>(resp.segment_sizes_size()) ||
        t.offset() > resp.segment_sizes(t.segment()) ||
        (!t.cast_on_push() && t.length() > resp.segment_sizes(t.segment()) - t.offset())) {
      return absl::InternalError(absl::StrCat("daemon sent tensor \"", t.name(),
                                              "\" outside its segment"));
    }
  }
  std::vector<const uint8_t*> bases(resp.segment_sizes_size(), nullptr);  // shm
  std::vector<const uint8_t*> data;  // grpc, push: each tensor's bytes
  if (options.transport == Transport::kCuda) {
#ifdef WEIGHTD_CLIENT_CUDA
    WD_RETURN_IF_ERROR(PushIntoCudaAndCopyBack(resp, options.cuda_device, &set->buffers_));
    set->lease_id_ = 0;  // ended with the push's connection
    for (const std::string& b : set->buffers_) {
      data.push_back(reinterpret_cast<const uint8_t*>(b.data()));
    }
#else
    return absl::UnimplementedError(
        "this client was built without CUDA (no cuda.h): it cannot fetch into a GPU");
#endif
  } else if (options.transport == Transport::kPush) {
    std::vector<uint64_t> offsets;
    WD_RETURN_IF_ERROR(
        PushIntoNewMemfd(resp, &set->push_memfd_, &set->push_map_, &offsets));
    set->lease_id_ = 0;  // ended with the push's connection
    for (uint64_t off : offsets) data.push_back(set->push_map_.data() + off);
  } else if (options.transport == Transport::kShm) {
    std::vector<UniqueFd> fds;
    WD_RETURN_IF_ERROR(CollectFds(resp.data_socket(), resp, &set->data_connection_, &fds));
    for (int i = 0; i < resp.segment_sizes_size(); ++i) {
      WD_ASSIGN_OR_RETURN(MappedRegion map,
                          MappedRegion::Map(fds[i].get(), resp.segment_sizes(i),
                                            MappedRegion::Mode::kReadOnly));
      bases[i] = map.data();
      set->maps_.push_back(std::move(map));
    }
  } else {
    // Only the tensors' ranges, never whole segments: a view-backed tensor
    // lives in a segment that may hold its whole checkpoint.
    WD_ASSIGN_OR_RETURN(data, ReadTensorRanges(channel_->shards.get(), resp, &set->buffers_));
  }
  for (int i = 0; i < resp.tensors_size(); ++i) {
    const v1::ShardTensor& t = resp.tensors(i);
    TensorView v;
    v.name = t.name();
    WD_ASSIGN_OR_RETURN(v.dtype, FromProto(t.dtype()));
    v.shape.assign(t.shape().begin(), t.shape().end());
    v.global_shape.assign(t.global_shape().begin(), t.global_shape().end());
    v.global_offset.assign(t.global_offset().begin(), t.global_offset().end());
    if (options.transport == Transport::kShm) {
      v.data = bases[t.segment()] == nullptr ? nullptr : bases[t.segment()] + t.offset();
    } else if ((options.transport == Transport::kPush || options.transport == Transport::kCuda) &&
               t.length() == 0) {
      v.data = nullptr;
    } else {
      v.data = data[i];
    }
    v.length = t.length();
    if (t.digest().size() == 16) std::memcpy(v.digest.bytes.data(), t.digest().data(), 16);
    v.cast_on_push = t.cast_on_push();
    if (options.populate && options.transport == Transport::kShm) {
      // Only this shard's pages: the segment may hold the whole checkpoint.
      absl::Status populated = set->maps_[t.segment()].PopulateRead(t.offset(), t.length());
      if (!populated.ok() && populated.code() != absl::StatusCode::kUnimplemented) {
        return populated;
      }
    }
    if (options.verify_digests && DigestBytes(v.data, v.length) != v.digest) {
      return absl::DataLossError(absl::StrCat("tensor \"", v.name, "\": digest mismatch"));
    }
    set->tensors_.push_back(std::move(v));
  }
  return set;
}

namespace {
AdapterInfo ToAdapterInfo(const v1::AdapterInfo& a) {
  AdapterInfo out;
  out.name = a.name();
  out.path = a.path();
  out.format = a.format();
  out.tensor_count = a.tensor_count();
  out.bytes = a.bytes();
  out.ignored.assign(a.ignored().begin(), a.ignored().end());
  out.readers.assign(a.readers().begin(), a.readers().end());
  return out;
}
}  // namespace

absl::StatusOr<AdapterInfo> Client::LoadAdapter(const std::string& name, const std::string& path,
                                                const std::string& format, bool strict,
                                                const std::vector<std::string>& readers,
                                                const std::string& source) {
  grpc::ClientContext ctx;
  v1::LoadAdapterRequest req;
  req.set_name(name);
  req.set_path(path);
  req.set_format(format);
  req.set_strict(strict);
  for (const std::string& r : readers) req.add_readers(r);
  WD_ASSIGN_OR_RETURN(v1::LoadSource src, ParseSource(source));
  req.set_source(src);
  v1::AdapterInfo resp;
  WD_RETURN_IF_ERROR(FromGrpc(channel_->adapters->Load(&ctx, req, &resp)));
  return ToAdapterInfo(resp);
}

absl::Status Client::UnloadAdapter(const std::string& name) {
  grpc::ClientContext ctx;
  v1::UnloadAdapterRequest req;
  req.set_name(name);
  v1::UnloadAdapterResponse resp;
  return FromGrpc(channel_->adapters->Unload(&ctx, req, &resp));
}

absl::StatusOr<std::vector<AdapterInfo>> Client::ListAdapters() {
  v1::ListAdaptersRequest req;
  v1::ListAdaptersResponse resp;
  WD_RETURN_IF_ERROR(Retrying(retry_deadline_, [&] {
    grpc::ClientContext ctx;
    return FromGrpc(channel_->adapters->List(&ctx, req, &resp));
  }));
  std::vector<AdapterInfo> out;
  for (const v1::AdapterInfo& a : resp.adapters()) out.push_back(ToAdapterInfo(a));
  return out;
}

absl::StatusOr<GenerationEvent> Client::Apply(const std::string& model,
                                              const std::vector<AdapterStrength>& stack,
                                              uint64_t expect_generation) {
  grpc::ClientContext ctx;
  v1::ApplyRequest req;
  req.set_model(model);
  for (const AdapterStrength& a : stack) {
    v1::AdapterRef* r = req.add_adapters();
    r->set_name(a.name);
    r->set_strength(a.strength);
  }
  req.set_expect_generation(expect_generation);
  v1::ApplyResponse resp;
  WD_RETURN_IF_ERROR(FromGrpc(channel_->adapters->Apply(&ctx, req, &resp)));
  GenerationEvent ev;
  ev.model = model;
  ev.generation = resp.generation();
  ev.adapters.assign(resp.adapters().begin(), resp.adapters().end());
  ev.weights_id = resp.weights_id();
  return ev;
}

namespace {

PublishOutcome ToPublishOutcome(const v1::PublishResult& r) {
  PublishOutcome o;
  o.model = r.model();
  o.generation = r.generation();
  o.weights_id = r.weights_id();
  o.tensors = r.tensors();
  o.changed = r.changed();
  o.bytes = r.bytes();
  o.bytes_stored = r.bytes_stored();
  o.bytes_shared = r.bytes_shared();
  o.shared_with.assign(r.shared_with().begin(), r.shared_with().end());
  o.adapters.assign(r.adapters().begin(), r.adapters().end());
  return o;
}

constexpr uint64_t kPublishChunkBytes = uint64_t{4} << 20;
// Runs per in-place declaration message (~1.3 MiB).
constexpr int kDeclaredRuns = 65536;

}  // namespace

absl::StatusOr<PublishOutcome> Client::Publish(const std::string& model,
                                               const std::vector<PublishTensor>& tensors,
                                               const PublishOptions& options) {
  v1::BeginPublishRequest begin;
  begin.set_model(model);
  begin.set_expect_generation(options.expect_generation);
  begin.set_timeout_seconds(static_cast<uint32_t>(
      std::max<int64_t>(1, absl::ToInt64Seconds(options.timeout))));
  for (const PublishTensor& t : tensors) {
    v1::PublishTensor* pt = begin.add_tensors();
    pt->set_name(t.name);
    pt->set_dtype(ToProtoDType(t.dtype));
    for (int64_t d : t.shape) pt->add_shape(d);
  }
  const Transport transport = options.transport.value_or(
      channel_->socket_path.empty() ? Transport::kGrpc : Transport::kShm);
  if (transport != Transport::kShm && transport != Transport::kGrpc) {
    return absl::InvalidArgumentError("a publish goes over the shm or the grpc transport");
  }
  const bool in_place = transport == Transport::kShm;
  v1::PublishSession session;
  {
    grpc::ClientContext ctx;
    WD_RETURN_IF_ERROR(FromGrpc(channel_->models->BeginPublish(&ctx, begin, &session)));
  }
  auto abort = [&](absl::Status why) {
    grpc::ClientContext ctx;
    v1::AbortPublishRequest req;
    req.set_session(session.session());
    req.set_token(session.token());
    v1::AbortPublishResponse resp;
    (void)channel_->models->AbortPublish(&ctx, req, &resp);
    return why;
  };
  if (in_place) {
    // Each tensor copied once into the staging memfd, which is unmapped
    // before anything is declared (the commit refuses it while mapped).
    absl::Status copied = [&]() -> absl::Status {
      if (session.offsets_size() != static_cast<int>(tensors.size())) {
        return absl::FailedPreconditionError(
            "the daemon offers no staging memfd for this publish; use the grpc transport");
      }
      WD_ASSIGN_OR_RETURN(
          UniqueFd fd,
          TakeStaging(DataSocketFor(channel_->socket_path, session.data_socket(),
                                    session.data_socket_name()),
                      session));
      WD_ASSIGN_OR_RETURN(MappedRegion map,
                          MappedRegion::Map(fd.get(), session.staging_bytes(),
                                            MappedRegion::Mode::kReadWrite, /*populate=*/true));
      uint64_t done = 0;
      for (size_t i = 0; i < tensors.size(); ++i) {
        const PublishTensor& t = tensors[i];
        const uint64_t want =
            static_cast<uint64_t>(NumElements(t.shape)) * DTypeSize(t.dtype);
        if (t.length != want) {
          return absl::InvalidArgumentError(absl::StrCat(
              "tensor \"", t.name, "\": ", t.length, " bytes for ", DTypeName(t.dtype), " ",
              ShapeString(t.shape), " (", want, " bytes)"));
        }
        if (t.length > 0) std::memcpy(map.data() + session.offsets(i), t.data, t.length);
        done += t.length;
        if (options.progress) options.progress(done, session.bytes());
      }
      return absl::OkStatus();  // `map` unmapped here
    }();
    if (!copied.ok()) return abort(copied);
  }
  v1::PublishWriteResponse written;
  {
    grpc::ClientContext ctx;
    auto writer = channel_->models->PublishWrite(&ctx, &written);
    v1::PublishChunk chunk;
    chunk.set_session(session.session());
    chunk.set_token(session.token());
    uint64_t sent = 0;
    bool broken = false;
    chunk.set_in_place(in_place);
    auto flush = [&]() {
      if (chunk.runs_size() == 0) return true;
      sent += chunk.data().size();
      const bool ok = writer->Write(chunk);
      chunk.Clear();
      chunk.set_in_place(in_place);
      if (ok && !in_place && options.progress) options.progress(sent, session.bytes());
      return ok;
    };
    for (size_t i = 0; i < tensors.size() && !broken; ++i) {
      const PublishTensor& t = tensors[i];
      if (in_place) {  // declared, not sent
        v1::PublishRun* run = chunk.add_runs();
        run->set_tensor(static_cast<uint32_t>(i));
        run->set_offset(0);
        run->set_length(t.length);
        if (chunk.runs_size() >= kDeclaredRuns) broken = !flush();
        continue;
      }
      uint64_t at = 0;
      while (at < t.length && !broken) {
        const uint64_t room = kPublishChunkBytes - chunk.data().size();
        const uint64_t n = std::min(room, t.length - at);
        v1::PublishRun* run = chunk.add_runs();
        run->set_tensor(static_cast<uint32_t>(i));
        run->set_offset(at);
        run->set_length(n);
        chunk.mutable_data()->append(reinterpret_cast<const char*>(t.data) + at, n);
        at += n;
        if (chunk.data().size() >= kPublishChunkBytes) broken = !flush();
      }
    }
    if (!broken) broken = !flush();
    if (!broken) writer->WritesDone();
    absl::Status s = FromGrpc(writer->Finish());
    if (!s.ok()) return abort(s);
  }
  if (written.has_result()) return ToPublishOutcome(written.result());
  // Every byte sent, yet the result came to nobody (an empty publish, or
  // the tensors were given shorter than their shapes): ask.
  v1::CommitPublishRequest commit;
  commit.set_session(session.session());
  commit.set_token(session.token());
  v1::PublishResult result;
  grpc::ClientContext ctx;
  absl::Status s = FromGrpc(channel_->models->CommitPublish(&ctx, commit, &result));
  if (!s.ok()) return abort(s);
  return ToPublishOutcome(result);
}

absl::Status Client::Watch(const std::string& model, bool include_current,
                           const std::function<bool(const GenerationEvent&)>& on_event) {
  grpc::ClientContext ctx;
  v1::WatchRequest req;
  req.set_model(model);
  req.set_include_current(include_current);
  auto reader = channel_->shards->Watch(&ctx, req);
  v1::GenerationEvent msg;
  while (reader->Read(&msg)) {
    GenerationEvent ev;
    ev.model = msg.model();
    ev.generation = msg.generation();
    ev.adapters.assign(msg.adapters().begin(), msg.adapters().end());
    ev.weights_id = msg.weights_id();
    if (!on_event(ev)) {
      ctx.TryCancel();
      reader->Finish();
      return absl::OkStatus();
    }
  }
  return FromGrpc(reader->Finish());
}

ShardSet::~ShardSet() { (void)Release(); }

absl::Status ShardSet::Release() {
  if (released_) return absl::OkStatus();
  released_ = true;
  tensors_.clear();
  maps_.clear();
  buffers_.clear();
  push_map_.Reset();
  push_memfd_.Reset();
  absl::Status status;
  if (channel_ != nullptr && lease_id_ != 0) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::ReleaseRequest req;
    req.set_lease_id(lease_id_);
    req.set_token(token_);
    v1::ReleaseResponse resp;
    status = FromGrpc(channel_->shards->Release(&ctx, req, &resp));
    // The data connection closing ends the lease anyway: with one, a lease
    // the daemon no longer knows, or a daemon that cannot answer now
    // (restarting, handing over to a successor), is not an error.
    const absl::StatusCode code = status.code();
    if (data_connection_.valid() &&
        (code == absl::StatusCode::kNotFound || code == absl::StatusCode::kUnavailable ||
         code == absl::StatusCode::kCancelled || code == absl::StatusCode::kDeadlineExceeded)) {
      status = absl::OkStatus();
    }
  }
  data_connection_.Reset();
  return status;
}

namespace {

struct DLPackContext {
  std::shared_ptr<const ShardSet> set;
  std::vector<int64_t> shape;
  dl::DLManagedTensor managed{};
};

void DeleteDLPack(dl::DLManagedTensor* self) {
  delete static_cast<DLPackContext*>(self->manager_ctx);
}

}  // namespace

absl::StatusOr<dl::DLManagedTensor*> ToDLPack(std::shared_ptr<const ShardSet> set,
                                              size_t index) {
  if (set == nullptr || index >= set->tensors().size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "no tensor ", index, " in the shard set (", set == nullptr ? 0 : set->tensors().size(),
        " tensors)"));
  }
  const TensorView& t = set->tensors()[index];
  dl::DLDataType type{0, static_cast<uint8_t>(DTypeSize(t.dtype) * 8), 1};
  switch (t.dtype) {
    case DType::kF64:
    case DType::kF32:
    case DType::kF16: type.code = 2; break;
    case DType::kBF16: type.code = 4; break;
    case DType::kBool: type.code = 6; break;
    case DType::kU8: type.code = 1; break;
    case DType::kF8E4M3:
    case DType::kF8E5M2:
      return absl::UnimplementedError(absl::StrCat(
          "tensor \"", t.name, "\" is ", DTypeName(t.dtype),
          ": DLPack's unversioned ABI has no FP8 code; take its bytes (TensorView::data)"));
    default: type.code = 0; break;  // the signed integers
  }
  auto ctx = std::make_unique<DLPackContext>();
  ctx->set = std::move(set);
  ctx->shape = t.shape;
  dl::DLTensor& d = ctx->managed.dl_tensor;
  d.data = const_cast<uint8_t*>(t.data);
  d.device = dl::DLDevice{t.device < 0 ? 1 : 2, t.device < 0 ? 0 : t.device};
  d.ndim = static_cast<int32_t>(ctx->shape.size());
  d.dtype = type;
  d.shape = ctx->shape.data();
  d.strides = nullptr;
  d.byte_offset = 0;
  ctx->managed.manager_ctx = ctx.get();
  ctx->managed.deleter = &DeleteDLPack;
  return &ctx.release()->managed;
}

}  // namespace weightd
