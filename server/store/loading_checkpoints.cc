#include "server/store/loading_checkpoints.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace weightd {
namespace {

// Bytes copied out of a partial copy for one peer read: the buffer a
// ReadCheckpoint stream sends from. Ids from their own range, never a
// segment's.
class CopiedBytes final : public Buffer {
 public:
  // `copied` counts the bytes of copies alive: taken by the caller, given
  // back here.
  CopiedBytes(std::string bytes, std::shared_ptr<std::atomic<uint64_t>> copied)
      : bytes_(std::move(bytes)), copied_(std::move(copied)) {}
  ~CopiedBytes() override { copied_->fetch_sub(bytes_.size()); }
  uint64_t id() const override { return id_; }
  uint64_t size() const override { return bytes_.size(); }
  MemoryLocation location() const override { return {}; }
  const uint8_t* host_data() const override {
    return reinterpret_cast<const uint8_t*>(bytes_.data());
  }
  absl::StatusOr<int> ShareableFd() const override {
    return absl::FailedPreconditionError("bytes copied for a peer are not shared");
  }

 private:
  static std::atomic<uint64_t> next_id_;
  const uint64_t id_ = next_id_.fetch_add(1);
  const std::string bytes_;
  const std::shared_ptr<std::atomic<uint64_t>> copied_;
};
std::atomic<uint64_t> CopiedBytes::next_id_{1ull << 62};

}  // namespace

LoadingCopy::LoadingCopy(Digest key, Digest copy, ReaderList readers,
                         std::vector<uint64_t> length)
    : key_(key),
      copy_(copy),
      readers_(std::move(readers)),
      length_(std::move(length)),
      read_(length_.size()) {}

void LoadingCopy::Attach(std::vector<const uint8_t*> data) {
  absl::MutexLock lock(&mu_);
  if (data.size() == length_.size()) data_ = std::move(data);
}

void LoadingCopy::MarkRead(size_t file, uint64_t begin, uint64_t length) {
  absl::MutexLock lock(&mu_);
  if (closed_ || data_.empty()) return;
  read_.Add(file, begin, length);
}

void LoadingCopy::Close() {
  absl::MutexLock lock(&mu_);  // exclusive: no copy is in flight after this
  closed_ = true;
}

bool LoadingCopy::HasLocked(const CheckpointRange& r) const {
  return !closed_ && !data_.empty() && read_.Covers(r.file, r.offset, r.length);
}

bool LoadingCopy::CopyOut(const CheckpointRange& r, std::string* out) const {
  absl::ReaderMutexLock lock(&mu_);
  if (!HasLocked(r)) return false;
  out->assign(reinterpret_cast<const char*>(data_[r.file]) + r.offset, r.length);
  return true;
}

bool LoadingCopy::Describe(const std::vector<CheckpointRange>& samples,
                           std::vector<CheckpointRange>* have,
                           std::vector<std::optional<Digest>>* digests) const {
  absl::ReaderMutexLock lock(&mu_);
  if (closed_) return false;
  *have = read_.List(kMaxPartialRanges);
  for (const CheckpointRange& s : samples) {
    if (s.file < length_.size() && s.offset <= length_[s.file] &&
        s.length <= length_[s.file] - s.offset && HasLocked(s)) {
      digests->push_back(DigestBytes(data_[s.file] + s.offset, s.length));
    } else {
      digests->push_back(std::nullopt);
    }
  }
  return true;
}

std::shared_ptr<LoadingCopy> LoadingCheckpoints::Add(const Digest& key, ReaderList readers,
                                                     std::vector<uint64_t> length) {
  auto copy =
      std::make_shared<LoadingCopy>(key, RandomDigest(), std::move(readers), std::move(length));
  absl::MutexLock lock(&mu_);
  for (auto it = loads_.begin(); it != loads_.end();) {  // the gone ones
    it = it->second.expired() ? loads_.erase(it) : std::next(it);
  }
  loads_.emplace(key, copy);
  return copy;
}

std::vector<std::shared_ptr<LoadingCopy>> LoadingCheckpoints::Live(const Digest& key) const {
  std::vector<std::shared_ptr<LoadingCopy>> out;
  absl::MutexLock lock(&mu_);
  auto [b, e] = loads_.equal_range(key);
  for (auto it = b; it != e; ++it) {
    if (std::shared_ptr<LoadingCopy> c = it->second.lock()) out.push_back(std::move(c));
  }
  return out;
}

std::vector<LoadingCheckpoints::Offer> LoadingCheckpoints::Find(
    const Digest& key, const std::vector<CheckpointRange>& samples,
    absl::FunctionRef<bool(const ReaderList&)> admits) const {
  std::vector<Offer> out;
  for (const std::shared_ptr<LoadingCopy>& c : Live(key)) {
    if (!admits(c->readers())) continue;
    Offer o;
    o.copy = c->copy();
    if (c->Describe(samples, &o.have, &o.sample_digests)) out.push_back(std::move(o));
  }
  return out;
}

absl::StatusOr<BufferPtr> LoadingCheckpoints::Read(
    const Digest& key, const Digest& copy, const CheckpointRange& r,
    absl::FunctionRef<bool(const ReaderList&)> admits) const {
  if (r.length > kMaxPartialReadBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a range of ", r.length, " bytes from a checkpoint still loading (at most ",
        kMaxPartialReadBytes, " at once)"));
  }
  for (const std::shared_ptr<LoadingCopy>& c : Live(key)) {
    if (c->copy() != copy || !admits(c->readers())) continue;
    if (r.file >= c->length_.size() || r.offset > c->length_[r.file] ||
        r.length > c->length_[r.file] - r.offset) {
      return absl::InvalidArgumentError(absl::StrCat("range ", r.offset, "+", r.length,
                                                     " of file ", r.file,
                                                     " is outside the checkpoint's files"));
    }
    if (copied_->fetch_add(r.length) + r.length > max_copy_bytes_) {
      copied_->fetch_sub(r.length);
      return absl::ResourceExhaustedError(absl::StrCat(
          "copies of a checkpoint still loading for peers already hold ", max_copy_bytes_,
          " bytes; ask again shortly"));
    }
    std::string bytes;
    if (!c->CopyOut(r, &bytes)) {
      copied_->fetch_sub(r.length);
      break;
    }
    return std::make_shared<const CopiedBytes>(std::move(bytes), copied_);
  }
  return absl::NotFoundError(absl::StrCat("copy ", copy.Hex().substr(0, 12), " of checkpoint ",
                                          key.Hex().substr(0, 12),
                                          " is not loading here (any more), or has not read "
                                          "those bytes yet"));
}

}  // namespace weightd
