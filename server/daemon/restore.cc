#include "server/daemon/restore.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/base/log.h"

namespace weightd {
namespace {

// The content identity a record carries (32 hex digits, Digest::Hex()).
bool ParseIdentity(const std::string& hex, Digest* out) {
  if (hex.size() != 2 * out->bytes.size() ||
      !std::all_of(hex.begin(), hex.end(), [](char c) { return absl::ascii_isxdigit(c); })) {
    return false;
  }
  const std::string bytes = absl::HexStringToBytes(hex);
  std::memcpy(out->bytes.data(), bytes.data(), out->bytes.size());
  return true;
}

// Long loads say how far they are, every tenth of the bytes
// (restore_progress).
LoadProgressFn LogEveryTenth(const std::string& name) {
  auto tenth = std::make_shared<std::atomic<int>>(0);
  return [tenth, name](const LoadProgressInfo& p) {
    if (p.bytes_total == 0) return;
    const int now = static_cast<int>(10 * p.bytes_done / p.bytes_total);
    int was = tenth->load();
    while (now > was && !tenth->compare_exchange_weak(was, now)) {
    }
    if (now > was && now < 10) {
      LogEvent(LogLevel::kInfo, "restore_progress",
               {{"model", name}, {"percent", absl::StrCat(10 * now)},
                {"bytes_done", absl::StrCat(p.bytes_done)},
                {"bytes_total", absl::StrCat(p.bytes_total)}});
    }
  };
}

// One restore (RestoreState): the models with their publishes and stacks,
// then the adapters loaded at the end. Not thread-safe; lives for one call.
class Restorer {
 public:
  Restorer(WeightService& service, StateJournal* journal, const std::function<bool()>& stop,
           uint64_t floor_margin, size_t entries)
      : service_(service), journal_(journal), stop_(stop), floor_margin_(floor_margin) {
    report_.entries = entries;
  }

  void RestoreModels(const std::vector<RestorePlan::ModelEntry>& models);
  void RestoreAdapters(const std::vector<StateRecord>& adapters);
  const RestoreReport& report() const { return report_; }

 private:
  void RestoreModel(const RestorePlan::ModelEntry& e);
  // The model's last publish; true when it serves it again. Clears
  // `as_was` when it does not.
  bool RestorePublishes(const RestorePlan::ModelEntry& e, bool* as_was);
  // The model's current stack, on what RestorePublishes left it serving.
  void RestoreStack(const RestorePlan::ModelEntry& e, bool published, bool* as_was);
  // The stack a record merged, its adapters loaded as they were then;
  // "" or why not.
  std::string LoadStack(const StateRecord& r, const std::vector<StateRecord>& loads,
                        std::vector<AdapterRef>* stack, Digest* content);
  absl::Status LoadAdapter(const StateRecord& r);
  void Progress(const StateRecord& r);
  void Skip(const StateRecord& r, const std::string& reason);
  bool Stopped();

  // Constant after construction.
  WeightService& service_;
  StateJournal* const journal_;  // may be null
  const std::function<bool()>& stop_;
  const uint64_t floor_margin_;

  // The restore's progress.
  RestoreReport report_;
  size_t n_ = 0;                             // entries begun
  std::map<std::string, uint64_t> adapters_;  // loaded now: name -> record seq
};

void Restorer::Progress(const StateRecord& r) {
  ++n_;
  LogEvent(LogLevel::kInfo, "restore_entry",
           {{"entry", DescribeRecord(r)}, {"n", absl::StrCat(n_)},
            {"of", absl::StrCat(report_.entries)}});
}

void Restorer::Skip(const StateRecord& r, const std::string& reason) {
  LogEvent(LogLevel::kWarning, "restore_skipped",
           {{"entry", DescribeRecord(r)}, {"path", r.path}, {"reason", reason}});
  if (journal_ != nullptr) journal_->RecordSkipped(r, reason);
  report_.skipped.emplace_back(DescribeRecord(r), reason);
  report_.skipped_names.insert(r.name);
}

bool Restorer::Stopped() {
  if (!stop_ || !stop_()) return false;
  report_.interrupted = true;
  return true;
}

absl::Status Restorer::LoadAdapter(const StateRecord& r) {
  auto it = adapters_.find(r.name);
  if (it != adapters_.end() && it->second == r.seq) return absl::OkStatus();
  if (it != adapters_.end()) {
    (void)service_.UnloadAdapter(r.name);
    adapters_.erase(it);
  }
  auto loaded = service_.LoadAdapter(r.name, r.path, r.format, r.strict, r.readers);
  if (!loaded.ok()) return loaded.status();
  adapters_[r.name] = r.seq;
  return absl::OkStatus();
}

std::string Restorer::LoadStack(const StateRecord& r, const std::vector<StateRecord>& loads,
                                std::vector<AdapterRef>* stack, Digest* content) {
  if (!ParseIdentity(r.content, content)) return "the record has no valid content identity";
  for (size_t i = 0; i < r.stack.size(); ++i) {
    const auto& [adapter, strength] = r.stack[i];
    stack->push_back(AdapterRef{adapter, strength});
    const StateRecord& rec = i < loads.size() ? loads[i] : StateRecord{};
    if (rec.name.empty()) {
      return absl::StrCat("adapter \"", adapter, "\" of its stack has no intact load record");
    }
    if (absl::Status s = LoadAdapter(rec); !s.ok()) {
      return absl::StrCat("adapter \"", adapter, "\" of its stack: ", s.message());
    }
  }
  return "";
}

void Restorer::RestoreModels(const std::vector<RestorePlan::ModelEntry>& models) {
  for (const RestorePlan::ModelEntry& e : models) {
    if (Stopped()) break;
    RestoreModel(e);
  }
}

void Restorer::RestoreModel(const RestorePlan::ModelEntry& e) {
  const std::string& name = e.load.name;
  Progress(e.load);
  // Next numbers past every number the model had (and past any a damaged
  // record may have held: floor_margin), saturating at one past the
  // largest number (the model then has none left; records past that
  // were refused as damage when the journal was read).
  const uint64_t max = std::min(e.max_generation, kMaxGeneration);
  const uint64_t floor = max + 1 + std::min(floor_margin_, kMaxGeneration - max);
  WeightService::RestoreExpect expect;
  expect.generation_floor = floor;
  expect.objects = e.load.objects;
  if (!ParseIdentity(e.load.content, &expect.content)) {
    Skip(e.load, "the record has no valid content identity");
    return;
  }
  // Published only if its content is what the record describes.
  auto loaded = service_.RestoreLoadModel(name, e.load.path, e.load.profile_json,
                                          e.load.readers, expect, LogEveryTenth(name));
  if (!loaded.ok()) {
    Skip(e.load, std::string(loaded.status().message()));
    return;
  }
  bool as_was = true;
  const bool published = RestorePublishes(e, &as_was);  // the last publish restored
  RestoreStack(e, published, &as_was);
  // Journaled, so that the next restart keeps it.
  (void)service_.SetGenerationFloor(name, floor);
  if (as_was) ++report_.restored;
}

bool Restorer::RestorePublishes(const RestorePlan::ModelEntry& e, bool* as_was) {
  if (e.publish.seq == 0) return false;
  const std::string& name = e.load.name;
  std::vector<AdapterRef> stack;
  Digest content;
  std::string why = LoadStack(e.publish, e.publish_stack_adapters, &stack, &content);
  if (why.empty()) {
    // Served only if it rebuilds the generation the record describes.
    auto restored =
        service_.RestorePublish(name, e.publish.path, stack, e.publish.generation, content);
    if (!restored.ok()) why = std::string(restored.status().message());
  }
  if (why.empty()) {
    report_.published_files.insert(e.publish.path);
    return true;
  }
  *as_was = false;
  Skip(e.publish, absl::StrCat("published weights (generation ", e.publish.generation,
                               ") not restored: ", why, "; model \"", name,
                               "\" serves the weights of its files"));
  return false;
}

void Restorer::RestoreStack(const RestorePlan::ModelEntry& e, bool published, bool* as_was) {
  const std::string& name = e.load.name;
  if (!e.has_apply) return;
  if (published && e.apply.seq < e.publish.seq) {
    // The restored publish merged this stack already.
    return;
  }
  if (!published && e.first_publish_seq != 0 && e.apply.seq > e.first_publish_seq) {
    Skip(e.apply, absl::StrCat("it was applied on published weights, which were not "
                               "restored; model \"", name, "\" serves its base"));
    return;
  }
  std::vector<AdapterRef> stack;
  Digest content;
  std::string why = LoadStack(e.apply, e.stack_adapters, &stack, &content);
  if (why.empty()) {
    // Published only if it merges to the bytes it had.
    auto applied = service_.RestoreApply(name, stack, e.apply.generation, content);
    if (!applied.ok()) why = std::string(applied.status().message());
  }
  if (!why.empty()) {
    *as_was = false;
    Skip(e.apply, absl::StrCat(why, "; model \"", name, "\" serves ",
                               published ? "its published weights" : "its base"));
  }
}

void Restorer::RestoreAdapters(const std::vector<StateRecord>& adapters) {
  // The adapters loaded at the end (a stack may have needed older ones).
  std::map<std::string, uint64_t> wanted;
  for (const StateRecord& r : adapters) wanted[r.name] = r.seq;
  for (auto it = adapters_.begin(); it != adapters_.end();) {
    auto w = wanted.find(it->first);
    if (w == wanted.end() || w->second != it->second) {
      (void)service_.UnloadAdapter(it->first);
      it = adapters_.erase(it);
    } else {
      ++it;
    }
  }
  for (const StateRecord& r : adapters) {
    if (Stopped()) break;
    Progress(r);
    if (absl::Status s = LoadAdapter(r); !s.ok()) {
      Skip(r, std::string(s.message()));
    } else {
      ++report_.restored;
    }
  }
}

}  // namespace

RestoreReport RestoreState(WeightService& service, const RestorePlan& plan,
                           StateJournal* journal, const std::function<bool()>& stop,
                           uint64_t floor_margin) {
  const absl::Time start = absl::Now();
  LogEvent(LogLevel::kInfo, "restore_begin",
           {{"models", absl::StrCat(plan.models.size())},
            {"adapters", absl::StrCat(plan.adapters.size())}});
  Restorer restorer(service, journal, stop, floor_margin, plan.entries());
  restorer.RestoreModels(plan.models);
  restorer.RestoreAdapters(plan.adapters);
  const RestoreReport& report = restorer.report();
  LogEvent(report.interrupted ? LogLevel::kWarning : LogLevel::kInfo, "restore_done",
           {{"restored", absl::StrCat(report.restored)},
            {"skipped", absl::StrCat(report.skipped.size())},
            {"interrupted", report.interrupted ? "yes (a signal)" : "no"},
            {"seconds", absl::StrCat(absl::ToDoubleSeconds(absl::Now() - start))}});
  return report;
}

}  // namespace weightd
