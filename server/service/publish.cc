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

constexpr char kSealedByWriter[] =
    "its staging memfd was sealed by a writer (F_SEAL_SEAL): the daemon can no longer seal it "
    "against writes, so nothing of it can be published";

uint64_t SmallPageBytes() {
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

// Whether another holder of the memfd forbade further seals.
bool SealedByWriter(int fd) {
  const int seals = ::fcntl(fd, F_GET_SEALS);
  return seals >= 0 && (seals & F_SEAL_SEAL) != 0;
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

struct WeightService::PublishSession {
  uint64_t id = 0;
  std::string token;
  std::string model;
  // The model instance the session began on: a model unloaded and loaded
  // again under the same name meanwhile is another one (Model::instance).
  uint64_t model_instance = 0;
  // The model's own readers (fixed for the instance): every call on the
  // session checks its caller against them (FindPublish).
  std::vector<ReadGuard> model_guards;
  uint64_t expect_generation = 0;
  uint64_t base_generation = 0;
  std::vector<PublishTensorSpec> specs;
  PublishLayout layout;
  uint64_t bytes_total = 0;
  absl::Time start;
  absl::Time deadline;
  absl::Duration idle_timeout;  // zero: none
  uint8_t* base = nullptr;  // the staging segment's writable mapping
  uint64_t staging_bytes = 0;
  uint64_t page_bytes = 4096;  // of the staging's pages, for messages
  // Its open-session slot (PublishSlots), held until it ends, under
  // `caller_key`; its specs and layout, charged to the budget for its life.
  PublishSlots* slots = nullptr;
  std::string caller_key;
  std::unique_ptr<MemoryCharge> metadata ABSL_GUARDED_BY(mu);
  // The budget its coverage's ranges are charged to as they grow.
  std::shared_ptr<MemoryAccount> account;

  enum class State { kOpen, kCommitting, kDone, kFailed };
  absl::Mutex mu;
  absl::CondVar changed;
  std::unique_ptr<Segment> staging ABSL_GUARDED_BY(mu);  // until commit or failure
  std::vector<RangeCoverage> coverage ABSL_GUARDED_BY(mu);
  // Ranges the coverage holds, and the bytes charged for them (a high-water
  // mark with room for the runs being added).
  uint64_t coverage_ranges ABSL_GUARDED_BY(mu) = 0;
  uint64_t coverage_charged ABSL_GUARDED_BY(mu) = 0;
  uint64_t landed ABSL_GUARDED_BY(mu) = 0;  // bytes copied in
  // The staging memfd was handed out writable (StagePublish): the commit
  // must prove no one maps it any more (Segment::SealExclusive).
  bool handed_out ABSL_GUARDED_BY(mu) = false;
  int writers ABSL_GUARDED_BY(mu) = 0;      // copies in progress
  int waiters ABSL_GUARDED_BY(mu) = 0;      // CommitPublish calls waiting for it
  absl::Time last_active ABSL_GUARDED_BY(mu);  // of the last write, stage or commit call
  bool holds_slot ABSL_GUARDED_BY(mu) = false;
  State state ABSL_GUARDED_BY(mu) = State::kOpen;
  absl::Status failure ABSL_GUARDED_BY(mu);
  std::optional<PublishResult> result ABSL_GUARDED_BY(mu);
  // Who may be told the result: the guards of the generation it made.
  std::vector<ReadGuard> result_guards ABSL_GUARDED_BY(mu);
  absl::Time ended ABSL_GUARDED_BY(mu) = absl::InfiniteFuture();

  std::string Describe() const {
    return absl::StrCat("publish session ", id, " of model \"", model, "\"");
  }
  // Ends the session with `why`: nothing of it becomes visible; its memory
  // goes once no copy is in progress.
  void FailLocked(absl::Status why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (state == State::kDone || state == State::kFailed) return;
    state = State::kFailed;
    failure = std::move(why);
    ended = absl::Now();
    EndedLocked();
    changed.SignalAll();
    LogEvent(LogLevel::kWarning, "publish_failed",
             {{"model", model}, {"session", absl::StrCat(id)}, {"error", failure.ToString()}});
  }
  // What an ended session (done or failed) gives back: its slot at once,
  // its memory once no copy is in progress (DropLocked). What stays while
  // it lingers (kEndedSessionLinger) is its result or failure.
  void EndedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (holds_slot) slots->Release(caller_key);
    holds_slot = false;
    if (writers == 0) DropLocked();
  }
  // Frees an ended session's memory: the staging (unless the commit took
  // it), the coverage, the specs and layout and their charges. REQUIRES:
  // ended, and no copy in progress (copies read `layout` and `base` without
  // the lock; specs and layout are read without it only by those and by
  // the commit, which no one else ends).
  void DropLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    staging.reset();
    coverage.clear();
    coverage.shrink_to_fit();
    coverage_ranges = 0;
    if (coverage_charged > 0) account->Return(coverage_charged);
    coverage_charged = 0;
    specs.clear();
    specs.shrink_to_fit();
    layout = PublishLayout();
    metadata.reset();
  }
  // The status of a call on a session that is no longer open.
  absl::Status NotOpenLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    switch (state) {
      case State::kOpen:
        return absl::OkStatus();
      case State::kCommitting:
        return absl::FailedPreconditionError(
            absl::StrCat(Describe(), " has every byte and is being committed"));
      case State::kDone:
        return absl::FailedPreconditionError(absl::StrCat(
            Describe(), " is complete (generation ", result->generation.generation, ")"));
      case State::kFailed:
        return absl::Status(failure.code(),
                            absl::StrCat(Describe(), " ended: ", failure.message()));
    }
    return absl::InternalError("unknown session state");
  }
  // NotOpenLocked(), and a session past its deadline, or idle past its
  // idle timeout, fails now.
  absl::Status CheckOpenLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    WD_RETURN_IF_ERROR(NotOpenLocked());
    ExpireLocked(absl::Now());
    return NotOpenLocked();
  }
  // Fails an open session past its deadline or idle too long.
  void ExpireLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (state != State::kOpen) return;
    if (now > deadline) {
      FailLocked(absl::DeadlineExceededError(absl::StrCat(
          "not complete by its deadline; missing ", FirstMissingLocked(),
          "; nothing was published")));
    } else if (idle_timeout > absl::ZeroDuration() && writers == 0 && waiters == 0 &&
               now - last_active > idle_timeout) {
      FailLocked(absl::DeadlineExceededError(absl::StrCat(
          "idle for over ", absl::FormatDuration(idle_timeout),
          " (no write, stage or waiting commit; --publish-idle-seconds); missing ",
          FirstMissingLocked(), "; nothing was published")));
    }
  }
  // "tensor \"x\" bytes [a, b)" of the first byte still missing.
  std::string FirstMissingLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (size_t i = 0; i < coverage.size(); ++i) {
      auto gap = coverage[i].FirstGap();
      if (gap.has_value()) {
        return absl::StrCat("tensor \"", specs[i].name, "\" bytes [", gap->first, ", ",
                            gap->second, ")");
      }
    }
    return "nothing";
  }
  // Records `runs` of a write carrying `data_size` bytes (their lengths
  // add up to `total`, or `overflow`ed) as landing, and counts the write in
  // progress; a write that lies about its bytes ends the session.
  absl::Status AddRunsLocked(absl::Span<const PublishRun> runs, uint64_t data_size,
                             uint64_t total, bool overflow, bool in_place)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    absl::Status bad;
    if (in_place) {
      if (!handed_out) {
        // Not the publisher lying: nothing was written. The session stays open.
        return absl::FailedPreconditionError(absl::StrCat(
            Describe(), ": runs declared written in place, but no writer has taken its "
            "staging memfd (a StageRequest on the data socket)"));
      }
      if (data_size != 0 || overflow) {
        bad = absl::InvalidArgumentError(absl::StrCat(
            "a write declared in place carries ", data_size, " bytes of data"));
      }
    } else if (overflow || total != data_size) {
      bad = absl::InvalidArgumentError(absl::StrCat("a write's runs add up to ", total,
                                                    " bytes but it carries ", data_size));
    }
    for (size_t i = 0; i < runs.size() && bad.ok(); ++i) {
      const PublishRun& r = runs[i];
      if (r.tensor >= specs.size()) {
        bad = absl::InvalidArgumentError(absl::StrCat("a write names tensor index ", r.tensor,
                                                      "; the session has ", specs.size()));
        break;
      }
      RangeCoverage& c = coverage[r.tensor];
      const size_t before = c.ranges();
      absl::Status added = c.Add(r.offset, r.length);
      coverage_ranges = coverage_ranges + c.ranges() - before;
      if (!added.ok()) {
        bad = absl::InvalidArgumentError(
            absl::StrCat("tensor \"", specs[r.tensor].name, "\": ", added.message()));
      }
    }
    if (!bad.ok()) {
      // What was written is not trusted.
      FailLocked(bad);
      return NotOpenLocked();
    }
    ++writers;
    return absl::OkStatus();
  }
  // Why a guarded access of the staging at `offset` failed.
  absl::Status StagingFault(uint64_t offset) const {
    return absl::FailedPreconditionError(absl::StrCat(
        "staging page at offset ", offset / page_bytes * page_bytes,
        " could not be faulted in: a writer of its memfd punched it out, or the huge-page "
        "pool is exhausted; nothing was published"));
  }
};

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
  std::unique_ptr<Segment> ahead = TakeStagingAhead(model->instance, staging_size);
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

absl::StatusOr<std::shared_ptr<WeightService::PublishSession>> WeightService::FindPublish(
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
  WantStagingAhead(session.model, session.model_instance, staging_size);
  return result;
}

void WeightService::WantStagingAhead(const std::string& model, uint64_t instance,
                                     uint64_t bytes) {
  if (!options_.publish_staging_ahead || bytes == 0) return;
  std::unique_ptr<Segment> drop;  // another size: freed outside the lock
  absl::MutexLock lock(&ahead_mu_);
  StagingAhead& a = ahead_[instance];
  if (a.bytes == bytes && (a.segment != nullptr || a.in_flight)) return;
  a.model = model;
  a.bytes = bytes;
  drop = std::move(a.segment);
  ahead_wanted_.Signal();
}

std::unique_ptr<Segment> WeightService::TakeStagingAhead(uint64_t instance, uint64_t bytes) {
  std::unique_ptr<Segment> out;
  std::unique_ptr<Segment> drop;  // another size: freed outside the lock
  {
    absl::MutexLock lock(&ahead_mu_);
    // One the stager is faulting in now is waited for (a trainer that
    // publishes again at once), rather than allocated a second time.
    const absl::Time until = absl::Now() + absl::Seconds(10);
    auto it = ahead_.find(instance);
    while (it != ahead_.end() && it->second.in_flight && it->second.bytes == bytes &&
           !ahead_ready_.WaitWithDeadline(&ahead_mu_, until)) {
      it = ahead_.find(instance);
    }
    it = ahead_.find(instance);
    if (it == ahead_.end() || it->second.in_flight) return nullptr;
    if (it->second.segment != nullptr && it->second.bytes == bytes) {
      out = std::move(it->second.segment);
    } else {
      drop = std::move(it->second.segment);
    }
    // The stager makes the next one after this session commits.
    ahead_.erase(it);
  }
  return out;
}

uint64_t WeightService::StagingAheadBytes() const {
  absl::MutexLock lock(&ahead_mu_);
  uint64_t bytes = 0;
  for (const auto& [instance, a] : ahead_) bytes += a.segment != nullptr ? a.segment->size() : 0;
  return bytes;
}

void WeightService::DropStagingAhead(uint64_t instance) {
  std::unique_ptr<Segment> drop;
  absl::MutexLock lock(&ahead_mu_);
  auto it = ahead_.find(instance);
  if (it == ahead_.end()) return;
  drop = std::move(it->second.segment);
  ahead_.erase(it);
  ahead_ready_.SignalAll();
}

uint64_t WeightService::ReclaimStagingAhead(absl::Duration idle) {
  std::vector<std::unique_ptr<Segment>> dropped;
  uint64_t freed = 0;
  const absl::Time now = absl::Now();
  {
    absl::MutexLock lock(&ahead_mu_);
    for (auto it = ahead_.begin(); it != ahead_.end();) {
      StagingAhead& a = it->second;
      if (a.in_flight || (a.segment != nullptr && now - a.ready_at < idle)) {
        ++it;
        continue;
      }
      if (a.segment != nullptr) {
        freed += a.segment->size();
        dropped.push_back(std::move(a.segment));
      }
      // Nothing is prepared again before the model's next publish.
      ahead_.erase(it++);
    }
    ahead_ready_.SignalAll();
  }
  dropped.clear();  // returns the bytes to the budget
  if (freed > 0) {
    LogEvent(LogLevel::kDebug, "publish_staging_reclaimed", {{"bytes", absl::StrCat(freed)}});
  }
  return freed;
}

void WeightService::StagerLoop() {
  for (;;) {
    uint64_t instance = 0;
    uint64_t bytes = 0;
    std::string model;
    {
      absl::MutexLock lock(&ahead_mu_);
      auto next = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(ahead_mu_) {
        for (auto& [i, a] : ahead_) {
          if (a.segment == nullptr && !a.in_flight && a.bytes > 0) {
            a.in_flight = true;
            instance = i;
            bytes = a.bytes;
            model = a.model;
            return true;
          }
        }
        return false;
      };
      while (!ahead_stop_ && !next()) ahead_wanted_.Wait(&ahead_mu_);
      if (ahead_stop_) return;
    }
    // Not for a model unloaded since its publish; only into room the
    // budget has (never evicting anything for it).
    absl::StatusOr<std::unique_ptr<Segment>> segment =
        absl::NotFoundError("the model was unloaded");
    auto loaded = FindModel(model);
    if (loaded.ok() && (*loaded)->instance == instance) {
      HostMemoryManager::AllocateOptions alloc;
      alloc.purpose = "publish";
      alloc.prefault = true;
      alloc.reclaim = false;
      segment = memory_.Allocate(bytes, alloc);
    }
    std::unique_ptr<Segment> unused;
    {
      absl::MutexLock lock(&ahead_mu_);
      auto it = ahead_.find(instance);
      const bool still = it != ahead_.end() && it->second.in_flight && it->second.bytes == bytes;
      if (still) it->second.in_flight = false;
      if (segment.ok() && still) {
        it->second.segment = std::move(*segment);
        it->second.ready_at = absl::Now();
      } else {
        if (segment.ok()) unused = std::move(*segment);  // taken, dropped or resized meanwhile
        if (still) ahead_.erase(it);                     // not again before the next publish
      }
      ahead_ready_.SignalAll();
    }
    if (!segment.ok()) {
      LogEvent(LogLevel::kDebug, "publish_staging_ahead_skipped",
               {{"bytes", absl::StrCat(bytes)}, {"error", segment.status().ToString()}});
    }
  }
}

void WeightService::StopStager() {
  {
    absl::MutexLock lock(&ahead_mu_);
    ahead_stop_ = true;
    ahead_wanted_.SignalAll();
  }
  if (stager_.joinable()) stager_.join();
  if (ahead_reclaimer_ != 0) memory_.RemoveReclaimer(ahead_reclaimer_);
  ahead_reclaimer_ = 0;
  ReclaimStagingAhead();
}

absl::Status WeightService::AbortPublish(const std::optional<Principal>& caller, uint64_t id,
                                       absl::string_view token) {
  WD_ASSIGN_OR_RETURN(std::shared_ptr<PublishSession> s, FindPublish(caller, id, token));
  absl::MutexLock lock(&s->mu);
  if (s->state != PublishSession::State::kOpen) return s->NotOpenLocked();
  s->FailLocked(absl::AbortedError("aborted by the publisher; nothing was published"));
  return absl::OkStatus();
}

std::vector<std::shared_ptr<WeightService::PublishSession>> WeightService::PublishSessions()
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
  DropStagingAhead(instance);
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
  const absl::Time commit_start = absl::Now();
  if (handed_out) {
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
  } else {
    WD_RETURN_IF_ERROR(staged->Seal(/*populate=*/false));
  }
  const SegmentPtr segment(std::move(staged));
  const uint8_t* base = segment->data();
  const absl::Time sealed_at = absl::Now();

  // The model as the session found it, and each spec's served tensor.
  WD_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model, FindModel(session.model));
  if (model->instance != session.model_instance) {
    return absl::AbortedError(absl::StrCat("model \"", session.model,
                                           "\" was unloaded during the publish; nothing published"));
  }
  // Each published tensor as parts (one per checkpoint tensor it merges;
  // an allow_new tensor is one part keyed by its served name), digested.
  struct Piece {
    size_t spec = 0;
    std::string key;
    bool part = true;  // a checkpoint tensor's place (else an allow_new tensor's)
    std::vector<int64_t> shape;
    uint64_t offset = 0;  // in the staging segment
    uint64_t length = 0;
    Digest digest;
  };
  std::vector<Piece> pieces;
  {
    absl::flat_hash_map<absl::string_view, const Served*> by_name;
    for (const Served* s : ServedAt(*model, *model->current)) by_name.emplace(s->plan.name, s);
    for (size_t i = 0; i < session.specs.size(); ++i) {
      const PublishTensorSpec& spec = session.specs[i];
      auto it = by_name.find(spec.name);
      if (it == by_name.end()) return absl::InternalError("a published tensor vanished");
      const ServedTensorPlan& plan = it->second->plan;
      const uint64_t at = session.layout.offsets[i];
      if (plan.parts.empty()) {
        pieces.push_back(Piece{i, plan.name, false, plan.shape, at, spec.bytes(), {}});
        continue;
      }
      std::vector<PartBytes> split = SplitParts(plan.shape, plan.dtype, plan.part_rows);
      for (size_t k = 0; k < plan.parts.size(); ++k) {
        std::vector<int64_t> shape = plan.shape;
        if (!shape.empty()) shape[0] = plan.part_rows[k];
        if (plan.parts.size() == 1) shape = it->second->parts[0]->shape;
        pieces.push_back(Piece{i, plan.parts[k].source, true, std::move(shape),
                               at + split[k].offset, split[k].length, {}});
      }
    }
  }
  // Digested on the worker threads' count of cores (the caller's thread
  // too), a tensor at a time: a digest reads every byte once more.
  // Under a fault guard: the staging's pages are checked above, but
  // nothing a writer did to it may take the daemon down.
  WD_RETURN_IF_ERROR(ParallelFor(
      nullptr, pieces.size(), std::max(1, options_.worker_threads), [&](size_t i) {
        Digest digest;
        const std::optional<MemoryFault> fault = RunFaultGuarded(
            base, segment->size(),
            [&] { digest = DigestBytes(base + pieces[i].offset, pieces[i].length); });
        if (fault.has_value()) return session.StagingFault(fault->offset);
        pieces[i].digest = digest;
        return absl::OkStatus();
      }));
  const absl::Time digested_at = absl::Now();

  std::vector<ReadGuard> result_guards;  // of the generation the result describes
  auto finish = [&](PublishResult result) {
    {
      absl::MutexLock lock(&session.mu);
      session.result_guards = result_guards;
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
              {"seal_seconds", absl::StrCat(absl::ToDoubleSeconds(sealed_at - commit_start))},
              {"digest_seconds", absl::StrCat(absl::ToDoubleSeconds(digested_at - sealed_at))},
              {"commit_seconds", absl::StrCat(absl::ToDoubleSeconds(absl::Now() - commit_start))}});
    return result;
  };
  for (int attempt = 0;; ++attempt) {
    WD_ASSIGN_OR_RETURN(model, FindModel(session.model));
    if (model->instance != session.model_instance) {
      return absl::AbortedError(absl::StrCat(
          "model \"", session.model, "\" was unloaded during the publish; nothing published"));
    }
    const std::shared_ptr<const Generation> cur = model->current;
    // The new generation keeps the stack of the one it builds on: its
    // committer must be able to read that one (an adapter applied since
    // the session began may be private).
    result_guards = GuardsOf(*model, *cur);
    if (caller.has_value()) WD_RETURN_IF_ERROR(access_.CheckRead(*caller, result_guards));
    if (session.expect_generation != 0 && cur->number != session.expect_generation) {
      return absl::AbortedError(absl::StrCat("model \"", session.model, "\" is at generation ",
                                             cur->number, ", not ", session.expect_generation,
                                             "; nothing published"));
    }
    // What each part key holds now.
    absl::flat_hash_map<std::string, const StoredTensor*> now;
    for (const Served* s : ServedAt(*model, *cur)) {
      for (const StoredTensor* p : s->parts) now.emplace(p->name, p);
    }
    auto published = cur->published != nullptr ? std::make_shared<PublishedBase>(*cur->published)
                                               : std::make_shared<PublishedBase>();
    std::vector<const Piece*> fresh;  // changed, and not the checkpoint's own bytes
    absl::flat_hash_set<size_t> changed_specs;
    uint64_t fresh_bytes = 0;
    for (const Piece& p : pieces) {
      auto n = now.find(p.key);
      if (n != now.end() && n->second->digest == p.digest) continue;  // same bytes
      changed_specs.insert(p.spec);
      const StoredTensor* original = p.part ? model->checkpoint->Find(p.key) : nullptr;
      if (original != nullptr && original->digest == p.digest) {
        published->erase(p.key);  // back to the checkpoint's bytes
        continue;
      }
      fresh.push_back(&p);
      fresh_bytes += (p.length + 63) / 64 * 64;
    }
    PublishResult result;
    result.tensors = session.specs.size();
    result.changed = changed_specs.size();
    result.bytes = session.bytes_total;
    // Changed bytes that some loaded model holds already (the same publish
    // sent to another profile of the base, a tensor of another checkpoint)
    // are shared instead of stored again; so are repeats within this
    // publish (below).
    std::vector<std::optional<ResidentCopy>> resident(fresh.size());
    absl::flat_hash_set<uint64_t> held;  // what the new generation holds anyway
    if (!fresh.empty()) {
      absl::flat_hash_set<std::string> replaced;
      for (const Piece* p : fresh) replaced.insert(p->key);
      for (const StoredTensor& t : model->checkpoint->tensors()) {
        if (t.buffer != nullptr) held.insert(t.buffer->id());
      }
      for (const auto& [key, t] : *published) {
        if (!replaced.contains(key) && t->buffer != nullptr) held.insert(t->buffer->id());
      }
      std::vector<WantedBytes> wanted;
      wanted.reserve(fresh.size());
      for (const Piece* p : fresh) {
        wanted.push_back(WantedBytes{p->digest, base + p->offset, p->length});
      }
      resident = FindResidentCopies(model->name, ReadScope(ModelGuards(*model)), wanted, held);
    }
    // What stays to be stored: one copy of each run of bytes no model holds.
    std::vector<int64_t> same_as(fresh.size(), -1);  // an earlier fresh piece with its bytes
    fresh_bytes = 0;
    size_t fresh_stored = 0;  // pieces to store (some may be empty)
    {
      absl::flat_hash_map<Digest, std::vector<size_t>> stored_by_digest;
      for (size_t f = 0; f < fresh.size(); ++f) {
        const Piece& p = *fresh[f];
        if (resident[f].has_value()) continue;
        std::vector<size_t>& earlier = stored_by_digest[p.digest];
        for (size_t e : earlier) {
          if (fresh[e]->length == p.length &&
              std::memcmp(base + fresh[e]->offset, base + p.offset, p.length) == 0) {
            same_as[f] = static_cast<int64_t>(e);
            break;
          }
        }
        if (same_as[f] >= 0) continue;
        earlier.push_back(f);
        fresh_bytes += (p.length + 63) / 64 * 64;
        ++fresh_stored;
      }
    }
    if (changed_specs.empty()) {
      // Nothing differs: no new generation.
      absl::MutexLock lock(&mu_);
      auto it = models_.find(session.model);
      if (it == models_.end() || it->second->current != cur) {
        if (attempt < 5) continue;
        return absl::AbortedError(absl::StrCat("model \"", session.model,
                                               "\" kept changing during the publish; retry"));
      }
      result.generation = InfoOf(*it->second, *cur);
      return finish(std::move(result));
    }
    // Only the changed bytes stay: when some published tensors are
    // unchanged, the changed ones move to a segment of their size.
    SegmentPtr holder = segment;
    std::vector<uint64_t> offsets(fresh.size(), 0);
    // (When they are at most 7/8 of what was sent: a copy to save little
    // is not worth it.)
    // (Empty tensors count: they must not keep the staging segment alive.)
    if (fresh_stored > 0 && fresh_bytes + session.bytes_total / 8 < session.bytes_total) {
      HostMemoryManager::AllocateOptions alloc;
      alloc.purpose = "publish";
      // Not prefaulted: the copy below faults the pages in, on the worker
      // threads, in one pass instead of two (zeroing, then copying).
      alloc.prefault = false;
      auto packed = memory_.Allocate(std::max<uint64_t>(fresh_bytes, 64), alloc);
      if (packed.ok()) {
        std::vector<CopyRun> runs;
        uint64_t at = 0;
        for (size_t f = 0; f < fresh.size(); ++f) {
          const Piece& p = *fresh[f];
          if (resident[f].has_value() || same_as[f] >= 0) continue;
          runs.push_back(CopyRun{(*packed)->mutable_data() + at, base + p.offset, p.length});
          offsets[f] = at;
          at += (p.length + 63) / 64 * 64;
        }
        absl::Status copied = ParallelCopy(runs, options_.worker_threads);
        if (copied.ok() && (*packed)->Seal(/*populate=*/false).ok()) {
          holder = SegmentPtr(std::move(*packed));
        }
      }
      // No room for the copy: the staging segment is kept as it is.
    }
    if (holder == segment) {
      for (size_t f = 0; f < fresh.size(); ++f) offsets[f] = fresh[f]->offset;
      // The staging segment stays whole when anything is stored from it: a
      // copy in a segment the new generation would not hold otherwise saves
      // nothing then, and would only keep that segment alive.
      if (fresh_stored > 0) {
        for (auto& r : resident) {
          if (r.has_value() && !held.contains(r->buffer->id())) r.reset();
        }
      }
    }
    bool holder_used = false;
    for (size_t f = 0; f < fresh.size(); ++f) {
      const Piece& p = *fresh[f];
      StoredTensor t;
      t.name = p.key;
      t.dtype = session.specs[p.spec].dtype;
      t.shape = p.shape;
      t.length = p.length;
      t.digest = p.digest;
      if (resident[f].has_value()) {
        result.bytes_shared += p.length;
        if (std::find(result.shared_with.begin(), result.shared_with.end(),
                      resident[f]->holder) == result.shared_with.end()) {
          result.shared_with.push_back(resident[f]->holder);
        }
        t.buffer = resident[f]->buffer;
        t.offset = resident[f]->offset;
        t.file = absl::StrCat("(published in session ", session.id, "; bytes shared with model \"",
                              resident[f]->holder, "\")");
      } else {
        t.buffer = holder;
        t.offset = offsets[same_as[f] >= 0 ? static_cast<size_t>(same_as[f]) : f];
        t.file = absl::StrCat("(published in session ", session.id, ")");
        holder_used = true;
      }
      WD_ASSIGN_OR_RETURN((*published)[p.key], ChargedPublished(std::move(t)));
    }
    result.bytes_stored = !holder_used ? 0 : (holder == segment ? segment->size() : fresh_bytes);

    WD_ASSIGN_OR_RETURN(const uint64_t number,
                        NextGenerationNumber(session.model, cur->number, model->generation_floor));
    WD_ASSIGN_OR_RETURN(std::shared_ptr<Generation> gen,
                        BuildGeneration(*model, number, cur->stack, cur->adapters,
                                        std::move(published)));
    gen->adapter_guards = cur->adapter_guards;
    StateRecord record;
    record.kind = StateRecord::Kind::kPublish;
    record.name = session.model;
    record.generation = number;
    record.content = gen->identity.Hex();
    for (const AdapterRef& r : cur->stack) record.stack.emplace_back(r.name, r.strength);
    if (published_store_ != nullptr) record.path = published_store_->FileName(session.model, number);
    bool raced = false;
    std::vector<uint64_t> retired;
    absl::Status committed = CommitState(
        record,
        [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          auto it = models_.find(session.model);
          if (it == models_.end() || it->second->instance != session.model_instance) {
            return absl::AbortedError(absl::StrCat("model \"", session.model,
                                                   "\" was unloaded during the publish"));
          }
          if (it->second->current != cur || number < it->second->generation_floor) {
            raced = true;
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
          result.generation = InstallGeneration(session.model, gen, &retired);
        });
    if (!committed.ok()) {
      // Another apply or publish won the race: build on it (a publish with
      // expect_generation is refused above instead).
      if (raced && attempt < 5) continue;
      return committed;
    }
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
    return finish(std::move(result));
  }
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
