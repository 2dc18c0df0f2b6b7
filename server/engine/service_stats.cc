// WeightService: Stats(): the service's counters and its parts' aggregated into one
// snapshot.
#include "server/engine/weight_service.h"

#include <sys/stat.h>

#include <algorithm>
#include <tuple>
#include <cmath>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/base/log.h"
#include "common/untrusted_text.h"
#include "server/adapter/lora_patch.h"
#include "server/profile/name_summary.h"
#include "common/status_macros.h"
#include "server/base/thread_pool.h"

namespace weightd {

ServiceStats WeightService::Stats() const {
  ServiceStats s;
  // The models as they are now (immutable; walked without the lock).
  std::vector<std::shared_ptr<const Model>> models;
  {
    absl::MutexLock lock(&mu_);
    models.reserve(models_.size());
    for (const auto& [name, model] : models_) models.push_back(model);
  }
  {
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
  s.bytes_served = bytes_served_.load();
  s.bytes_read = bytes_read_.load();
  s.pinned_bytes = pinner_.pinned_bytes();
  s.pushes = pushes_.load();
  s.push_bytes = push_bytes_.load();
  s.publishes = publish_count_.load();
  s.publish_bytes = publish_bytes_.load();
  s.publish_seconds = static_cast<double>(publish_ns_.load()) / 1e9;
  s.publish_sessions = publish_.OpenSessions();
  s.publish_staging_prepared = publish_.staging_prepared();
  s.publish_staging_allocated = publish_.staging_allocated();
  s.publish_staging_ahead_bytes = staging_.Bytes();
  s.fetches = fetches_.load();
  s.applies = applies_.load();
  s.loads = loads_.load();
  s.load_bytes = load_bytes_.load();
  s.load_seconds = static_cast<double>(load_ns_.load()) / 1e9;
  s.fetch_errors = fetch_errors_.load();
  s.fetch_latency_shm = fetch_latency_shm_.Take();
  s.fetch_latency_grpc = fetch_latency_grpc_.Take();
  {
    absl::MutexLock lock(&peer_counters_mu_);
    s.load_bytes_storage = load_bytes_storage_;
    s.load_bytes_peers = load_bytes_peers_;
    s.load_bytes_peers_discarded = load_bytes_peers_discarded_;
    s.peer_transfers = peer_transfers_;
  }
  s.bytes_sent_to_peers = bytes_sent_to_peers_.load();
  if (options_.sources != nullptr) s.source = options_.sources->client().counters();
  {
    absl::MutexLock lock(&mu_);
    s.adapters = adapters_.size();
  }
  return s;
}

}  // namespace weightd
