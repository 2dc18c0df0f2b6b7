// Catalog: the loaded models (immutable Model snapshots) and adapters by
// name, the names being loaded, and the journaled, atomic swap of what is
// served (Commit, through its ChangeCommitter). Readers get snapshots and
// read them without a lock; a change builds a new snapshot outside the
// lock and swaps it in under it.
//
// Thread-safe. One mutex, mu_, taken after the committer's
// (ChangeCommitter::mu_ -> Catalog::mu_ -> PublishService::mu_); nothing
// that blocks runs under it, and nothing else is taken while it is held
// but the leaf locks of the callbacks a change runs (check, publish).
//
// Owns: the registries (models_, loading_, adapters_ and what is kept per
// adapter: summary, readers, the journal seq of its load), the condition
// variable generation waiters sleep on, and the ChangeCommitter.
#ifndef WEIGHTD_SERVER_SERVICE_CATALOG_H_
#define WEIGHTD_SERVER_SERVICE_CATALOG_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/cancel.h"
#include "server/adapter/adapter.h"
#include "server/auth/access_control.h"
#include "server/service/change_committer.h"
#include "server/service/model.h"
#include "server/service/types.h"
#include "server/state/state_journal.h"
#include "server/store/checkpoint.h"

namespace weightd {

class Catalog {
 public:
  // `sink`: where committed records go (ChangeCommitter::Sink).
  explicit Catalog(ChangeCommitter::Sink sink);
  Catalog(const Catalog&) = delete;
  Catalog& operator=(const Catalog&) = delete;

  // Lookups. NOT_FOUND "model \"x\" is not loaded" for an unknown name.
  absl::StatusOr<std::shared_ptr<const Model>> FindModel(const std::string& name) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Every loaded model as it is now, in no order.
  std::vector<std::shared_ptr<const Model>> Models() const ABSL_LOCKS_EXCLUDED(mu_);
  bool HasAdapter(const std::string& name) const ABSL_LOCKS_EXCLUDED(mu_);
  size_t AdapterCount() const ABSL_LOCKS_EXCLUDED(mu_);
  // The loaded adapters' summaries, by name.
  std::vector<AdapterSummary> ListAdapters() const ABSL_LOCKS_EXCLUDED(mu_);

  // Loads: a name is reserved while its model loads (ALREADY_EXISTS "model
  // \"x\" is already loaded" when it is loaded or being loaded), with the
  // load's cancellation, then either published (PublishLoadedLocked, in a
  // Commit) or given back (CancelLoad, once the load freed what it had).
  absl::Status ReserveLoad(const std::string& name, std::shared_ptr<Cancellation> cancel)
      ABSL_LOCKS_EXCLUDED(mu_);
  void CancelLoad(const std::string& name) ABSL_LOCKS_EXCLUDED(mu_);
  // If `name` is being loaded: cancels that load (`why`) and waits up to
  // `timeout` for it to end (its name given back or published); false when
  // no load of `name` was running. DEADLINE_EXCEEDED when it has not
  // ended in time.
  absl::StatusOr<bool> CancelLoading(const std::string& name, const std::string& why,
                                     absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);

  // What an apply of `stack` on `model_name` starts from, read at once:
  // the model, the adapters (NOT_FOUND for an unknown model or adapter),
  // the journal seq of each adapter's load, and a guard per private
  // adapter ("adapter \"x\"", once each).
  struct StackOf {
    std::shared_ptr<const Model> model;
    std::vector<std::shared_ptr<const Adapter>> adapters;
    std::vector<uint64_t> seqs;
    std::vector<ReadGuard> guards;
  };
  absl::StatusOr<StackOf> ResolveStack(const std::string& model_name,
                                       const std::vector<AdapterRef>& stack) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Whether a loaded model or adapter holding `c` has readers `admits`
  // accepts (a copy kept alive by leases alone is not counted).
  bool AnyHolderAdmits(const Checkpoint& c,
                       absl::FunctionRef<bool(const ReaderList&)> admits) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Drops from every model the generations that are neither current nor
  // leased; their materializer tags ("name#number").
  std::vector<std::string> PruneUnleased() ABSL_LOCKS_EXCLUDED(mu_);

  // Blocks until `model` has a generation > `after` (its info), or
  // `timeout` passes (nullopt). NOT_FOUND when the model is not loaded.
  absl::StatusOr<std::optional<GenerationInfo>> WaitForGeneration(const std::string& model,
                                                                  uint64_t after,
                                                                  absl::Duration timeout)
      ABSL_LOCKS_EXCLUDED(mu_);

  // One change of what is served (ChangeCommitter::Commit): `check` (under
  // mu_) may refuse it, and then nothing is journaled; else the record
  // gets the next seq and reaches the sink, and `publish` (under mu_; no
  // other change ran meanwhile) makes it visible with the *Locked calls.
  absl::Status Commit(StateRecord& record, absl::FunctionRef<absl::Status()> check,
                      absl::FunctionRef<void()> publish) ABSL_LOCKS_EXCLUDED(mu_);
  // The lock check and publish run under (for their annotations).
  absl::Mutex& mu() const ABSL_LOCK_RETURNED(mu_) { return mu_; }

  // Under mu_, for a change's check and publish.
  // The model, or null when not loaded.
  std::shared_ptr<const Model> ModelLocked(const std::string& name) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The journal seq of adapter `name`'s load (0: not loaded).
  uint64_t AdapterSeqLocked(const std::string& name) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool HasAdapterLocked(const std::string& name) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The reserved name's model becomes loaded.
  void PublishLoadedLocked(const std::string& name, std::shared_ptr<const Model> model)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Replaces loaded model `name` (a new snapshot of it); wakes waiters.
  void ReplaceModelLocked(const std::string& name, std::shared_ptr<const Model> model)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes `gen` loaded model `name`'s current generation (WithGeneration:
  // the retired numbers go to `retired`) and wakes waiters.
  GenerationInfo InstallGenerationLocked(const std::string& name, std::shared_ptr<Generation> gen,
                                         std::vector<uint64_t>* retired)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes loaded model `name` and returns it; wakes waiters.
  std::shared_ptr<const Model> EraseModelLocked(const std::string& name)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AddAdapterLocked(const std::string& name, std::shared_ptr<const Adapter> adapter,
                        uint64_t seq, AdapterSummary info, ReaderList readers)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseAdapterLocked(const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

 private:
  // Own synchronization (its lock is taken before mu_).
  ChangeCommitter committer_;

  // Protected by mu_.
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<const Model>> models_ ABSL_GUARDED_BY(mu_);
  // The names being loaded, with their loads' cancellations.
  absl::flat_hash_map<std::string, std::shared_ptr<Cancellation>> loading_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::shared_ptr<const Adapter>> adapters_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, AdapterSummary> adapter_info_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, ReaderList> adapter_readers_ ABSL_GUARDED_BY(mu_);
  // The journal seq of each loaded adapter's load (apply records name it).
  absl::flat_hash_map<std::string, uint64_t> adapter_seq_ ABSL_GUARDED_BY(mu_);
  // Signalled whenever a model's current generation changes or it unloads.
  absl::CondVar generation_changed_;
  // Signalled whenever a load ends (its name published or given back).
  absl::CondVar load_ended_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_SERVICE_CATALOG_H_
