// The values a publish session takes and answers with (WeightService's
// publish calls, weight_service.h "Publishing new base weights"). No
// behaviour; copied freely.
#ifndef WEIGHTD_SERVER_PUBLISH_PUBLISH_TYPES_H_
#define WEIGHTD_SERVER_PUBLISH_PUBLISH_TYPES_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "server/publish/publish_plan.h"
#include "server/auth/access_control.h"
#include "server/service/types.h"

namespace weightd {

struct PublishBeginParams {
  std::optional<Principal> caller;  // none: the daemon itself
  std::string model;
  std::vector<PublishTensorSpec> tensors;
  uint64_t expect_generation = 0;
  absl::Duration timeout = absl::Minutes(10);  // from begin to the last byte
};
struct PublishSessionInfo {
  uint64_t id = 0;
  std::string token;  // every write and commit must present it
  uint64_t base_generation = 0;
  PublishLayout layout;  // where each tensor lies in the staging segment
  uint64_t staging_bytes = 0;  // the staging memfd's size (layout.total, rounded to its pages)
  uint64_t bytes = 0;    // tensor bytes to write (sum over the specs)
  absl::Time deadline;
  std::vector<std::string> per_part;  // specs the profile shards part by part
};
struct PublishRun {
  uint32_t tensor = 0;  // index into the session's specs
  uint64_t offset = 0;  // bytes into the tensor (row-major)
  uint64_t length = 0;
};
struct PublishResult {
  GenerationInfo generation;  // the new one, or the current one when nothing changed
  uint64_t tensors = 0;
  uint64_t changed = 0;         // served tensors whose bytes differ
  uint64_t bytes = 0;           // received
  uint64_t bytes_stored = 0;    // new memory held for the changed ones
  // Changed bytes that some loaded model already held, shared instead of
  // stored again (FindResidentCopies), and the models that held them.
  uint64_t bytes_shared = 0;
  std::vector<std::string> shared_with;
};
struct PublishProgress {
  uint64_t bytes_done = 0;
  uint64_t bytes_total = 0;
  std::optional<PublishResult> result;  // set by the write that completed it
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_PUBLISH_PUBLISH_TYPES_H_
