// PushIntoCudaAndCopyBack in a client built without CUDA headers.
#include "client/cuda/cuda_push.h"

namespace weightd {

absl::Status PushIntoCudaAndCopyBack(const v1::FetchResponse&, int, std::vector<std::string>*) {
  return absl::UnimplementedError(
      "this client was built without CUDA (no cuda.h): it cannot fetch into a GPU");
}

}  // namespace weightd
