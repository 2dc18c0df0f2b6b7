// The Models service's calls between daemons (models_service_impl.h): Peers
// (what this daemon knows of its peers), and FindCheckpoint/ReadCheckpoint,
// which serve a resident checkpoint to a fleet member loading it. The
// latter two are for fleet members only (AccessPolicy::CheckFleetMember),
// checked before anything about the request is looked at.
#include <grpcpp/grpcpp.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/fleet/peer_table.h"
#include "server/grpc/models_service_impl.h"
#include "server/grpc/reactors.h"
#include "server/grpc/ucx_offer.h"

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

// The peers as the poller last saw them; what each holds only with
// `models` (an admin asks).
void FillPeers(const PeerTable& peers, bool models, v1::PeersResponse* resp) {
  resp->set_advertise(peers.options().advertise);
  resp->set_peer_dns(peers.options().dns);
  resp->set_dns_error(peers.dns_error());
  resp->set_poll_seconds(
      static_cast<uint32_t>(absl::ToInt64Seconds(peers.options().poll_interval)));
  auto ms = [](absl::Time t) { return t == absl::InfinitePast() ? 0 : absl::ToUnixMillis(t); };
  for (const PeerState& p : peers.Snapshot()) {
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

void FillHolding(const PeerHolding& held, v1::FindCheckpointResponse* resp) {
  resp->set_copy(std::string(held.copy.View()));
  for (const std::vector<Digest>& file : held.tensor_digests) {
    std::string* out = resp->add_tensor_digests();
    out->reserve(file.size() * 16);
    for (const Digest& d : file) out->append(d.View().data(), d.View().size());
  }
  for (size_t k = 0; k < held.sample_digests.size(); ++k) {
    // A partial holder leaves the samples it has not read empty.
    const bool known = !held.partial || held.sample_known[k];
    resp->add_sample_digests(known ? std::string(held.sample_digests[k].View()) : std::string());
  }
  if (!held.partial) return;
  resp->set_partial(true);
  for (const CheckpointRange& r : held.available) {
    v1::CheckpointRange* out = resp->add_available();
    out->set_file(r.file);
    out->set_offset(r.offset);
    out->set_length(r.length);
  }
}

}  // namespace

grpc::ServerUnaryReactor* ModelsImpl::Peers(grpc::CallbackServerContext* ctx,
                                            const v1::PeersRequest*, v1::PeersResponse* resp) {
  auto who = auth_->Authenticate(ctx);
  if (!who.ok()) return Refuse(ctx, who.status());
  // What the peers hold (as their List shows it to this daemon's fleet
  // identity) is for admins: other callers see who answers, not names.
  const bool models = auth_->policy().CheckAdmin(*who, "see what peers hold").ok();
  if (peers_ != nullptr) FillPeers(*peers_, models, resp);
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* ModelsImpl::FindCheckpoint(grpc::CallbackServerContext* ctx,
                                                     const v1::FindCheckpointRequest* req,
                                                     v1::FindCheckpointResponse* resp) {
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
  return RunOnPool(ctx, pool_, drain_,
                   [this, req, resp, key = *key, samples = std::move(samples),
                    sample_digests = std::move(sample_digests), who = std::move(*who)] {
                     WD_ASSIGN_OR_RETURN(PeerHolding held,
                                         copies_->FindHeld(key, samples, sample_digests, who));
                     FillHolding(held, resp);
                     // Over UCX too, when the asker reads over it (same
                     // checks as above: the grants are for this copy only).
                     // A load still running here serves over gRPC only.
                     if (!held.partial) OfferUcx(ucx_, *copies_, *req, key, who, resp);
                     return absl::OkStatus();
                   });
}

grpc::ServerWriteReactor<v1::ReadChunk>* ModelsImpl::ReadCheckpoint(
    grpc::CallbackServerContext* ctx, const v1::ReadCheckpointRequest* req) {
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
  auto range = copies_->ReadHeld(*key, *copy, {r.file(), r.offset(), r.length()}, *who);
  if (!range.ok()) return RefuseStream<v1::ReadChunk>(range.status());
  return new ReadReactor(std::move(*range), std::move(*hold));  // deletes itself in OnDone
}

}  // namespace weightd
