// Hashing: xxHash3 (64-bit) for fingerprints of bytes, and a documented 64-bit mixer.
//
// Hash64 is for identifiers and cache keys (not for security). Mix64 is the SplitMix64
// finalizer (Steele, Lea, Flood 2014): a bijection on 64-bit values with full avalanche; the
// refit content digest is built from it (see rolloutcore/refit/digest.h).
//
// Thread safety: pure functions; Hasher instances are not shared between threads.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace rc {

uint64_t Hash64(const void* data, size_t len, uint64_t seed = 0);
inline uint64_t Hash64(std::string_view s, uint64_t seed = 0) { return Hash64(s.data(), s.size(), seed); }

constexpr uint64_t Mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// 16 lowercase hex digits (defined with the other encodings: rolloutcore/base/encoding.h).
std::string Hex64(uint64_t v);

// Incremental xxHash3-64 over several pieces.
class Hasher {
 public:
  explicit Hasher(uint64_t seed = 0);
  ~Hasher();
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;
  Hasher& Update(const void* data, size_t len);
  Hasher& Update(std::string_view s) { return Update(s.data(), s.size()); }
  Hasher& UpdateU64(uint64_t v) { return Update(&v, sizeof v); }
  uint64_t Digest() const;

 private:
  void* state_;
};

}  // namespace rc
