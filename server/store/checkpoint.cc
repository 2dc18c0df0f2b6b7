#include "server/store/checkpoint.h"

#include <algorithm>

namespace weightd {

int64_t StoredTensor::NumElements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

uint64_t TensorMetadataBytes(absl::string_view name, size_t rank) {
  return kTensorMetadataBytes + kTensorMetadataBytesPerNameByte * name.size() +
         kTensorMetadataBytesPerDim * rank;
}

Checkpoint::Checkpoint(std::string path, std::vector<std::string> files,
                       std::vector<StoredTensor> tensors,
                       std::vector<SegmentPtr> host_segments,
                       std::unique_ptr<MemoryCharge> metadata_charge,
                       std::vector<CheckpointFileInfo> file_info)
    : path_(std::move(path)),
      files_(std::move(files)),
      tensors_(std::move(tensors)),
      host_segments_(std::move(host_segments)),
      file_info_(std::move(file_info)),
      metadata_charge_(std::move(metadata_charge)) {
  if (!file_info_.empty()) {
    std::vector<CheckpointFileId> ids;
    for (const CheckpointFileInfo& f : file_info_) ids.push_back(f.id);
    content_key_ = CheckpointKey(ids);
  }
  std::sort(tensors_.begin(), tensors_.end(),
            [](const StoredTensor& a, const StoredTensor& b) { return a.name < b.name; });
  DigestBuilder copy;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    by_name_[tensors_[i].name] = i;
    total_bytes_ += tensors_[i].length;
    copy.Update(tensors_[i].digest.bytes.data(), tensors_[i].digest.bytes.size());
  }
  copy_id_ = copy.Finish();
  for (const SegmentPtr& seg : host_segments_) {
    page_bytes_[static_cast<size_t>(seg->pages())] += seg->size();
  }
}

const StoredTensor* Checkpoint::Find(absl::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

}  // namespace weightd
