#include "server/grpc/ucx_offer.h"

#include <string>
#include <vector>

#include "server/base/log.h"

namespace weightd {

void OfferUcx(UcxPlane* ucx, const ResidentCopies& copies, const v1::FindCheckpointRequest& req,
              const Digest& key, const Principal& asker, v1::FindCheckpointResponse* resp) {
  if (ucx == nullptr || !req.ucx()) return;
  std::optional<Digest> copy = DigestFromBytes(resp->copy());
  if (!copy) return;
  auto sections = copies.HeldSections(key, *copy, asker);
  absl::Status why = sections.status();
  std::vector<UcxGrant> grants;
  if (sections.ok()) {
    for (const ResidentCopies::HeldSection& s : *sections) {
      auto g = ucx->Grant(s.segment, s.offset, s.length);
      if (!g.ok()) {
        why = g.status();
        break;
      }
      grants.push_back(std::move(*g));
    }
  }
  if (!why.ok()) {
    LogEvent(LogLevel::kWarning, "ucx_offer_failed",
             {{"key", key.Hex().substr(0, 12)}, {"error", why.ToString()},
              {"action", "answered without UCX; the peer reads over gRPC"}});
    return;
  }
  resp->set_ucx_worker(ucx->worker_address());
  for (const UcxGrant& g : grants) {
    v1::UcxRegion* r = resp->add_ucx_files();
    r->set_grant(g.id);
    r->set_token(g.token);
    r->set_length(g.length);
  }
}

void FillPeerTransports(const PeerCheckpointClient& peers, v1::StatsResponse* resp) {
  for (const auto& [key, t] : peers.TransportStats()) {
    v1::PeerTransportStats* out = resp->add_peer_transports();
    out->set_peer(key.first);
    out->set_transport(key.second);
    out->set_bytes(t.bytes);
    out->set_seconds(t.seconds);
    out->set_failures(t.failures);
  }
}

}  // namespace weightd
