#include "server/state/restore.h"

#include <map>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"

namespace weightd {

RestoreReport RestoreState(WeightService& service, const RestorePlan& plan,
                           StateJournal* journal) {
  RestoreReport report;
  report.entries = plan.entries();
  const absl::Time start = absl::Now();
  LogEvent(LogLevel::kInfo, "restore_begin",
           {{"models", absl::StrCat(plan.models.size())},
            {"adapters", absl::StrCat(plan.adapters.size())}});
  size_t n = 0;
  auto progress = [&](const StateRecord& r) {
    ++n;
    LogEvent(LogLevel::kInfo, "restore_entry",
             {{"entry", DescribeRecord(r)}, {"n", absl::StrCat(n)},
              {"of", absl::StrCat(report.entries)}});
  };
  auto skip = [&](const StateRecord& r, const std::string& reason) {
    LogEvent(LogLevel::kWarning, "restore_skipped",
             {{"entry", DescribeRecord(r)}, {"path", r.path}, {"reason", reason}});
    if (journal != nullptr) journal->RecordSkipped(r, reason);
    report.skipped.emplace_back(DescribeRecord(r), reason);
  };
  std::map<std::string, uint64_t> adapters;  // loaded now: name -> record seq
  auto load_adapter = [&](const StateRecord& r) -> absl::Status {
    auto it = adapters.find(r.name);
    if (it != adapters.end() && it->second == r.seq) return absl::OkStatus();
    if (it != adapters.end()) {
      (void)service.UnloadAdapter(r.name);
      adapters.erase(it);
    }
    auto loaded = service.LoadAdapter(r.name, r.path, r.format, r.strict, r.readers);
    if (!loaded.ok()) return loaded.status();
    adapters[r.name] = r.seq;
    return absl::OkStatus();
  };

  for (const RestorePlan::ModelEntry& e : plan.models) {
    const std::string& name = e.load.name;
    progress(e.load);
    auto loaded = service.LoadModel(name, e.load.path, e.load.profile_json, nullptr,
                                    e.load.readers);
    if (!loaded.ok()) {
      skip(e.load, std::string(loaded.status().message()));
      continue;
    }
    if (!e.load.content.empty() && loaded->content.Hex() != e.load.content) {
      (void)service.UnloadModel(name);
      skip(e.load, "its files changed since it was loaded (the served content differs); "
                   "not served");
      continue;
    }
    uint64_t current = 1;
    bool as_was = true;
    if (e.has_apply) {
      std::string why;
      std::vector<AdapterRef> stack;
      for (size_t i = 0; i < e.apply.stack.size() && why.empty(); ++i) {
        const auto& [adapter, strength] = e.apply.stack[i];
        stack.push_back(AdapterRef{adapter, strength});
        const StateRecord& rec = e.stack_adapters[i];
        if (rec.name.empty()) {
          why = absl::StrCat("adapter \"", adapter, "\" of its stack has no intact load record");
        } else if (absl::Status s = load_adapter(rec); !s.ok()) {
          why = absl::StrCat("adapter \"", adapter, "\" of its stack: ", s.message());
        }
      }
      if (why.empty()) {
        auto applied = service.RestoreApply(name, stack, e.apply.generation);
        if (!applied.ok()) {
          why = std::string(applied.status().message());
        } else if (!e.apply.content.empty() && applied->content.Hex() != e.apply.content) {
          why = "the stack merges to other bytes than before (an adapter file changed?)";
          // Back to the base (its own bytes), under a number never used.
          auto base = service.RestoreApply(name, {}, e.max_generation + 1);
          current = base.ok() ? base->generation : applied->generation;
        } else {
          current = applied->generation;
        }
      }
      if (!why.empty()) {
        as_was = false;
        skip(e.apply, absl::StrCat(why, "; model \"", name, "\" serves its base"));
      }
    }
    if (current <= e.max_generation) {
      (void)service.SetGenerationFloor(name, e.max_generation + 1);
    }
    if (as_was) ++report.restored;
  }
  // The adapters loaded at the end (a stack may have needed older ones).
  std::map<std::string, uint64_t> wanted;
  for (const StateRecord& r : plan.adapters) wanted[r.name] = r.seq;
  for (auto it = adapters.begin(); it != adapters.end();) {
    auto w = wanted.find(it->first);
    if (w == wanted.end() || w->second != it->second) {
      (void)service.UnloadAdapter(it->first);
      it = adapters.erase(it);
    } else {
      ++it;
    }
  }
  for (const StateRecord& r : plan.adapters) {
    progress(r);
    if (absl::Status s = load_adapter(r); !s.ok()) {
      skip(r, std::string(s.message()));
    } else {
      ++report.restored;
    }
  }
  LogEvent(LogLevel::kInfo, "restore_done",
           {{"restored", absl::StrCat(report.restored)},
            {"skipped", absl::StrCat(report.skipped.size())},
            {"seconds", absl::StrCat(absl::ToDoubleSeconds(absl::Now() - start))}});
  return report;
}

}  // namespace weightd
