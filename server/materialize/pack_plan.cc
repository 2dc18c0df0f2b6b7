#include "server/materialize/pack_plan.h"

#include "absl/strings/str_cat.h"
#include "server/kernels/cast.h"

namespace weightd {
namespace {

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// Linear element index of the box's first element.
int64_t LinearStart(absl::Span<const int64_t> global_shape, const ShardBox& box) {
  int64_t index = 0;
  for (size_t d = 0; d < global_shape.size(); ++d) {
    index = index * global_shape[d] + box.offset[d];
  }
  return index;
}

}  // namespace

absl::StatusOr<PackPlan> PlanPack(absl::Span<const MaterializeItem> items,
                                  absl::Span<const size_t> misses, uint64_t chunk_bytes) {
  PackPlan plan;
  plan.slots.reserve(misses.size());
  size_t open_group = SIZE_MAX;  // the group still taking items
  for (size_t i : misses) {
    const MaterializeItem& item = items[i];
    const StoredTensor* base = nullptr;
    bool tagged = item.fp8_scale.has_value() || item.scalar.has_value();
    for (const PartSlice& s : item.slices) {
      if (s.stored != nullptr && !CanCast(s.stored->dtype, item.out_dtype) &&
          !item.fp8_scale.has_value()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor \"", item.name, "\": cannot convert ", DTypeName(s.stored->dtype), " to ",
            DTypeName(item.out_dtype)));
      }
      if (base == nullptr && s.stored != nullptr) base = s.stored;
      tagged = tagged || !s.patches.empty();
    }
    PackSlot slot;
    slot.item = i;
    slot.length = static_cast<uint64_t>(OutputElements(item)) * DTypeSize(item.out_dtype);
    if (IsPlainView(item)) {
      const PartSlice& s = item.slices[0];
      // An empty box's linear start can lie past the tensor (a [0, n] tensor
      // split on dim 1), even past 2^63 bytes: it points at the start.
      const uint64_t start = slot.length == 0
                                 ? 0
                                 : static_cast<uint64_t>(LinearStart(s.shape, s.box)) *
                                       DTypeSize(s.stored->dtype);
      slot.view = true;
      slot.view_of = s.stored->buffer;
      slot.offset = s.stored->offset + start;
      plan.slots.push_back(std::move(slot));
      continue;
    }
    if (chunk_bytes != 0 && slot.length > chunk_bytes) {
      slot.group = plan.groups.size();  // too big for a chunk: a group of its own
      plan.groups.emplace_back();
    } else {
      if (open_group == SIZE_MAX ||
          (chunk_bytes != 0 && plan.groups[open_group].bytes + slot.length > chunk_bytes)) {
        open_group = plan.groups.size();
        plan.groups.emplace_back();
      }
      slot.group = open_group;
    }
    PackGroup& group = plan.groups[slot.group];
    slot.offset = group.bytes;
    group.bytes = AlignUp(group.bytes + slot.length, kPackAlign);
    group.tagged = group.tagged || tagged;
    if (group.first_base == nullptr) group.first_base = base;
    group.slots.push_back(plan.slots.size());
    plan.slots.push_back(std::move(slot));
  }
  return plan;
}

}  // namespace weightd
