// The parts of LoadAdapter (adapter.h) and what they share; nothing outside
// server/adapter/ includes this. LoadAdapter (adapter.cc) opens the files,
// classifies every key (adapter_keys.cc), picks the format, reads the PEFT
// config and the tensors the format uses (adapter_files.cc), and hands them
// to the builder of that format: dense payloads and the shared claim
// bookkeeping (patch_builder.cc), PEFT (peft.cc), kohya (kohya.cc).
//
// Thread safety: everything here is reentrant; a Builder belongs to one load.
#ifndef WEIGHTD_SERVER_ADAPTER_ADAPTER_INTERNAL_H_
#define WEIGHTD_SERVER_ADAPTER_ADAPTER_INTERNAL_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/digest.h"
#include "common/file_opener.h"
#include "common/safetensors.h"
#include "re2/re2.h"
#include "server/adapter/adapter.h"
#include "server/adapter/lora_patch.h"
#include "server/adapter/patch.h"

namespace weightd::adapter_internal {

// INVALID_ARGUMENT "<file>: tensor "<key>": <what>".
absl::Status KeyError(absl::string_view file, absl::string_view key, absl::string_view what);
// `status` annotated as it rises with "<file>: tensor "<key>"" (its code
// kept): how a patch's Create error names the key it came from.
absl::Status AnnotateKey(const absl::Status& status, absl::string_view file,
                         absl::string_view key);

// ------------------------------------------------------------------ keys

enum class Role {
  kPeftA,
  kPeftB,
  kPeftBias,  // lora_B.bias
  kEmbA,
  kEmbB,
  kMagnitude,
  kKohyaDown,
  kKohyaUp,
  kAlpha,      // <m>.alpha / <m>.lora_alpha
  kDoraScale,  // kohya <m>.dora_scale
  kDenseAdd,
  kDenseSet,
  kOther,
};

bool IsPeftRole(Role r);
bool IsKohyaRole(Role r);
inline bool IsDenseRole(Role r) { return r == Role::kDenseAdd || r == Role::kDenseSet; }

struct KeyInfo {
  std::string key;   // as in the file
  std::string name;  // normalized (prefixes stripped)
  Role role = Role::kOther;
  std::string module;  // module (LoRA roles) or target parameter (dense roles)
  bool kohya_name = false;
};

// What a key of the weights file is (adapter_keys.cc; the spellings are in
// adapter.h's header comment).
KeyInfo Classify(absl::string_view key);

// "a.b.c" from components [begin, end) of a split name.
std::string Join(const std::vector<absl::string_view>& t, size_t begin, size_t end);

// True when `name` starts with a kohya prefix (lora_unet_, lora_te1_, ...;
// kohya.cc).
bool HasKohyaPrefix(absl::string_view name);

// ------------------------------------------------------------------ tensors
// (adapter_files.cc)

// The weights file, opened and its header parsed.
struct TensorFile {
  std::string path;
  OpenedFile file;  // read through `files` (the seam: a file's fd, or a remote object)
  const FileOpener* files = nullptr;
  uint64_t size = 0;
  std::string prefix;  // the 8-byte length and the header JSON, for the digest
  SafetensorsHeader header;
};

// `file` as a safetensors file: INVALID_ARGUMENT naming it when it is not a
// regular file, too short, or its header is malformed.
absl::StatusOr<TensorFile> OpenTensorFile(const FileOpener& files, OpenedFile file);

struct LoadedTensor {
  std::vector<int64_t> shape;
  std::vector<float> values;
};
using TensorMap = absl::flat_hash_map<std::string, LoadedTensor>;

// Reads the whole file in order (the parser guarantees the tensors tile the
// data section), feeding every byte to `digest`, and converts the `wanted`
// tensors to fp32.
// `fetched`: the data section in memory (AdapterLoadOptions::fetch), or
// null to read it through the fd.
absl::StatusOr<TensorMap> ReadTensors(const TensorFile& f,
                                      const absl::flat_hash_set<std::string>& wanted,
                                      DigestBuilder* digest, const uint8_t* fetched);

// ------------------------------------------------------------------ config

struct Pattern {
  std::string key;
  std::unique_ptr<RE2> re;
  double value = 0;
};

struct PeftConfig {
  bool present = false;
  std::string path;
  int64_t r = 8;
  double lora_alpha = 8;
  bool use_rslora = false;
  bool fan_in_fan_out = false;
  bool use_dora = false;
  std::string bias = "none";
  std::vector<Pattern> rank_pattern;   // in file order
  std::vector<Pattern> alpha_pattern;  // in file order
  std::vector<std::string> modules_to_save;
};

// adapter_config.json's text (read from `path`) into a PeftConfig;
// INVALID_ARGUMENT "<path>: ..." for what cannot be merged (peft.cc).
absl::StatusOr<PeftConfig> ParsePeftConfig(absl::string_view text, const std::string& path);

// The target of a PEFT non-LoRA key: a modules_to_save replacement or a
// bias="all"/"lora_only" bias; nullopt = ignored (peft.cc).
std::optional<std::string> PeftReplacementTarget(const PeftConfig& cfg, absl::string_view name);

// ------------------------------------------------------------------ building

// Turns one load's tensors into the Adapter's entries, refusing two payloads
// that patch one parameter in ways that do not stack.
struct Builder {
  std::string file;
  Digest digest;
  const TensorMap* tensors = nullptr;
  Adapter* adapter = nullptr;
  // target -> (what patches it, first key), to reject conflicting payloads.
  struct Claim {
    bool lora = false, add = false, replace = false;
    std::string key;
  };
  std::map<std::pair<std::string, bool>, Claim> claims;

  const LoadedTensor& T(const KeyInfo* k) const { return tensors->at(k->key); }

  absl::Status Reserve(const std::string& target, bool kohya, TensorPatch::Kind kind, bool lora,
                       const std::string& key);
  absl::Status Add(std::string target, bool kohya, TensorPatchPtr patch, bool lora,
                   const std::string& key, uint64_t bytes);
  PatchSource Source(const std::string& target) const { return PatchSource{digest, target}; }

  // A dense payload (.diff, .diff_b, .diff_param, .set_weight, .set_param).
  absl::Status AddDense(const KeyInfo& k);
  // A PEFT modules_to_save / bias replacement of `target`.
  absl::Status AddReplacement(const KeyInfo& k, const std::string& target);
  // A 2-D factor pair -> LowRankFactors. `down`: [r, in], `up`: [out, r].
  absl::StatusOr<LowRankFactors> Factors(const KeyInfo* down, const KeyInfo* up,
                                         absl::string_view down_name, absl::string_view up_name);
  // The scalar alpha tensor `k` (nullptr or 0: alpha = rank).
  absl::StatusOr<double> ScalarAlpha(const KeyInfo* k, int64_t rank);
};

// Puts `k` into an empty `slot`; two keys for one slot are INVALID_ARGUMENT.
absl::Status SetSlot(const std::string& file, const KeyInfo* k, const KeyInfo** slot);
// INVALID_ARGUMENT "<file>: tensor "<have>": <has> without <lacks>".
absl::Status MissingPartner(const std::string& file, const KeyInfo* have, absl::string_view has,
                            absl::string_view lacks);

// The format builders: each adds the entries of `keys` (the low-rank keys
// and alphas the format uses, in key order) to bld.adapter.
absl::Status BuildPeft(Builder& bld, const std::vector<KeyInfo>& keys, const PeftConfig& cfg);
absl::Status BuildKohya(Builder& bld, const std::vector<KeyInfo>& keys);

}  // namespace weightd::adapter_internal

#endif  // WEIGHTD_SERVER_ADAPTER_ADAPTER_INTERNAL_H_
