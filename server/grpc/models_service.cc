#include "server/grpc/services.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "common/grpc/status_convert.h"
#include "common/status_macros.h"
#include "proto/convert/dtype_convert.h"
#include "server/fleet/peer_table.h"
#include "server/gpu/gpu_health.h"
#include "server/grpc/proto_convert.h"
#include "server/grpc/reactors.h"
#include "server/grpc/ucx_offer.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace weightd {
namespace {

// A 16-byte digest off the wire (a checkpoint key, a copy id, a sample's).
absl::StatusOr<Digest> KeyOf(const std::string& bytes) {
  std::optional<Digest> d = DigestFromBytes(bytes);
  if (!d) {
    return absl::InvalidArgumentError(
        absl::StrCat("a digest is ", sizeof(Digest::bytes), " bytes, got ", bytes.size()));
  }
  return *d;
}

void FillPublishResult(const WeightService::PublishResult& r, v1::PublishResult* out) {
  out->set_model(r.generation.model);
  out->set_generation(r.generation.generation);
  out->set_weights_id(r.generation.content.Hex());
  out->set_tensors(r.tensors);
  out->set_changed(r.changed);
  out->set_bytes(r.bytes);
  out->set_bytes_stored(r.bytes_stored);
  out->set_bytes_shared(r.bytes_shared);
  for (const std::string& m : r.shared_with) out->add_shared_with(m);
  for (const std::string& a : r.generation.adapters) out->add_adapters(a);
}

// PublishWrite: each chunk is copied into the session's staging memory on
// the worker pool (the chunk that completes the session also digests and
// commits it there), then the next one is read.
class PublishWriteReactor : public grpc::ServerReadReactor<v1::PublishChunk> {
 public:
  PublishWriteReactor(WeightService* service, ThreadPool* pool, CallDrain::Hold hold,
                      Principal caller, v1::PublishWriteResponse* resp)
      : service_(service),
        pool_(pool),
        hold_(std::move(hold)),
        caller_(std::move(caller)),
        resp_(resp) {
    StartRead(&chunk_);
  }

 private:
  void OnReadDone(bool ok) override {
    if (!ok) {  // the writer is done (or gone)
      Finish(grpc::Status::OK);
      return;
    }
    pool_->Schedule([this] { Process(); });
  }
  void Process() {
    if (chunk_.session() != 0) {
      if (session_ != 0 && chunk_.session() != session_) {
        Finish(ToGrpcStatus(absl::InvalidArgumentError(
            "one PublishWrite stream writes to one session")));
        return;
      }
      session_ = chunk_.session();
      if (!chunk_.token().empty()) token_ = chunk_.token();
    }
    if (session_ == 0) {
      Finish(ToGrpcStatus(absl::InvalidArgumentError(
          "the first message of a PublishWrite stream must name its session")));
      return;
    }
    std::vector<WeightService::PublishRun> runs;
    runs.reserve(chunk_.runs_size());
    for (const v1::PublishRun& r : chunk_.runs()) {
      runs.push_back(WeightService::PublishRun{r.tensor(), r.offset(), r.length()});
    }
    auto progress =
        service_->WritePublish(caller_, session_, token_, runs, chunk_.data(), chunk_.in_place());
    if (!progress.ok()) {
      Finish(ToGrpcStatus(progress.status()));
      return;
    }
    resp_->set_bytes_written(resp_->bytes_written() + chunk_.data().size());
    resp_->set_bytes_done(progress->bytes_done);
    resp_->set_bytes_total(progress->bytes_total);
    if (progress->result.has_value()) FillPublishResult(*progress->result, resp_->mutable_result());
    StartRead(&chunk_);
  }
  void OnDone() override { delete this; }  // gRPC reactor idiom

  WeightService* const service_;
  ThreadPool* const pool_;
  CallDrain::Hold hold_;
  const Principal caller_;
  v1::PublishWriteResponse* const resp_;
  v1::PublishChunk chunk_;
  uint64_t session_ = 0;
  std::string token_;
};

class ModelsImpl final : public v1::Models::CallbackService {
 public:
  ModelsImpl(WeightService* service, ThreadPool* pool, TaskThreads* long_calls, CallDrain* drain,
             const CallAuthenticator* auth, const PeerTable* peers)
      : service_(service),
        pool_(pool),
        long_calls_(long_calls),
        drain_(drain),
        auth_(auth),
        peers_(peers) {}

  grpc::ServerWriteReactor<v1::LoadProgress>* Load(grpc::CallbackServerContext* ctx,
                                                   const v1::LoadRequest* req) override {
    auto who = auth_->AuthenticateAdmin(ctx, "load models");
    if (!who.ok()) return RefuseStream<v1::LoadProgress>(who.status());
    auto hold = drain_->Enter(/*change=*/true);
    if (!hold.ok()) return RefuseStream<v1::LoadProgress>(hold.status());
    // Deletes itself in OnDone, which is after the thread's Close(). The
    // thread is joined at shutdown, before this service is destroyed.
    auto* writer = new QueuedWriter<v1::LoadProgress>(std::move(*hold));
    v1::LoadRequest copy = *req;
    absl::Status started = long_calls_->Start([this, writer, copy = std::move(copy)] {
      std::vector<std::string> readers(copy.readers().begin(), copy.readers().end());
      LoadSource source = LoadSource::kAuto;
      switch (copy.source()) {
        case v1::LOAD_SOURCE_STORAGE: source = LoadSource::kStorage; break;
        case v1::LOAD_SOURCE_PEERS: source = LoadSource::kPeers; break;
        default: break;
      }
      // The last report's sources go into the final message.
      auto last = std::make_shared<LoadProgressInfo>();
      auto result = service_->LoadModel(
          copy.name(), copy.path(), copy.profile_json(),
          [writer, last](const LoadProgressInfo& p) {
            *last = p;
            v1::LoadProgress msg;
            msg.set_bytes_done(p.bytes_done);
            msg.set_bytes_total(p.bytes_total);
            msg.set_tensors_done(p.tensors_done);
            msg.set_tensors_total(p.tensors_total);
            msg.set_current_file(p.current_file);
            msg.set_bytes_from_storage(p.bytes_from_storage);
            msg.set_bytes_from_peers(p.bytes_from_peers);
            for (const std::string& peer : p.peers) msg.add_peers(peer);
            writer->Push(std::move(msg), /*replaceable=*/true);
          },
          readers, source);
      if (result.ok()) {
        v1::LoadProgress done;
        done.set_bytes_from_storage(last->bytes_from_storage);
        done.set_bytes_from_peers(last->bytes_from_peers);
        for (const std::string& peer : last->peers) done.add_peers(peer);
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
    return RunOnPool(
        ctx, pool_, drain_, [this, req] { return service_->UnloadModel(req->name()); },
        /*change=*/true);
  }

  grpc::ServerUnaryReactor* List(grpc::CallbackServerContext* ctx, const v1::ListModelsRequest*,
                                 v1::ListModelsResponse* resp) override {
    SayWhoAnswers(ctx);  // a refusal too: a daemon polling itself knows
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

  grpc::ServerUnaryReactor* BeginPublish(grpc::CallbackServerContext* ctx,
                                         const v1::BeginPublishRequest* req,
                                         v1::PublishSession* resp) override {
    auto who = auth_->AuthenticateAdmin(ctx, "publish weights");
    if (!who.ok()) return Refuse(ctx, who.status());
    return RunOnPool(
        ctx, pool_, drain_,
        [this, req, resp, who = std::move(*who)]() -> absl::Status {
          WeightService::PublishBeginParams params;
          params.caller = who;
          params.model = req->model();
          params.expect_generation = req->expect_generation();
          params.timeout = absl::Seconds(req->timeout_seconds() == 0 ? 600 : req->timeout_seconds());
          for (const v1::PublishTensor& t : req->tensors()) {
            PublishTensorSpec spec;
            spec.name = t.name();
            auto dtype = FromProtoDType(t.dtype());
            if (!dtype.ok()) {
              return absl::InvalidArgumentError(
                  absl::StrCat("tensor \"", t.name(), "\": ", dtype.status().message()));
            }
            spec.dtype = *dtype;
            spec.shape.assign(t.shape().begin(), t.shape().end());
            params.tensors.push_back(std::move(spec));
          }
          auto info = service_->BeginPublish(params);
          if (!info.ok()) return info.status();
          resp->set_session(info->id);
          resp->set_token(info->token);
          resp->set_base_generation(info->base_generation);
          resp->set_bytes(info->bytes);
          resp->set_deadline_unix_ms(absl::ToUnixMillis(info->deadline));
          for (const std::string& n : info->per_part) resp->add_per_part(n);
          for (uint64_t o : info->layout.offsets) resp->add_offsets(o);
          resp->set_staging_bytes(info->staging_bytes);
          resp->set_data_socket(service_->options().data_socket_path);
          resp->set_data_socket_name(service_->options().data_socket_name);
          return absl::OkStatus();
        },
        /*change=*/true);
  }

  grpc::ServerReadReactor<v1::PublishChunk>* PublishWrite(
      grpc::CallbackServerContext* ctx, v1::PublishWriteResponse* resp) override {
    auto who = auth_->AuthenticateAdmin(ctx, "publish weights");
    absl::StatusOr<CallDrain::Hold> hold =
        who.ok() ? drain_->Enter(/*change=*/true) : absl::StatusOr<CallDrain::Hold>(who.status());
    if (!hold.ok()) {
      class Refused : public grpc::ServerReadReactor<v1::PublishChunk> {
       public:
        explicit Refused(const absl::Status& s) { Finish(ToGrpcStatus(s)); }
        void OnDone() override { delete this; }
      };
      return new Refused(hold.status());
    }
    return new PublishWriteReactor(service_, pool_, std::move(*hold), std::move(*who), resp);
  }

  grpc::ServerUnaryReactor* CommitPublish(grpc::CallbackServerContext* ctx,
                                          const v1::CommitPublishRequest* req,
                                          v1::PublishResult* resp) override {
    auto who = auth_->AuthenticateAdmin(ctx, "publish weights");
    if (!who.ok()) return Refuse(ctx, who.status());
    auto hold = drain_->Enter(/*change=*/true);
    if (!hold.ok()) return Refuse(ctx, hold.status());
    auto* reactor = new HeldUnaryReactor(std::move(*hold));  // deletes itself in OnDone
    // It may wait: a thread of its own, not a pool worker.
    absl::Status started = long_calls_->Start([this, reactor, req, resp, who = std::move(*who)] {
      auto r = service_->CommitPublish(who, req->session(), req->token(),
                                       absl::Seconds(std::min<uint32_t>(req->wait_seconds(), 3600)));
      if (r.ok()) FillPublishResult(*r, resp);
      reactor->Finish(ToGrpcStatus(r.status()));
    });
    if (!started.ok()) reactor->Finish(ToGrpcStatus(started));
    return reactor;
  }

  grpc::ServerUnaryReactor* AbortPublish(grpc::CallbackServerContext* ctx,
                                         const v1::AbortPublishRequest* req,
                                         v1::AbortPublishResponse*) override {
    auto who = auth_->AuthenticateAdmin(ctx, "publish weights");
    if (!who.ok()) return Refuse(ctx, who.status());
    return RunOnPool(
        ctx, pool_, drain_,
        [this, req, who = std::move(*who)] {
          return service_->AbortPublish(who, req->session(), req->token());
        },
        /*change=*/true);
  }

  grpc::ServerUnaryReactor* Peers(grpc::CallbackServerContext* ctx, const v1::PeersRequest*,
                                  v1::PeersResponse* resp) override {
    auto who = auth_->Authenticate(ctx);
    if (!who.ok()) return Refuse(ctx, who.status());
    // What the peers hold (as their List shows it to this daemon's fleet
    // identity) is for admins: other callers see who answers, not names.
    const bool models = auth_->policy().CheckAdmin(*who, "see what peers hold").ok();
    if (peers_ != nullptr) {
      resp->set_advertise(peers_->options().advertise);
      resp->set_peer_dns(peers_->options().dns);
      resp->set_dns_error(peers_->dns_error());
      resp->set_poll_seconds(
          static_cast<uint32_t>(absl::ToInt64Seconds(peers_->options().poll_interval)));
      auto ms = [](absl::Time t) { return t == absl::InfinitePast() ? 0 : absl::ToUnixMillis(t); };
      for (const PeerState& p : peers_->Snapshot()) {
        v1::PeerInfo* out = resp->add_peers();
        out->set_address(p.address);
        out->set_reachable(p.reachable);
        out->set_error(p.error);
        out->set_last_seen_unix_ms(ms(p.last_seen));
        out->set_polled_unix_ms(ms(p.polled));
        if (!models) continue;
        for (const PeerModelState& m : p.models) {
          v1::PeerModel* pm = out->add_models();
          pm->set_name(m.name);
          pm->set_generation(m.generation);
          pm->set_weights_id(m.weights_id);
        }
      }
    }
    auto* reactor = ctx->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerUnaryReactor* FindCheckpoint(grpc::CallbackServerContext* ctx,
                                           const v1::FindCheckpointRequest* req,
                                           v1::FindCheckpointResponse* resp) override {
    // Fleet members only, before anything about the request is looked at.
    SayWhoAnswers(ctx);
    auto who = auth_->Authenticate(ctx);
    if (!who.ok()) return Refuse(ctx, who.status());
    absl::Status member = auth_->policy().CheckFleetMember(*who);
    if (!member.ok()) return Refuse(ctx, member);
    auto key = KeyOf(req->key());
    if (!key.ok()) return Refuse(ctx, key.status());
    std::vector<CheckpointRange> samples;
    for (const v1::CheckpointRange& r : req->samples()) {
      samples.push_back({r.file(), r.offset(), r.length()});
    }
    std::vector<Digest> sample_digests;
    for (const std::string& d : req->sample_digests()) {
      auto digest = KeyOf(d);
      if (!digest.ok()) return Refuse(ctx, digest.status());
      sample_digests.push_back(*digest);
    }
    // Digests up to 4096 MiB of samples: on the pool.
    return RunOnPool(ctx, pool_, drain_, [this, req, resp, key = *key, samples = std::move(samples),
                                          sample_digests = std::move(sample_digests),
                                          who = std::move(*who)] {
      WD_ASSIGN_OR_RETURN(PeerHolding held,
                          service_->FindHeld(key, samples, sample_digests, who));
      resp->set_copy(std::string(held.copy.View()));
      for (const std::vector<Digest>& file : held.tensor_digests) {
        std::string* out = resp->add_tensor_digests();
        out->reserve(file.size() * 16);
        for (const Digest& d : file) out->append(d.View().data(), d.View().size());
      }
      for (const Digest& d : held.sample_digests) resp->add_sample_digests(std::string(d.View()));
      OfferUcx(ucx_, *service_, *req, key, who, resp);
      return absl::OkStatus();
    });
  }

  grpc::ServerWriteReactor<v1::ReadChunk>* ReadCheckpoint(
      grpc::CallbackServerContext* ctx, const v1::ReadCheckpointRequest* req) override {
    auto who = auth_->Authenticate(ctx);
    if (!who.ok()) return RefuseStream<v1::ReadChunk>(who.status());
    absl::Status member = auth_->policy().CheckFleetMember(*who);
    if (!member.ok()) return RefuseStream<v1::ReadChunk>(member);
    auto key = KeyOf(req->key());
    if (!key.ok()) return RefuseStream<v1::ReadChunk>(key.status());
    auto hold = drain_->Enter();
    if (!hold.ok()) return RefuseStream<v1::ReadChunk>(hold.status());
    auto copy = KeyOf(req->copy());
    if (!copy.ok()) return RefuseStream<v1::ReadChunk>(copy.status());
    const v1::CheckpointRange& r = req->range();
    auto range = service_->ReadHeld(*key, *copy, {r.file(), r.offset(), r.length()}, *who);
    if (!range.ok()) return RefuseStream<v1::ReadChunk>(range.status());
    return new ReadReactor(std::move(*range), std::move(*hold));  // deletes itself in OnDone
  }

  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* ctx, const v1::StatsRequest*,
                                  v1::StatsResponse* resp) override {
    auto who = auth_->Authenticate(ctx);
    if (!who.ok()) return Refuse(ctx, who.status());
    ServiceStats s = service_->Stats();
    resp->set_models(s.models);
    resp->set_segments(s.segments);
    resp->set_bytes_resident(s.bytes_resident);
    resp->set_checkpoint_bytes_logical(s.checkpoint_bytes_logical);
    resp->set_checkpoint_bytes_resident(s.checkpoint_bytes_resident);
    resp->set_published_bytes_logical(s.published_bytes_logical);
    resp->set_published_bytes_resident(s.published_bytes_resident);
    resp->set_publishes(s.publishes);
    resp->set_publish_bytes(s.publish_bytes);
    resp->set_publish_seconds(s.publish_seconds);
    resp->set_publish_sessions(s.publish_sessions);
    resp->set_publish_staging_prepared(s.publish_staging_prepared);
    resp->set_publish_staging_allocated(s.publish_staging_allocated);
    resp->set_publish_staging_ahead_bytes(s.publish_staging_ahead_bytes);
    resp->set_load_bytes_storage(s.load_bytes_storage);
    resp->set_load_bytes_peers(s.load_bytes_peers);
    resp->set_bytes_sent_to_peers(s.bytes_sent_to_peers);
    for (const auto& [peer, c] : s.peer_transfers) {
      v1::PeerTransfer* t = resp->add_peer_transfers();
      t->set_peer(peer);
      t->set_bytes(c.bytes);
      t->set_failures(c.failures);
    }
    if (peer_client_ != nullptr) FillPeerTransports(*peer_client_, resp);
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
    resp->set_pushes(s.pushes);
    resp->set_push_bytes(s.push_bytes);
    resp->set_pinned_bytes(s.pinned_bytes);
    resp->set_segment_bytes_4k(s.page_bytes[static_cast<int>(PageKind::kSmall)]);
    resp->set_segment_bytes_thp(s.page_bytes[static_cast<int>(PageKind::kTransparentHuge)]);
    resp->set_segment_bytes_hugetlb(s.page_bytes[static_cast<int>(PageKind::kHugetlb)]);
    resp->set_huge_page_fallbacks(s.page_fallbacks);
    resp->set_huge_pages(HugePageModeName(s.huge_pages));
    resp->set_hugetlb_pages_total(s.host_pages.hugetlb_total);
    resp->set_hugetlb_pages_free(s.host_pages.hugetlb_free);
    resp->set_shmem_thp(s.host_pages.shmem_thp);
    const GpuInventory& gpus = service_->gpus();
    resp->set_cuda_built(gpus.cuda_built);
    resp->set_gpus_unavailable(gpus.unavailable);
    for (const GpuDevice& g : gpus.devices) {
      v1::GpuDevice* out = resp->add_gpus();
      out->set_uuid(g.uuid);
      out->set_name(g.name);
      out->set_pci_bus_id(g.pci_bus_id);
      out->set_memory_bytes(g.memory_bytes);
      out->set_ordinal(g.ordinal);
      out->set_compute_major(g.compute_major);
      out->set_compute_minor(g.compute_minor);
      out->set_pageable_memory_access(g.pageable_memory_access);
      out->set_host_register(g.host_register);
      out->set_host_register_read_only(g.host_register_read_only);
      out->set_unavailable(GpuHealth::Process().Unavailable(g.uuid));
    }
    auto* reactor = ctx->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

 public:
  UcxPlane* ucx_ = nullptr;  // FindCheckpoint's UCX grants (ucx_offer.h); set once at creation
  const PeerCheckpointClient* peer_client_ = nullptr;  // Stats.peer_transports

 private:
  // Answers carry this daemon's instance id (PeerTable::instance_id), so
  // that a daemon that finds itself among its peers (--peer-dns naming it)
  // knows and leaves itself out.
  void SayWhoAnswers(grpc::CallbackServerContext* ctx) const {
    if (peers_ != nullptr) ctx->AddInitialMetadata(kInstanceMetadata, peers_->instance_id());
  }

  WeightService* service_;
  ThreadPool* pool_;
  TaskThreads* long_calls_;
  CallDrain* drain_;
  const CallAuthenticator* auth_;
  const PeerTable* peers_;
};

}  // namespace

std::unique_ptr<grpc::Service> MakeModelsService(const ServiceContext& c) {
  auto models = std::make_unique<ModelsImpl>(c.service, c.pool, c.long_calls, c.drain, c.auth, c.peers);
  models->ucx_ = c.ucx;
  models->peer_client_ = c.peer_client;
  return models;
}

}  // namespace weightd
