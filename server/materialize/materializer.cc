#include "server/materialize/materializer.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "common/status_macros.h"

namespace weightd {

Materializer::Materializer(Options options)
    : options_(std::move(options)), fill_(options_.threads) {
  reclaimer_id_ = options_.memory->AddReclaimer(MemoryAccount::kRankCache,
                                                [this](uint64_t) { return EvictUnused(); });
}

Materializer::~Materializer() { options_.memory->RemoveReclaimer(reclaimer_id_); }

absl::StatusOr<std::vector<MaterializedTensor>> Materializer::Materialize(
    absl::Span<const MaterializeItem> items, const std::string& tag, const std::string& scope) {
  std::vector<MaterializedTensor> out(items.size());
  std::vector<std::string> keys;
  keys.reserve(items.size());
  for (const MaterializeItem& item : items) keys.push_back(MaterializeCache::Key(item, scope));
  const std::vector<size_t> misses = cache_.Lookup(keys, &out);
  if (misses.empty()) return out;
  // The reserve's background work waits while we compute.
  HostMemoryManager::WorkScope work_scope(options_.memory);

  WD_ASSIGN_OR_RETURN(PackPlan plan,
                      PlanPack(items, misses, options_.memory->reserve_chunk_bytes()));
  std::vector<std::unique_ptr<Segment>> buffers;
  buffers.reserve(plan.groups.size());
  for (const PackGroup& group : plan.groups) {
    WD_ASSIGN_OR_RETURN(std::unique_ptr<Segment> segment,
                        options_.memory->Allocate(std::max<uint64_t>(group.bytes, 1),
                                                  {.purpose = "shard", .warm = true}));
    buffers.push_back(std::move(segment));
  }
  std::vector<FillJob> jobs;
  jobs.reserve(plan.slots.size());
  for (const PackSlot& slot : plan.slots) {
    FillJob job{&items[slot.item], nullptr, nullptr, 0, slot.length};
    if (slot.view) {
      job.view_of = slot.view_of.get();  // the plan holds it
      job.view_offset = slot.offset;
    } else {
      job.dst = buffers[slot.group]->mutable_data() + slot.offset;
    }
    jobs.push_back(job);
  }
  WD_ASSIGN_OR_RETURN(std::vector<Digest> digests, fill_.Run(jobs));

  std::vector<MaterializeCache::Packed> packed;
  packed.reserve(plan.groups.size());
  for (size_t g = 0; g < plan.groups.size(); ++g) {
    // Clients read these, the daemon rarely (grpc transport, verify).
    WD_RETURN_IF_ERROR(buffers[g]->Seal(/*populate=*/false));
    packed.push_back({SegmentPtr(std::move(buffers[g])), plan.groups[g].first_base,
                      plan.groups[g].tagged});
  }
  for (size_t m = 0; m < plan.slots.size(); ++m) {
    const PackSlot& slot = plan.slots[m];
    BufferPtr buffer = slot.view ? slot.view_of : BufferPtr(packed[slot.group].buffer);
    out[slot.item] = MaterializedTensor{std::move(buffer), slot.offset, slot.length,
                                        digests[m], slot.view};
  }
  cache_.Insert(keys, misses, out, packed, tag);
  return out;
}

uint64_t Materializer::EvictUnused() { return Evict(/*orphans_only=*/false, /*now=*/true); }

uint64_t Materializer::Sweep() { return Evict(/*orphans_only=*/true, /*now=*/false); }

void Materializer::RetireTag(const std::string& tag) {
  if (tag.empty()) return;
  cache_.RetireTag(tag);
  Evict(/*orphans_only=*/true, /*now=*/false);
}

uint64_t Materializer::Evict(bool orphans_only, bool now) {
  std::vector<SegmentPtr> dropped;
  const uint64_t freed = cache_.Evict(orphans_only, &dropped);
  // The last holds are dropped without the cache's lock: giving a large
  // segment back to the kernel takes a while, and fetches wait for that
  // lock. The memory manager frees them here (`now`), in an idle moment or
  // on the disposer's thread.
  for (SegmentPtr& seg : dropped) options_.memory->Retire(std::move(seg), now);
  return freed;
}

MaterializerStats Materializer::stats() const { return cache_.stats(); }

}  // namespace weightd
