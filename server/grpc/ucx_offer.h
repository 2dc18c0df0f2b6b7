// The holder's side of the UCX data plane in FindCheckpoint (issue 41):
// once the handler has authenticated the caller, checked it is a fleet
// member and found the copy it may read (WeightService::FindHeld), and
// only when the request says the caller speaks UCX, the answer gains this
// daemon's UCX worker address and a grant per file of that copy
// (UcxPlane::Grant: its segment registered once, the grant gone when the
// segment goes). Nothing is granted for a copy FindHeld would not offer:
// not a private model's or publish's bytes, never staging (not resident
// checkpoints at all).
#ifndef WEIGHTD_SERVER_GRPC_UCX_OFFER_H_
#define WEIGHTD_SERVER_GRPC_UCX_OFFER_H_

#include "absl/status/status.h"
#include "common/digest.h"
#include "server/auth/access_control.h"
#include "server/service/resident_copies.h"
#include "server/fleet/peer_checkpoint_client.h"
#include "server/fleet/ucx_plane.h"
#include "weightd/v1/weightd.pb.h"

namespace weightd {

// Adds the UCX offer of copy `resp->copy()` of `key` to `resp` when `ucx`
// (null: none) and `req.ucx()`. A copy gone meanwhile, or a grant UCX
// refuses, leaves the answer without it (the asker reads over gRPC);
// logged. Never fails the call.
void OfferUcx(UcxPlane* ucx, const ResidentCopies& copies, const v1::FindCheckpointRequest& req,
              const Digest& key, const Principal& asker, v1::FindCheckpointResponse* resp);

// Stats.peer_transports: the loads' reads by peer and transport.
void FillPeerTransports(const PeerCheckpointClient& peers, v1::StatsResponse* resp);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_GRPC_UCX_OFFER_H_
