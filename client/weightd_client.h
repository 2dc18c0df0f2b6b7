// C++ client of weightd: control-plane calls over gRPC and the shm data path.
//
//   auto client = weightd::Client::Connect({.socket = "/run/weightd.sock"});
//   auto shards = (*client)->Fetch({.model = "llama", .mesh = {{2}, {rank}}});
//   for (const weightd::TensorView& t : (*shards)->tensors()) use(t.data, t.length);
//
// A ShardSet owns its lease: while it lives, the bytes it maps stay valid and
// unchanged; destroying it releases the lease (and closes the data
// connection, which would release it too if the process died first).
// Client is thread-safe; a ShardSet is immutable after Fetch returns.
#ifndef WEIGHTD_CLIENT_WEIGHTD_CLIENT_H_
#define WEIGHTD_CLIENT_WEIGHTD_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/digest.h"
#include "common/dtype.h"
#include "common/fd.h"
#include "common/shard.h"

namespace weightd {

struct ClientOptions {
  std::string socket;  // unix socket path, or
  std::string target;  // HOST:PORT
  // TCP only. TLS is used when `tls` is set or any tls_* file is given:
  // tls_ca_file (PEM roots that verify the daemon; empty = system roots),
  // tls_cert_file + tls_key_file (client certificate for --tls-client-ca),
  // tls_server_name (name to verify instead of the target's host).
  bool tls = false;
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_server_name;
  // Bearer token sent on every call as "authorization: Bearer <token>"
  // (the daemon's --auth-token-file).
  std::string token;
  // Read-only calls (Health, List, GetModel, Stats, Verify, ListAdapters)
  // and Fetch retry on UNAVAILABLE (daemon down, draining, restarting on the
  // same sockets; also the CANCELLED a draining daemon answers) with exponential backoff (50 ms, x2, at most 2 s, +-20%
  // jitter) until this much time has passed; zero = fail at once. A Fetch is
  // retried whole, with a fresh data-socket connection. Mutating calls
  // (Load, Unload, LoadAdapter, UnloadAdapter, Apply, Release) and Watch are
  // never retried.
  absl::Duration retry_deadline = absl::Seconds(30);
};

struct ModelTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  Digest digest;
  std::vector<std::string> sources;
  std::vector<std::string> patched_by;
};

struct ModelInfo {
  std::string name;
  std::string path;
  uint64_t generation = 0;
  uint64_t tensor_count = 0;
  uint64_t total_bytes = 0;
  std::vector<std::string> files;
  std::vector<std::string> adapters;  // current stack, "name:strength"
  std::vector<std::string> report;    // profile report lines
  std::vector<ModelTensor> tensors;   // filled by GetModel only
  std::vector<std::string> readers;   // empty = public
  // The checkpoint's segments by page kind (4 KiB, THP, 2 MiB hugetlb).
  uint64_t segment_bytes_4k = 0, segment_bytes_thp = 0, segment_bytes_hugetlb = 0;
  // Identity of the current generation's weights (hex): a digest over
  // (served name, tensor digest) of every served tensor; the same on every
  // daemon serving the same checkpoint, profile and adapter stack.
  std::string weights_id;
};

struct AdapterInfo {
  std::string name, path, format;
  uint64_t tensor_count = 0, bytes = 0;
  std::vector<std::string> ignored;
  std::vector<std::string> readers;  // empty = public
};

struct AdapterStrength {
  std::string name;
  float strength = 1.0f;
};

struct GenerationEvent {
  std::string model;
  uint64_t generation = 0;
  std::vector<std::string> adapters;
  std::string weights_id;  // as ModelInfo::weights_id
};

struct LoadProgressUpdate {
  uint64_t bytes_done = 0, bytes_total = 0, tensors_done = 0, tensors_total = 0;
  std::string current_file;
  // Where the bytes done came from: storage, and peers (their addresses).
  uint64_t bytes_from_storage = 0, bytes_from_peers = 0;
  std::vector<std::string> peers;
  bool done = false;  // the last update, once the model is loaded
  // Per entry of `peers`: what carried its bytes ("grpc", "ucx", "grpc+ucx").
  std::vector<std::string> peer_transports;
};

// A GPU the daemon found (named by UUID on the wire).
struct GpuInfo {
  std::string uuid, name, pci_bus_id;
  uint64_t memory_bytes = 0;
  int ordinal = 0;  // the daemon's CUDA index
  int compute_major = 0, compute_minor = 0;
  bool pageable_memory_access = false, host_register = false, host_register_read_only = false;
  std::string unavailable;  // "" while the daemon can use it, else why not
};

// Models.Peers: the fleet's other daemons as this one last polled them.
struct PeerModelInfo {
  std::string name;
  uint64_t generation = 0;
  std::string weights_id;
};
struct PeerInfo {
  std::string address;
  bool reachable = false;
  std::string error;
  int64_t last_seen_unix_ms = 0;  // 0 = never
  int64_t polled_unix_ms = 0;     // 0 = not yet
  std::vector<PeerModelInfo> models;
};
struct PeersInfo {
  std::string advertise;
  std::string peer_dns, dns_error;
  uint32_t poll_seconds = 0;
  std::vector<PeerInfo> peers;
};

struct DaemonStats {
  uint64_t models = 0, segments = 0, bytes_resident = 0, materializations = 0,
           materialization_bytes = 0, cache_hits = 0, cache_misses = 0, leases_open = 0,
           bytes_served = 0, fetches = 0, applies = 0, adapters = 0;
  uint64_t reserve_ready_bytes = 0, reserve_target_bytes = 0;
  uint64_t bytes_read = 0;  // asked for by grpc-transport Reads
  // Checkpoint bytes per model, summed, and held (shared checkpoints once).
  uint64_t checkpoint_bytes_logical = 0, checkpoint_bytes_resident = 0;
  uint64_t pushes = 0, push_bytes = 0;  // pushes into clients' memory
  // Publishes committed, their bytes, seconds (summed), sessions open now.
  uint64_t publishes = 0, publish_bytes = 0, publish_sessions = 0;
  // Sessions begun on staging prepared ahead / allocated at begin; the
  // bytes prepared and waiting now (--publish-staging-ahead).
  uint64_t publish_staging_prepared = 0, publish_staging_allocated = 0,
           publish_staging_ahead_bytes = 0;
  // Published bytes of the current generations summed over models, and the
  // segments holding them beside the checkpoints' (shared bytes once).
  uint64_t published_bytes_logical = 0, published_bytes_resident = 0;
  double publish_seconds = 0;
  // Checkpoint bytes loads took from storage and from peers; per peer the
  // bytes received and ranges it failed; bytes sent to peers loading.
  uint64_t load_bytes_storage = 0, load_bytes_peers = 0, bytes_sent_to_peers = 0;
  // Remote sources (--model-source): bytes, requests, retries, failures.
  uint64_t source_bytes = 0, source_requests = 0, source_retries = 0, source_failures = 0;
  struct PeerTransfer {
    std::string peer;
    uint64_t bytes = 0, failures = 0;
  };
  std::vector<PeerTransfer> peer_transfers;
  struct PeerTransportStats {  // reads by peer and transport (--peer-transport)
    std::string peer, transport;
    uint64_t bytes = 0, failures = 0;
    double seconds = 0;
  };
  std::vector<PeerTransportStats> peer_transports;
  uint64_t pinned_bytes = 0;            // host memory registered with CUDA
  // Live segments' bytes by pages (--huge-pages), and the host's 2 MiB pool.
  uint64_t segment_bytes_4k = 0, segment_bytes_thp = 0, segment_bytes_hugetlb = 0;
  uint64_t huge_page_fallbacks = 0;
  std::string huge_pages;  // the daemon's --huge-pages mode
  uint64_t hugetlb_pages_total = 0, hugetlb_pages_free = 0;
  std::string shmem_thp;
  bool cuda_built = false;
  std::vector<GpuInfo> gpus;     // found by the daemon at start-up
  std::string gpus_unavailable;  // why none
};

// kShm: the daemon's sealed segments, mapped read-only (zero-copy).
// kGrpc: the tensors' bytes streamed over gRPC (remote clients).
// kPush: the client allocates one memfd (its own memory, writable), the
//   daemon writes the shard into it over the data socket (docs/DESIGN.md §9.1, §4.5, the
//   host twin of the CUDA push) and the lease ends once the bytes are in
//   place; tensors lie at the default layout's offsets (common/push_layout.h).
// kCuda: the same into GPU memory: the client allocates a CUDA VMM
//   allocation on FetchOptions::cuda_device (through the driver,
//   libcuda.so.1, found at run time), the daemon pushes into it (the WDC1
//   request), and the bytes are copied back to host memory for the views
//   (so a file written from them can be compared with the CPU path; the
//   GPU allocation is freed). Needs a client built with CUDA headers.
enum class Transport { kShm, kGrpc, kPush, kCuda };

struct FetchOptions {
  std::string model;
  MeshCoord mesh{{1}, {0}};
  std::optional<std::vector<Placement>> placements;
  std::optional<DType> dtype;  // nullopt = keep
  std::vector<std::string> names;
  Transport transport = Transport::kShm;
  uint64_t generation = 0;
  uint64_t changed_since = 0;
  // Recompute every tensor's digest on arrival; DATA_LOSS on a mismatch.
  bool verify_digests = false;
  // shm: fill the page tables of this shard's bytes before Fetch returns,
  // so first reads do not fault page by page.
  bool populate = true;
  // kCuda: this process's CUDA device index.
  int cuda_device = 0;
  // kPush, kCuda: a tensor that needs only a cast of its stored bytes is
  // cast by the daemon as it pushes it (on the GPU for kCuda), not into a
  // copy it keeps (FetchRequest.defer_casts); such tensors have no digest
  // (TensorView::cast_on_push). Off when verify_digests asks for them all.
  bool cast_on_push = true;
  // With cast_on_push: patched tensors (LoRA, dense; not DoRA) on whole
  // rows are merged by the push too, element by element
  // (FetchRequest.defer_merges). nullopt: on for kCuda (the GPU merges),
  // off for kPush (the host twin is slower than the daemon's vectorized
  // merge).
  std::optional<bool> merge_on_push;
};

struct TensorView {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<int64_t> global_shape;
  std::vector<int64_t> global_offset;
  // Valid while the ShardSet lives; kPush: the client's own memory (the
  // ShardSet's writable memfd mapping: const_cast is fine).
  const uint8_t* data = nullptr;
  uint64_t length = 0;
  Digest digest;
  // Cast by the push (FetchOptions::cast_on_push): `digest` is unset.
  bool cast_on_push = false;
  // Where `data` points: -1 = host memory, which every transport gives
  // today (kCuda copies back to host). A view left in GPU memory (issue
  // [gpu]) names its CUDA device here, and `data` is then a device pointer
  // the CPU must not read.
  int device = -1;
};

// One tensor to publish: a served name of the model, in the dtype and shape
// the model stores it in, and its bytes (row-major), borrowed for the call.
struct PublishTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  uint64_t length = 0;
};

struct PublishOptions {
  uint64_t expect_generation = 0;  // 0 = any; else ABORTED when the model moved on
  absl::Duration timeout = absl::Minutes(10);
  // Called after each chunk the daemon took: (bytes done, bytes total);
  // with kShm after each tensor copied in.
  std::function<void(uint64_t, uint64_t)> progress;
  // kShm: each tensor copied once, straight into the session's staging
  // memfd (taken on the data socket: a daemon on this node), then declared;
  // kGrpc: streamed in chunks of <= 4 MiB. nullopt: kShm when this client
  // reached the daemon over a Unix socket, else kGrpc. Others:
  // INVALID_ARGUMENT.
  std::optional<Transport> transport;
};

struct PublishOutcome {
  std::string model;
  uint64_t generation = 0;  // the new one (the current one when nothing changed)
  std::string weights_id;
  uint64_t tensors = 0, changed = 0, bytes = 0, bytes_stored = 0;
  std::vector<std::string> adapters;  // the stack merged again on the new weights
  // Changed bytes some loaded model already held, shared instead of stored
  // again, and those models.
  uint64_t bytes_shared = 0;
  std::vector<std::string> shared_with;
};

class Client;

// DLPack (https://dmlc.github.io/dlpack): the unversioned ABI that
// torch.utils.dlpack.from_dlpack, CuPy, JAX and NumPy take, declared here
// under weightd::dl (so a program that includes dlpack.h too sees no
// clash; the layouts are the same).
namespace dl {
struct DLDevice {
  int32_t device_type;  // 1 kDLCPU, 2 kDLCUDA
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;  // 0 int, 1 uint, 2 float, 4 bfloat, 6 bool
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // null: compact row-major
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};
}  // namespace dl

class ShardSet;

// A DLPack view of tensors()[index] of `set` that keeps the set (and so its
// lease and memory) alive until the consumer calls its deleter; hand it to a
// framework (e.g. as a PyCapsule named "dltensor"). Host memory (device
// kDLCPU): read-only for the shm transport (a write faults), the client's
// own for kPush. INVALID_ARGUMENT for an index out of range; UNIMPLEMENTED
// for FP8 (DLPack's unversioned ABI has no FP8 code: take TensorView::data).
absl::StatusOr<dl::DLManagedTensor*> ToDLPack(std::shared_ptr<const ShardSet> set,
                                              size_t index);

class ShardSet {
 public:
  ~ShardSet();  // releases the lease
  ShardSet(const ShardSet&) = delete;
  ShardSet& operator=(const ShardSet&) = delete;

  uint64_t generation() const { return generation_; }
  const std::string& weights_id() const { return weights_id_; }  // the generation's
  // 0 once no lease is held (kPush: the lease ends when the push is done).
  uint64_t lease_id() const { return lease_id_; }
  // kPush: the memfd the tensors live in (the ShardSet keeps it open);
  // -1 otherwise.
  int push_memfd() const { return push_memfd_.get(); }
  const std::vector<TensorView>& tensors() const { return tensors_; }

  // Releases now; later calls are no-ops. The views dangle afterwards.
  absl::Status Release();

 private:
  friend class Client;
  ShardSet() = default;

  std::shared_ptr<class ClientChannel> channel_;
  uint64_t lease_id_ = 0;
  std::string token_;
  uint64_t generation_ = 0;
  std::string weights_id_;
  std::vector<TensorView> tensors_;
  UniqueFd data_connection_;               // shm: holds the lease
  std::vector<MappedRegion> maps_;         // shm: read-only segment maps
  std::vector<std::string> buffers_;       // grpc: the tensors' byte ranges
  UniqueFd push_memfd_;                    // push: the destination
  MappedRegion push_map_;                  // push: its read-write mapping
  bool released_ = false;
};

class Client {
 public:
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  ~Client();

  // OK iff the daemon reports SERVING.
  absl::Status Health();
  absl::StatusOr<ModelInfo> Load(const std::string& name, const std::string& path,
                                 const std::string& profile_json,
                                 const std::function<void(const LoadProgressUpdate&)>& progress,
                                 const std::vector<std::string>& readers = {},
                                 // "auto" (peers holding the same files, else
                                 // storage), "storage" or "peers".
                                 const std::string& source = "auto");
  absl::Status Unload(const std::string& name);
  absl::StatusOr<std::vector<ModelInfo>> List();
  absl::StatusOr<ModelInfo> GetModel(const std::string& name);
  absl::StatusOr<DaemonStats> Stats();
  absl::StatusOr<PeersInfo> Peers();
  // Recomputes every resident tensor's digest in the daemon; DATA_LOSS on a
  // mismatch. Returns (tensors, bytes) checked.
  absl::StatusOr<std::pair<uint64_t, uint64_t>> Verify(const std::string& name);
  absl::StatusOr<std::unique_ptr<ShardSet>> Fetch(const FetchOptions& options);

  absl::StatusOr<AdapterInfo> LoadAdapter(const std::string& name, const std::string& path,
                                          const std::string& format, bool strict,
                                          const std::vector<std::string>& readers = {},
                                          // as Load's: "auto", "storage" or "peers"
                                          const std::string& source = "auto");
  absl::Status UnloadAdapter(const std::string& name);
  absl::StatusOr<std::vector<AdapterInfo>> ListAdapters();
  // Sets the model's whole stack; returns the new generation.
  absl::StatusOr<GenerationEvent> Apply(const std::string& model,
                                        const std::vector<AdapterStrength>& stack,
                                        uint64_t expect_generation);
  // Publishes new base weights for `model` (admins): one session, the
  // bytes written in place or streamed (PublishOptions::transport), the
  // generation made when the last byte lands (Models.BeginPublish /
  // PublishWrite / CommitPublish). On any error the session is aborted:
  // nothing is published.
  absl::StatusOr<PublishOutcome> Publish(const std::string& model,
                                         const std::vector<PublishTensor>& tensors,
                                         const PublishOptions& options = {});
  // Calls `on_event` for each new generation until it returns false or the
  // stream ends. include_current: report the current generation first.
  absl::Status Watch(const std::string& model, bool include_current,
                     const std::function<bool(const GenerationEvent&)>& on_event);

 private:
  Client(std::shared_ptr<ClientChannel> channel, absl::Duration retry_deadline);
  absl::StatusOr<std::unique_ptr<ShardSet>> FetchOnce(const FetchOptions& options);
  std::shared_ptr<ClientChannel> channel_;
  absl::Duration retry_deadline_;
};

}  // namespace weightd

#endif  // WEIGHTD_CLIENT_WEIGHTD_CLIENT_H_
