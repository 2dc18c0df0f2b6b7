#include "server/publish/publish_commit.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "server/base/fault_guard.h"
#include "common/status_macros.h"
#include "server/base/thread_pool.h"

namespace weightd {
namespace {

uint64_t SmallPageBytes() {
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

// Whether another holder of the memfd forbade further seals.
bool SealedByWriter(int fd) {
  const int seals = ::fcntl(fd, F_GET_SEALS);
  return seals >= 0 && (seals & F_SEAL_SEAL) != 0;
}

// A staging memfd handed out writable, sealed since: FAILED_PRECONDITION
// when it has fewer pages allocated than its size. Every page was
// allocated before it was handed out (StagePublish) and the seal forbids
// punching from then on, so a missing page is one a writer punched out
// (fallocate PUNCH_HOLE, MADV_REMOVE); reading it would fault in a zero
// page, or on hugetlb with an empty pool, SIGBUS. REQUIRES: the daemon's
// mapping of it is not populated yet (mincore then finds the first hole
// of a shmem memfd; hugetlb mappings say nothing of the file's pages).
absl::Status CheckNoPagesLost(const Segment& staging) {
  struct stat st;
  if (::fstat(staging.fd(), &st) != 0) return ErrnoStatus(errno, "fstat on the staging memfd");
  const uint64_t allocated = static_cast<uint64_t>(st.st_blocks) * 512;
  if (allocated >= staging.size()) return absl::OkStatus();
  // Pages are whole: a size of 4 KiB pages and a bit takes one more.
  const uint64_t whole = (staging.size() + SmallPageBytes() - 1) / SmallPageBytes() * SmallPageBytes();
  std::string where;
  if (staging.pages() != PageKind::kHugetlb && staging.data() != nullptr) {
    const uint64_t page = SmallPageBytes();
    std::vector<unsigned char> resident((staging.size() + page - 1) / page);
    if (::mincore(const_cast<uint8_t*>(staging.data()), staging.size(), resident.data()) == 0) {
      for (size_t i = 0; i < resident.size(); ++i) {
        if ((resident[i] & 1) == 0) {
          where = absl::StrCat(", the first at offset ", i * page);
          break;
        }
      }
    }
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "a writer punched ", whole - allocated,
      " bytes of pages out of its staging memfd after it was handed out (fallocate "
      "PUNCH_HOLE, MADV_REMOVE)",
      where, "; nothing was published"));
}

}  // namespace

const char kSealedByWriter[] =
    "its staging memfd was sealed by a writer (F_SEAL_SEAL): the daemon can no longer seal it "
    "against writes, so nothing of it can be published";

absl::StatusOr<SegmentPtr> SealStaging(std::unique_ptr<Segment> staged, bool handed_out) {
  if (!handed_out) {
    WD_RETURN_IF_ERROR(staged->Seal(/*populate=*/false));
    return SegmentPtr(std::move(staged));
  }
  // Written in place by other processes: sealed only once none of them
  // can write any more, so the digests below describe the bytes for good.
  // A writer that sealed it itself (F_SEAL_SEAL) leaves no way to.
  if (SealedByWriter(staged->fd())) return absl::FailedPreconditionError(kSealedByWriter);
  absl::Status sealed = staged->SealExclusive(/*populate=*/false);
  if (!sealed.ok()) {
    // The seal refused (EPERM) because a writer sealed it meanwhile.
    if (absl::IsPermissionDenied(sealed) && SealedByWriter(staged->fd())) {
      return absl::FailedPreconditionError(kSealedByWriter);
    }
    // Sealed, but not mapped again: a hugetlb page punched out needs a
    // page of the pool to map, and it may have none.
    const int seals = ::fcntl(staged->fd(), F_GET_SEALS);
    if (seals >= 0 && (seals & F_SEAL_WRITE) != 0) {
      WD_RETURN_IF_ERROR(CheckNoPagesLost(*staged));
      return Annotate(sealed, "mapping the sealed staging memfd");
    }
    return Annotate(sealed, "sealing the staging memfd (each writer must unmap it before "
                            "declaring its last bytes)");
  }
  // No one can punch pages out of it any more; every page was there when
  // it was handed out.
  WD_RETURN_IF_ERROR(CheckNoPagesLost(*staged));
#ifdef MADV_POPULATE_READ
  // Page tables filled in one call, not a fault per page while digesting
  // (best effort).
  if (staged->size() > 0) {
    (void)::madvise(const_cast<uint8_t*>(staged->data()), staged->size(), MADV_POPULATE_READ);
  }
#endif
  return SegmentPtr(std::move(staged));
}

absl::StatusOr<std::vector<StagedPiece>> PiecesOf(const PublishSession& session,
                                                  const Model& model) {
  std::vector<StagedPiece> pieces;
  absl::flat_hash_map<absl::string_view, const Served*> by_name;
  for (const Served* s : ServedAt(model, *model.current)) by_name.emplace(s->plan.name, s);
  for (size_t i = 0; i < session.specs.size(); ++i) {
    const PublishTensorSpec& spec = session.specs[i];
    auto it = by_name.find(spec.name);
    if (it == by_name.end()) return absl::InternalError("a published tensor vanished");
    const ServedTensorPlan& plan = it->second->plan;
    const uint64_t at = session.layout.offsets[i];
    if (plan.parts.empty()) {
      pieces.push_back(StagedPiece{i, plan.name, false, plan.shape, at, spec.bytes(), {}});
      continue;
    }
    std::vector<PartBytes> split = SplitParts(plan.shape, plan.dtype, plan.part_rows);
    for (size_t k = 0; k < plan.parts.size(); ++k) {
      std::vector<int64_t> shape = plan.shape;
      if (!shape.empty()) shape[0] = plan.part_rows[k];
      if (plan.parts.size() == 1) shape = it->second->parts[0]->shape;
      pieces.push_back(StagedPiece{i, plan.parts[k].source, true, std::move(shape),
                                   at + split[k].offset, split[k].length, {}});
    }
  }
  return pieces;
}

absl::Status DigestPieces(std::vector<StagedPiece>& pieces, const Segment& segment, int threads,
                          const PublishSession& session) {
  // Digested on the worker threads' count of cores (the caller's thread
  // too), a tensor at a time: a digest reads every byte once more.
  // Under a fault guard: the staging's pages are checked when sealed, but
  // nothing a writer did to it may take the daemon down.
  const uint8_t* base = segment.data();
  return ParallelFor(nullptr, pieces.size(), std::max(1, threads), [&](size_t i) {
    Digest digest;
    const std::optional<MemoryFault> fault = RunFaultGuarded(
        base, segment.size(),
        [&] { digest = DigestBytes(base + pieces[i].offset, pieces[i].length); });
    if (fault.has_value()) return session.StagingFault(fault->offset);
    pieces[i].digest = digest;
    return absl::OkStatus();
  });
}

PublishDiff DiffPieces(const std::vector<StagedPiece>& pieces, const Model& model,
                       const Generation& cur) {
  // What each part key holds now.
  absl::flat_hash_map<std::string, const StoredTensor*> now;
  for (const Served* s : ServedAt(model, cur)) {
    for (const StoredTensor* p : s->parts) now.emplace(p->name, p);
  }
  PublishDiff diff;
  diff.published = cur.published != nullptr ? std::make_shared<PublishedBase>(*cur.published)
                                            : std::make_shared<PublishedBase>();
  absl::flat_hash_set<size_t> changed_specs;
  for (const StagedPiece& p : pieces) {
    auto n = now.find(p.key);
    if (n != now.end() && n->second->digest == p.digest) continue;  // same bytes
    changed_specs.insert(p.spec);
    const StoredTensor* original = p.part ? model.checkpoint->Find(p.key) : nullptr;
    if (original != nullptr && original->digest == p.digest) {
      diff.published->erase(p.key);  // back to the checkpoint's bytes
      continue;
    }
    diff.fresh.push_back(&p);
  }
  diff.changed_specs = changed_specs.size();
  return diff;
}

absl::flat_hash_set<uint64_t> HeldBuffers(const Model& model, const PublishedBase& published,
                                          const std::vector<const StagedPiece*>& fresh) {
  absl::flat_hash_set<uint64_t> held;
  absl::flat_hash_set<std::string> replaced;
  for (const StagedPiece* p : fresh) replaced.insert(p->key);
  for (const StoredTensor& t : model.checkpoint->tensors()) {
    if (t.buffer != nullptr) held.insert(t.buffer->id());
  }
  for (const auto& [key, t] : published) {
    if (!replaced.contains(key) && t->buffer != nullptr) held.insert(t->buffer->id());
  }
  return held;
}

StorePlan PlanStore(const std::vector<const StagedPiece*>& fresh,
                    const std::vector<std::optional<HeldElsewhere>>& resident,
                    const uint8_t* base) {
  StorePlan plan;
  plan.same_as.assign(fresh.size(), -1);
  absl::flat_hash_map<Digest, std::vector<size_t>> stored_by_digest;
  for (size_t f = 0; f < fresh.size(); ++f) {
    const StagedPiece& p = *fresh[f];
    if (resident[f].has_value()) continue;
    std::vector<size_t>& earlier = stored_by_digest[p.digest];
    for (size_t e : earlier) {
      if (fresh[e]->length == p.length &&
          std::memcmp(base + fresh[e]->offset, base + p.offset, p.length) == 0) {
        plan.same_as[f] = static_cast<int64_t>(e);
        break;
      }
    }
    if (plan.same_as[f] >= 0) continue;
    earlier.push_back(f);
    plan.bytes += (p.length + 63) / 64 * 64;
    ++plan.pieces;
  }
  return plan;
}

namespace {

// The stored pieces copied into a segment of their size; nullopt when
// there is no room for it or the copy failed.
std::optional<StoredRuns> PackStored(const std::vector<const StagedPiece*>& fresh,
                                     const std::vector<std::optional<HeldElsewhere>>& resident,
                                     const StorePlan& plan, const uint8_t* base,
                                     HostMemoryManager& memory, int threads) {
  HostMemoryManager::AllocateOptions alloc;
  alloc.purpose = "publish";
  // Not prefaulted: the copy below faults the pages in, on the worker
  // threads, in one pass instead of two (zeroing, then copying).
  alloc.prefault = false;
  auto packed = memory.Allocate(std::max<uint64_t>(plan.bytes, 64), alloc);
  if (!packed.ok()) return std::nullopt;
  StoredRuns out;
  out.offsets.assign(fresh.size(), 0);
  std::vector<CopyRun> runs;
  uint64_t at = 0;
  for (size_t f = 0; f < fresh.size(); ++f) {
    const StagedPiece& p = *fresh[f];
    if (resident[f].has_value() || plan.same_as[f] >= 0) continue;
    runs.push_back(CopyRun{(*packed)->mutable_data() + at, base + p.offset, p.length});
    out.offsets[f] = at;
    at += (p.length + 63) / 64 * 64;
  }
  absl::Status copied = ParallelCopy(runs, threads);
  if (!copied.ok() || !(*packed)->Seal(/*populate=*/false).ok()) return std::nullopt;
  out.holder = SegmentPtr(std::move(*packed));
  return out;
}

}  // namespace

StoredRuns CompactStored(const std::vector<const StagedPiece*>& fresh,
                         std::vector<std::optional<HeldElsewhere>>& resident,
                         const StorePlan& plan, const SegmentPtr& segment,
                         uint64_t bytes_received, const absl::flat_hash_set<uint64_t>& held,
                         HostMemoryManager& memory, int threads) {
  // (When they are at most 7/8 of what was sent: a copy to save little
  // is not worth it.)
  // (Empty tensors count: they must not keep the staging segment alive.)
  if (plan.pieces > 0 && plan.bytes + bytes_received / 8 < bytes_received) {
    std::optional<StoredRuns> packed =
        PackStored(fresh, resident, plan, segment->data(), memory, threads);
    if (packed.has_value()) return *std::move(packed);
    // No room for the copy: the staging segment is kept as it is.
  }
  StoredRuns out;
  out.holder = segment;
  out.offsets.reserve(fresh.size());
  for (const StagedPiece* p : fresh) out.offsets.push_back(p->offset);
  // The staging segment stays whole when anything is stored from it: a
  // copy in a segment the new generation would not hold otherwise saves
  // nothing then, and would only keep that segment alive.
  if (plan.pieces > 0) {
    for (auto& r : resident) {
      if (r.has_value() && !held.contains(r->buffer->id())) r.reset();
    }
  }
  return out;
}

std::vector<StoredTensor> StoredTensorsOf(const PublishSession& session,
                                          const std::vector<const StagedPiece*>& fresh,
                                          const std::vector<std::optional<HeldElsewhere>>& resident,
                                          const StorePlan& plan, const StoredRuns& stored,
                                          const SegmentPtr& segment, PublishResult* result) {
  std::vector<StoredTensor> out;
  out.reserve(fresh.size());
  bool holder_used = false;
  for (size_t f = 0; f < fresh.size(); ++f) {
    const StagedPiece& p = *fresh[f];
    StoredTensor t;
    t.name = p.key;
    t.dtype = session.specs[p.spec].dtype;
    t.shape = p.shape;
    t.length = p.length;
    t.digest = p.digest;
    if (resident[f].has_value()) {
      result->bytes_shared += p.length;
      if (std::find(result->shared_with.begin(), result->shared_with.end(),
                    resident[f]->holder) == result->shared_with.end()) {
        result->shared_with.push_back(resident[f]->holder);
      }
      t.buffer = resident[f]->buffer;
      t.offset = resident[f]->offset;
      t.file = absl::StrCat("(published in session ", session.id,
                            "; bytes shared with model \"", resident[f]->holder, "\")");
    } else {
      t.buffer = stored.holder;
      t.offset = stored.offsets[plan.same_as[f] >= 0 ? static_cast<size_t>(plan.same_as[f]) : f];
      t.file = absl::StrCat("(published in session ", session.id, ")");
      holder_used = true;
    }
    out.push_back(std::move(t));
  }
  result->bytes_stored =
      !holder_used ? 0 : (stored.holder == segment ? segment->size() : plan.bytes);
  return out;
}

}  // namespace weightd
