#include "server/store/peer_read.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "server/base/log.h"
#include "common/status_macros.h"
#include "server/base/thread_pool.h"

namespace weightd {
namespace {

constexpr size_t kMaxSamples = 4096;  // what a holder answers

std::string Abbrev(const Digest& d) { return d.Hex().substr(0, 12); }

Digest KeyOf(const CheckpointFiles& files) {
  std::vector<CheckpointFileId> ids;
  for (size_t i = 0; i < files.files.size(); ++i) {
    ids.push_back({files.names[i], files.files[i].size(), files.files[i].header_digest});
  }
  return CheckpointKey(ids);
}

// Storage samples at random places each load: a peer cannot have prepared
// for them. (It sees them in the question, though: they pick its copy and
// turn away peers with other bytes early; what checks its bytes is
// SecretPieces.)
absl::Status SampleStorage(const CheckpointLoadOptions& options,
                           const std::vector<CheckpointFile>& files, const StorageReader& storage,
                           PeerPlan& plan) {
  std::mt19937_64 rng(std::random_device{}());
  const uint64_t piece = std::clamp<uint64_t>(options.peer_sample_bytes, 1, 1 << 20);
  const uint64_t per_file = std::max<uint64_t>(
      1,
      std::min<uint64_t>(options.peer_samples_per_file, 4096 / std::max<size_t>(1, files.size())));
  for (size_t i = 0; i < files.size(); ++i) {
    const uint64_t len = files[i].data_length();
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
    buf.resize(r.length);
    WD_RETURN_IF_ERROR(storage.ReadData(r.file, r.offset, r.length, buf.data()));
    plan.sample_digests.push_back(DigestBytes(buf.data(), r.length));
  }
  return absl::OkStatus();
}

// Each file's tensors in data-offset order (ties by name): the order of a
// peer's digests.
std::vector<std::vector<size_t>> DigestOrder(size_t files, const LoadLayout& layout) {
  std::vector<std::vector<size_t>> order(files);
  for (size_t i = 0; i < layout.tensors.size(); ++i) order[layout.tensor_file[i]].push_back(i);
  for (auto& o : order) {
    std::sort(o.begin(), o.end(), [&](size_t a, size_t b) {
      return std::tie(layout.tensor_begin[a], layout.tensors[a].name) <
             std::tie(layout.tensor_begin[b], layout.tensors[b].name);
    });
  }
  return order;
}

// What a load asks, and who it turns away.
struct Asking {
  const std::string& path;
  const PeerPlan& plan;
  const std::vector<CheckpointFile>& files;
  const LoadLayout& layout;
  const std::vector<std::vector<size_t>>& order;
  LoadTally& tally;

  void TurnAway(const std::string& peer, const std::string& why) const {
    tally.PeerFailed(peer);
    LogEvent(LogLevel::kWarning, "peer_content_differs",
             {{"peer", peer}, {"path", path}, {"key", Abbrev(plan.key)}, {"why", why},
              {"action", "not used"}});
  }
  // Why `h` cannot be used (its answer's shape, an empty tensor's digest,
  // a sample), or empty.
  std::string Fault(const PeerHolding& h) const;
};

std::string Asking::Fault(const PeerHolding& h) const {
  bool ok = h.tensor_digests.size() == files.size() &&
            h.sample_digests.size() == plan.samples.size();
  for (size_t i = 0; ok && i < files.size(); ++i) {
    ok = h.tensor_digests[i].size() == order[i].size();
  }
  if (!ok) return "its answer does not fit the files' tensors and samples";
  // An empty tensor's digest is known: a holder saying otherwise lies.
  static const Digest kEmpty = DigestBytes(nullptr, 0);
  for (size_t i = 0; i < files.size(); ++i) {
    for (size_t k = 0; k < order[i].size(); ++k) {
      if (layout.tensors[order[i][k]].length == 0 && h.tensor_digests[i][k] != kEmpty) {
        return "it reports a digest of bytes for an empty tensor";
      }
    }
  }
  if (h.sample_digests == plan.sample_digests) return "";
  size_t k = 0;
  while (h.sample_digests[k] == plan.sample_digests[k]) ++k;
  const CheckpointRange& r = plan.samples[k];
  return absl::StrCat("its bytes at ", files[r.file].path(), " data offset ", r.offset, " (",
                      r.length, " bytes) differ from storage's");
}

// The holders whose answers fit and whose samples match storage's.
std::vector<const PeerHolding*> AskHolders(const Asking& ask, CheckpointPeers& peers,
                                           std::vector<PeerHolding>& found) {
  PeerQuery query;
  query.key = ask.plan.key;
  query.samples = ask.plan.samples;
  query.sample_digests = ask.plan.sample_digests;
  for (const auto& o : ask.order) query.tensors_per_file.push_back(o.size());
  found = peers.FindHolders(query);
  std::vector<const PeerHolding*> usable;
  for (const PeerHolding& h : found) {
    const std::string fault = ask.Fault(h);
    if (fault.empty()) {
      usable.push_back(&h);
    } else {
      ask.TurnAway(h.peer, fault);
    }
  }
  return usable;
}

// Holders that disagree on a digest cannot all be right: the largest group
// that agrees is used (the first found on a tie); the others are turned
// away. Sets the plan's holders, copy and expected digests; null when
// `usable` is empty.
const PeerHolding* ChooseCopy(const Asking& ask, const std::vector<const PeerHolding*>& usable,
                              PeerPlan& plan) {
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
      ask.TurnAway(h->peer, absl::StrCat("its tensor digests differ from those of ", best->peer));
    }
  }
  if (best == nullptr) return nullptr;
  plan.copy = best->copy;
  plan.expected.resize(ask.layout.tensors.size());
  for (size_t i = 0; i < ask.files.size(); ++i) {
    for (size_t k = 0; k < ask.order[i].size(); ++k) {
      plan.expected[ask.order[i][k]] = best->tensor_digests[i][k];
    }
  }
  return best;
}

}  // namespace

absl::StatusOr<PeerPlan> PlanPeers(const std::string& path, const CheckpointLoadOptions& options,
                                   const CheckpointFiles& files, const LoadLayout& layout,
                                   const StorageReader& storage, LoadTally& tally) {
  PeerPlan plan;
  if (options.peers == nullptr) {
    if (options.source == LoadSource::kPeers) {
      return absl::FailedPreconditionError(
          "--source peers: this daemon has no peers (--peers, --peer-dns)");
    }
    return plan;
  }
  plan.key = KeyOf(files);
  WD_RETURN_IF_ERROR(SampleStorage(options, files.files, storage, plan));
  const std::vector<std::vector<size_t>> order = DigestOrder(files.files.size(), layout);
  if (plan.samples.empty()) {
    // No data at all: nothing to ask for (and nothing to show a holder
    // that we hold the same bytes).
    return plan;
  }
  const Asking ask{path, plan, files.files, layout, order, tally};
  std::vector<PeerHolding> found;
  const std::vector<const PeerHolding*> usable = AskHolders(ask, *options.peers, found);
  if (ChooseCopy(ask, usable, plan) == nullptr) {
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
  LogEvent(LogLevel::kInfo, "load_source",
           {{"path", path}, {"source", "peers"}, {"key", Abbrev(plan.key)},
            {"holders", absl::StrJoin(plan.holders, ",")}});
  return plan;
}

std::vector<CheckpointRange> SecretPieces(const std::vector<CheckpointFile>& files,
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
    const uint64_t len = files[i].data_length();
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

PeerRead::PeerRead(const std::string& path, const CheckpointLoadOptions& options,
                   const PeerPlan& plan, const std::vector<CheckpointFile>& files,
                   LoadLayout& layout, const ChunkPlan& chunks, const StorageReader& storage,
                   LoadTally& tally)
    : path_(path),
      options_(options),
      plan_(plan),
      files_(files),
      chunks_(chunks),
      storage_(storage),
      tally_(tally),
      dropped_(std::make_unique<std::atomic<bool>[]>(plan.holders.size())),
      lied_(std::make_unique<std::atomic<bool>[]>(plan.holders.size())),
      supplier_(chunks.chunks.size(), kFromStorage),
      transport_(chunks.chunks.size(), ""),
      unchecked_(chunks.chunks.size(), 0),
      excluded_(chunks.chunks.size()),
      layout_(layout) {
  for (size_t h = 0; h < plan.holders.size(); ++h) dropped_[h] = lied_[h] = false;
}

absl::Status PeerRead::Run() {
  WD_RETURN_IF_ERROR(Fill(FirstPassOrder(), /*count=*/true));
  // Every peer has sent its bytes (it is committed to them) before the
  // places where they are compared with storage's are chosen.
  secret_ = SecretPieces(files_, options_, chunks_.chunks);
  bool trust_storage = false;  // storage disagreed with the holders' digests
  for (size_t round = 0;; ++round) {
    WD_RETURN_IF_ERROR(DigestTensors(layout_, chunks_, options_.read_threads));
    if (trust_storage) break;
    WD_ASSIGN_OR_RETURN(Verdict v, Check());
    if (v.storage_disagrees) {
      WD_RETURN_IF_ERROR(TrustStorage(v.first_bad));
      trust_storage = true;
      continue;
    }
    if (v.redo.empty()) break;
    if (round > 2 * plan_.holders.size() + 2) {
      // Each round drops a holder or keeps a chunk from one: not reached
      // but by a bug. Storage still has the bytes (kAuto).
      if (options_.source == LoadSource::kPeers) {
        return absl::InternalError(
            absl::StrCat("loading ", path_, " from peers did not converge"));
      }
      WD_RETURN_IF_ERROR(AllFromStorage());
      trust_storage = true;
      continue;
    }
    WD_RETURN_IF_ERROR(Fill(std::vector<size_t>(v.redo.begin(), v.redo.end()), /*count=*/false));
  }
  CountSources();
  return absl::OkStatus();
}

std::vector<size_t> PeerRead::FirstPassOrder() const {
  // The first chunk of every group, then the second of each, ...: the
  // streams at work take different groups, so a large tensor's pieces
  // (one group, one holder) do not keep them all on one holder.
  const std::vector<Chunk>& chunks = chunks_.chunks;
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
  return todo;
}

absl::Status PeerRead::Fill(const std::vector<size_t>& todo, bool count) {
  return ParallelFor(nullptr, todo.size(), std::max(1, options_.peer_streams),
                     [&](size_t k) { return FillChunk(todo[k], count); });
}

absl::Status PeerRead::FillChunk(size_t ci, bool count) {
  const Chunk& c = chunks_.chunks[ci];
  const CheckpointFile& f = files_[c.file];
  WD_RETURN_IF_ERROR(CancelledStatus(options_.cancel));
  WD_RETURN_IF_ERROR_CTX(PopulateForWrite(c.dest, c.length), "loading ", f.path());
  absl::Status last;
  for (size_t h : RendezvousOrder(plan_.holders, plan_.key, c.group)) {
    if (dropped_[h] || std::find(excluded_[ci].begin(), excluded_[ci].end(),
                                 static_cast<int>(h)) != excluded_[ci].end()) {
      continue;
    }
    const CheckpointRange range{static_cast<uint32_t>(c.file), c.data_begin, c.length};
    const char* transport = "";
    absl::Status s = options_.peers->ReadRange(plan_.holders[h], plan_.key, plan_.copy, range,
                                               c.dest, &transport);
    if (s.ok()) {
      supplier_[ci] = static_cast<int>(h);
      transport_[ci] = transport;
      unchecked_[ci] = 1;
      // Discarded until the load keeps them (counted at its end).
      tally_.PeerSent(c.length, f.path(), plan_.holders[h], transport, count);
      return absl::OkStatus();
    }
    Drop(h, s, "peer_read_failed");
    last = s;
  }
  if (options_.source == LoadSource::kPeers) {
    return absl::UnavailableError(absl::StrCat(
        "--source peers: no peer holding ", path_, " could supply ", f.path(), " bytes ",
        c.file_offset, "..", c.file_offset + c.length, " (",
        last.ok() ? "every holder was dropped or sent wrong bytes" : last.ToString(), ")"));
  }
  supplier_[ci] = kFromStorage;
  unchecked_[ci] = 0;
  return storage_.ReadChunk(c, count);
}

void PeerRead::Drop(size_t h, const absl::Status& why, const char* event) {
  if (why.code() == absl::StatusCode::kDataLoss) lied_[h] = true;
  if (dropped_[h].exchange(true)) return;
  tally_.PeerFailed(plan_.holders[h]);
  LogEvent(LogLevel::kWarning, event,
           {{"peer", plan_.holders[h]}, {"path", path_}, {"error", why.ToString()},
            {"action", "dropped from this load; its ranges come from other holders or "
                       "storage"}});
}

absl::StatusOr<PeerRead::Verdict> PeerRead::Check() {
  // Wrong bytes: a tensor that misses its digest, a sample that differs
  // from storage's. Whoever supplied them is dropped; they are fetched
  // again.
  Verdict v;
  const std::vector<StoredTensor>& tensors = layout_.tensors;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].digest != plan_.expected[i]) {
      Blame(chunks_.Under(layout_.tensor_file[i], layout_.tensor_begin[i], tensors[i].length),
            absl::StrCat("tensor \"", tensors[i].name, "\" (", tensors[i].file, ")"), v);
    }
  }
  for (size_t k = 0; k < plan_.samples.size(); ++k) {
    const CheckpointRange& r = plan_.samples[k];
    const uint8_t* got = chunks_.file_data[r.file] + r.offset;
    if (DigestBytes(got, r.length) != plan_.sample_digests[k]) {
      Blame(chunks_.Under(r.file, r.offset, r.length),
            absl::StrCat(files_[r.file].path(), " data offset ", r.offset), v);
    }
  }
  // The bytes themselves against storage's, where the peers could not
  // know (whatever digests they reported for them).
  WD_ASSIGN_OR_RETURN(std::vector<size_t> differ, CompareWithStorage());
  for (size_t k : differ) {
    const CheckpointRange& r = secret_[k];
    Blame(chunks_.Under(r.file, r.offset, r.length),
          absl::StrCat(files_[r.file].path(), " data offset ", r.offset, " (", r.length,
                       " bytes, compared with storage's)"),
          v);
  }
  // A peer caught sending wrong bytes is trusted for none of them: its
  // other bytes may agree with digests it made up for them.
  for (size_t ci = 0; ci < supplier_.size() && !v.storage_disagrees; ++ci) {
    if (supplier_[ci] != kFromStorage && lied_[supplier_[ci]]) v.redo.insert(ci);
  }
  return v;
}

void PeerRead::Blame(const std::vector<size_t>& under, const std::string& what, Verdict& v) {
  // One peer sent the wrong bytes: it is dropped. Several (a group split
  // by a holder dropped midway, a sample across groups): none is blamed,
  // but each of their chunks comes from another source next.
  std::set<int> peers;
  for (size_t ci : under) {
    if (supplier_[ci] != kFromStorage) peers.insert(supplier_[ci]);
  }
  if (peers.empty()) {
    v.storage_disagrees = true;
    if (v.first_bad.empty()) v.first_bad = what;
    return;
  }
  if (peers.size() == 1) {
    Drop(static_cast<size_t>(*peers.begin()),
         absl::DataLossError(absl::StrCat("its bytes of ", what, " are wrong")), "peer_data_loss");
  }
  // A peer dropped already (for wrong bytes elsewhere) is presumed the
  // culprit; else every chunk avoids the peer that sent it.
  bool culprit = false;
  for (int p : peers) culprit = culprit || dropped_[p];
  for (size_t ci : under) {
    if (supplier_[ci] == kFromStorage) continue;
    if (culprit && !dropped_[supplier_[ci]]) continue;
    if (!culprit) excluded_[ci].push_back(supplier_[ci]);
    v.redo.insert(ci);
  }
}

absl::StatusOr<std::vector<size_t>> PeerRead::CompareWithStorage() {
  // The secret pieces over chunks a peer filled since the last check, read
  // from storage and compared with what the peer sent: the pieces that
  // differ.
  std::vector<size_t> differ;
  absl::Mutex differ_mu;
  WD_RETURN_IF_ERROR(ParallelFor(nullptr, secret_.size(), options_.read_threads,
                                 [&](size_t k) -> absl::Status {
    const CheckpointRange& r = secret_[k];
    bool from_peer = false;
    for (size_t ci : chunks_.Under(r.file, r.offset, r.length)) {
      from_peer = from_peer || unchecked_[ci];
    }
    if (!from_peer) return absl::OkStatus();
    std::string buf(r.length, '\0');
    WD_RETURN_IF_ERROR(storage_.ReadData(r.file, r.offset, r.length, buf.data()));
    const uint8_t* got = chunks_.file_data[r.file] + r.offset;
    if (std::memcmp(buf.data(), got, r.length) != 0) {
      absl::MutexLock d(&differ_mu);
      differ.push_back(k);
    }
    return absl::OkStatus();
  }));
  std::fill(unchecked_.begin(), unchecked_.end(), 0);
  std::sort(differ.begin(), differ.end());
  return differ;
}

absl::Status PeerRead::TrustStorage(const std::string& first_bad) {
  // Storage's bytes are what the files say: the holders' digests are not
  // those of these files.
  if (options_.source == LoadSource::kPeers) {
    return absl::DataLossError(absl::StrCat(
        "--source peers: storage's bytes of ", first_bad,
        " differ from every holder's digest; the peers hold other content"));
  }
  LogEvent(LogLevel::kWarning, "peer_content_differs",
           {{"path", path_}, {"holders", absl::StrJoin(plan_.holders, ",")},
            {"why", absl::StrCat("storage's bytes of ", first_bad,
                                 " do not match their digests")},
            {"action", "reading everything from storage"}});
  return AllFromStorage();
}

absl::Status PeerRead::AllFromStorage() {
  // Every holder dropped, what they sent read from storage again.
  for (size_t h = 0; h < plan_.holders.size(); ++h) dropped_[h] = true;
  std::vector<size_t> peer_chunks;
  for (size_t ci = 0; ci < supplier_.size(); ++ci) {
    if (supplier_[ci] != kFromStorage) peer_chunks.push_back(ci);
  }
  return Fill(peer_chunks, /*count=*/false);
}

void PeerRead::CountSources() {
  // Per holder that supplied kept bytes: the transports that carried them.
  std::map<int, std::set<std::string>> used;
  for (size_t ci = 0; ci < supplier_.size(); ++ci) {
    const uint64_t length = chunks_.chunks[ci].length;
    if (supplier_[ci] == kFromStorage) {
      sources_.bytes_from_storage += length;
    } else {
      sources_.bytes_from_peers += length;
      kept_by_peer_[plan_.holders[supplier_[ci]]] += length;
      std::set<std::string>& over = used[supplier_[ci]];
      if (*transport_[ci] != '\0') over.insert(transport_[ci]);
    }
  }
  for (const auto& [h, over] : used) {
    sources_.peers.push_back(plan_.holders[h]);
    sources_.peer_transports.push_back(absl::StrJoin(over, "+"));
  }
  LogEvent(LogLevel::kInfo, "load_sources",
           {{"path", path_}, {"from_peers", absl::StrCat(sources_.bytes_from_peers)},
            {"from_storage", absl::StrCat(sources_.bytes_from_storage)},
            {"peers", absl::StrJoin(sources_.peers, ",")},
            {"transports", absl::StrJoin(sources_.peer_transports, ",")}});
}

}  // namespace weightd
