// Client and ShardSet: the control-plane calls and the fetch that ties a
// lease to the bytes it names. The parts live beside this file: the
// channel (channel.h), the retry loop (retry.h), message conversion
// (convert.h), the data socket (data_socket.h), the grpc transport's reads
// (grpc_read.h), publishing (publish.cc), DLPack (dlpack.cc), and the CUDA
// push (cuda/).
#include "client/weightd_client.h"

#include <chrono>
#include <cstring>

#include <grpcpp/client_context.h>

#include "absl/strings/str_cat.h"
#include "client/channel.h"
#include "client/convert.h"
#include "client/cuda/cuda_push.h"
#include "client/data_socket.h"
#include "client/grpc_read.h"
#include "client/retry.h"
#include "common/grpc/status_convert.h"
#include "common/status_macros.h"
#include "proto/convert/dtype_convert.h"

namespace weightd {
namespace {

v1::FetchRequest FetchRequestOf(const FetchOptions& options) {
  v1::FetchRequest req;
  req.set_model(options.model);
  req.set_generation(options.generation);
  for (int64_t d : options.mesh.shape) req.add_mesh_shape(d);
  for (int64_t c : options.mesh.coord) req.add_coord(c);
  if (options.placements.has_value()) {
    for (const Placement& p : *options.placements) req.add_placements()->set_shard_dim(p.shard_dim);
  }
  if (options.dtype.has_value()) req.set_dtype(ToProtoDType(*options.dtype));
  for (const std::string& n : options.names) req.add_names(n);
  req.set_transport(options.transport == Transport::kGrpc ? v1::GRPC : v1::SHM);
  req.set_changed_since(options.changed_since);
  req.set_defer_casts(options.cast_on_push && !options.verify_digests &&
                      (options.transport == Transport::kPush ||
                       options.transport == Transport::kCuda));
  if (req.defer_casts()) {
    req.set_defer_merges(options.merge_on_push.value_or(options.transport == Transport::kCuda));
  }
  return req;
}

// Every tensor inside its segment (a tensor cast by the push names its
// stored bytes, not `length` bytes of its dtype: only the daemon reads
// them).
absl::Status CheckTensorsInSegments(const v1::FetchResponse& resp) {
  for (const v1::ShardTensor& t : resp.tensors()) {
    if (t.segment() >= static_cast<uint32_t>(resp.segment_sizes_size()) ||
        t.offset() > resp.segment_sizes(t.segment()) ||
        (!t.cast_on_push() && t.length() > resp.segment_sizes(t.segment()) - t.offset())) {
      return absl::InternalError(absl::StrCat("daemon sent tensor \"", t.name(),
                                              "\" outside its segment"));
    }
  }
  return absl::OkStatus();
}

// shm: the lease attached on `conn`, each segment mapped read-only into
// `maps`; each tensor's bytes in them.
absl::StatusOr<std::vector<const uint8_t*>> DeliverShm(const v1::FetchResponse& resp,
                                                       UniqueFd* conn,
                                                       std::vector<MappedRegion>* maps) {
  std::vector<UniqueFd> fds;
  WD_RETURN_IF_ERROR(AttachLease(resp.data_socket(), resp, conn, &fds));
  for (int i = 0; i < resp.segment_sizes_size(); ++i) {
    WD_ASSIGN_OR_RETURN(MappedRegion map,
                        MappedRegion::Map(fds[i].get(), resp.segment_sizes(i),
                                          MappedRegion::Mode::kReadOnly));
    maps->push_back(std::move(map));
  }
  std::vector<const uint8_t*> data;
  for (const v1::ShardTensor& t : resp.tensors()) {
    const uint8_t* base = (*maps)[t.segment()].data();
    data.push_back(base == nullptr ? nullptr : base + t.offset());
  }
  return data;
}

// kPush: the shard pushed into a memfd of the client's (`memfd`, mapped
// read-write as `map`); each tensor's bytes there, nullptr for empty ones.
absl::StatusOr<std::vector<const uint8_t*>> DeliverPush(const v1::FetchResponse& resp,
                                                        UniqueFd* memfd, MappedRegion* map) {
  std::vector<uint64_t> offsets;
  WD_RETURN_IF_ERROR(PushIntoNewMemfd(resp, memfd, map, &offsets));
  std::vector<const uint8_t*> data;
  for (int i = 0; i < resp.tensors_size(); ++i) {
    data.push_back(resp.tensors(i).length() == 0 ? nullptr : map->data() + offsets[i]);
  }
  return data;
}

// kCuda: the shard pushed into GPU memory and copied back into `buffers`
// (one per tensor); each tensor's bytes there, nullptr for empty ones.
absl::StatusOr<std::vector<const uint8_t*>> DeliverCuda(const v1::FetchResponse& resp,
                                                        int device,
                                                        std::vector<std::string>* buffers) {
  WD_RETURN_IF_ERROR(PushIntoCudaAndCopyBack(resp, device, buffers));
  std::vector<const uint8_t*> data;
  for (int i = 0; i < resp.tensors_size(); ++i) {
    data.push_back(resp.tensors(i).length() == 0
                       ? nullptr
                       : reinterpret_cast<const uint8_t*>((*buffers)[i].data()));
  }
  return data;
}

// The view of tensor `t` whose bytes are at `data`. shm (`map` set): this
// shard's pages of the segment filled first when `options.populate`.
absl::StatusOr<TensorView> ViewOf(const v1::ShardTensor& t, const uint8_t* data,
                                  const FetchOptions& options, const MappedRegion* map) {
  TensorView v;
  v.name = t.name();
  WD_ASSIGN_OR_RETURN(v.dtype, DTypeFromDaemon(t.dtype()));
  v.shape.assign(t.shape().begin(), t.shape().end());
  v.global_shape.assign(t.global_shape().begin(), t.global_shape().end());
  v.global_offset.assign(t.global_offset().begin(), t.global_offset().end());
  v.data = data;
  v.length = t.length();
  if (t.digest().size() == 16) std::memcpy(v.digest.bytes.data(), t.digest().data(), 16);
  v.cast_on_push = t.cast_on_push();
  if (options.populate && map != nullptr) {
    // Only this shard's pages: the segment may hold the whole checkpoint.
    absl::Status populated = map->PopulateRead(t.offset(), t.length());
    if (!populated.ok() && populated.code() != absl::StatusCode::kUnimplemented) {
      return populated;
    }
  }
  if (options.verify_digests && DigestBytes(v.data, v.length) != v.digest) {
    return absl::DataLossError(absl::StrCat("tensor \"", v.name, "\": digest mismatch"));
  }
  return v;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  WD_ASSIGN_OR_RETURN(std::shared_ptr<ClientChannel> channel, MakeClientChannel(options));
  return std::unique_ptr<Client>(new Client(std::move(channel), options.retry_deadline));
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
                                  {msg.peers().begin(), msg.peers().end()}, msg.done(),
                                  {msg.peer_transports().begin(), msg.peer_transports().end()}});
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
  return ToPeersInfo(r);
}

absl::StatusOr<DaemonStats> Client::Stats() {
  v1::StatsRequest req;
  v1::StatsResponse r;
  WD_RETURN_IF_ERROR(Retrying(retry_deadline_, [&] {
    grpc::ClientContext ctx;
    return FromGrpc(channel_->models->Stats(&ctx, req, &r));
  }));
  return ToDaemonStats(r);
}

// Retried whole on UNAVAILABLE: a Fetch the daemon never handled granted no
// lease, and one granted by a daemon that then went away (data socket
// refused or closed, Read stream cut) died with it. Each attempt connects to
// the data socket afresh (there is no persistent data connection).
absl::StatusOr<std::unique_ptr<ShardSet>> Client::Fetch(const FetchOptions& options) {
  return Retrying(retry_deadline_, [&] { return FetchOnce(options); });
}

absl::StatusOr<std::unique_ptr<ShardSet>> Client::FetchOnce(const FetchOptions& options) {
  v1::FetchResponse resp;
  {
    grpc::ClientContext ctx;
    WD_RETURN_IF_ERROR(FromGrpc(channel_->shards->Fetch(&ctx, FetchRequestOf(options), &resp)));
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
  WD_RETURN_IF_ERROR(CheckTensorsInSegments(resp));
  absl::StatusOr<std::vector<const uint8_t*>> data;
  switch (options.transport) {
    case Transport::kShm:
      data = DeliverShm(resp, &set->data_connection_, &set->maps_);
      break;
    case Transport::kGrpc:
      // Only the tensors' ranges, never whole segments: a view-backed tensor
      // lives in a segment that may hold its whole checkpoint.
      data = ReadTensorRanges(channel_->shards.get(), resp, &set->buffers_);
      break;
    case Transport::kPush:
      data = DeliverPush(resp, &set->push_memfd_, &set->push_map_);
      if (data.ok()) set->lease_id_ = 0;  // ended with the push's connection
      break;
    case Transport::kCuda:
      data = DeliverCuda(resp, options.cuda_device, &set->buffers_);
      if (data.ok()) set->lease_id_ = 0;  // ended with the push's connection
      break;
  }
  WD_RETURN_IF_ERROR(data.status());
  for (int i = 0; i < resp.tensors_size(); ++i) {
    const v1::ShardTensor& t = resp.tensors(i);
    const MappedRegion* map =
        options.transport == Transport::kShm ? &set->maps_[t.segment()] : nullptr;
    WD_ASSIGN_OR_RETURN(TensorView v, ViewOf(t, (*data)[i], options, map));
    set->tensors_.push_back(std::move(v));
  }
  return set;
}

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

absl::Status Client::Watch(const std::string& model, bool include_current,
                           const std::function<bool(const GenerationEvent&)>& on_event) {
  grpc::ClientContext ctx;
  v1::WatchRequest req;
  req.set_model(model);
  req.set_include_current(include_current);
  auto reader = channel_->shards->Watch(&ctx, req);
  v1::GenerationEvent msg;
  while (reader->Read(&msg)) {
    if (!on_event(ToGenerationEvent(msg))) {
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

}  // namespace weightd
