// The daemon's side of its fleet as one part to start and stop: the
// channels to the peers (PeerChannels), the table of peers polled for what
// they hold (PeerTable: `weightctl peers`, the Peers RPC) and the client
// loads ask for checkpoint bytes (PeerCheckpointClient, the store's
// CheckpointPeers).
//
// Thread-safe (its parts are). Owns the three, destroyed in the reverse of
// the order they are built: the checkpoint client (borrowing the table and
// the channels), the table (its polling thread joined), the channels.
#ifndef WEIGHTD_SERVER_FLEET_FLEET_H_
#define WEIGHTD_SERVER_FLEET_FLEET_H_

#include <memory>

#include "absl/status/statusor.h"
#include "server/fleet/peer_channels.h"
#include "server/fleet/peer_checkpoint_client.h"
#include "server/fleet/peer_table.h"

namespace weightd {

class Fleet {
 public:
  // INVALID_ARGUMENT for an address that is not HOST:PORT, or credentials
  // that cannot be read (the file's own error). Polls at once, then every
  // poll_interval.
  // `ucx` (null: none; borrowed, outlives the fleet): the data plane
  // loads read over, as options.transport says.
  static absl::StatusOr<std::unique_ptr<Fleet>> Start(PeerOptions options,
                                                      UcxPlane* ucx = nullptr);
  Fleet(const Fleet&) = delete;
  Fleet& operator=(const Fleet&) = delete;

  PeerTable* table() const { return table_.get(); }
  CheckpointPeers* checkpoint_peers() const { return checkpoints_.get(); }
  const PeerCheckpointClient* checkpoint_client() const { return checkpoints_.get(); }

 private:
  Fleet() = default;

  // Set once by Start; declared in construction order.
  std::unique_ptr<PeerChannels> channels_;
  std::unique_ptr<PeerTable> table_;
  std::unique_ptr<PeerCheckpointClient> checkpoints_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_FLEET_FLEET_H_
