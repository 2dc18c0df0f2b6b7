#include "server/fleet/peer_checkpoint_client.h"

#include <algorithm>
#include <chrono>
#include <memory>

#include <grpcpp/client_context.h>

#include "absl/strings/str_cat.h"
#include "common/digest.h"
#include "common/grpc/chunk_stream.h"
#include "common/grpc/status_convert.h"
#include "server/base/log.h"
#include "server/base/thread_pool.h"

namespace weightd {
namespace {

// Logs why `peer`'s answer to the question on `key_hex` is not used.
void Refuse(const std::string& peer, const std::string& key_hex, const std::string& why) {
  LogEvent(LogLevel::kWarning, "peer_find_failed",
           {{"peer", peer}, {"key", key_hex}, {"error", why}, {"action", "not asked for bytes"}});
}

// Why `resp` is not shaped as a true answer to `query` (this daemon's own
// headers say how many tensors each file has), or "" when it is.
std::string ShapeError(const v1::FindCheckpointResponse& resp, const PeerQuery& query) {
  const size_t files = query.tensors_per_file.size();
  if (resp.partial()) {
    // Still loading: no tensor digests, a digest or nothing per sample, at
    // most kMaxPartialRanges ranges, each inside a file of the checkpoint.
    if (resp.tensor_digests_size() != 0 ||
        static_cast<size_t>(resp.sample_digests_size()) != query.samples.size() ||
        resp.copy().size() != 16 || static_cast<size_t>(resp.available_size()) > kMaxPartialRanges ||
        std::any_of(resp.sample_digests().begin(), resp.sample_digests().end(),
                    [](const std::string& d) { return !d.empty() && d.size() != 16; })) {
      return absl::StrCat("its answer (still loading) has ", resp.tensor_digests_size(),
                          " files' digests, ", resp.sample_digests_size(), " sample digests for ",
                          query.samples.size(), " samples and ", resp.available_size(),
                          " ranges");
    }
    for (const v1::CheckpointRange& r : resp.available()) {
      if (r.file() >= files || r.length() == 0 || r.offset() + r.length() < r.offset()) {
        return "its answer (still loading) names a range outside the checkpoint's files";
      }
    }
    return "";
  }
  if (static_cast<size_t>(resp.tensor_digests_size()) != files) {
    return absl::StrCat("its answer has digests for ", resp.tensor_digests_size(),
                        " files; the checkpoint has ", files);
  }
  for (size_t f = 0; f < files; ++f) {
    if (resp.tensor_digests(static_cast<int>(f)).size() != 16 * query.tensors_per_file[f]) {
      return absl::StrCat("its answer has ", resp.tensor_digests(static_cast<int>(f)).size(),
                          " bytes of digests for file ", f, ", which has ",
                          query.tensors_per_file[f], " tensors (16 bytes each)");
    }
  }
  if (static_cast<size_t>(resp.sample_digests_size()) != query.samples.size() ||
      resp.copy().size() != 16 ||
      std::any_of(resp.sample_digests().begin(), resp.sample_digests().end(),
                  [](const std::string& d) { return d.size() != 16; })) {
    return absl::StrCat("its answer has ", resp.sample_digests_size(), " sample digests for ",
                        query.samples.size(), " samples, or digests not of 16 bytes");
  }
  return "";
}

// A well-shaped answer (ShapeError "") as what `peer` holds.
PeerHolding ToHolding(const std::string& peer, const v1::FindCheckpointResponse& resp) {
  PeerHolding h;
  h.peer = peer;
  h.copy = *DigestFromBytes(resp.copy());
  for (const std::string& file : resp.tensor_digests()) {
    std::vector<Digest> digests;
    digests.reserve(file.size() / 16);
    for (size_t at = 0; at < file.size(); at += 16) {
      digests.push_back(*DigestFromBytes(absl::string_view(file).substr(at, 16)));
    }
    h.tensor_digests.push_back(std::move(digests));
  }
  for (const std::string& d : resp.sample_digests()) {
    h.sample_digests.push_back(d.empty() ? Digest{} : *DigestFromBytes(d));
    h.sample_known.push_back(!d.empty());
  }
  h.partial = resp.partial();
  for (const v1::CheckpointRange& r : resp.available()) {
    h.available.push_back({r.file(), r.offset(), r.length()});
  }
  if (!h.partial) h.sample_known.clear();
  return h;
}

// The key of a holder's UCX offer for (peer, key, copy).
std::string OfferKey(const std::string& peer, const Digest& key, const Digest& copy) {
  return absl::StrCat(peer, "|", key.View(), copy.View());
}

v1::FindCheckpointRequest FindRequest(const PeerQuery& query, bool ucx) {
  v1::FindCheckpointRequest req;
  req.set_ucx(ucx);
  req.set_key(std::string(query.key.View()));
  for (const CheckpointRange& r : query.samples) {
    v1::CheckpointRange* out = req.add_samples();
    out->set_file(r.file);
    out->set_offset(r.offset);
    out->set_length(r.length);
  }
  for (const Digest& d : query.sample_digests) req.add_sample_digests(std::string(d.View()));
  return req;
}

}  // namespace

PeerCheckpointClient::PeerCheckpointClient(PeerTable* table, PeerChannels* channels,
                                           UcxPlane* ucx, PeerTransport transport)
    : table_(table),
      channels_(channels),
      ucx_(transport == PeerTransport::kGrpc ? nullptr : ucx),
      transport_(transport) {}

std::optional<PeerHolding> PeerCheckpointClient::AskOne(const std::string& peer,
                                                        absl::Duration deadline,
                                                        const v1::FindCheckpointRequest& req,
                                                        const PeerQuery& query) {
  std::shared_ptr<v1::Models::Stub> stub = channels_->StubFor(peer);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(deadline));
  v1::FindCheckpointResponse resp;
  const absl::Status s = FromGrpc(stub->FindCheckpoint(&ctx, req, &resp));
  if (AnsweredBy(ctx, table_->instance_id())) {
    table_->MarkSelf(peer);
    return std::nullopt;
  }
  if (s.code() == absl::StatusCode::kNotFound) return std::nullopt;  // not a holder
  const std::string key_hex = query.key.Hex().substr(0, 12);
  if (!s.ok()) {
    Refuse(peer, key_hex,
           absl::StrCat(s.ToString(), " (a true answer takes at most ", query.AnswerBound(),
                        " bytes)"));
    return std::nullopt;
  }
  // Exactly the question's shape, before anything is made of it.
  if (std::string why = ShapeError(resp, query); !why.empty()) {
    Refuse(peer, key_hex, why);
    return std::nullopt;
  }
  PeerHolding held = ToHolding(peer, resp);
  if (ucx_ != nullptr) {
    // Its UCX offer, if whole: a worker and a grant of 16-byte token per file.
    bool whole = !resp.ucx_worker().empty() && resp.ucx_worker().size() <= 64 * 1024 &&
                 static_cast<size_t>(resp.ucx_files_size()) == query.tensors_per_file.size();
    UcxOffer offer;
    offer.worker = resp.ucx_worker();
    for (const v1::UcxRegion& r : resp.ucx_files()) {
      whole = whole && r.token().size() == 16;
      offer.files.push_back(UcxGrant{r.grant(), r.token(), r.length()});
    }
    if (!whole && transport_ == PeerTransport::kUcx) {
      Refuse(peer, key_hex, "it offers no UCX data plane (--peer-transport ucx)");
      return std::nullopt;
    }
    absl::MutexLock lock(&mu_);
    const std::string k = OfferKey(peer, query.key, held.copy);
    if (whole) {
      if (offers_.size() >= 4096) offers_.clear();  // answers of long ago
      offers_[k] = std::move(offer);
    } else {
      offers_.erase(k);
    }
  }
  return held;
}

std::vector<PeerHolding> PeerCheckpointClient::FindHolders(const PeerQuery& query) {
  const PeerOptions& options = table_->options();
  std::vector<std::string> ask;
  std::vector<absl::Duration> deadline;
  for (const PeerState& p : table_->Snapshot()) {
    ask.push_back(p.address);
    deadline.push_back(p.reachable || p.polled == absl::InfinitePast()
                           ? options.call_timeout
                           : std::min(options.call_timeout, absl::Milliseconds(500)));
  }
  // As many at once as the receive budget holds true answers twice over.
  const uint64_t bound = query.AnswerBound();
  const uint64_t fit = options.receive_budget_bytes / (2 * bound);
  if (fit == 0) {
    LogEvent(LogLevel::kWarning, "peer_find_skipped",
             {{"key", query.key.Hex().substr(0, 12)},
              {"why", absl::StrCat("an answer for its ", bound, " bytes of digests would not fit "
                                   "the peer receive budget of ",
                                   options.receive_budget_bytes, " bytes")},
              {"action", "not asked; read from storage"}});
    return {};
  }
  const int parallel = static_cast<int>(std::min<uint64_t>(fit, options.call_threads));
  const v1::FindCheckpointRequest req = FindRequest(query, ucx_ != nullptr);
  std::vector<std::optional<PeerHolding>> answers(ask.size());
  (void)ParallelFor(nullptr, ask.size(), parallel, [&](size_t i) {
    answers[i] = AskOne(ask[i], deadline[i], req, query);
    return absl::OkStatus();
  });
  std::vector<PeerHolding> out;
  for (auto& a : answers) {
    if (a.has_value()) out.push_back(std::move(*a));
  }
  return out;
}

void PeerCheckpointClient::Count(const std::string& peer, const char* transport, uint64_t bytes,
                                 absl::Duration took, bool ok) {
  absl::MutexLock lock(&mu_);
  TransportTally& t = tally_[{peer, transport}];
  if (ok) {
    t.bytes += bytes;
    t.seconds += absl::ToDoubleSeconds(took);
  } else {
    ++t.failures;
  }
}

std::map<std::pair<std::string, std::string>, PeerCheckpointClient::TransportTally>
PeerCheckpointClient::TransportStats() const {
  absl::MutexLock lock(&mu_);
  return tally_;
}

absl::Status PeerCheckpointClient::ReadRange(const std::string& peer, const Digest& key,
                                             const Digest& copy, const CheckpointRange& range,
                                             uint8_t* dest, const char** transport) {
  const absl::Duration deadline = 2 * table_->options().call_timeout +
                                  absl::Seconds(static_cast<double>(range.length) / (32 << 20));
  const absl::Time start = absl::Now();
  if (ucx_ != nullptr) {
    std::optional<UcxOffer> offer;
    {
      absl::MutexLock lock(&mu_);
      auto it = offers_.find(OfferKey(peer, key, copy));
      if (it != offers_.end()) offer = it->second;
    }
    if (offer.has_value()) {
      if (range.file >= offer->files.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("file ", range.file, " of a UCX offer of ", offer->files.size()));
      }
      absl::Status s = ucx_->Read(peer, offer->worker, offer->files[range.file], range.offset,
                                  range.length, dest, deadline);
      Count(peer, "ucx", range.length, absl::Now() - start, s.ok());
      if (transport != nullptr) *transport = "ucx";
      return s;
    }
    if (transport_ == PeerTransport::kUcx) {
      return absl::FailedPreconditionError(
          absl::StrCat("peer ", peer, " offered no UCX grant for this copy (--peer-transport ucx)"));
    }
  }
  absl::Status s = ReadRangeGrpc(peer, key, copy, range, dest, deadline);
  Count(peer, "grpc", range.length, absl::Now() - start, s.ok());
  if (transport != nullptr) *transport = "grpc";
  return s;
}

absl::Status PeerCheckpointClient::ReadRangeGrpc(const std::string& peer, const Digest& key,
                                                 const Digest& copy, const CheckpointRange& range,
                                                 uint8_t* dest, absl::Duration deadline) {
  std::shared_ptr<v1::Models::Stub> stub = channels_->StubFor(peer);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(deadline));
  v1::ReadCheckpointRequest req;
  req.set_key(std::string(key.View()));
  req.set_copy(std::string(copy.View()));
  req.mutable_range()->set_file(range.file);
  req.mutable_range()->set_offset(range.offset);
  req.mutable_range()->set_length(range.length);
  auto reader = stub->ReadCheckpoint(&ctx, req);
  return ReadChunksInto(ctx, *reader, range.length, dest,
                        ChunkSender{absl::StrCat("peer ", peer),
                                    absl::StrCat("reading from peer ", peer)});
}

}  // namespace weightd
