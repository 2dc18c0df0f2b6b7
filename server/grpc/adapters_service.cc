#include "server/grpc/services.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "common/grpc/status_convert.h"
#include "common/status_macros.h"
#include "server/grpc/proto_convert.h"
#include "server/grpc/reactors.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace weightd {
namespace {

class AdaptersImpl final : public v1::Adapters::CallbackService {
 public:
  AdaptersImpl(AdapterService* adapters, ThreadPool* pool, CallDrain* drain,
               const CallAuthenticator* auth)
      : adapters_(adapters), pool_(pool), drain_(drain), auth_(auth) {}

  grpc::ServerUnaryReactor* Load(grpc::CallbackServerContext* ctx,
                                 const v1::LoadAdapterRequest* req,
                                 v1::AdapterInfo* resp) override {
    auto who = auth_->AuthenticateAdmin(ctx, "load adapters");
    if (!who.ok()) return Refuse(ctx, who.status());
    return RunOnPool(ctx, pool_, drain_, [this, req, resp]() -> absl::Status {
      std::vector<std::string> readers(req->readers().begin(), req->readers().end());
      auto info = adapters_->Load(req->name(), req->path(), req->format(), req->strict(),
                                  readers, FromProtoLoadSource(req->source()));
      if (!info.ok()) return info.status();
      FillAdapterInfo(*info, resp);
      return absl::OkStatus();
    }, /*change=*/true);
  }

  grpc::ServerUnaryReactor* Unload(grpc::CallbackServerContext* ctx,
                                   const v1::UnloadAdapterRequest* req,
                                   v1::UnloadAdapterResponse*) override {
    auto who = auth_->AuthenticateAdmin(ctx, "unload adapters");
    if (!who.ok()) return Refuse(ctx, who.status());
    return RunOnPool(
        ctx, pool_, drain_, [this, req] { return adapters_->Unload(req->name()); },
        /*change=*/true);
  }

  grpc::ServerUnaryReactor* List(grpc::CallbackServerContext* ctx,
                                 const v1::ListAdaptersRequest*,
                                 v1::ListAdaptersResponse* resp) override {
    auto who = auth_->Authenticate(ctx);
    if (!who.ok()) return Refuse(ctx, who.status());
    // Only the adapters the caller may read.
    for (const AdapterSummary& a : adapters_->List()) {
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
      auto info = adapters_->Apply(req->model(), stack, req->expect_generation());
      if (!info.ok()) return info.status();
      resp->set_generation(info->generation);
      for (const std::string& a : info->adapters) resp->add_adapters(a);
      resp->set_weights_id(info->content.Hex());
      return absl::OkStatus();
    }, /*change=*/true);
  }

 private:
  AdapterService* adapters_;
  ThreadPool* pool_;
  CallDrain* drain_;
  const CallAuthenticator* auth_;
};

}  // namespace

std::unique_ptr<grpc::Service> MakeAdaptersService(const ServiceContext& c) {
  return std::make_unique<AdaptersImpl>(c.engine.adapters, c.pool, c.drain, c.auth);
}

}  // namespace weightd
