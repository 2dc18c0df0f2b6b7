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
// Thread-safe (loads call it at once); no state of its own beyond what it
// borrows: the table and the channels, which must outlive it.
#ifndef WEIGHTD_SERVER_FLEET_PEER_CHECKPOINT_CLIENT_H_
#define WEIGHTD_SERVER_FLEET_PEER_CHECKPOINT_CLIENT_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/fleet/peer_channels.h"
#include "server/fleet/peer_table.h"
#include "server/store/peer_source.h"

namespace weightd {

class PeerCheckpointClient : public CheckpointPeers {
 public:
  PeerCheckpointClient(PeerTable* table, PeerChannels* channels);
  PeerCheckpointClient(const PeerCheckpointClient&) = delete;
  PeerCheckpointClient& operator=(const PeerCheckpointClient&) = delete;

  std::vector<PeerHolding> FindHolders(const PeerQuery& query) override;
  absl::Status ReadRange(const std::string& peer, const Digest& key, const Digest& copy,
                         const CheckpointRange& range, uint8_t* dest) override;

 private:
  // What `peer` holds of query's checkpoint, or nullopt (not a holder, this
  // daemon itself, failed or refused: logged).
  std::optional<PeerHolding> AskOne(const std::string& peer, absl::Duration deadline,
                                    const v1::FindCheckpointRequest& req,
                                    const PeerQuery& query);

  // Constant after construction (borrowed).
  PeerTable* const table_;
  PeerChannels* const channels_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_FLEET_PEER_CHECKPOINT_CLIENT_H_
