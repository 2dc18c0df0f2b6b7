#include "server/materialize/item.h"

namespace weightd {

int64_t OutputElements(const MaterializeItem& item) {
  if (item.scalar.has_value()) return 1;
  int64_t n = 0;
  for (const PartSlice& s : item.slices) n += s.box.NumElements();
  return n;
}

bool IsPlainView(const MaterializeItem& item) {
  if (item.scalar.has_value() || item.fp8_scale.has_value() || item.slices.size() != 1) {
    return false;
  }
  const PartSlice& s = item.slices[0];
  return s.stored != nullptr && s.patches.empty() && s.stored->dtype == item.out_dtype &&
         IsContiguous(s.shape, s.box);
}

bool IsCastOfView(const MaterializeItem& item) {
  if (item.scalar.has_value() || item.fp8_scale.has_value() || item.slices.size() != 1) {
    return false;
  }
  const PartSlice& s = item.slices[0];
  return s.stored != nullptr && s.patches.empty() && s.stored->dtype != item.out_dtype &&
         CanCast(s.stored->dtype, item.out_dtype) && IsContiguous(s.shape, s.box);
}

}  // namespace weightd
