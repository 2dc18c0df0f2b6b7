// DLPack views of a ShardSet's tensors (ToDLPack, declared in the public
// weightd_client.h): the dtype mapping, and the managed tensor that keeps
// its set alive. Stateless; thread-safe.
#ifndef WEIGHTD_CLIENT_DLPACK_H_
#define WEIGHTD_CLIENT_DLPACK_H_

#include "absl/status/statusor.h"
#include "client/weightd_client.h"

namespace weightd {

// DLPack's type of `dtype` (one lane): float 2, bfloat 4, bool 6, uint 1,
// int 0. UNIMPLEMENTED for FP8 (the unversioned ABI has no FP8 code);
// `name` names the tensor in that message.
absl::StatusOr<dl::DLDataType> DLPackTypeOf(DType dtype, absl::string_view name);

}  // namespace weightd

#endif  // WEIGHTD_CLIENT_DLPACK_H_
