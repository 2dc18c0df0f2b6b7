// WeightService: Stats(): the service's counters and its parts' aggregated into one
// snapshot.
#include <algorithm>
#include <iterator>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "server/engine/weight_service.h"

namespace weightd {

namespace {

// The checkpoint and published bytes of `models`, summed and as held
// (ServiceStats' checkpoint_bytes_* and published_bytes_*).
void CountModelBytes(const std::vector<std::shared_ptr<const Model>>& models, ServiceStats& s) {
  s.models = models.size();
  absl::flat_hash_set<const Checkpoint*> held;
  absl::flat_hash_set<uint64_t> checkpoint_buffers;
  std::vector<const Checkpoint*> sharing;  // with tensors held elsewhere
  for (const auto& model : models) {
    s.checkpoint_bytes_logical += model->checkpoint->total_bytes();
    if (held.insert(model->checkpoint.get()).second) {
      // (Tensors shared from other holders count where they are held.)
      s.checkpoint_bytes_resident +=
          model->checkpoint->total_bytes() - model->checkpoint->bytes_held_elsewhere();
      for (const SegmentPtr& seg : model->checkpoint->host_segments()) {
        checkpoint_buffers.insert(seg->id());
      }
      if (model->checkpoint->bytes_held_elsewhere() > 0) {
        sharing.push_back(model->checkpoint.get());
      }
    }
  }
  absl::flat_hash_set<uint64_t> published_buffers;
  for (const auto& model : models) {
    if (model->current->published == nullptr) continue;
    for (const auto& [key, t] : *model->current->published) {
      s.published_bytes_logical += t->length;
      if (t->buffer == nullptr || checkpoint_buffers.contains(t->buffer->id())) continue;
      if (published_buffers.insert(t->buffer->id()).second) {
        s.published_bytes_resident += t->buffer->size();
      }
    }
  }
  // Shared tensors whose holder is gone (unloaded, its publish replaced)
  // are held by the checkpoints that share them: counted there, once.
  absl::flat_hash_set<std::pair<uint64_t, uint64_t>> orphans;  // (buffer id, offset)
  for (const Checkpoint* c : sharing) {
    for (const StoredTensor& t : c->tensors()) {
      if (t.buffer == nullptr) continue;
      const uint64_t id = t.buffer->id();
      if (checkpoint_buffers.contains(id) || published_buffers.contains(id)) continue;
      if (orphans.insert({id, t.offset}).second) s.checkpoint_bytes_resident += t.length;
    }
  }
}

}  // namespace

ServiceStats WeightService::Stats() const {
  ServiceStats s;
  // The models as they are now (immutable; walked without the lock).
  std::vector<std::shared_ptr<const Model>> models = catalog_.Models();
  CountModelBytes(models, s);
  const HostMemoryStats memory = memory_.stats();
  s.segments = memory.segments;
  s.bytes_resident = memory.used_bytes;
  s.memory_limit = memory.limit_bytes;
  s.reserve = memory.reserve;
  s.huge_pages = memory.huge_pages;
  std::copy(std::begin(memory.page_bytes), std::end(memory.page_bytes), std::begin(s.page_bytes));
  s.page_fallbacks = memory.page_fallbacks;
  s.host_pages = memory.host;
  s.materializer = materializer_.stats();
  s.leases_open = leases_.size();
  FetchStats fetch = fetch_.Stats();
  s.bytes_served = fetch.bytes_served;
  s.bytes_read = fetch.bytes_read;
  s.pinned_bytes = pinner_.pinned_bytes();
  s.pushes = fetch.pushes;
  s.push_bytes = fetch.push_bytes;
  s.publishes = publish_count_.load();
  s.publish_bytes = publish_bytes_.load();
  s.publish_seconds = static_cast<double>(publish_ns_.load()) / 1e9;
  s.publish_sessions = publish_.OpenSessions();
  s.publish_staging_prepared = publish_.staging_prepared();
  s.publish_staging_allocated = publish_.staging_allocated();
  s.publish_staging_ahead_bytes = staging_.Bytes();
  s.fetches = fetch.fetches;
  s.applies = adapters_.applies();
  LoadStats load = models_.Stats();
  s.loads = load.loads;
  s.load_bytes = load.load_bytes;
  s.load_seconds = load.load_seconds;
  s.fetch_errors = fetch.fetch_errors;
  s.fetch_latency_shm = fetch.fetch_latency_shm;
  s.fetch_latency_grpc = fetch.fetch_latency_grpc;
  s.load_bytes_storage = load.load_bytes_storage;
  s.load_bytes_peers = load.load_bytes_peers;
  s.load_bytes_peers_discarded = load.load_bytes_peers_discarded;
  s.peer_transfers = std::move(load.peer_transfers);
  s.bytes_sent_to_peers = copies_.bytes_sent_to_peers();
  s.adapters = catalog_.AdapterCount();
  if (options_.sources != nullptr) s.source = options_.sources->client().counters();
  return s;
}

}  // namespace weightd
