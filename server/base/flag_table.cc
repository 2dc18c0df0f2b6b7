#include "server/base/flag_table.h"

#include <cassert>
#include <cstdio>
#include <map>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/fd.h"
#include "common/status_macros.h"

namespace weightd {
namespace {

// Config files are a few lines; anything larger is a mistake.
constexpr uint64_t kMaxConfigBytes = 1 << 20;

struct FlagSource {
  std::string origin;                                       // for messages
  std::vector<std::pair<std::string, std::string>> values;  // flag -> value, in order
};

absl::StatusOr<FlagSource> ReadConfigFile(const std::string& path) {
  auto text = ReadFileToString(path, kMaxConfigBytes);
  if (!text.ok()) {
    return absl::NotFoundError(absl::StrCat("cannot open config file ", path, ": ",
                                            text.status().message()));
  }
  FlagSource src{absl::StrCat("config ", path), {}};
  int number = 0;
  for (absl::string_view raw : absl::StrSplit(*text, '\n')) {
    ++number;
    std::string line(absl::StripAsciiWhitespace(raw));
    if (line.empty() || line[0] == '#') continue;
    size_t eq = line.find('=');
    if (eq == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", number, ": expected flag = value"));
    }
    std::string key(absl::StripAsciiWhitespace(line.substr(0, eq)));
    std::string value(absl::StripAsciiWhitespace(line.substr(eq + 1)));
    if (absl::StartsWith(key, "--")) key = key.substr(2);
    src.values.emplace_back(std::move(key), std::move(value));
  }
  return src;
}

absl::StatusOr<bool> ParseSwitch(absl::string_view flag, absl::string_view text) {
  std::string b = absl::AsciiStrToLower(text);
  if (b == "true" || b == "1" || b == "yes") return true;
  if (b == "false" || b == "0" || b == "no") return false;
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, ": expected true or false, got \"", text, "\""));
}

}  // namespace

FlagTable::FlagTable(std::string program, std::string env_prefix)
    : program_(std::move(program)), env_prefix_(std::move(env_prefix)) {}

FlagTable& FlagTable::Add(FlagSpec spec) {
  assert(Find(spec.name) == nullptr && spec.name != "config" && spec.apply);
  specs_.push_back(std::move(spec));
  return *this;
}

const FlagSpec* FlagTable::Find(absl::string_view name) const {
  for (const FlagSpec& s : specs_) {
    if (s.name == name) return &s;
  }
  return nullptr;
}

std::string FlagTable::EnvName(absl::string_view flag) const {
  std::string var = absl::StrCat(env_prefix_, "_", absl::AsciiStrToUpper(flag));
  for (char& c : var) c = c == '-' ? '_' : c;
  return var;
}

std::string FlagTable::Usage() const {
  std::string out = absl::StrCat("usage: ", program_, " [flags]\n");
  size_t width = 0;
  std::vector<std::string> heads;
  for (const FlagSpec& s : specs_) {
    std::string head = absl::StrCat("--", s.name);
    if (s.kind != FlagSpec::Kind::kSwitch) absl::StrAppend(&head, " ", s.metavar);
    if (s.kind == FlagSpec::Kind::kList) absl::StrAppend(&head, " ...");
    width = std::max(width, head.size());
    heads.push_back(std::move(head));
  }
  for (size_t i = 0; i < specs_.size(); ++i) {
    absl::StrAppend(&out, "  ", heads[i], std::string(width - heads[i].size() + 2, ' '),
                    specs_[i].help, "\n");
  }
  absl::StrAppend(&out, "  --config FILE", std::string(width > 11 ? width - 11 : 2, ' '),
                  "\"flag = value\" lines (also ", EnvName("config"), ")\n",
                  "Every flag may also be set as ", env_prefix_,
                  "_<FLAG> (dashes as underscores, lists\ncomma-separated) or in the config "
                  "file; the command line beats the environment,\nwhich beats the file.\n");
  return out;
}

bool FlagTable::WantsHelp(const std::vector<std::string>& args) {
  for (const std::string& a : args) {
    if (a == "--help" || a == "-h") return true;
  }
  return false;
}

absl::StatusOr<std::vector<std::string>> FlagTable::Merge(
    const std::vector<std::string>& args,
    const std::function<const char*(const char*)>& getenv) const {
  std::string config;
  if (const char* env = getenv(EnvName("config").c_str())) config = env;
  std::vector<std::string> rest;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--config" && i + 1 < args.size()) {
      config = args[++i];
    } else if (absl::StartsWith(args[i], "--config=")) {
      config = args[i].substr(9);
    } else {
      rest.push_back(args[i]);
    }
  }
  std::vector<FlagSource> sources;
  if (!config.empty()) {
    WD_ASSIGN_OR_RETURN(FlagSource file, ReadConfigFile(config));
    sources.push_back(std::move(file));
  }
  FlagSource env{"environment", {}};
  for (const FlagSpec& s : specs_) {
    const char* value = getenv(EnvName(s.name).c_str());
    if (value == nullptr) continue;
    if (s.kind == FlagSpec::Kind::kList) {
      for (absl::string_view v : absl::StrSplit(value, ',', absl::SkipEmpty())) {
        env.values.emplace_back(s.name, std::string(v));
      }
    } else {
      env.values.emplace_back(s.name, value);
    }
  }
  sources.push_back(std::move(env));

  std::set<std::string> on_cli;
  for (const std::string& a : rest) {
    if (!absl::StartsWith(a, "--")) continue;
    size_t eq = a.find('=');
    on_cli.insert(a.substr(2, eq == std::string::npos ? std::string::npos : eq - 2));
  }
  // Later sources replace earlier ones flag by flag.
  std::map<std::string, std::vector<std::string>> chosen;
  std::vector<std::string> order;
  for (const FlagSource& src : sources) {
    std::map<std::string, std::vector<std::string>> mine;
    for (const auto& [k, v] : src.values) {
      if (Find(k) == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(src.origin, ": unknown flag \"", k, "\""));
      }
      mine[k].push_back(v);
    }
    for (auto& [k, vs] : mine) {
      if (!chosen.count(k)) order.push_back(k);
      chosen[k] = std::move(vs);
    }
  }
  std::vector<std::string> merged;
  for (const std::string& k : order) {
    if (on_cli.count(k)) continue;
    for (const std::string& v : chosen[k]) {
      if (Find(k)->kind == FlagSpec::Kind::kSwitch) {
        merged.push_back(absl::StrCat("--", k, "=", v));
      } else {
        merged.push_back("--" + k);
        merged.push_back(v);
      }
    }
  }
  merged.insert(merged.end(), rest.begin(), rest.end());
  return merged;
}

absl::StatusOr<std::vector<std::string>> FlagTable::Parse(
    const std::vector<std::string>& args,
    const std::function<const char*(const char*)>& getenv) const {
  WD_ASSIGN_OR_RETURN(std::vector<std::string> merged, Merge(args, getenv));
  for (size_t i = 0; i < merged.size(); ++i) {
    const std::string& arg = merged[i];
    std::string name = arg, value;
    bool inline_value = false;
    if (!absl::StartsWith(arg, "--")) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument \"", arg, "\"\n",
                                                     Usage()));
    }
    if (size_t eq = arg.find('='); eq != std::string::npos) {
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
      inline_value = true;
    }
    const FlagSpec* spec = Find(absl::string_view(name).substr(2));
    if (spec == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag \"", name, "\"\n", Usage()));
    }
    if (spec->kind == FlagSpec::Kind::kSwitch) {
      bool on = true;
      if (inline_value) {
        WD_ASSIGN_OR_RETURN(on, ParseSwitch(spec->name, value));
      }
      WD_RETURN_IF_ERROR(spec->apply(on ? "true" : "false"));
      continue;
    }
    if (!inline_value) {
      if (i + 1 >= merged.size()) {
        return absl::InvalidArgumentError(absl::StrCat(name, " needs a value"));
      }
      value = merged[++i];
    }
    WD_RETURN_IF_ERROR(spec->apply(value));
    // "--model-root A B C": further plain words are values too.
    while (spec->kind == FlagSpec::Kind::kList && !inline_value && i + 1 < merged.size() &&
           !absl::StartsWith(merged[i + 1], "--")) {
      WD_RETURN_IF_ERROR(spec->apply(merged[++i]));
    }
  }
  return merged;
}

std::function<absl::Status(const std::string&)> StringInto(std::string* out) {
  return [out](const std::string& v) {
    *out = v;
    return absl::OkStatus();
  };
}

std::function<absl::Status(const std::string&)> AppendInto(std::vector<std::string>* out) {
  return [out](const std::string& v) {
    out->push_back(v);
    return absl::OkStatus();
  };
}

std::function<absl::Status(const std::string&)> Uint64Into(std::string flag, uint64_t* out,
                                                           uint64_t min, uint64_t max) {
  return [flag = std::move(flag), out, min, max](const std::string& v) {
    uint64_t n = 0;
    if (!absl::SimpleAtoi(v, &n)) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, ": \"", v, "\" is not a number"));
    }
    if (n < min || n > max) {
      return absl::InvalidArgumentError(
          max == UINT64_MAX ? absl::StrCat("--", flag, " must be >= ", min)
                            : absl::StrCat("--", flag, " must be ", min, "..", max));
    }
    *out = n;
    return absl::OkStatus();
  };
}

}  // namespace weightd
