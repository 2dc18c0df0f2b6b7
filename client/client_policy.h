// The rules the C++ client shares with the Python client (retry codes and
// backoff, the read-only methods' service config, read coalescing, the
// largest message), as constants generated at build time from
// client/policy/client_policy.json (client/CMakeLists.txt runs
// client/policy/gen_client_policy.py; tests/conformance/test_client_policy.py
// pins both clients to the JSON). Not installed.
#ifndef WEIGHTD_CLIENT_CLIENT_POLICY_H_
#define WEIGHTD_CLIENT_CLIENT_POLICY_H_

#include <cstdint>

#include "absl/status/status.h"

namespace weightd {

#include "client/client_policy.inc"  // ${CMAKE_BINARY_DIR}/generated

}  // namespace weightd

#endif  // WEIGHTD_CLIENT_CLIENT_POLICY_H_
