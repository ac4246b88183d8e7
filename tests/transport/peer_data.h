// Seeded contents of the regions a transport peer process publishes, so the reading process can
// recompute every expected byte without reading it from anywhere.
// Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "rolloutcore/base/hash.h"

namespace rc::transport::testing {

// Byte `offset` of region `region` published under `seed`.
inline std::byte PeerByte(uint64_t seed, uint64_t region, uint64_t offset) {
  const uint64_t word = Mix64(seed ^ (region << 48) ^ (offset / 8));
  return static_cast<std::byte>(word >> (8 * (offset % 8)));
}

// Fills out[0..length) with bytes offset..offset+length of the region.
inline void FillPeerBytes(uint64_t seed, uint64_t region, uint64_t offset, std::byte* out, uint64_t length) {
  uint64_t i = 0;
  while (i < length && (offset + i) % 8 != 0) {
    out[i] = PeerByte(seed, region, offset + i);
    ++i;
  }
  for (; i + 8 <= length; i += 8) {
    const uint64_t word = Mix64(seed ^ (region << 48) ^ ((offset + i) / 8));
    std::memcpy(out + i, &word, 8);  // little-endian: byte j of the word is byte offset+i+j
  }
  for (; i < length; ++i) out[i] = PeerByte(seed, region, offset + i);
}

}  // namespace rc::transport::testing
