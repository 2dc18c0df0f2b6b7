#include "server/publish/publish_service.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "server/base/fault_guard.h"
#include "server/base/log.h"
#include "common/status_macros.h"
#include "common/untrusted_text.h"
#include "server/publish/publish_commit.h"

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

PublishService::PublishService(Options options)
    : options_(std::move(options)), slots_(options_.limits) {}

absl::StatusOr<PublishSessionInfo> PublishService::Begin(const PublishBeginParams& params) {
  WD_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model, options_.find_model(params.model));
  const std::shared_ptr<const Generation> cur = model->current;
  // Writing requires reading: nothing about the model (its generation,
  // names, dtypes, shapes) is checked or said before the caller is known
  // to be a reader, as Fetch does.
  if (params.caller.has_value()) {
    WD_RETURN_IF_ERROR(options_.access->CheckRead(*params.caller, GuardsOf(*model, *cur)));
  }
  if (params.expect_generation != 0 && params.expect_generation != cur->number) {
    return absl::AbortedError(absl::StrCat("model \"", params.model, "\" is at generation ",
                                           cur->number, ", not ", params.expect_generation));
  }
  if (params.timeout <= absl::ZeroDuration() || params.timeout > absl::Hours(24)) {
    return absl::InvalidArgumentError("a publish session's timeout must be between 0 and 24 h");
  }
  WD_ASSIGN_OR_RETURN(PublishLayout layout, LayoutPublish(params.tensors));
  WD_ASSIGN_OR_RETURN(SpecCheck specs, CheckSpecs(*model, *cur, params));
  // An open session holds a memfd and a mapping: capped per caller and in
  // all, so that no caller can take the daemon's file descriptors.
  const std::string caller_key = params.caller.has_value() ? CallerKey(*params.caller) : "";
  WD_RETURN_IF_ERROR(slots_.Acquire(
      caller_key, params.caller.has_value() ? params.caller->Describe() : "the daemon"));
  absl::Cleanup give_slot_back = [&] { slots_.Release(caller_key); };
  WD_ASSIGN_OR_RETURN(
      std::unique_ptr<MemoryCharge> metadata,
      options_.memory->Charge(specs.metadata_bytes, absl::StrCat("publish session metadata for "
                                                                 "model \"", params.model, "\"")));
  bool took_ahead = false;
  WD_ASSIGN_OR_RETURN(std::unique_ptr<Segment> staging,
                      AllocateStaging(*model, params, layout.total, &took_ahead));
  auto session = std::make_shared<PublishSession>();
  session->token = RandomHex(16);
  session->model = params.model;
  session->model_instance = model->instance;
  session->model_guards = ModelGuards(*model);
  session->expect_generation = params.expect_generation;
  session->base_generation = cur->number;
  session->specs = params.tensors;
  session->layout = layout;
  session->bytes_total = specs.bytes;
  session->start = absl::Now();
  session->deadline = session->start + params.timeout;
  session->idle_timeout = options_.idle_timeout;
  session->base = staging->mutable_data();
  session->staging_bytes = staging->size();
  session->page_bytes = staging->pages() == PageKind::kSmall ? SmallPageBytes() : kHugePageBytes;
  session->slots = &slots_;
  session->caller_key = caller_key;
  session->account = options_.memory->account();
  {
    absl::MutexLock lock(&session->mu);
    session->metadata = std::move(metadata);
    session->staging = std::move(staging);
    for (const PublishTensorSpec& spec : params.tensors) {
      session->coverage.emplace_back(spec.bytes());
    }
    session->last_active = session->start;
    session->holds_slot = true;
  }
  std::move(give_slot_back).Cancel();
  {
    absl::MutexLock lock(&mu_);
    session->id = next_id_++;
    sessions_[session->id] = session;
  }
  PublishSessionInfo info;
  info.id = session->id;
  info.token = session->token;
  info.base_generation = session->base_generation;
  info.layout = std::move(layout);
  info.staging_bytes = session->staging_bytes;
  info.bytes = specs.bytes;
  info.deadline = session->deadline;
  info.per_part = std::move(specs.per_part);
  LogEvent(LogLevel::kInfo, "publish_begin",
           {{"model", params.model},
            {"session", absl::StrCat(info.id)},
            {"tensors", absl::StrCat(params.tensors.size())},
            {"bytes", absl::StrCat(specs.bytes)},
            {"base_generation", absl::StrCat(info.base_generation)},
            {"staging", took_ahead ? "prepared ahead" : "allocated"}});
  return info;
}

absl::StatusOr<PublishService::SpecCheck> PublishService::CheckSpecs(
    const Model& model, const Generation& cur, const PublishBeginParams& params) {
  absl::flat_hash_map<absl::string_view, const Served*> by_name;
  for (const Served* s : ServedAt(model, cur)) by_name.emplace(s->plan.name, s);
  absl::flat_hash_set<absl::string_view> added;
  for (const Served& s : cur.added) added.insert(s.plan.name);
  SpecCheck out;
  out.metadata_bytes = sizeof(PublishSession);
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
    if (plan.parts.empty() && model.checkpoint->Find(plan.name) != nullptr) {
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
    out.bytes += spec.bytes();
    out.metadata_bytes += sizeof(PublishTensorSpec) + spec.name.size() +
                          spec.shape.size() * sizeof(int64_t) + sizeof(RangeCoverage) +
                          sizeof(uint64_t);
    if (plan.per_part) out.per_part.push_back(spec.name);
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Segment>> PublishService::AllocateStaging(
    const Model& model, const PublishBeginParams& params, uint64_t bytes, bool* took_ahead) {
  // Prepared after the model's last publish (StagingReserve) when this one
  // is the same size; else allocated now.
  std::unique_ptr<Segment> ahead = options_.staging->Take(model.instance, bytes);
  *took_ahead = ahead != nullptr;
  HostMemoryManager::AllocateOptions alloc;
  alloc.purpose = "publish";
  // Faulted in at once: the writers' copies then run at memory speed
  // instead of taking a page fault per 4 KiB.
  alloc.prefault = true;
  alloc.warm = true;  // a pre-faulted reserve chunk when the staging fits one
  absl::StatusOr<std::unique_ptr<Segment>> staging = std::move(ahead);
  if (!*took_ahead) staging = options_.memory->Allocate(bytes, alloc);
  if (!staging.ok()) {
    return Annotate(staging.status(), absl::StrCat("staging ", bytes, " bytes to publish to model \"",
                                                   params.model, "\""));
  }
  (*took_ahead ? staging_prepared_ : staging_allocated_).fetch_add(1);
  return staging;
}

absl::StatusOr<std::shared_ptr<PublishSession>> PublishService::Find(
    const std::optional<Principal>& caller, uint64_t id, absl::string_view token) {
  std::shared_ptr<PublishSession> session;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(id);
    if (it == sessions_.end()) {
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
  if (caller.has_value()) WD_RETURN_IF_ERROR(options_.access->CheckRead(*caller, session->model_guards));
  return session;
}

absl::StatusOr<UniqueFd> PublishService::Stage(const std::optional<Principal>& caller,
                                               uint64_t id, absl::string_view token) {
  WD_ASSIGN_OR_RETURN(std::shared_ptr<PublishSession> s, Find(caller, id, token));
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

absl::StatusOr<PublishProgress> PublishService::Write(
    const std::optional<Principal>& caller, uint64_t id, absl::string_view token,
    absl::Span<const PublishRun> runs, absl::string_view data, bool in_place) {
  WD_ASSIGN_OR_RETURN(std::shared_ptr<PublishSession> s, Find(caller, id, token));
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

absl::StatusOr<PublishResult> PublishService::Commit(
    const std::optional<Principal>& caller, uint64_t id, absl::string_view token,
    absl::Duration wait) {
  WD_ASSIGN_OR_RETURN(std::shared_ptr<PublishSession> s, Find(caller, id, token));
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
          WD_RETURN_IF_ERROR(options_.access->CheckRead(*caller, session.result_guards));
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

absl::StatusOr<PublishResult> PublishService::CommitAndRecord(
    PublishSession& session, const std::optional<Principal>& caller) {
  auto result = options_.commit(session, caller);
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
  options_.staging->Want(session.model, session.model_instance, staging_size);
  return result;
}

absl::Status PublishService::Abort(const std::optional<Principal>& caller, uint64_t id,
                                   absl::string_view token) {
  WD_ASSIGN_OR_RETURN(std::shared_ptr<PublishSession> s, Find(caller, id, token));
  absl::MutexLock lock(&s->mu);
  if (s->state != PublishSession::State::kOpen) return s->NotOpenLocked();
  s->FailLocked(absl::AbortedError("aborted by the publisher; nothing was published"));
  return absl::OkStatus();
}

std::vector<std::shared_ptr<PublishSession>> PublishService::Sessions() const {
  std::vector<std::shared_ptr<PublishSession>> out;
  absl::MutexLock lock(&mu_);
  for (const auto& [id, s] : sessions_) out.push_back(s);
  return out;
}

uint64_t PublishService::OpenSessions() const {
  const std::vector<std::shared_ptr<PublishSession>> sessions = Sessions();
  uint64_t open = 0;
  for (const auto& s : sessions) {
    absl::MutexLock lock(&s->mu);
    open += s->state == PublishSession::State::kOpen ||
            s->state == PublishSession::State::kCommitting;
  }
  return open;
}

void PublishService::EndSessionsOf(uint64_t instance, const std::string& why) {
  options_.staging->Drop(instance);
  for (const auto& s : Sessions()) {
    if (s->model_instance != instance) continue;
    absl::MutexLock lock(&s->mu);
    // A session committing now finds the model gone and fails itself.
    if (s->state == PublishSession::State::kOpen) {
      s->FailLocked(absl::AbortedError(absl::StrCat(why, "; nothing was published")));
    }
  }
}

void PublishService::Expire() {
  const absl::Time now = absl::Now();
  const std::vector<std::shared_ptr<PublishSession>> sessions = Sessions();
  std::vector<uint64_t> gone;
  for (const auto& s : sessions) {
    absl::MutexLock lock(&s->mu);
    s->ExpireLocked(now);
    if (s->ended != absl::InfiniteFuture() && now - s->ended > kEndedSessionLinger) {
      gone.push_back(s->id);
    }
  }
  if (gone.empty()) return;
  absl::MutexLock lock(&mu_);
  for (uint64_t id : gone) sessions_.erase(id);
}
}  // namespace weightd
