#include "server/service/catalog.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/untrusted_text.h"
#include "server/service/generations.h"

namespace weightd {
namespace {

absl::Status ModelNotLoaded(const std::string& name) {
  return absl::NotFoundError(absl::StrCat("model ", QuoteForMessage(name), " is not loaded"));
}

}  // namespace

Catalog::Catalog(ChangeCommitter::Sink sink) : committer_(std::move(sink), &mu_) {}

absl::StatusOr<std::shared_ptr<const Model>> Catalog::FindModel(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto it = models_.find(name);
  if (it == models_.end()) return ModelNotLoaded(name);
  return it->second;
}

std::vector<std::shared_ptr<const Model>> Catalog::Models() const {
  std::vector<std::shared_ptr<const Model>> out;
  absl::MutexLock lock(&mu_);
  out.reserve(models_.size());
  for (const auto& [name, model] : models_) out.push_back(model);
  return out;
}

bool Catalog::HasAdapter(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  return adapters_.contains(name);
}

size_t Catalog::AdapterCount() const {
  absl::MutexLock lock(&mu_);
  return adapters_.size();
}

std::vector<AdapterSummary> Catalog::ListAdapters() const {
  std::vector<AdapterSummary> out;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, info] : adapter_info_) out.push_back(info);
  }
  std::sort(out.begin(), out.end(),
            [](const AdapterSummary& a, const AdapterSummary& b) { return a.name < b.name; });
  return out;
}

absl::Status Catalog::ReserveLoad(const std::string& name,
                                  std::shared_ptr<Cancellation> cancel) {
  absl::MutexLock lock(&mu_);
  if (models_.contains(name) || loading_.contains(name)) {
    return absl::AlreadyExistsError(absl::StrCat("model \"", name, "\" is already loaded"));
  }
  loading_.emplace(name, std::move(cancel));
  return absl::OkStatus();
}

void Catalog::CancelLoad(const std::string& name) {
  absl::MutexLock lock(&mu_);
  loading_.erase(name);
  load_ended_.SignalAll();
}

absl::StatusOr<bool> Catalog::CancelLoading(const std::string& name, const std::string& why,
                                            absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto it = loading_.find(name);
  if (it == loading_.end()) return false;
  const std::shared_ptr<Cancellation> load = it->second;
  load->Cancel(why);
  const absl::Time deadline = absl::Now() + timeout;
  // Until this load's name is given back or published (a later load of
  // the same name has another cancellation).
  while (true) {
    auto now = loading_.find(name);
    if (now == loading_.end() || now->second != load) return true;
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "the load of model \"", name, "\" was cancelled but has not ended after ",
          absl::FormatDuration(timeout)));
    }
    load_ended_.WaitWithDeadline(&mu_, deadline);
  }
}

absl::StatusOr<Catalog::StackOf> Catalog::ResolveStack(const std::string& model_name,
                                                       const std::vector<AdapterRef>& stack) const {
  StackOf out;
  absl::MutexLock lock(&mu_);
  auto it = models_.find(model_name);
  if (it == models_.end()) return ModelNotLoaded(model_name);
  out.model = it->second;
  for (const AdapterRef& ref : stack) {
    auto a = adapters_.find(ref.name);
    if (a == adapters_.end()) {
      return absl::NotFoundError(
          absl::StrCat("adapter ", QuoteForMessage(ref.name), " is not loaded"));
    }
    out.adapters.push_back(a->second);
    // Which load of the adapter this apply merges (the journal names it).
    auto seq = adapter_seq_.find(ref.name);
    out.seqs.push_back(seq == adapter_seq_.end() ? 0 : seq->second);
    auto r = adapter_readers_.find(ref.name);
    bool listed = std::any_of(out.guards.begin(), out.guards.end(),
                              [&](const ReadGuard& g) { return g.what == ref.name; });
    if (r != adapter_readers_.end() && !r->second.empty() && !listed) {
      out.guards.push_back(ReadGuard{ref.name, r->second});
    }
  }
  for (ReadGuard& g : out.guards) g.what = absl::StrCat("adapter \"", g.what, "\"");
  return out;
}

bool Catalog::AnyHolderAdmits(const Checkpoint& c,
                              absl::FunctionRef<bool(const ReaderList&)> admits) const {
  // The same bytes under several holders: readable if any holder admits
  // the asker (a public one admits everyone). Only the loaded models and
  // adapters count: a copy kept alive by leases alone is not offered.
  absl::MutexLock lock(&mu_);
  for (const auto& [name, m] : models_) {
    if (m->checkpoint.get() != &c) continue;
    if (admits(m->readers)) return true;
  }
  for (const auto& [name, a] : adapters_) {
    const auto* kept = static_cast<const AdapterFileBytes*>(a->fetched.get());
    if (kept == nullptr || kept->first.get() != &c) continue;
    auto readers = adapter_readers_.find(name);
    const ReaderList none;
    if (admits(readers != adapter_readers_.end() ? readers->second : none)) return true;
  }
  return false;
}

std::vector<std::string> Catalog::PruneUnleased() {
  std::vector<std::string> retired;
  absl::MutexLock lock(&mu_);
  for (auto& [name, model] : models_) {
    std::shared_ptr<Model> next = WithoutUnleased(*model, &retired);
    if (next != nullptr) model = std::move(next);
  }
  return retired;
}

absl::StatusOr<std::optional<GenerationInfo>> Catalog::WaitForGeneration(
    const std::string& model_name, uint64_t after, absl::Duration timeout) {
  absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  while (true) {
    auto it = models_.find(model_name);
    if (it == models_.end()) return ModelNotLoaded(model_name);
    const Generation& gen = *it->second->current;
    if (gen.number > after) return std::optional<GenerationInfo>(InfoOf(*it->second, gen));
    if (generation_changed_.WaitWithDeadline(&mu_, deadline)) {
      return std::optional<GenerationInfo>();
    }
  }
}

absl::Status Catalog::Commit(StateRecord& record, absl::FunctionRef<absl::Status()> check,
                             absl::FunctionRef<void()> publish) {
  return committer_.Commit(record, check, publish);
}

std::shared_ptr<const Model> Catalog::ModelLocked(const std::string& name) const {
  auto it = models_.find(name);
  return it == models_.end() ? nullptr : it->second;
}

uint64_t Catalog::AdapterSeqLocked(const std::string& name) const {
  auto seq = adapter_seq_.find(name);
  return seq == adapter_seq_.end() ? 0 : seq->second;
}

bool Catalog::HasAdapterLocked(const std::string& name) const { return adapters_.contains(name); }

void Catalog::PublishLoadedLocked(const std::string& name, std::shared_ptr<const Model> model) {
  loading_.erase(name);
  load_ended_.SignalAll();
  models_[name] = std::move(model);
}

void Catalog::ReplaceModelLocked(const std::string& name, std::shared_ptr<const Model> model) {
  models_[name] = std::move(model);
  generation_changed_.SignalAll();
}

GenerationInfo Catalog::InstallGenerationLocked(const std::string& name,
                                                std::shared_ptr<Generation> gen,
                                                std::vector<uint64_t>* retired) {
  auto it = models_.find(name);
  std::shared_ptr<Model> next = WithGeneration(*it->second, gen, retired);
  it->second = next;
  generation_changed_.SignalAll();
  return InfoOf(*next, *gen);
}

std::shared_ptr<const Model> Catalog::EraseModelLocked(const std::string& name) {
  auto it = models_.find(name);
  std::shared_ptr<const Model> dropped = std::move(it->second);
  models_.erase(it);
  generation_changed_.SignalAll();
  return dropped;
}

void Catalog::AddAdapterLocked(const std::string& name, std::shared_ptr<const Adapter> adapter,
                               uint64_t seq, AdapterSummary info, ReaderList readers) {
  adapters_.emplace(name, std::move(adapter));
  adapter_seq_[name] = seq;
  adapter_info_[name] = std::move(info);
  adapter_readers_[name] = std::move(readers);
}

void Catalog::EraseAdapterLocked(const std::string& name) {
  adapters_.erase(name);
  adapter_seq_.erase(name);
  adapter_info_.erase(name);
  adapter_readers_.erase(name);
}

}  // namespace weightd
