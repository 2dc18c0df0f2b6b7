// WeightService: publishing new base weights (weight_service.h, "Publishing
// new base weights"). A session stages the published tensors in one segment
// of its own; the write that lands its last byte digests them and installs
// the generation. Locks: a session's mu is taken alone or after publish_mu_
// is released; CommitStaged takes state_mu_/mu_ (CommitState) with no
// session lock held.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <tuple>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/fault_guard.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "common/thread_pool.h"
#include "common/untrusted_text.h"
#include "server/publish/publish_commit.h"
#include "server/service/weight_service.h"

namespace weightd {
namespace {

// How long an ended session still answers CommitPublish with its result
// (the other ranks of a sharded publish ask after the last byte landed).
constexpr absl::Duration kEndedSessionLinger = absl::Seconds(60);

std::string RandomHex(size_t bytes) {
  std::string raw(bytes, '\0');
  size_t done = 0;
  while (done < bytes) {
    ssize_t n = ::getrandom(raw.data() + done, bytes - done, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // getrandom does not fail for 16 bytes on Linux >= 3.17
    done += static_cast<size_t>(n);
  }
  return absl::BytesToHexString(raw);
}

bool TokensEqual(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

std::string SpecString(DType dtype, absl::Span<const int64_t> shape) {
  return absl::StrCat(DTypeName(dtype), " ", ShapeString(shape));
}

// What one recorded byte range of a session's coverage costs in memory (a
// std::map node and its allocation), charged as the coverage grows.
constexpr uint64_t kCoverageRangeBytes = 64;

uint64_t SmallPageBytes() {
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

// The key a caller's open sessions are counted under (PublishSlots): its
// uid on a Unix socket, its token name and certificate CN on TCP; "" for
// the daemon itself.
std::string CallerKey(const Principal& p) {
  switch (p.via) {
    case Principal::Via::kInternal:
      return "";
    case Principal::Via::kUnixSocket:
      return absl::StrCat("uid:", p.peer.uid);
    case Principal::Via::kTcp:
      return absl::StrCat("tcp:token=", p.token_name, ",cn=", p.cert_cn);
  }
  return "";
}

}  // namespace

absl::StatusOr<WeightService::PublishSessionInfo> WeightService::BeginPublish(
    const PublishBeginParams& params) {
  WD_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model, FindModel(params.model));
  const std::shared_ptr<const Generation> cur = model->current;
  // Writing requires reading: nothing about the model (its generation,
  // names, dtypes, shapes) is checked or said before the caller is known
  // to be a reader, as Fetch does.
  if (params.caller.has_value()) {
    WD_RETURN_IF_ERROR(access_.CheckRead(*params.caller, GuardsOf(*model, *cur)));
  }
  if (params.expect_generation != 0 && params.expect_generation != cur->number) {
    return absl::AbortedError(absl::StrCat("model \"", params.model, "\" is at generation ",
                                           cur->number, ", not ", params.expect_generation));
  }
  if (params.timeout <= absl::ZeroDuration() || params.timeout > absl::Hours(24)) {
    return absl::InvalidArgumentError("a publish session's timeout must be between 0 and 24 h");
  }
  WD_ASSIGN_OR_RETURN(PublishLayout layout, LayoutPublish(params.tensors));
  // Each tensor must be one the model serves, as it stores it.
  absl::flat_hash_map<absl::string_view, const Served*> by_name;
  for (const Served* s : ServedAt(*model, *cur)) by_name.emplace(s->plan.name, s);
  absl::flat_hash_set<absl::string_view> added;
  for (const Served& s : cur->added) added.insert(s.plan.name);
  uint64_t bytes = 0;
  uint64_t metadata_bytes = sizeof(PublishSession);
  std::vector<std::string> per_part;
  for (const PublishTensorSpec& spec : params.tensors) {
    if (added.contains(spec.name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor \"", spec.name, "\" of model \"", params.model,
          "\" is added by an adapter of its stack; only base weights are published"));
    }
    auto it = by_name.find(spec.name);
    if (it == by_name.end()) {
      return absl::NotFoundError(absl::StrCat("model \"", params.model, "\" has no tensor ",
                                              QuoteForMessage(spec.name),
                                              " (a new name must be allowed by its profile)"));
    }
    const ServedTensorPlan& plan = it->second->plan;
    if (plan.parts.empty() && model->checkpoint->Find(plan.name) != nullptr) {
      // Published parts are keyed by checkpoint name, and this allowed new
      // tensor's name is another tensor's there.
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor \"", spec.name, "\" of model \"", params.model,
          "\" is a new tensor whose name is also a checkpoint tensor's (mapped elsewhere by the "
          "profile); it cannot be published"));
    }
    if (spec.dtype != plan.dtype || spec.shape != plan.shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor \"", spec.name, "\" of model \"", params.model, "\" is ",
          SpecString(plan.dtype, plan.shape), "; the publish says ",
          SpecString(spec.dtype, spec.shape)));
    }
    bytes += spec.bytes();
    metadata_bytes += sizeof(PublishTensorSpec) + spec.name.size() +
                      spec.shape.size() * sizeof(int64_t) + sizeof(RangeCoverage) +
                      sizeof(uint64_t);
    if (plan.per_part) per_part.push_back(spec.name);
  }
  // An open session holds a memfd and a mapping: capped per caller and in
  // all, so that no caller can take the daemon's file descriptors.
  const std::string caller_key = params.caller.has_value() ? CallerKey(*params.caller) : "";
  WD_RETURN_IF_ERROR(publish_slots_.Acquire(
      caller_key, params.caller.has_value() ? params.caller->Describe() : "the daemon"));
  absl::Cleanup give_slot_back = [&] { publish_slots_.Release(caller_key); };
  WD_ASSIGN_OR_RETURN(std::unique_ptr<MemoryCharge> metadata,
                      memory_.Charge(metadata_bytes, absl::StrCat("publish session metadata for "
                                                                  "model \"", params.model, "\"")));
  const uint64_t staging_size = layout.total;
  // Prepared after the model's last publish (StagerLoop) when this one is
  // the same size; else allocated now.
  std::unique_ptr<Segment> ahead = staging_.Take(model->instance, staging_size);
  const bool took_ahead = ahead != nullptr;
  HostMemoryManager::AllocateOptions alloc;
  alloc.purpose = "publish";
  // Faulted in at once: the writers' copies then run at memory speed
  // instead of taking a page fault per 4 KiB.
  alloc.prefault = true;
  alloc.warm = true;  // a pre-faulted reserve chunk when the staging fits one
  absl::StatusOr<std::unique_ptr<Segment>> staging = std::move(ahead);
  if (!took_ahead) staging = memory_.Allocate(staging_size, alloc);
  if (!staging.ok()) {
    return Annotate(staging.status(),
                    absl::StrCat("staging ", layout.total, " bytes to publish to model \"",
                                 params.model, "\""));
  }
  (took_ahead ? staging_prepared_ : staging_allocated_).fetch_add(1);
  auto session = std::make_shared<PublishSession>();
  session->token = RandomHex(16);
  session->model = params.model;
  session->model_instance = model->instance;
  session->model_guards = ModelGuards(*model);
  session->expect_generation = params.expect_generation;
  session->base_generation = cur->number;
  session->specs = params.tensors;
  session->layout = layout;
  session->bytes_total = bytes;
  session->start = absl::Now();
  session->deadline = session->start + params.timeout;
  session->idle_timeout = options_.publish_idle_timeout;
  session->base = (*staging)->mutable_data();
  session->staging_bytes = (*staging)->size();
  session->page_bytes = (*staging)->pages() == PageKind::kSmall ? SmallPageBytes() : kHugePageBytes;
  session->slots = &publish_slots_;
  session->caller_key = caller_key;
  session->account = memory_.account();
  {
    absl::MutexLock lock(&session->mu);
    session->metadata = std::move(metadata);
    session->staging = std::move(*staging);
    for (const PublishTensorSpec& spec : params.tensors) {
      session->coverage.emplace_back(spec.bytes());
    }
    session->last_active = session->start;
    session->holds_slot = true;
  }
  std::move(give_slot_back).Cancel();
  PublishSessionInfo info;
  {
    absl::MutexLock lock(&publish_mu_);
    session->id = next_publish_id_++;
    publishes_[session->id] = session;
  }
  info.id = session->id;
  info.token = session->token;
  info.base_generation = session->base_generation;
  info.layout = std::move(layout);
  info.staging_bytes = session->staging_bytes;
  info.bytes = bytes;
  info.deadline = session->deadline;
  info.per_part = std::move(per_part);
  LogEvent(LogLevel::kInfo, "publish_begin",
           {{"model", params.model},
            {"session", absl::StrCat(info.id)},
            {"tensors", absl::StrCat(params.tensors.size())},
            {"bytes", absl::StrCat(bytes)},
            {"base_generation", absl::StrCat(info.base_generation)},
            {"staging", took_ahead ? "prepared ahead" : "allocated"}});
  return info;
}

absl::StatusOr<std::shared_ptr<PublishSession>> WeightService::FindPublish(
    const std::optional<Principal>& caller, uint64_t id, absl::string_view token) {
  std::shared_ptr<PublishSession> session;
  {
    absl::MutexLock lock(&publish_mu_);
    auto it = publishes_.find(id);
    if (it == publishes_.end()) {
      return absl::NotFoundError(absl::StrCat("publish session ", id,
                                              " is unknown (never opened, or ended over ",
                                              absl::FormatDuration(kEndedSessionLinger), " ago)"));
    }
    if (!TokensEqual(token, it->second->token)) {
      return absl::PermissionDeniedError(
          absl::StrCat("wrong token for publish session ", id));
    }
    session = it->second;
  }
  // A token is not enough: writing requires reading (model_guards is fixed
  // for the session's life).
  if (caller.has_value()) WD_RETURN_IF_ERROR(access_.CheckRead(*caller, session->model_guards));
  return session;
}

absl::StatusOr<UniqueFd> WeightService::StagePublish(const std::optional<Principal>& caller,
                                                     uint64_t id, absl::string_view token) {
  WD_ASSIGN_OR_RETURN(std::shared_ptr<PublishSession> s, FindPublish(caller, id, token));
  PublishSession& session = *s;
  absl::MutexLock lock(&session.mu);
  WD_RETURN_IF_ERROR(session.CheckOpenLocked());
  if (session.staging == nullptr) return absl::InternalError("publish session has no staging");
  const int fd = session.staging->fd();
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0) return ErrnoStatus(errno, "reading the staging memfd's seals");
  if ((seals & F_SEAL_SEAL) != 0) {
    // A writer it was handed to sealed it: the commit cannot seal it
    // against writes any more, so nothing of it can be published.
    session.FailLocked(absl::FailedPreconditionError(kSealedByWriter));
    return session.NotOpenLocked();
  }
  // The publisher may write, never resize: a shrink would take pages the
  // daemon's mapping covers.
  constexpr int kShape = F_SEAL_GROW | F_SEAL_SHRINK;
  if ((seals & kShape) != kShape && ::fcntl(fd, F_ADD_SEALS, kShape) != 0) {
    return ErrnoStatus(errno, "sealing the staging memfd's size");
  }
  if (!session.handed_out) {
    // Every page allocated before anyone else holds the memfd: a page
    // missing at the commit was then punched out by a writer
    // (StagingLostPages).
    struct stat st;
    if (::fstat(fd, &st) != 0) return ErrnoStatus(errno, "fstat on the staging memfd");
    if (static_cast<uint64_t>(st.st_blocks) * 512 < session.staging->size() &&
        ::fallocate(fd, 0, 0, static_cast<off_t>(session.staging->size())) != 0) {
      return ErrnoStatus(errno, "allocating every page of the staging memfd");
    }
  }
  UniqueFd dup(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
  if (!dup.valid()) return ErrnoStatus(errno, "duplicating the staging memfd");
  if (!session.handed_out) {
    LogEvent(LogLevel::kInfo, "publish_staged",
             {{"model", session.model}, {"session", absl::StrCat(id)},
              {"bytes", absl::StrCat(session.staging->size())}});
  }
  session.handed_out = true;
  session.last_active = absl::Now();
  return dup;
}

absl::StatusOr<WeightService::PublishProgress> WeightService::WritePublish(
    const std::optional<Principal>& caller, uint64_t id, absl::string_view token,
    absl::Span<const PublishRun> runs, absl::string_view data, bool in_place) {
  WD_ASSIGN_OR_RETURN(std::shared_ptr<PublishSession> s, FindPublish(caller, id, token));
  PublishSession& session = *s;
  uint64_t total = 0;
  bool overflow = false;
  for (const PublishRun& r : runs) {
    overflow |= total + r.length < total;
    total += r.length;
  }
  // The ranges the runs may add are charged before they are recorded.
  const std::string charge_what = absl::StrCat("the byte ranges written to ", session.Describe());
  for (bool reclaimed = false;; reclaimed = true) {
    uint64_t short_by = 0;
    {
      absl::MutexLock lock(&session.mu);
      WD_RETURN_IF_ERROR(session.CheckOpenLocked());
      session.last_active = absl::Now();
      const uint64_t want = (session.coverage_ranges + runs.size()) * kCoverageRangeBytes;
      if (want > session.coverage_charged) {
        absl::Status charged =
            session.account->ReserveNoReclaim(want - session.coverage_charged, charge_what);
        // The budget is short: what the reclaimers free (outside the
        // session's lock), once; else this write is refused, the session
        // still open.
        if (!charged.ok() && reclaimed) return charged;
        if (charged.ok()) {
          session.coverage_charged = want;
        } else {
          short_by = want - session.coverage_charged;
        }
      }
      if (short_by == 0) {
        WD_RETURN_IF_ERROR(session.AddRunsLocked(runs, data.size(), total, overflow, in_place));
        break;
      }
    }
    session.account->ReclaimUpTo(std::numeric_limits<int>::max(), short_by);
  }
  // Disjoint ranges (the coverage says so): no lock while copying. Another
  // process may map the staging writable too (StagePublish) and punch out
  // the pages copied into: a page that cannot be faulted in ends this
  // session, never the daemon.
  std::optional<MemoryFault> fault;
  if (!in_place) {
    fault = RunFaultGuarded(session.base, session.staging_bytes, [&] {
      uint64_t at = 0;
      for (const PublishRun& r : runs) {
        std::memcpy(session.base + session.layout.offsets[r.tensor] + r.offset, data.data() + at,
                    r.length);
        at += r.length;
      }
    });
  }
  PublishProgress progress;
  progress.bytes_total = session.bytes_total;
  bool commit = false;
  {
    absl::MutexLock lock(&session.mu);
    --session.writers;
    session.last_active = absl::Now();
    if (fault.has_value()) session.FailLocked(session.StagingFault(fault->offset));
    session.landed += total;
    progress.bytes_done = session.landed;
    if (session.state == PublishSession::State::kFailed) {
      if (session.writers == 0) session.DropLocked();
      return session.NotOpenLocked();
    }
    if (session.landed == session.bytes_total && session.writers == 0) {
      session.state = PublishSession::State::kCommitting;
      commit = true;
    }
  }
  if (!commit) return progress;
  WD_ASSIGN_OR_RETURN(progress.result, CommitAndRecord(session, caller));
  return progress;
}

absl::StatusOr<WeightService::PublishResult> WeightService::CommitPublish(
    const std::optional<Principal>& caller, uint64_t id, absl::string_view token,
    absl::Duration wait) {
  WD_ASSIGN_OR_RETURN(std::shared_ptr<PublishSession> s, FindPublish(caller, id, token));
  PublishSession& session = *s;
  bool commit = false;
  {
    absl::MutexLock lock(&session.mu);
    session.ExpireLocked(absl::Now());
    if (session.state == PublishSession::State::kOpen) session.last_active = absl::Now();
    // A caller waiting for the last byte keeps the session from idling out.
    ++session.waiters;
    const absl::Time until = std::min(absl::Now() + wait, session.deadline);
    while (session.state == PublishSession::State::kOpen ||
           session.state == PublishSession::State::kCommitting) {
      // Nothing to write (every tensor empty): this call commits.
      if (session.state == PublishSession::State::kOpen &&
          session.landed == session.bytes_total && session.writers == 0) {
        session.state = PublishSession::State::kCommitting;
        commit = true;
        break;
      }
      if (session.changed.WaitWithDeadline(&session.mu, until)) break;
    }
    --session.waiters;
    if (session.state == PublishSession::State::kOpen) session.last_active = absl::Now();
    if (!commit) {
      if (session.state == PublishSession::State::kDone) {
        // The generation it made may carry guards the model's own readers
        // do not (a private adapter in its stack).
        if (caller.has_value()) {
          WD_RETURN_IF_ERROR(access_.CheckRead(*caller, session.result_guards));
        }
        return *session.result;
      }
      if (session.state != PublishSession::State::kOpen) return session.NotOpenLocked();
      return absl::FailedPreconditionError(absl::StrCat(
          session.Describe(), " is not complete: ", session.landed, " of ",
          session.bytes_total, " bytes written; missing ", session.FirstMissingLocked()));
    }
  }
  return CommitAndRecord(session, caller);
}

absl::StatusOr<WeightService::PublishResult> WeightService::CommitAndRecord(
    PublishSession& session, const std::optional<Principal>& caller) {
  auto result = CommitStaged(session, caller);
  absl::MutexLock lock(&session.mu);
  session.ended = absl::Now();
  if (!result.ok()) {
    session.FailLocked(result.status());
    return result.status();
  }
  const uint64_t staging_size = session.layout.total;
  session.state = PublishSession::State::kDone;
  session.result = *result;
  session.EndedLocked();
  session.changed.SignalAll();
  staging_.Want(session.model, session.model_instance, staging_size);
  return result;
}

absl::Status WeightService::AbortPublish(const std::optional<Principal>& caller, uint64_t id,
                                       absl::string_view token) {
  WD_ASSIGN_OR_RETURN(std::shared_ptr<PublishSession> s, FindPublish(caller, id, token));
  absl::MutexLock lock(&s->mu);
  if (s->state != PublishSession::State::kOpen) return s->NotOpenLocked();
  s->FailLocked(absl::AbortedError("aborted by the publisher; nothing was published"));
  return absl::OkStatus();
}

std::vector<std::shared_ptr<PublishSession>> WeightService::PublishSessions()
    const {
  std::vector<std::shared_ptr<PublishSession>> out;
  absl::MutexLock lock(&publish_mu_);
  for (const auto& [id, s] : publishes_) out.push_back(s);
  return out;
}

uint64_t WeightService::OpenPublishSessions() const {
  const std::vector<std::shared_ptr<PublishSession>> sessions = PublishSessions();
  uint64_t open = 0;
  for (const auto& s : sessions) {
    absl::MutexLock lock(&s->mu);
    open += s->state == PublishSession::State::kOpen ||
            s->state == PublishSession::State::kCommitting;
  }
  return open;
}

void WeightService::EndPublishesOf(uint64_t instance, const std::string& why) {
  staging_.Drop(instance);
  for (const auto& s : PublishSessions()) {
    if (s->model_instance != instance) continue;
    absl::MutexLock lock(&s->mu);
    // A session committing now finds the model gone and fails itself.
    if (s->state == PublishSession::State::kOpen) {
      s->FailLocked(absl::AbortedError(absl::StrCat(why, "; nothing was published")));
    }
  }
}

void WeightService::ExpirePublishes() {
  const absl::Time now = absl::Now();
  const std::vector<std::shared_ptr<PublishSession>> sessions = PublishSessions();
  std::vector<uint64_t> gone;
  for (const auto& s : sessions) {
    absl::MutexLock lock(&s->mu);
    s->ExpireLocked(now);
    if (s->ended != absl::InfiniteFuture() && now - s->ended > kEndedSessionLinger) {
      gone.push_back(s->id);
    }
  }
  if (gone.empty()) return;
  absl::MutexLock lock(&publish_mu_);
  for (uint64_t id : gone) publishes_.erase(id);
}

absl::StatusOr<WeightService::PublishResult> WeightService::CommitStaged(
    PublishSession& session, const std::optional<Principal>& caller) {
  std::unique_ptr<Segment> staged;
  bool handed_out = false;
  {
    absl::MutexLock lock(&session.mu);
    staged = std::move(session.staging);
    handed_out = session.handed_out;
  }
  if (staged == nullptr) return absl::InternalError("publish session lost its staging memory");
  CommitTimes times;
  times.start = absl::Now();
  WD_ASSIGN_OR_RETURN(const SegmentPtr segment, SealStaging(std::move(staged), handed_out));
  times.sealed = absl::Now();
  // The model as the session found it, and each spec's served tensor.
  WD_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model, FindSessionModel(session));
  WD_ASSIGN_OR_RETURN(std::vector<StagedPiece> pieces, PiecesOf(session, *model));
  WD_RETURN_IF_ERROR(DigestPieces(pieces, *segment, options_.worker_threads, session));
  times.digested = absl::Now();
  for (int attempt = 0;; ++attempt) {
    WD_ASSIGN_OR_RETURN(model, FindSessionModel(session));
    const std::shared_ptr<const Generation> cur = model->current;
    // The new generation keeps the stack of the one it builds on: its
    // committer must be able to read that one (an adapter applied since
    // the session began may be private).
    const std::vector<ReadGuard> result_guards = GuardsOf(*model, *cur);
    if (caller.has_value()) WD_RETURN_IF_ERROR(access_.CheckRead(*caller, result_guards));
    if (session.expect_generation != 0 && cur->number != session.expect_generation) {
      return absl::AbortedError(absl::StrCat("model \"", session.model, "\" is at generation ",
                                             cur->number, ", not ", session.expect_generation,
                                             "; nothing published"));
    }
    PublishDiff diff = DiffPieces(pieces, *model, *cur);
    PublishResult result;
    result.tensors = session.specs.size();
    result.changed = diff.changed_specs;
    result.bytes = session.bytes_total;
    bool raced = false;
    absl::Status installed =
        diff.changed_specs == 0
            ? CurrentAsResult(session, cur, &result, &raced)
            : StorePublished(session, *model, cur, segment, diff, &result, &raced);
    if (raced && attempt < 5) continue;
    WD_RETURN_IF_ERROR(installed);
    return FinishPublish(session, result_guards, times, std::move(result));
  }
}

absl::StatusOr<std::shared_ptr<const Model>> WeightService::FindSessionModel(
    const PublishSession& session) const {
  WD_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model, FindModel(session.model));
  if (model->instance != session.model_instance) {
    return absl::AbortedError(absl::StrCat("model \"", session.model,
                                           "\" was unloaded during the publish; nothing published"));
  }
  return model;
}

absl::Status WeightService::CurrentAsResult(const PublishSession& session,
                                            const std::shared_ptr<const Generation>& cur,
                                            PublishResult* result, bool* raced) {
  // Nothing differs: no new generation.
  absl::MutexLock lock(&mu_);
  auto it = models_.find(session.model);
  if (it == models_.end() || it->second->current != cur) {
    *raced = true;
    return absl::AbortedError(
        absl::StrCat("model \"", session.model, "\" kept changing during the publish; retry"));
  }
  result->generation = InfoOf(*it->second, *cur);
  return absl::OkStatus();
}

absl::Status WeightService::StorePublished(PublishSession& session, const Model& model,
                                           const std::shared_ptr<const Generation>& cur,
                                           const SegmentPtr& segment, PublishDiff& diff,
                                           PublishResult* result, bool* raced) {
  // Changed bytes that some loaded model holds already (the same publish
  // sent to another profile of the base, a tensor of another checkpoint)
  // are shared instead of stored again; so are repeats within this
  // publish (PlanStore).
  const std::vector<const StagedPiece*>& fresh = diff.fresh;
  std::vector<std::optional<ResidentCopy>> resident(fresh.size());
  absl::flat_hash_set<uint64_t> held;  // what the new generation holds anyway
  if (!fresh.empty()) {
    held = HeldBuffers(model, *diff.published, fresh);
    std::vector<WantedBytes> wanted;
    wanted.reserve(fresh.size());
    for (const StagedPiece* p : fresh) {
      wanted.push_back(WantedBytes{p->digest, segment->data() + p->offset, p->length});
    }
    resident = FindResidentCopies(model.name, ReadScope(ModelGuards(model)), wanted, held);
  }
  const StorePlan plan = PlanStore(fresh, resident, segment->data());
  const StoredRuns stored = CompactStored(fresh, resident, plan, segment, session.bytes_total,
                                          held, memory_, options_.worker_threads);
  for (StoredTensor& t : StoredTensorsOf(session, fresh, resident, plan, stored, segment, result)) {
    const std::string key = t.name;
    WD_ASSIGN_OR_RETURN((*diff.published)[key], ChargedPublished(std::move(t)));
  }
  return InstallPublished(session, model, cur, std::move(diff.published), result, raced);
}

absl::Status WeightService::InstallPublished(const PublishSession& session, const Model& model,
                                             const std::shared_ptr<const Generation>& cur,
                                             std::shared_ptr<PublishedBase> published,
                                             PublishResult* result, bool* raced) {
  WD_ASSIGN_OR_RETURN(const uint64_t number,
                      NextGenerationNumber(session.model, cur->number, model.generation_floor));
  WD_ASSIGN_OR_RETURN(std::shared_ptr<Generation> gen,
                      BuildGeneration(model, number, cur->stack, cur->adapters,
                                      std::move(published)));
  gen->adapter_guards = cur->adapter_guards;
  StateRecord record;
  record.kind = StateRecord::Kind::kPublish;
  record.name = session.model;
  record.generation = number;
  record.content = gen->identity.Hex();
  for (const AdapterRef& r : cur->stack) record.stack.emplace_back(r.name, r.strength);
  if (published_store_ != nullptr) record.path = published_store_->FileName(session.model, number);
  std::vector<uint64_t> retired;
  // Another apply or publish winning the race is built on (`raced`; a
  // publish with expect_generation is refused by the caller instead).
  WD_RETURN_IF_ERROR(CommitState(
      record,
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        auto it = models_.find(session.model);
        if (it == models_.end() || it->second->instance != session.model_instance) {
          return absl::AbortedError(absl::StrCat("model \"", session.model,
                                                 "\" was unloaded during the publish"));
        }
        if (it->second->current != cur || number < it->second->generation_floor) {
          *raced = true;
          return absl::AbortedError(absl::StrCat(
              "model \"", session.model, "\" changed while the publish was committed"));
        }
        // Which load of each stack adapter the generation merged (a
        // restore loads those again).
        record.stack_seqs.clear();
        for (const AdapterRef& r : cur->stack) {
          auto seq = adapter_seq_.find(r.name);
          record.stack_seqs.push_back(seq == adapter_seq_.end() ? 0 : seq->second);
        }
        return absl::OkStatus();
      },
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        result->generation = InstallGeneration(session.model, gen, &retired);
      }));
  for (uint64_t g : retired) materializer_.RetireTag(absl::StrCat(session.model, "#", g));
  PinPublished(session.model, gen->published.get());
  if (published_store_ != nullptr) {
    // Saved for restarts in the background (the journal names the file).
    std::vector<std::shared_ptr<const StoredTensor>> tensors;
    if (gen->published != nullptr) {  // null: every part is the checkpoint's again
      for (const auto& [key, t] : *gen->published) tensors.push_back(t);
    }
    std::sort(tensors.begin(), tensors.end(),
              [](const auto& a, const auto& b) { return a->name < b->name; });
    published_store_->Save(session.model, number, std::move(tensors));
  }
  return absl::OkStatus();
}

WeightService::PublishResult WeightService::FinishPublish(PublishSession& session,
                                                          std::vector<ReadGuard> result_guards,
                                                          const CommitTimes& times,
                                                          PublishResult result) {
  {
    absl::MutexLock lock(&session.mu);
    session.result_guards = std::move(result_guards);
  }
  publish_count_.fetch_add(1);
  publish_bytes_.fetch_add(session.bytes_total);
  const absl::Duration took = absl::Now() - session.start;
  publish_ns_.fetch_add(static_cast<uint64_t>(absl::ToInt64Nanoseconds(took)));
  LogEvent(LogLevel::kInfo, "publish",
           {{"model", session.model},
            {"session", absl::StrCat(session.id)},
            {"generation", absl::StrCat(result.generation.generation)},
            {"tensors", absl::StrCat(result.tensors)},
            {"changed", absl::StrCat(result.changed)},
            {"bytes", absl::StrCat(result.bytes)},
            {"bytes_stored", absl::StrCat(result.bytes_stored)},
            {"bytes_shared", absl::StrCat(result.bytes_shared)},
            {"shared_with", absl::StrJoin(result.shared_with, ",")},
            {"seconds", absl::StrCat(absl::ToDoubleSeconds(took))},
            // Of which the commit, from the last byte: sealing, digests, the rest.
            {"seal_seconds", absl::StrCat(absl::ToDoubleSeconds(times.sealed - times.start))},
            {"digest_seconds", absl::StrCat(absl::ToDoubleSeconds(times.digested - times.sealed))},
            {"commit_seconds", absl::StrCat(absl::ToDoubleSeconds(absl::Now() - times.start))}});
  return result;
}

std::vector<std::optional<WeightService::ResidentCopy>> WeightService::FindResidentCopies(
    const std::string& own, const std::string& scope, absl::Span<const WantedBytes> wanted,
    const absl::flat_hash_set<uint64_t>& held) const {
  std::vector<std::optional<ResidentCopy>> found(wanted.size());
  absl::flat_hash_map<Digest, std::vector<size_t>> by_digest;
  for (size_t i = 0; i < wanted.size(); ++i) by_digest[wanted[i].digest].push_back(i);
  std::vector<std::shared_ptr<const Model>> models;
  {
    absl::MutexLock lock(&mu_);
    models.reserve(models_.size());
    for (const auto& [name, m] : models_) models.push_back(m);
  }
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

bool WeightService::DropCopiesUnderHalf(std::vector<std::optional<ResidentCopy>>& copies,
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
