// AVX-512 kernels (F, BW, DQ, VL). This file is compiled with -mavx512f -mavx512bw -mavx512dq
// -mavx512vl -mfma and includes nothing that could leak those instructions into inline functions
// shared with other translation units; it runs only after a run-time CPU check.
//
// The lane order is the AVX2 path's, exactly (kernels.h): every output is 8 lanes of fused
// multiply-adds over k, the same pairwise lane sum, then the same scalar fma tail. A zmm holds
// TWO such 8-lane accumulators, one per row: rows 2p and 2p+1 of x sit in its halves (x is
// packed once per call so one 64-byte load gives both rows' 8 k), and one column's 8 weights are
// widened into both halves by one word permute (the bf16 bits into the high half of each f32,
// zeros below: exact). So each half computes what the AVX2 kernel computes for its row, in the
// same order, and the results are bit for bit the AVX2 and portable paths' (kernels_test.cc).
// What it gains: one weight widening per 8 k serves 2 rows per register, and the FMAs are 16
// wide — about 1.4-1.6x the AVX2 kernel at M = 30 on 2 cores (docs/performance.md).
// GCC 12's AVX-512 intrinsics fill unused lanes from _mm512_undefined_ps(), which its own
// -Wmaybe-uninitialized then reports at every inlined use (a known false positive).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <cstdint>

namespace rc::engine::internal {

int64_t PackedPairStride(int64_t K);  // defined below (kernels.h declares it for the callers)

namespace {

// The two 8-lane sums of a zmm, each in the AVX2 path's pairwise order (halves[0]: lanes 0-7).
inline void HalfLaneSums(__m512 v, float halves[2]) {
  alignas(64) float a[16];
  _mm512_store_ps(a, v);
  for (int64_t h = 0; h < 2; ++h) {
    const float* b = a + 8 * h;
    halves[h] = ((b[0] + b[1]) + (b[2] + b[3])) + ((b[4] + b[5]) + (b[6] + b[7]));
  }
}

// One column's 8 weights at p, widened to f32 in both 256-bit halves. (Plain loads: a masked
// load costs an extra ALU uop on the ports the FMAs need, about 40 % of the kernel's speed.)
inline __m512 LoadW2(const float* p) { return _mm512_broadcast_f32x8(_mm256_loadu_ps(p)); }
inline __m512 LoadW2(const uint16_t* p) {
  // Word 2i+1 (the high half of f32 lane i) takes bf16 element i mod 8; the even words are zeroed.
  const __m512i idx = _mm512_set_epi16(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0,  //
                                       7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i raw = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, idx, raw));
}
// (kernels_avx2.cc has the same two: each ISA file includes nothing shared, see its header.)
inline float WidenW(float v) { return v; }
inline float WidenW(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

// PR row pairs x NR columns. xp: this tile's first pair in the packed layout (pair stride
// `pair_stride` floats; block b of a pair = 16 floats: its even row's k 8b..8b+7, then its odd
// row's). x: the same rows unpacked (row-major, K per row), for the scalar tail. rows: the real
// rows of the tile (2 * PR, or one less when the last pair's odd row is padding).
template <int PR, int NR, typename W>
inline void Tile(const float* xp, int64_t pair_stride, const float* x, int64_t K, const W* w, float* y, int64_t ldy,
                 int64_t rows) {
  __m512 acc[PR][NR];
  for (int i = 0; i < PR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t blocks = K / 8;
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = LoadW2(w + j * K + b * 8);
    for (int i = 0; i < PR; ++i) {
      const __m512 xv = _mm512_loadu_ps(xp + i * pair_stride + b * 16);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  const int64_t k = blocks * 8;
  float sums[PR][NR][2];
  for (int i = 0; i < PR; ++i)
    for (int j = 0; j < NR; ++j) HalfLaneSums(acc[i][j], sums[i][j]);
  for (int i = 0; i < PR; ++i) {
    for (int h = 0; h < 2; ++h) {
      const int64_t r = 2 * i + h;
      if (r >= rows) break;
      for (int j = 0; j < NR; ++j) {
        float s = sums[i][j][h];
        for (int64_t kk = k; kk < K; ++kk) s = __builtin_fmaf(x[r * K + kk], WidenW(w[j * K + kk]), s);
        y[r * ldy + j] = s;
      }
    }
  }
}

template <int PR, typename W>
inline void PairTile(const float* xp, int64_t pair_stride, const float* x, int64_t K, const W* w, int64_t n0,
                     int64_t n1, float* y, int64_t ldy, int64_t rows) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) Tile<PR, 4>(xp, pair_stride, x, K, w + n * K, y + n, ldy, rows);
  switch (n1 - n) {
    case 3: Tile<PR, 3>(xp, pair_stride, x, K, w + n * K, y + n, ldy, rows); break;
    case 2: Tile<PR, 2>(xp, pair_stride, x, K, w + n * K, y + n, ldy, rows); break;
    case 1: Tile<PR, 1>(xp, pair_stride, x, K, w + n * K, y + n, ldy, rows); break;
    default: break;
  }
}

template <typename W>
void MatMulColumnsAvx512T(const float* xp, const float* x, int64_t M, int64_t K, const W* w, int64_t n0, int64_t n1,
                          float* y, int64_t ldy) {
  const int64_t pairs = (M + 1) / 2;
  const int64_t stride = PackedPairStride(K);
  // Block the columns so a block of w stays in L2 while all rows of x stream past it.
  int64_t block = int64_t{256} * 1024 / (K * static_cast<int64_t>(sizeof(W)));
  block = block < 4 ? 4 : (block / 4) * 4;
  for (int64_t nb = n0; nb < n1; nb += block) {
    const int64_t ne = nb + block < n1 ? nb + block : n1;
    int64_t p = 0;
    auto rows = [&](int64_t first_pair, int64_t npairs) {
      const int64_t r = M - 2 * first_pair;
      return r < 2 * npairs ? r : 2 * npairs;
    };
    for (; p + 3 <= pairs; p += 3) {
      PairTile<3>(xp + p * stride, stride, x + 2 * p * K, K, w, nb, ne, y + 2 * p * ldy, ldy, rows(p, 3));
    }
    if (pairs - p == 2) PairTile<2>(xp + p * stride, stride, x + 2 * p * K, K, w, nb, ne, y + 2 * p * ldy, ldy, rows(p, 2));
    if (pairs - p == 1) PairTile<1>(xp + p * stride, stride, x + 2 * p * K, K, w, nb, ne, y + 2 * p * ldy, ldy, rows(p, 1));
  }
}

}  // namespace

int64_t PackedPairStride(int64_t K) { return (K / 8) * 16; }

void PackRowPairs(const float* x, int64_t M, int64_t K, float* xp) {
  const int64_t blocks = K / 8, stride = PackedPairStride(K);
  for (int64_t p = 0; p < (M + 1) / 2; ++p) {
    for (int64_t h = 0; h < 2; ++h) {
      const int64_t r = 2 * p + h;
      for (int64_t b = 0; b < blocks; ++b) {
        float* dst = xp + p * stride + b * 16 + h * 8;
        const __m256 v = r < M ? _mm256_loadu_ps(x + r * K + b * 8) : _mm256_setzero_ps();
        _mm256_storeu_ps(dst, v);
      }
    }
  }
}

void MatMulColumnsAvx512(const float* xp, const float* x, int64_t M, int64_t K, const float* w, int64_t n0,
                         int64_t n1, float* y, int64_t ldy) {
  MatMulColumnsAvx512T(xp, x, M, K, w, n0, n1, y, ldy);
}

void MatMulColumnsAvx512(const float* xp, const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0,
                         int64_t n1, float* y, int64_t ldy) {
  MatMulColumnsAvx512T(xp, x, M, K, w, n0, n1, y, ldy);
}

}  // namespace rc::engine::internal
