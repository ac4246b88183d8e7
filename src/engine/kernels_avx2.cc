// AVX2+FMA kernels. This file is compiled with -mavx2 -mfma and includes nothing that could
// leak AVX2 instructions into inline functions shared with other translation units.
#include <immintrin.h>

#include <cstdint>

namespace rc::engine::internal {
namespace {

inline float LaneSum(__m256 v) {
  alignas(32) float a[8];
  _mm256_store_ps(a, v);
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

// Weight loads: f32 as is; bf16 widened in registers (zero-extend to 32 bits, shift left 16),
// which is exact, so the FMAs below see the same f32 values as the f32 path would.
inline __m256 LoadW(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 LoadW(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float WidenW(float v) { return v; }
inline float WidenW(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

template <int MR, int NR, typename W>
inline void Tile(const float* x, int64_t K, const W* w, float* y, int64_t ldy) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = _mm256_loadu_ps(x + i * K + k);
    for (int j = 0; j < NR; ++j) {
      const __m256 wv = LoadW(w + j * K + k);
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float s = LaneSum(acc[i][j]);
      for (int64_t kk = k; kk < K; ++kk) s = __builtin_fmaf(x[i * K + kk], WidenW(w[j * K + kk]), s);
      y[i * ldy + j] = s;
    }
  }
}

template <int MR, typename W>
inline void RowTile(const float* x, int64_t K, const W* w, int64_t n0, int64_t n1, float* y,
                    int64_t ldy) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) Tile<MR, 4>(x, K, w + n * K, y + n, ldy);
  switch (n1 - n) {
    case 3: Tile<MR, 3>(x, K, w + n * K, y + n, ldy); break;
    case 2: Tile<MR, 2>(x, K, w + n * K, y + n, ldy); break;
    case 1: Tile<MR, 1>(x, K, w + n * K, y + n, ldy); break;
    default: break;
  }
}

template <typename W>
void MatMulColumnsAvx2T(const float* x, int64_t M, int64_t K, const W* w, int64_t n0, int64_t n1, float* y,
                        int64_t ldy) {
  // Block the columns so a block of w stays in L2 while all rows of x stream past it.
  int64_t block = int64_t{256} * 1024 / (K * static_cast<int64_t>(sizeof(W)));
  block = block < 4 ? 4 : (block / 4) * 4;
  for (int64_t nb = n0; nb < n1; nb += block) {
    const int64_t ne = nb + block < n1 ? nb + block : n1;
    int64_t m = 0;
    for (; m + 3 <= M; m += 3) RowTile<3>(x + m * K, K, w, nb, ne, y + m * ldy, ldy);
    if (M - m == 2) RowTile<2>(x + m * K, K, w, nb, ne, y + m * ldy, ldy);
    if (M - m == 1) RowTile<1>(x + m * K, K, w, nb, ne, y + m * ldy, ldy);
  }
}

}  // namespace

void MatMulColumnsAvx2(const float* x, int64_t M, int64_t K, const float* w, int64_t n0,
                       int64_t n1, float* y, int64_t ldy) {
  MatMulColumnsAvx2T(x, M, K, w, n0, n1, y, ldy);
}

void MatMulColumnsAvx2(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0,
                       int64_t n1, float* y, int64_t ldy) {
  MatMulColumnsAvx2T(x, M, K, w, n0, n1, y, ldy);
}

float DotAvx2(const float* a, const float* b, int64_t k) {
  float y;
  Tile<1, 1>(a, k, b, &y, 1);
  return y;
}

}  // namespace rc::engine::internal
