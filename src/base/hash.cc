#include "rolloutcore/base/hash.h"

#include <xxhash.h>

namespace rc {

uint64_t Hash64(const void* data, size_t len, uint64_t seed) { return XXH3_64bits_withSeed(data, len, seed); }

Hasher::Hasher(uint64_t seed) : state_(XXH3_createState()) {
  XXH3_64bits_reset_withSeed(static_cast<XXH3_state_t*>(state_), seed);
}
Hasher::~Hasher() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }
Hasher& Hasher::Update(const void* data, size_t len) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data, len);
  return *this;
}
uint64_t Hasher::Digest() const { return XXH3_64bits_digest(static_cast<XXH3_state_t*>(state_)); }

}  // namespace rc
