#include "server/state/restore.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"

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

}  // namespace

RestoreReport RestoreState(WeightService& service, const RestorePlan& plan,
                           StateJournal* journal, const std::function<bool()>& stop,
                           uint64_t floor_margin) {
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
    report.skipped_names.insert(r.name);
  };
  auto stopped = [&]() {
    if (!stop || !stop()) return false;
    report.interrupted = true;
    return true;
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
    if (stopped()) break;
    const std::string& name = e.load.name;
    progress(e.load);
    // Next numbers past every number the model had (and past any a damaged
    // record may have held: floor_margin), saturating at one past the
    // largest number (the model then has none left; records past that
    // were refused as damage when the journal was read).
    const uint64_t max = std::min(e.max_generation, kMaxGeneration);
    const uint64_t floor = max + 1 + std::min(floor_margin, kMaxGeneration - max);
    WeightService::RestoreExpect expect;
    expect.generation_floor = floor;
    if (!ParseIdentity(e.load.content, &expect.content)) {
      skip(e.load, "the record has no valid content identity");
      continue;
    }
    // Published only if its content is what the record describes. Long
    // loads say how far they are, every tenth of the bytes.
    auto tenth = std::make_shared<std::atomic<int>>(0);
    LoadProgressFn on_progress = [tenth, &name](const LoadProgressInfo& p) {
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
    auto loaded = service.RestoreLoadModel(name, e.load.path, e.load.profile_json,
                                           e.load.readers, expect, on_progress);
    if (!loaded.ok()) {
      skip(e.load, std::string(loaded.status().message()));
      continue;
    }
    // The stack a record merged, its adapters loaded as they were then;
    // "" or why not.
    auto load_stack = [&](const StateRecord& r, const std::vector<StateRecord>& loads,
                          std::vector<AdapterRef>* stack, Digest* content) -> std::string {
      if (!ParseIdentity(r.content, content)) return "the record has no valid content identity";
      for (size_t i = 0; i < r.stack.size(); ++i) {
        const auto& [adapter, strength] = r.stack[i];
        stack->push_back(AdapterRef{adapter, strength});
        const StateRecord& rec = i < loads.size() ? loads[i] : StateRecord{};
        if (rec.name.empty()) {
          return absl::StrCat("adapter \"", adapter, "\" of its stack has no intact load record");
        }
        if (absl::Status s = load_adapter(rec); !s.ok()) {
          return absl::StrCat("adapter \"", adapter, "\" of its stack: ", s.message());
        }
      }
      return "";
    };
    bool as_was = true;
    bool published = false;  // the last publish restored
    if (e.publish.seq != 0) {
      std::vector<AdapterRef> stack;
      Digest content;
      std::string why = load_stack(e.publish, e.publish_stack_adapters, &stack, &content);
      if (why.empty()) {
        // Served only if it rebuilds the generation the record describes.
        auto restored = service.RestorePublish(name, e.publish.path, stack,
                                               e.publish.generation, content);
        if (!restored.ok()) why = std::string(restored.status().message());
      }
      if (why.empty()) {
        published = true;
        report.published_files.insert(e.publish.path);
      } else {
        as_was = false;
        skip(e.publish, absl::StrCat("published weights (generation ", e.publish.generation,
                                     ") not restored: ", why, "; model \"", name,
                                     "\" serves the weights of its files"));
      }
    }
    if (e.has_apply && published && e.apply.seq < e.publish.seq) {
      // The restored publish merged this stack already.
    } else if (e.has_apply && !published && e.first_publish_seq != 0 &&
               e.apply.seq > e.first_publish_seq) {
      skip(e.apply, absl::StrCat("it was applied on published weights, which were not "
                                 "restored; model \"", name, "\" serves its base"));
    } else if (e.has_apply) {
      std::vector<AdapterRef> stack;
      Digest content;
      std::string why = load_stack(e.apply, e.stack_adapters, &stack, &content);
      if (why.empty()) {
        // Published only if it merges to the bytes it had.
        auto applied = service.RestoreApply(name, stack, e.apply.generation, content);
        if (!applied.ok()) why = std::string(applied.status().message());
      }
      if (!why.empty()) {
        as_was = false;
        skip(e.apply, absl::StrCat(why, "; model \"", name, "\" serves ",
                                   published ? "its published weights" : "its base"));
      }
    }
    // Journaled, so that the next restart keeps it.
    (void)service.SetGenerationFloor(name, floor);
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
    if (stopped()) break;
    progress(r);
    if (absl::Status s = load_adapter(r); !s.ok()) {
      skip(r, std::string(s.message()));
    } else {
      ++report.restored;
    }
  }
  LogEvent(report.interrupted ? LogLevel::kWarning : LogLevel::kInfo, "restore_done",
           {{"restored", absl::StrCat(report.restored)},
            {"skipped", absl::StrCat(report.skipped.size())},
            {"interrupted", report.interrupted ? "yes (a signal)" : "no"},
            {"seconds", absl::StrCat(absl::ToDoubleSeconds(absl::Now() - start))}});
  return report;
}

}  // namespace weightd
