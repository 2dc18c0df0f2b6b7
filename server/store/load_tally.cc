#include "server/store/load_tally.h"

#include <algorithm>

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
  if (count) Progress(bytes, file, "");
}

void LoadTally::PeerSent(uint64_t bytes, const std::string& file, const std::string& peer,
                         bool count) {
  absl::MutexLock lock(&mu_);
  report_->peer_bytes_discarded += bytes;
  if (count) Progress(bytes, file, peer);
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

void LoadTally::Progress(uint64_t bytes, const std::string& file, const std::string& peer) {
  if (!fn_) return;
  info_.bytes_done += bytes;
  info_.current_file = file;
  if (peer.empty()) {
    info_.bytes_from_storage += bytes;
  } else {
    info_.bytes_from_peers += bytes;
    if (std::find(info_.peers.begin(), info_.peers.end(), peer) == info_.peers.end()) {
      info_.peers.push_back(peer);
    }
  }
  fn_(info_);
}

}  // namespace weightd
