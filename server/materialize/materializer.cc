#include "server/materialize/materializer.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/cast.h"
#include "common/status_macros.h"
#include "common/thread_pool.h"

namespace weightd {
namespace {

constexpr uint64_t kPackAlign = 64;
constexpr float kFp8E4M3Max = 448.0f;

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// Linear element index of the box's first element.
int64_t LinearStart(absl::Span<const int64_t> global_shape, const ShardBox& box) {
  int64_t index = 0;
  for (size_t d = 0; d < global_shape.size(); ++d) {
    index = index * global_shape[d] + box.offset[d];
  }
  return index;
}

bool IsPlainView(const MaterializeItem& item) {
  if (item.scalar.has_value() || item.fp8_scale.has_value() || item.slices.size() != 1) {
    return false;
  }
  const PartSlice& s = item.slices[0];
  return s.stored != nullptr && s.patches.empty() && s.stored->dtype == item.out_dtype &&
         IsContiguous(s.shape, s.box);
}

void AppendFloat(std::string* key, float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  absl::StrAppend(key, bits, ";");
}

// Floats per block when a slice is computed in fp32: small enough to stay
// in cache and to reuse one buffer per thread (fresh pages cost more here
// than the arithmetic), large enough for efficient GEMMs.
constexpr int64_t kBlockFloats = 1 << 18;

// Calls fn(box, values, n) for consecutive row blocks of the slice, with the
// fp32 values of each block (patches applied) in box order.
absl::Status ForEachFloatBlock(
    const PartSlice& s,
    const std::function<absl::Status(const ShardBox&, float*, int64_t)>& fn) {
  const int64_t total = s.box.NumElements();
  if (total == 0) return absl::OkStatus();
  BaseRowReader base = [&s](int64_t row_begin, int64_t row_end, float* out) -> absl::Status {
    if (s.shape.empty() || row_begin < 0 || row_end > s.shape[0] || row_begin > row_end) {
      return absl::InternalError("base row read out of range");
    }
    int64_t cols = 1;
    for (size_t d = 1; d < s.shape.size(); ++d) cols *= s.shape[d];
    if (s.stored == nullptr) {
      std::fill(out, out + (row_end - row_begin) * cols, 0.0f);
      return absl::OkStatus();
    }
    ShardBox rows;
    rows.offset.assign(s.shape.size(), 0);
    rows.offset[0] = row_begin;
    rows.shape = s.shape;
    rows.shape[0] = row_end - row_begin;
    return CopyBox(s.stored->data(), s.stored->dtype, s.shape, rows,
                   reinterpret_cast<uint8_t*>(out), DType::kF32);
  };
  const int64_t rows = s.box.shape.empty() ? 1 : s.box.shape[0];
  const int64_t per_row = total / rows;
  const int64_t block = std::max<int64_t>(1, std::min<int64_t>(rows, kBlockFloats / std::max<int64_t>(per_row, 1)));
  thread_local std::vector<float> acc;
  acc.resize(static_cast<size_t>(block * per_row));
  for (int64_t r = 0; r < rows; r += block) {
    ShardBox sub = s.box;
    if (!sub.shape.empty()) {
      sub.offset[0] += r;
      sub.shape[0] = std::min(block, rows - r);
    }
    const int64_t n = sub.NumElements();
    if (s.stored != nullptr) {
      WD_RETURN_IF_ERROR(CopyBox(s.stored->data(), s.stored->dtype, s.shape, sub,
                                 reinterpret_cast<uint8_t*>(acc.data()), DType::kF32));
    } else {
      std::fill(acc.begin(), acc.begin() + n, 0.0f);
    }
    for (const AppliedPatch& p : s.patches) {
      WD_RETURN_IF_ERROR(p.patch->Apply(sub, s.shape, p.strength, base, acc.data()));
    }
    WD_RETURN_IF_ERROR(fn(sub, acc.data(), n));
  }
  return absl::OkStatus();
}

}  // namespace

int64_t OutputElements(const MaterializeItem& item) {
  if (item.scalar.has_value()) return 1;
  int64_t n = 0;
  for (const PartSlice& s : item.slices) n += s.box.NumElements();
  return n;
}

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

absl::Status FillItem(const MaterializeItem& item, uint8_t* dst, DigestBuilder* digest) {
  const size_t out_size = DTypeSize(item.out_dtype);
  if (item.scalar.has_value()) {
    WD_RETURN_IF_ERROR(CastBuffer(DType::kF32, &*item.scalar, item.out_dtype, dst, 1));
    if (digest != nullptr) digest->Update(dst, out_size);
    return absl::OkStatus();
  }
  if (item.fp8_scale.has_value() && item.out_dtype != DType::kF8E4M3) {
    return absl::InternalError("fp8 quantization needs F8_E4M3 output");
  }
  uint64_t off = 0;
  for (const PartSlice& s : item.slices) {
    const int64_t n = s.box.NumElements();
    if (n == 0) continue;
    uint8_t* out = dst + off;
    off += static_cast<uint64_t>(n) * out_size;
    if (s.stored != nullptr && s.patches.empty() && !item.fp8_scale.has_value()) {
      if (!CanCast(s.stored->dtype, item.out_dtype)) {
        return absl::InvalidArgumentError(absl::StrCat("cannot convert ",
                                                       DTypeName(s.stored->dtype), " to ",
                                                       DTypeName(item.out_dtype)));
      }
      WD_RETURN_IF_ERROR(CopyBox(s.stored->data(), s.stored->dtype, s.shape, s.box, out,
                                 item.out_dtype));
      if (digest != nullptr) digest->Update(out, static_cast<size_t>(n) * out_size);
      continue;
    }
    if (s.stored == nullptr && s.patches.empty() && !item.fp8_scale.has_value()) {
      std::memset(out, 0, static_cast<size_t>(n) * out_size);  // zero in every dtype
      if (digest != nullptr) digest->Update(out, static_cast<size_t>(n) * out_size);
      continue;
    }
    if (!IsFloating(item.out_dtype) || !IsFloating(s.dtype)) {
      return absl::InvalidArgumentError("adapter patches apply only to floating tensors");
    }
    uint8_t* cursor = out;
    WD_RETURN_IF_ERROR(ForEachFloatBlock(s, [&](const ShardBox&, float* v, int64_t count) {
      if (item.fp8_scale.has_value()) {
        const float scale = *item.fp8_scale;
        for (int64_t i = 0; i < count; ++i) {
          float x = v[i] / scale;
          if (x > kFp8E4M3Max) x = kFp8E4M3Max;
          if (x < -kFp8E4M3Max) x = -kFp8E4M3Max;
          v[i] = x;
        }
      }
      WD_RETURN_IF_ERROR(CastBuffer(DType::kF32, v, item.out_dtype, cursor,
                                    static_cast<size_t>(count)));
      if (digest != nullptr) digest->Update(cursor, static_cast<size_t>(count) * out_size);
      cursor += static_cast<size_t>(count) * out_size;
      return absl::OkStatus();
    }));
  }
  return absl::OkStatus();
}

absl::StatusOr<float> AbsMax(absl::Span<const PartSlice> slices) {
  float amax = 0.0f;
  for (const PartSlice& s : slices) {
    WD_RETURN_IF_ERROR(ForEachFloatBlock(s, [&](const ShardBox&, float* v, int64_t count) {
      for (int64_t i = 0; i < count; ++i) {
        float a = std::fabs(v[i]);
        if (a > amax) amax = a;  // NaN compares false: ignored
      }
      return absl::OkStatus();
    }));
  }
  return amax;
}

Materializer::Materializer(Options options) : options_(std::move(options)) {
  reclaimer_id_ = options_.memory->AddReclaimer(MemoryAccount::kRankCache,
                                                [this](uint64_t) { return EvictUnused(); });
}

Materializer::~Materializer() { options_.memory->RemoveReclaimer(reclaimer_id_); }

std::string Materializer::MakeKey(const MaterializeItem& item, const std::string& scope) {
  // The scope first, length-prefixed: entries of different scopes never
  // meet, whatever the rest of the key holds.
  std::string key = absl::StrCat(scope.size(), "#", scope, "|", static_cast<int>(item.out_dtype), "|");
  if (item.scalar.has_value()) {
    key += "scalar:";
    AppendFloat(&key, *item.scalar);
    return key;
  }
  if (item.fp8_scale.has_value()) {
    key += "fp8:";
    AppendFloat(&key, *item.fp8_scale);
  }
  for (const PartSlice& s : item.slices) {
    if (s.stored != nullptr) {
      absl::StrAppend(&key, "P", s.stored->digest.Hex(), ":", static_cast<int>(s.stored->dtype));
    } else {
      absl::StrAppend(&key, "Z", static_cast<int>(s.dtype));
    }
    absl::StrAppend(&key, "[", absl::StrJoin(s.shape, ","), "]@[", absl::StrJoin(s.box.offset, ","),
                    "]+[", absl::StrJoin(s.box.shape, ","), "]");
    for (const AppliedPatch& p : s.patches) {
      absl::StrAppend(&key, "{", p.patch->CacheKey(), "*");
      AppendFloat(&key, p.strength);
      key += "}";
    }
    key += "|";
  }
  return key;
}

bool Materializer::Lookup(const std::string& key, MaterializedTensor* out) {
  auto it = cache_.find(key);
  if (it == cache_.end()) return false;
  const Entry& e = it->second;
  if (e.packed_segment_id == 0) {
    SegmentPtr seg = e.view_segment.lock();
    if (seg == nullptr) {
      cache_.erase(it);
      return false;
    }
    *out = MaterializedTensor{std::move(seg), e.offset, e.length, e.digest, true};
    return true;
  }
  auto p = packed_.find(e.packed_segment_id);
  if (p == packed_.end()) return false;
  *out = MaterializedTensor{p->second.segment, e.offset, e.length, e.digest, false};
  return true;
}

absl::StatusOr<std::vector<MaterializedTensor>> Materializer::Materialize(
    absl::Span<const MaterializeItem> items, const std::string& tag, const std::string& scope) {
  std::vector<MaterializedTensor> out(items.size());
  std::vector<std::string> keys;
  keys.reserve(items.size());
  std::vector<size_t> misses;
  for (const MaterializeItem& item : items) keys.push_back(MakeKey(item, scope));
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < items.size(); ++i) {
      if (Lookup(keys[i], &out[i])) {
        ++stats_.hits;
      } else {
        ++stats_.misses;
        misses.push_back(i);
      }
    }
  }
  if (misses.empty()) return out;
  // The reserve's background work waits while we compute.
  HostMemoryManager::WorkScope work_scope(options_.memory);

  // Views need only a digest; the rest is packed into new segments: one,
  // or with a pool, as many chunk-sized ones as the misses fill.
  struct Group {
    uint64_t bytes = 0;
    bool tagged = false;
    const StoredTensor* first_base = nullptr;
    std::vector<size_t> items;
    std::unique_ptr<Segment> segment;
    SegmentPtr sealed;
  };
  const uint64_t chunk = options_.memory->reserve_chunk_bytes();
  std::vector<Group> groups;
  std::vector<size_t> group_of(items.size(), 0);
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
    uint64_t length = static_cast<uint64_t>(OutputElements(item)) * DTypeSize(item.out_dtype);
    if (IsPlainView(item)) {
      const PartSlice& s = item.slices[0];
      // An empty box's linear start can lie past the tensor (a [0, n] tensor
      // split on dim 1), even past 2^63 bytes: it points at the start.
      uint64_t start = length == 0 ? 0
                                   : static_cast<uint64_t>(LinearStart(s.shape, s.box)) *
                                         DTypeSize(s.stored->dtype);
      out[i] = MaterializedTensor{s.stored->segment, s.stored->offset + start, length, Digest(),
                                  true};
      continue;
    }
    size_t g;
    if (chunk != 0 && length > chunk) {
      g = groups.size();  // too big for a chunk: a segment of its own
      groups.emplace_back();
    } else {
      if (open_group == SIZE_MAX ||
          (chunk != 0 && groups[open_group].bytes + length > chunk)) {
        open_group = groups.size();
        groups.emplace_back();
      }
      g = open_group;
    }
    Group& group = groups[g];
    out[i].offset = group.bytes;
    out[i].length = length;
    group.bytes = AlignUp(group.bytes + length, kPackAlign);
    group.tagged = group.tagged || tagged;
    if (group.first_base == nullptr) group.first_base = base;
    group.items.push_back(i);
    group_of[i] = g;
  }
  for (Group& group : groups) {
    WD_ASSIGN_OR_RETURN(group.segment,
                        options_.memory->Allocate(std::max<uint64_t>(group.bytes, 1),
                                                  {.purpose = "shard", .warm = true}));
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
      if (out[i].view) {
        out[i].digest = DigestBytes(out[i].segment->data() + out[i].offset, out[i].length);
        continue;
      }
      uint8_t* dst = groups[group_of[i]].segment->mutable_data() + out[i].offset;
      DigestBuilder digest;
      absl::Status s = FillItem(items[i], dst, &digest);
      if (!s.ok()) {
        absl::MutexLock lock(&err_mu);
        if (first_error.ok()) first_error = Annotate(s, absl::StrCat("tensor \"", items[i].name, "\""));
        continue;
      }
      out[i].digest = digest.Finish();
    }
  };
  int threads = std::max(1, std::min<int>(options_.threads, static_cast<int>(misses.size())));
  RunOnThreads(threads, worker);  // never aborts at the thread limit
  WD_RETURN_IF_ERROR(first_error);

  for (Group& group : groups) {
    // Clients read these, the daemon rarely (grpc transport, verify).
    WD_RETURN_IF_ERROR(group.segment->Seal(/*populate=*/false));
    group.sealed = SegmentPtr(std::move(group.segment));
    for (size_t i : group.items) out[i].segment = group.sealed;
  }

  absl::MutexLock lock(&mu_);
  for (const Group& group : groups) {
    PackedSegment& ps = packed_[group.sealed->id()];
    ps.segment = group.sealed;
    if (group.first_base != nullptr) ps.base = group.first_base->segment;
    if (group.tagged) ps.tag = tag;
    stats_.packed_segments++;
    stats_.packed_bytes += group.sealed->size();
  }
  for (size_t i : misses) {
    Entry e;
    e.offset = out[i].offset;
    e.length = out[i].length;
    e.digest = out[i].digest;
    if (out[i].view) {
      e.view_segment = out[i].segment;
    } else {
      e.packed_segment_id = out[i].segment->id();
    }
    auto [it, inserted] = cache_.try_emplace(keys[i], e);
    // A concurrent call may have computed the same thing first: keep its
    // entry (identical bytes); ours lives on only as long as this fetch.
    if (inserted && !out[i].view) packed_[e.packed_segment_id].entries++;
  }
  for (const Group& group : groups) {
    if (packed_[group.sealed->id()].entries == 0) {
      stats_.packed_segments--;
      stats_.packed_bytes -= group.sealed->size();
      packed_.erase(group.sealed->id());
    }
  }
  return out;
}

uint64_t Materializer::EvictUnused() { return Evict(/*orphans_only=*/false, /*now=*/true); }

uint64_t Materializer::Sweep() { return Evict(/*orphans_only=*/true, /*now=*/false); }

void Materializer::RetireTag(const std::string& tag) {
  if (tag.empty()) return;
  {
    absl::MutexLock lock(&mu_);
    retired_tags_.insert(tag);
  }
  Evict(/*orphans_only=*/true, /*now=*/false);
}

uint64_t Materializer::Evict(bool orphans_only, bool now) {
  std::vector<SegmentPtr> dropped;
  uint64_t freed;
  {
    absl::MutexLock lock(&mu_);
    freed = EvictLocked(orphans_only, &dropped);
  }
  // The last holds are dropped without the lock: giving a large segment
  // back to the kernel takes a while, and fetches wait for mu_. The memory
  // manager frees them here (`now`), in an idle moment or on the
  // disposer's thread.
  for (SegmentPtr& seg : dropped) options_.memory->Retire(std::move(seg), now);
  return freed;
}

uint64_t Materializer::EvictLocked(bool orphans_only, std::vector<SegmentPtr>* dropped) {
  uint64_t freed = 0;
  absl::flat_hash_set<std::string> live_tags;
  for (auto it = packed_.begin(); it != packed_.end();) {
    auto cur = it++;
    bool retired = !cur->second.tag.empty() && retired_tags_.contains(cur->second.tag);
    if (retired && cur->second.segment.use_count() != 1) live_tags.insert(cur->second.tag);
    if (orphans_only && !cur->second.base.expired() && !retired) continue;
    if (cur->second.segment.use_count() == 1) {
      freed += cur->second.segment->size();
      stats_.packed_segments--;
      stats_.packed_bytes -= cur->second.segment->size();
      dropped->push_back(std::move(cur->second.segment));  // freed by Evict, unlocked
      packed_.erase(cur);
    }
  }
  // Entries of freed packed segments go at once. Views die only when their
  // checkpoint is gone, which a sweep after every release would look for in
  // vain: walking every entry then costs more than the release itself, so a
  // sweep that freed nothing prunes only every 64th time (stats() counts
  // live entries only, so nothing observable waits on it).
  if (freed > 0 || !orphans_only || ++sweeps_since_prune_ >= 64) {
    sweeps_since_prune_ = 0;
    absl::erase_if(cache_, [this](const auto& kv) ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return !EntryLive(kv.second);
    });
  }
  // A retired tag is forgotten once none of its segments is left.
  for (auto it = retired_tags_.begin(); it != retired_tags_.end();) {
    auto cur = it++;
    if (!live_tags.contains(*cur)) retired_tags_.erase(cur);
  }
  return freed;
}

bool Materializer::EntryLive(const Entry& e) const {
  return e.packed_segment_id == 0 ? !e.view_segment.expired()
                                  : packed_.contains(e.packed_segment_id);
}

MaterializerStats Materializer::stats() const {
  absl::MutexLock lock(&mu_);
  MaterializerStats s = stats_;
  s.entries = 0;
  for (const auto& [key, e] : cache_) s.entries += EntryLive(e) ? 1 : 0;
  return s;
}

}  // namespace weightd
