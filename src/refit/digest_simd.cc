#include "refit/digest_simd.h"

// GCC 12 reports its own _mm512_undefined_* placeholders inside avx512fintrin.h as
// "(may be) used uninitialized" once the intrinsics are inlined; the values are never read.
// (clang has no -Wmaybe-uninitialized and does not warn here.)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "rolloutcore/base/cpu_features.h"
#include "rolloutcore/refit/digest.h"

namespace rc::refit::internal {
namespace {

constexpr uint64_t kPoison = uint64_t{1} << 40;

// Per-position constants of the digest (digest.h), as tables the vector loops load lane groups
// from: kPosA[j] = (uint32)(j * kDigestPositionKey), and kPosMul[p][j] such that for a block key K
// with K & 1 == p, B_j = (K + j * kDigestPositionMul) | 1 = (K & ~1) + kPosMul[p][j]. (j * M has the
// parity of j because M is odd: K + j * M is even exactly when K & 1 == j & 1, and then the | 1
// adds one.) One add per lane group instead of an add and an or.
struct PositionTables {
  alignas(64) uint64_t a[64];
  alignas(64) uint64_t mul[2][64];
};
constexpr PositionTables MakePositionTables() {
  PositionTables t{};
  for (uint32_t j = 0; j < 64; ++j) {
    t.a[j] = static_cast<uint32_t>(j * kDigestPositionKey);
    const uint64_t d = static_cast<uint64_t>(j) * kDigestPositionMul;
    t.mul[0][j] = d + 1 - (j & 1);
    t.mul[1][j] = d + 1 + (j & 1);
  }
  return t;
}
constexpr PositionTables kPos = MakePositionTables();
static_assert(((uint64_t{0x1234} & ~uint64_t{1}) + kPos.mul[0][5]) == DigestPositionMul(0x1234, 5));
static_assert(((uint64_t{0x1235} & ~uint64_t{1}) + kPos.mul[1][5]) == DigestPositionMul(0x1235, 5));
static_assert(((uint64_t{0x1235} & ~uint64_t{1}) + kPos.mul[1][6]) == DigestPositionMul(0x1235, 6));
static_assert(((uint64_t{0x1234} & ~uint64_t{1}) + kPos.mul[0][6]) == DigestPositionMul(0x1234, 6));

// ---- scalar reference ------------------------------------------------------------------------

inline uint64_t LoadBits(int es, const unsigned char* p) {
  switch (es) {
    case 1: return p[0];
    case 2: { uint16_t v; std::memcpy(&v, p, 2); return v; }
    case 4: { uint32_t v; std::memcpy(&v, p, 4); return v; }
    default: { uint64_t v; std::memcpy(&v, p, 8); return v; }
  }
}

inline uint64_t Bf16AsF32Bits(uint32_t u) { return (u & 0xffffu) == 0 ? (u >> 16) : (kPoison | u); }

// Element by element, the block key computed once per (partial) 64-element block.
template <int ES, bool kCopy, bool kBf16>
uint64_t ScalarRun(unsigned char* dst, const unsigned char* src, uint64_t index, int64_t n) {
  uint64_t sum = 0;
  int64_t j = 0;
  while (j < n) {
    const uint64_t gi = index + static_cast<uint64_t>(j);
    const uint64_t key = DigestBlockKey(gi >> 6);
    const auto pos = static_cast<uint32_t>(gi & 63);
    const int64_t m = std::min<int64_t>(n - j, 64 - pos);
    for (int64_t t = 0; t < m; ++t) {
      const unsigned char* e = src + (j + t) * ES;
      uint64_t bits = LoadBits(ES, e);
      if (kCopy) std::memcpy(dst + (j + t) * ES, e, ES);
      if (kBf16) bits = Bf16AsF32Bits(static_cast<uint32_t>(bits));
      sum += DigestTermInBlock(key, pos + static_cast<uint32_t>(t), bits);
    }
    j += m;
  }
  return sum;
}

// Elements before the first 64-aligned global index (all n when the run ends first): the vector
// loops run over whole blocks only.
inline int64_t HeadElements(uint64_t index, int64_t n) {
  return std::min<int64_t>(n, static_cast<int64_t>((64 - (index & 63)) & 63));
}

// The per-lane vector loops (Avx2Run, Avx512Run: 1- and 8-byte elements and bf16 in f32; 2- and
// 4-byte elements take the factored kernels below) keep two sums, lo (of x * lo32(B)) and hi (of
// x * hi32(B), plus hi32(x) * lo32(B) when x may exceed 32 bits); the digest is lo + (hi << 32) mod
// 2^64, since the shift distributes over the sum. x exceeds 32 bits only for 8-byte elements and
// poisoned bf16-in-f32 values.
template <int ES, bool kBf16>
inline constexpr bool kWideX = ES == 8 || kBf16;

// ---- the factored form of whole blocks (elem_size 2 and 4) -------------------------------------
//
// The term sum of one whole block with key K, x_j = b_j ^ A_j, is evaluated in a factored form
// that is the same value modulo 2^64. With p = K & 1 and c_j = j * M - (j & 1) (M =
// kDigestPositionMul), B_j = (K | 1) + c_j + 2p [j odd] (j * M has the parity of j because M is odd:
// K + j * M is even exactly when p == (j & 1), and then the | 1 adds one). So
//
//     sum_j x_j B_j = (K | 1) * S + sum_j c_j x_j + 2p * S_odd,   S = sum_j x_j, S_odd = sum over odd j
//
// and only (K | 1) * S and the parity term depend on the block's key: sum_j c_j x_j is accumulated
// per position over every block of a run (lanes of per-position sums) and weighted by the constants
// once at the end. Per element that leaves an XOR and a few adds; per block one multiply of a
// partial sum by (K | 1) per lane.
//
// 16-bit elements (bf16): x_j = (A_j & 0xffff0000) + y_j with y_j = (b_j ^ A_j) & 0xffff, and the
// kernels work on y'_j = y_j - 32768 = y_j ^ 0x8000 read as a signed 16-bit lane, so that vpmaddwd
// (signed 16 x 16 -> 32, adjacent pairs added) sums neighbours into 32-bit lanes exactly. The rest,
// X_j = (A_j & 0xffff0000) + 0x8000, depends on the key only: its block sum KeyOnlyTerms16(K) is
// linear in the 16 bits h = K >> 48 (A_j & 0xffff0000 is (h ^ hi16(j * kDigestPositionKey)) << 16),
// so it is read from tables per byte of h. With P_i = y'_{2i} + y'_{2i+1} (vpmaddwd by ones) and
// o_i = y'_{2i+1}, sum_j c_j y'_j = sum_i c_{2i} P_i + (M - 1) sum_i o_i, since c_{2i+1} - c_{2i} is
// M - 1. The 32-bit lane sums are flushed into 64-bit arithmetic every kFlushBlocks16 blocks.
//
// 32-bit elements (f32): x_j is the dword lane itself. A qword lane holds x_{2k} + 2^32 x_{2k+1};
// summing qword lanes wraps modulo 2^64 but keeps both halves recoverable once the high dwords are
// also summed on their own (x_{2k} sums = wrapped sum - (odd sums << 32)), so every accumulator is
// 64-bit and nothing needs a flush. The per-position sums are kept summed over the block's vectors
// q (positions j = W q + d), with sum_q q * (vector q) beside them: c_{Wq + d} = W q M + c_d.

constexpr uint64_t kM = kDigestPositionMul;
constexpr uint64_t FactoredPositionMul(uint32_t j) { return uint64_t{j} * kM - (j & 1); }
constexpr bool FactoredMulHolds(uint64_t key) {
  for (uint32_t j = 0; j < 64; ++j) {
    const uint64_t parity = ((key & 1) != 0 && (j & 1) != 0) ? 2 : 0;
    if ((key | 1) + FactoredPositionMul(j) + parity != DigestPositionMul(key, j)) return false;
  }
  return true;
}
static_assert(FactoredMulHolds(0) && FactoredMulHolds(1) && FactoredMulHolds(DigestBlockKey(7)) &&
              FactoredMulHolds(DigestBlockKey(8)) && FactoredMulHolds(~uint64_t{0}));

// lo16[j] = lo16(j * kDigestPositionKey) ^ 0x8000 (the 16-bit kernels' position keys, y' form);
// lo32[j] = (uint32)(j * kDigestPositionKey). key_sum[b][v] and key_rest[p][b][v] hold the parts of
// KeyOnlyTerms16 contributed by byte b of h having the value v (constants in byte 0's entries).
struct FactoredTables {
  alignas(64) uint16_t lo16[64];
  alignas(64) uint32_t lo32[64];
  uint64_t key_sum[2][256];
  uint64_t key_rest[2][2][256];
};
constexpr FactoredTables MakeFactoredTables() {
  FactoredTables t{};
  // Per bit u of hi16(j * kDigestPositionKey): how many positions have it set, and the sums of c_j
  // and of [j odd] over the positions that have it clear (0) and set (1).
  uint64_t ones[16] = {}, c_sum[2][16] = {}, odd_sum[2][16] = {};
  uint64_t c_all = 0;
  for (uint32_t j = 0; j < 64; ++j) {
    const uint32_t a = j * kDigestPositionKey;
    t.lo16[j] = static_cast<uint16_t>((a & 0xffffu) ^ 0x8000u);
    t.lo32[j] = a;
    c_all += FactoredPositionMul(j);
    for (int u = 0; u < 16; ++u) {
      const uint32_t bit = (a >> (16 + u)) & 1;
      ones[u] += bit;
      c_sum[bit][u] += FactoredPositionMul(j);
      odd_sum[bit][u] += j & 1;
    }
  }
  for (int b = 0; b < 2; ++b) {
    for (uint32_t v = 0; v < 256; ++v) {
      // Bit u of (h ^ q_j) is set for the positions whose bit u differs from h's.
      uint64_t s = 0, c = 0, odd = 0;
      for (int i = 0; i < 8; ++i) {
        const int u = 8 * b + i;
        const uint32_t hb = (v >> i) & 1;
        s += (uint64_t{1} << u) * (hb != 0 ? 64 - ones[u] : ones[u]);
        c += (uint64_t{1} << u) * c_sum[1 - hb][u];
        odd += (uint64_t{1} << u) * odd_sum[1 - hb][u];
      }
      // sum_j X_j = 2^16 sum_j (h ^ q_j) + 64 * 2^15.
      t.key_sum[b][v] = (s << 16) + (b == 0 ? uint64_t{64} << 15 : 0);
      for (int p = 0; p < 2; ++p) {
        // sum_j c_j X_j + 2p sum_{j odd} X_j, the 2^15 of every X_j in byte 0's entry.
        t.key_rest[p][b][v] = ((c + 2 * static_cast<uint64_t>(p) * odd) << 16) +
                              (b == 0 ? (c_all << 15) + 2 * static_cast<uint64_t>(p) * (uint64_t{32} << 15) : 0);
      }
    }
  }
  return t;
}
constexpr FactoredTables kFactored = MakeFactoredTables();

// sum_j X_j B_j over a whole block with key K, X_j = (A_j & 0xffff0000) + 0x8000: the part of a
// 16-bit block's terms that does not depend on the data (the kernels add sum_j y'_j B_j).
constexpr uint64_t KeyOnlyTerms16(uint64_t key) {
  const auto lo = static_cast<uint32_t>((key >> 48) & 0xff), hi = static_cast<uint32_t>(key >> 56);
  const uint64_t p = key & 1;
  return (key | 1) * (kFactored.key_sum[0][lo] + kFactored.key_sum[1][hi]) + kFactored.key_rest[p][0][lo] +
         kFactored.key_rest[p][1][hi];
}
constexpr bool KeyOnlyTermsHold(uint64_t key) {
  uint64_t sum = 0;
  for (uint32_t j = 0; j < 64; ++j) {
    sum += ((DigestPositionKey(key, j) & 0xffff0000u) + 0x8000u) * DigestPositionMul(key, j);
  }
  return sum == KeyOnlyTerms16(key);
}
static_assert(KeyOnlyTermsHold(DigestBlockKey(0)) && KeyOnlyTermsHold(DigestBlockKey(1)) &&
              KeyOnlyTermsHold(DigestBlockKey(12345)) && KeyOnlyTermsHold(0) && KeyOnlyTermsHold(~uint64_t{0}) &&
              KeyOnlyTermsHold(0x8000'0001'0000'0000ULL));

// The 16-bit kernels' 32-bit lane sums move by at most 2^17 a block (four y' of at most 2^15 in
// magnitude: the AVX2 odd-position sum), so 2^13 blocks keep every lane inside +-2^30.
constexpr int64_t kFlushBlocks16 = int64_t{1} << 13;

// The factored kernels ask for the source line kPrefetchBytes ahead of the one they load: without
// it, on two threads streaming from memory the loads wait on memory with the digest's work behind
// them instead of beside it (bench: docs/performance.md). A prefetch never faults, so the lines past
// the end of a run are harmless.
constexpr int64_t kPrefetchBytes = 2048;
inline void PrefetchAhead(const unsigned char* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
}

// The key-independent part of the 16-bit kernels from their 32-bit lane sums: pair[q][i] the sums of
// P_i of vector q (positions kLanes * 2 q + 2i and + 1), odd[i] the sums of o_i over every block,
// odd1[i] over the blocks with odd keys. Weighted by c_{2i + 2 kLanes q} = (2i + 2 kLanes q) M,
// M - 1 and 2.
template <int kVecs, int kLanes>
uint64_t Flush16(const int32_t* pair, const int32_t* odd, const int32_t* odd1) {
  int64_t weighted = 0, o = 0, o1 = 0;  // |weighted| < 2^6 * 2^6 * 2^31
  for (int q = 0; q < kVecs; ++q) {
    for (int i = 0; i < kLanes; ++i) weighted += int64_t{2 * kLanes * q + 2 * i} * pair[q * kLanes + i];
  }
  for (int i = 0; i < kLanes; ++i) {
    o += odd[i];
    o1 += odd1[i];
  }
  return static_cast<uint64_t>(weighted) * kM + static_cast<uint64_t>(o) * (kM - 1) + static_cast<uint64_t>(o1) * 2;
}

// The key-independent part of the 32-bit kernels from their 64-bit lane sums (kLanes qword lanes a
// vector, kLanes * 2 positions): x[k] = sum of (x_{2k} + 2^32 x_{2k+1}) over the vectors of every
// block, odd[k] = sum of x_{2k+1}; qx and qodd the same weighted by the vector's number q in its
// block; odd1[k] = odd[k] over the blocks with odd keys only; key[k] the lanes' (K | 1) * S.
template <int kLanes>
uint64_t Finish32(const uint64_t* x, const uint64_t* odd, const uint64_t* qx, const uint64_t* qodd,
                  const uint64_t* odd1, const uint64_t* key) {
  uint64_t sum = 0;
  for (int k = 0; k < kLanes; ++k) {
    const uint64_t even = x[k] - (odd[k] << 32), qeven = qx[k] - (qodd[k] << 32);
    sum += FactoredPositionMul(static_cast<uint32_t>(2 * k)) * even +
           FactoredPositionMul(static_cast<uint32_t>(2 * k + 1)) * odd[k] +
           2 * static_cast<uint64_t>(kLanes) * kM * (qeven + qodd[k]) + 2 * odd1[k] + key[k];
  }
  return sum;
}

// True when one of the n elements at p is NaN or +-Inf (exponent all ones: bf16 for ES 2, f32 for ES 4).
template <int ES>
inline bool ScalarNonFinite(const unsigned char* p, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    if constexpr (ES == 2) {
      uint16_t h;
      std::memcpy(&h, p + 2 * j, 2);
      if ((h & 0x7f80u) == 0x7f80u) return true;
    } else {
      uint32_t u;
      std::memcpy(&u, p + 4 * j, 4);
      if ((u & 0x7f800000u) == 0x7f800000u) return true;
    }
  }
  return false;
}

// ---- AVX2: 4 lanes, 16 lane groups per block --------------------------------------------------

#define RC_AVX2 __attribute__((target("avx2")))

// Loads 4 elements, stores them to dst when copying, returns them zero-extended to 64 bits.
template <int ES, bool kCopy>
RC_AVX2 inline __m256i Load4(unsigned char* dst, const unsigned char* src) {
  if constexpr (ES == 1) {
    uint32_t v;
    std::memcpy(&v, src, 4);
    if (kCopy) std::memcpy(dst, &v, 4);
    return _mm256_cvtepu8_epi64(_mm_cvtsi32_si128(static_cast<int>(v)));
  } else if constexpr (ES == 2) {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
    if (kCopy) _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), v);
    return _mm256_cvtepu16_epi64(v);
  } else if constexpr (ES == 4) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    if (kCopy) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), v);
    return _mm256_cvtepu32_epi64(v);
  } else {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    if (kCopy) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), v);
    return v;
  }
}

template <int ES, bool kCopy, bool kBf16>
RC_AVX2 uint64_t Avx2Run(unsigned char* dst, const unsigned char* src, uint64_t index, int64_t n) {
  const __m256i low16 = _mm256_set1_epi64x(0xffff);
  const __m256i poison = _mm256_set1_epi64x(static_cast<long long>(kPoison));
  const int64_t head = HeadElements(index, n);
  uint64_t sum = ScalarRun<ES, kCopy, kBf16>(dst, src, index, head);
  __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
  int64_t j = head;
  for (; j + 64 <= n; j += 64) {
    const uint64_t key = DigestBlockKey((index + static_cast<uint64_t>(j)) >> 6);
    const uint64_t* mul = kPos.mul[key & 1];
    const __m256i kh = _mm256_set1_epi64x(static_cast<long long>(key >> 32));
    const __m256i k0 = _mm256_set1_epi64x(static_cast<long long>(key & ~uint64_t{1}));
#pragma GCC unroll 16
    for (int64_t g = 0; g < 16; ++g) {
      __m256i bits = Load4<ES, kCopy>(dst + (j + 4 * g) * ES, src + (j + 4 * g) * ES);
      if constexpr (kBf16) {
        const __m256i zero_low = _mm256_cmpeq_epi64(_mm256_and_si256(bits, low16), _mm256_setzero_si256());
        bits = _mm256_blendv_epi8(_mm256_or_si256(bits, poison), _mm256_srli_epi64(bits, 16), zero_low);
      }
      const __m256i x = _mm256_xor_si256(_mm256_xor_si256(bits, kh),
                                         _mm256_load_si256(reinterpret_cast<const __m256i*>(kPos.a + 4 * g)));
      const __m256i b = _mm256_add_epi64(k0, _mm256_load_si256(reinterpret_cast<const __m256i*>(mul + 4 * g)));
      lo = _mm256_add_epi64(lo, _mm256_mul_epu32(x, b));
      hi = _mm256_add_epi64(hi, _mm256_mul_epu32(x, _mm256_srli_epi64(b, 32)));
      if constexpr (kWideX<ES, kBf16>) hi = _mm256_add_epi64(hi, _mm256_mul_epu32(_mm256_srli_epi64(x, 32), b));
    }
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32)));
  sum += ScalarRun<ES, kCopy, kBf16>(dst + j * ES, src + j * ES, index + static_cast<uint64_t>(j), n - j);
  return sum + lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

// The factored kernels (see "the factored form" above) over whole blocks: 16-bit elements as four
// 16-lane vectors a block, 32-bit elements as eight 8-lane vectors (4 qword lanes each).
template <bool kCopy>
RC_AVX2 uint64_t Avx2Factored16(unsigned char* dst, const unsigned char* src, uint64_t index, int64_t n) {
  const int64_t head = HeadElements(index, n);
  uint64_t sum = ScalarRun<2, kCopy, false>(dst, src, index, head);
  int64_t j = head;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i key_lo = _mm256_setzero_si256(), key_hi = _mm256_setzero_si256();
  while (j + 64 <= n) {
    const int64_t blocks = std::min<int64_t>((n - j) / 64, kFlushBlocks16);
    __m256i pair[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                       _mm256_setzero_si256()};
    __m256i odd = _mm256_setzero_si256(), odd1 = _mm256_setzero_si256();
    for (int64_t b = 0; b < blocks; ++b, j += 64) {
      const uint64_t key = DigestBlockKey((index + static_cast<uint64_t>(j)) >> 6);
      const uint64_t k1 = key | 1;
      sum += KeyOnlyTerms16(key);
      const __m256i kl = _mm256_set1_epi32(static_cast<int>(((key >> 32) & 0xffff) * 0x10001));
      __m256i p = _mm256_setzero_si256(), o = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int64_t q = 0; q < 4; ++q) {
        if (q % 2 == 0) PrefetchAhead(src + j * 2 + 32 * q);
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j * 2 + 32 * q));
        if constexpr (kCopy) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j * 2 + 32 * q), v);
        const __m256i y = _mm256_xor_si256(
            _mm256_xor_si256(v, kl), _mm256_load_si256(reinterpret_cast<const __m256i*>(kFactored.lo16 + 16 * q)));
        const __m256i pq = _mm256_madd_epi16(y, ones);
        pair[q] = _mm256_add_epi32(pair[q], pq);
        p = _mm256_add_epi32(p, pq);
        o = _mm256_add_epi32(o, _mm256_srai_epi32(y, 16));
      }
      odd = _mm256_add_epi32(odd, o);
      odd1 = _mm256_add_epi32(odd1, _mm256_and_si256(o, _mm256_set1_epi32(static_cast<int>(0 - (key & 1)))));
      const __m256i r = _mm256_add_epi32(p, _mm256_srli_epi64(p, 32));
      key_lo = _mm256_add_epi64(key_lo, _mm256_mul_epi32(r, _mm256_set1_epi64x(static_cast<long long>(k1))));
      const uint64_t hi = (k1 >> 32) + ((k1 >> 31) & 1);
      key_hi = _mm256_add_epi64(key_hi, _mm256_mul_epu32(r, _mm256_set1_epi64x(static_cast<long long>(hi))));
    }
    alignas(32) int32_t lanes[6][8];
    for (int q = 0; q < 4; ++q) _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[q]), pair[q]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[4]), odd);
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[5]), odd1);
    sum += Flush16<4, 8>(lanes[0], lanes[4], lanes[5]);
  }
  alignas(32) uint64_t lane[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lane), _mm256_add_epi64(key_lo, _mm256_slli_epi64(key_hi, 32)));
  for (uint64_t l : lane) sum += l;
  return sum + ScalarRun<2, kCopy, false>(dst + j * 2, src + j * 2, index + static_cast<uint64_t>(j), n - j);
}

template <bool kCopy>
RC_AVX2 uint64_t Avx2Factored32(unsigned char* dst, const unsigned char* src, uint64_t index, int64_t n) {
  const int64_t head = HeadElements(index, n);
  uint64_t sum = ScalarRun<4, kCopy, false>(dst, src, index, head);
  int64_t j = head;
  __m256i acc_x = _mm256_setzero_si256(), acc_odd = _mm256_setzero_si256();
  __m256i acc_qx = _mm256_setzero_si256(), acc_qodd = _mm256_setzero_si256();
  __m256i acc_odd1 = _mm256_setzero_si256(), key_lo = _mm256_setzero_si256(), key_hi = _mm256_setzero_si256();
  for (; j + 64 <= n; j += 64) {
    const uint64_t key = DigestBlockKey((index + static_cast<uint64_t>(j)) >> 6);
    const uint64_t k1 = key | 1;
    const __m256i kh = _mm256_set1_epi32(static_cast<int>(key >> 32));
    // Suffix sums from the last vector down: xs = sum_q x_q and qx = sum_q q x_q (each suffix sum
    // from q = 1 added once per q it covers), the same of the odd halves.
    __m256i xs = _mm256_setzero_si256(), os = _mm256_setzero_si256();
    __m256i qx = _mm256_setzero_si256(), qo = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int64_t q = 7; q >= 0; --q) {
      if (q % 2 == 0) PrefetchAhead(src + j * 4 + 32 * q);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j * 4 + 32 * q));
      if constexpr (kCopy) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j * 4 + 32 * q), v);
      const __m256i x = _mm256_xor_si256(
          _mm256_xor_si256(v, kh), _mm256_load_si256(reinterpret_cast<const __m256i*>(kFactored.lo32 + 8 * q)));
      xs = _mm256_add_epi64(xs, x);
      os = _mm256_add_epi64(os, _mm256_srli_epi64(x, 32));
      if (q > 0) {
        qx = _mm256_add_epi64(qx, xs);
        qo = _mm256_add_epi64(qo, os);
      }
    }
    acc_x = _mm256_add_epi64(acc_x, xs);
    acc_odd = _mm256_add_epi64(acc_odd, os);
    acc_qx = _mm256_add_epi64(acc_qx, qx);
    acc_qodd = _mm256_add_epi64(acc_qodd, qo);
    acc_odd1 = _mm256_add_epi64(acc_odd1, _mm256_and_si256(os, _mm256_set1_epi64x(static_cast<long long>(0 - (key & 1)))));
    // The lane's sum of its 16 elements (< 2^36) times K | 1: three 32 x 32 -> 64 partial products.
    const __m256i lane_sum = _mm256_add_epi64(_mm256_sub_epi64(xs, _mm256_slli_epi64(os, 32)), os);
    const __m256i k = _mm256_set1_epi64x(static_cast<long long>(k1));
    key_lo = _mm256_add_epi64(key_lo, _mm256_mul_epu32(lane_sum, k));
    key_hi = _mm256_add_epi64(key_hi, _mm256_mul_epu32(lane_sum, _mm256_srli_epi64(k, 32)));
    key_hi = _mm256_add_epi64(key_hi, _mm256_mul_epu32(_mm256_srli_epi64(lane_sum, 32), k));
  }
  alignas(32) uint64_t lanes[6][4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[0]), acc_x);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[1]), acc_odd);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[2]), acc_qx);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[3]), acc_qodd);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[4]), acc_odd1);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[5]), _mm256_add_epi64(key_lo, _mm256_slli_epi64(key_hi, 32)));
  sum += Finish32<4>(lanes[0], lanes[1], lanes[2], lanes[3], lanes[4], lanes[5]);
  return sum + ScalarRun<4, kCopy, false>(dst + j * 4, src + j * 4, index + static_cast<uint64_t>(j), n - j);
}

// ---- AVX-512 (F + BW + VL): 8 lanes, 8 lane groups per block ---------------------------------

#define RC_AVX512 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl")))

template <int ES, bool kCopy>
RC_AVX512 inline __m512i Load8(unsigned char* dst, const unsigned char* src) {
  if constexpr (ES == 1) {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
    if (kCopy) _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), v);
    return _mm512_cvtepu8_epi64(v);
  } else if constexpr (ES == 2) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    if (kCopy) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), v);
    return _mm512_cvtepu16_epi64(v);
  } else if constexpr (ES == 4) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    if (kCopy) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), v);
    return _mm512_cvtepu32_epi64(v);
  } else {
    const __m512i v = _mm512_loadu_si512(src);
    if (kCopy) _mm512_storeu_si512(dst, v);
    return v;
  }
}

template <int ES, bool kCopy, bool kBf16>
RC_AVX512 uint64_t Avx512Run(unsigned char* dst, const unsigned char* src, uint64_t index, int64_t n) {
  const __m512i low16 = _mm512_set1_epi64(0xffff);
  const __m512i poison = _mm512_set1_epi64(static_cast<long long>(kPoison));
  const int64_t head = HeadElements(index, n);
  uint64_t sum = ScalarRun<ES, kCopy, kBf16>(dst, src, index, head);
  __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
  int64_t j = head;
  for (; j + 64 <= n; j += 64) {
    const uint64_t key = DigestBlockKey((index + static_cast<uint64_t>(j)) >> 6);
    const uint64_t* mul = kPos.mul[key & 1];
    const __m512i kh = _mm512_set1_epi64(static_cast<long long>(key >> 32));
    const __m512i k0 = _mm512_set1_epi64(static_cast<long long>(key & ~uint64_t{1}));
#pragma GCC unroll 8
    for (int64_t g = 0; g < 8; ++g) {
      __m512i bits = Load8<ES, kCopy>(dst + (j + 8 * g) * ES, src + (j + 8 * g) * ES);
      if constexpr (kBf16) {
        const __mmask8 zero_low = _mm512_cmpeq_epi64_mask(_mm512_and_si512(bits, low16), _mm512_setzero_si512());
        bits = _mm512_mask_blend_epi64(zero_low, _mm512_or_si512(bits, poison), _mm512_srli_epi64(bits, 16));
      }
      // bits ^ kh ^ a in one instruction (truth table 0x96: three-way XOR).
      const __m512i x = _mm512_ternarylogic_epi64(bits, kh, _mm512_load_si512(kPos.a + 8 * g), 0x96);
      const __m512i b = _mm512_add_epi64(k0, _mm512_load_si512(mul + 8 * g));
      lo = _mm512_add_epi64(lo, _mm512_mul_epu32(x, b));
      hi = _mm512_add_epi64(hi, _mm512_mul_epu32(x, _mm512_srli_epi64(b, 32)));
      if constexpr (kWideX<ES, kBf16>) hi = _mm512_add_epi64(hi, _mm512_mul_epu32(_mm512_srli_epi64(x, 32), b));
    }
  }
  // Summed as unsigned (wrapping) lanes: GCC's _mm512_reduce_add_epi64 adds them as signed
  // long long, which UBSan reports as overflow.
  alignas(64) uint64_t lane[8];
  _mm512_store_si512(lane, _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32)));
  for (uint64_t l : lane) sum += l;
  return sum + ScalarRun<ES, kCopy, kBf16>(dst + j * ES, src + j * ES, index + static_cast<uint64_t>(j), n - j);
}

// The factored kernels (see "the factored form" above) over whole blocks, the elements before the
// first block boundary and after the last in ScalarRun. kScan (with kCopy): the landing copy,
// CopyDigestAndScan: 64 bytes loaded at a time, stored with non-temporal stores where the
// destination is 64-byte aligned (nothing reads the staged bytes back soon, so they need not
// displace the cache, and a streaming store skips the read-for-ownership of the destination line),
// digested from the same registers and checked for NaN/Inf on them (exponent all ones: bf16 for
// ES 2, f32 for ES 4; tracked as the largest magnitude seen).

// The keys of 8 consecutive blocks and what the factored kernels broadcast from them, computed
// 8 at a time in qword lanes (the kernels read them from memory: broadcasts from memory cost no
// vector ALU slot).
struct KeyBatch {
  alignas(64) uint64_t key[8];
  alignas(64) uint64_t k1[8];  // K | 1
  alignas(64) uint64_t hi[8];  // hi32(K | 1) + bit 31 of K | 1: see the 16-bit kernel's key multiply
  alignas(32) uint32_t kl[8];  // lo16(K >> 32) in both 16-bit halves (16-bit kernels)
  alignas(32) uint32_t kh[8];  // hi32(K) (32-bit kernels)
  alignas(16) uint16_t odd[8];  // all ones when K is odd
};

// DigestBlockKey(b) = Mix64(b + kDigestBlockSeed), Mix64 being SplitMix64's finalizer
// (rolloutcore/base/hash.h), which first adds its own increment; the steps written out for the
// vector version, checked against the definition here.
constexpr uint64_t kMixIncrement = 0x9E3779B97F4A7C15ULL, kMixMul1 = 0xBF58476D1CE4E5B9ULL,
                   kMixMul2 = 0x94D049BB133111EBULL;
constexpr uint64_t BlockKeySteps(uint64_t block) {
  uint64_t z = block + kDigestBlockSeed + kMixIncrement;  // the sum wraps modulo 2^64
  z = (z ^ (z >> 30)) * kMixMul1;
  z = (z ^ (z >> 27)) * kMixMul2;
  return z ^ (z >> 31);
}
constexpr uint64_t kBlockKeyOffset = kDigestBlockSeed + kMixIncrement;  // modulo 2^64
static_assert(BlockKeySteps(0) == DigestBlockKey(0) && BlockKeySteps(12345) == DigestBlockKey(12345) &&
              BlockKeySteps(~uint64_t{0} >> 6) == DigestBlockKey(~uint64_t{0} >> 6));

// Blocks first .. first + 7; block numbers wrap modulo 2^58 as the global index wraps modulo 2^64.
RC_AVX512 inline void Avx512Keys(uint64_t first, KeyBatch& kb) {
  const __m512i blocks = _mm512_and_si512(_mm512_add_epi64(_mm512_set1_epi64(static_cast<long long>(first)),
                                                           _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0)),
                                          _mm512_set1_epi64(static_cast<long long>(~uint64_t{0} >> 6)));
  __m512i z = _mm512_add_epi64(blocks, _mm512_set1_epi64(static_cast<long long>(kBlockKeyOffset)));
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)),
                         _mm512_set1_epi64(static_cast<long long>(kMixMul1)));
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)),
                         _mm512_set1_epi64(static_cast<long long>(kMixMul2)));
  const __m512i key = _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
  const __m512i k1 = _mm512_or_si512(key, _mm512_set1_epi64(1));
  _mm512_store_si512(kb.key, key);
  _mm512_store_si512(kb.k1, k1);
  _mm512_store_si512(kb.hi, _mm512_add_epi64(_mm512_srli_epi64(k1, 32),
                                             _mm512_and_si512(_mm512_srli_epi64(k1, 31), _mm512_set1_epi64(1))));
  const __m512i hi32 = _mm512_srli_epi64(key, 32);
  const __m512i lo16 = _mm512_and_si512(hi32, _mm512_set1_epi64(0xffff));
  _mm256_store_si256(reinterpret_cast<__m256i*>(kb.kl),
                     _mm512_cvtepi64_epi32(_mm512_or_si512(lo16, _mm512_slli_epi64(lo16, 16))));
  _mm256_store_si256(reinterpret_cast<__m256i*>(kb.kh), _mm512_cvtepi64_epi32(hi32));
  _mm_store_si128(reinterpret_cast<__m128i*>(kb.odd),
                  _mm512_cvtepi64_epi16(_mm512_sub_epi64(_mm512_setzero_si512(),
                                                         _mm512_and_si512(key, _mm512_set1_epi64(1)))));
  // A compiler barrier: left to itself GCC forwards these stores and picks the lanes back out of
  // the registers (an extract and a broadcast per value: shuffle-port work the memory broadcasts
  // avoid).
  asm volatile("" : : "r"(&kb) : "memory");
}

// 16-bit elements: two 32-lane vectors a block.
template <bool kCopy, bool kScan>
RC_AVX512 uint64_t Avx512Factored16(unsigned char* dst, const unsigned char* src, uint64_t index, int64_t n,
                                    bool* nonfinite) {
  const int64_t head = HeadElements(index, n);
  uint64_t sum = ScalarRun<2, kCopy, false>(dst, src, index, head);
  bool bad = kScan && ScalarNonFinite<2>(dst, head);  // the stored head, from L1
  int64_t j = head;
  const bool stream = kScan && ((reinterpret_cast<uintptr_t>(dst) + static_cast<uintptr_t>(j * 2)) & 63) == 0;
  const __m512i ones = _mm512_set1_epi16(1);
  const __m512i t0 = _mm512_load_si512(kFactored.lo16), t1 = _mm512_load_si512(kFactored.lo16 + 32);
  const __m512i magnitude = _mm512_set1_epi16(0x7fff);
  __m512i largest = _mm512_setzero_si512();
  __m512i key_lo = _mm512_setzero_si512(), key_hi = _mm512_setzero_si512();
  // Whole blocks in batches of 8, the keys of the next batch computed before this one is digested
  // (so that their latency overlaps its work); the 32-bit lane sums flushed every kFlushBlocks16.
  const int64_t blocks = (n - j) / 64;
  const uint64_t first_block = (index + static_cast<uint64_t>(j)) >> 6;
  KeyBatch kb[2];
  if (blocks > 0) Avx512Keys(first_block, kb[0]);
  __m512i pair0 = _mm512_setzero_si512(), pair1 = _mm512_setzero_si512();
  __m512i odd = _mm512_setzero_si512(), odd1 = _mm512_setzero_si512();
  for (int64_t done = 0; done < blocks;) {
    const KeyBatch& cur = kb[(done >> 3) & 1];
    if (done + 8 < blocks) Avx512Keys(first_block + static_cast<uint64_t>(done + 8), kb[((done >> 3) + 1) & 1]);
    const int count = static_cast<int>(std::min<int64_t>(8, blocks - done));
    for (int t = 0; t < count; ++t) sum += KeyOnlyTerms16(cur.key[t]);
    for (int t = 0; t < count; ++t, j += 64) {
      const unsigned char* s = src + j * 2;
      PrefetchAhead(s);
      PrefetchAhead(s + 64);
      const __m512i v0 = _mm512_loadu_si512(s), v1 = _mm512_loadu_si512(s + 64);
      if constexpr (kCopy) {
        unsigned char* d = dst + j * 2;
        if (stream) {
          _mm512_stream_si512(reinterpret_cast<__m512i*>(d), v0);
          _mm512_stream_si512(reinterpret_cast<__m512i*>(d + 64), v1);
        } else {
          _mm512_storeu_si512(d, v0);
          _mm512_storeu_si512(d + 64, v1);
        }
      }
      if constexpr (kScan) {
        largest = _mm512_max_epu16(largest, _mm512_and_si512(v0, magnitude));
        largest = _mm512_max_epu16(largest, _mm512_and_si512(v1, magnitude));
      }
      // y' = b ^ lo16(K >> 32) ^ lo16(j * kDigestPositionKey) ^ 0x8000 (truth table 0x96: three-way XOR).
      const __m512i kl = _mm512_set1_epi32(static_cast<int>(cur.kl[t]));
      const __m512i y0 = _mm512_ternarylogic_epi32(v0, kl, t0, 0x96);
      const __m512i y1 = _mm512_ternarylogic_epi32(v1, kl, t1, 0x96);
      const __m512i p0 = _mm512_madd_epi16(y0, ones), p1 = _mm512_madd_epi16(y1, ones);
      pair0 = _mm512_add_epi32(pair0, p0);
      pair1 = _mm512_add_epi32(pair1, p1);
      const __m512i o = _mm512_add_epi32(_mm512_srai_epi32(y0, 16), _mm512_srai_epi32(y1, 16));
      odd = _mm512_add_epi32(odd, o);
      odd1 = _mm512_mask_add_epi32(odd1, static_cast<__mmask16>(cur.odd[t]), odd1, o);
      // (K | 1) * S: the qword lane's two 32-bit sums added in its low dword (|r| < 2^19), times
      // K | 1 split as its low dword read signed (vpmuldq) plus hi << 32, hi = hi32 + the low
      // dword's sign bit (only hi * r mod 2^32 matters, so vpmuludq).
      const __m512i p = _mm512_add_epi32(p0, p1);
      const __m512i r = _mm512_add_epi32(p, _mm512_srli_epi64(p, 32));
      key_lo = _mm512_add_epi64(key_lo, _mm512_mul_epi32(r, _mm512_set1_epi64(static_cast<long long>(cur.k1[t]))));
      key_hi = _mm512_add_epi64(key_hi, _mm512_mul_epu32(r, _mm512_set1_epi64(static_cast<long long>(cur.hi[t]))));
    }
    done += count;
    if (done % kFlushBlocks16 == 0 || done == blocks) {
      alignas(64) int32_t lanes[4][16];
      _mm512_store_si512(lanes[0], pair0);
      _mm512_store_si512(lanes[1], pair1);
      _mm512_store_si512(lanes[2], odd);
      _mm512_store_si512(lanes[3], odd1);
      sum += Flush16<2, 16>(lanes[0], lanes[2], lanes[3]);
      pair0 = pair1 = odd = odd1 = _mm512_setzero_si512();
    }
  }
  if (kScan && stream) _mm_sfence();  // the streaming stores are ordered before whatever publishes the copy
  // Summed as unsigned (wrapping) lanes: GCC's _mm512_reduce_add_epi64 adds them as signed
  // long long, which UBSan reports as overflow.
  alignas(64) uint64_t lane[8];
  _mm512_store_si512(lane, _mm512_add_epi64(key_lo, _mm512_slli_epi64(key_hi, 32)));
  for (uint64_t l : lane) sum += l;
  sum += ScalarRun<2, kCopy, false>(dst + j * 2, src + j * 2, index + static_cast<uint64_t>(j), n - j);
  if constexpr (kScan) {
    bad = bad || _mm512_cmpge_epu16_mask(largest, _mm512_set1_epi16(0x7f80)) != 0 ||
          ScalarNonFinite<2>(dst + j * 2, n - j);
    if (bad) *nonfinite = true;
  }
  return sum;
}

// 32-bit elements: four 16-lane vectors a block (positions j = 16 q + d), summed as 8 qword lanes.
template <bool kCopy, bool kScan>
RC_AVX512 uint64_t Avx512Factored32(unsigned char* dst, const unsigned char* src, uint64_t index, int64_t n,
                                    bool* nonfinite) {
  const int64_t head = HeadElements(index, n);
  uint64_t sum = ScalarRun<4, kCopy, false>(dst, src, index, head);
  bool bad = kScan && ScalarNonFinite<4>(dst, head);
  int64_t j = head;
  const bool stream = kScan && ((reinterpret_cast<uintptr_t>(dst) + static_cast<uintptr_t>(j * 4)) & 63) == 0;
  __m512i pos[4];
  for (int64_t q = 0; q < 4; ++q) pos[q] = _mm512_load_si512(kFactored.lo32 + 16 * q);
  const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
  __m512i largest = _mm512_setzero_si512();
  __m512i acc_x = _mm512_setzero_si512(), acc_odd = _mm512_setzero_si512();
  __m512i acc_qx = _mm512_setzero_si512(), acc_qodd = _mm512_setzero_si512();
  __m512i acc_odd1 = _mm512_setzero_si512(), acc_key = _mm512_setzero_si512();
  for (; j + 64 <= n; j += 64) {
    const uint64_t key = DigestBlockKey((index + static_cast<uint64_t>(j)) >> 6);
    const __m512i kh = _mm512_set1_epi32(static_cast<int>(key >> 32));
    __m512i x[4], o[4];
#pragma GCC unroll 4
    for (int64_t q = 0; q < 4; ++q) {
      PrefetchAhead(src + j * 4 + 64 * q);
      const __m512i v = _mm512_loadu_si512(src + j * 4 + 64 * q);
      if constexpr (kCopy) {
        unsigned char* d = dst + j * 4 + 64 * q;
        if (stream) {
          _mm512_stream_si512(reinterpret_cast<__m512i*>(d), v);
        } else {
          _mm512_storeu_si512(d, v);
        }
      }
      if constexpr (kScan) largest = _mm512_max_epu32(largest, _mm512_and_si512(v, magnitude));
      x[q] = _mm512_ternarylogic_epi32(v, kh, pos[q], 0x96);  // b ^ hi32(K) ^ lo32(j * kDigestPositionKey)
      o[q] = _mm512_srli_epi64(x[q], 32);
    }
    // Suffix sums: X = sum_q x_q, QX = sum_q q x_q (and the same of the odd halves).
    const __m512i x23 = _mm512_add_epi64(x[2], x[3]), x123 = _mm512_add_epi64(x[1], x23);
    const __m512i xs = _mm512_add_epi64(x[0], x123);
    const __m512i o23 = _mm512_add_epi64(o[2], o[3]), o123 = _mm512_add_epi64(o[1], o23);
    const __m512i os = _mm512_add_epi64(o[0], o123);
    acc_x = _mm512_add_epi64(acc_x, xs);
    acc_odd = _mm512_add_epi64(acc_odd, os);
    acc_qx = _mm512_add_epi64(acc_qx, _mm512_add_epi64(_mm512_add_epi64(x123, x23), x[3]));
    acc_qodd = _mm512_add_epi64(acc_qodd, _mm512_add_epi64(_mm512_add_epi64(o123, o23), o[3]));
    acc_odd1 = _mm512_mask_add_epi64(acc_odd1, static_cast<__mmask8>(0 - (key & 1)), acc_odd1, os);
    // The lane's sum of its 8 elements (< 2^35): the wrapped packed sum less the odd halves' carry-in.
    const __m512i lane_sum = _mm512_add_epi64(_mm512_sub_epi64(xs, _mm512_slli_epi64(os, 32)), os);
    acc_key = _mm512_add_epi64(acc_key,
                               _mm512_mullo_epi64(lane_sum, _mm512_set1_epi64(static_cast<long long>(key | 1))));
  }
  if (kScan && stream) _mm_sfence();
  alignas(64) uint64_t lanes[6][8];
  _mm512_store_si512(lanes[0], acc_x);
  _mm512_store_si512(lanes[1], acc_odd);
  _mm512_store_si512(lanes[2], acc_qx);
  _mm512_store_si512(lanes[3], acc_qodd);
  _mm512_store_si512(lanes[4], acc_odd1);
  _mm512_store_si512(lanes[5], acc_key);
  sum += Finish32<8>(lanes[0], lanes[1], lanes[2], lanes[3], lanes[4], lanes[5]);
  sum += ScalarRun<4, kCopy, false>(dst + j * 4, src + j * 4, index + static_cast<uint64_t>(j), n - j);
  if constexpr (kScan) {
    bad = bad || _mm512_cmpge_epu32_mask(largest, _mm512_set1_epi32(0x7f800000)) != 0 ||
          ScalarNonFinite<4>(dst + j * 4, n - j);
    if (bad) *nonfinite = true;
  }
  return sum;
}

// ---- finite check ----------------------------------------------------------------------------

bool AnyNonFiniteScalar(const unsigned char* p, int64_t n) {
  uint32_t any = 0;
  for (int64_t j = 0; j < n; ++j) {
    uint32_t u;
    std::memcpy(&u, p + 4 * j, 4);
    any |= static_cast<uint32_t>((u & 0x7f800000u) == 0x7f800000u);
  }
  return any != 0;
}

RC_AVX2 bool AnyNonFiniteAvx2(const unsigned char* p, int64_t n) {
  const __m256i exp = _mm256_set1_epi32(0x7f800000);
  __m256i any = _mm256_setzero_si256();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 4 * j));
    any = _mm256_or_si256(any, _mm256_cmpeq_epi32(_mm256_and_si256(v, exp), exp));
  }
  return !_mm256_testz_si256(any, any) || AnyNonFiniteScalar(p + 4 * j, n - j);
}

bool AnyNonFiniteBf16Scalar(const unsigned char* p, int64_t n) {
  uint32_t any = 0;
  for (int64_t j = 0; j < n; ++j) {
    uint16_t h;
    std::memcpy(&h, p + 2 * j, 2);
    any |= static_cast<uint32_t>((h & 0x7f80u) == 0x7f80u);
  }
  return any != 0;
}

RC_AVX2 bool AnyNonFiniteBf16Avx2(const unsigned char* p, int64_t n) {
  const __m256i exp = _mm256_set1_epi16(0x7f80);
  __m256i any = _mm256_setzero_si256();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * j));
    any = _mm256_or_si256(any, _mm256_cmpeq_epi16(_mm256_and_si256(v, exp), exp));
  }
  return !_mm256_testz_si256(any, any) || AnyNonFiniteBf16Scalar(p + 2 * j, n - j);
}

RC_AVX512 bool AnyNonFiniteBf16Avx512(const unsigned char* p, int64_t n) {
  const __m512i exp = _mm512_set1_epi16(0x7f80);
  __mmask32 any = 0;
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m512i v = _mm512_loadu_si512(p + 2 * j);
    any |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(v, exp), exp);
  }
  return any != 0 || AnyNonFiniteBf16Scalar(p + 2 * j, n - j);
}

// ---- dispatch --------------------------------------------------------------------------------

template <bool kCopy, bool kBf16>
uint64_t Run(DigestIsa isa, int es, void* dst, const void* src, uint64_t index, int64_t n) {
  const auto* s = static_cast<const unsigned char*>(src);
  // Without a copy nothing is written; dst is only offset in step with src (never null).
  auto* d = kCopy ? static_cast<unsigned char*>(dst) : const_cast<unsigned char*>(s);
  if (n <= 0) return 0;
  if (!DigestIsaSupported(isa)) isa = DigestIsa::kScalar;
// FN names a function template: it cannot be parenthesized, hence the NOLINT.
// NOLINTBEGIN(bugprone-macro-parentheses)
#define RC_DIGEST_CASES(FN)                                        \
  switch (es) {                                                    \
    case 1: return FN<1, kCopy, kBf16>(d, s, index, n);            \
    case 2: return FN<2, kCopy, kBf16>(d, s, index, n);            \
    case 4: return FN<4, kCopy, kBf16>(d, s, index, n);            \
    default: return FN<8, kCopy, kBf16>(d, s, index, n);           \
  }
// NOLINTEND(bugprone-macro-parentheses)
  // 2- and 4-byte elements (bits as they are): the factored kernels.
  if (!kBf16 && (es == 2 || es == 4)) {
    switch (isa) {
      case DigestIsa::kAvx512:
        return es == 2 ? Avx512Factored16<kCopy, false>(d, s, index, n, nullptr)
                       : Avx512Factored32<kCopy, false>(d, s, index, n, nullptr);
      case DigestIsa::kAvx2:
        return es == 2 ? Avx2Factored16<kCopy>(d, s, index, n) : Avx2Factored32<kCopy>(d, s, index, n);
      case DigestIsa::kScalar: break;
    }
  }
  switch (isa) {
    case DigestIsa::kAvx512: RC_DIGEST_CASES(Avx512Run)
    case DigestIsa::kAvx2: RC_DIGEST_CASES(Avx2Run)
    case DigestIsa::kScalar: break;
  }
  RC_DIGEST_CASES(ScalarRun)
#undef RC_DIGEST_CASES
}

DigestIsa DetectBest() {
  DigestIsa best = DigestIsa::kScalar;
  if (DigestIsaSupported(DigestIsa::kAvx2)) best = DigestIsa::kAvx2;
  if (DigestIsaSupported(DigestIsa::kAvx512)) best = DigestIsa::kAvx512;
  if (const char* env = std::getenv("ROLLOUTCORE_DIGEST_ISA")) {
    const std::string v = env;
    if (v == "scalar") best = DigestIsa::kScalar;
    if (v == "avx2" && best == DigestIsa::kAvx512) best = DigestIsa::kAvx2;
  }
  return best;
}

}  // namespace

std::string_view DigestIsaName(DigestIsa isa) {
  switch (isa) {
    case DigestIsa::kScalar: return "scalar";
    case DigestIsa::kAvx2: return "avx2";
    case DigestIsa::kAvx512: return "avx512";
  }
  return "scalar";
}

bool DigestIsaSupported(DigestIsa isa) {
  switch (isa) {
    case DigestIsa::kScalar: return true;
    case DigestIsa::kAvx2: return CpuHasAvx2();
    case DigestIsa::kAvx512: return CpuHasAvx512();
  }
  return false;
}

DigestIsa BestDigestIsa() {
  static const DigestIsa kBest = DetectBest();
  return kBest;
}

uint64_t DigestContiguous(DigestIsa isa, int elem_size, const void* p, uint64_t index, int64_t n) {
  return Run<false, false>(isa, elem_size, nullptr, p, index, n);
}
uint64_t DigestBf16AsF32(DigestIsa isa, const void* p, uint64_t index, int64_t n) {
  return Run<false, true>(isa, 4, nullptr, p, index, n);
}
uint64_t CopyAndDigestContiguous(DigestIsa isa, int elem_size, void* dst, const void* src, uint64_t index,
                                 int64_t n) {
  return Run<true, false>(isa, elem_size, dst, src, index, n);
}
namespace {
RC_AVX2 void WidenBf16Avx2(unsigned char* d, const unsigned char* s, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 2 * j));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 4 * j), _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  for (; j < n; ++j) {
    uint16_t h;
    std::memcpy(&h, s + 2 * j, 2);
    const uint32_t u = uint32_t{h} << 16;
    std::memcpy(d + 4 * j, &u, 4);
  }
}
}  // namespace

void WidenBf16ToF32(DigestIsa isa, void* dst, const void* src, int64_t n) {
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  if (n <= 0) return;
  if (isa != DigestIsa::kScalar && DigestIsaSupported(DigestIsa::kAvx2)) return WidenBf16Avx2(d, s, n);
  for (int64_t j = 0; j < n; ++j) {
    uint16_t h;
    std::memcpy(&h, s + 2 * j, 2);
    const uint32_t u = uint32_t{h} << 16;
    std::memcpy(d + 4 * j, &u, 4);
  }
}

bool AnyNonFiniteF32(DigestIsa isa, const void* p, int64_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  if (n <= 0) return false;
  if (isa != DigestIsa::kScalar && DigestIsaSupported(DigestIsa::kAvx2)) return AnyNonFiniteAvx2(b, n);
  return AnyNonFiniteScalar(b, n);
}

bool AnyNonFiniteBf16(DigestIsa isa, const void* p, int64_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  if (n <= 0) return false;
  if (!DigestIsaSupported(isa)) isa = DigestIsa::kScalar;
  switch (isa) {
    case DigestIsa::kAvx512: return AnyNonFiniteBf16Avx512(b, n);
    case DigestIsa::kAvx2: return AnyNonFiniteBf16Avx2(b, n);
    case DigestIsa::kScalar: break;
  }
  return AnyNonFiniteBf16Scalar(b, n);
}

uint64_t CopyAndDigestBf16AsF32(DigestIsa isa, void* dst, const void* src, uint64_t index, int64_t n) {
  return Run<true, true>(isa, 4, dst, src, index, n);
}

uint64_t CopyDigestAndScan(DigestIsa isa, int elem_size, void* dst, const void* src, uint64_t index, int64_t n,
                           bool* nonfinite) {
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  if (n <= 0) return 0;
  if ((elem_size == 2 || elem_size == 4) && isa == DigestIsa::kAvx512 && DigestIsaSupported(isa)) {
    return elem_size == 2 ? Avx512Factored16<true, true>(d, s, index, n, nonfinite)
                          : Avx512Factored32<true, true>(d, s, index, n, nonfinite);
  }
  // Other ISAs: copy and digest in L1-sized pieces, each scanned from L1 right after it was stored.
  constexpr int64_t kPieceBytes = 16 << 10;
  const int64_t per = std::max<int64_t>(1, kPieceBytes / elem_size);
  uint64_t sum = 0;
  bool bad = false;
  for (int64_t j = 0; j < n; j += per) {
    const int64_t m = std::min(per, n - j);
    unsigned char* dp = d + j * elem_size;
    sum += Run<true, false>(isa, elem_size, dp, s + j * elem_size, index + static_cast<uint64_t>(j), m);
    if (elem_size == 2) bad = bad || AnyNonFiniteBf16(isa, dp, m);
    if (elem_size == 4) bad = bad || AnyNonFiniteF32(isa, dp, m);
  }
  if (bad) *nonfinite = true;
  return sum;
}

}  // namespace rc::refit::internal
