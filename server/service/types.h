// The plain values the service answers with: summaries of models, tensors
// and adapters, adapter stack entries and generation descriptions. No
// behaviour; copied freely.
#ifndef WEIGHTD_SERVER_SERVICE_TYPES_H_
#define WEIGHTD_SERVER_SERVICE_TYPES_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "common/digest.h"
#include "common/dtype.h"
#include "server/memory/segment.h"
#include "server/auth/access_control.h"

namespace weightd {

struct ModelSummary {
  std::string name;
  std::string path;
  uint64_t generation = 0;
  uint64_t tensor_count = 0;  // served tensors
  uint64_t total_bytes = 0;   // checkpoint bytes
  // The checkpoint's segments by page kind (PageKind order), rounding included.
  std::array<uint64_t, kPageKinds> page_bytes{};
  std::vector<std::string> files;
  std::vector<std::string> adapters;  // current stack, "name:strength"
  std::vector<std::string> report;    // profile report, names summarized
  std::vector<std::string> readers;   // the model's own; empty = public
  // What a read of the current generation must pass: the model and every
  // private adapter in its stack.
  std::vector<ReadGuard> guards;
  // Identity of the current generation's served content: a digest over the
  // (served name, tensor digest) pairs in name order.
  Digest content;
};

struct TensorSummary {
  std::string name;  // served name
  DType dtype;       // as served by default (dtype rules and quantization applied)
  std::vector<int64_t> shape;
  Digest digest;     // content identity at the current generation
  std::vector<std::string> sources;  // checkpoint names (reverse map)
  std::vector<std::string> patched_by;  // adapters touching it
};

struct ModelDetail {
  ModelSummary summary;
  std::vector<TensorSummary> tensors;
};

struct AdapterSummary {
  std::string name;
  std::string path;
  std::string format;
  uint64_t tensor_count = 0;  // parameters it patches
  uint64_t bytes = 0;
  std::vector<std::string> ignored;  // keys not understood, summarized
  std::vector<std::string> readers;  // empty = public
};

struct AdapterRef {
  std::string name;
  float strength = 1.0f;
};

// The bytes a grpc-transport Read (or a peer's ReadCheckpoint) streams.
struct ReadRange {
  BufferPtr buffer;  // host memory (Read refuses other kinds)
  uint64_t offset = 0;
  uint64_t length = 0;
};

struct GenerationInfo {
  std::string model;
  uint64_t generation = 0;
  std::vector<std::string> adapters;  // "name:strength"
  std::vector<ReadGuard> guards;      // what reading this generation must pass
  Digest content;                     // as ModelSummary::content
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_SERVICE_TYPES_H_
