#include "server/store/checkpoint_layout.h"

#include <algorithm>

#include "server/base/thread_pool.h"

namespace weightd {
namespace {

// Each file's identity and place.
std::vector<CheckpointFileInfo> DescribeFiles(const CheckpointFiles& files) {
  std::vector<CheckpointFileInfo> out;
  for (size_t i = 0; i < files.files.size(); ++i) {
    const CheckpointFile& f = files.files[i];
    CheckpointFileInfo info;
    info.path = f.path();
    info.id = {files.names[i], f.size(), f.header_digest};
    info.data_offset = f.header.data_offset;
    info.data_length = f.data_length();
    info.segment = f.segment_index;
    info.segment_offset = f.segment_offset;
    info.mtime_sec = f.st().st_mtim.tv_sec;
    info.mtime_nsec = f.st().st_mtim.tv_nsec;
    info.dev = f.st().st_dev;
    info.ino = f.st().st_ino;
    info.version = f.opened.version;
    out.push_back(std::move(info));
  }
  return out;
}

// The tensors where the layout puts them.
void PlaceTensors(const std::vector<CheckpointFile>& files, uint64_t tensors_total,
                  LoadLayout& layout) {
  layout.tensors.reserve(tensors_total);
  for (size_t i = 0; i < files.size(); ++i) {
    const CheckpointFile& f = files[i];
    for (const SafetensorsEntry& e : f.header.tensors) {
      StoredTensor t;
      t.name = e.name;
      t.dtype = e.dtype;
      t.shape = e.shape;
      t.offset = f.segment_offset + e.begin;
      t.length = e.end - e.begin;
      t.file = f.path();
      layout.tensors.push_back(std::move(t));
      layout.tensor_segment.push_back(f.segment_index);
      layout.tensor_file.push_back(i);
      layout.tensor_begin.push_back(e.begin);
    }
  }
}

}  // namespace

LoadLayout LayOut(CheckpointFiles& files, uint64_t segment_target_bytes) {
  LoadLayout layout;
  std::vector<uint64_t>& sizes = layout.segment_sizes;
  for (CheckpointFile& f : files.files) {
    const uint64_t data_len = f.data_length();
    layout.bytes_total += data_len;
    if (sizes.empty() || (sizes.back() > 0 && sizes.back() + data_len > segment_target_bytes)) {
      sizes.push_back(0);
    }
    f.segment_index = sizes.size() - 1;
    f.segment_offset = sizes.back();
    sizes.back() = AlignUp(sizes.back() + data_len, kSegmentAlign);
  }
  layout.file_info = DescribeFiles(files);
  PlaceTensors(files.files, files.tensors, layout);
  return layout;
}

ChunkPlan PlanChunks(const std::vector<CheckpointFile>& files, const LoadLayout& layout,
                     std::vector<uint8_t*> file_data, uint64_t chunk_bytes) {
  ChunkPlan plan;
  plan.file_data = std::move(file_data);
  std::vector<Chunk>& chunks = plan.chunks;
  size_t groups = 0;
  size_t t = 0;  // tensors are in file order, each file's by offset
  for (size_t i = 0; i < files.size(); ++i) {
    const CheckpointFile& f = files[i];
    plan.first_chunk.push_back(chunks.size());
    uint8_t* base = plan.file_data[i];
    auto emit = [&](uint64_t begin, uint64_t end) {
      for (uint64_t off = begin; off < end; off += chunk_bytes) {
        chunks.push_back({i, f.header.data_offset + off, std::min(chunk_bytes, end - off),
                          base + off, off, groups});
      }
      ++groups;
    };
    uint64_t group_start = 0, pos = 0;
    for (; t < layout.tensors.size() && layout.tensor_file[t] == i; ++t) {
      const uint64_t end = std::max(pos, layout.tensor_begin[t] + layout.tensors[t].length);
      if (end - group_start > chunk_bytes && pos > group_start) {
        emit(group_start, pos);
        group_start = pos;
      }
      pos = end;
      if (pos - group_start > chunk_bytes) {
        emit(group_start, pos);
        group_start = pos;
      }
    }
    if (f.data_length() > group_start) emit(group_start, f.data_length());
  }
  plan.first_chunk.push_back(chunks.size());
  return plan;
}

std::vector<size_t> ChunkPlan::Under(size_t file, uint64_t begin, uint64_t length) const {
  std::vector<size_t> out;
  if (length == 0) return out;
  // The last chunk starting at or before `begin`, then on while they start
  // before the end.
  auto it = std::upper_bound(chunks.begin() + first_chunk[file],
                             chunks.begin() + first_chunk[file + 1], begin,
                             [](uint64_t b, const Chunk& c) { return b < c.data_begin; });
  for (size_t ci = static_cast<size_t>(it - chunks.begin()) - 1;
       ci < first_chunk[file + 1] && chunks[ci].data_begin < begin + length; ++ci) {
    out.push_back(ci);
  }
  return out;
}

DigestAsRead::DigestAsRead(LoadLayout& layout, const ChunkPlan& plan)
    : layout_(layout),
      plan_(plan),
      tensors_of_chunk_(plan.chunks.size()),
      pending_(new std::atomic<uint32_t>[layout.tensors.size()]) {
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    const std::vector<size_t> under =
        plan.Under(layout.tensor_file[i], layout.tensor_begin[i], layout.tensors[i].length);
    pending_[i].store(static_cast<uint32_t>(under.size()), std::memory_order_relaxed);
    for (size_t c : under) tensors_of_chunk_[c].push_back(i);
    if (under.empty()) Digest(i);  // no bytes to wait for
  }
}

void DigestAsRead::ChunkDone(size_t chunk) {
  for (size_t i : tensors_of_chunk_[chunk]) {
    // acq_rel: the last chunk's thread sees every other chunk's bytes.
    if (pending_[i].fetch_sub(1, std::memory_order_acq_rel) == 1) Digest(i);
  }
}

void DigestAsRead::Digest(size_t i) {
  StoredTensor& t = layout_.tensors[i];
  t.digest = DigestBytes(plan_.file_data[layout_.tensor_file[i]] + layout_.tensor_begin[i],
                         t.length);
  digested_.fetch_add(1);
}

absl::Status DigestTensors(LoadLayout& layout, const ChunkPlan& plan, int threads) {
  return ParallelFor(nullptr, layout.tensors.size(), threads, [&](size_t i) {
    StoredTensor& t = layout.tensors[i];
    const uint8_t* bytes = plan.file_data[layout.tensor_file[i]] + layout.tensor_begin[i];
    t.digest = DigestBytes(bytes, t.length);
    return absl::OkStatus();
  });
}

}  // namespace weightd
