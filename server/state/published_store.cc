#include "server/state/published_store.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/digest.h"
#include "common/fd.h"
#include "server/base/log.h"
#include "common/safetensors.h"
#include "common/status_macros.h"

namespace weightd {
namespace {

constexpr char kSubdir[] = "published";
constexpr char kSuffix[] = ".safetensors";
constexpr char kTempPrefix[] = ".tmp-";

}  // namespace

absl::Status WriteSafetensorsFile(const StateDir& dir, const std::string& name,
                                  absl::Span<const std::shared_ptr<const StoredTensor>> tensors) {
  std::vector<SafetensorsWriteEntry> entries;
  std::set<absl::string_view> names;
  for (const auto& t : tensors) {
    if (t->length > 0 && t->host_data() == nullptr) {
      return absl::UnimplementedError(
          absl::StrCat("tensor \"", t->name, "\" is not in host memory"));
    }
    if (!names.insert(t->name).second) {
      return absl::InvalidArgumentError(absl::StrCat("tensor \"", t->name, "\" given twice"));
    }
    entries.push_back({t->name, t->dtype, t->shape, t->length});
  }
  const std::string prefix = BuildSafetensorsHeader(entries);
  const std::string temp = absl::StrCat(kTempPrefix, ::getpid(), "-", ::syscall(SYS_gettid));
  WD_ASSIGN_OR_RETURN(UniqueFd fd, dir.CreateFile(temp));
  absl::Status written = [&]() -> absl::Status {
    WD_RETURN_IF_ERROR(WriteFull(fd.get(), prefix.data(), prefix.size()));
    for (const auto& t : tensors) {
      if (t->length > 0) WD_RETURN_IF_ERROR(WriteFull(fd.get(), t->host_data(), t->length));
    }
    if (::fsync(fd.get()) != 0) return ErrnoStatus(errno, "fsync");
    return absl::OkStatus();
  }();
  fd.Reset();
  if (written.ok()) written = dir.Rename(temp, name);
  if (!written.ok()) {
    (void)dir.Remove(temp);
    return Annotate(written, absl::StrCat("writing ", dir.PathOf(name)));
  }
  return dir.Sync();
}

PublishedStore::PublishedStore(std::shared_ptr<const StateDir> state_dir)
    : state_dir_(std::move(state_dir)), dir_(state_dir_->PathOf(kSubdir)) {}

PublishedStore::~PublishedStore() {
  std::thread thread;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    thread = std::move(thread_);
  }
  if (thread.joinable()) thread.join();
}

std::string PublishedStore::ModelPrefix(const std::string& model) const {
  return absl::StrCat(DigestBytes(model.data(), model.size()).Hex(), "-");
}

std::string PublishedStore::FileName(const std::string& model, uint64_t generation) const {
  return absl::StrCat(ModelPrefix(model), generation, kSuffix);
}

std::string PublishedStore::PathFor(const std::string& model, uint64_t generation) const {
  return absl::StrCat(dir_, "/", FileName(model, generation));
}

absl::StatusOr<std::string> PublishedStore::PathOf(const std::string& file_name) const {
  if (file_name.empty() || file_name[0] == '.' || file_name.find('/') != std::string::npos ||
      !absl::EndsWith(file_name, kSuffix)) {
    return absl::InvalidArgumentError(
        absl::StrCat("\"", file_name.substr(0, 80), "\" is not a published weights file name"));
  }
  return absl::StrCat(dir_, "/", file_name);
}

absl::StatusOr<std::shared_ptr<const FileOpener>> PublishedStore::Reader() const {
  WD_ASSIGN_OR_RETURN(std::shared_ptr<const StateDir> dir,
                      state_dir_->Subdir(kSubdir, /*create=*/false));
  return std::make_shared<StateDirFileOpener>(std::move(dir));
}

void PublishedStore::Save(const std::string& model, uint64_t generation,
                          std::vector<std::shared_ptr<const StoredTensor>> tensors) {
  absl::MutexLock lock(&mu_);
  // A save of the model still waiting is superseded by this one.
  for (auto it = queue_.begin(); it != queue_.end();) {
    if (it->model == model && it->generation != 0) {
      it = queue_.erase(it);
      ++stats_.dropped;
    } else {
      ++it;
    }
  }
  queue_.push_back(Job{model, generation, std::move(tensors)});
  if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
}

void PublishedStore::Forget(const std::string& model) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(Job{model, 0, {}});
  if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
}

void PublishedStore::KeepOnly(const std::set<std::string>& keep) {
  auto dir = state_dir_->Subdir(kSubdir, /*create=*/false);
  if (!dir.ok()) return;  // nothing saved yet (or refused at start: CheckStateDirEntries)
  auto names = (*dir)->List();
  if (!names.ok()) return;
  for (const std::string& name : *names) {
    if (keep.contains(name)) continue;
    if ((*dir)->Remove(name).ok()) {
      LogEvent(LogLevel::kInfo, "published_removed",
               {{"path", (*dir)->PathOf(name)}, {"reason", "no restored model serves it"}});
    }
  }
}

bool PublishedStore::WaitIdle(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return queue_.empty() && !busy_; };
  return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

PublishedStore::Stats PublishedStore::stats() const {
  absl::MutexLock lock(&mu_);
  Stats s = stats_;
  s.pending = queue_.size() + (busy_ ? 1 : 0);
  return s;
}

void PublishedStore::Loop() {
  // Background work: the cores go to fetches first.
  (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 19);
  for (;;) {
    Job job;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || !queue_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      // Stopping: what is queued is still saved (a clean stop keeps it).
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    Run(job);
    absl::MutexLock lock(&mu_);
    busy_ = false;
  }
}

void PublishedStore::Run(Job& job) {
  const std::string keep = job.generation != 0 ? FileName(job.model, job.generation) : "";
  auto dir = state_dir_->Subdir(kSubdir, /*create=*/job.generation != 0);
  if (job.generation != 0) {
    const absl::Time start = absl::Now();
    uint64_t bytes = 0;
    for (const auto& t : job.tensors) bytes += t->length;
    absl::Status s = dir.status();
    if (s.ok()) s = WriteSafetensorsFile(**dir, keep, job.tensors);
    job.tensors.clear();  // the memory may go now
    absl::MutexLock lock(&mu_);
    if (!s.ok()) {
      ++stats_.failed;
      LogEvent(LogLevel::kError, "published_save_failed",
               {{"model", job.model}, {"generation", absl::StrCat(job.generation)},
                {"error", s.ToString()}});
      return;  // the older file stays: it is no use to a restore, but harmless
    }
    ++stats_.saved;
    stats_.saved_bytes += bytes;
    LogEvent(LogLevel::kInfo, "published_saved",
             {{"model", job.model}, {"generation", absl::StrCat(job.generation)},
              {"path", (*dir)->PathOf(keep)}, {"bytes", absl::StrCat(bytes)},
              {"seconds", absl::StrCat(absl::ToDoubleSeconds(absl::Now() - start))}});
  }
  if (!dir.ok()) return;  // nothing saved
  // The model's other files are superseded (or, forgotten, all of them).
  const std::string prefix = ModelPrefix(job.model);
  auto names = (*dir)->List();
  if (!names.ok()) return;
  for (const std::string& name : *names) {
    if (absl::StartsWith(name, prefix) && absl::EndsWith(name, kSuffix) && name != keep) {
      (void)(*dir)->Remove(name);
    }
  }
}

}  // namespace weightd
