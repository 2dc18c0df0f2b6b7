#include "server/store/resident_checkpoints.h"

#include <algorithm>
#include <cstring>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/base/log.h"
#include "common/status_macros.h"
#include "server/base/thread_pool.h"

namespace weightd {
namespace {

// c and other (which shares other holders' bytes: ShareHeldTensors, and so
// has no file layout to compare) hold the same tensors, byte for byte.
bool SameTensors(const Checkpoint& c, const Checkpoint& other) {
  for (size_t i = 0; i < c.tensors().size(); ++i) {
    const StoredTensor& a = c.tensors()[i];
    const StoredTensor& b = other.tensors()[i];
    const bool same = a.name == b.name && a.dtype == b.dtype && a.shape == b.shape &&
                      a.length == b.length && a.host_data() != nullptr &&
                      b.host_data() != nullptr &&
                      std::memcmp(a.host_data(), b.host_data(), a.length) == 0;
    if (!same) return false;
  }
  return true;
}

// c's files and other's: the same sizes, headers and data sections.
bool SameFiles(const Checkpoint& c, const Checkpoint& other) {
  const std::vector<CheckpointFileInfo>& files = c.file_info();
  const std::vector<CheckpointFileInfo>& theirs = other.file_info();
  if (theirs.size() != files.size()) return false;
  for (size_t i = 0; i < files.size(); ++i) {
    const CheckpointFileInfo& a = files[i];
    const CheckpointFileInfo& b = theirs[i];
    if (a.id.size != b.id.size || a.id.header != b.id.header || a.data_length != b.data_length) {
      return false;
    }
  }
  // Equal digests are not proof: the bytes are compared.
  for (size_t i = 0; i < files.size(); ++i) {
    const CheckpointFileInfo& a = files[i];
    const CheckpointFileInfo& b = theirs[i];
    if (a.data_length == 0) continue;
    if (a.segment >= c.host_segments().size() || b.segment >= other.host_segments().size()) {
      return false;
    }
    const uint8_t* pa = c.host_segments()[a.segment]->host_data();
    const uint8_t* pb = other.host_segments()[b.segment]->host_data();
    if (pa == nullptr || pb == nullptr ||
        std::memcmp(pa + a.segment_offset, pb + b.segment_offset, a.data_length) != 0) {
      return false;
    }
  }
  return true;
}

// Which of a checkpoint's tensors memory holds already, and where the
// others go in one segment of their own.
struct HeldPlan {
  std::vector<std::optional<HeldElsewhere>> held;
  uint64_t shared = 0;       // bytes held elsewhere
  uint64_t rest = 0;         // bytes of the segment for the others
  size_t rest_count = 0;     // tensors to store (some may be empty)
  std::vector<uint64_t> at;  // each other tensor's offset in that segment
  std::vector<std::string> holders;
};

HeldPlan PlanHeld(const std::vector<StoredTensor>& tensors,
                  std::vector<std::optional<HeldElsewhere>> held) {
  HeldPlan plan;
  plan.held = std::move(held);
  plan.at.assign(tensors.size(), 0);
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (plan.held[i].has_value()) {
      plan.shared += tensors[i].length;
      const std::string& holder = plan.held[i]->holder;
      if (std::find(plan.holders.begin(), plan.holders.end(), holder) == plan.holders.end()) {
        plan.holders.push_back(holder);
      }
    } else {
      plan.at[i] = plan.rest;
      plan.rest += (tensors[i].length + 63) / 64 * 64;
      ++plan.rest_count;
    }
  }
  return plan;
}

// The tensors not held elsewhere, copied into one new sealed segment (on
// the reader threads: the first touch of the new pages is most of it).
// Where that segment cannot be had (budget, seal), `*why_not` says why and
// nothing is returned.
absl::StatusOr<SegmentPtr> StoreRest(const HeldPlan& plan, const std::vector<StoredTensor>& tensors,
                                     HostMemoryManager* memory, int threads,
                                     absl::Status* why_not) {
  auto packed = memory->Allocate(std::max<uint64_t>(plan.rest, 64), {.purpose = "checkpoint"});
  if (!packed.ok()) {
    *why_not = packed.status();
    return nullptr;
  }
  std::vector<CopyRun> runs;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (plan.held[i].has_value()) continue;
    runs.push_back(
        CopyRun{(*packed)->mutable_data() + plan.at[i], tensors[i].host_data(), tensors[i].length});
  }
  WD_RETURN_IF_ERROR(ParallelCopy(runs, threads));
  if (absl::Status sealed = (*packed)->Seal(/*populate=*/false); !sealed.ok()) {
    *why_not = sealed;
    return nullptr;
  }
  return SegmentPtr(std::move(*packed));
}

}  // namespace

std::shared_ptr<const Checkpoint> ResidentCheckpoints::Find(const std::string& files_key) const {
  absl::MutexLock lock(&mu_);
  auto it = by_files_.find(files_key);
  return it == by_files_.end() ? nullptr : it->second.checkpoint.lock();
}

std::vector<std::shared_ptr<const Checkpoint>> ResidentCheckpoints::FindByContent(
    const Digest& key) const {
  std::vector<std::pair<uint64_t, std::shared_ptr<const Checkpoint>>> found;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [files, e] : by_files_) {
      if (e.content_key != key) continue;
      if (auto c = e.checkpoint.lock()) found.emplace_back(e.added, std::move(c));
    }
  }
  std::sort(found.begin(), found.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<std::shared_ptr<const Checkpoint>> out;
  for (auto& [added, c] : found) out.push_back(std::move(c));
  return out;
}

std::vector<std::pair<std::string, std::shared_ptr<const Checkpoint>>>
ResidentCheckpoints::Snapshot() const {
  std::vector<std::pair<std::string, std::shared_ptr<const Checkpoint>>> out;
  absl::MutexLock lock(&mu_);
  for (const auto& [key, e] : by_files_) {
    if (auto c = e.checkpoint.lock()) out.emplace_back(key, std::move(c));
  }
  return out;
}

void ResidentCheckpoints::Add(const std::string& files_key,
                              const std::shared_ptr<const Checkpoint>& checkpoint) {
  absl::MutexLock lock(&mu_);
  absl::erase_if(by_files_, [](const auto& kv) { return kv.second.checkpoint.expired(); });
  by_files_[files_key] = Entry{checkpoint, checkpoint->content_key(), ++adds_};
}

std::shared_ptr<const Checkpoint> FindIdenticalCopy(const ResidentCheckpoints& resident,
                                                    const Checkpoint& c) {
  if (c.file_info().empty()) return nullptr;
  for (auto& [key, other] : resident.Snapshot()) {
    if (other.get() == &c || other->copy_id() != c.copy_id() ||
        other->tensors().size() != c.tensors().size()) {
      continue;
    }
    if (other->bytes_held_elsewhere() > 0 ? SameTensors(c, *other) : SameFiles(c, *other)) {
      return other;
    }
  }
  return nullptr;
}

absl::StatusOr<std::shared_ptr<Checkpoint>> ShareHeldTensors(const std::string& path,
                                                             const FindHeldFn& find_held,
                                                             HostMemoryManager* memory,
                                                             int threads,
                                                             std::shared_ptr<Checkpoint> fresh) {
  const std::vector<StoredTensor>& tensors = fresh->tensors();
  const absl::Time start = absl::Now();
  std::vector<std::optional<HeldElsewhere>> held = find_held(*fresh);
  const absl::Time found = absl::Now();
  if (held.size() != tensors.size()) {
    return absl::InternalError(absl::StrCat("find_held answered ", held.size(), " entries for ",
                                            tensors.size(), " tensors"));
  }
  const HeldPlan plan = PlanHeld(tensors, std::move(held));
  if (plan.shared == 0 || plan.shared <= fresh->total_bytes() / 8) return fresh;
  SegmentPtr rest;  // none when every tensor is shared
  if (plan.rest_count > 0) {
    absl::Status why_not;
    WD_ASSIGN_OR_RETURN(rest, StoreRest(plan, tensors, memory, threads, &why_not));
    if (!why_not.ok()) {
      LogEvent(LogLevel::kInfo, "load_tensors_not_shared",
               {{"path", path}, {"bytes_held_elsewhere", absl::StrCat(plan.shared)},
                {"reason", std::string(why_not.message())}});
      return fresh;
    }
  }
  std::vector<StoredTensor> out = tensors;
  for (size_t i = 0; i < out.size(); ++i) {
    if (plan.held[i].has_value()) {
      out[i].buffer = plan.held[i]->buffer;
      out[i].offset = plan.held[i]->offset;
    } else {
      out[i].buffer = rest;
      out[i].offset = plan.at[i];
    }
  }
  std::vector<SegmentPtr> segments;
  if (rest != nullptr) segments.push_back(rest);
  auto shared_copy = std::make_shared<Checkpoint>(path, fresh->files(), std::move(out),
                                                  std::move(segments),
                                                  fresh->TakeMetadataCharge());
  shared_copy->set_bytes_held_elsewhere(plan.shared);
  // What was read goes back to the kernel off the load's path.
  uint64_t read_bytes = 0;
  for (const SegmentPtr& seg : fresh->host_segments()) read_bytes += seg->size();
  memory->disposer()->Dispose(std::shared_ptr<const void>(std::move(fresh)), read_bytes);
  std::vector<std::string> holders = plan.holders;
  std::sort(holders.begin(), holders.end());
  LogEvent(LogLevel::kInfo, "load_tensors_shared",
           {{"path", path}, {"bytes_shared", absl::StrCat(plan.shared)},
            {"bytes_stored", absl::StrCat(plan.rest)},
            {"shared_with", absl::StrJoin(holders, ",")},
            {"find_seconds", absl::StrCat(absl::ToDoubleSeconds(found - start))},
            {"store_seconds", absl::StrCat(absl::ToDoubleSeconds(absl::Now() - found))}});
  return shared_copy;
}

absl::StatusOr<HeldBytes> FindHeldBytes(const Checkpoint& c, const CheckpointRange& r,
                                        uint64_t max_length) {
  if (r.file >= c.file_info().size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "file ", r.file, " of a checkpoint of ", c.file_info().size(), " files"));
  }
  const CheckpointFileInfo& f = c.file_info()[r.file];
  if (r.length > max_length || r.offset > f.data_length || r.length > f.data_length - r.offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        "range ", r.offset, "+", r.length, " of ", f.id.name, " (a data section of ",
        f.data_length, " bytes; at most ", max_length, " at once)"));
  }
  return HeldBytes{c.host_segments()[f.segment], f.segment_offset + r.offset};
}

absl::StatusOr<PeerHolding> DescribeHolding(const Checkpoint& c,
                                            const std::vector<CheckpointRange>& samples) {
  WD_RETURN_IF_ERROR(CheckPeerSamples(samples));
  PeerHolding out;
  out.copy = c.copy_id();
  for (const CheckpointRange& r : samples) {
    WD_ASSIGN_OR_RETURN(HeldBytes held, FindHeldBytes(c, r, kMaxPeerSampleBytes));
    out.sample_digests.push_back(
        DigestBytes(held.buffer->host_data() + held.offset, r.length));
  }
  absl::flat_hash_map<std::string, size_t> file_of;
  for (size_t i = 0; i < c.file_info().size(); ++i) file_of[c.file_info()[i].path] = i;
  std::vector<std::vector<const StoredTensor*>> by_file(c.file_info().size());
  for (const StoredTensor& t : c.tensors()) {
    auto it = file_of.find(t.file);
    if (it == file_of.end()) {
      return absl::InternalError(absl::StrCat("tensor \"", t.name, "\" of no file"));
    }
    by_file[it->second].push_back(&t);
  }
  for (auto& v : by_file) {
    std::sort(v.begin(), v.end(), [](const StoredTensor* a, const StoredTensor* b) {
      return std::tie(a->offset, a->name) < std::tie(b->offset, b->name);
    });
    std::vector<Digest> digests;
    digests.reserve(v.size());
    for (const StoredTensor* t : v) digests.push_back(t->digest);
    out.tensor_digests.push_back(std::move(digests));
  }
  return out;
}

}  // namespace weightd
