// What a checkpoint load tells while it runs: its progress (a
// LoadProgressFn the caller passes, called from the reader threads) and
// where its bytes came from (the caller's LoadSourceReport).
#ifndef WEIGHTD_SERVER_STORE_LOAD_TALLY_H_
#define WEIGHTD_SERVER_STORE_LOAD_TALLY_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/store/peer_source.h"

namespace weightd {

struct LoadProgressInfo {
  uint64_t bytes_done = 0;
  uint64_t bytes_total = 0;
  uint64_t tensors_done = 0;
  uint64_t tensors_total = 0;
  std::string current_file;
  // Where the bytes done came from (peers: the addresses that sent some;
  // peer_transports, per peer: what carried them, "grpc", "ucx" or
  // "grpc+ucx").
  uint64_t bytes_from_storage = 0;
  uint64_t bytes_from_peers = 0;
  std::vector<std::string> peers;
  std::vector<std::string> peer_transports;
};
using LoadProgressFn = std::function<void(const LoadProgressInfo&)>;

// The last progress report of a load: everything done (`sources`: where
// the bytes came from, when they were read). Nothing without `fn`.
void ReportDone(const LoadProgressFn& fn, uint64_t bytes, uint64_t tensors,
                const LoadProgressInfo* sources = nullptr);

// One load's running progress and source counts. Thread-safe: the reader
// threads count into it. Its mutex is a leaf; the progress function runs
// under it (reports arrive in order) and must not call back into the
// tally. Owns neither the function nor the report: both outlive it.
class LoadTally {
 public:
  LoadTally(const LoadProgressFn& fn, LoadSourceReport* report) : fn_(fn), report_(report) {}

  // The totals progress reports carry; before any bytes are counted.
  void SetTotals(uint64_t bytes, uint64_t tensors) ABSL_LOCKS_EXCLUDED(mu_);
  // `bytes` read from storage (samples and checks included); with `count`,
  // also progress on `file`.
  void StorageRead(uint64_t bytes, const std::string& file, bool count) ABSL_LOCKS_EXCLUDED(mu_);
  // `bytes` of `file` that `peer` sent over `transport` ("grpc", "ucx"):
  // counted discarded until the load keeps them (KeepPeerBytes); with
  // `count`, also progress.
  void PeerSent(uint64_t bytes, const std::string& file, const std::string& peer,
                const std::string& transport, bool count) ABSL_LOCKS_EXCLUDED(mu_);
  // A range `peer` failed (or a holder turned away for its answer).
  void PeerFailed(const std::string& peer) ABSL_LOCKS_EXCLUDED(mu_);
  // `bytes` from `peer` that the load keeps (once, at its end).
  void KeepPeerBytes(const std::string& peer, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Progress(uint64_t bytes, const std::string& file, const std::string& peer,
                const std::string& transport) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Constant after construction.
  const LoadProgressFn& fn_;

  // Protected by mu_.
  absl::Mutex mu_;
  LoadSourceReport* const report_ ABSL_PT_GUARDED_BY(mu_);
  LoadProgressInfo info_ ABSL_GUARDED_BY(mu_);
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_STORE_LOAD_TALLY_H_
