// Client::Publish: one publish session (Models.BeginPublish), the bytes
// copied into the session's staging memfd (kShm) or streamed (kGrpc), the
// runs declared or sent (PublishWrite), the result taken (CommitPublish
// when the stream's answer had none). On any error the session is aborted:
// nothing is published.
#include <algorithm>
#include <cstring>
#include <memory>

#include <grpcpp/client_context.h>

#include "absl/strings/str_cat.h"
#include "client/channel.h"
#include "client/convert.h"
#include "client/data_socket.h"
#include "client/weightd_client.h"
#include "common/grpc/status_convert.h"
#include "common/status_macros.h"
#include "proto/convert/dtype_convert.h"

namespace weightd {
namespace {

constexpr uint64_t kPublishChunkBytes = uint64_t{4} << 20;
// Runs per in-place declaration message (~1.3 MiB).
constexpr int kDeclaredRuns = 65536;

v1::BeginPublishRequest BeginRequest(const std::string& model,
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
  return begin;
}

absl::StatusOr<v1::PublishSession> Begin(ClientChannel& c, const v1::BeginPublishRequest& req) {
  grpc::ClientContext ctx;
  v1::PublishSession session;
  WD_RETURN_IF_ERROR(FromGrpc(c.models->BeginPublish(&ctx, req, &session)));
  return session;
}

// Ends the session without publishing; returns `why`.
absl::Status Abort(ClientChannel& c, const v1::PublishSession& session, absl::Status why) {
  grpc::ClientContext ctx;
  v1::AbortPublishRequest req;
  req.set_session(session.session());
  req.set_token(session.token());
  v1::AbortPublishResponse resp;
  (void)c.models->AbortPublish(&ctx, req, &resp);
  return why;
}

// kShm: each tensor copied once into the staging memfd, which is unmapped
// before anything is declared (the commit refuses it while mapped).
absl::Status StageInPlace(ClientChannel& c, const v1::PublishSession& session,
                          const std::vector<PublishTensor>& tensors,
                          const PublishOptions& options) {
  if (session.offsets_size() != static_cast<int>(tensors.size())) {
    return absl::FailedPreconditionError(
        "the daemon offers no staging memfd for this publish; use the grpc transport");
  }
  WD_ASSIGN_OR_RETURN(
      UniqueFd fd,
      TakeStaging(DataSocketFor(c.socket_path, session.data_socket(), session.data_socket_name()),
                  session));
  WD_ASSIGN_OR_RETURN(MappedRegion map,
                      MappedRegion::Map(fd.get(), session.staging_bytes(),
                                        MappedRegion::Mode::kReadWrite, /*populate=*/true));
  uint64_t done = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const PublishTensor& t = tensors[i];
    const uint64_t want = static_cast<uint64_t>(NumElements(t.shape)) * DTypeSize(t.dtype);
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
}

// Writes a session's runs on one PublishWrite stream: declared (in place:
// at most kDeclaredRuns per message) or sent with their bytes (at most
// kPublishChunkBytes per message). The first message names the session.
// Not thread-safe; owned by one Publish.
class RunWriter {
 public:
  RunWriter(grpc::ClientWriter<v1::PublishChunk>* writer, const v1::PublishSession& session,
            bool in_place, const PublishOptions& options)
      : writer_(writer), session_(session), in_place_(in_place), options_(options) {
    chunk_.set_session(session.session());
    chunk_.set_token(session.token());
    chunk_.set_in_place(in_place);
  }

  // Every tensor's runs, then the last message; false once the stream broke.
  bool WriteAll(const std::vector<PublishTensor>& tensors) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      const bool ok = in_place_ ? Declare(static_cast<uint32_t>(i), tensors[i].length)
                                : Send(static_cast<uint32_t>(i), tensors[i]);
      if (!ok) return false;
    }
    return Flush();
  }

 private:
  bool Declare(uint32_t tensor, uint64_t length) {
    AddRun(tensor, 0, length);
    return chunk_.runs_size() >= kDeclaredRuns ? Flush() : true;
  }
  bool Send(uint32_t tensor, const PublishTensor& t) {
    for (uint64_t at = 0; at < t.length;) {
      const uint64_t n = std::min(kPublishChunkBytes - chunk_.data().size(), t.length - at);
      AddRun(tensor, at, n);
      chunk_.mutable_data()->append(reinterpret_cast<const char*>(t.data) + at, n);
      at += n;
      if (chunk_.data().size() >= kPublishChunkBytes && !Flush()) return false;
    }
    return true;
  }
  void AddRun(uint32_t tensor, uint64_t offset, uint64_t length) {
    v1::PublishRun* run = chunk_.add_runs();
    run->set_tensor(tensor);
    run->set_offset(offset);
    run->set_length(length);
  }
  bool Flush() {
    if (chunk_.runs_size() == 0) return true;
    sent_ += chunk_.data().size();
    const bool ok = writer_->Write(chunk_);
    chunk_.Clear();
    chunk_.set_in_place(in_place_);
    if (ok && !in_place_ && options_.progress) options_.progress(sent_, session_.bytes());
    return ok;
  }

  // Constant after construction.
  grpc::ClientWriter<v1::PublishChunk>* const writer_;
  const v1::PublishSession& session_;
  const bool in_place_;
  const PublishOptions& options_;

  // The message being filled, and the bytes sent before it.
  v1::PublishChunk chunk_;
  uint64_t sent_ = 0;
};

// The runs on one PublishWrite stream; its answer (with the result when the
// last byte committed the publish).
absl::StatusOr<v1::PublishWriteResponse> StreamRuns(ClientChannel& c,
                                                    const v1::PublishSession& session,
                                                    const std::vector<PublishTensor>& tensors,
                                                    bool in_place,
                                                    const PublishOptions& options) {
  v1::PublishWriteResponse written;
  grpc::ClientContext ctx;
  auto writer = c.models->PublishWrite(&ctx, &written);
  if (RunWriter(writer.get(), session, in_place, options).WriteAll(tensors)) {
    writer->WritesDone();
  }
  WD_RETURN_IF_ERROR(FromGrpc(writer->Finish()));
  return written;
}

absl::StatusOr<v1::PublishResult> Commit(ClientChannel& c, const v1::PublishSession& session) {
  v1::CommitPublishRequest commit;
  commit.set_session(session.session());
  commit.set_token(session.token());
  v1::PublishResult result;
  grpc::ClientContext ctx;
  WD_RETURN_IF_ERROR(FromGrpc(c.models->CommitPublish(&ctx, commit, &result)));
  return result;
}

}  // namespace

absl::StatusOr<PublishOutcome> Client::Publish(const std::string& model,
                                               const std::vector<PublishTensor>& tensors,
                                               const PublishOptions& options) {
  const v1::BeginPublishRequest begin = BeginRequest(model, tensors, options);
  const Transport transport = options.transport.value_or(
      channel_->socket_path.empty() ? Transport::kGrpc : Transport::kShm);
  if (transport != Transport::kShm && transport != Transport::kGrpc) {
    return absl::InvalidArgumentError("a publish goes over the shm or the grpc transport");
  }
  const bool in_place = transport == Transport::kShm;
  WD_ASSIGN_OR_RETURN(v1::PublishSession session, Begin(*channel_, begin));
  if (in_place) {
    absl::Status copied = StageInPlace(*channel_, session, tensors, options);
    if (!copied.ok()) return Abort(*channel_, session, copied);
  }
  absl::StatusOr<v1::PublishWriteResponse> written =
      StreamRuns(*channel_, session, tensors, in_place, options);
  if (!written.ok()) return Abort(*channel_, session, written.status());
  if (written->has_result()) return ToPublishOutcome(written->result());
  // Every byte sent, yet the result came to nobody (an empty publish, or
  // the tensors were given shorter than their shapes): ask.
  absl::StatusOr<v1::PublishResult> result = Commit(*channel_, session);
  if (!result.ok()) return Abort(*channel_, session, result.status());
  return ToPublishOutcome(*result);
}

}  // namespace weightd
