#include "server/state/state_journal.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/digest.h"
#include "server/base/log.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace weightd {
namespace {

constexpr char kMagic[4] = {'W', 'D', 'J', '1'};
constexpr size_t kHeader = 4 + 4 + 16;
// A record is a few paths and a profile; anything larger is damage.
// Profiles may be up to 64 MiB (kMaxProfileBytes), escaped in JSON.
constexpr uint32_t kMaxPayload = 512u << 20;

absl::Status Errno(int err, const std::string& what) {
  return absl::Status(err == ENOSPC || err == EDQUOT ? absl::StatusCode::kResourceExhausted
                                                     : absl::StatusCode::kInternal,
                      absl::StrCat(what, ": ", std::strerror(err)));
}

absl::Status WriteAll(int fd, const std::string& bytes, const std::string& what) {
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Errno(errno, what);
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

const char* const kKindNames[] = {"model_load", "model_unload", "adapter_load",
                                  "adapter_unload", "apply", "generation_floor", "publish"};

}  // namespace

absl::StatusOr<uint64_t> NextGenerationNumber(absl::string_view model, uint64_t current,
                                              uint64_t floor) {
  const uint64_t number = std::max(current < kMaxGeneration ? current + 1 : kMaxGeneration + 1,
                                   floor);
  if (number > kMaxGeneration) {
    return absl::FailedPreconditionError(absl::StrCat(
        "model \"", model.substr(0, 200), "\" has no generation number left (its next would be ",
        number, ", past the largest, 2^62); unload it and load it again to number anew"));
  }
  return number;
}

const char* StateRecordKindName(StateRecord::Kind kind) {
  return kKindNames[static_cast<int>(kind)];
}

std::string DescribeRecord(const StateRecord& r) {
  std::string what = StateRecordKindName(r.kind);
  std::replace(what.begin(), what.end(), '_', ' ');
  return absl::StrCat(what, " \"", r.name, "\" (seq ", r.seq, ")");
}

std::string EncodeStateRecord(const StateRecord& r) {
  nlohmann::json j;
  j["kind"] = StateRecordKindName(r.kind);
  j["seq"] = r.seq;
  j["name"] = r.name;
  if (!r.path.empty()) j["path"] = r.path;
  if (!r.profile_json.empty()) j["profile"] = r.profile_json;
  if (!r.readers.empty()) j["readers"] = r.readers;
  if (!r.format.empty()) j["format"] = r.format;
  if (r.strict) j["strict"] = true;
  for (const StateRecord::SourceObject& o : r.objects) {
    j["objects"].push_back({{"url", o.url}, {"version", o.version}, {"size", o.size}});
  }
  if (r.kind == StateRecord::Kind::kApply || r.kind == StateRecord::Kind::kPublish) {
    nlohmann::json stack = nlohmann::json::array();
    for (size_t i = 0; i < r.stack.size(); ++i) {
      const uint64_t seq = i < r.stack_seqs.size() ? r.stack_seqs[i] : 0;
      stack.push_back({r.stack[i].first, r.stack[i].second, seq});
    }
    j["stack"] = stack;
  }
  if (r.generation != 0) j["generation"] = r.generation;
  if (!r.content.empty()) j["content"] = r.content;
  // Paths are bytes; one that is not UTF-8 is written with U+FFFD in place
  // of the bad bytes (that entry then fails to restore, reported) instead
  // of throwing.
  const std::string payload = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  const Digest d = DigestBytes(payload.data(), payload.size());
  std::string out(kMagic, 4);
  const uint32_t n = static_cast<uint32_t>(payload.size());
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out.append(reinterpret_cast<const char*>(d.bytes.data()), d.bytes.size());
  out += payload;
  return out;
}

absl::StatusOr<StateRecord> DecodeStatePayload(const std::string& payload) {
  nlohmann::json j = nlohmann::json::parse(payload, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return absl::DataLossError("not a JSON object");
  StateRecord r;
  try {
    const std::string kind = j.at("kind").get<std::string>();
    auto it = std::find(std::begin(kKindNames), std::end(kKindNames), kind);
    if (it == std::end(kKindNames)) {
      return absl::DataLossError(absl::StrCat("unknown kind \"", kind.substr(0, 40), "\""));
    }
    r.kind = static_cast<StateRecord::Kind>(it - std::begin(kKindNames));
    r.seq = j.at("seq").get<uint64_t>();
    r.name = j.at("name").get<std::string>();
    r.path = j.value("path", "");
    r.profile_json = j.value("profile", "");
    r.readers = j.value("readers", std::vector<std::string>{});
    r.format = j.value("format", "");
    r.strict = j.value("strict", false);
    if (j.contains("objects")) {
      for (const auto& o : j.at("objects")) {
        r.objects.push_back({o.at("url").get<std::string>(), o.at("version").get<std::string>(),
                             o.at("size").get<uint64_t>()});
      }
    }
    if (j.contains("stack")) {
      for (const auto& e : j.at("stack")) {
        r.stack.emplace_back(e.at(0).get<std::string>(), e.at(1).get<float>());
        r.stack_seqs.push_back(e.size() > 2 ? e.at(2).get<uint64_t>() : 0);
      }
    }
    r.generation = j.value("generation", uint64_t{0});
    r.content = j.value("content", "");
  } catch (const nlohmann::json::exception& e) {
    return absl::DataLossError(absl::StrCat("malformed record: ", e.what()));
  }
  // A number no model can have (forged, or damage the digest missed):
  // restored, it would make the model's next numbers wrap below ones it had.
  const uint64_t most = r.kind == StateRecord::Kind::kFloor ? kMaxGeneration + 1 : kMaxGeneration;
  if (r.generation > most) {
    return absl::DataLossError(absl::StrCat(
        DescribeRecord(r), ": generation ", r.generation, " is past the largest a model may have (",
        most, "); record not restored"));
  }
  return r;
}

JournalContents ParseJournal(const std::string& bytes) {
  JournalContents out;
  size_t pos = 0;
  auto resync = [&](size_t from) {
    // The next record start after a damaged one.
    size_t next = bytes.find(std::string(kMagic, 4), from);
    return next == std::string::npos ? bytes.size() : next;
  };
  while (pos < bytes.size()) {
    if (bytes.size() - pos < kHeader || std::memcmp(bytes.data() + pos, kMagic, 4) != 0) {
      const bool tail = bytes.size() - pos < kHeader;
      size_t next = resync(pos + 1);
      out.problems.push_back({pos, tail ? "a record cut short (the journal ends inside its header)"
                                        : absl::StrCat(next - pos, " bytes that are no record")});
      pos = next;
      continue;
    }
    uint32_t n = 0;
    for (int i = 0; i < 4; ++i) n |= static_cast<uint32_t>(static_cast<uint8_t>(bytes[pos + 4 + i])) << (8 * i);
    if (n > kMaxPayload || bytes.size() - pos - kHeader < n) {
      size_t next = resync(pos + 4);
      out.problems.push_back(
          {pos, n > kMaxPayload ? absl::StrCat("a record with an impossible length ", n)
                                : "a record cut short (the journal ends inside it)"});
      pos = next;
      continue;
    }
    const std::string payload = bytes.substr(pos + kHeader, n);
    const Digest d = DigestBytes(payload.data(), payload.size());
    if (std::memcmp(d.bytes.data(), bytes.data() + pos + 8, 16) != 0) {
      // Named when what is left of it still reads as a record.
      auto guess = DecodeStatePayload(payload);
      out.problems.push_back(
          {pos, absl::StrCat("a record whose digest does not match its bytes",
                             guess.ok() ? absl::StrCat(" (it reads as ", DescribeRecord(*guess),
                                                       ", not restored)")
                                        : "")});
      pos = resync(pos + 4);
      continue;
    }
    auto rec = DecodeStatePayload(payload);
    if (!rec.ok()) {
      out.problems.push_back({pos, std::string(rec.status().message())});
    } else {
      out.records.push_back(std::move(*rec));
    }
    pos += kHeader + n;
  }
  return out;
}

RestorePlan PlanRestore(std::vector<StateRecord> records) {
  std::stable_sort(records.begin(), records.end(),
                   [](const StateRecord& a, const StateRecord& b) { return a.seq < b.seq; });
  std::map<std::string, RestorePlan::ModelEntry> models;
  std::map<std::string, uint64_t> model_order;
  std::map<std::string, StateRecord> adapters;          // loaded now
  std::map<std::string, StateRecord> last_adapter_load;  // as of the replay point
  std::map<uint64_t, StateRecord> adapter_loads;         // by seq
  // The adapter loads a stack merged: by the seq its record names; records
  // without one: the last load of the name before it.
  auto stack_loads = [&](const StateRecord& r) {
    std::vector<StateRecord> out;
    for (size_t i = 0; i < r.stack.size(); ++i) {
      const uint64_t seq = i < r.stack_seqs.size() ? r.stack_seqs[i] : 0;
      auto by_seq = adapter_loads.find(seq);
      auto last = last_adapter_load.find(r.stack[i].first);
      if (seq != 0) {
        out.push_back(by_seq != adapter_loads.end() && by_seq->second.name == r.stack[i].first
                          ? by_seq->second
                          : StateRecord{});
      } else {
        out.push_back(last == last_adapter_load.end() ? StateRecord{} : last->second);
      }
    }
    return out;
  };
  for (const StateRecord& r : records) {
    switch (r.kind) {
      case StateRecord::Kind::kModelLoad: {
        RestorePlan::ModelEntry e;
        e.load = r;
        models[r.name] = std::move(e);
        model_order[r.name] = r.seq;
        break;
      }
      case StateRecord::Kind::kModelUnload:
        models.erase(r.name);
        break;
      case StateRecord::Kind::kAdapterLoad:
        adapters[r.name] = r;
        last_adapter_load[r.name] = r;
        adapter_loads[r.seq] = r;
        break;
      case StateRecord::Kind::kAdapterUnload:
        adapters.erase(r.name);
        break;
      case StateRecord::Kind::kApply: {
        auto it = models.find(r.name);
        if (it == models.end()) break;
        it->second.has_apply = true;
        it->second.apply = r;
        it->second.max_generation = std::max(it->second.max_generation, r.generation);
        it->second.stack_adapters = stack_loads(r);
        break;
      }
      case StateRecord::Kind::kPublish: {
        auto it = models.find(r.name);
        if (it == models.end()) break;
        it->second.publish = r;
        it->second.publish_stack_adapters = stack_loads(r);
        if (it->second.first_publish_seq == 0) it->second.first_publish_seq = r.seq;
        it->second.max_generation = std::max(it->second.max_generation, r.generation);
        break;
      }
      case StateRecord::Kind::kFloor: {
        auto it = models.find(r.name);
        if (it != models.end()) {
          it->second.max_generation =
              std::max(it->second.max_generation, std::max<uint64_t>(r.generation, 1) - 1);
        }
        break;
      }
    }
  }
  RestorePlan plan;
  for (auto& [name, e] : models) plan.models.push_back(std::move(e));
  std::sort(plan.models.begin(), plan.models.end(),
            [](const RestorePlan::ModelEntry& a, const RestorePlan::ModelEntry& b) {
              return a.load.seq < b.load.seq;
            });
  for (auto& [name, r] : adapters) plan.adapters.push_back(std::move(r));
  std::sort(plan.adapters.begin(), plan.adapters.end(),
            [](const StateRecord& a, const StateRecord& b) { return a.seq < b.seq; });
  return plan;
}

absl::Status CheckStateDirEntries(const StateDir& dir) {
  using K = StateDir::Kind;
  for (const auto& [name, kind] : {std::pair<const char*, K>{"journal", K::kFile},
                                   {"journal.new", K::kFile},
                                   {"skipped.log", K::kFile},
                                   {"published", K::kDirectory},
                                   {"handover.sock", K::kSocket}}) {
    auto checked = dir.Check(name, kind);
    if (!checked.ok() && !absl::IsNotFound(checked.status())) return checked.status();
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<StateJournal>> StateJournal::Open(const std::string& dir) {
  WD_ASSIGN_OR_RETURN(std::shared_ptr<const StateDir> opened, StateDir::Open(dir, ::geteuid()));
  return Open(std::move(opened));
}

absl::StatusOr<std::unique_ptr<StateJournal>> StateJournal::Open(
    std::shared_ptr<const StateDir> dir) {
  WD_RETURN_IF_ERROR(CheckStateDirEntries(*dir));
  JournalContents previous;
  const std::string path = dir->PathOf("journal");
  auto in = dir->OpenToRead("journal");
  if (in.ok()) {
    std::string bytes;
    char buf[1 << 16];
    ssize_t n;
    while ((n = ::read(in->get(), buf, sizeof(buf))) != 0) {
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return Errno(errno, absl::StrCat("reading ", path));
      bytes.append(buf, static_cast<size_t>(n));
    }
    previous = ParseJournal(bytes);
  } else if (!absl::IsNotFound(in.status())) {
    return in.status();
  }
  auto fd = dir->OpenToAppend("journal.new", /*truncate=*/true);
  if (!fd.ok()) return Annotate(fd.status(), "creating the journal");
  return std::unique_ptr<StateJournal>(
      new StateJournal(std::move(dir), fd->release(), std::move(previous)));
}

StateJournal::~StateJournal() {
  absl::MutexLock lock(&mu_);
  if (fd_ >= 0) ::close(fd_);
}

absl::Status StateJournal::Append(const StateRecord& record) {
  const std::string bytes = EncodeStateRecord(record);
  absl::MutexLock lock(&mu_);
  const std::string what =
      absl::StrCat("appending to ", dir_->PathOf(committed_ ? "journal" : "journal.new"));
  if (absl::Status s = WriteAll(fd_, bytes, what); !s.ok()) return s;
  if (::fdatasync(fd_) != 0) return Errno(errno, absl::StrCat("fdatasync ", what));
  return absl::OkStatus();
}

absl::Status StateJournal::Commit() {
  absl::MutexLock lock(&mu_);
  if (committed_) return absl::OkStatus();
  if (::fdatasync(fd_) != 0) return Errno(errno, "fdatasync journal.new");
  WD_RETURN_IF_ERROR(dir_->Rename("journal.new", "journal"));
  WD_RETURN_IF_ERROR(dir_->Sync());
  committed_ = true;
  return absl::OkStatus();
}

void StateJournal::RecordSkipped(const StateRecord& record, const std::string& reason) {
  nlohmann::json j;
  j["entry"] = DescribeRecord(record);
  j["path"] = record.path;
  j["reason"] = reason;
  const std::string line =
      j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  auto fd = dir_->OpenToAppend("skipped.log", /*truncate=*/false);
  absl::Status s = fd.status();
  if (s.ok()) s = WriteAll(fd->get(), line, dir_->PathOf("skipped.log"));
  if (s.ok() && ::fsync(fd->get()) != 0) s = Errno(errno, "fsync skipped.log");
  if (!s.ok()) {
    LogEvent(LogLevel::kError, "state_skipped_log_failed",
             {{"entry", DescribeRecord(record)}, {"error", s.ToString()}});
  }
}

}  // namespace weightd
