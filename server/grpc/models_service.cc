#include "server/grpc/services.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/grpc/proto_convert.h"
#include "server/grpc/reactors.h"
#include "server/grpc/status_convert.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace weightd {
namespace {

class ModelsImpl final : public v1::Models::CallbackService {
 public:
  ModelsImpl(WeightService* service, ThreadPool* pool, TaskThreads* long_calls, CallDrain* drain,
             const CallAuthenticator* auth)
      : service_(service), pool_(pool), long_calls_(long_calls), drain_(drain), auth_(auth) {}

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
    return RunOnPool(
        ctx, pool_, drain_, [this, req] { return service_->UnloadModel(req->name()); },
        /*change=*/true);
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
    resp->set_checkpoint_bytes_logical(s.checkpoint_bytes_logical);
    resp->set_checkpoint_bytes_resident(s.checkpoint_bytes_resident);
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
    }
    auto* reactor = ctx->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

 private:
  WeightService* service_;
  ThreadPool* pool_;
  TaskThreads* long_calls_;
  CallDrain* drain_;
  const CallAuthenticator* auth_;
};

}  // namespace

std::unique_ptr<grpc::Service> MakeModelsService(const ServiceContext& c) {
  return std::make_unique<ModelsImpl>(c.service, c.pool, c.long_calls, c.drain, c.auth);
}

}  // namespace weightd
