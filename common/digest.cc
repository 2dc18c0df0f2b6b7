#include "common/digest.h"

#include <xxhash.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <random>

#include "absl/strings/escaping.h"
#include "absl/strings/string_view.h"
#include "common/digest_kernel.h"

namespace weightd {
namespace {

#if defined(WEIGHTD_DIGEST_X86)
bool CpuRuns(absl::string_view name) {
  __builtin_cpu_init();  // in case a digest is taken during static initialization
  if (name == "avx2") return __builtin_cpu_supports("avx2");
  if (name == "avx512") {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2");
  }
  return false;
}
#endif

const WdDigestKernel& SelectKernel() {
  const std::vector<const WdDigestKernel*> usable = UsableDigestKernels();
  const char* env = std::getenv("WEIGHTD_DIGEST_KERNEL");
  const absl::string_view want = env != nullptr ? env : "";
  // AVX2 unless told otherwise: on the machines measured (bench/digest_bench)
  // AVX-512 XXH3 digests resident memory slower than AVX2 (22 vs 29 GB/s).
  const WdDigestKernel* pick = usable.front();
  for (const WdDigestKernel* k : usable) {
    if (k->name == want) return *k;
    if (absl::string_view(k->name) != "avx512") pick = k;
  }
  return *pick;
}

}  // namespace

Digest DigestFromHash(WdHash128 w) {
  XXH128_hash_t h;
  h.low64 = w.low64;
  h.high64 = w.high64;
  XXH128_canonical_t canon;
  XXH128_canonicalFromHash(&canon, h);
  Digest d;
  static_assert(sizeof(canon.digest) == 16);
  std::memcpy(d.bytes.data(), canon.digest, 16);
  return d;
}

std::vector<const WdDigestKernel*> UsableDigestKernels() {
  std::vector<const WdDigestKernel*> out = {wd_digest_kernel_baseline()};
#if defined(WEIGHTD_DIGEST_X86)
  if (CpuRuns("avx2")) out.push_back(wd_digest_kernel_avx2());
  if (CpuRuns("avx512")) out.push_back(wd_digest_kernel_avx512());
#endif
  return out;
}

const WdDigestKernel& ActiveDigestKernel() {
  static const WdDigestKernel& k = SelectKernel();
  return k;
}

std::string Digest::Hex() const { return absl::BytesToHexString(View()); }

std::optional<Digest> DigestFromBytes(absl::string_view bytes) {
  Digest d;
  if (bytes.size() != d.bytes.size()) return std::nullopt;
  std::memcpy(d.bytes.data(), bytes.data(), d.bytes.size());
  return d;
}

Digest DigestBytes(const void* data, size_t size) {
  return DigestFromHash(ActiveDigestKernel().hash(data, size));
}

Digest RandomDigest() {
  std::random_device rd;
  Digest d;
  for (size_t i = 0; i < d.bytes.size(); i += 4) {
    const uint32_t v = rd();
    std::memcpy(d.bytes.data() + i, &v, std::min<size_t>(4, d.bytes.size() - i));
  }
  return d;
}

DigestBuilder::DigestBuilder() : kernel_(&ActiveDigestKernel()), state_(kernel_->new_state()) {
  if (state_ == nullptr) std::abort();  // 576 bytes: as new would
}

DigestBuilder::~DigestBuilder() { kernel_->free_state(state_); }

void DigestBuilder::Update(const void* data, size_t size) { kernel_->update(state_, data, size); }

Digest DigestBuilder::Finish() { return DigestFromHash(kernel_->finish(state_)); }

}  // namespace weightd
