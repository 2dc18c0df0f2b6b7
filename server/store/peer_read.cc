#include "server/store/peer_read.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "server/base/log.h"
#include "common/status_macros.h"
#include "server/base/thread_pool.h"

namespace weightd {
namespace {


std::string Abbrev(const Digest& d) { return d.Hex().substr(0, 12); }

// Storage samples at random places each load: a peer cannot have prepared
// for them. (It sees them in the question, though: they pick its copy and
// turn away peers with other bytes early; what checks its bytes is
// SecretPieces.)
absl::Status SampleStorage(const CheckpointLoadOptions& options,
                           const std::vector<CheckpointFile>& files, const StorageReader& storage,
                           PeerPlan& plan) {
  std::mt19937_64 rng(std::random_device{}());
  const uint64_t piece = std::clamp<uint64_t>(options.peer_sample_bytes, 1, kMaxPeerSampleBytes);
  const uint64_t per_file = std::max<uint64_t>(
      1, std::min<uint64_t>(options.peer_samples_per_file,
                            kMaxPeerSamples / std::max<size_t>(1, files.size())));
  for (size_t i = 0; i < files.size(); ++i) {
    const uint64_t len = files[i].data_length();
    if (len == 0) continue;
    if (len <= piece * per_file) {
      for (uint64_t off = 0; off < len && plan.samples.size() < kMaxPeerSamples; off += piece) {
        plan.samples.push_back({static_cast<uint32_t>(i), off, std::min(piece, len - off)});
      }
    } else {
      for (uint64_t k = 0; k < per_file && plan.samples.size() < kMaxPeerSamples; ++k) {
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
  LoadSource source = LoadSource::kAuto;
  PeerPlan* plan_out = nullptr;  // where AskHolders puts partial holders

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
  if (h.partial) {
    if (!h.tensor_digests.empty() || h.sample_digests.size() != plan.samples.size() ||
        h.sample_known.size() != plan.samples.size()) {
      return "its answer (still loading) does not fit the files' samples";
    }
    for (const CheckpointRange& r : h.available) {
      if (r.file >= files.size() || r.offset > files[r.file].data_length() ||
          r.length > files[r.file].data_length() - r.offset) {
        return "it names ranges outside the files";
      }
    }
    for (size_t k = 0; k < plan.samples.size(); ++k) {
      if (!h.sample_known[k] || h.sample_digests[k] == plan.sample_digests[k]) continue;
      const CheckpointRange& r = plan.samples[k];
      return absl::StrCat("its bytes at ", files[r.file].path(), " data offset ", r.offset, " (",
                          r.length, " bytes) differ from storage's");
    }
    return "";
  }
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

// A partial holder's refusal that is no fault: its load ended (or failed)
// since it answered (NOT_FOUND), or it is busy serving others
// (RESOURCE_EXHAUSTED).
bool PartialRefusal(bool partial, const absl::Status& s) {
  return partial && (s.code() == absl::StatusCode::kNotFound ||
                     s.code() == absl::StatusCode::kResourceExhausted);
}

// What a load asks its peers: who holds `plan.key`, with these samples.
PeerQuery QueryFor(const PeerPlan& plan, const std::vector<std::vector<size_t>>& order) {
  PeerQuery query;
  query.key = plan.key;
  query.samples = plan.samples;
  query.sample_digests = plan.sample_digests;
  for (const auto& o : order) query.tensors_per_file.push_back(o.size());
  return query;
}

// The holders whose answers fit and whose samples match storage's.
std::vector<const PeerHolding*> AskHolders(const Asking& ask, CheckpointPeers& peers,
                                           std::vector<PeerHolding>& found) {
  found = peers.FindHolders(QueryFor(ask.plan, ask.order));
  std::vector<const PeerHolding*> usable;
  for (const PeerHolding& h : found) {
    const std::string fault = ask.Fault(h);
    if (fault.empty() && h.partial) {
      // Loading it too: kept aside (kAuto), its bytes checked as they come.
      if (ask.source == LoadSource::kAuto) ask.plan_out->partial.push_back(h);
    } else if (fault.empty()) {
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

Digest CheckpointKeyOf(const CheckpointFiles& files) {
  std::vector<CheckpointFileId> ids;
  for (size_t i = 0; i < files.files.size(); ++i) {
    ids.push_back({files.names[i], files.files[i].size(), files.files[i].header_digest});
  }
  return CheckpointKey(ids);
}

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
  plan.key = CheckpointKeyOf(files);
  WD_RETURN_IF_ERROR(SampleStorage(options, files.files, storage, plan));
  const std::vector<std::vector<size_t>> order = DigestOrder(files.files.size(), layout);
  if (plan.samples.empty()) {
    // No data at all: nothing to ask for (and nothing to show a holder
    // that we hold the same bytes).
    return plan;
  }
  const Asking ask{path, plan, files.files, layout, order, tally, options.source, &plan};
  std::vector<PeerHolding> found;
  const std::vector<const PeerHolding*> usable = AskHolders(ask, *options.peers, found);
  // Through PeerRead even with no holder: loaders that start together
  // find each other there, and share out storage's reads.
  plan.swarm = options.source == LoadSource::kAuto;
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
                         : !plan.partial.empty() ? "peers are loading the files too"
                                                 : "no peer holds the same bytes"},
              {"loading_peers", absl::StrCat(plan.partial.size())}});
    return plan;
  }
  LogEvent(LogLevel::kInfo, "load_source",
           {{"path", path}, {"source", "peers"}, {"key", Abbrev(plan.key)},
            {"holders", absl::StrJoin(plan.holders, ",")},
            {"loading_peers", absl::StrCat(plan.partial.size())}});
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
  const uint64_t piece = std::clamp<uint64_t>(options.peer_sample_bytes, 1, kMaxPeerSampleBytes);
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

uint64_t RendezvousScore(const Digest& key, const std::string& holder, size_t chunk) {
  const std::string seed = absl::StrCat(key.View(), "|", holder, "|", chunk);
  const Digest d = DigestBytes(seed.data(), seed.size());
  uint64_t score;
  std::memcpy(&score, d.bytes.data(), sizeof(score));
  return score;
}

std::vector<size_t> RendezvousOrder(const std::vector<std::string>& holders, const Digest& key,
                                    size_t chunk) {
  std::vector<std::pair<uint64_t, size_t>> scored;
  for (size_t h = 0; h < holders.size(); ++h) {
    scored.emplace_back(RendezvousScore(key, holders[h], chunk), h);
  }
  std::sort(scored.rbegin(), scored.rend());
  std::vector<size_t> out;
  for (const auto& [score, h] : scored) out.push_back(h);
  return out;
}

PeerRead::PeerRead(const std::string& path, const CheckpointLoadOptions& options,
                   const PeerPlan& plan, const std::vector<CheckpointFile>& files,
                   LoadLayout& layout, const ChunkPlan& chunks, const StorageReader& storage,
                   LoadTally& tally, LoadingCopy* own)
    : path_(path),
      options_(options),
      plan_(plan),
      files_(files),
      chunks_(chunks),
      storage_(storage),
      own_(own),
      self_id_(own != nullptr ? own->copy().Hex() : absl::StrCat("self:", RandomDigest().Hex())),
      order_(DigestOrder(files.size(), layout)),
      first_order_(),
      tally_(tally),
      supplier_(chunks.chunks.size(), kFromStorage),
      transport_(chunks.chunks.size(), ""),
      unchecked_(chunks.chunks.size(), 0),
      excluded_(chunks.chunks.size()),
      layout_(layout) {
  absl::MutexLock lock(&mu_);
  for (const std::string& peer : plan.holders) {
    Holder h;
    h.peer = peer;
    h.copy = plan.copy;
    h.id = peer;
    holders_.push_back(std::move(h));
  }
  for (const PeerHolding& p : plan.partial) AddHolder(p);
  expected_ = plan.expected;
}

absl::Status PeerRead::Run() {
  WD_RETURN_IF_ERROR(FirstPass());
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
    size_t holders;
    {
      absl::MutexLock lock(&mu_);
      holders = holders_.size();
    }
    if (round > 2 * holders + 2) {
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

void PeerRead::AddHolder(const PeerHolding& p) {
  Holder h;
  h.peer = p.peer;
  h.copy = p.copy;
  h.partial = p.partial;
  h.id = p.partial ? p.copy.Hex() : p.peer;
  h.have = RangesOf(p);
  h.progressed = absl::Now();
  holders_.push_back(std::move(h));
}

ByteRanges PeerRead::RangesOf(const PeerHolding& p) const {
  ByteRanges have(files_.size());
  for (const CheckpointRange& r : p.available) have.Add(r.file, r.offset, r.length);
  return have;
}

bool PeerRead::Has(const Holder& h, const Chunk& c) const {
  return !h.partial || h.have.Covers(c.file, c.data_begin, c.length);
}

int PeerRead::Supplier(size_t ci) const {
  const Chunk& c = chunks_.chunks[ci];
  int best = -1;
  uint64_t best_score = 0;
  for (size_t h = 0; h < holders_.size(); ++h) {
    const Holder& holder = holders_[h];
    if (holder.dropped || !holder.present || holder.unreadable || !Has(holder, c) ||
        std::find(excluded_[ci].begin(), excluded_[ci].end(), static_cast<int>(h)) !=
            excluded_[ci].end()) {
      continue;
    }
    // A complete holder by group (a tensor's pieces from one holder); a
    // partial one by chunk, as chunks are owned.
    const uint64_t score = RendezvousScore(plan_.key, holder.id, holder.partial ? ci : c.group);
    if (best < 0 || score > best_score) best = static_cast<int>(h), best_score = score;
  }
  return best;
}

void PeerRead::UpdateOwners() {
  // The loads reading storage now: this one and the partial holders still
  // answering and still reading new ranges. Each chunk's group goes to the
  // one scoring highest, as every one of them computes it.
  std::vector<const std::string*> ids = {&self_id_};
  const absl::Time now = absl::Now();
  for (const Holder& h : holders_) {
    if (h.partial && h.present && !h.dropped && now - h.progressed < options_.peer_patience) {
      ids.push_back(&h.id);
    }
  }
  // The loads reading storage together read with as many streams in all
  // as one load alone: each of P with read_threads / P (at least one), so
  // its chunks land one after another for the others to take, not all at
  // the end. A load whose plan saw no one reads with one stream until its
  // first refresh (holders_ has no partial holder before it either).
  const int threads = std::max(1, options_.read_threads);
  const int participants = static_cast<int>(ids.size());
  storage_width_ = refreshed_ ? std::max(1, (threads + participants - 1) / participants) : 1;
  // By chunk, not group (a large tensor's pieces are shared out too), and
  // in turn over the loads sorted by id, from a place the key picks: each
  // owns as many chunks as any other (within one), since each owner's
  // link then sends its chunks to every other load.
  std::sort(ids.begin(), ids.end(), [](const std::string* a, const std::string* b) {
    return *a < *b;
  });
  const size_t self = static_cast<size_t>(
      std::find_if(ids.begin(), ids.end(), [&](const std::string* id) { return id == &self_id_; }) -
      ids.begin());
  const size_t start = RendezvousScore(plan_.key, "owners", 0) % ids.size();
  mine_.assign(chunks_.chunks.size(), 0);
  for (size_t ci = 0; ci < chunks_.chunks.size(); ++ci) {
    mine_[ci] = (start + ci) % ids.size() == self;
  }
}

absl::Status PeerRead::FirstPass() {
  first_order_ = FirstPassOrder();

  {
    absl::MutexLock lock(&mu_);
    state_.assign(chunks_.chunks.size(), kTodo);
    remaining_ = chunks_.chunks.size();
    waiting_since_.assign(chunks_.chunks.size(), absl::InfiniteFuture());
    // Alone as far as the plan saw (others may be starting as it asked):
    // one storage stream until the first refresh.
    refreshed_ = !(plan_.partial.empty() && plan_.holders.empty());
    UpdateOwners();
  }
  const bool from_storage = options_.source != LoadSource::kPeers;
  std::vector<std::thread> threads;
  for (int i = 0; i < std::max(1, options_.peer_streams); ++i) {
    threads.emplace_back([this] { Worker(/*storage=*/false); });
  }
  for (int i = 0; from_storage && i < std::max(1, options_.read_threads); ++i) {
    threads.emplace_back([this] { Worker(/*storage=*/true); });
  }
  // Meanwhile, while loads of the same files may come or go (kAuto): the
  // peers asked again, less often while nothing changes.
  // The first time soon: loads that started together see each other.
  absl::Duration every = std::min(options_.peer_refresh, absl::Milliseconds(100));
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      const absl::Time until = absl::Now() + every;
      while (remaining_ > 0 && failed_.ok() && absl::Now() < until) {
        changed_.WaitWithDeadline(&mu_, until);
      }
      if (remaining_ == 0 || !failed_.ok()) break;
      if (absl::Status c = CancelledStatus(options_.cancel); !c.ok()) {
        failed_ = c;  // the workers waiting see it
        changed_.SignalAll();
        break;
      }
      if (!from_storage || !plan_.swarm) continue;
    }
    const bool news = Refresh();
    bool waiting = false;  // for chunks another load is to read
    {
      absl::MutexLock lock(&mu_);
      for (size_t ci = 0; ci < state_.size() && !waiting; ++ci) {
        waiting = state_[ci] == kTodo && !mine_[ci] && Supplier(ci) < 0;
      }
    }
    every = news || waiting ? options_.peer_refresh
                            : std::min(2 * every, 16 * options_.peer_refresh);
  }
  for (std::thread& t : threads) t.join();
  absl::MutexLock lock(&mu_);
  return failed_;
}

std::pair<long, int> PeerRead::Take(bool storage) {
  absl::MutexLock lock(&mu_);
  for (;;) {
    if (remaining_ == 0 || !failed_.ok()) return {-1, 0};
    if (absl::Status c = CancelledStatus(options_.cancel); !c.ok()) {
      failed_ = c;
      changed_.SignalAll();
      return {-1, 0};
    }
    bool waiting = false;  // a chunk no one can supply yet
    // Past the chunks done (the order's prefix), once.
    while (first_todo_ < first_order_.size() && state_[first_order_[first_todo_]] == kDone) {
      ++first_todo_;
    }
    const absl::Time now = absl::Now();
    long overdue = -1;  // another load's chunk waited for past patience
    for (size_t k = first_todo_; k < first_order_.size(); ++k) {
      const size_t ci = first_order_[k];
      if (state_[ci] != kTodo) continue;
      if (storage) {
        // At its width a storage reader takes nothing; its own chunks
        // only where no peer has them.
        if (storage_busy_ >= storage_width_) break;
        if (!mine_[ci] &&
            (waiting_since_[ci] > now - 3 * options_.peer_patience || overdue >= 0)) {
          continue;
        }
        if (Supplier(ci) >= 0) continue;
        if (!mine_[ci]) {
          overdue = static_cast<long>(ci);
          continue;
        }
        state_[ci] = kInFlight;
        ++storage_busy_;
        return {static_cast<long>(ci), kFromStorage};
      }
      const int h = Supplier(ci);
      if (h >= 0) {
        state_[ci] = kInFlight;
        return {static_cast<long>(ci), h};
      }
      if (!mine_[ci] && waiting_since_[ci] == absl::InfiniteFuture()) waiting_since_[ci] = now;
      waiting = true;
    }
    if (storage && overdue >= 0 && storage_busy_ < storage_width_) {
      // Its owner has not offered it for 3 x peer_patience (slow, stuck
      // or lying about its progress): read here.
      state_[overdue] = kInFlight;
      ++storage_busy_;
      return {overdue, kFromStorage};
    }
    if (!storage && waiting && options_.source == LoadSource::kPeers) {
      // Every holder gone: nothing will supply it.
      bool any = false;
      for (const Holder& h : holders_) any = any || (!h.dropped && h.present);
      if (!any) {
        failed_ = absl::UnavailableError(absl::StrCat(
            "--source peers: no peer holding ", path_,
            " could supply the rest of it (every holder was dropped or sent wrong bytes)"));
        changed_.SignalAll();
        return {-1, 0};
      }
    }
    changed_.Wait(&mu_);
  }
}

void PeerRead::Worker(bool storage) {
  for (;;) {
    const auto [ci_signed, h] = Take(storage);
    if (ci_signed < 0) return;
    const size_t ci = static_cast<size_t>(ci_signed);
    const Chunk& c = chunks_.chunks[ci];
    absl::Status s;
    if (h == kFromStorage) {
      s = ReadOwn(ci, /*count=*/true);
      absl::MutexLock lock(&mu_);
      --storage_busy_;
    } else {
      std::string peer;
      Digest copy;
      bool partial;
      {
        absl::MutexLock lock(&mu_);
        peer = holders_[h].peer;
        copy = holders_[h].copy;
        partial = holders_[h].partial;
      }
      s = PopulateForWrite(c.dest, c.length);
      bool retry = false;  // the chunk goes back to be taken again
      if (s.ok()) {
        s = ReadFrom(ci, h, peer, copy, /*count=*/true);
        if (s.ok() || OwnCancel(s)) {
          // Read; or the load's own cancel: it fails.
        } else if (PartialRefusal(partial, s)) {
          // It answers again as what it is now at the next refresh; still
          // an owner of its chunks until the answers say otherwise (a load
          // that ended answers as a complete holder next).
          absl::MutexLock lock(&mu_);
          holders_[h].unreadable = true;
          retry = true;
        } else {
          Drop(static_cast<size_t>(h), s, "peer_read_failed");
          retry = true;
        }
      }
      if (retry) {
        absl::MutexLock lock(&mu_);
        state_[ci] = kTodo;
        changed_.SignalAll();
        continue;
      }
    }
    absl::MutexLock lock(&mu_);
    if (!s.ok()) {
      if (failed_.ok()) failed_ = s;
    } else {
      state_[ci] = kDone;
      --remaining_;
    }
    changed_.SignalAll();
  }
}

bool PeerRead::Refresh() {
  std::vector<PeerHolding> found = options_.peers->FindHolders(QueryFor(plan_, order_));
  // Checked before the lock (they only read the plan).
  std::vector<std::string> faults;
  for (const PeerHolding& p : found) faults.push_back(Fault(p));
  absl::MutexLock lock(&mu_);
  bool news = false;
  for (Holder& h : holders_) h.present = false;
  for (size_t i = 0; i < found.size(); ++i) {
    const PeerHolding& p = found[i];
    if (refused_.count({p.peer, p.copy})) continue;
    std::string fault = faults[i];
    if (fault.empty() && !p.partial) {
      if (expected_.empty()) {
        // The first complete holder: its digests are what every tensor is
        // checked against at the end.
        expected_.resize(layout_.tensors.size());
        for (size_t f = 0; f < order_.size(); ++f) {
          for (size_t k = 0; k < order_[f].size(); ++k) {
            expected_[order_[f][k]] = p.tensor_digests[f][k];
          }
        }
      } else {
        for (size_t f = 0; f < order_.size() && fault.empty(); ++f) {
          for (size_t k = 0; k < order_[f].size() && fault.empty(); ++k) {
            if (expected_[order_[f][k]] != p.tensor_digests[f][k]) {
              fault = "its tensor digests differ from those this load checks against";
            }
          }
        }
      }
    }
    if (!fault.empty()) {
      refused_.insert({p.peer, p.copy});
      TurnAway(p.peer, fault);
      continue;
    }
    auto it = std::find_if(holders_.begin(), holders_.end(), [&](const Holder& h) {
      return h.peer == p.peer && h.copy == p.copy;
    });
    if (it == holders_.end()) {
      AddHolder(p);
      news = true;
      continue;
    }
    it->present = true;
    it->unreadable = false;
    if (!it->partial) continue;
    ByteRanges have = RangesOf(p);
    if (have.bytes() != it->have.bytes()) {
      news = true;
      it->progressed = absl::Now();
    }
    it->have = std::move(have);
  }
  refreshed_ = true;
  UpdateOwners();
  changed_.SignalAll();
  return news;
}

std::string PeerRead::Fault(const PeerHolding& h) const {
  const Asking ask{path_, plan_, files_, layout_, order_, tally_};
  return ask.Fault(h);
}

void PeerRead::TurnAway(const std::string& peer, const std::string& why) const {
  const Asking ask{path_, plan_, files_, layout_, order_, tally_};
  ask.TurnAway(peer, why);
}

absl::Status PeerRead::Fill(const std::vector<size_t>& todo, bool count) {
  return ParallelFor(nullptr, todo.size(), std::max(1, options_.peer_streams),
                     [&](size_t k) { return FillChunk(todo[k], count); });
}

absl::Status PeerRead::ReadOwn(size_t ci, bool count) {
  const Chunk& c = chunks_.chunks[ci];
  supplier_[ci] = kFromStorage;
  unchecked_[ci] = 0;
  WD_RETURN_IF_ERROR(storage_.ReadChunk(c, count));
  if (own_ != nullptr) own_->MarkRead(c.file, c.data_begin, c.length);
  return absl::OkStatus();
}

bool PeerRead::OwnCancel(const absl::Status& s) const {
  return s.code() == absl::StatusCode::kCancelled && options_.cancel != nullptr &&
         options_.cancel->cancelled();
}

absl::Status PeerRead::ReadFrom(size_t ci, int h, const std::string& peer, const Digest& copy,
                              bool count) {
  const Chunk& c = chunks_.chunks[ci];
  const CheckpointRange range{static_cast<uint32_t>(c.file), c.data_begin, c.length};
  const char* transport = "";
  WD_RETURN_IF_ERROR(options_.peers->ReadRange(peer, plan_.key, copy, range, c.dest, &transport));
  supplier_[ci] = h;
  transport_[ci] = transport;
  unchecked_[ci] = 1;
  // Discarded until the load keeps them (counted at its end).
  tally_.PeerSent(c.length, files_[c.file].path(), peer, transport, count);
  return absl::OkStatus();
}

absl::Status PeerRead::FillChunk(size_t ci, bool count) {
  const Chunk& c = chunks_.chunks[ci];
  const CheckpointFile& f = files_[c.file];
  WD_RETURN_IF_ERROR(CancelledStatus(options_.cancel));
  WD_RETURN_IF_ERROR_CTX(PopulateForWrite(c.dest, c.length), "loading ", f.path());
  absl::Status last;
  for (;;) {
    int h;
    std::string peer;
    Digest copy;
    bool partial;
    {
      absl::MutexLock lock(&mu_);
      h = Supplier(ci);
      if (h < 0) break;
      peer = holders_[h].peer;
      copy = holders_[h].copy;
      partial = holders_[h].partial;
    }
    const absl::Status s = ReadFrom(ci, h, peer, copy, count);
    if (s.ok() || OwnCancel(s)) return s;
    if (PartialRefusal(partial, s)) {
      // Not asked again in this load (later rounds do not refresh).
      absl::MutexLock lock(&mu_);
      holders_[h].unreadable = true;
    } else {
      Drop(static_cast<size_t>(h), s, "peer_read_failed");
    }
    last = s;
  }
  if (options_.source == LoadSource::kPeers) {
    return absl::UnavailableError(absl::StrCat(
        "--source peers: no peer holding ", path_, " could supply ", f.path(), " bytes ",
        c.file_offset, "..", c.file_offset + c.length, " (",
        last.ok() ? "every holder was dropped or sent wrong bytes" : last.ToString(), ")"));
  }
  return ReadOwn(ci, count);
}

void PeerRead::Drop(size_t h, const absl::Status& why, const char* event) {
  std::string peer;
  {
    absl::MutexLock lock(&mu_);
    Holder& holder = holders_[h];
    if (why.code() == absl::StatusCode::kDataLoss) holder.lied = true;
    if (holder.dropped) return;
    holder.dropped = true;
    peer = holder.peer;
    UpdateOwners();
    changed_.SignalAll();
  }
  tally_.PeerFailed(peer);
  LogEvent(LogLevel::kWarning, event,
           {{"peer", peer}, {"path", path_}, {"error", why.ToString()},
            {"action", "dropped from this load; its ranges come from other holders or "
                       "storage"}});
}

absl::StatusOr<PeerRead::Verdict> PeerRead::Check() {
  // Wrong bytes: a tensor that misses its digest, a sample that differs
  // from storage's. Whoever supplied them is dropped; they are fetched
  // again.
  Verdict v;
  std::vector<Digest> expected;
  {
    absl::MutexLock lock(&mu_);
    expected = expected_;
  }
  const std::vector<StoredTensor>& tensors = layout_.tensors;
  for (size_t i = 0; i < tensors.size() && !expected.empty(); ++i) {
    if (tensors[i].digest != expected[i]) {
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
  absl::MutexLock lock(&mu_);
  for (size_t ci = 0; ci < supplier_.size() && !v.storage_disagrees; ++ci) {
    if (supplier_[ci] != kFromStorage && holders_[supplier_[ci]].lied) v.redo.insert(ci);
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
  absl::MutexLock lock(&mu_);
  bool culprit = false;
  for (int p : peers) culprit = culprit || holders_[p].dropped;
  for (size_t ci : under) {
    if (supplier_[ci] == kFromStorage) continue;
    if (culprit && !holders_[supplier_[ci]].dropped) continue;
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
  std::vector<std::string> peers;
  {
    absl::MutexLock lock(&mu_);
    for (const Holder& h : holders_) peers.push_back(h.peer);
  }
  LogEvent(LogLevel::kWarning, "peer_content_differs",
           {{"path", path_}, {"holders", absl::StrJoin(peers, ",")},
            {"why", absl::StrCat("storage's bytes of ", first_bad,
                                 " do not match their digests")},
            {"action", "reading everything from storage"}});
  return AllFromStorage();
}

absl::Status PeerRead::AllFromStorage() {
  // Every holder dropped, what they sent read from storage again.
  {
    absl::MutexLock lock(&mu_);
    for (Holder& h : holders_) h.dropped = true;
  }
  std::vector<size_t> peer_chunks;
  for (size_t ci = 0; ci < supplier_.size(); ++ci) {
    if (supplier_[ci] != kFromStorage) peer_chunks.push_back(ci);
  }
  return Fill(peer_chunks, /*count=*/false);
}

void PeerRead::CountSources() {
  // Per holder that supplied kept bytes: the transports that carried them.
  std::map<int, std::set<std::string>> used;
  absl::MutexLock lock(&mu_);
  for (size_t ci = 0; ci < supplier_.size(); ++ci) {
    const uint64_t length = chunks_.chunks[ci].length;
    if (supplier_[ci] == kFromStorage) {
      sources_.bytes_from_storage += length;
    } else {
      sources_.bytes_from_peers += length;
      kept_by_peer_[holders_[supplier_[ci]].peer] += length;
      std::set<std::string>& over = used[supplier_[ci]];
      if (*transport_[ci] != '\0') over.insert(transport_[ci]);
    }
  }
  // By peer address (a daemon that was partial, then complete, is one).
  std::map<std::string, std::set<std::string>> by_peer;
  for (const auto& [h, over] : used) by_peer[holders_[h].peer].insert(over.begin(), over.end());
  for (const auto& [peer, over] : by_peer) {
    sources_.peers.push_back(peer);
    sources_.peer_transports.push_back(absl::StrJoin(over, "+"));
  }
  LogEvent(LogLevel::kInfo, "load_sources",
           {{"path", path_}, {"from_peers", absl::StrCat(sources_.bytes_from_peers)},
            {"from_storage", absl::StrCat(sources_.bytes_from_storage)},
            {"peers", absl::StrJoin(sources_.peers, ",")},
            {"transports", absl::StrJoin(sources_.peer_transports, ",")}});
}

}  // namespace weightd
