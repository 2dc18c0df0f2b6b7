// kCuda fetches (docs/DESIGN.md §9.3): the daemon pushes a shard into GPU memory the
// client allocated, and the client copies it back to host memory for its
// views. With WEIGHTD_CLIENT_CUDA this is cuda_push.cc (the driver through
// cuda_driver.h); without, no_cuda_push.cc, which refuses. No CUDA types
// here: the rest of the client never includes cuda.h.
#ifndef WEIGHTD_CLIENT_CUDA_CUDA_PUSH_H_
#define WEIGHTD_CLIENT_CUDA_CUDA_PUSH_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "weightd/v1/weightd.pb.h"

namespace weightd {

// Allocates a CUDA VMM allocation on this process's CUDA device `device`
// (the default layout's bytes, rounded up to the granularity), has the
// daemon push the shard of `resp` into it (WDC1 on the data socket, the
// exported fd riding along), copies each tensor back into `host` (one
// string per tensor) and frees the allocation; the push's connection is
// closed, which ends the lease. FAILED_PRECONDITION without a usable
// driver, UNAVAILABLE for a failed CUDA call, the daemon's code for a
// refused push; UNIMPLEMENTED in a client built without CUDA.
absl::Status PushIntoCudaAndCopyBack(const v1::FetchResponse& resp, int device,
                                     std::vector<std::string>* host);

}  // namespace weightd

#endif  // WEIGHTD_CLIENT_CUDA_CUDA_PUSH_H_
