// LoadAdapter (adapter.h) as phases: open the adapter's files, classify the
// weights' keys (adapter_keys.cc), settle the format (kAuto: from the keys),
// read the PEFT config, pick the keys the format uses, read those tensors
// (charging AdapterLoadOptions::reserve first, from
// AdapterLoadOptions::fetch when given), and hand them to the format's
// builder (adapter_internal.h). Also the format names.
#include "server/adapter/adapter.h"

#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "common/fd.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "server/adapter/adapter_internal.h"

namespace weightd {
namespace {

using adapter_internal::Builder;
using adapter_internal::Classify;
using adapter_internal::IsDenseRole;
using adapter_internal::IsKohyaRole;
using adapter_internal::IsPeftRole;
using adapter_internal::KeyInfo;
using adapter_internal::PeftConfig;
using adapter_internal::OpenTensorFile;
using adapter_internal::ReadTensors;
using adapter_internal::Role;
using adapter_internal::TensorFile;
using adapter_internal::TensorMap;

constexpr char kConfigName[] = "adapter_config.json";
constexpr char kWeightsName[] = "adapter_model.safetensors";
constexpr uint64_t kMaxConfigBytes = 16ull << 20;

// ------------------------------------------------------------------ phases

// An adapter's files, each opened once, where it really lies.
struct AdapterFiles {
  OpenedFile weights;
  std::optional<OpenedFile> config;  // a PEFT directory's adapter_config.json
  std::string weights_path;          // names the weights in messages
};

absl::Status CheckNotDirectoryFormat(const std::string& path, AdapterFormat format) {
  return absl::InvalidArgumentError(
      absl::StrCat(path, " is a directory; format ", AdapterFormatName(format),
                   " expects a .safetensors file (directories are PEFT adapters)"));
}

// A PEFT adapter directory: its config and its weights, both required.
absl::StatusOr<AdapterFiles> OpenPeftDirectory(const FileOpener& opener, const OpenedFile& top,
                                               const std::string& path) {
  auto cfg = opener.OpenIn(top, kConfigName);
  if (absl::IsNotFound(cfg.status())) {
    return absl::NotFoundError(
        absl::StrCat("PEFT adapter directory ", path, " has no ", kConfigName));
  }
  if (!cfg.ok()) return cfg.status();
  auto w = opener.OpenIn(top, kWeightsName);
  if (absl::IsNotFound(w.status())) {
    const bool bin = !absl::IsNotFound(opener.OpenIn(top, "adapter_model.bin").status());
    return absl::NotFoundError(absl::StrCat(
        "PEFT adapter directory ", path, " has no ", kWeightsName,
        bin ? " (adapter_model.bin, a pickle, is not supported: convert it to safetensors)"
            : ""));
  }
  if (!w.ok()) return w.status();
  AdapterFiles files;
  files.config = std::move(*cfg);
  files.weights = std::move(*w);
  files.weights_path = files.weights.path;
  return files;
}

// `path` itself when it is a file; a directory is a PEFT adapter (so
// *format becomes kPeft; any other explicit format is INVALID_ARGUMENT).
absl::StatusOr<AdapterFiles> OpenFiles(const FileOpener& opener, const std::string& path,
                                       AdapterFormat* format) {
  WD_ASSIGN_OR_RETURN(OpenedFile top, opener.Open(path));
  if (!top.is_directory()) {
    AdapterFiles files;
    files.weights = std::move(top);
    files.weights_path = path;
    return files;
  }
  if (*format != AdapterFormat::kAuto && *format != AdapterFormat::kPeft) {
    return CheckNotDirectoryFormat(path, *format);
  }
  *format = AdapterFormat::kPeft;
  return OpenPeftDirectory(opener, top, path);
}

// Every key of the weights file, classified, in key order.
std::vector<KeyInfo> ClassifyKeys(const SafetensorsHeader& header) {
  std::vector<KeyInfo> keys;
  keys.reserve(header.tensors.size());
  for (const SafetensorsEntry& e : header.tensors) keys.push_back(Classify(e.name));
  std::sort(keys.begin(), keys.end(),
            [](const KeyInfo& a, const KeyInfo& b) { return a.key < b.key; });
  return keys;
}

// kAuto's answer: PEFT when there are lora_A/lora_B keys, kohya when there
// are lora_down/lora_up keys (both: INVALID_ARGUMENT), dense when there are
// only dense keys; none of them: INVALID_ARGUMENT.
absl::StatusOr<AdapterFormat> DetectFormat(const std::vector<KeyInfo>& keys,
                                           const std::string& weights_path) {
  size_t peft = 0, kohya = 0, dense = 0;
  for (const KeyInfo& k : keys) {
    peft += IsPeftRole(k.role);
    kohya += k.role == Role::kKohyaDown || k.role == Role::kKohyaUp;
    dense += IsDenseRole(k.role);
  }
  if (peft > 0 && kohya > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(weights_path,
                     ": mixes PEFT (lora_A/lora_B) and kohya (lora_down/lora_up) keys; "
                     "pass the format explicitly"));
  }
  if (peft > 0) return AdapterFormat::kPeft;
  if (kohya > 0) return AdapterFormat::kKohya;
  if (dense > 0) return AdapterFormat::kDense;
  std::vector<absl::string_view> sample;
  for (size_t i = 0; i < keys.size() && i < 3; ++i) sample.push_back(keys[i].key);
  return absl::InvalidArgumentError(absl::StrCat(
      "cannot tell the adapter format of ", weights_path,
      ": no lora_A/lora_B, lora_down/lora_up or dense (.diff, .set_weight) keys among its ",
      keys.size(), " tensors", sample.empty() ? "" : " (e.g. \"",
      absl::StrJoin(sample, "\", \""), sample.empty() ? "" : "\")"));
}

// The PEFT config: the directory's, or one beside a single file (none: an
// absent config). Its text goes into `digest` first.
absl::StatusOr<PeftConfig> ReadPeftConfig(const FileOpener& opener, const TensorFile& file,
                                          std::optional<OpenedFile> config,
                                          DigestBuilder& digest) {
  if (!config) {
    auto sibling = opener.OpenBeside(file.file, kConfigName);
    if (sibling.ok()) {
      config = std::move(*sibling);
    } else if (!absl::IsNotFound(sibling.status())) {
      return sibling.status();
    }
  }
  if (!config) return PeftConfig{};
  WD_ASSIGN_OR_RETURN(std::string text, ReadWholeFile(opener, *config, kMaxConfigBytes));
  WD_ASSIGN_OR_RETURN(PeftConfig cfg, adapter_internal::ParsePeftConfig(text, config->path));
  digest.Update(text.data(), text.size());
  return cfg;
}

// The keys a format uses: its payloads (`used`, in key order), PEFT's
// replacement tensors with their targets, and every tensor to read.
struct KeySelection {
  std::vector<KeyInfo> used;
  std::vector<std::pair<const KeyInfo*, std::string>> replacements;
  absl::flat_hash_set<std::string> wanted;
};

// Picks from `keys` (which must outlive the result) what `format` uses; the
// others go to `ignored`.
KeySelection SelectKeys(const std::vector<KeyInfo>& keys, AdapterFormat format,
                        const PeftConfig& cfg, std::vector<std::string>& ignored) {
  KeySelection out;
  for (const KeyInfo& k : keys) {
    bool use = false;
    const bool dense = IsDenseRole(k.role);
    switch (format) {
      case AdapterFormat::kPeft:
        use = dense || IsPeftRole(k.role) || (k.role == Role::kAlpha && !cfg.present);
        if (!use && !IsPeftRole(k.role) && !IsKohyaRole(k.role) && cfg.present) {
          if (auto target = adapter_internal::PeftReplacementTarget(cfg, k.name)) {
            out.replacements.emplace_back(&k, *target);
            out.wanted.insert(k.key);
            continue;
          }
        }
        break;
      case AdapterFormat::kKohya:
        use = dense || IsKohyaRole(k.role) || k.role == Role::kAlpha;
        break;
      case AdapterFormat::kDense:
        use = dense;
        break;
      case AdapterFormat::kAuto:
        break;
    }
    if (use) {
      out.used.push_back(k);
      out.wanted.insert(k.key);
    } else {
      ignored.push_back(k.key);
    }
  }
  return out;
}

// The `wanted` tensors in fp32, every byte of the file fed to `digest`:
// their bytes reserved first (options.reserve), the data section from
// options.fetch when it gives one (else through the fd).
absl::StatusOr<TensorMap> ReadWanted(const TensorFile& file,
                                     const absl::flat_hash_set<std::string>& wanted,
                                     const AdapterLoadOptions& options, Adapter& adapter,
                                     DigestBuilder& digest) {
  if (options.reserve) {
    uint64_t bytes = 0;
    for (const SafetensorsEntry& e : file.header.tensors) {
      if (wanted.contains(e.name)) bytes += static_cast<uint64_t>(NumElements(e.shape)) * 4;
    }
    WD_ASSIGN_OR_RETURN(adapter.reservation, options.reserve(bytes));
  }
  const uint8_t* fetched = nullptr;
  if (options.fetch) {
    WD_ASSIGN_OR_RETURN(AdapterLoadOptions::FetchedBytes bytes,
                        options.fetch(file.path, file.prefix));
    if (bytes.data != nullptr) {
      if (bytes.length != file.size - file.header.data_offset) {
        return absl::DataLossError(absl::StrCat(file.path, " changed while it was being loaded"));
      }
      fetched = bytes.data;
      adapter.fetched = std::move(bytes.keep);
    }
  }
  return ReadTensors(file, wanted, &digest, fetched);
}

// The dense payloads of every format, then the format's low-rank builder,
// then PEFT's replacement tensors.
absl::Status BuildPatches(Builder& bld, const KeySelection& keys, AdapterFormat format,
                          const PeftConfig& cfg) {
  std::vector<KeyInfo> lowrank;
  for (const KeyInfo& k : keys.used) {
    if (IsDenseRole(k.role)) {
      WD_RETURN_IF_ERROR(bld.AddDense(k));
    } else {
      lowrank.push_back(k);
    }
  }
  if (format == AdapterFormat::kPeft) {
    WD_RETURN_IF_ERROR(adapter_internal::BuildPeft(bld, lowrank, cfg));
  } else if (format == AdapterFormat::kKohya) {
    WD_RETURN_IF_ERROR(adapter_internal::BuildKohya(bld, lowrank));
  }
  for (const auto& [k, target] : keys.replacements) {
    WD_RETURN_IF_ERROR(bld.AddReplacement(*k, target));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<AdapterFormat> ParseAdapterFormat(absl::string_view text) {
  const std::string t = absl::AsciiStrToLower(text);
  if (t == "auto") return AdapterFormat::kAuto;
  if (t == "peft") return AdapterFormat::kPeft;
  if (t == "kohya") return AdapterFormat::kKohya;
  if (t == "dense") return AdapterFormat::kDense;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown adapter format \"", text, "\" (expected auto, peft, kohya or dense)"));
}

absl::string_view AdapterFormatName(AdapterFormat format) {
  switch (format) {
    case AdapterFormat::kAuto:
      return "auto";
    case AdapterFormat::kPeft:
      return "peft";
    case AdapterFormat::kKohya:
      return "kohya";
    case AdapterFormat::kDense:
      return "dense";
  }
  return "unknown";
}

absl::StatusOr<std::shared_ptr<const Adapter>> LoadAdapter(const std::string& path,
                                                           AdapterFormat format,
                                                           const AdapterLoadOptions& options) {
  // Each file is opened once, where it really lies, and read through its fd.
  const UnconfinedFileOpener unconfined;
  const FileOpener& opener = options.files != nullptr ? *options.files : unconfined;
  WD_ASSIGN_OR_RETURN(AdapterFiles files, OpenFiles(opener, path, &format));
  WD_ASSIGN_OR_RETURN(TensorFile file, OpenTensorFile(opener, std::move(files.weights)));
  const std::vector<KeyInfo> keys = ClassifyKeys(file.header);
  if (format == AdapterFormat::kAuto) {
    WD_ASSIGN_OR_RETURN(format, DetectFormat(keys, files.weights_path));
  }
  PeftConfig cfg;
  DigestBuilder digest;
  if (format == AdapterFormat::kPeft) {
    WD_ASSIGN_OR_RETURN(cfg, ReadPeftConfig(opener, file, std::move(files.config), digest));
  }

  auto adapter = std::make_shared<Adapter>();
  adapter->path = path;
  adapter->format = format;
  const KeySelection selected = SelectKeys(keys, format, cfg, adapter->ignored_keys);
  WD_ASSIGN_OR_RETURN(TensorMap tensors,
                      ReadWanted(file, selected.wanted, options, *adapter, digest));
  adapter->digest = digest.Finish();

  Builder bld;
  bld.file = files.weights_path;
  bld.digest = adapter->digest;
  bld.tensors = &tensors;
  bld.adapter = adapter.get();
  WD_RETURN_IF_ERROR(BuildPatches(bld, selected, format, cfg));
  if (adapter->entries.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(files.weights_path, ": no ",
                                                   AdapterFormatName(format),
                                                   " adapter tensors among its ", keys.size(),
                                                   " keys"));
  }
  std::sort(adapter->ignored_keys.begin(), adapter->ignored_keys.end());
  return std::shared_ptr<const Adapter>(std::move(adapter));
}

}  // namespace weightd
