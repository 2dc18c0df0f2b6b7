#include "client/dlpack.h"

#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace weightd {
namespace {

// What a managed tensor owns: its set (and so the lease and memory) and
// its shape.
struct DLPackContext {
  std::shared_ptr<const ShardSet> set;
  std::vector<int64_t> shape;
  dl::DLManagedTensor managed{};
};

void DeleteDLPack(dl::DLManagedTensor* self) {
  delete static_cast<DLPackContext*>(self->manager_ctx);
}

}  // namespace

absl::StatusOr<dl::DLDataType> DLPackTypeOf(DType dtype, absl::string_view name) {
  dl::DLDataType type{0, static_cast<uint8_t>(DTypeSize(dtype) * 8), 1};
  switch (dtype) {
    case DType::kF64:
    case DType::kF32:
    case DType::kF16: type.code = 2; break;
    case DType::kBF16: type.code = 4; break;
    case DType::kBool: type.code = 6; break;
    case DType::kU8: type.code = 1; break;
    case DType::kF8E4M3:
    case DType::kF8E5M2:
      return absl::UnimplementedError(absl::StrCat(
          "tensor \"", name, "\" is ", DTypeName(dtype),
          ": DLPack's unversioned ABI has no FP8 code; take its bytes (TensorView::data)"));
    default: type.code = 0; break;  // the signed integers
  }
  return type;
}

absl::StatusOr<dl::DLManagedTensor*> ToDLPack(std::shared_ptr<const ShardSet> set,
                                              size_t index) {
  if (set == nullptr || index >= set->tensors().size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "no tensor ", index, " in the shard set (", set == nullptr ? 0 : set->tensors().size(),
        " tensors)"));
  }
  const TensorView& t = set->tensors()[index];
  absl::StatusOr<dl::DLDataType> type = DLPackTypeOf(t.dtype, t.name);
  if (!type.ok()) return type.status();
  auto ctx = std::make_unique<DLPackContext>();
  ctx->set = std::move(set);
  ctx->shape = t.shape;
  dl::DLTensor& d = ctx->managed.dl_tensor;
  d.data = const_cast<uint8_t*>(t.data);
  d.device = dl::DLDevice{t.device < 0 ? 1 : 2, t.device < 0 ? 0 : t.device};
  d.ndim = static_cast<int32_t>(ctx->shape.size());
  d.dtype = *type;
  d.shape = ctx->shape.data();
  d.strides = nullptr;
  d.byte_offset = 0;
  ctx->managed.manager_ctx = ctx.get();
  ctx->managed.deleter = &DeleteDLPack;
  return &ctx.release()->managed;
}

}  // namespace weightd
