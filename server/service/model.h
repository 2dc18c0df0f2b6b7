// The immutable snapshots of what the service serves: a loaded Model, its
// Generations (the adapter stack and published weights on top of the
// checkpoint), and each Served tensor's plan and stored parts. A change
// builds new ones and swaps them in (Catalog, under Catalog::mu_);
// readers hold them by shared_ptr and read them without a lock, except
// Generation::fp8_scales (its own leaf lock, scale_mu).
#ifndef WEIGHTD_SERVER_SERVICE_MODEL_H_
#define WEIGHTD_SERVER_SERVICE_MODEL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/digest.h"
#include "server/adapter/adapter.h"
#include "server/materialize/item.h"
#include "server/memory/host_memory.h"
#include "server/profile/profile.h"
#include "server/auth/access_control.h"
#include "server/service/types.h"
#include "server/store/checkpoint.h"

namespace weightd {

// How many generations' content identities a Model keeps (Model::digests).
inline constexpr size_t kDigestHistory = 256;

using ContentMap = absl::flat_hash_map<std::string, Digest>;
// A served tensor of a model: its plan and its parts in the store.
struct Served {
  ServedTensorPlan plan;
  std::vector<const StoredTensor*> parts;  // borrowed from the checkpoint
};
using PublishedBase = absl::flat_hash_map<std::string, std::shared_ptr<const StoredTensor>>;
// One generation: the adapter stack and the patches it puts on each part
// (keyed by the part's checkpoint name, or served name for new tensors).
struct Generation {
  uint64_t number = 1;
  // Copied into every lease on this generation, and nowhere else: the
  // generation is leased while use_count() > 1 (IsLeased).
  std::shared_ptr<const int> lease_marker = std::make_shared<const int>(0);
  std::vector<AdapterRef> stack;
  std::vector<std::shared_ptr<const Adapter>> adapters;  // kept alive
  absl::flat_hash_map<std::string, std::vector<AppliedPatch>> patches;
  absl::flat_hash_map<std::string, std::vector<std::string>> patched_by;  // served -> adapters
  // Served tensors added by .set_weight (absent from the checkpoint).
  std::vector<Served> added;
  // Published base weights in place of the checkpoint's (by part key: the
  // checkpoint name, or the served name of an allow_new tensor), carried
  // from generation to generation; null = none.
  std::shared_ptr<const PublishedBase> published;
  // The model's served tensors with the published parts in place (the
  // model's own list when nothing is published).
  std::shared_ptr<const std::vector<Served>> served;
  std::shared_ptr<const ContentMap> content;  // served name -> identity
  Digest identity;                            // ContentIdentity(*content)
  // Private adapters of the stack, with their readers as of the apply.
  std::vector<ReadGuard> adapter_guards;
  // FP8 scales (amax / 448) computed on first use, per served tensor.
  mutable absl::Mutex scale_mu;
  mutable absl::flat_hash_map<std::string, float> fp8_scales ABSL_GUARDED_BY(scale_mu);
};
// Immutable; an apply publishes a new Model sharing everything but the
// generation list.
struct Model {
  std::string name;
  // Which load this is (kept by the copies an apply makes): a model
  // unloaded and loaded again under its name is another instance.
  uint64_t instance = 0;
  std::string path;
  std::vector<std::string> files;  // the files its load opened
  std::shared_ptr<const Checkpoint> checkpoint;
  // A model that shares its checkpoint with another (loaded from the same
  // files) holds its own charge for the metadata it builds (names,
  // layout, generations): the checkpoint's own was charged once.
  std::shared_ptr<const MemoryCharge> metadata_charge;
  std::shared_ptr<const Profile> profile;  // null: identity layout
  ReaderList readers;                      // empty: public
  std::shared_ptr<const std::vector<Served>> served;  // sorted by name
  std::shared_ptr<const ServedLayout> layout;
  std::shared_ptr<const Generation> current;
  // Older generations still leased (and the current one).
  std::vector<std::shared_ptr<const Generation>> history;
  // Content identities of the last kDigestHistory generations, leased or
  // not: all --changed-since needs.
  std::vector<std::pair<uint64_t, std::shared_ptr<const ContentMap>>> digests;
  // The next generation's number is at least this (SetGenerationFloor).
  uint64_t generation_floor = 0;
};

// What an adapter loaded with peers keeps of its weights file (Adapter::
// fetched): the one-file checkpoint holding its bytes, and the budget
// charge of a shared copy.
using AdapterFileBytes =
    std::pair<std::shared_ptr<const Checkpoint>, std::shared_ptr<MemoryCharge>>;

// Names of models and adapters: 1 to 128 letters, digits and . _ - / :
// (INVALID_ARGUMENT otherwise, the name escaped).
absl::Status ValidateModelName(const std::string& name);

// The served tensors at `gen`: the model's plus those the generation adds,
// sorted by served name.
std::vector<const Served*> ServedAt(const Model& model, const Generation& gen);
// The model's own readers (none: public), whatever generation is served.
std::vector<ReadGuard> ModelGuards(const Model& model);
// What a read of generation `gen` of `model` must pass: the model's own
// readers and every private adapter of the generation's stack.
std::vector<ReadGuard> GuardsOf(const Model& model, const Generation& gen);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_SERVICE_MODEL_H_
