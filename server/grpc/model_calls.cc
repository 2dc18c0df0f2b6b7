// The Models service's model administration and reads (models_service_impl.h):
// Load and Unload for admins; List, Get, Verify and Stats for any caller,
// each answering only with what the caller may read.
#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/grpc/status_convert.h"
#include "common/status_macros.h"
#include "proto/convert/dtype_convert.h"
#include "server/gpu/gpu_health.h"
#include "server/grpc/models_service_impl.h"
#include "server/grpc/proto_convert.h"
#include "server/grpc/reactors.h"
#include "server/grpc/ucx_offer.h"
#include "server/grpc/services.h"

namespace weightd {
namespace {

// One progress report of a load, as the stream sends it.
v1::LoadProgress ProgressMessage(const LoadProgressInfo& p) {
  v1::LoadProgress msg;
  msg.set_bytes_done(p.bytes_done);
  msg.set_bytes_total(p.bytes_total);
  msg.set_tensors_done(p.tensors_done);
  msg.set_tensors_total(p.tensors_total);
  msg.set_current_file(p.current_file);
  msg.set_bytes_from_storage(p.bytes_from_storage);
  msg.set_bytes_from_peers(p.bytes_from_peers);
  for (const std::string& peer : p.peers) msg.add_peers(peer);
  for (const std::string& t : p.peer_transports) msg.add_peer_transports(t);
  return msg;
}

// The last message of a load that succeeded: the last report's sources and
// the model.
v1::LoadProgress DoneMessage(const LoadProgressInfo& last, const ModelSummary& model) {
  v1::LoadProgress done;
  done.set_bytes_from_storage(last.bytes_from_storage);
  done.set_bytes_from_peers(last.bytes_from_peers);
  for (const std::string& peer : last.peers) done.add_peers(peer);
  for (const std::string& t : last.peer_transports) done.add_peer_transports(t);
  done.set_done(true);
  done.set_bytes_done(model.total_bytes);
  done.set_bytes_total(model.total_bytes);
  done.set_tensors_done(model.tensor_count);
  done.set_tensors_total(model.tensor_count);
  FillModelInfo(model, done.mutable_model());
  return done;
}

// The daemon-wide counters of Stats (everything but the GPUs).
void FillStats(const ServiceStats& s, v1::StatsResponse* resp) {
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
  FillSourceStats(s.source, resp);
  for (const auto& [peer, c] : s.peer_transfers) {
    v1::PeerTransfer* t = resp->add_peer_transfers();
    t->set_peer(peer);
    t->set_bytes(c.bytes);
    t->set_failures(c.failures);
  }
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
}

// The GPUs the daemon found at start-up, and which of them failed since.
void FillGpus(const GpuInventory& gpus, v1::StatsResponse* resp) {
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
}

}  // namespace

grpc::ServerWriteReactor<v1::LoadProgress>* ModelsImpl::Load(grpc::CallbackServerContext* ctx,
                                                             const v1::LoadRequest* req) {
  auto who = auth_->AuthenticateAdmin(ctx, "load models");
  if (!who.ok()) return RefuseStream<v1::LoadProgress>(who.status());
  auto hold = drain_->Enter(/*change=*/true);
  if (!hold.ok()) return RefuseStream<v1::LoadProgress>(hold.status());
  // Deletes itself in OnDone, which is after the thread's Close(). The
  // thread is joined at shutdown, before this service is destroyed.
  // The client cancelling the call (weightctl's Ctrl-C) cancels the load.
  auto cancel = std::make_shared<Cancellation>();
  auto* writer = new QueuedWriter<v1::LoadProgress>(std::move(*hold), cancel);
  v1::LoadRequest copy = *req;
  absl::Status started = long_calls_->Start([this, writer, cancel, copy = std::move(copy)] {
    std::vector<std::string> readers(copy.readers().begin(), copy.readers().end());
    // The last report's sources go into the final message.
    auto last = std::make_shared<LoadProgressInfo>();
    auto result = models_->Load(
        copy.name(), copy.path(), copy.profile_json(),
        [writer, last](const LoadProgressInfo& p) {
          *last = p;
          writer->Push(ProgressMessage(p), /*replaceable=*/true);
        },
        readers, /*expect=*/nullptr, FromProtoLoadSource(copy.source()), cancel);
    if (result.ok()) writer->Push(DoneMessage(*last, *result), /*replaceable=*/false);
    writer->Close(ToGrpcStatus(result.status()));
  });
  if (!started.ok()) writer->Close(ToGrpcStatus(started));
  return writer;
}

grpc::ServerUnaryReactor* ModelsImpl::Unload(grpc::CallbackServerContext* ctx,
                                             const v1::UnloadRequest* req, v1::UnloadResponse*) {
  auto who = auth_->AuthenticateAdmin(ctx, "unload models");
  if (!who.ok()) return Refuse(ctx, who.status());
  return RunOnPool(
      ctx, pool_, drain_, [this, req] { return models_->Unload(req->name()); },
      /*change=*/true);
}

grpc::ServerUnaryReactor* ModelsImpl::List(grpc::CallbackServerContext* ctx,
                                           const v1::ListModelsRequest*,
                                           v1::ListModelsResponse* resp) {
  SayWhoAnswers(ctx);  // a refusal too: a daemon polling itself knows
  auto who = auth_->Authenticate(ctx);
  if (!who.ok()) return Refuse(ctx, who.status());
  // Only the models the caller may read.
  for (const ModelSummary& s : models_->List()) {
    if (auth_->policy().CheckRead(*who, s.guards).ok()) FillModelInfo(s, resp->add_models());
  }
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* ModelsImpl::Get(grpc::CallbackServerContext* ctx,
                                          const v1::GetModelRequest* req, v1::ModelInfo* resp) {
  auto who = auth_->Authenticate(ctx);
  if (!who.ok()) return Refuse(ctx, who.status());
  return RunOnPool(ctx, pool_, drain_, [this, req, resp, who = std::move(*who)]() -> absl::Status {
    auto detail = models_->Get(req->name());
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

grpc::ServerUnaryReactor* ModelsImpl::Verify(grpc::CallbackServerContext* ctx,
                                             const v1::VerifyRequest* req,
                                             v1::VerifyResponse* resp) {
  auto who = auth_->Authenticate(ctx);
  if (!who.ok()) return Refuse(ctx, who.status());
  return RunOnPool(ctx, pool_, drain_, [this, req, resp, who = std::move(*who)]() -> absl::Status {
    WD_RETURN_IF_ERROR(models_->CheckCanRead(req->name(), who));
    auto r = models_->Verify(req->name());
    if (!r.ok()) return r.status();
    resp->set_tensors(r->tensors);
    resp->set_bytes(r->bytes);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ModelsImpl::Stats(grpc::CallbackServerContext* ctx,
                                            const v1::StatsRequest*, v1::StatsResponse* resp) {
  auto who = auth_->Authenticate(ctx);
  if (!who.ok()) return Refuse(ctx, who.status());
  FillStats(stats_->Stats(), resp);
  if (peer_client_ != nullptr) FillPeerTransports(*peer_client_, resp);
  FillGpus(stats_->gpus(), resp);
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

std::unique_ptr<grpc::Service> MakeModelsService(const ServiceContext& c) {
  return std::make_unique<ModelsImpl>(c.engine, c.pool, c.long_calls, c.drain, c.auth, c.peers,
                                      c.ucx, c.peer_client);
}

}  // namespace weightd
