#include "server/grpc/grpc_server.h"

#include <sys/stat.h>
#include <unistd.h>

#include <deque>
#include <mutex>
#include <utility>

#include <grpc/grpc.h>
#include <grpcpp/support/byte_buffer.h>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/fd.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "common/thread_pool.h"
#include "server/grpc/call_auth.h"
#include "server/grpc/call_drain.h"
#include "server/grpc/status_convert.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace weightd {
namespace {

constexpr size_t kReadChunkBytes = 4u << 20;  // DESIGN §5: chunks <= 4 MiB

void FillModelInfo(const ModelSummary& s, v1::ModelInfo* out) {
  out->set_name(s.name);
  out->set_path(s.path);
  out->set_generation(s.generation);
  out->set_tensor_count(s.tensor_count);
  out->set_total_bytes(s.total_bytes);
  for (const std::string& f : s.files) out->add_files(f);
  for (const std::string& a : s.adapters) out->add_adapters(a);
  for (const std::string& r : s.report) out->add_report(r);
  for (const std::string& r : s.readers) out->add_readers(r);
}

void FillAdapterInfo(const AdapterSummary& a, v1::AdapterInfo* out) {
  out->set_name(a.name);
  out->set_path(a.path);
  out->set_format(a.format);
  out->set_tensor_count(a.tensor_count);
  out->set_bytes(a.bytes);
  for (const std::string& i : a.ignored) out->add_ignored(i);
  for (const std::string& r : a.readers) out->add_readers(r);
}

// A server stream fed by a producer thread. Push() queues a message (the
// newest replaceable one supersedes a queued replaceable one, so a slow
// reader never makes progress reports pile up); Close() ends the stream once
// the queue drains. After Close() the producer must not touch the reactor.
template <typename T>
class QueuedWriter : public grpc::ServerWriteReactor<T> {
 public:
  QueuedWriter() = default;
  // Counts as a call in flight (CallDrain) until the stream is done.
  explicit QueuedWriter(CallDrain::Hold hold) : hold_(std::move(hold)) {}

  void Push(T msg, bool replaceable) {
    {
      absl::MutexLock lock(&mu_);
      if (cancelled_) return;
      if (replaceable && !queue_.empty() && queue_.back().second) {
        queue_.back().first = std::move(msg);
      } else {
        queue_.emplace_back(std::move(msg), replaceable);
      }
      if (writing_) return;
      writing_ = true;
      current_ = std::move(queue_.front().first);
      queue_.pop_front();
    }
    this->StartWrite(&current_);
  }

  bool cancelled() {
    absl::MutexLock lock(&mu_);
    return cancelled_;
  }

  void Close(grpc::Status status) {
    {
      absl::MutexLock lock(&mu_);
      closed_ = true;
      final_ = std::move(status);
      if (writing_ || !queue_.empty()) return;  // OnWriteDone finishes
    }
    this->Finish(final_);
  }

 private:
  void OnWriteDone(bool ok) override {
    bool start = false;
    bool finish = false;
    grpc::Status status;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok) {
        cancelled_ = true;
        queue_.clear();
      }
      if (!queue_.empty()) {
        writing_ = start = true;
        current_ = std::move(queue_.front().first);
        queue_.pop_front();
      } else if (closed_) {
        finish = true;
        status = cancelled_ ? grpc::Status::CANCELLED : final_;
      }
    }
    if (start) {
      this->StartWrite(&current_);
    } else if (finish) {
      this->Finish(status);
    }
  }
  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
  }
  void OnDone() override { delete this; }  // gRPC reactor idiom

  CallDrain::Hold hold_;
  absl::Mutex mu_;
  std::deque<std::pair<T, bool>> queue_;
  T current_;
  bool writing_ = false;
  bool closed_ = false;
  bool cancelled_ = false;
  grpc::Status final_;
};

// Streams one ReadRange in <= 4 MiB chunks, producing each on demand.
class ReadReactor : public grpc::ServerWriteReactor<v1::ReadChunk> {
 public:
  ReadReactor(ReadRange range, CallDrain::Hold hold)
      : range_(std::move(range)), hold_(std::move(hold)) {
    Next();
  }

 private:
  void Next() {
    if (pos_ >= range_.length) {
      Finish(grpc::Status::OK);
      return;
    }
    size_t n = static_cast<size_t>(std::min<uint64_t>(kReadChunkBytes, range_.length - pos_));
    chunk_.set_offset(pos_);
    chunk_.set_data(reinterpret_cast<const char*>(range_.segment->data() + range_.offset + pos_),
                    n);
    pos_ += n;
    StartWrite(&chunk_);
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::CANCELLED);
      return;
    }
    Next();
  }
  void OnDone() override { delete this; }  // gRPC reactor idiom

  ReadRange range_;
  CallDrain::Hold hold_;
  uint64_t pos_ = 0;
  v1::ReadChunk chunk_;
};

// Finishes a unary call refused by access control.
grpc::ServerUnaryReactor* Refuse(grpc::CallbackServerContext* ctx, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// The same for a server stream.
template <typename T>
grpc::ServerWriteReactor<T>* RefuseStream(const absl::Status& status) {
  auto* writer = new QueuedWriter<T>();  // deletes itself in OnDone
  writer->Close(ToGrpcStatus(status));
  return writer;
}

// A unary call counted in flight (CallDrain) until gRPC is done with it.
class HeldUnaryReactor : public grpc::ServerUnaryReactor {
 public:
  explicit HeldUnaryReactor(CallDrain::Hold hold) : hold_(std::move(hold)) {}

 private:
  void OnDone() override { delete this; }  // gRPC reactor idiom
  CallDrain::Hold hold_;
};

// Runs `fn` on the worker pool (or, with a null pool, at once on gRPC's
// callback thread: for work of microseconds) and finishes the unary call
// with its status; UNAVAILABLE once the daemon drains.
grpc::ServerUnaryReactor* RunOnPool(grpc::CallbackServerContext* ctx, ThreadPool* pool,
                                    CallDrain* drain, std::function<absl::Status()> fn) {
  auto hold = drain->Enter();
  if (!hold.ok()) return Refuse(ctx, hold.status());
  auto* reactor = new HeldUnaryReactor(std::move(*hold));  // deletes itself in OnDone
  if (pool == nullptr) {
    reactor->Finish(ToGrpcStatus(fn()));
  } else {
    pool->Schedule([reactor, fn = std::move(fn)] { reactor->Finish(ToGrpcStatus(fn())); });
  }
  return reactor;
}

absl::StatusOr<FetchParams> DecodeFetch(const v1::FetchRequest& req) {
  FetchParams p;
  p.model = req.model();
  p.generation = req.generation();
  p.mesh.shape.assign(req.mesh_shape().begin(), req.mesh_shape().end());
  p.mesh.coord.assign(req.coord().begin(), req.coord().end());
  if (p.mesh.shape.empty()) {
    p.mesh.shape = {1};
    if (p.mesh.coord.empty()) p.mesh.coord = {0};
  }
  if (req.placements_size() > 0) {
    std::vector<Placement> pl;
    for (const v1::Placement& x : req.placements()) {
      if (x.shard_dim() < -1) {
        return absl::InvalidArgumentError(absl::StrCat("bad placement shard_dim ", x.shard_dim()));
      }
      pl.push_back(Placement{x.shard_dim()});
    }
    p.placements = std::move(pl);
  }
  if (req.dtype() != v1::DTYPE_UNSPECIFIED) {
    auto d = FromProtoDType(req.dtype());
    if (!d.ok()) return d.status();
    p.dtype = *d;
  }
  p.names.assign(req.names().begin(), req.names().end());
  switch (req.transport()) {
    case v1::TRANSPORT_UNSPECIFIED:
    case v1::SHM: p.transport = TransportKind::kShm; break;
    case v1::GRPC: p.transport = TransportKind::kGrpc; break;
    case v1::CUDA: p.transport = TransportKind::kCuda; break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("unknown transport ", req.transport()));
  }
  p.changed_since = req.changed_since();
  return p;
}

// Counts the streams of one kind that hold a thread, up to a cap.
class StreamSlots {
 public:
  // One stream counted until it is destroyed. Move-only.
  class Slot {
   public:
    Slot() = default;
    Slot(Slot&& other) noexcept : slots_(std::exchange(other.slots_, nullptr)) {}
    Slot& operator=(Slot&&) = delete;
    ~Slot() {
      if (slots_ != nullptr) slots_->Release();
    }

   private:
    friend class StreamSlots;
    explicit Slot(StreamSlots* slots) : slots_(slots) {}
    StreamSlots* slots_ = nullptr;
  };

  // `what`: "Watch streams"; `flag`: the flag that sets `max`.
  StreamSlots(int max, std::string what, std::string flag)
      : max_(max), what_(std::move(what)), flag_(std::move(flag)) {}

  // A slot, or RESOURCE_EXHAUSTED naming the cap when all are taken.
  absl::StatusOr<Slot> Acquire() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (open_ >= max_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          open_, " ", what_, " are open, the daemon's limit (", flag_,
          "); try again once one ends"));
    }
    ++open_;
    return Slot(this);
  }

 private:
  void Release() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    --open_;
  }

  const int max_;
  const std::string what_;
  const std::string flag_;
  absl::Mutex mu_;
  int open_ ABSL_GUARDED_BY(mu_) = 0;
};

class ModelsImpl final : public v1::Models::CallbackService {
 public:
  ModelsImpl(WeightService* service, ThreadPool* pool, CallDrain* drain,
             const CallAuthenticator* auth)
      : service_(service), pool_(pool), drain_(drain), auth_(auth) {}

  grpc::ServerWriteReactor<v1::LoadProgress>* Load(grpc::CallbackServerContext* ctx,
                                                   const v1::LoadRequest* req) override {
    auto who = auth_->AuthenticateAdmin(ctx, "load models");
    if (!who.ok()) return RefuseStream<v1::LoadProgress>(who.status());
    auto hold = drain_->Enter();
    if (!hold.ok()) return RefuseStream<v1::LoadProgress>(hold.status());
    // Deletes itself in OnDone, which is after the thread's Close().
    auto* writer = new QueuedWriter<v1::LoadProgress>(std::move(*hold));
    v1::LoadRequest copy = *req;
    absl::Status started = StartDetachedThread([this, writer, copy = std::move(copy)] {
      std::vector<std::string> readers(copy.readers().begin(), copy.readers().end());
      auto result = service_->LoadModel(
          copy.name(), copy.path(), copy.profile_json(), [writer](const LoadProgressInfo& p) {
            v1::LoadProgress msg;
            msg.set_bytes_done(p.bytes_done);
            msg.set_bytes_total(p.bytes_total);
            msg.set_tensors_done(p.tensors_done);
            msg.set_tensors_total(p.tensors_total);
            msg.set_current_file(p.current_file);
            writer->Push(std::move(msg), /*replaceable=*/true);
          },
          readers);
      if (result.ok()) {
        v1::LoadProgress done;
        done.set_done(true);
        done.set_bytes_done(result->total_bytes);
        done.set_bytes_total(result->total_bytes);
        done.set_tensors_done(result->tensor_count);
        done.set_tensors_total(result->tensor_count);
        FillModelInfo(*result, done.mutable_model());
        writer->Push(std::move(done), /*replaceable=*/false);
      }
      writer->Close(ToGrpcStatus(result.status()));
    });
    if (!started.ok()) writer->Close(ToGrpcStatus(started));
    return writer;
  }

  grpc::ServerUnaryReactor* Unload(grpc::CallbackServerContext* ctx,
                                   const v1::UnloadRequest* req,
                                   v1::UnloadResponse*) override {
    auto who = auth_->AuthenticateAdmin(ctx, "unload models");
    if (!who.ok()) return Refuse(ctx, who.status());
    return RunOnPool(ctx, pool_, drain_, [this, req] { return service_->UnloadModel(req->name()); });
  }

  grpc::ServerUnaryReactor* List(grpc::CallbackServerContext* ctx, const v1::ListModelsRequest*,
                                 v1::ListModelsResponse* resp) override {
    auto who = auth_->Authenticate(ctx);
    if (!who.ok()) return Refuse(ctx, who.status());
    // Only the models the caller may read.
    for (const ModelSummary& s : service_->ListModels()) {
      if (auth_->policy().CheckRead(*who, s.guards).ok()) FillModelInfo(s, resp->add_models());
    }
    auto* reactor = ctx->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerUnaryReactor* Get(grpc::CallbackServerContext* ctx, const v1::GetModelRequest* req,
                                v1::ModelInfo* resp) override {
    auto who = auth_->Authenticate(ctx);
    if (!who.ok()) return Refuse(ctx, who.status());
    return RunOnPool(ctx, pool_, drain_, [this, req, resp, who = std::move(*who)]() -> absl::Status {
      auto detail = service_->GetModel(req->name());
      if (!detail.ok()) return detail.status();
      WD_RETURN_IF_ERROR(auth_->policy().CheckRead(who, detail->summary.guards));
      FillModelInfo(detail->summary, resp);
      for (const TensorSummary& t : detail->tensors) {
        v1::TensorInfo* ti = resp->add_tensors();
        ti->set_name(t.name);
        ti->set_dtype(ToProtoDType(t.dtype));
        for (int64_t d : t.shape) ti->add_shape(d);
        ti->set_digest(std::string(t.digest.View()));
        for (const std::string& src : t.sources) ti->add_sources(src);
        for (const std::string& a : t.patched_by) ti->add_patched_by(a);
      }
      return absl::OkStatus();
    });
  }

  grpc::ServerUnaryReactor* Verify(grpc::CallbackServerContext* ctx, const v1::VerifyRequest* req,
                                   v1::VerifyResponse* resp) override {
    auto who = auth_->Authenticate(ctx);
    if (!who.ok()) return Refuse(ctx, who.status());
    return RunOnPool(ctx, pool_, drain_, [this, req, resp, who = std::move(*who)]() -> absl::Status {
      WD_RETURN_IF_ERROR(service_->CheckCanRead(req->name(), who));
      auto r = service_->Verify(req->name());
      if (!r.ok()) return r.status();
      resp->set_tensors(r->tensors);
      resp->set_bytes(r->bytes);
      return absl::OkStatus();
    });
  }

  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* ctx, const v1::StatsRequest*,
                                  v1::StatsResponse* resp) override {
    auto who = auth_->Authenticate(ctx);
    if (!who.ok()) return Refuse(ctx, who.status());
    ServiceStats s = service_->Stats();
    resp->set_models(s.models);
    resp->set_segments(s.segments);
    resp->set_bytes_resident(s.bytes_resident);
    resp->set_materializations(s.materializer.entries);
    resp->set_materialization_bytes(s.materializer.packed_bytes);
    resp->set_cache_hits(s.materializer.hits);
    resp->set_cache_misses(s.materializer.misses);
    resp->set_leases_open(s.leases_open);
    resp->set_bytes_served(s.bytes_served);
    resp->set_bytes_read(s.bytes_read);
    resp->set_fetches(s.fetches);
    resp->set_applies(s.applies);
    resp->set_adapters(s.adapters);
    resp->set_reserve_ready_bytes(s.reserve.ready_bytes);
    resp->set_reserve_target_bytes(s.reserve.target_bytes);
    auto* reactor = ctx->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

 private:
  WeightService* service_;
  ThreadPool* pool_;
  CallDrain* drain_;
  const CallAuthenticator* auth_;
};

// The FetchResponse of `table` without lease_id and token (fields 1 and 2),
// serialized once per table: protobuf merges concatenated messages, so a
// response is the per-lease head followed by these bytes.
const std::string& EncodedTable(const FetchTable& table) {
  std::call_once(table.wire_once, [&table] {
    v1::FetchResponse body;
    body.set_generation(table.generation);
    body.set_data_socket(table.data_socket);
    for (uint64_t s : table.segment_sizes) body.add_segment_sizes(s);
    for (const FetchedTensor& t : table.tensors) {
      v1::ShardTensor* st = body.add_tensors();
      st->set_name(t.name);
      st->set_dtype(ToProtoDType(t.dtype));
      for (int64_t d : t.shape) st->add_shape(d);
      for (int64_t d : t.global_shape) st->add_global_shape(d);
      for (int64_t d : t.global_offset) st->add_global_offset(d);
      st->set_segment(t.segment);
      st->set_offset(t.offset);
      st->set_length(t.length);
      st->set_digest(std::string(t.digest.View()));
    }
    body.SerializeToString(&table.wire);
  });
  return table.wire;
}

void ReleaseTable(void* table) { delete static_cast<std::shared_ptr<const FetchTable>*>(table); }

// The response bytes: a fresh head (lease id, token) and the table's shared
// encoding, sent without a copy (the slice keeps the table alive).
grpc::ByteBuffer EncodeFetchResponse(const FetchResult& result) {
  v1::FetchResponse head;
  head.set_lease_id(result.lease.id);
  head.set_token(std::string(reinterpret_cast<const char*>(result.lease.token.data()),
                             result.lease.token.size()));
  std::string head_bytes = head.SerializeAsString();
  const std::string& body = EncodedTable(*result.table);
  grpc::Slice slices[2] = {
      grpc::Slice(head_bytes),
      grpc::Slice(const_cast<char*>(body.data()), body.size(), &ReleaseTable,
                  new std::shared_ptr<const FetchTable>(result.table))};
  return grpc::ByteBuffer(slices, 2);
}

// A fetch's outcome as the call's response (or its error).
absl::Status EncodeFetchResponse(const absl::StatusOr<FetchResult>& result,
                                 grpc::ByteBuffer* resp) {
  if (!result.ok()) return result.status();
  *resp = EncodeFetchResponse(*result);
  return absl::OkStatus();
}

absl::StatusOr<v1::FetchRequest> ParseFetchRequest(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  v1::FetchRequest req;
  std::string bytes;
  if (buffer.Dump(&slices).ok()) {
    for (const grpc::Slice& sl : slices) {
      bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
    }
    if (req.ParseFromString(bytes)) return req;
  }
  return absl::InvalidArgumentError("malformed FetchRequest");
}

// Fetch is a raw method: its response is assembled from a cached encoding.
using ShardsBase = v1::Shards::WithRawCallbackMethod_Fetch<v1::Shards::WithCallbackMethod_Read<
    v1::Shards::WithCallbackMethod_Release<v1::Shards::WithCallbackMethod_Watch<
        v1::Shards::Service>>>>;

class ShardsImpl final : public ShardsBase {
 public:
  ShardsImpl(WeightService* service, ThreadPool* pool, CallDrain* drain,
             const CallAuthenticator* auth, int max_watch_streams)
      : service_(service),
        pool_(pool),
        drain_(drain),
        auth_(auth),
        watch_slots_(max_watch_streams, "Watch streams", "--max-watch-streams") {}

  grpc::ServerUnaryReactor* Fetch(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                  grpc::ByteBuffer* resp) override {
    auto who = auth_->Authenticate(ctx);
    if (!who.ok()) return Refuse(ctx, who.status());
    auto request = ParseFetchRequest(*req);
    if (!request.ok()) return Refuse(ctx, request.status());
    auto params = DecodeFetch(*request);
    if (!params.ok()) return Refuse(ctx, params.status());
    params->caller = std::move(*who);
    // A table served before: answered on this thread. Anything else (a
    // materialization, a cast, a merge) goes to the worker pool.
    // (Draining is checked first so that no lease is granted for a refusal.)
    if (absl::Status open = drain_->CheckOpen(); !open.ok()) return Refuse(ctx, open);
    if (auto cached = service_->TryFetchCached(*params); cached.has_value()) {
      return RunOnPool(ctx, nullptr, drain_, [resp, result = *std::move(cached)]() {
        return EncodeFetchResponse(result, resp);
      });
    }
    return RunOnPool(ctx, pool_, drain_, [this, resp, params = std::move(*params)]() {
      return EncodeFetchResponse(service_->Fetch(params), resp);
    });
  }

  grpc::ServerWriteReactor<v1::ReadChunk>* Read(grpc::CallbackServerContext* ctx,
                                                const v1::ReadRequest* req) override {
    auto who = auth_->Authenticate(ctx);
    if (!who.ok()) return RefuseStream<v1::ReadChunk>(who.status());
    auto range = service_->Read(req->lease_id(), req->token(), req->segment(), req->offset(),
                                req->length(), &*who);
    if (!range.ok()) {
      auto* writer = new QueuedWriter<v1::ReadChunk>();  // deletes itself in OnDone
      writer->Close(ToGrpcStatus(range.status()));
      return writer;
    }
    auto hold = drain_->Enter();
    if (!hold.ok()) return RefuseStream<v1::ReadChunk>(hold.status());
    return new ReadReactor(std::move(*range), std::move(*hold));  // deletes itself in OnDone
  }

  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* ctx,
                                    const v1::ReleaseRequest* req,
                                    v1::ReleaseResponse*) override {
    auto who = auth_->Authenticate(ctx);
    if (!who.ok()) return Refuse(ctx, who.status());
    // Microseconds: on this thread.
    return RunOnPool(ctx, nullptr, drain_, [this, req, who = std::move(*who)] {
      return service_->Release(req->lease_id(), req->token(), &who);
    });
  }

  grpc::ServerWriteReactor<v1::GenerationEvent>* Watch(grpc::CallbackServerContext* ctx,
                                                       const v1::WatchRequest* req) override {
    auto who = auth_->Authenticate(ctx);
    if (!who.ok()) return RefuseStream<v1::GenerationEvent>(who.status());
    // One thread per watcher, so watchers are capped.
    auto slot = watch_slots_.Acquire();
    if (!slot.ok()) return RefuseStream<v1::GenerationEvent>(slot.status());
    auto hold = drain_->Enter();
    if (!hold.ok()) return RefuseStream<v1::GenerationEvent>(hold.status());
    // Deletes itself in OnDone, which is after the thread's Close().
    auto* writer = new QueuedWriter<v1::GenerationEvent>(std::move(*hold));
    v1::WatchRequest copy = *req;
    absl::Status started = StartDetachedThread([this, writer, ctx, copy = std::move(copy),
                                                who = std::move(*who),
                                                slot = std::move(*slot)] {
      // Not a reader of the current generation: refused now, not on the
      // next event.
      if (absl::Status s = service_->CheckCanRead(copy.model(), who); !s.ok()) {
        writer->Close(ToGrpcStatus(s));
        return;
      }
      uint64_t after = copy.after();
      if (after == 0) {
        auto current = service_->WaitForGeneration(copy.model(), 0, absl::ZeroDuration());
        if (!current.ok()) {
          writer->Close(ToGrpcStatus(current.status()));
          return;
        }
        after = (*current)->generation;
        if (copy.include_current()) after -= 1;
      }
      while (!ctx->IsCancelled() && !writer->cancelled()) {
        // A draining daemon ends its watches (within 500 ms) with
        // UNAVAILABLE: watch again once it is back.
        if (drain_->draining()) {
          writer->Close(ToGrpcStatus(CallDrain::DrainingError()));
          return;
        }
        auto event = service_->WaitForGeneration(copy.model(), after, absl::Milliseconds(500));
        if (!event.ok()) {
          writer->Close(ToGrpcStatus(event.status()));
          return;
        }
        if (!event->has_value()) continue;
        // A generation the caller may not read (a private adapter applied)
        // ends the stream.
        if (absl::Status s = auth_->policy().CheckRead(who, (*event)->guards); !s.ok()) {
          writer->Close(ToGrpcStatus(s));
          return;
        }
        v1::GenerationEvent msg;
        msg.set_model((*event)->model);
        msg.set_generation((*event)->generation);
        for (const std::string& a : (*event)->adapters) msg.add_adapters(a);
        after = (*event)->generation;
        writer->Push(std::move(msg), /*replaceable=*/false);
      }
      writer->Close(grpc::Status::CANCELLED);
    });
    if (!started.ok()) writer->Close(ToGrpcStatus(started));
    return writer;
  }

 private:
  WeightService* service_;
  ThreadPool* pool_;
  CallDrain* drain_;
  const CallAuthenticator* auth_;
  StreamSlots watch_slots_;
};

class AdaptersImpl final : public v1::Adapters::CallbackService {
 public:
  AdaptersImpl(WeightService* service, ThreadPool* pool, CallDrain* drain,
               const CallAuthenticator* auth)
      : service_(service), pool_(pool), drain_(drain), auth_(auth) {}

  grpc::ServerUnaryReactor* Load(grpc::CallbackServerContext* ctx,
                                 const v1::LoadAdapterRequest* req,
                                 v1::AdapterInfo* resp) override {
    auto who = auth_->AuthenticateAdmin(ctx, "load adapters");
    if (!who.ok()) return Refuse(ctx, who.status());
    return RunOnPool(ctx, pool_, drain_, [this, req, resp]() -> absl::Status {
      std::vector<std::string> readers(req->readers().begin(), req->readers().end());
      auto info = service_->LoadAdapter(req->name(), req->path(), req->format(), req->strict(),
                                        readers);
      if (!info.ok()) return info.status();
      FillAdapterInfo(*info, resp);
      return absl::OkStatus();
    });
  }

  grpc::ServerUnaryReactor* Unload(grpc::CallbackServerContext* ctx,
                                   const v1::UnloadAdapterRequest* req,
                                   v1::UnloadAdapterResponse*) override {
    auto who = auth_->AuthenticateAdmin(ctx, "unload adapters");
    if (!who.ok()) return Refuse(ctx, who.status());
    return RunOnPool(ctx, pool_, drain_, [this, req] { return service_->UnloadAdapter(req->name()); });
  }

  grpc::ServerUnaryReactor* List(grpc::CallbackServerContext* ctx,
                                 const v1::ListAdaptersRequest*,
                                 v1::ListAdaptersResponse* resp) override {
    auto who = auth_->Authenticate(ctx);
    if (!who.ok()) return Refuse(ctx, who.status());
    // Only the adapters the caller may read.
    for (const AdapterSummary& a : service_->ListAdapters()) {
      auto readers = ReaderList::Parse(a.readers);
      std::vector<ReadGuard> guard;
      if (readers.ok()) guard.push_back(ReadGuard{a.name, std::move(*readers)});
      if (readers.ok() && auth_->policy().CheckRead(*who, guard).ok()) {
        FillAdapterInfo(a, resp->add_adapters());
      }
    }
    auto* reactor = ctx->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerUnaryReactor* Apply(grpc::CallbackServerContext* ctx, const v1::ApplyRequest* req,
                                  v1::ApplyResponse* resp) override {
    auto who = auth_->AuthenticateAdmin(ctx, "apply adapters");
    if (!who.ok()) return Refuse(ctx, who.status());
    return RunOnPool(ctx, pool_, drain_, [this, req, resp]() -> absl::Status {
      std::vector<AdapterRef> stack;
      for (const v1::AdapterRef& r : req->adapters()) stack.push_back(AdapterRef{r.name(), r.strength()});
      auto info = service_->Apply(req->model(), stack, req->expect_generation());
      if (!info.ok()) return info.status();
      resp->set_generation(info->generation);
      for (const std::string& a : info->adapters) resp->add_adapters(a);
      return absl::OkStatus();
    });
  }

 private:
  WeightService* service_;
  ThreadPool* pool_;
  CallDrain* drain_;
  const CallAuthenticator* auth_;
};

}  // namespace

class GrpcServer::Impl {
 public:
  Impl(GrpcServerOptions options, WeightService* service,
       std::shared_ptr<const BearerTokens> tokens)
      : options_(std::move(options)),
        pool_(options_.worker_threads),
        auth_(&service->access(), &peers_, std::move(tokens), &drain_),
        models_(service, &pool_, &drain_, &auth_),
        shards_(service, &pool_, &drain_, &auth_, options_.max_watch_streams),
        adapters_(service, &pool_, &drain_, &auth_) {}

  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> TcpCredentials() {
    if (options_.tls_cert_file.empty()) return grpc::InsecureServerCredentials();
    constexpr uint64_t kMaxPem = 1 << 20;
    auto read = [&](const std::string& path, const char* what) -> absl::StatusOr<std::string> {
      auto text = ReadFileToString(path, kMaxPem);
      if (!text.ok()) {
        return absl::Status(text.status().code(),
                            absl::StrCat(what, " ", path, ": ", text.status().message()));
      }
      return text;
    };
    WD_ASSIGN_OR_RETURN(std::string cert, read(options_.tls_cert_file, "--tls-cert"));
    WD_ASSIGN_OR_RETURN(std::string key, read(options_.tls_key_file, "--tls-key"));
    grpc::SslServerCredentialsOptions ssl(
        options_.tls_client_ca_file.empty()
            ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
            : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    ssl.pem_key_cert_pairs.push_back({key, cert});
    if (!options_.tls_client_ca_file.empty()) {
      WD_ASSIGN_OR_RETURN(ssl.pem_root_certs, read(options_.tls_client_ca_file, "--tls-client-ca"));
    }
    return grpc::SslServerCredentials(ssl);
  }

  absl::Status Start() {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::ServerBuilder builder;
    // The Unix socket is accepted by UnixGrpcAcceptor (peer credentials).
    int tcp_port = 0;
    if (!options_.tcp_listen.empty()) {
      WD_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> creds, TcpCredentials());
      builder.AddListeningPort(options_.tcp_listen, creds, &tcp_port);
    }
    builder.SetMaxSendMessageSize(256 << 20);
    builder.SetMaxReceiveMessageSize(64 << 20);
    builder.RegisterService(&models_);
    builder.RegisterService(&shards_);
    builder.RegisterService(&adapters_);
    server_ = builder.BuildAndStart();
    if (server_ == nullptr) {
      return absl::UnavailableError(absl::StrCat("cannot start the gRPC server",
                                                 options_.tcp_listen.empty() ? "" : " on ",
                                                 options_.tcp_listen));
    }
    if (!options_.tcp_listen.empty() && tcp_port == 0) {
      return absl::UnavailableError(absl::StrCat("cannot listen on ", options_.tcp_listen));
    }
    auto acceptor = UnixGrpcAcceptor::Start(options_.unix_socket, options_.unix_socket_mode,
                                            server_.get(), &peers_);
    if (!acceptor.ok()) {
      return absl::Status(acceptor.status().code(),
                          absl::StrCat("cannot listen on unix:", options_.unix_socket, ": ",
                                       acceptor.status().message()));
    }
    acceptor_ = std::move(*acceptor);
    server_->GetHealthCheckService()->SetServingStatus(true);
    return absl::OkStatus();
  }

  void Shutdown(absl::Duration grace) {
    {
      absl::MutexLock lock(&mu_);
      if (shut_down_) return;
      shut_down_ = true;
    }
    // New calls, also on connections already open, get UNAVAILABLE; health
    // says NOT_SERVING; no new connections.
    drain_.BeginDrain();
    if (server_ != nullptr) server_->GetHealthCheckService()->SetServingStatus(false);
    if (acceptor_ != nullptr) acceptor_->Stop();  // unlinks the socket
    if (server_ == nullptr) return;
    // In-flight calls get `grace` (watches end within 500 ms).
    const absl::Time deadline = absl::Now() + grace;
    int64_t left = drain_.WaitIdle(deadline);
    if (left > 0) {
      LogEvent(LogLevel::kWarning, "shutdown_grace_expired",
               {{"calls_in_flight", absl::StrCat(left)}, {"cancelled", "true"}});
    }
    // An expired deadline: gRPC cancels what is left and closes the idle
    // connections instead of waiting for their clients to close them.
    server_->Shutdown(std::chrono::system_clock::now());
    // A cancelled load or watch thread still runs until it notices; the
    // service must outlive it.
    drain_.WaitIdle(absl::InfiniteFuture());
  }

  void Wait() { server_->Wait(); }

 private:
  GrpcServerOptions options_;
  ThreadPool pool_;
  CallDrain drain_;
  UnixPeerRegistry peers_;
  CallAuthenticator auth_;
  ModelsImpl models_;
  ShardsImpl shards_;
  AdaptersImpl adapters_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<UnixGrpcAcceptor> acceptor_;
  absl::Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
};

absl::StatusOr<std::unique_ptr<GrpcServer>> GrpcServer::Start(GrpcServerOptions options,
                                                              WeightService* service) {
  // gRPC's library-wide teardown (the last grpc_shutdown(), run by the
  // server's destructor) waits for its timer threads to be counted out, and
  // a timer thread it failed to start at the process's thread limit (pids
  // cgroup, TasksMax, RLIMIT_NPROC) is never counted out: the daemon would
  // hang at exit. So the library stays initialized for the life of the
  // process, which hands everything back to the kernel when it exits.
  static const bool kLibraryHeld = [] {
    grpc_init();
    return true;
  }();
  (void)kLibraryHeld;
  std::shared_ptr<const BearerTokens> tokens;
  if (!options.auth_token_file.empty()) {
    WD_ASSIGN_OR_RETURN(BearerTokens loaded, BearerTokens::Load(options.auth_token_file));
    tokens = std::make_shared<const BearerTokens>(std::move(loaded));
  }
  auto impl = std::make_unique<Impl>(std::move(options), service, std::move(tokens));
  absl::Status s = impl->Start();
  if (!s.ok()) return s;
  return std::unique_ptr<GrpcServer>(new GrpcServer(std::move(impl)));
}

GrpcServer::GrpcServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GrpcServer::~GrpcServer() { Shutdown(absl::Seconds(5)); }
void GrpcServer::Shutdown(absl::Duration grace) { impl_->Shutdown(grace); }
void GrpcServer::Wait() { impl_->Wait(); }

}  // namespace weightd
