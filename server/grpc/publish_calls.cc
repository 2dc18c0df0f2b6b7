// The Models service's publish calls (models_service_impl.h): a session is
// begun (BeginPublish), written (PublishWrite, or the data socket's staging),
// committed or aborted. Admins only ("publish weights"); each call changes
// what is served, so a draining daemon refuses it (CallDrain).
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/grpc/status_convert.h"
#include "server/grpc/models_service_impl.h"
#include "server/grpc/proto_convert.h"
#include "server/grpc/reactors.h"

namespace weightd {
namespace {

void FillPublishResult(const PublishResult& r, v1::PublishResult* out) {
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
  PublishWriteReactor(PublishService* publishes, ThreadPool* pool, CallDrain::Hold hold,
                      Principal caller, v1::PublishWriteResponse* resp)
      : publishes_(publishes),
        pool_(pool),
        caller_(std::move(caller)),
        resp_(resp),
        hold_(std::move(hold)) {
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
        Finish(ToGrpcStatus(
            absl::InvalidArgumentError("one PublishWrite stream writes to one session")));
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
    std::vector<PublishRun> runs;
    runs.reserve(chunk_.runs_size());
    for (const v1::PublishRun& r : chunk_.runs()) {
      runs.push_back(PublishRun{r.tensor(), r.offset(), r.length()});
    }
    auto progress =
        publishes_->Write(caller_, session_, token_, runs, chunk_.data(), chunk_.in_place());
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

  // Constant after construction.
  PublishService* const publishes_;
  ThreadPool* const pool_;
  const Principal caller_;
  v1::PublishWriteResponse* const resp_;
  // Owned by the call: one chunk is read or processed at a time.
  CallDrain::Hold hold_;
  v1::PublishChunk chunk_;
  uint64_t session_ = 0;
  std::string token_;
};

// A refused PublishWrite stream: finished at once.
class RefusedPublishWrite : public grpc::ServerReadReactor<v1::PublishChunk> {
 public:
  explicit RefusedPublishWrite(const absl::Status& s) { Finish(ToGrpcStatus(s)); }
  void OnDone() override { delete this; }  // gRPC reactor idiom
};

// BeginPublish's parameters from its request: INVALID_ARGUMENT for a tensor
// without a dtype.
absl::StatusOr<PublishBeginParams> BeginParams(const v1::BeginPublishRequest& req,
                                                              Principal who) {
  PublishBeginParams params;
  params.caller = std::move(who);
  params.model = req.model();
  params.expect_generation = req.expect_generation();
  params.timeout = absl::Seconds(req.timeout_seconds() == 0 ? 600 : req.timeout_seconds());
  for (const v1::PublishTensor& t : req.tensors()) {
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
  return params;
}

}  // namespace

grpc::ServerUnaryReactor* ModelsImpl::BeginPublish(grpc::CallbackServerContext* ctx,
                                                   const v1::BeginPublishRequest* req,
                                                   v1::PublishSession* resp) {
  auto who = auth_->AuthenticateAdmin(ctx, "publish weights");
  if (!who.ok()) return Refuse(ctx, who.status());
  return RunOnPool(
      ctx, pool_, drain_,
      [this, req, resp, who = std::move(*who)]() -> absl::Status {
        auto params = BeginParams(*req, who);
        if (!params.ok()) return params.status();
        auto info = publishes_->Begin(*params);
        if (!info.ok()) return info.status();
        resp->set_session(info->id);
        resp->set_token(info->token);
        resp->set_base_generation(info->base_generation);
        resp->set_bytes(info->bytes);
        resp->set_deadline_unix_ms(absl::ToUnixMillis(info->deadline));
        for (const std::string& n : info->per_part) resp->add_per_part(n);
        for (uint64_t o : info->layout.offsets) resp->add_offsets(o);
        resp->set_staging_bytes(info->staging_bytes);
        resp->set_data_socket(data_socket_path_);
        resp->set_data_socket_name(data_socket_name_);
        return absl::OkStatus();
      },
      /*change=*/true);
}

grpc::ServerReadReactor<v1::PublishChunk>* ModelsImpl::PublishWrite(
    grpc::CallbackServerContext* ctx, v1::PublishWriteResponse* resp) {
  auto who = auth_->AuthenticateAdmin(ctx, "publish weights");
  absl::StatusOr<CallDrain::Hold> hold =
      who.ok() ? drain_->Enter(/*change=*/true) : absl::StatusOr<CallDrain::Hold>(who.status());
  if (!hold.ok()) return new RefusedPublishWrite(hold.status());  // deletes itself in OnDone
  // Deletes itself in OnDone.
  return new PublishWriteReactor(publishes_, pool_, std::move(*hold), std::move(*who), resp);
}

grpc::ServerUnaryReactor* ModelsImpl::CommitPublish(grpc::CallbackServerContext* ctx,
                                                    const v1::CommitPublishRequest* req,
                                                    v1::PublishResult* resp) {
  auto who = auth_->AuthenticateAdmin(ctx, "publish weights");
  if (!who.ok()) return Refuse(ctx, who.status());
  auto hold = drain_->Enter(/*change=*/true);
  if (!hold.ok()) return Refuse(ctx, hold.status());
  auto* reactor = new HeldUnaryReactor(std::move(*hold));  // deletes itself in OnDone
  // It may wait: a thread of its own, not a pool worker.
  absl::Status started = long_calls_->Start([this, reactor, req, resp, who = std::move(*who)] {
    auto r = publishes_->Commit(who, req->session(), req->token(),
                                absl::Seconds(std::min<uint32_t>(req->wait_seconds(), 3600)));
    if (r.ok()) FillPublishResult(*r, resp);
    reactor->Finish(ToGrpcStatus(r.status()));
  });
  if (!started.ok()) reactor->Finish(ToGrpcStatus(started));
  return reactor;
}

grpc::ServerUnaryReactor* ModelsImpl::AbortPublish(grpc::CallbackServerContext* ctx,
                                                   const v1::AbortPublishRequest* req,
                                                   v1::AbortPublishResponse*) {
  auto who = auth_->AuthenticateAdmin(ctx, "publish weights");
  if (!who.ok()) return Refuse(ctx, who.status());
  return RunOnPool(
      ctx, pool_, drain_,
      [this, req, who = std::move(*who)] {
        return publishes_->Abort(who, req->session(), req->token());
      },
      /*change=*/true);
}

}  // namespace weightd
