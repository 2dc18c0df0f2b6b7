// What the daemon serves, recorded so that a restarted daemon (--state-dir)
// serves it again: a journal of the changes the operators made (model and
// adapter loads and unloads, applies), and its replay into a restore plan.
//
// The journal is an append-only file of records, each
//   "WDJ1" | u32 payload length (LE) | 16-byte digest of the payload | payload (JSON)
// written with one write() and fdatasync()ed before the change is visible
// to any client (WeightService publishes it after the sink returns), so a
// crash at any instant loses no change anybody saw, and leaves at most one
// partial record at the end. Reading checks every record on its own: a
// damaged one (bad digest, bad JSON, cut short) is reported with its offset
// and skipped, and reading resumes at the next "WDJ1" — the records after it
// are still restored.
//
// A restore writes a fresh journal beside the old one (journal.new: the
// records of what it restored, and of what clients change meanwhile) and
// replaces the old one with it atomically (rename + directory fsync) when
// it is done; a crash during a restore leaves the old journal in place.
//
// The journal lives in a StateDir (state_dir.h): a directory of the
// daemon's own that no other user may write, every file in it opened
// relative to it and never through a link.
#ifndef WEIGHTD_SERVER_STATE_STATE_JOURNAL_H_
#define WEIGHTD_SERVER_STATE_STATE_JOURNAL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/state/state_dir.h"

namespace weightd {

// The highest generation number a model may have (2^62): more than any
// model can use up, and far enough below 2^64 that no number the daemon
// computes from one wraps. A journal record naming a higher one (a floor:
// one past it, "no number left") is damage: reported and skipped as such.
inline constexpr uint64_t kMaxGeneration = uint64_t{1} << 62;

// The number of a model's next generation: past `current`, at least
// `floor`. FAILED_PRECONDITION when that is past kMaxGeneration (numbers
// never wrap to ones the model had).
absl::StatusOr<uint64_t> NextGenerationNumber(absl::string_view model, uint64_t current,
                                              uint64_t floor);

struct StateRecord {
  enum class Kind { kModelLoad, kModelUnload, kAdapterLoad, kAdapterUnload, kApply, kFloor, kPublish };
  Kind kind = Kind::kModelLoad;
  uint64_t seq = 0;  // the order the service committed the changes in
  std::string name;  // the model (kApply, kFloor too) or adapter
  // Loads.
  std::string path;
  std::string profile_json;          // model loads
  std::vector<std::string> readers;  // ReaderList syntax
  std::string format;                // adapter loads
  bool strict = false;               // adapter loads
  // kPublish: new base weights published; `path` is the file they are saved
  // to in the background (published_store.h; empty: not saved), `stack`
  // the adapter stack the generation merged. A restore serves the file only
  // if it is there and rebuilds the journaled identity; else it reports the
  // publish and serves the files' weights under a later number.
  // kApply: the stack; kApply/kModelLoad/kPublish: the generation made (1 for a load);
  // kFloor: the lowest number the model's next generation may have.
  std::vector<std::pair<std::string, float>> stack;
  // kApply: the seq of the load record of each stack adapter (0: unknown).
  std::vector<uint64_t> stack_seqs;
  uint64_t generation = 0;
  // kModelLoad/kApply: the served content's identity (hex), checked on restore.
  std::string content;
  // kModelLoad of a URL (docs/sources.md): every object it read, with the
  // version (ETag) and size it had; a restore loads the model only while
  // they still match.
  struct SourceObject {
    std::string url;
    std::string version;
    uint64_t size = 0;
  };
  std::vector<SourceObject> objects;
};

const char* StateRecordKindName(StateRecord::Kind kind);
// "model load \"m\" (seq 3)", for messages.
std::string DescribeRecord(const StateRecord& record);

std::string EncodeStateRecord(const StateRecord& record);  // header + payload
absl::StatusOr<StateRecord> DecodeStatePayload(const std::string& payload);

struct JournalProblem {
  uint64_t offset = 0;  // of the damaged bytes in the file
  std::string what;
};

struct JournalContents {
  std::vector<StateRecord> records;  // intact ones, in file order
  std::vector<JournalProblem> problems;
};

// Parses journal bytes (any damage reported, never fatal).
JournalContents ParseJournal(const std::string& bytes);

// The state the records leave, and what a restore must do to reach it.
struct RestorePlan {
  struct ModelEntry {
    StateRecord load;
    bool has_apply = false;
    StateRecord apply;            // the current stack, if any apply came after the load
    uint64_t max_generation = 1;  // the highest number the model had
    // The adapter loads its stack needs, as they were when it was applied
    // (one per stack entry, same order; empty name = no load record found).
    std::vector<StateRecord> stack_adapters;
    // The last publish after the load (publish.seq == 0: none), and the
    // adapter loads its stack needs (as stack_adapters). Its weights are
    // in publish.path, if they were saved: an apply recorded after the first
    // publish can be restored only on top of the last one.
    StateRecord publish;
    std::vector<StateRecord> publish_stack_adapters;
    uint64_t first_publish_seq = 0;  // every apply after it merged published weights
  };
  std::vector<ModelEntry> models;      // in load order
  std::vector<StateRecord> adapters;   // loaded at the end, in load order
  size_t entries() const { return models.size() + adapters.size(); }
};

// Replays `records` in seq order.
RestorePlan PlanRestore(std::vector<StateRecord> records);

// Checks what a state directory holds where the daemon keeps its state:
// journal, journal.new and skipped.log must be regular files of the
// daemon's own (one link each), published/ a directory of its own that no
// other user may write, handover.sock a socket; each may be missing.
// FAILED_PRECONDITION naming the first that is not so (StateDir::Check):
// the daemon does not start on a state directory someone else arranged.
absl::Status CheckStateDirEntries(const StateDir& dir);

class StateJournal {
 public:
  // Checks `dir`'s entries (CheckStateDirEntries); reads `dir`/journal when
  // present; creates `dir`/journal.new (emptied) for the records to come.
  static absl::StatusOr<std::unique_ptr<StateJournal>> Open(std::shared_ptr<const StateDir> dir);
  // StateDir::Open(dir, the effective uid), then Open(); for tests and tools.
  static absl::StatusOr<std::unique_ptr<StateJournal>> Open(const std::string& dir);
  ~StateJournal();

  // What the existing journal held (empty for a new state directory).
  const JournalContents& previous() const { return previous_; }
  const std::string& dir() const { return dir_->path(); }

  // Appends and fdatasync()s. Thread-safe.
  absl::Status Append(const StateRecord& record) ABSL_LOCKS_EXCLUDED(mu_);
  // journal.new becomes the journal (rename, directory fsync); appends
  // continue into it. Idempotent.
  absl::Status Commit() ABSL_LOCKS_EXCLUDED(mu_);
  // Appends one line (JSON) to `dir`/skipped.log: an entry a restore could
  // not restore, with the reason, for the operator. A skipped.log that is
  // not the daemon's own file is not written (state_skipped_log_failed).
  void RecordSkipped(const StateRecord& record, const std::string& reason);

 private:
  StateJournal(std::shared_ptr<const StateDir> dir, int fd, JournalContents previous)
      : dir_(std::move(dir)), fd_(fd), previous_(std::move(previous)) {}

  const std::shared_ptr<const StateDir> dir_;
  absl::Mutex mu_;
  int fd_ ABSL_GUARDED_BY(mu_) = -1;
  bool committed_ ABSL_GUARDED_BY(mu_) = false;
  const JournalContents previous_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_STATE_STATE_JOURNAL_H_
