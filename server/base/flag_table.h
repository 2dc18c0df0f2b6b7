// FlagTable: a program's flags declared once — name, what the value looks
// like, one line of help, how a value is applied — from which come the
// command-line parser, the usage text, the environment variable names
// (PREFIX_<FLAG>, dashes as underscores) and the config-file keys. A new
// flag costs one Add() line.
//
// Sources, weakest first: a config file (--config FILE or PREFIX_CONFIG: one
// "flag = value" per line, '#' comments, a repeated flag adds a value), the
// environment (list flags comma-separated), the command line. A stronger
// source that names a flag replaces everything weaker sources said of it
// (for list flags: the whole list).
//
// Not thread-safe; build it, Parse once, then drop it.
#ifndef WEIGHTD_SERVER_BASE_FLAG_TABLE_H_
#define WEIGHTD_SERVER_BASE_FLAG_TABLE_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace weightd {

struct FlagSpec {
  enum class Kind {
    kValue,   // --name VALUE or --name=VALUE; given again, applied again
    kList,    // like kValue, and "--name A B C" takes every following word
              // up to the next --flag; comma-separated in the environment
    kSwitch,  // --name alone means true; --name=false, and true/false (1/0,
              // yes/no) from the environment or a config file
  };
  std::string name;     // without "--"
  std::string metavar;  // "N", "PATH", ...; ignored for switches
  std::string help;     // one line
  Kind kind = Kind::kValue;
  // Applies one value ("true"/"false" for switches). Its error is returned
  // as is: name the flag in it.
  std::function<absl::Status(const std::string& value)> apply;
};

class FlagTable {
 public:
  // `program` heads the usage text; `env_prefix` ("WEIGHTD") names the
  // environment variables.
  FlagTable(std::string program, std::string env_prefix);

  // A name added twice is a programming error (assert).
  FlagTable& Add(FlagSpec spec);

  // PREFIX_HOST_MEMORY_BYTES for "host-memory-bytes".
  std::string EnvName(absl::string_view flag) const;

  // "usage: PROGRAM [flags]" and one line per flag, in the order added.
  std::string Usage() const;

  // Merges the sources and applies every value in order. `getenv` looks
  // the environment up (nullptr = unset). Returns the effective arguments
  // (argv-style, for logging). INVALID_ARGUMENT for an unknown flag (in any
  // source, naming it), a missing value, a malformed switch; NOT_FOUND for
  // a config file that cannot be opened; errors of `apply` as they are.
  // "--help"/"-h" are not handled here (see WantsHelp).
  absl::StatusOr<std::vector<std::string>> Parse(
      const std::vector<std::string>& args,
      const std::function<const char*(const char*)>& getenv) const;

  // Does the command line ask for the usage text?
  static bool WantsHelp(const std::vector<std::string>& args);

 private:
  const FlagSpec* Find(absl::string_view name) const;
  absl::StatusOr<std::vector<std::string>> Merge(
      const std::vector<std::string>& args,
      const std::function<const char*(const char*)>& getenv) const;

  std::string program_;
  std::string env_prefix_;
  std::vector<FlagSpec> specs_;
};

// Helpers for common value types; each names `flag` in its error.
std::function<absl::Status(const std::string&)> StringInto(std::string* out);
std::function<absl::Status(const std::string&)> AppendInto(std::vector<std::string>* out);
// An unsigned decimal in [min, max].
std::function<absl::Status(const std::string&)> Uint64Into(std::string flag, uint64_t* out,
                                                           uint64_t min = 0,
                                                           uint64_t max = UINT64_MAX);
// The same into a narrower integer; `max` must fit in T.
template <typename T>
std::function<absl::Status(const std::string&)> NumberInto(std::string flag, T* out,
                                                           uint64_t min, uint64_t max) {
  return [flag = std::move(flag), out, min, max](const std::string& v) -> absl::Status {
    uint64_t n = 0;
    absl::Status s = Uint64Into(flag, &n, min, max)(v);
    if (s.ok()) *out = static_cast<T>(n);
    return s;
  };
}

}  // namespace weightd

#endif  // WEIGHTD_SERVER_BASE_FLAG_TABLE_H_
