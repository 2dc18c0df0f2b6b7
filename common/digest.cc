#include "common/digest.h"

#include <xxhash.h>

#include <cstring>

#include "absl/strings/escaping.h"

namespace weightd {
namespace {

Digest FromHash(XXH128_hash_t h) {
  XXH128_canonical_t canon;
  XXH128_canonicalFromHash(&canon, h);
  Digest d;
  static_assert(sizeof(canon.digest) == 16);
  std::memcpy(d.bytes.data(), canon.digest, 16);
  return d;
}

}  // namespace

std::string Digest::Hex() const { return absl::BytesToHexString(View()); }

std::optional<Digest> DigestFromBytes(absl::string_view bytes) {
  Digest d;
  if (bytes.size() != d.bytes.size()) return std::nullopt;
  std::memcpy(d.bytes.data(), bytes.data(), d.bytes.size());
  return d;
}

Digest DigestBytes(const void* data, size_t size) {
  return FromHash(XXH3_128bits(data, size));
}

DigestBuilder::DigestBuilder() : state_(XXH3_createState()) {
  XXH3_128bits_reset(static_cast<XXH3_state_t*>(state_));
}

DigestBuilder::~DigestBuilder() {
  XXH3_freeState(static_cast<XXH3_state_t*>(state_));
}

void DigestBuilder::Update(const void* data, size_t size) {
  XXH3_128bits_update(static_cast<XXH3_state_t*>(state_), data, size);
}

Digest DigestBuilder::Finish() {
  return FromHash(XXH3_128bits_digest(static_cast<XXH3_state_t*>(state_)));
}

}  // namespace weightd
