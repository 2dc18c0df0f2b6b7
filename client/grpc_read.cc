#include "client/grpc_read.h"

#include <algorithm>
#include <utility>

#include <grpcpp/client_context.h>

#include "absl/strings/str_cat.h"
#include "client/client_policy.h"
#include "common/grpc/chunk_stream.h"
#include "common/status_macros.h"

namespace weightd {
namespace {

// Streams bytes [offset, offset + length) of segment `index` into `out`.
absl::Status ReadRange(v1::Shards::Stub* stub, const v1::FetchResponse& resp, uint32_t index,
                       uint64_t offset, uint64_t length, std::string* out) {
  out->assign(length, '\0');
  if (length == 0) return absl::OkStatus();
  grpc::ClientContext ctx;
  v1::ReadRequest req;
  req.set_lease_id(resp.lease_id());
  req.set_token(resp.token());
  req.set_segment(index);
  req.set_offset(offset);
  req.set_length(length);
  auto reader = stub->Read(&ctx, req);
  // The daemon's own errors reach the caller as the daemon wrote them.
  return ReadChunksInto(ctx, *reader, length, reinterpret_cast<uint8_t*>(out->data()),
                        ChunkSender{absl::StrCat("the daemon (segment ", index, ")"), ""});
}

}  // namespace

std::vector<ReadRun> PlanReadRuns(const v1::FetchResponse& resp) {
  std::vector<int> order;
  for (int i = 0; i < resp.tensors_size(); ++i) {
    if (resp.tensors(i).length() != 0) order.push_back(i);
  }
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    const v1::ShardTensor &x = resp.tensors(a), &y = resp.tensors(b);
    return std::make_pair(x.segment(), x.offset()) < std::make_pair(y.segment(), y.offset());
  });
  std::vector<ReadRun> runs;
  for (int i : order) {
    const v1::ShardTensor& t = resp.tensors(i);
    const uint64_t end = t.offset() + t.length();  // checked against the segment by the caller
    if (!runs.empty() && runs.back().segment == t.segment() &&
        t.offset() <= runs.back().hi + kReadMergeGap) {
      runs.back().hi = std::max(runs.back().hi, end);
    } else {
      runs.push_back(ReadRun{t.segment(), t.offset(), end, {}});
    }
    runs.back().tensors.push_back(i);
  }
  return runs;
}

absl::StatusOr<std::vector<const uint8_t*>> ReadTensorRanges(v1::Shards::Stub* stub,
                                                             const v1::FetchResponse& resp,
                                                             std::vector<std::string>* buffers) {
  const std::vector<ReadRun> runs = PlanReadRuns(resp);
  std::vector<const uint8_t*> data(resp.tensors_size(), nullptr);
  buffers->resize(runs.size());
  for (size_t r = 0; r < runs.size(); ++r) {
    const ReadRun& run = runs[r];
    WD_RETURN_IF_ERROR(ReadRange(stub, resp, run.segment, run.lo, run.hi - run.lo,
                                 &(*buffers)[r]));
    for (int i : run.tensors) {
      data[i] = reinterpret_cast<const uint8_t*>((*buffers)[r].data()) +
                (resp.tensors(i).offset() - run.lo);
    }
  }
  return data;
}

}  // namespace weightd
