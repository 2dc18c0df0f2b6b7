#include "server/store/load_tally.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace weightd {

void ReportDone(const LoadProgressFn& fn, uint64_t bytes, uint64_t tensors,
                const LoadProgressInfo* sources) {
  if (!fn) return;
  LoadProgressInfo done;
  if (sources != nullptr) done = *sources;
  done.bytes_done = done.bytes_total = bytes;
  done.tensors_done = done.tensors_total = tensors;
  done.current_file.clear();
  fn(done);
}

void LoadTally::SetTotals(uint64_t bytes, uint64_t tensors) {
  absl::MutexLock lock(&mu_);
  info_.bytes_total = bytes;
  info_.tensors_total = tensors;
}

void LoadTally::StorageRead(uint64_t bytes, const std::string& file, bool count) {
  absl::MutexLock lock(&mu_);
  report_->storage_bytes += bytes;
  if (count) Progress(bytes, file, "", "");
}

void LoadTally::PeerSent(uint64_t bytes, const std::string& file, const std::string& peer,
                         const std::string& transport, bool count) {
  absl::MutexLock lock(&mu_);
  report_->peer_bytes_discarded += bytes;
  if (count) Progress(bytes, file, peer, transport);
}

void LoadTally::PeerFailed(const std::string& peer) {
  absl::MutexLock lock(&mu_);
  report_->peer_failures[peer]++;
}

void LoadTally::KeepPeerBytes(const std::string& peer, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  report_->peer_bytes += bytes;
  report_->by_peer[peer] += bytes;
  report_->peer_bytes_discarded -= bytes;
}

void LoadTally::Progress(uint64_t bytes, const std::string& file, const std::string& peer,
                         const std::string& transport) {
  if (!fn_) return;
  info_.bytes_done += bytes;
  info_.current_file = file;
  if (peer.empty()) {
    info_.bytes_from_storage += bytes;
  } else {
    info_.bytes_from_peers += bytes;
    auto it = std::find(info_.peers.begin(), info_.peers.end(), peer);
    const size_t i = static_cast<size_t>(it - info_.peers.begin());
    if (it == info_.peers.end()) {
      info_.peers.push_back(peer);
      info_.peer_transports.push_back(transport);
    } else if (!transport.empty()) {
      // The transports it used, sorted, "+"-joined.
      std::vector<std::string> used = absl::StrSplit(info_.peer_transports[i], '+',
                                                     absl::SkipEmpty());
      if (std::find(used.begin(), used.end(), transport) == used.end()) {
        used.push_back(transport);
        std::sort(used.begin(), used.end());
        info_.peer_transports[i] = absl::StrJoin(used, "+");
      }
    }
  }
  fn_(info_);
}

}  // namespace weightd
