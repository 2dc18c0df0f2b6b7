// CheckpointPeers over gRPC: what a load asks the daemons of its fleet
// (server/store/peer_source.h) — which of the peers in the table hold a
// checkpoint (Models.FindCheckpoint), and a range of its bytes from one of
// them (Models.ReadCheckpoint, read with common/grpc/chunk_stream.h).
//
// Every peer of the table is asked: one whose last poll failed may be back
// (it gets a short deadline, so a peer down costs a load little). An
// answer is refused unless it has exactly the query's shape; with too
// little receive budget for call_threads true answers at once, fewer peers
// are asked at once (none, logged, when even one would not fit). A range's
// deadline: twice the call timeout plus 32 MiB/s of its length. A range
// whose chunks are out of order, too long or short is DATA_LOSS (the load
// then keeps nothing that peer sent).
//
// With a UCX data plane (--peer-transport auto|ucx) the question says the
// asker speaks UCX, and a holder that answers with its worker address and
// a grant per file is read over UCX (UcxPlane::Read, the same deadline);
// the others over gRPC (auto), or not at all (ucx: such a holder is
// refused at the question). A UCX read that fails fails the range, as a
// gRPC one does.
//
// Thread-safe (loads call it at once). Borrows the table, the channels and
// the plane (null: none), which must outlive it; keeps the holders' UCX
// grants of recent answers, and bytes and time per peer and transport.
#ifndef WEIGHTD_SERVER_FLEET_PEER_CHECKPOINT_CLIENT_H_
#define WEIGHTD_SERVER_FLEET_PEER_CHECKPOINT_CLIENT_H_

#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/fleet/peer_channels.h"
#include "server/fleet/peer_table.h"
#include "server/fleet/ucx_plane.h"
#include "server/store/peer_source.h"

namespace weightd {

class PeerCheckpointClient : public CheckpointPeers {
 public:
  PeerCheckpointClient(PeerTable* table, PeerChannels* channels, UcxPlane* ucx = nullptr,
                       PeerTransport transport = PeerTransport::kGrpc);
  PeerCheckpointClient(const PeerCheckpointClient&) = delete;
  PeerCheckpointClient& operator=(const PeerCheckpointClient&) = delete;

  std::vector<PeerHolding> FindHolders(const PeerQuery& query) override;
  absl::Status ReadRange(const std::string& peer, const Digest& key, const Digest& copy,
                         const CheckpointRange& range, uint8_t* dest,
                         const char** transport) override;

  // Bytes read and seconds spent reading, by (peer, transport: "ucx" or
  // "grpc"), since start.
  struct TransportTally {
    uint64_t bytes = 0;
    double seconds = 0;
    uint64_t failures = 0;
  };
  std::map<std::pair<std::string, std::string>, TransportTally> TransportStats() const
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // A holder's UCX answer: its worker and a grant per file.
  struct UcxOffer {
    std::string worker;
    std::vector<UcxGrant> files;
  };
  absl::Status ReadRangeGrpc(const std::string& peer, const Digest& key, const Digest& copy,
                             const CheckpointRange& range, uint8_t* dest,
                             absl::Duration deadline);
  void Count(const std::string& peer, const char* transport, uint64_t bytes, absl::Duration took,
             bool ok) ABSL_LOCKS_EXCLUDED(mu_);

  // What `peer` holds of query's checkpoint, or nullopt (not a holder, this
  // daemon itself, failed or refused: logged).
  std::optional<PeerHolding> AskOne(const std::string& peer, absl::Duration deadline,
                                    const v1::FindCheckpointRequest& req,
                                    const PeerQuery& query);

  // Constant after construction (borrowed).
  PeerTable* const table_;
  PeerChannels* const channels_;
  UcxPlane* const ucx_;
  const PeerTransport transport_;

  // Protected by mu_ (a leaf).
  mutable absl::Mutex mu_;
  // By peer + key + copy (the bytes of each), the most recent answers.
  std::map<std::string, UcxOffer> offers_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<std::string, std::string>, TransportTally> tally_ ABSL_GUARDED_BY(mu_);
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_FLEET_PEER_CHECKPOINT_CLIENT_H_
