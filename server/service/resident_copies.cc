// ResidentCopies (resident_copies.h): bytes that loaded models already
// hold, found for sharing, and offered to peers that load the same files.
#include "server/service/resident_copies.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <tuple>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace weightd {

std::vector<std::shared_ptr<const Checkpoint>> ResidentCopies::HeldCopies(const Digest& key,
                                                                         int only_file) const {
  // Only copies whose files are as they were when read: a file rewritten
  // since (the same names, sizes and headers: a fine-tune saved in place)
  // would offer peers stale bytes that agree with their digests.
  std::vector<std::shared_ptr<const Checkpoint>> out;
  for (std::shared_ptr<const Checkpoint>& c : options_.resident->FindByContent(key)) {
    bool unchanged = !c->file_info().empty();
    for (size_t i = 0; i < c->file_info().size() && unchanged; ++i) {
      if (only_file >= 0 && static_cast<size_t>(only_file) != i) continue;
      const CheckpointFileInfo& f = c->file_info()[i];
      if (!f.version.empty()) {  // a remote object: still at the version read (a HEAD)
        absl::StatusOr<OpenedFile> now = options_.files->Open(f.path);
        unchanged = now.ok() && now->version == f.version &&
                    static_cast<uint64_t>(now->st.st_size) == f.id.size;
        continue;
      }
      struct stat st;
      unchanged = ::stat(f.path.c_str(), &st) == 0 &&
                  static_cast<uint64_t>(st.st_size) == f.id.size && st.st_dev == f.dev &&
                  st.st_ino == f.ino && st.st_mtim.tv_sec == f.mtime_sec &&
                  st.st_mtim.tv_nsec == f.mtime_nsec;
    }
    if (unchanged) out.push_back(std::move(c));
  }
  return out;
}

bool ResidentCopies::MayOfferToPeer(const Checkpoint& c, const Principal& asker) const {
  return options_.catalog->AnyHolderAdmits(c, [&](const ReaderList& readers) {
    return options_.access->CheckRead(asker, {ReadGuard{"", readers}}).ok();
  });
}

absl::StatusOr<PeerHolding> ResidentCopies::FindHeld(const Digest& key,
                                                     const std::vector<CheckpointRange>& samples,
                                                     const std::vector<Digest>& sample_digests,
                                                     const Principal& asker) const {
  if (samples.size() != sample_digests.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        samples.size(), " samples but ", sample_digests.size(), " sample digests"));
  }
  // The same bounds for a copy still loading as DescribeHolding's for a
  // resident one, before either is looked at.
  WD_RETURN_IF_ERROR(CheckPeerSamples(samples));
  if (samples.empty()) {
    return absl::InvalidArgumentError(
        "FindCheckpoint needs samples of the asker's bytes and their digests: they pick the copy");
  }
  // Only a copy the asker may read, and only the one whose bytes at the
  // samples are the asker's: not held, not readable and other bytes all
  // answer the same NOT_FOUND.
  for (const std::shared_ptr<const Checkpoint>& c : HeldCopies(key)) {
    if (!MayOfferToPeer(*c, asker)) continue;
    WD_ASSIGN_OR_RETURN(PeerHolding held, DescribeHolding(*c, samples));
    if (held.sample_digests == sample_digests) return held;
  }
  // A load of the same files still running here: the ranges it has read
  // from storage, if its bytes at the samples it has are the asker's.
  auto admits = [&](const ReaderList& readers) {
    return options_.access->CheckRead(asker, {ReadGuard{"", readers}}).ok();
  };
  for (LoadingCheckpoints::Offer& o : options_.resident->loading().Find(key, samples, admits)) {
    bool same = true;
    for (size_t k = 0; k < samples.size() && same; ++k) {
      same = !o.sample_digests[k].has_value() || *o.sample_digests[k] == sample_digests[k];
    }
    if (!same) continue;
    PeerHolding held;
    held.copy = o.copy;
    held.partial = true;
    held.available = std::move(o.have);
    for (const std::optional<Digest>& d : o.sample_digests) {
      held.sample_digests.push_back(d.value_or(Digest{}));
      held.sample_known.push_back(d.has_value());
    }
    return held;
  }
  return absl::NotFoundError(absl::StrCat("no copy of checkpoint ", key.Hex(),
                                          " with the asker's bytes at its samples is held here"));
}

absl::StatusOr<std::vector<ResidentCopies::HeldSection>> ResidentCopies::HeldSections(
    const Digest& key, const Digest& copy, const Principal& asker) const {
  for (const std::shared_ptr<const Checkpoint>& c : HeldCopies(key)) {
    if (c->copy_id() != copy || !MayOfferToPeer(*c, asker)) continue;
    std::vector<HeldSection> out;
    for (const CheckpointFileInfo& f : c->file_info()) {
      out.push_back({c->host_segments()[f.segment], f.segment_offset, f.data_length});
    }
    return out;
  }
  return absl::NotFoundError(absl::StrCat("copy ", copy.Hex().substr(0, 12), " of checkpoint ",
                                          key.Hex().substr(0, 12), " is not resident (any more)"));
}

absl::StatusOr<ReadRange> ResidentCopies::ReadHeld(const Digest& key, const Digest& copy,
                                                   const CheckpointRange& r,
                                                   const Principal& asker) {
  for (const std::shared_ptr<const Checkpoint>& c :
       HeldCopies(key, static_cast<int>(std::min<uint64_t>(r.file, INT32_MAX)))) {
    if (c->copy_id() != copy || !MayOfferToPeer(*c, asker)) continue;
    WD_ASSIGN_OR_RETURN(HeldBytes held, FindHeldBytes(*c, r, kMaxPeerRangeBytes));
    ReadRange out;
    out.buffer = std::move(held.buffer);
    out.offset = held.offset;
    out.length = r.length;
    bytes_sent_to_peers_.fetch_add(r.length);
    return out;
  }
  // A load still running here (FindHeld offered its ranges): a copy of the
  // bytes, if it has read them.
  absl::StatusOr<BufferPtr> loading = options_.resident->loading().Read(
      key, copy, r, [&](const ReaderList& readers) {
        return options_.access->CheckRead(asker, {ReadGuard{"", readers}}).ok();
      });
  if (loading.ok()) {
    ReadRange out;
    out.buffer = std::move(*loading);
    out.length = r.length;
    bytes_sent_to_peers_.fetch_add(r.length);
    return out;
  }
  if (loading.status().code() != absl::StatusCode::kNotFound) return loading.status();
  return absl::NotFoundError(absl::StrCat("copy ", copy.Hex().substr(0, 12), " of checkpoint ",
                                          key.Hex().substr(0, 12), " is not resident (any more)"));
}

std::vector<std::optional<ResidentCopies::ResidentCopy>> ResidentCopies::Find(
    const std::string& own, const std::string& scope, absl::Span<const WantedBytes> wanted,
    const absl::flat_hash_set<uint64_t>& held) const {
  std::vector<std::optional<ResidentCopy>> found(wanted.size());
  absl::flat_hash_map<Digest, std::vector<size_t>> by_digest;
  for (size_t i = 0; i < wanted.size(); ++i) by_digest[wanted[i].digest].push_back(i);
  std::vector<std::shared_ptr<const Model>> models = options_.catalog->Models();
  // The same answer whatever the map's order: the model's own bytes first,
  // then the others' by name.
  std::sort(models.begin(), models.end(), [&](const auto& l, const auto& r) {
    const bool l_other = l->name != own, r_other = r->name != own;
    return std::tie(l_other, l->name) < std::tie(r_other, r->name);
  });
  // Models are immutable: what each holds is read without the lock. A
  // holder counts with every guard its generation has.
  absl::flat_hash_set<const Checkpoint*> seen;
  auto consider = [&](const StoredTensor& t, const std::string& owner) {
    auto it = by_digest.find(t.digest);
    if (it == by_digest.end() || t.buffer == nullptr) return;
    const uint8_t* bytes = t.host_data();
    if (bytes == nullptr) return;
    for (size_t i : it->second) {
      if (found[i].has_value() || t.length != wanted[i].length || wanted[i].data == nullptr) {
        continue;
      }
      if (std::memcmp(bytes, wanted[i].data, t.length) != 0) continue;
      found[i] = ResidentCopy{t.buffer, t.offset, owner};
    }
  };
  for (const std::shared_ptr<const Model>& m : models) {
    const std::string holder_scope = ReadScope(GuardsOf(*m, *m->current));
    if (!holder_scope.empty() && holder_scope != scope) continue;
    if (seen.insert(m->checkpoint.get()).second) {
      for (const StoredTensor& t : m->checkpoint->tensors()) consider(t, m->name);
    }
    if (m->current->published != nullptr) {
      for (const auto& [key, t] : *m->current->published) consider(*t, m->name);
    }
  }
  DropCopiesUnderHalf(found, wanted, held);
  return found;
}

bool ResidentCopies::DropCopiesUnderHalf(std::vector<std::optional<ResidentCopy>>& copies,
                                        absl::Span<const WantedBytes> wanted,
                                        const absl::flat_hash_set<uint64_t>& held) {
  // Shared only where that pins no more than it saves: per segment, the
  // distinct runs taken from it must make up half of it (or the new
  // generation holds it anyway).
  absl::flat_hash_map<uint64_t, uint64_t> taken;  // buffer id -> bytes of distinct runs
  absl::flat_hash_set<std::pair<uint64_t, uint64_t>> counted;  // (buffer id, offset)
  for (size_t i = 0; i < copies.size(); ++i) {
    if (!copies[i].has_value()) continue;
    const uint64_t id = copies[i]->buffer->id();
    if (counted.insert({id, copies[i]->offset}).second) taken[id] += wanted[i].length;
  }
  bool dropped = false;
  for (std::optional<ResidentCopy>& c : copies) {
    if (!c.has_value()) continue;
    const uint64_t id = c->buffer->id();
    if (held.contains(id)) continue;
    if (taken[id] * 2 < c->buffer->size()) {
      c.reset();
      dropped = true;
    }
  }
  return dropped;
}

}  // namespace weightd
