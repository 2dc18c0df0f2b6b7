// Published weights kept across restarts (--state-dir; docs/restarts.md).
//
// A publish lives in the daemon's memory; its journal record (kPublish)
// names the file its weights are saved to, `published/<model>-<G>.safetensors`
// under the state directory (<model> is the digest of the model's name, so
// any name makes a valid file name), and this store writes that file in the
// background after the publish is visible: the published tensors as they
// are stored (checkpoint part names, the model's dtypes and shapes), into a
// temporary file that is fsync()ed and renamed into place, then the
// directory fsync()ed — so a file that exists is whole. A restore loads it
// and serves it only if the generation it rebuilds has the identity the
// record journaled. A save still queued when a newer publish of the same
// model arrives is dropped (the newer one supersedes it); once a model's
// newest file is written, its older files are removed, and an unload
// removes them all. A daemon that stops cleanly finishes its saves first;
// one that crashes before a save is done restarts serving the files'
// weights and says so (restore_skipped).
//
// The files are named, written, renamed and removed relative to the
// directory (StateDir: owned by the daemon, writable by no other user, no
// link followed).
//
// Thread-safe. Writes at the lowest I/O-friendly CPU priority, on one thread
// started with the first save.
#ifndef WEIGHTD_SERVER_STATE_PUBLISHED_STORE_H_
#define WEIGHTD_SERVER_STATE_PUBLISHED_STORE_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/file_opener.h"
#include "server/state/state_dir.h"
#include "server/store/checkpoint.h"

namespace weightd {

// Writes `tensors` (host memory) as one safetensors file `name` in `dir`:
// a temporary file beside it, fsync()ed, renamed over `name`, the directory
// fsync()ed. Names must be unique. On failure nothing is left at `name`
// that was not there before.
absl::Status WriteSafetensorsFile(const StateDir& dir, const std::string& name,
                                  absl::Span<const std::shared_ptr<const StoredTensor>> tensors);

class PublishedStore {
 public:
  // The files go in `state_dir`/published (created 0700 when first needed,
  // checked as StateDir::Subdir says whenever it is used).
  explicit PublishedStore(std::shared_ptr<const StateDir> state_dir);
  ~PublishedStore();  // finishes the saves queued, then joins
  PublishedStore(const PublishedStore&) = delete;
  PublishedStore& operator=(const PublishedStore&) = delete;

  // The directory's path, for messages.
  const std::string& dir() const { return dir_; }
  // The file model `model`'s generation `generation` is saved as: its name
  // (what the journal records: the state directory may move) and path.
  std::string FileName(const std::string& model, uint64_t generation) const;
  std::string PathFor(const std::string& model, uint64_t generation) const;
  // The path of a file name FileName() gave; INVALID_ARGUMENT for a name
  // that could lead elsewhere ("/", "..").
  absl::StatusOr<std::string> PathOf(const std::string& file_name) const;
  // Opens the saved files for a load (of PathOf(name)); NOT_FOUND when
  // nothing was saved, FAILED_PRECONDITION when the directory is not the
  // daemon's own (StateDir).
  absl::StatusOr<std::shared_ptr<const FileOpener>> Reader() const;

  // Queues saving `tensors` as PathFor(model, generation).
  void Save(const std::string& model, uint64_t generation,
            std::vector<std::shared_ptr<const StoredTensor>> tensors) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes the model's files once the saves queued before are done.
  void Forget(const std::string& model) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes every file of the directory but those named `keep` (FileName()s;
  // after a restore: the files of models not restored, or superseded, are
  // garbage).
  void KeepOnly(const std::set<std::string>& keep) ABSL_LOCKS_EXCLUDED(mu_);
  // Blocks until nothing is queued or being written, or `timeout` passes;
  // true when idle. For tests and `stats`.
  bool WaitIdle(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);

  struct Stats {
    uint64_t saved = 0;        // files written
    uint64_t saved_bytes = 0;  // their tensor bytes
    uint64_t dropped = 0;      // saves superseded before they were written
    uint64_t failed = 0;       // saves that failed (logged: published_save_failed)
    uint64_t pending = 0;      // queued or being written now
  };
  Stats stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Job {
    std::string model;
    uint64_t generation = 0;  // 0: forget the model's files
    std::vector<std::shared_ptr<const StoredTensor>> tensors;
  };
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);
  void Run(Job& job);
  std::string ModelPrefix(const std::string& model) const;

  const std::shared_ptr<const StateDir> state_dir_;
  const std::string dir_;  // its published/, for messages
  mutable absl::Mutex mu_;
  std::deque<Job> queue_ ABSL_GUARDED_BY(mu_);
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  Stats stats_ ABSL_GUARDED_BY(mu_);
  std::thread thread_ ABSL_GUARDED_BY(mu_);
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_STATE_PUBLISHED_STORE_H_
