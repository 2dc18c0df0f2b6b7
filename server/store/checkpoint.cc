#include "server/store/checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <thread>
#include <tuple>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/fd.h"
#include "common/log.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "common/thread_pool.h"

namespace weightd {
namespace {

constexpr uint64_t kSegmentAlign = 4096;
constexpr uint64_t kMaxIndexBytes = 64ull << 20;
constexpr char kIndexName[] = "model.safetensors.index.json";

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

struct OpenFile {
  std::string path;
  UniqueFd fd;
  struct stat st {};
  SafetensorsHeader header;
  Digest header_digest;  // of the 8-byte length and the JSON
  // Placement of the data section.
  size_t segment_index = 0;
  uint64_t segment_offset = 0;
};

absl::StatusOr<OpenFile> OpenSafetensors(OpenedFile file) {
  OpenFile f;
  f.path = file.path;
  f.fd = std::move(file.fd);
  f.st = file.st;
  const std::string& path = f.path;
  if (!S_ISREG(f.st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  }
  uint64_t size = static_cast<uint64_t>(f.st.st_size);
  if (size < 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": file is ", size, " bytes, too short for a safetensors header"));
  }
  char prefix[8];
  WD_RETURN_IF_ERROR_CTX(PreadFull(f.fd.get(), prefix, 8, 0), path);
  auto header_len = ParseSafetensorsPrefix(absl::string_view(prefix, 8), size);
  if (!header_len.ok()) return Annotate(header_len.status(), path);
  std::string json(*header_len, '\0');
  WD_RETURN_IF_ERROR_CTX(PreadFull(f.fd.get(), json.data(), json.size(), 8), path);
  auto header = ParseSafetensorsHeader(json, size);
  if (!header.ok()) return Annotate(header.status(), path);
  f.header = std::move(*header);
  DigestBuilder digest;
  digest.Update(prefix, 8);
  digest.Update(json.data(), json.size());
  f.header_digest = digest.Finish();
  return f;
}

// The files of a checkpoint, opened (each once, through `opener`), with the
// name each has in the index (when there is one).
struct CheckpointFiles {
  std::vector<OpenedFile> files;
  std::vector<std::string> index_names;
  bool has_index = false;
  SafetensorsIndex index;
};

absl::Status ReadIndex(const FileOpener& opener, const OpenedFile& index_file,
                       CheckpointFiles* out) {
  WD_ASSIGN_OR_RETURN(std::string json,
                      ReadFdToString(index_file.fd.get(), index_file.path, kMaxIndexBytes));
  auto parsed = ParseSafetensorsIndex(json);
  if (!parsed.ok()) return Annotate(parsed.status(), index_file.path);
  out->index = std::move(*parsed);
  out->has_index = true;
  for (const std::string& name : out->index.files) {
    WD_ASSIGN_OR_RETURN(OpenedFile f, opener.OpenBeside(index_file, name));
    out->files.push_back(std::move(f));
    out->index_names.push_back(name);
  }
  return absl::OkStatus();
}

absl::StatusOr<CheckpointFiles> OpenCheckpointFiles(const FileOpener& opener,
                                                    const std::string& path) {
  CheckpointFiles out;
  WD_ASSIGN_OR_RETURN(OpenedFile top, opener.Open(path));
  if (!top.is_directory()) {
    if (Basename(path) == kIndexName) {
      // An index file named directly: its shards lie beside it.
      WD_RETURN_IF_ERROR(ReadIndex(opener, top, &out));
      return out;
    }
    out.files.push_back(std::move(top));
    return out;
  }
  // The index is opened like any other file: a symlink out of the roots is
  // refused before a byte of it is read.
  auto index_file = opener.OpenIn(top, kIndexName);
  if (index_file.ok()) {
    WD_RETURN_IF_ERROR(ReadIndex(opener, *index_file, &out));
    return out;
  }
  if (!absl::IsNotFound(index_file.status())) return index_file.status();
  int listing = ::openat(top.fd.get(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DIR* d = listing < 0 ? nullptr : ::fdopendir(listing);
  if (d == nullptr) {
    int err = errno;
    if (listing >= 0) ::close(listing);
    return ErrnoStatus(err, absl::StrCat("opening directory ", path));
  }
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (absl::EndsWith(name, ".safetensors")) names.push_back(name);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  if (names.empty()) {
    return absl::NotFoundError(absl::StrCat(
        "directory ", path, " holds no .safetensors files and no ", kIndexName));
  }
  for (const std::string& name : names) {
    WD_ASSIGN_OR_RETURN(OpenedFile f, opener.OpenIn(top, name));
    out.files.push_back(std::move(f));
  }
  return out;
}

// Progress shared by the reader threads.
class ProgressTracker {
 public:
  ProgressTracker(const LoadProgressFn& fn, uint64_t bytes_total, uint64_t tensors_total)
      : fn_(fn) {
    info_.bytes_total = bytes_total;
    info_.tensors_total = tensors_total;
  }
  // `peer`: the address the bytes came from; empty: storage.
  void Add(uint64_t bytes, uint64_t tensors, const std::string& file,
           const std::string& peer = "") {
    if (!fn_) return;
    absl::MutexLock lock(&mu_);
    info_.bytes_done += bytes;
    info_.tensors_done += tensors;
    info_.current_file = file;
    if (peer.empty()) {
      info_.bytes_from_storage += bytes;
    } else {
      info_.bytes_from_peers += bytes;
      if (std::find(info_.peers.begin(), info_.peers.end(), peer) == info_.peers.end()) {
        info_.peers.push_back(peer);
      }
    }
    fn_(info_);
  }


 private:
  const LoadProgressFn& fn_;
  absl::Mutex mu_;
  LoadProgressInfo info_ ABSL_GUARDED_BY(mu_);
};

// The last progress report of a load: everything done (`sources`: where
// the bytes came from, when they were read).
void ReportDone(const LoadProgressFn& fn, uint64_t bytes, uint64_t tensors,
                const LoadProgressInfo* sources = nullptr) {
  if (!fn) return;
  LoadProgressInfo done;
  if (sources != nullptr) done = *sources;
  done.bytes_done = done.bytes_total = bytes;
  done.tensors_done = done.tensors_total = tensors;
  done.current_file.clear();
  fn(done);
}

// Allocates and maps the shared-memory pages under [dest, dest + length)
// (rounded out to pages) in one call instead of a fault per page while
// pread() copies; RESOURCE_EXHAUSTED when the memory is not there.
absl::Status PopulateForWrite(uint8_t* dest, uint64_t length) {
#ifdef MADV_POPULATE_WRITE
  uintptr_t begin = reinterpret_cast<uintptr_t>(dest) / kSegmentAlign * kSegmentAlign;
  uintptr_t end = AlignUp(reinterpret_cast<uintptr_t>(dest) + length, kSegmentAlign);
  if (length > 0 &&
      ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE) != 0) {
    if (errno == ENOMEM || errno == ENOSPC || errno == EFAULT) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "allocating ", end - begin, " bytes of shared memory: ", std::strerror(errno)));
    }
    // EINVAL (older kernel): pread() faults the pages in instead.
  }
#endif
  return absl::OkStatus();
}

// Best effort: fills the page tables of a read-only mapped range, so
// fetches and casts reading it take no page faults.
void PopulateForRead(const uint8_t* data, uint64_t length) {
#ifdef MADV_POPULATE_READ
  uintptr_t begin = reinterpret_cast<uintptr_t>(data) / kSegmentAlign * kSegmentAlign;
  uintptr_t end = AlignUp(reinterpret_cast<uintptr_t>(data) + length, kSegmentAlign);
  if (length > 0) {
    (void)::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_READ);
  }
#endif
}

// The identity of the files as opened: each one's path, device, inode,
// size, mtime and ctime, in order (ResidentCheckpoints).
std::string FilesKey(const std::vector<OpenFile>& files) {
  std::string key;
  for (const OpenFile& f : files) {
    absl::StrAppend(&key, f.path.size(), ":", f.path, "|", f.st.st_dev, "|", f.st.st_ino, "|",
                    f.st.st_size, "|", f.st.st_mtim.tv_sec, ".", f.st.st_mtim.tv_nsec, "|",
                    f.st.st_ctim.tv_sec, ".", f.st.st_ctim.tv_nsec, ";");
  }
  return key;
}


// The checkpoint over a predecessor's segments `d` for files laid out as
// `segment_sizes`, with `tensors` where that layout puts them; the digests
// checked as the donation's verify mode says. Any mismatch is an error (the
// caller reads the files instead); `metadata_charge` is taken only on
// success.
absl::StatusOr<std::shared_ptr<const Checkpoint>> AdoptDonated(
    const std::string& path, const CheckpointLoadOptions& options, DonatedCheckpoint d,
    const std::vector<uint64_t>& segment_sizes, std::vector<StoredTensor> tensors,
    const std::vector<size_t>& tensor_segment, const std::vector<std::string>& paths,
    std::unique_ptr<MemoryCharge>& metadata_charge, std::vector<CheckpointFileInfo> file_info) {
  if (d.segment_target_bytes != options.segment_target_bytes) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the predecessor laid the files out in segments of up to ", d.segment_target_bytes,
        " bytes, this daemon in ", options.segment_target_bytes,
        " (--checkpoint-segment-bytes differs)"));
  }
  if (d.segment_fds.size() != segment_sizes.size() ||
      d.segment_pages.size() != segment_sizes.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the predecessor handed over ", d.segment_fds.size(), " segments for a layout of ",
        segment_sizes.size()));
  }
  std::vector<SegmentPtr> segments;
  for (size_t i = 0; i < segment_sizes.size(); ++i) {
    WD_ASSIGN_OR_RETURN(std::unique_ptr<Segment> seg,
                        options.memory->Adopt(std::move(d.segment_fds[i]), d.segment_pages[i],
                                              "checkpoint"));
    const uint64_t want = d.segment_pages[i] == PageKind::kSmall
                              ? segment_sizes[i]
                              : RoundUpToHugePage(segment_sizes[i]);
    if (seg->size() != want) {
      return absl::FailedPreconditionError(absl::StrCat(
          "handed-over segment ", i, " holds ", seg->size(), " bytes; the layout needs ", want));
    }
    segments.push_back(SegmentPtr(std::move(seg)));
  }
  // Which tensors are digested again: all, a sample, or none.
  const AdoptVerify verify = options.donated->verify();
  std::vector<size_t> check;
  for (size_t i = 0; i < tensors.size(); ++i) {
    auto it = d.digests.find(tensors[i].name);
    if (it == d.digests.end()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the predecessor sent no digest for tensor \"", tensors[i].name, "\""));
    }
    auto place = d.places.find(tensors[i].name);
    if (place == d.places.end() ||
        place->second.segment != static_cast<int64_t>(tensor_segment[i]) ||
        place->second.offset != tensors[i].offset || place->second.length != tensors[i].length) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tensor \"", tensors[i].name, "\" lies elsewhere in the predecessor's segments than "
          "in this daemon's layout"));
    }
    tensors[i].digest = it->second;
    tensors[i].buffer = segments[tensor_segment[i]];
    const bool sampled = i % 16 == 0 || i + 1 == tensors.size();
    if (verify == AdoptVerify::kFull || (verify == AdoptVerify::kSample && sampled)) {
      check.push_back(i);
    }
  }
  std::atomic<size_t> bad{SIZE_MAX};
  WD_RETURN_IF_ERROR(ParallelFor(nullptr, check.size(), options.read_threads, [&](size_t k) {
    const StoredTensor& t = tensors[check[k]];
    if (DigestBytes(t.host_data(), t.length) != t.digest) {
      size_t expected = SIZE_MAX;
      bad.compare_exchange_strong(expected, check[k]);
    }
    return absl::OkStatus();
  }));
  if (bad.load() != SIZE_MAX) {
    const StoredTensor& t = tensors[bad.load()];
    return absl::DataLossError(absl::StrCat("handed-over bytes of tensor \"", t.name, "\" (",
                                            t.file, ") do not match the predecessor's digest"));
  }
  return std::make_shared<const Checkpoint>(path, paths, std::move(tensors), std::move(segments),
                                            std::move(metadata_charge), std::move(file_info));
}

// A range of one file's data section that a load fills (from storage or
// a peer), and where in the segments it goes.
struct Chunk {
  size_t file;
  uint64_t file_offset;  // in the file (the data section's offset included)
  uint64_t length;
  uint8_t* dest;
  uint64_t data_begin;  // in the file's data section
  size_t group;         // chunks of one group come from one holder
};

// What the peers offered a load: the holders that agree on every tensor's
// digest (expected[i] for tensor i), and the storage samples their bytes
// were checked against.
struct PeerPlan {
  Digest key;
  std::vector<std::string> holders;
  std::vector<Digest> expected;
  std::vector<CheckpointRange> samples;
  std::vector<Digest> sample_digests;  // of storage's bytes
  Digest copy;  // the holders' copy (PeerHolding::copy)
};

std::string Abbrev(const Digest& d) { return d.Hex().substr(0, 12); }

// Samples storage, asks the peers who holds `files` and keeps the holders
// whose samples match storage and who agree on the tensor digests (the
// largest such group). `tensor_file`/`tensor_begin`: each tensor's file
// and offset in that file's data section. No holder: an empty plan
// (kAuto), UNAVAILABLE (kPeers).
absl::StatusOr<PeerPlan> PlanPeers(const std::string& path, const CheckpointLoadOptions& options,
                                   const std::vector<OpenFile>& files,
                                   const std::vector<std::string>& names,
                                   const std::vector<StoredTensor>& tensors,
                                   const std::vector<size_t>& tensor_file,
                                   const std::vector<uint64_t>& tensor_begin,
                                   LoadSourceReport& report) {
  PeerPlan plan;
  if (options.peers == nullptr) {
    if (options.source == LoadSource::kPeers) {
      return absl::FailedPreconditionError(
          "--source peers: this daemon has no peers (--peers, --peer-dns)");
    }
    return plan;
  }
  std::vector<CheckpointFileId> ids;
  for (size_t i = 0; i < files.size(); ++i) {
    ids.push_back({names[i], static_cast<uint64_t>(files[i].st.st_size),
                   files[i].header_digest});
  }
  plan.key = CheckpointKey(ids);
  // Random places each load: a peer cannot have prepared for them. (It
  // sees them in the question, though: they pick its copy and turn away
  // peers with other bytes early; what checks its bytes is SecretPieces.)
  std::mt19937_64 rng(std::random_device{}());
  constexpr size_t kMaxSamples = 4096;  // what a holder answers
  const uint64_t piece = std::clamp<uint64_t>(options.peer_sample_bytes, 1, 1 << 20);
  const uint64_t per_file = std::max<uint64_t>(
      1,
      std::min<uint64_t>(options.peer_samples_per_file, 4096 / std::max<size_t>(1, files.size())));
  for (size_t i = 0; i < files.size(); ++i) {
    const uint64_t len = static_cast<uint64_t>(files[i].st.st_size) - files[i].header.data_offset;
    if (len == 0) continue;
    if (len <= piece * per_file) {
      for (uint64_t off = 0; off < len && plan.samples.size() < kMaxSamples; off += piece) {
        plan.samples.push_back({static_cast<uint32_t>(i), off, std::min(piece, len - off)});
      }
    } else {
      for (uint64_t k = 0; k < per_file && plan.samples.size() < kMaxSamples; ++k) {
        plan.samples.push_back({static_cast<uint32_t>(i), rng() % (len - piece + 1), piece});
      }
    }
  }
  std::string buf;
  for (const CheckpointRange& r : plan.samples) {
    const OpenFile& f = files[r.file];
    buf.resize(r.length);
    WD_RETURN_IF_ERROR_CTX(
        PreadFull(f.fd.get(), buf.data(), r.length, f.header.data_offset + r.offset),
        "reading ", f.path);
    plan.sample_digests.push_back(DigestBytes(buf.data(), r.length));
    report.storage_bytes += r.length;
  }
  // Each file's tensors in data-offset order (ties by name): the order of
  // a peer's digests.
  std::vector<std::vector<size_t>> order(files.size());
  for (size_t i = 0; i < tensors.size(); ++i) order[tensor_file[i]].push_back(i);
  for (auto& o : order) {
    std::sort(o.begin(), o.end(), [&](size_t a, size_t b) {
      return std::tie(tensor_begin[a], tensors[a].name) <
             std::tie(tensor_begin[b], tensors[b].name);
    });
  }
  if (plan.samples.empty()) {
    // No data at all: nothing to ask for (and nothing to show a holder
    // that we hold the same bytes).
    return plan;
  }
  PeerQuery query;
  query.key = plan.key;
  query.samples = plan.samples;
  query.sample_digests = plan.sample_digests;
  for (const auto& o : order) query.tensors_per_file.push_back(o.size());
  std::vector<PeerHolding> found = options.peers->FindHolders(query);
  auto differs = [&](const std::string& peer, const std::string& why) {
    report.peer_failures[peer]++;
    LogEvent(LogLevel::kWarning, "peer_content_differs",
             {{"peer", peer}, {"path", path}, {"key", Abbrev(plan.key)}, {"why", why},
              {"action", "not used"}});
  };
  std::vector<const PeerHolding*> usable;
  for (const PeerHolding& h : found) {
    bool ok = h.tensor_digests.size() == files.size() &&
              h.sample_digests.size() == plan.samples.size();
    for (size_t i = 0; ok && i < files.size(); ++i)
      ok = h.tensor_digests[i].size() == order[i].size();
    if (!ok) {
      differs(h.peer, "its answer does not fit the files' tensors and samples");
      continue;
    }
    // An empty tensor's digest is known: a holder saying otherwise lies.
    static const Digest kEmpty = DigestBytes(nullptr, 0);
    for (size_t i = 0; ok && i < files.size(); ++i) {
      for (size_t k = 0; ok && k < order[i].size(); ++k) {
        ok = tensors[order[i][k]].length > 0 || h.tensor_digests[i][k] == kEmpty;
      }
    }
    if (!ok) {
      differs(h.peer, "it reports a digest of bytes for an empty tensor");
      continue;
    }
    if (h.sample_digests != plan.sample_digests) {
      size_t k = 0;
      while (h.sample_digests[k] == plan.sample_digests[k]) ++k;
      const CheckpointRange& r = plan.samples[k];
      differs(h.peer, absl::StrCat("its bytes at ", files[r.file].path, " data offset ", r.offset,
                                   " (", r.length, " bytes) differ from storage's"));
      continue;
    }
    usable.push_back(&h);
  }
  // Holders that disagree on a digest cannot all be right: the largest
  // group that agrees is used (the first found on a tie).
  const PeerHolding* best = nullptr;
  size_t best_count = 0;
  for (const PeerHolding* a : usable) {
    size_t n = 0;
    for (const PeerHolding* b : usable) n += a->tensor_digests == b->tensor_digests;
    if (n > best_count) best = a, best_count = n;
  }
  for (const PeerHolding* h : usable) {
    if (h->tensor_digests == best->tensor_digests) {
      plan.holders.push_back(h->peer);
    } else {
      differs(h->peer, absl::StrCat("its tensor digests differ from those of ", best->peer));
    }
  }
  if (plan.holders.empty()) {
    if (options.source == LoadSource::kPeers) {
      return absl::UnavailableError(absl::StrCat(
          "--source peers: no peer holds the files of ", path, " (checkpoint key ",
          Abbrev(plan.key), "; ", found.size(), " answered holding them, ",
          found.size() - usable.size(), " of those with other bytes)"));
    }
    LogEvent(LogLevel::kInfo, "load_source",
             {{"path", path}, {"source", "storage"}, {"key", Abbrev(plan.key)},
              {"reason", found.empty() ? "no peer holds the files"
                                       : "no peer holds the same bytes"}});
    return plan;
  }
  plan.copy = best->copy;
  plan.expected.resize(tensors.size());
  for (size_t i = 0; i < files.size(); ++i) {
    for (size_t k = 0; k < order[i].size(); ++k) {
      plan.expected[order[i][k]] = best->tensor_digests[i][k];
    }
  }
  LogEvent(LogLevel::kInfo, "load_source",
           {{"path", path}, {"source", "peers"}, {"key", Abbrev(plan.key)},
            {"holders", absl::StrJoin(plan.holders, ",")}});
  return plan;
}

// Where the bytes peers send are compared with storage's (the load reads
// them from storage after the peers sent theirs): per file, pieces of
// peer_sample_bytes at random places chosen here, after the holders
// answered, and never sent to any peer, so a peer that answers the
// question's samples truthfully cannot know where else it is checked.
// peer_verify samples: peer_samples_per_file pieces per file; a fraction:
// that share of each file's pieces (at least as many); all: the chunks
// themselves, every byte.
std::vector<CheckpointRange> SecretPieces(const std::vector<OpenFile>& files,
                                          const CheckpointLoadOptions& options,
                                          const std::vector<Chunk>& chunks) {
  std::vector<CheckpointRange> out;
  const double fraction = options.peer_verify.fraction;
  if (fraction >= 1) {
    for (const Chunk& c : chunks) {
      out.push_back({static_cast<uint32_t>(c.file), c.data_begin, c.length});
    }
    return out;
  }
  std::mt19937_64 rng(std::random_device{}());
  const uint64_t piece = std::clamp<uint64_t>(options.peer_sample_bytes, 1, 1 << 20);
  for (size_t i = 0; i < files.size(); ++i) {
    const uint64_t len = static_cast<uint64_t>(files[i].st.st_size) - files[i].header.data_offset;
    if (len == 0) continue;
    const uint64_t n = (len + piece - 1) / piece;
    uint64_t k = std::min<uint64_t>(n, std::max(1, options.peer_samples_per_file));
    if (fraction > 0) k = std::max<uint64_t>(k, std::min<uint64_t>(n, std::ceil(fraction * n)));
    // k distinct pieces of n (Floyd's sampling), in order.
    std::set<uint64_t> picked;
    for (uint64_t j = n - k; j < n; ++j) {
      const uint64_t t = rng() % (j + 1);
      if (!picked.insert(t).second) picked.insert(j);
    }
    // Every piece whole (the last one ends where the data does).
    for (uint64_t at : picked) {
      const uint64_t length = std::min(piece, len);
      out.push_back({static_cast<uint32_t>(i), std::min(at * piece, len - length), length});
    }
  }
  return out;
}

// The holders of a range in rendezvous order: each range goes to the
// holder scoring highest for it, so a fleet loading the same files spreads
// its ranges over every holder, and a holder dropped moves only its own.
std::vector<size_t> RendezvousOrder(const std::vector<std::string>& holders, const Digest& key,
                                    size_t chunk) {
  std::vector<std::pair<uint64_t, size_t>> scored;
  for (size_t h = 0; h < holders.size(); ++h) {
    const std::string seed = absl::StrCat(key.View(), "|", holders[h], "|", chunk);
    const Digest d = DigestBytes(seed.data(), seed.size());
    uint64_t score;
    std::memcpy(&score, d.bytes.data(), sizeof(score));
    scored.emplace_back(score, h);
  }
  std::sort(scored.rbegin(), scored.rend());
  std::vector<size_t> out;
  for (const auto& [score, h] : scored) out.push_back(h);
  return out;
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

namespace {

// Tensors of a freshly read checkpoint whose bytes memory holds already
// (options.find_held: another checkpoint's tensors, a published
// generation's) point at those bytes; the others move to one segment of
// their size, and the files' segments are freed when `fresh` goes. Done
// only when the shared bytes are over 1/8 of the checkpoint (a copy to
// save less is not worth it) and the segment for the rest fits the budget
// and seals; otherwise `fresh` is returned as it is. The result has no file_info():
// its segments are no longer laid out by file, so peers are not offered it
// and a hand-over does not send it (the successor reads the files).
absl::StatusOr<std::shared_ptr<Checkpoint>> ShareHeldTensors(const std::string& path,
                                                             const CheckpointLoadOptions& options,
                                                             std::shared_ptr<Checkpoint> fresh) {
  const std::vector<StoredTensor>& tensors = fresh->tensors();
  const absl::Time start = absl::Now();
  std::vector<std::optional<HeldElsewhere>> held = options.find_held(*fresh);
  const absl::Time found = absl::Now();
  if (held.size() != tensors.size()) {
    return absl::InternalError(absl::StrCat("find_held answered ", held.size(), " entries for ",
                                            tensors.size(), " tensors"));
  }
  uint64_t shared = 0, rest = 0;
  size_t rest_count = 0;  // tensors to store (some may be empty)
  std::vector<uint64_t> at(tensors.size(), 0);
  std::vector<std::string> holders;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (held[i].has_value()) {
      shared += tensors[i].length;
      if (std::find(holders.begin(), holders.end(), held[i]->holder) == holders.end()) {
        holders.push_back(held[i]->holder);
      }
    } else {
      at[i] = rest;
      rest += AlignUp(tensors[i].length, 64);
      ++rest_count;
    }
  }
  const uint64_t total = fresh->total_bytes();
  if (shared == 0 || shared <= total / 8) return fresh;
  auto not_shared = [&](const absl::Status& why) {
    LogEvent(LogLevel::kInfo, "load_tensors_not_shared",
             {{"path", path}, {"bytes_held_elsewhere", absl::StrCat(shared)},
              {"reason", std::string(why.message())}});
    return fresh;
  };
  std::vector<StoredTensor> out = tensors;
  std::vector<SegmentPtr> segments;  // none when every tensor is shared
  if (rest_count > 0) {
    auto packed =
        options.memory->Allocate(std::max<uint64_t>(rest, 64), {.purpose = "checkpoint"});
    if (!packed.ok()) return not_shared(packed.status());
    // On the reader threads: the first touch of the new pages is most of it.
    std::vector<CopyRun> runs;
    for (size_t i = 0; i < out.size(); ++i) {
      if (held[i].has_value()) continue;
      runs.push_back(
          CopyRun{(*packed)->mutable_data() + at[i], tensors[i].host_data(), tensors[i].length});
    }
    WD_RETURN_IF_ERROR(ParallelCopy(runs, options.read_threads));
    if (absl::Status sealed = (*packed)->Seal(/*populate=*/false); !sealed.ok()) {
      return not_shared(sealed);
    }
    segments.push_back(SegmentPtr(std::move(*packed)));
  }
  for (size_t i = 0; i < out.size(); ++i) {
    if (held[i].has_value()) {
      out[i].buffer = held[i]->buffer;
      out[i].offset = held[i]->offset;
    } else {
      out[i].buffer = segments.front();
      out[i].offset = at[i];
    }
  }
  auto shared_copy = std::make_shared<Checkpoint>(path, fresh->files(), std::move(out),
                                                  std::move(segments),
                                                  fresh->TakeMetadataCharge());
  shared_copy->set_bytes_held_elsewhere(shared);
  // What was read goes back to the kernel off the load's path.
  uint64_t read_bytes = 0;
  for (const SegmentPtr& seg : fresh->host_segments()) read_bytes += seg->size();
  options.memory->disposer()->Dispose(std::shared_ptr<const void>(std::move(fresh)), read_bytes);
  std::sort(holders.begin(), holders.end());
  LogEvent(LogLevel::kInfo, "load_tensors_shared",
           {{"path", path}, {"bytes_shared", absl::StrCat(shared)},
            {"bytes_stored", absl::StrCat(rest)}, {"shared_with", absl::StrJoin(holders, ",")},
            {"find_seconds", absl::StrCat(absl::ToDoubleSeconds(found - start))},
            {"store_seconds", absl::StrCat(absl::ToDoubleSeconds(absl::Now() - found))}});
  return shared_copy;
}

}  // namespace

std::shared_ptr<const Checkpoint> FindIdenticalCopy(const ResidentCheckpoints& resident,
                                                    const Checkpoint& c) {
  const std::vector<CheckpointFileInfo>& files = c.file_info();
  if (files.empty()) return nullptr;
  for (auto& [key, other] : resident.Snapshot()) {
    const std::vector<CheckpointFileInfo>& theirs = other->file_info();
    if (other.get() == &c || other->copy_id() != c.copy_id() ||
        other->tensors().size() != c.tensors().size()) {
      continue;
    }
    if (other->bytes_held_elsewhere() > 0) {
      // One that shares other holders' bytes (ShareHeldTensors) has no file
      // layout to compare: the same tensors, byte for byte, will do.
      bool same = true;
      for (size_t i = 0; i < c.tensors().size() && same; ++i) {
        const StoredTensor& a = c.tensors()[i];
        const StoredTensor& b = other->tensors()[i];
        same = a.name == b.name && a.dtype == b.dtype && a.shape == b.shape &&
               a.length == b.length && a.host_data() != nullptr && b.host_data() != nullptr &&
               std::memcmp(a.host_data(), b.host_data(), a.length) == 0;
      }
      if (same) return other;
      continue;
    }
    if (theirs.size() != files.size()) continue;
    bool same = true;
    for (size_t i = 0; i < files.size() && same; ++i) {
      const CheckpointFileInfo& a = files[i];
      const CheckpointFileInfo& b = theirs[i];
      same = a.id.size == b.id.size && a.id.header == b.id.header &&
             a.data_length == b.data_length;
    }
    // Equal digests are not proof: the bytes are compared.
    for (size_t i = 0; i < files.size() && same; ++i) {
      const CheckpointFileInfo& a = files[i];
      const CheckpointFileInfo& b = theirs[i];
      if (a.data_length == 0) continue;
      if (a.segment >= c.host_segments().size() || b.segment >= other->host_segments().size()) {
        same = false;
        break;
      }
      const uint8_t* pa = c.host_segments()[a.segment]->host_data();
      const uint8_t* pb = other->host_segments()[b.segment]->host_data();
      same = pa != nullptr && pb != nullptr &&
             std::memcmp(pa + a.segment_offset, pb + b.segment_offset, a.data_length) == 0;
    }
    if (same) return other;
  }
  return nullptr;
}

const char* AdoptVerifyName(AdoptVerify v) {
  switch (v) {
    case AdoptVerify::kFull: return "full";
    case AdoptVerify::kSample: return "sample";
    case AdoptVerify::kNone: return "none";
  }
  return "?";
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

void DonatedCheckpoints::Add(DonatedCheckpoint checkpoint) {
  absl::MutexLock lock(&mu_);
  std::string key = checkpoint.files_key;
  by_files_[std::move(key)] = std::move(checkpoint);
}

std::optional<DonatedCheckpoint> DonatedCheckpoints::Take(const std::string& files_key) {
  absl::MutexLock lock(&mu_);
  auto it = by_files_.find(files_key);
  if (it == by_files_.end()) return std::nullopt;
  DonatedCheckpoint d = std::move(it->second);
  by_files_.erase(it);
  return d;
}

size_t DonatedCheckpoints::DropUnused() {
  absl::MutexLock lock(&mu_);
  size_t n = by_files_.size();
  by_files_.clear();
  return n;
}

void ResidentCheckpoints::Add(const std::string& files_key,
                              const std::shared_ptr<const Checkpoint>& checkpoint) {
  absl::MutexLock lock(&mu_);
  absl::erase_if(by_files_, [](const auto& kv) { return kv.second.checkpoint.expired(); });
  by_files_[files_key] = Entry{checkpoint, checkpoint->content_key(), ++adds_};
}

int64_t StoredTensor::NumElements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

uint64_t TensorMetadataBytes(absl::string_view name, size_t rank) {
  return kTensorMetadataBytes + kTensorMetadataBytesPerNameByte * name.size() +
         kTensorMetadataBytesPerDim * rank;
}

Checkpoint::Checkpoint(std::string path, std::vector<std::string> files,
                       std::vector<StoredTensor> tensors,
                       std::vector<SegmentPtr> host_segments,
                       std::unique_ptr<MemoryCharge> metadata_charge,
                       std::vector<CheckpointFileInfo> file_info)
    : path_(std::move(path)),
      files_(std::move(files)),
      tensors_(std::move(tensors)),
      host_segments_(std::move(host_segments)),
      metadata_charge_(std::move(metadata_charge)),
      file_info_(std::move(file_info)) {
  if (!file_info_.empty()) {
    std::vector<CheckpointFileId> ids;
    for (const CheckpointFileInfo& f : file_info_) ids.push_back(f.id);
    content_key_ = CheckpointKey(ids);
  }
  std::sort(tensors_.begin(), tensors_.end(),
            [](const StoredTensor& a, const StoredTensor& b) { return a.name < b.name; });
  DigestBuilder copy;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    by_name_[tensors_[i].name] = i;
    total_bytes_ += tensors_[i].length;
    copy.Update(tensors_[i].digest.bytes.data(), tensors_[i].digest.bytes.size());
  }
  copy_id_ = copy.Finish();
  for (const SegmentPtr& seg : host_segments_) {
    page_bytes_[static_cast<size_t>(seg->pages())] += seg->size();
  }
}

const StoredTensor* Checkpoint::Find(absl::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
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
  if (samples.size() > 4096) {
    return absl::InvalidArgumentError(absl::StrCat(samples.size(), " samples; at most 4096"));
  }
  PeerHolding out;
  out.copy = c.copy_id();
  for (const CheckpointRange& r : samples) {
    WD_ASSIGN_OR_RETURN(HeldBytes held, FindHeldBytes(c, r, 1 << 20));
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

absl::StatusOr<std::shared_ptr<const Checkpoint>> LoadCheckpoint(
    const std::string& path, const CheckpointLoadOptions& options) {
  const UnconfinedFileOpener unconfined;
  const FileOpener& opener = options.files != nullptr ? *options.files : unconfined;
  WD_ASSIGN_OR_RETURN(CheckpointFiles found, OpenCheckpointFiles(opener, path));
  const SafetensorsIndex& index = found.index;
  const bool has_index = found.has_index;

  std::vector<OpenFile> files;
  std::vector<std::string> paths;
  files.reserve(found.files.size());
  absl::flat_hash_map<std::string, std::string> owner;  // tensor -> file
  uint64_t tensors_total = 0;
  for (size_t i = 0; i < found.files.size(); ++i) {
    WD_ASSIGN_OR_RETURN(OpenFile f, OpenSafetensors(std::move(found.files[i])));
    const std::string& p = f.path;
    paths.push_back(p);
    if (options.opened_files != nullptr) options.opened_files->push_back(p);
    for (const SafetensorsEntry& e : f.header.tensors) {
      auto [it, inserted] = owner.emplace(e.name, p);
      if (!inserted) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor \"", e.name, "\" appears in both ", it->second, " and ", p));
      }
      if (has_index) {
        auto mapped = index.weight_map.find(e.name);
        if (mapped == index.weight_map.end() || mapped->second != found.index_names[i]) {
          return absl::InvalidArgumentError(absl::StrCat(
              p, ": tensor \"", e.name, "\" is not mapped to this file by ", kIndexName));
        }
      }
    }
    tensors_total += f.header.tensors.size();
    files.push_back(std::move(f));
  }
  if (has_index) {
    for (const auto& [name, file] : index.weight_map) {
      if (!owner.contains(name)) {
        return absl::InvalidArgumentError(absl::StrCat(
            kIndexName, " maps tensor \"", name, "\" to ", file, ", which does not hold it"));
      }
    }
  }

  // The per-tensor bookkeeping counts against the budget like the bytes: a
  // small file of very many tensors must not take unaccounted memory.
  uint64_t metadata_bytes = 0;
  for (const OpenFile& f : files) {
    for (const SafetensorsEntry& e : f.header.tensors) {
      metadata_bytes += TensorMetadataBytes(e.name, e.shape.size());
    }
  }
  WD_ASSIGN_OR_RETURN(
      std::unique_ptr<MemoryCharge> metadata_charge,
      options.memory->Charge(metadata_bytes,
                            absl::StrCat("metadata of ", tensors_total, " tensors")));

  // Files already resident (the same files under another model's name or
  // profile) are shared, not read again; the metadata charge above goes to
  // the caller, for what it builds per model. The files were opened above,
  // through the caller's confinement, so only what it may read is shared.
  std::string files_key;
  if (options.resident != nullptr) {
    files_key = FilesKey(files);
    if (std::shared_ptr<const Checkpoint> resident = options.resident->Find(files_key)) {
      ReportDone(options.progress, resident->total_bytes(), resident->tensors().size());
      *options.shared_charge = std::move(metadata_charge);
      LogEvent(LogLevel::kInfo, "load_shared",
               {{"path", path}, {"files", absl::StrCat(files.size())},
                {"bytes", absl::StrCat(resident->total_bytes())}});
      return resident;
    }
  }

  // Lay the data sections out in segments, in file order.
  std::vector<uint64_t> segment_sizes;
  uint64_t bytes_total = 0;
  for (OpenFile& f : files) {
    uint64_t data_len = static_cast<uint64_t>(f.st.st_size) - f.header.data_offset;
    bytes_total += data_len;
    if (segment_sizes.empty() ||
        (segment_sizes.back() > 0 &&
         segment_sizes.back() + data_len > options.segment_target_bytes)) {
      segment_sizes.push_back(0);
    }
    f.segment_index = segment_sizes.size() - 1;
    f.segment_offset = segment_sizes.back();
    segment_sizes.back() = AlignUp(segment_sizes.back() + data_len, kSegmentAlign);
  }
  // Each file's identity and place (what peers ask for and serve).
  std::vector<CheckpointFileInfo> file_info;
  std::vector<std::string> names;
  for (size_t i = 0; i < files.size(); ++i) {
    const OpenFile& f = files[i];
    names.push_back(has_index ? found.index_names[i] : std::string(Basename(f.path)));
    CheckpointFileInfo info;
    info.path = f.path;
    info.id = {names.back(), static_cast<uint64_t>(f.st.st_size), f.header_digest};
    info.data_offset = f.header.data_offset;
    info.data_length = static_cast<uint64_t>(f.st.st_size) - f.header.data_offset;
    info.segment = f.segment_index;
    info.segment_offset = f.segment_offset;
    info.mtime_sec = f.st.st_mtim.tv_sec;
    info.mtime_nsec = f.st.st_mtim.tv_nsec;
    info.dev = f.st.st_dev;
    info.ino = f.st.st_ino;
    file_info.push_back(std::move(info));
  }
  // The tensors where the layout puts them (and each one's segment, file
  // and offset in the file's data section).
  std::vector<StoredTensor> tensors;
  std::vector<size_t> tensor_segment, tensor_file;
  std::vector<uint64_t> tensor_begin;
  tensors.reserve(tensors_total);
  for (size_t i = 0; i < files.size(); ++i) {
    const OpenFile& f = files[i];
    for (const SafetensorsEntry& e : f.header.tensors) {
      StoredTensor t;
      t.name = e.name;
      t.dtype = e.dtype;
      t.shape = e.shape;
      t.offset = f.segment_offset + e.begin;
      t.length = e.end - e.begin;
      t.file = f.path;
      tensors.push_back(std::move(t));
      tensor_segment.push_back(f.segment_index);
      tensor_file.push_back(i);
      tensor_begin.push_back(e.begin);
    }
  }

  // Segments a predecessor daemon handed over for these very files are
  // adopted instead of read, once they check out.
  if (options.donated != nullptr) {
    if (files_key.empty()) files_key = FilesKey(files);
    if (std::optional<DonatedCheckpoint> d = options.donated->Take(files_key)) {
      auto adopted = AdoptDonated(path, options, std::move(*d), segment_sizes, tensors,
                                  tensor_segment, paths, metadata_charge, file_info);
      if (adopted.ok()) {
        options.donated->CountAdopted();
        ReportDone(options.progress, bytes_total, tensors_total);
        if (options.resident != nullptr) options.resident->Add(files_key, *adopted);
        LogEvent(LogLevel::kInfo, "load_adopted",
                 {{"path", path}, {"segments", absl::StrCat(segment_sizes.size())},
                  {"bytes", absl::StrCat(bytes_total)},
                  {"verify", AdoptVerifyName(options.donated->verify())}});
        return *adopted;
      }
      options.donated->CountRefused();
      LogEvent(LogLevel::kWarning, "handover_segments_refused",
               {{"path", path}, {"error", adopted.status().ToString()},
                {"action", "reading the files instead"}});
    }
  }

  // Peers holding the same files supply the bytes (checked below), before
  // any memory is taken for them.
  LoadSourceReport local_report;
  LoadSourceReport& report = options.report != nullptr ? *options.report : local_report;
  PeerPlan plan;
  if (options.source != LoadSource::kStorage) {
    WD_ASSIGN_OR_RETURN(plan, PlanPeers(path, options, files, names, tensors, tensor_file,
                                        tensor_begin, report));
  }

  std::vector<std::unique_ptr<Segment>> segments;
  for (uint64_t size : segment_sizes) {
    // Not prefaulted here: one thread allocating and mapping every page up
    // front took over half the load; each reader populates its own chunk.
    WD_ASSIGN_OR_RETURN(auto seg,
                        options.memory->Allocate(size, {.purpose = "checkpoint"}));
    segments.push_back(std::move(seg));
  }

  // Every data section in chunks of at most chunk_bytes (file i's from
  // first_chunk[i] on), in groups: whole tensors packed together, or one
  // large tensor's pieces. A group comes from one holder (while it lasts),
  // so a tensor that misses its digest names the peer that sent it.
  const uint64_t chunk_bytes = std::max<uint64_t>(1, options.read_chunk_bytes);
  std::vector<Chunk> chunks;
  std::vector<size_t> first_chunk;
  size_t groups = 0;
  {
    size_t t = 0;  // tensors are in file order, each file's by offset
    for (size_t i = 0; i < files.size(); ++i) {
      const OpenFile& f = files[i];
      first_chunk.push_back(chunks.size());
      const uint64_t data_len = static_cast<uint64_t>(f.st.st_size) - f.header.data_offset;
      uint8_t* base = segments[f.segment_index]->mutable_data() + f.segment_offset;
      auto emit = [&](uint64_t begin, uint64_t end) {
        for (uint64_t off = begin; off < end; off += chunk_bytes) {
          chunks.push_back({i, f.header.data_offset + off, std::min(chunk_bytes, end - off),
                            base + off, off, groups});
        }
        ++groups;
      };
      uint64_t group_start = 0, pos = 0;
      for (; t < tensors.size() && tensor_file[t] == i; ++t) {
        const uint64_t end = std::max(pos, tensor_begin[t] + tensors[t].length);
        if (end - group_start > chunk_bytes && pos > group_start) {
          emit(group_start, pos);
          group_start = pos;
        }
        pos = end;
        if (pos - group_start > chunk_bytes) {
          emit(group_start, pos);
          group_start = pos;
        }
      }
      if (data_len > group_start) emit(group_start, data_len);
    }
    first_chunk.push_back(chunks.size());
  }
  ProgressTracker progress(options.progress, bytes_total, tensors_total);
  absl::Mutex report_mu;
  auto read_storage = [&](const Chunk& c, bool count) -> absl::Status {
    const OpenFile& f = files[c.file];
    WD_RETURN_IF_ERROR_CTX(PopulateForWrite(c.dest, c.length), "reading ", f.path);
    WD_RETURN_IF_ERROR_CTX(PreadFull(f.fd.get(), c.dest, c.length, c.file_offset),
                           "reading ", f.path);
    {
      absl::MutexLock lock(&report_mu);
      report.storage_bytes += c.length;
    }
    if (count) progress.Add(c.length, 0, f.path);
    return absl::OkStatus();
  };
  auto digest_all = [&]() {
    return ParallelFor(nullptr, tensors.size(), options.read_threads, [&](size_t i) {
      StoredTensor& t = tensors[i];
      t.digest = DigestBytes(segments[tensor_segment[i]]->mutable_data() + t.offset, t.length);
      return absl::OkStatus();
    });
  };
  // Where the bytes kept came from (what was fetched again replaced).
  LoadProgressInfo sources;
  std::map<std::string, uint64_t> kept_by_peer;
  sources.bytes_from_storage = bytes_total;
  if (plan.holders.empty()) {
    // Read every data section in chunks, in parallel.
    WD_RETURN_IF_ERROR(ParallelFor(nullptr, chunks.size(), options.read_threads, [&](size_t i) {
      return read_storage(chunks[i], /*count=*/true);
    }));
    WD_RETURN_IF_ERROR(digest_all());
  } else {
    // From the holders, each chunk from the first in its rendezvous order
    // still in the load; what none supplies from storage (kAuto).
    constexpr int kFromStorage = -1;
    const std::vector<std::string>& holders = plan.holders;
    std::vector<int> supplier(chunks.size(), kFromStorage);
    // Chunks a peer filled since the last comparison with storage.
    std::vector<char> unchecked(chunks.size(), 0);
    // Holders a chunk is not asked again (changed only between fills).
    std::vector<std::vector<int>> excluded(chunks.size());
    auto dropped = std::make_unique<std::atomic<bool>[]>(holders.size());
    // Dropped for wrong bytes: nothing it sent is kept.
    auto lied = std::make_unique<std::atomic<bool>[]>(holders.size());
    for (size_t h = 0; h < holders.size(); ++h) dropped[h] = lied[h] = false;
    auto drop = [&](size_t h, const absl::Status& why, const char* event) {
      if (why.code() == absl::StatusCode::kDataLoss) lied[h] = true;
      if (dropped[h].exchange(true)) return;
      {
        absl::MutexLock lock(&report_mu);
        report.peer_failures[holders[h]]++;
      }
      LogEvent(LogLevel::kWarning, event,
               {{"peer", holders[h]}, {"path", path}, {"error", why.ToString()},
                {"action", "dropped from this load; its ranges come from other holders or "
                           "storage"}});
    };
    auto fill = [&](const std::vector<size_t>& todo, bool count) {
      return ParallelFor(nullptr, todo.size(), std::max(1, options.peer_streams), [&](size_t k) {
        const size_t ci = todo[k];
        const Chunk& c = chunks[ci];
        const OpenFile& f = files[c.file];
        WD_RETURN_IF_ERROR_CTX(PopulateForWrite(c.dest, c.length), "loading ", f.path);
        absl::Status last;
        for (size_t h : RendezvousOrder(holders, plan.key, c.group)) {
          if (dropped[h] || std::find(excluded[ci].begin(), excluded[ci].end(),
                                      static_cast<int>(h)) != excluded[ci].end()) {
            continue;
          }
          const CheckpointRange range{static_cast<uint32_t>(c.file), c.data_begin, c.length};
          absl::Status s = options.peers->ReadRange(holders[h], plan.key, plan.copy, range, c.dest);
          if (s.ok()) {
            supplier[ci] = static_cast<int>(h);
            unchecked[ci] = 1;
            {
              // Discarded until the load keeps them (counted at its end).
              absl::MutexLock lock(&report_mu);
              report.peer_bytes_discarded += c.length;
            }
            if (count) progress.Add(c.length, 0, f.path, holders[h]);
            return absl::OkStatus();
          }
          drop(h, s, "peer_read_failed");
          last = s;
        }
        if (options.source == LoadSource::kPeers) {
          return absl::UnavailableError(absl::StrCat(
              "--source peers: no peer holding ", path, " could supply ", f.path, " bytes ",
              c.file_offset, "..", c.file_offset + c.length, " (",
              last.ok() ? "every holder was dropped or sent wrong bytes" : last.ToString(),
              ")"));
        }
        supplier[ci] = kFromStorage;
        unchecked[ci] = 0;
        return read_storage(c, count);
      });
    };
    // The chunks under a byte range of a file's data section.
    auto chunks_under = [&](size_t file, uint64_t begin, uint64_t length) {
      std::vector<size_t> out;
      if (length == 0) return out;
      // The last chunk starting at or before `begin`, then on while they
      // start before the end.
      auto it = std::upper_bound(chunks.begin() + first_chunk[file],
                                 chunks.begin() + first_chunk[file + 1], begin,
                                 [](uint64_t b, const Chunk& c) { return b < c.data_begin; });
      for (size_t ci = static_cast<size_t>(it - chunks.begin()) - 1;
           ci < first_chunk[file + 1] && chunks[ci].data_begin < begin + length; ++ci) {
        out.push_back(ci);
      }
      return out;
    };
    // The first chunk of every group, then the second of each, ...: the
    // streams at work take different groups, so a large tensor's pieces
    // (one group, one holder) do not keep them all on one holder.
    std::vector<size_t> todo(chunks.size());
    std::vector<size_t> rank_in_group(chunks.size());
    for (size_t i = 0; i < chunks.size(); ++i) {
      todo[i] = i;
      const bool same_group = i > 0 && chunks[i - 1].group == chunks[i].group;
      rank_in_group[i] = same_group ? rank_in_group[i - 1] + 1 : 0;
    }
    std::stable_sort(todo.begin(), todo.end(), [&](size_t a, size_t b) {
      return rank_in_group[a] < rank_in_group[b];
    });
    WD_RETURN_IF_ERROR(fill(todo, /*count=*/true));
    // Every peer has sent its bytes (it is committed to them) before the
    // places where they are compared with storage's are chosen.
    const std::vector<CheckpointRange> secret = SecretPieces(files, options, chunks);
    // The secret pieces over chunks a peer filled since the last check,
    // read from storage and compared with what the peer sent: the pieces
    // that differ.
    auto compare_with_storage = [&]() -> absl::StatusOr<std::vector<size_t>> {
      std::vector<size_t> differ;
      absl::Mutex differ_mu;
      WD_RETURN_IF_ERROR(ParallelFor(nullptr, secret.size(), options.read_threads,
                                     [&](size_t k) -> absl::Status {
        const CheckpointRange& r = secret[k];
        bool from_peer = false;
        for (size_t ci : chunks_under(r.file, r.offset, r.length)) {
          from_peer = from_peer || unchecked[ci];
        }
        if (!from_peer) return absl::OkStatus();
        const OpenFile& f = files[r.file];
        std::string buf(r.length, '\0');
        WD_RETURN_IF_ERROR_CTX(
            PreadFull(f.fd.get(), buf.data(), r.length, f.header.data_offset + r.offset),
            "reading ", f.path);
        const uint8_t* got = chunks[first_chunk[r.file]].dest + r.offset;
        const bool same = std::memcmp(buf.data(), got, r.length) == 0;
        absl::MutexLock lock(&report_mu);
        report.storage_bytes += r.length;
        if (!same) {
          absl::MutexLock d(&differ_mu);
          differ.push_back(k);
        }
        return absl::OkStatus();
      }));
      std::fill(unchecked.begin(), unchecked.end(), 0);
      std::sort(differ.begin(), differ.end());
      return differ;
    };
    // Every holder dropped, what they sent read from storage again.
    auto all_from_storage = [&]() {
      for (size_t h = 0; h < holders.size(); ++h) dropped[h] = true;
      std::vector<size_t> peer_chunks;
      for (size_t ci = 0; ci < chunks.size(); ++ci) {
        if (supplier[ci] != kFromStorage) peer_chunks.push_back(ci);
      }
      return fill(peer_chunks, /*count=*/false);
    };
    bool trust_storage = false;  // storage disagreed with the holders' digests
    for (size_t round = 0;; ++round) {
      WD_RETURN_IF_ERROR(digest_all());
      if (trust_storage) break;
      // Wrong bytes: a tensor that misses its digest, a sample that differs
      // from storage's. Whoever supplied them is dropped; they are fetched
      // again.
      std::set<size_t> redo;
      bool storage_disagrees = false;
      std::string first_bad;
      // One peer sent the wrong bytes: it is dropped. Several (a group
      // split by a holder dropped midway, a sample across groups): none is
      // blamed, but each of their chunks comes from another source next.
      auto blame = [&](const std::vector<size_t>& under, const std::string& what) {
        std::set<int> peers;
        for (size_t ci : under) {
          if (supplier[ci] != kFromStorage) peers.insert(supplier[ci]);
        }
        if (peers.empty()) {
          storage_disagrees = true;
          if (first_bad.empty()) first_bad = what;
          return;
        }
        if (peers.size() == 1) {
          drop(static_cast<size_t>(*peers.begin()),
               absl::DataLossError(absl::StrCat("its bytes of ", what, " are wrong")),
               "peer_data_loss");
        }
        // A peer dropped already (for wrong bytes elsewhere) is presumed
        // the culprit; else every chunk avoids the peer that sent it.
        bool culprit = false;
        for (int p : peers) culprit = culprit || dropped[p];
        for (size_t ci : under) {
          if (supplier[ci] == kFromStorage) continue;
          if (culprit && !dropped[supplier[ci]]) continue;
          if (!culprit) excluded[ci].push_back(supplier[ci]);
          redo.insert(ci);
        }
      };
      for (size_t i = 0; i < tensors.size(); ++i) {
        if (tensors[i].digest != plan.expected[i]) {
          blame(chunks_under(tensor_file[i], tensor_begin[i], tensors[i].length),
                absl::StrCat("tensor \"", tensors[i].name, "\" (", tensors[i].file, ")"));
        }
      }
      for (size_t k = 0; k < plan.samples.size(); ++k) {
        const CheckpointRange& r = plan.samples[k];
        const Chunk& c0 = chunks[first_chunk[r.file]];
        if (DigestBytes(c0.dest + r.offset, r.length) != plan.sample_digests[k]) {
          blame(chunks_under(r.file, r.offset, r.length),
                absl::StrCat(files[r.file].path, " data offset ", r.offset));
        }
      }
      // The bytes themselves against storage's, where the peers could not
      // know (whatever digests they reported for them).
      WD_ASSIGN_OR_RETURN(std::vector<size_t> differ, compare_with_storage());
      for (size_t k : differ) {
        const CheckpointRange& r = secret[k];
        blame(chunks_under(r.file, r.offset, r.length),
              absl::StrCat(files[r.file].path, " data offset ", r.offset, " (", r.length,
                           " bytes, compared with storage's)"));
      }
      // A peer caught sending wrong bytes is trusted for none of them: its
      // other bytes may agree with digests it made up for them.
      for (size_t ci = 0; ci < chunks.size() && !storage_disagrees; ++ci) {
        if (supplier[ci] != kFromStorage && lied[supplier[ci]]) redo.insert(ci);
      }
      if (storage_disagrees) {
        // Storage's bytes are what the files say: the holders' digests are
        // not those of these files.
        if (options.source == LoadSource::kPeers) {
          return absl::DataLossError(absl::StrCat(
              "--source peers: storage's bytes of ", first_bad,
              " differ from every holder's digest; the peers hold other content"));
        }
        LogEvent(LogLevel::kWarning, "peer_content_differs",
                 {{"path", path}, {"holders", absl::StrJoin(holders, ",")},
                  {"why", absl::StrCat("storage's bytes of ", first_bad,
                                       " do not match their digests")},
                  {"action", "reading everything from storage"}});
        WD_RETURN_IF_ERROR(all_from_storage());
        trust_storage = true;
        continue;
      }
      if (redo.empty()) break;
      if (round > 2 * holders.size() + 2) {
        // Each round drops a holder or keeps a chunk from one: not reached
        // but by a bug. Storage still has the bytes (kAuto).
        if (options.source == LoadSource::kPeers) {
          return absl::InternalError(
              absl::StrCat("loading ", path, " from peers did not converge"));
        }
        WD_RETURN_IF_ERROR(all_from_storage());
        trust_storage = true;
        continue;
      }
      WD_RETURN_IF_ERROR(fill(std::vector<size_t>(redo.begin(), redo.end()), /*count=*/false));
    }
    sources.bytes_from_storage = 0;
    std::set<int> used;
    for (size_t ci = 0; ci < chunks.size(); ++ci) {
      if (supplier[ci] == kFromStorage) {
        sources.bytes_from_storage += chunks[ci].length;
      } else {
        sources.bytes_from_peers += chunks[ci].length;
        kept_by_peer[holders[supplier[ci]]] += chunks[ci].length;
        used.insert(supplier[ci]);
      }
    }
    for (int h : used) sources.peers.push_back(holders[h]);
    LogEvent(LogLevel::kInfo, "load_sources",
             {{"path", path}, {"from_peers", absl::StrCat(sources.bytes_from_peers)},
              {"from_storage", absl::StrCat(sources.bytes_from_storage)},
              {"peers", absl::StrJoin(sources.peers, ",")}});
  }

  // A file replaced or rewritten while we read it would give torn tensors.
  // Any other change of its status (a ctime that moved: a write that put
  // the mtime back, a chmod) keeps this copy from being shared: later loads
  // read the files again.
  bool shareable = true;
  for (const OpenFile& f : files) {
    struct stat now;
    if (::fstat(f.fd.get(), &now) != 0) return ErrnoStatus(errno, f.path);
    if (now.st_size != f.st.st_size || now.st_mtim.tv_sec != f.st.st_mtim.tv_sec ||
        now.st_mtim.tv_nsec != f.st.st_mtim.tv_nsec) {
      return absl::DataLossError(absl::StrCat(f.path, " changed while it was being loaded"));
    }
    shareable = shareable && now.st_ctim.tv_sec == f.st.st_ctim.tv_sec &&
                now.st_ctim.tv_nsec == f.st.st_ctim.tv_nsec;
  }

  // Sealing keeps each segment's mapping (read-only now) with the pages the
  // readers wrote still mapped. Where it has to remap (kernels before 5.1),
  // the new mapping's page tables are filled on all reader threads instead
  // of by one MAP_POPULATE.
  std::vector<std::pair<const uint8_t*, uint64_t>> ranges;
  for (auto& seg : segments) {
    WD_RETURN_IF_ERROR(seg->Seal(/*populate=*/false));
    if (seg->kept_mapping()) continue;
    for (uint64_t off = 0; off < seg->size(); off += options.read_chunk_bytes) {
      ranges.emplace_back(seg->data() + off, std::min(options.read_chunk_bytes,
                                                      seg->size() - off));
    }
  }
  WD_RETURN_IF_ERROR(ParallelFor(nullptr, ranges.size(), options.read_threads, [&](size_t i) {
    PopulateForRead(ranges[i].first, ranges[i].second);
    return absl::OkStatus();
  }));
  std::vector<SegmentPtr> sealed;
  for (auto& seg : segments) sealed.push_back(SegmentPtr(std::move(seg)));
  for (size_t i = 0; i < tensors.size(); ++i) tensors[i].buffer = sealed[tensor_segment[i]];
  // The peers' bytes this load keeps; the rest of what they sent stays
  // counted as discarded.
  for (const auto& [peer, bytes] : kept_by_peer) {
    report.peer_bytes += bytes;
    report.by_peer[peer] += bytes;
    report.peer_bytes_discarded -= bytes;
  }
  ReportDone(options.progress, bytes_total, tensors_total, &sources);
  auto fresh = std::make_shared<Checkpoint>(path, std::move(paths), std::move(tensors),
                                            std::move(sealed), std::move(metadata_charge),
                                            std::move(file_info));
  if (options.resident != nullptr) {
    // The same bytes at other paths (a copy): what was just read is freed.
    // (Not registered under these files: a hand-over sends each resident
    // entry's segments, and would send that copy's twice.)
    if (std::shared_ptr<const Checkpoint> same = FindIdenticalCopy(*options.resident, *fresh)) {
      *options.shared_charge = fresh->TakeMetadataCharge();
      LogEvent(LogLevel::kInfo, "load_deduplicated",
               {{"path", path}, {"same_as", same->path()},
                {"bytes_freed", absl::StrCat(fresh->total_bytes())}});
      return same;
    }
  }
  if (options.find_held) {
    WD_ASSIGN_OR_RETURN(fresh, ShareHeldTensors(path, options, std::move(fresh)));
  }
  std::shared_ptr<const Checkpoint> checkpoint = std::move(fresh);
  if (options.resident != nullptr && shareable) options.resident->Add(files_key, checkpoint);
  return checkpoint;
}

}  // namespace weightd
