#include "server/materialize/materializer.h"

#include <algorithm>
#include <atomic>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/cast.h"
#include "common/status_macros.h"

namespace weightd {
namespace {

constexpr uint64_t kPackAlign = 64;

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// Linear element index of the box's first element, when the box is one
// contiguous run.
int64_t LinearStart(absl::Span<const int64_t> global_shape, const ShardBox& box) {
  int64_t index = 0;
  for (size_t d = 0; d < global_shape.size(); ++d) {
    index = index * global_shape[d] + box.offset[d];
  }
  return index;
}

}  // namespace

absl::Status CopyBox(const uint8_t* src, DType src_dtype,
                     absl::Span<const int64_t> global_shape, const ShardBox& box,
                     uint8_t* dst, DType dst_dtype) {
  const size_t ndim = global_shape.size();
  const int64_t total = box.NumElements();
  if (total == 0) return absl::OkStatus();
  const size_t in_size = DTypeSize(src_dtype);
  const size_t out_size = DTypeSize(dst_dtype);
  if (ndim == 0) return CastBuffer(src_dtype, src, dst_dtype, dst, 1);
  // The innermost dims the box covers whole collapse into one run together
  // with the last partial dim.
  size_t k = ndim;  // first dim of the collapsed run
  int64_t run = 1;
  while (k > 0) {
    --k;
    run *= box.shape[k];
    if (box.shape[k] != global_shape[k]) break;
  }
  // Strides of the global tensor, in elements.
  std::vector<int64_t> stride(ndim, 1);
  for (size_t d = ndim - 1; d > 0; --d) stride[d - 1] = stride[d] * global_shape[d];
  std::vector<int64_t> idx(k, 0);  // odometer over the box's outer dims
  const int64_t runs = total / run;
  for (int64_t r = 0; r < runs; ++r) {
    int64_t elem = box.offset[k] * stride[k];
    for (size_t d = 0; d < k; ++d) elem += (box.offset[d] + idx[d]) * stride[d];
    WD_RETURN_IF_ERROR(CastBuffer(src_dtype, src + elem * in_size, dst_dtype,
                                  dst + r * run * out_size, static_cast<size_t>(run)));
    for (size_t d = k; d-- > 0;) {
      if (++idx[d] < box.shape[d]) break;
      idx[d] = 0;
    }
  }
  return absl::OkStatus();
}

Materializer::Materializer(Options options) : options_(std::move(options)) {}

Materializer::Key Materializer::MakeKey(const MaterializeItem& item) {
  return Key{item.tensor->digest, item.tensor->dtype, item.out_dtype,
             item.tensor->shape,  item.box.offset,    item.box.shape};
}

bool Materializer::Lookup(const Key& key, ServedTensor* out) {
  auto it = cache_.find(key);
  if (it == cache_.end()) return false;
  const Entry& e = it->second;
  if (e.packed_segment_id == 0) {
    SegmentPtr seg = e.view_segment.lock();
    if (seg == nullptr) {
      cache_.erase(it);
      return false;
    }
    *out = ServedTensor{std::move(seg), e.offset, e.length, e.digest, true};
    return true;
  }
  auto p = packed_.find(e.packed_segment_id);
  if (p == packed_.end()) return false;
  *out = ServedTensor{p->second.segment, e.offset, e.length, e.digest, false};
  return true;
}

absl::StatusOr<std::vector<ServedTensor>> Materializer::Materialize(
    absl::Span<const MaterializeItem> items) {
  std::vector<ServedTensor> out(items.size());
  std::vector<Key> keys;
  keys.reserve(items.size());
  std::vector<size_t> misses;
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < items.size(); ++i) {
      keys.push_back(MakeKey(items[i]));
      if (Lookup(keys.back(), &out[i])) {
        ++stats_.hits;
      } else {
        ++stats_.misses;
        misses.push_back(i);
      }
    }
  }
  if (misses.empty()) return out;

  // Views need only a digest; the rest is packed into one new segment.
  std::vector<size_t> packed;
  uint64_t packed_bytes = 0;
  std::vector<uint64_t> pack_offset(items.size(), 0);
  for (size_t i : misses) {
    const MaterializeItem& item = items[i];
    const StoredTensor& t = *item.tensor;
    if (!CanCast(t.dtype, item.out_dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor \"", t.name, "\": cannot convert ", DTypeName(t.dtype), " to ",
          DTypeName(item.out_dtype)));
    }
    uint64_t length = static_cast<uint64_t>(item.box.NumElements()) * DTypeSize(item.out_dtype);
    if (item.out_dtype == t.dtype && IsContiguous(t.shape, item.box)) {
      uint64_t start = static_cast<uint64_t>(LinearStart(t.shape, item.box)) *
                       DTypeSize(t.dtype);
      out[i] = ServedTensor{t.segment, t.offset + start, length, Digest(), true};
    } else {
      pack_offset[i] = packed_bytes;
      packed_bytes = AlignUp(packed_bytes + length, kPackAlign);
      out[i].offset = pack_offset[i];
      out[i].length = length;
      packed.push_back(i);
    }
  }
  std::unique_ptr<Segment> segment;
  if (!packed.empty()) {
    WD_ASSIGN_OR_RETURN(segment, CreateSegment(std::max<uint64_t>(packed_bytes, 1)));
  }
  // Fill and digest in parallel, one item at a time.
  std::atomic<size_t> next{0};
  absl::Mutex err_mu;
  absl::Status first_error;
  auto worker = [&] {
    while (true) {
      size_t m = next.fetch_add(1);
      if (m >= misses.size()) return;
      size_t i = misses[m];
      const MaterializeItem& item = items[i];
      if (out[i].view) {
        out[i].digest = DigestBytes(out[i].segment->data() + out[i].offset, out[i].length);
        continue;
      }
      uint8_t* dst = segment->mutable_data() + out[i].offset;
      absl::Status s = CopyBox(item.tensor->data(), item.tensor->dtype, item.tensor->shape,
                               item.box, dst, item.out_dtype);
      if (!s.ok()) {
        absl::MutexLock lock(&err_mu);
        if (first_error.ok()) {
          first_error = Annotate(s, absl::StrCat("tensor \"", item.tensor->name, "\""));
        }
        continue;
      }
      out[i].digest = DigestBytes(dst, out[i].length);
    }
  };
  int threads = std::max(1, std::min<int>(options_.threads, static_cast<int>(misses.size())));
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
  WD_RETURN_IF_ERROR(first_error);

  SegmentPtr sealed;
  if (segment != nullptr) {
    WD_RETURN_IF_ERROR(segment->Seal());
    sealed = SegmentPtr(std::move(segment));
    for (size_t i : packed) out[i].segment = sealed;
  }

  absl::MutexLock lock(&mu_);
  if (sealed != nullptr) {
    PackedSegment& ps = packed_[sealed->id()];
    ps.segment = sealed;
    ps.base = items[packed.front()].tensor->segment;
    stats_.packed_segments++;
    stats_.packed_bytes += sealed->size();
  }
  for (size_t i : misses) {
    Entry e;
    e.offset = out[i].offset;
    e.length = out[i].length;
    e.digest = out[i].digest;
    if (out[i].view) {
      e.view_segment = out[i].segment;
    } else {
      e.packed_segment_id = sealed->id();
    }
    auto [it, inserted] = cache_.try_emplace(keys[i], e);
    if (!inserted) {
      // A concurrent call computed the same thing first: keep its entry
      // (identical bytes); ours lives on only as long as this fetch.
      continue;
    }
    if (!out[i].view) packed_[sealed->id()].entries++;
  }
  if (sealed != nullptr && packed_[sealed->id()].entries == 0) {
    stats_.packed_segments--;
    stats_.packed_bytes -= sealed->size();
    packed_.erase(sealed->id());
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Segment>> Materializer::CreateSegment(uint64_t size) {
  auto seg = Segment::Create(options_.account, "shard", size, /*prefault=*/true);
  if (seg.ok() || seg.status().code() != absl::StatusCode::kResourceExhausted) return seg;
  {
    absl::MutexLock lock(&mu_);
    if (EvictLocked(/*orphans_only=*/false) == 0) return seg.status();
  }
  return Segment::Create(options_.account, "shard", size, /*prefault=*/true);
}

uint64_t Materializer::EvictUnused() {
  absl::MutexLock lock(&mu_);
  return EvictLocked(/*orphans_only=*/false);
}

uint64_t Materializer::Sweep() {
  absl::MutexLock lock(&mu_);
  return EvictLocked(/*orphans_only=*/true);
}

uint64_t Materializer::EvictLocked(bool orphans_only) {
  uint64_t freed = 0;
  for (auto it = packed_.begin(); it != packed_.end();) {
    auto cur = it++;
    if (orphans_only && !cur->second.base.expired()) continue;
    if (cur->second.segment.use_count() == 1) {
      freed += cur->second.segment->size();
      stats_.packed_segments--;
      stats_.packed_bytes -= cur->second.segment->size();
      packed_.erase(cur);
    }
  }
  for (auto it = cache_.begin(); it != cache_.end();) {
    auto cur = it++;
    const Entry& e = cur->second;
    bool dead = e.packed_segment_id == 0 ? e.view_segment.expired()
                                         : !packed_.contains(e.packed_segment_id);
    if (dead) cache_.erase(cur);
  }
  return freed;
}

MaterializerStats Materializer::stats() const {
  absl::MutexLock lock(&mu_);
  MaterializerStats s = stats_;
  s.entries = cache_.size();
  return s;
}

}  // namespace weightd
