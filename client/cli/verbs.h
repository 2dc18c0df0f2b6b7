// weightctl's verbs: one handler per verb, called by weightctl.cc (which
// owns the verb table, the global flags and the usage text) with the verb's
// words already split by ParseArgs. A handler checks its words, calls the
// daemon through the C++ client and prints the answer on stdout (progress on
// stderr); an error is returned for weightctl.cc to print as
// "error: CODE: message" (INVALID_ARGUMENT, exit code 2, for bad words).
#ifndef WEIGHTD_CLIENT_CLI_VERBS_H_
#define WEIGHTD_CLIENT_CLI_VERBS_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/weightd_client.h"

namespace weightd::weightctl {

// Positional words and --flag values of one verb.
struct Args {
  std::vector<std::string> positional;
  std::map<std::string, std::string> flags;
  std::map<std::string, bool> switches;

  bool Has(const std::string& f) const { return flags.count(f) > 0; }
  std::string Get(const std::string& f, const std::string& def = "") const {
    auto it = flags.find(f);
    return it == flags.end() ? def : it->second;
  }
};

// Splits a verb's words: --NAME VALUE or --NAME=VALUE for `value_flags`,
// --NAME for `switch_flags`, the rest positional. Any other --flag, or a
// value flag with no value, is INVALID_ARGUMENT.
absl::StatusOr<Args> ParseArgs(const std::vector<std::string>& words,
                               const std::vector<std::string>& value_flags,
                               const std::vector<std::string>& switch_flags);

absl::Status CmdHealth(Client& c, const Args& a);
absl::Status CmdLoad(Client& c, const Args& a);
absl::Status CmdUnload(Client& c, const Args& a);
absl::Status CmdList(Client& c, const Args& a);
absl::Status CmdInfo(Client& c, const Args& a);
absl::Status CmdVerify(Client& c, const Args& a);
absl::Status CmdPeers(Client& c, const Args& a);
absl::Status CmdStats(Client& c, const Args& a);
absl::Status CmdGpus(Client& c, const Args& a);
absl::Status CmdFetch(Client& c, const Args& a);
absl::Status CmdAdapter(Client& c, const Args& a);
absl::Status CmdApply(Client& c, const Args& a);
absl::Status CmdPublish(Client& c, const Args& a);
absl::Status CmdWatch(Client& c, const Args& a);

}  // namespace weightd::weightctl

#endif  // WEIGHTD_CLIENT_CLI_VERBS_H_
