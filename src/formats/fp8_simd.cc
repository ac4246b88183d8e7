// The vector loops of the fp8 quantizer (fp8.h): the same arithmetic as Fp8E4M3FromF32, lane by
// lane, compiled for AVX2 and AVX-512 with target attributes and picked at run time.

// GCC 12 reports its own _mm512_undefined_* placeholders inside avx512fintrin.h as
// "(may be) used uninitialized" once the intrinsics are inlined; the values are never read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>

#include <algorithm>

#include "rolloutcore/base/cpu_features.h"
#include "rolloutcore/formats/fp8.h"

#define RC_AVX2 __attribute__((target("avx2")))
#define RC_AVX512 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl")))

namespace rc::formats::internal {
namespace {

int32_t AbsMaxTail(const uint16_t* x, int64_t n, int32_t m) {
  for (int64_t i = 0; i < n; ++i) {
    const int32_t a = x[i] & 0x7FFF;
    if ((a & 0x7F80) == 0x7F80) return -1;
    m = std::max(m, a);
  }
  return m;
}

}  // namespace

bool CpuHasAvx2() { return rc::CpuHasAvx2(); }

bool CpuHasAvx512() { return rc::CpuHasAvx2() && rc::CpuHasAvx512(); }

// ---- AVX-512: 16 lanes of f32, 32 of bf16 -----------------------------------------------------

RC_AVX512 int32_t AbsMaxBitsAvx512(const uint16_t* x, int64_t n) {
  const __m512i mag_mask = _mm512_set1_epi16(0x7FFF);
  const __m512i exp_mask = _mm512_set1_epi16(0x7F80);
  __m512i m = _mm512_setzero_si512();
  __mmask32 bad = 0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512i v = _mm512_and_si512(_mm512_loadu_si512(x + i), mag_mask);
    bad |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(v, exp_mask), exp_mask);
    m = _mm512_max_epu16(m, v);
  }
  if (bad != 0) return -1;
  alignas(64) uint16_t lanes[32];
  _mm512_store_si512(lanes, m);
  int32_t r = 0;
  for (uint16_t l : lanes) r = std::max<int32_t>(r, l);
  return AbsMaxTail(x + i, n - i, r);
}

RC_AVX512 int64_t QuantizeRunAvx512(const uint16_t* x, int64_t n, float factor, bool divide, uint8_t* q) {
  const __m512 f = _mm512_set1_ps(factor);
  const __m512 hi = _mm512_set1_ps(kFp8E4M3Max);
  const __m512 lo = _mm512_set1_ps(-kFp8E4M3Max);
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  const __m512i sign_mask = _mm512_set1_epi32(0x80);
  const __m512i min_normal = _mm512_set1_epi32(0x3C800000);
  const __m512 magic = _mm512_set1_ps(16384.0f);
  const __m512i magic_bits = _mm512_set1_epi32(0x46800000);
  const __m512i round_bias = _mm512_set1_epi32(0x7FFFF);
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i rebias = _mm512_set1_epi32(120 << 3);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
    const __m512 w = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    // min(v, hi) returns hi when v is NaN (MINPS gives the second operand), as fminf does.
    const __m512 v = _mm512_max_ps(lo, _mm512_min_ps(divide ? _mm512_div_ps(w, f) : _mm512_mul_ps(w, f), hi));
    const __m512i u = _mm512_castps_si512(v);
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), sign_mask);
    const __m512i a = _mm512_and_si512(u, abs_mask);
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(a, round_bias), _mm512_and_si512(_mm512_srli_epi32(a, 20), one));
    const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(r, 20), rebias);
    const __m512i sub =
        _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), magic)), magic_bits);
    const __m512i mag = _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(a, min_normal), normal, sub);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(_mm512_or_si512(mag, sign)));
  }
  return i;
}

// ---- AVX2: 8 lanes of f32, 16 of bf16 ---------------------------------------------------------

RC_AVX2 int32_t AbsMaxBitsAvx2(const uint16_t* x, int64_t n) {
  const __m256i mag_mask = _mm256_set1_epi16(0x7FFF);
  const __m256i exp_mask = _mm256_set1_epi16(0x7F80);
  __m256i m = _mm256_setzero_si256();
  __m256i bad = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i v = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), mag_mask);
    bad = _mm256_or_si256(bad, _mm256_cmpeq_epi16(_mm256_and_si256(v, exp_mask), exp_mask));
    m = _mm256_max_epu16(m, v);
  }
  if (_mm256_movemask_epi8(bad) != 0) return -1;
  alignas(32) uint16_t lanes[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), m);
  int32_t r = 0;
  for (uint16_t l : lanes) r = std::max<int32_t>(r, l);
  return AbsMaxTail(x + i, n - i, r);
}

RC_AVX2 int64_t QuantizeRunAvx2(const uint16_t* x, int64_t n, float factor, bool divide, uint8_t* q) {
  const __m256 f = _mm256_set1_ps(factor);
  const __m256 hi = _mm256_set1_ps(kFp8E4M3Max);
  const __m256 lo = _mm256_set1_ps(-kFp8E4M3Max);
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256i sign_mask = _mm256_set1_epi32(0x80);
  const __m256i min_normal = _mm256_set1_epi32(0x3C800000);
  const __m256 magic = _mm256_set1_ps(16384.0f);
  const __m256i magic_bits = _mm256_set1_epi32(0x46800000);
  const __m256i round_bias = _mm256_set1_epi32(0x7FFFF);
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i rebias = _mm256_set1_epi32(120 << 3);
  const __m256i zero = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i));
    const __m256 w = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    const __m256 v = _mm256_max_ps(lo, _mm256_min_ps(divide ? _mm256_div_ps(w, f) : _mm256_mul_ps(w, f), hi));
    const __m256i u = _mm256_castps_si256(v);
    const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), sign_mask);
    const __m256i a = _mm256_and_si256(u, abs_mask);
    const __m256i r = _mm256_add_epi32(_mm256_add_epi32(a, round_bias), _mm256_and_si256(_mm256_srli_epi32(a, 20), one));
    const __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(r, 20), rebias);
    const __m256i sub =
        _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), magic)), magic_bits);
    const __m256i is_sub = _mm256_cmpgt_epi32(min_normal, a);
    const __m256i res = _mm256_or_si256(_mm256_blendv_epi8(normal, sub, is_sub), sign);
    // 8 × int32 in [0, 255] -> 8 bytes: packs keeps each 128-bit half's 4 values, packus narrows
    // them to bytes 0..3 of each half.
    const __m256i p8 = _mm256_packus_epi16(_mm256_packs_epi32(res, zero), zero);
    const auto low = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm256_castsi256_si128(p8)));
    const auto high = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm256_extracti128_si256(p8, 1)));
    const uint64_t eight = static_cast<uint64_t>(low) | (static_cast<uint64_t>(high) << 32);
    __builtin_memcpy(q + i, &eight, 8);
  }
  return i;
}

}  // namespace rc::formats::internal
