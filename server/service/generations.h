// Generations of a model: building one (an adapter stack and published
// weights on the checkpoint), installing it in a new Model snapshot,
// pruning the ones nothing holds, describing them, content identities and
// FP8 scales.
//
// Free functions over the immutable snapshots of model.h: no locks of
// their own, except Fp8Scale, which takes the generation's leaf lock
// (Generation::scale_mu). Thread-safe.
#ifndef WEIGHTD_SERVER_SERVICE_GENERATIONS_H_
#define WEIGHTD_SERVER_SERVICE_GENERATIONS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/digest.h"
#include "server/adapter/adapter.h"
#include "server/service/model.h"
#include "server/service/types.h"

namespace weightd {

// A digest over the (served name, identity) pairs of `content`, in name order.
Digest ContentIdentity(const ContentMap& content);

// Generation `number` of `model`: `stack` (adapters[i] is stack[i]'s)
// patched onto the checkpoint, with `published` (if any) in place of its
// parts. INVALID_ARGUMENT for a stack that does not fit the model.
absl::StatusOr<std::shared_ptr<Generation>> BuildGeneration(
    const Model& model, uint64_t number, const std::vector<AdapterRef>& stack,
    std::vector<std::shared_ptr<const Adapter>> adapters,
    std::shared_ptr<const PublishedBase> published = nullptr);

// Generation `number` of `model` (0 = current), null if it is not kept.
std::shared_ptr<const Generation> GenerationOf(const Model& model, uint64_t number);

// What clients are told of generation `gen` of `model`.
GenerationInfo InfoOf(const Model& model, const Generation& gen);

// Does a lease still hold `gen`?
inline bool IsLeased(const Generation& gen) { return gen.lease_marker.use_count() > 1; }

// `model` with `gen` as its current generation, keeping the leased ones;
// the numbers no longer kept go to `retired`.
std::shared_ptr<Model> WithGeneration(const Model& model, std::shared_ptr<Generation> gen,
                                      std::vector<uint64_t>* retired);

// `model` without the generations that are neither current nor leased
// (their materializer tags, "name#number", go to `retired`); null when
// there is none to drop.
std::shared_ptr<Model> WithoutUnleased(const Model& model, std::vector<std::string>* retired);

// The FP8 scale (amax / 448) of `served` at `gen`, computed on first use
// and kept on the generation.
absl::StatusOr<float> Fp8Scale(const Served& served, const Generation& gen);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_SERVICE_GENERATIONS_H_
