// weightctl: the operator's and test-suite's command line for weightd
// (docs/DESIGN.md §4.2). Flags are parsed here and in verbs.cc, and only there. This
// file is the shell: the global flags, the verb table (each verb's flags,
// handler and usage lines; the handlers are in verbs.cc), the usage text
// built from it, and the exit code (0; 2 for INVALID_ARGUMENT; else 1).
#include <stdio.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "client/cli/verbs.h"
#include "client/weightd_client.h"
#include "common/fd.h"
#include "common/status_macros.h"

namespace weightd {
namespace {

using weightctl::Args;
using weightctl::ParseArgs;

// The usage text's first lines; each verb's lines follow, from Verbs().
constexpr char kUsageHeader[] =
    "usage: weightctl [--socket PATH | --target HOST:PORT] [--tls-ca FILE]\n"
    "                 [--tls-cert FILE --tls-key FILE] [--tls-server-name NAME]\n"
    "                 [--token-file FILE] [--retry-deadline SECONDS] VERB ...\n"
    "  (--retry-deadline: retry read-only verbs and fetch on UNAVAILABLE, e.g. while\n"
    "   the daemon restarts, for up to SECONDS; default 0 = fail at once)\n";

// One verb: the flags it takes, its handler and its lines in the usage text.
struct Verb {
  const char* name;
  std::vector<std::string> value_flags;  // --flag VALUE or --flag=VALUE
  std::vector<std::string> switches;     // --flag
  absl::Status (*run)(Client& c, const Args& a);  // verbs.h
  // Its usage, printed after two spaces (continuation lines carry their own
  // indent and every line its newline). A verb of one short synopsis sets
  // `shares_line` instead: consecutive ones share a line, " | " between.
  const char* usage;
  bool shares_line = false;
};

// Every verb, in the order the usage text lists them.
const std::vector<Verb>& Verbs() {
  static const auto* const kVerbs = new std::vector<Verb>{
      {"health", {}, {}, weightctl::CmdHealth, "health\n"},
      {"load", {"--profile", "--readers", "--source"}, {}, weightctl::CmdLoad,
       "load NAME PATH [--profile FILE] [--readers uid:N,gid:N,token:NAME,cn:NAME]\n"
       "       [--source auto|storage|peers]   (auto: peers holding the same files, else storage)\n"},
      {"unload", {}, {}, weightctl::CmdUnload, "unload NAME", true},
      {"list", {}, {}, weightctl::CmdList, "list", true},
      {"info", {}, {}, weightctl::CmdInfo, "info NAME", true},
      {"stats", {}, {}, weightctl::CmdStats, "stats", true},
      {"verify", {}, {}, weightctl::CmdVerify, "verify NAME", true},
      {"gpus", {}, {}, weightctl::CmdGpus, "gpus", true},
      {"peers", {}, {}, weightctl::CmdPeers, "peers", true},
      {"fetch",
       {"--world", "--rank", "--mesh", "--coord", "--placements", "--dtype", "--transport",
        "--device", "--generation", "--changed-since", "--names", "--out"},
       {"--verify", "--cast-on-fetch", "--merge-on-push"},
       weightctl::CmdFetch,
       "fetch NAME [--world W --rank R | --mesh AxB --coord i,j] [--placements P]\n"
       "        [--dtype keep|f32|f16|bf16|f8_e4m3|f8_e5m2] [--transport shm|grpc|push|cuda [--device N]]\n"
       "        [--generation G] [--changed-since G] [--names a,b] [--verify]\n"
       "        [--cast-on-fetch | --merge-on-push] --out FILE\n"
       "        (push, cuda: casts run as the daemon writes, on the GPU for cuda, and so do\n"
       "         LoRA merges for cuda; --cast-on-fetch materializes everything first,\n"
       "         --merge-on-push merges as it writes for push too)\n"},
      {"adapter", {"--format", "--readers", "--source"}, {"--strict"}, weightctl::CmdAdapter,
       "adapter load NAME PATH [--format auto|peft|kohya|dense] [--strict] [--readers LIST]\n"
       "       [--source auto|storage|peers]\n"
       "  adapter list | adapter unload NAME\n"},
      {"apply", {"--expect-generation"}, {}, weightctl::CmdApply,
       "apply MODEL [ADAPTER[:STRENGTH] ...] [--expect-generation G]   (none = back to base)\n"},
      {"watch", {"--count"}, {}, weightctl::CmdWatch, "watch MODEL [--count N]\n"},
      {"publish", {"--expect-generation", "--timeout", "--transport"}, {}, weightctl::CmdPublish,
       "publish MODEL FILE.safetensors [--expect-generation G] [--timeout SECONDS]\n"
       "        [--transport shm|grpc]\n"
       "        (new base weights: every tensor of FILE replaces the served tensor of its\n"
       "         name, same dtype and shape; unchanged ones keep their digests. shm, the\n"
       "         default over a Unix socket: copied once into the daemon's staging memory)\n"},
  };
  return *kVerbs;
}

// kUsageHeader, then every verb's usage.
const std::string& Usage() {
  static const auto* const kUsage = [] {
    auto* out = new std::string(kUsageHeader);
    std::vector<absl::string_view> shared;  // synopses waiting for their line
    auto flush = [&] {
      if (!shared.empty()) absl::StrAppend(out, "  ", absl::StrJoin(shared, " | "), "\n");
      shared.clear();
    };
    for (const Verb& v : Verbs()) {
      if (v.shares_line) {
        shared.push_back(v.usage);
        continue;
      }
      flush();
      absl::StrAppend(out, "  ", v.usage);
    }
    flush();
    return out;
  }();
  return *kUsage;
}

const Verb* FindVerb(absl::string_view name) {
  for (const Verb& v : Verbs()) {
    if (v.name == name) return &v;
  }
  return nullptr;
}

// One global flag (`value` is empty for one that takes none).
absl::Status ApplyGlobalFlag(const std::string& name, const std::string& value,
                             ClientOptions& copt, std::string& token_file) {
  if (name == "--socket") {
    copt.socket = value;
    copt.target.clear();
  } else if (name == "--target") {
    copt.target = value;
    copt.socket.clear();
  } else if (name == "--tls-ca") {
    copt.tls_ca_file = value;
  } else if (name == "--tls-cert") {
    copt.tls_cert_file = value;
  } else if (name == "--tls-key") {
    copt.tls_key_file = value;
  } else if (name == "--tls-server-name") {
    copt.tls_server_name = value;
  } else if (name == "--token-file") {
    token_file = value;
  } else if (name == "--retry-deadline") {
    double seconds = 0;
    if (!absl::SimpleAtod(value, &seconds) || !(seconds >= 0) || seconds > 86400) {
      return absl::InvalidArgumentError(
          absl::StrCat("--retry-deadline: expected seconds (0-86400), got \"", value, "\""));
    }
    copt.retry_deadline = absl::Seconds(seconds);
  } else if (name == "--help" || name == "-h") {
    std::fputs(Usage().c_str(), stdout);
    std::exit(0);
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown flag ", name, "\n", Usage()));
  }
  return absl::OkStatus();
}

// The global flags, which come before the verb; returns the verb's index
// in `words` (words.size() when there is none).
absl::StatusOr<size_t> ParseGlobalFlags(const std::vector<std::string>& words,
                                        ClientOptions& copt, std::string& token_file) {
  const std::vector<std::string> value_flags = {"--socket",   "--target",   "--tls-ca",
                                                "--tls-cert", "--tls-key",  "--tls-server-name",
                                                "--token-file", "--retry-deadline"};
  size_t i = 0;
  for (; i < words.size() && absl::StartsWith(words[i], "--"); ++i) {
    std::string w = words[i];
    std::string value;
    std::string name = w;
    if (size_t eq = w.find('='); eq != std::string::npos) {
      name = w.substr(0, eq);
      value = w.substr(eq + 1);
    } else if (std::find(value_flags.begin(), value_flags.end(), name) != value_flags.end()) {
      if (i + 1 >= words.size()) return absl::InvalidArgumentError(absl::StrCat(name, " needs a value"));
      value = words[++i];
    }
    WD_RETURN_IF_ERROR(ApplyGlobalFlag(name, value, copt, token_file));
  }
  return i;
}

absl::Status Run(int argc, char** argv) {
  std::vector<std::string> words(argv + 1, argv + argc);
  ClientOptions copt;
  copt.retry_deadline = absl::ZeroDuration();  // scripts and probes want an answer now
  if (const char* env = std::getenv("WEIGHTD_SOCKET")) copt.socket = env;
  if (const char* env = std::getenv("WEIGHTD_TOKEN")) copt.token = env;
  std::string token_file;
  if (const char* env = std::getenv("WEIGHTD_TOKEN_FILE")) token_file = env;
  WD_ASSIGN_OR_RETURN(const size_t i, ParseGlobalFlags(words, copt, token_file));
  if (i >= words.size()) return absl::InvalidArgumentError(absl::StrCat("no verb given\n", Usage()));
  if (copt.socket.empty() && copt.target.empty()) copt.socket = "/run/weightd/weightd.sock";
  if (!token_file.empty()) {
    WD_ASSIGN_OR_RETURN(copt.token, ReadTokenFile(token_file, "--token-file"));
  }
  const std::string& verb = words[i];
  std::vector<std::string> rest(words.begin() + i + 1, words.end());
  WD_ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Client::Connect(copt));
  const Verb* v = FindVerb(verb);
  if (v == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("unknown verb \"", verb, "\"\n", Usage()));
  }
  WD_ASSIGN_OR_RETURN(Args a, ParseArgs(rest, v->value_flags, v->switches));
  return v->run(*client, a);
}

}  // namespace
}  // namespace weightd

int main(int argc, char** argv) {
  absl::Status s = weightd::Run(argc, argv);
  if (s.ok()) return 0;
  std::fprintf(stderr, "error: %s: %s\n", absl::StatusCodeToString(s.code()).c_str(),
               std::string(s.message()).c_str());
  return s.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}
