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

// Fetch is a raw method: its response is assembled from a cached encoding.
using ShardsBase = v1::Shards::WithRawCallbackMethod_Fetch<v1::Shards::WithCallbackMethod_Read<
    v1::Shards::WithCallbackMethod_Release<v1::Shards::WithCallbackMethod_Watch<
        v1::Shards::Service>>>>;

class ShardsImpl final : public ShardsBase {
 public:
  ShardsImpl(FetchService* fetches, ModelService* models, ThreadPool* pool,
             TaskThreads* long_calls, CallDrain* drain, const CallAuthenticator* auth,
             int max_watch_streams)
      : fetches_(fetches),
        models_(models),
        pool_(pool),
        long_calls_(long_calls),
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
    if (auto cached = fetches_->TryFetchCached(*params); cached.has_value()) {
      return RunOnPool(ctx, nullptr, drain_, [resp, result = *std::move(cached)]() {
        return EncodeFetchResponse(result, resp);
      });
    }
    return RunOnPool(ctx, pool_, drain_, [this, resp, params = std::move(*params)]() {
      return EncodeFetchResponse(fetches_->Fetch(params), resp);
    });
  }

  grpc::ServerWriteReactor<v1::ReadChunk>* Read(grpc::CallbackServerContext* ctx,
                                                const v1::ReadRequest* req) override {
    auto who = auth_->Authenticate(ctx);
    if (!who.ok()) return RefuseStream<v1::ReadChunk>(who.status());
    auto range = fetches_->Read(req->lease_id(), req->token(), req->segment(), req->offset(),
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
      return fetches_->Release(req->lease_id(), req->token(), &who);
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
    // Deletes itself in OnDone, which is after the thread's Close(). The
    // thread is joined at shutdown, before this service is destroyed.
    auto* writer = new QueuedWriter<v1::GenerationEvent>(std::move(*hold));
    v1::WatchRequest copy = *req;
    absl::Status started = long_calls_->Start([this, writer, ctx, copy = std::move(copy),
                                                who = std::move(*who),
                                                slot = std::move(*slot)]() mutable {
      // The slot is given back before the stream closes, so that a client
      // that watches again as soon as its stream ends finds it free.
      auto close = [&writer, &slot](const grpc::Status& status) {
        { StreamSlots::Slot done = std::move(slot); }
        writer->Close(status);
      };
      // Not a reader of the current generation: refused now, not on the
      // next event.
      if (absl::Status s = models_->CheckCanRead(copy.model(), who); !s.ok()) {
        close(ToGrpcStatus(s));
        return;
      }
      uint64_t after = copy.after();
      if (after == 0) {
        auto current = models_->WaitForGeneration(copy.model(), 0, absl::ZeroDuration());
        if (!current.ok()) {
          close(ToGrpcStatus(current.status()));
          return;
        }
        after = (*current)->generation;
        if (copy.include_current()) after -= 1;
      }
      while (!ctx->IsCancelled() && !writer->cancelled()) {
        // A draining daemon ends its watches (within 500 ms) with
        // UNAVAILABLE: watch again once it is back.
        if (drain_->draining()) {
          close(ToGrpcStatus(CallDrain::DrainingError()));
          return;
        }
        auto event = models_->WaitForGeneration(copy.model(), after, absl::Milliseconds(500));
        if (!event.ok()) {
          close(ToGrpcStatus(event.status()));
          return;
        }
        if (!event->has_value()) continue;
        // A generation the caller may not read (a private adapter applied)
        // ends the stream.
        if (absl::Status s = auth_->policy().CheckRead(who, (*event)->guards); !s.ok()) {
          close(ToGrpcStatus(s));
          return;
        }
        v1::GenerationEvent msg;
        msg.set_model((*event)->model);
        msg.set_generation((*event)->generation);
        for (const std::string& a : (*event)->adapters) msg.add_adapters(a);
        msg.set_weights_id((*event)->content.Hex());
        after = (*event)->generation;
        writer->Push(std::move(msg), /*replaceable=*/false);
      }
      close(grpc::Status::CANCELLED);
    });
    if (!started.ok()) writer->Close(ToGrpcStatus(started));
    return writer;
  }

 private:
  // Constant after construction (borrowed).
  FetchService* fetches_;
  ModelService* models_;  // who may read a model; generation waits (Watch)
  ThreadPool* pool_;
  TaskThreads* long_calls_;
  CallDrain* drain_;
  const CallAuthenticator* auth_;
  StreamSlots watch_slots_;
};

}  // namespace

std::unique_ptr<grpc::Service> MakeShardsService(const ServiceContext& c, int max_watch_streams) {
  return std::make_unique<ShardsImpl>(c.engine.fetches, c.engine.models, c.pool, c.long_calls,
                                      c.drain, c.auth, max_watch_streams);
}

}  // namespace weightd
