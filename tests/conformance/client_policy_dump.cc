// Prints the client policy the C++ client was built with, as JSON, for
// test_client_policy.py to compare with client/policy/client_policy.json:
// the generated constants the client uses, and which codes its retry loop
// (client/retry.h) retries.
#include <cstdio>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/client_policy.h"
#include "client/retry.h"

namespace weightd {
namespace {

std::string Quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string Number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

int Dump() {
  std::string codes, retried;
  for (absl::StatusCode c : kRetryCodes) {
    absl::StrAppend(&codes, codes.empty() ? "" : ", ", Quote(absl::StatusCodeToString(c)));
  }
  for (int c = 1; c <= 16; ++c) {
    const absl::Status s(static_cast<absl::StatusCode>(c), "x");
    if (Retryable(s)) {
      absl::StrAppend(&retried, retried.empty() ? "" : ", ", Quote(absl::StatusCodeToString(s.code())));
    }
  }
  std::printf(
      "{\"retry_codes\": [%s], \"retried\": [%s], \"initial_backoff_s\": %s, "
      "\"multiplier\": %s, \"max_backoff_s\": %s, \"jitter\": %s, \"service_config\": %s, "
      "\"read_merge_gap\": %llu, \"max_message\": %d}\n",
      codes.c_str(), retried.c_str(), Number(kRetryInitialBackoffS).c_str(),
      Number(kRetryMultiplier).c_str(), Number(kRetryMaxBackoffS).c_str(),
      Number(kRetryJitter).c_str(), Quote(kServiceConfig).c_str(),
      static_cast<unsigned long long>(kReadMergeGap), kMaxMessageBytes);
  return 0;
}

}  // namespace
}  // namespace weightd

int main() { return weightd::Dump(); }
