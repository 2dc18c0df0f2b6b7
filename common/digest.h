// Content digests: XXH3-128 of a tensor's bytes, 16 bytes, stable across
// runs and machines (computed with the widest vector code the CPU runs,
// digest_kernel.h; every variant gives the same digest). Used to address identical tensors and to let clients
// check what they received (not a cryptographic hash).
#ifndef WEIGHTD_COMMON_DIGEST_H_
#define WEIGHTD_COMMON_DIGEST_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/strings/string_view.h"

struct WdDigestKernel;  // digest_kernel.h

namespace weightd {

struct Digest {
  std::array<uint8_t, 16> bytes{};

  bool operator==(const Digest& o) const { return bytes == o.bytes; }
  bool operator!=(const Digest& o) const { return bytes != o.bytes; }
  bool operator<(const Digest& o) const { return bytes < o.bytes; }
  std::string Hex() const;
  absl::string_view View() const {
    return absl::string_view(reinterpret_cast<const char*>(bytes.data()), 16);
  }
  template <typename H>
  friend H AbslHashValue(H h, const Digest& d) {
    return H::combine(std::move(h), d.bytes);
  }
};

Digest DigestBytes(const void* data, size_t size);
// 16 bytes from the system's random source: a name no other process picks
// (a load's copy, a daemon's run). Not a digest of anything.
Digest RandomDigest();
// The digest whose 16 bytes are `bytes` (off the wire); nullopt for any
// other length.
std::optional<Digest> DigestFromBytes(absl::string_view bytes);

// Incremental form, for data that arrives in pieces.
class DigestBuilder {
 public:
  DigestBuilder();
  ~DigestBuilder();
  DigestBuilder(const DigestBuilder&) = delete;
  DigestBuilder& operator=(const DigestBuilder&) = delete;
  void Update(const void* data, size_t size);
  Digest Finish();

 private:
  const WdDigestKernel* kernel_;
  void* state_;  // its XXH3_state_t, kept opaque so xxhash.h stays out of headers
};

}  // namespace weightd

#endif  // WEIGHTD_COMMON_DIGEST_H_
