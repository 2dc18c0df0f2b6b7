// Adapters: LoRA (PEFT, kohya/diffusers) and dense patches parsed from files
// into TensorPatches (docs/DESIGN.md §2.4, §2.5 "LoRA merge"; reference lora-formats.md).
//
// Formats:
//  * PEFT: a directory with adapter_config.json + adapter_model.safetensors
//    (or that .safetensors file itself; a sibling adapter_config.json is
//    used when present). Keys `[base_model.model.]M.lora_A[.<name>].weight`
//    [r, in] / `….lora_B….weight` [out, r] give ΔW = scale · (B @ A) on
//    `M.weight`, scale = alpha / r (alpha / √r with use_rslora), alpha and r
//    per module from alpha_pattern / rank_pattern (first key in file order
//    whose pattern P satisfies re.match(r"(.*\.)?(P)$", M), else lora_alpha
//    / r). The configured r must equal lora_A's rows. fan_in_fan_out
//    transposes ΔW (shape [in, out]). `M.lora_magnitude_vector` makes the
//    module DoRA. `E.lora_embedding_A` [r, num] / `_B` [dim, r] give
//    (B @ A)ᵀ on `E.weight`. `M.lora_B.bias` adds scale · bias to `M.bias`.
//    Non-LoRA keys are replacement tensors when they lie in a module listed
//    in modules_to_save (`module == name` or ends with `.name`; the
//    `modules_to_save.<adapter>.` infix, if present, is dropped) or are a
//    `*.bias` with config bias "all"/"lora_only"; otherwise ignored.
//    Without a config: alpha = r (scale 1) unless the file carries an
//    `M.alpha` / `M.lora_alpha` scalar.
//  * kohya: `<name>.lora_down.weight` [r, in], `<name>.lora_up.weight`
//    [out, r], optional `<name>.alpha` (missing or 0 ⇒ alpha = r), scale =
//    alpha / r. `<name>` = `lora_unet_…` / `lora_te[12]_…` /
//    `lora_transformer_…` is resolved against the base (ResolveKohyaTarget,
//    needs_kohya_resolution); a dotted name (`diffusion_model.x.y`) names
//    the module directly. `<name>.dora_scale` of shape [out] / [out, 1]
//    makes it DoRA.
//  * dense (FastVideo/ComfyUI): `M.diff` (+= on M.weight), `M.diff_b`
//    (+= on M.bias), `P.diff_param` (+= on P), `M.set_weight` (M.weight
//    becomes strength · value), `P.set_param` (P becomes strength · value).
//    These suffixes are understood in every format (FastVideo mixes them
//    with low-rank keys) and win over any other reading of the key.
//
// Names: a leading `base_model.model.` and then `diffusion_model.` are
// stripped from every key (PEFT, FastVideo). Tensors are converted to fp32
// at load (F64/F32/F16/BF16/FP8). Conv LoRA (4-D factors), aLoRA,
// layer_replication, target_parameters, PiSSA/OLoRA/CorDA/LoftQ/LoRA-GA
// initializations (which need a mutated base), QALoRA and the other LoRA
// variants are rejected.
//
// Thread safety: Adapter is immutable once loaded; all functions are
// reentrant.
#ifndef WEIGHTD_SERVER_ADAPTER_ADAPTER_H_
#define WEIGHTD_SERVER_ADAPTER_ADAPTER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/digest.h"
#include "common/file_opener.h"
#include "server/adapter/patch.h"

namespace weightd {

enum class AdapterFormat { kAuto, kPeft, kKohya, kDense };

// "auto", "peft", "kohya", "dense" (case-insensitive); else INVALID_ARGUMENT.
absl::StatusOr<AdapterFormat> ParseAdapterFormat(absl::string_view text);
// The lowercase spelling ParseAdapterFormat accepts.
absl::string_view AdapterFormatName(AdapterFormat format);

// One patch of a parsed adapter.
struct AdapterEntry {
  // The base parameter as the adapter names it: PEFT "<module>.weight"
  // (prefixes stripped), a dense payload's parameter, or — when
  // needs_kohya_resolution — the kohya name ("lora_unet_…", optionally
  // followed by ".bias" for a kohya-named .diff_b) for ResolveKohyaTarget.
  std::string target;
  bool needs_kohya_resolution = false;
  TensorPatchPtr patch;
};

struct Adapter {
  std::string path;                             // as given to LoadAdapter
  AdapterFormat format = AdapterFormat::kAuto;  // the one used (never kAuto)
  Digest digest;                          // XXH3-128 over the files' bytes (config first, for PEFT)
  std::vector<AdapterEntry> entries;      // in key order
  std::vector<std::string> ignored_keys;  // keys not understood (original spelling)
  uint64_t bytes = 0;                     // fp32 bytes held by the patches
  // What AdapterLoadOptions::reserve returned (e.g. a memory-budget charge).
  std::shared_ptr<const void> reservation;
  // What AdapterLoadOptions::fetch returned (the weights file's bytes).
  std::shared_ptr<const void> fetched;
};

// Loads the adapter at `path` (see the header comment). With kAuto the
// format comes from the files: a directory is PEFT; a single file is PEFT
// when it has lora_A/lora_B keys, kohya when it has lora_down/lora_up keys,
// dense when it has only dense keys. With an explicit format, keys of the
// other LoRA flavour are ignored_keys.
// Errors: NOT_FOUND for missing files (directory without
// adapter_config.json or adapter_model.safetensors, missing path);
// INVALID_ARGUMENT naming file and key for malformed safetensors, lora_A
// without lora_B (and the like), rank mismatch between A and B or with the
// config, non-2-D factors, non-floating tensors, bad config JSON or values,
// unsupported variants, two payloads for one parameter, files with no
// adapter tensors (in auto mode: unknown format).
// Every file is opened once through `options.files` and read through that
// fd (the daemon passes its ModelRoots: a file symlinked out of the model
// roots is PERMISSION_DENIED even when its directory lies inside; a FIFO or
// other special file is INVALID_ARGUMENT at once).
struct AdapterLoadOptions {
  const FileOpener* files = nullptr;  // nullptr: UnconfinedFileOpener
  // Called once the weights' header is parsed, before any tensor is read,
  // with the bytes the patches will hold (4 per element of every tensor the
  // format uses). It returns what keeps them reserved — the Adapter holds
  // it, so it is dropped with the Adapter — or fails the load with its
  // status (RESOURCE_EXHAUSTED), before anything is allocated for them.
  std::function<absl::StatusOr<std::shared_ptr<const void>>(uint64_t bytes)> reserve;
  // Optional: where the weights file's data section comes from instead of
  // its fd (the daemon: from storage or its peers, kept resident so that
  // peers can take it in turn). Called with the weights file's path as
  // opened and its header bytes (8-byte length and JSON); returns the data
  // section, valid while `keep` lives (the Adapter holds it). A fetch of
  // other header bytes or length is DATA_LOSS (the file changed). No
  // `data`: the section is read through the fd after all.
  struct FetchedBytes {
    const uint8_t* data = nullptr;
    uint64_t length = 0;
    std::shared_ptr<const void> keep;
  };
  std::function<absl::StatusOr<FetchedBytes>(const std::string& path,
                                               absl::string_view header)>
      fetch;
};
absl::StatusOr<std::shared_ptr<const Adapter>> LoadAdapter(const std::string& path,
                                                           AdapterFormat format,
                                                           const AdapterLoadOptions& options = {});

// Resolves a kohya name against the base checkpoint's names. `flat` is
// "<prefix><module with . → _>[.<param>]" with prefix one of lora_unet_,
// lora_te_, lora_te1_, lora_te2_, lora_te3_, lora_transformer_ (or none);
// <param> defaults to "weight". The result is the base name "<M>.<param>"
// whose module M flattened ('.' → '_') equals the module part; when no name
// matches exactly, names whose M ends with a dotted suffix that flattens to
// it (a base prefixed e.g. "model.diffusion_model.") are accepted.
// NOT_FOUND when nothing matches; INVALID_ARGUMENT when several do.
absl::StatusOr<std::string> ResolveKohyaTarget(absl::string_view flat,
                                               absl::Span<const std::string> base_names);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_ADAPTER_ADAPTER_H_
