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

// The vector loops keep two sums, lo (of x * lo32(B)) and hi (of x * hi32(B), plus hi32(x) * lo32(B)
// when x may exceed 32 bits); the digest is lo + (hi << 32) mod 2^64, since the shift distributes
// over the sum. x exceeds 32 bits only for 8-byte elements and poisoned bf16-in-f32 values.
template <int ES, bool kBf16>
inline constexpr bool kWideX = ES == 8 || kBf16;

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

// The landing copy (CopyDigestAndScan): 64 bytes loaded at a time, stored with non-temporal stores
// where the destination is 64-byte aligned (nothing reads the staged bytes back soon, so they need
// not displace the cache, and a streaming store skips the read-for-ownership of the destination
// line), digested from the same registers (the 8-lane groups of Avx512Run, taken out of the 64-byte
// vector), and checked for NaN/Inf on the same registers (exponent all ones: bf16 for ES 2, f32 for
// ES 4). Elements outside whole 64-element blocks go through the scalar path.
template <int ES>
RC_AVX512 inline __m512i Group8(__m512i v, int k) {
  if constexpr (ES == 2) {
    switch (k) {
      case 0: return _mm512_cvtepu16_epi64(_mm512_castsi512_si128(v));
      case 1: return _mm512_cvtepu16_epi64(_mm512_extracti32x4_epi32(v, 1));
      case 2: return _mm512_cvtepu16_epi64(_mm512_extracti32x4_epi32(v, 2));
      default: return _mm512_cvtepu16_epi64(_mm512_extracti32x4_epi32(v, 3));
    }
  } else {
    return k == 0 ? _mm512_cvtepu32_epi64(_mm512_castsi512_si256(v))
                  : _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(v, 1));
  }
}

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

template <int ES>
RC_AVX512 uint64_t Avx512CopyStream(unsigned char* dst, const unsigned char* src, uint64_t index, int64_t n,
                                    bool* nonfinite) {
  static_assert(ES == 2 || ES == 4);
  constexpr int kPerVec = 64 / ES;        // elements per 64-byte vector
  constexpr int kGroups = kPerVec / 8;    // 8-lane groups per vector
  constexpr int kVecs = 64 / kPerVec;     // vectors per 64-element block
  const __m512i exp = ES == 2 ? _mm512_set1_epi16(0x7f80) : _mm512_set1_epi32(0x7f800000);
  const int64_t head = HeadElements(index, n);
  uint64_t sum = ScalarRun<ES, true, false>(dst, src, index, head);
  bool bad = ScalarNonFinite<ES>(dst, head);  // the stored head, from L1
  __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
  uint64_t any = 0;
  int64_t j = head;
  const bool aligned = ((reinterpret_cast<uintptr_t>(dst) + static_cast<uintptr_t>(j * ES)) & 63) == 0;
  for (; j + 64 <= n; j += 64) {
    const uint64_t key = DigestBlockKey((index + static_cast<uint64_t>(j)) >> 6);
    const uint64_t* mul = kPos.mul[key & 1];
    const __m512i kh = _mm512_set1_epi64(static_cast<long long>(key >> 32));
    const __m512i k0 = _mm512_set1_epi64(static_cast<long long>(key & ~uint64_t{1}));
#pragma GCC unroll 4
    for (int q = 0; q < kVecs; ++q) {
      const unsigned char* s = src + (j + static_cast<int64_t>(q) * kPerVec) * ES;
      unsigned char* d = dst + (j + static_cast<int64_t>(q) * kPerVec) * ES;
      const __m512i v = _mm512_loadu_si512(s);
      if (aligned) {
        _mm512_stream_si512(reinterpret_cast<__m512i*>(d), v);
      } else {
        _mm512_storeu_si512(d, v);
      }
      if constexpr (ES == 2) {
        any |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(v, exp), exp);
      } else {
        any |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(v, exp), exp);
      }
#pragma GCC unroll 4
      for (int k = 0; k < kGroups; ++k) {
        const int64_t g = int64_t{q} * kGroups + k;
        const __m512i bits = Group8<ES>(v, k);
        const __m512i x = _mm512_ternarylogic_epi64(bits, kh, _mm512_load_si512(kPos.a + 8 * g), 0x96);
        const __m512i b = _mm512_add_epi64(k0, _mm512_load_si512(mul + 8 * g));
        lo = _mm512_add_epi64(lo, _mm512_mul_epu32(x, b));
        hi = _mm512_add_epi64(hi, _mm512_mul_epu32(x, _mm512_srli_epi64(b, 32)));
      }
    }
  }
  if (aligned) _mm_sfence();  // the streaming stores are ordered before whatever publishes the copy
  alignas(64) uint64_t lane[8];
  _mm512_store_si512(lane, _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32)));
  for (uint64_t l : lane) sum += l;
  sum += ScalarRun<ES, true, false>(dst + j * ES, src + j * ES, index + static_cast<uint64_t>(j), n - j);
  if (bad || any != 0 || ScalarNonFinite<ES>(dst + j * ES, n - j)) *nonfinite = true;
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
    case DigestIsa::kAvx2: return __builtin_cpu_supports("avx2");
    case DigestIsa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
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
    return elem_size == 2 ? Avx512CopyStream<2>(d, s, index, n, nonfinite)
                          : Avx512CopyStream<4>(d, s, index, n, nonfinite);
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
