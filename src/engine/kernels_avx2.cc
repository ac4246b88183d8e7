// AVX2+FMA kernels. This file is compiled with -mavx2 -mfma and includes nothing that could
// leak AVX2 instructions into inline functions shared with other translation units.
//
// MatMulNT's order (kernels.h) in 256-bit registers: one output's 16 lane accumulators are two
// ymm (lanes 0-7 and 8-15, computed in two passes); per whole chunk of 32 k, lane i takes the fma
// of k = 32c + 2i, then of 32c + 2i + 1. x comes packed in that order (PackEvenOdd). bf16 weights: each 32-byte half of
// the chunk is 8 words, element 2i in the low half of word i (shift left 16: an exact f32) and
// 2i + 1 in the high half (AND 0xFFFF0000); f32 weights are split into even and odd elements by
// two shuffles and two lane permutes per 16. Then the same pairwise sum of the 16 lanes and the
// same scalar fma tail as the portable path: its bits exactly (kernels_test.cc).
// fp8 weights: each 16-byte half of the chunk, zero-extended from 8 words to 8 32-bit lanes
// (vpmovzxwd), holds byte 2i in bits 0-7 of lane i and 2i + 1 in bits 8-15; shifting a byte to the
// top of the lane, arithmetically back down by 4 and an AND with 0x87F00000 leave its sign in bit
// 31 and its 7 low bits in bits 20-26, the f32 bits of E4M3 / 2^120 (subnormal codes are f32
// denormals: DAZ must be off, the default). Times 2^120 (exact), then times the chunk's scale
// (one per whole chunk, kernels.h): fl32(E4M3 * scale), the dequantized f32 weight. 2^120 stays out
// of the scale: scale * 2^120 overflows f32 from scale = 256 on, and then the product would too.
#include <immintrin.h>

#include <cstdint>

namespace rc::engine::internal {

int64_t PackedRowStride(int64_t K);  // kernels.cc

namespace {

// 16 consecutive weights (lanes 8h..8h+7 of a chunk) as their even and odd elements, in f32.
inline void LoadHalf(const uint16_t* p, __m256* even, __m256* odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  *odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void LoadHalf(const float* p, __m256* even, __m256* odd) {
  const __m256 a = _mm256_loadu_ps(p), b = _mm256_loadu_ps(p + 8);
  // [a0 a2 b0 b2 | a4 a6 b4 b6] -> 64-bit lanes 0, 2, 1, 3 -> [a0 a2 a4 a6 b0 b2 b4 b6]; odd alike.
  const __m256 e = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
  const __m256 o = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
  *even = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), _MM_SHUFFLE(3, 1, 2, 0)));
  *odd = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), _MM_SHUFFLE(3, 1, 2, 0)));
}
// 16 consecutive fp8 weights, even and odd, dequantized with the chunk's scale.
inline void LoadHalf(const uint8_t* p, __m256 scale, __m256* even, __m256* odd) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i mask = _mm256_set1_epi32(static_cast<int>(0x87F00000u));
  const __m256 pow120 = _mm256_set1_ps(0x1p120f);
  const __m256i e = _mm256_and_si256(_mm256_srai_epi32(_mm256_slli_epi32(v, 24), 4), mask);
  const __m256i o = _mm256_and_si256(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 4), mask);
  *even = _mm256_mul_ps(_mm256_mul_ps(_mm256_castsi256_ps(e), pow120), scale);
  *odd = _mm256_mul_ps(_mm256_mul_ps(_mm256_castsi256_ps(o), pow120), scale);
}
// (kernels_avx512.cc has the same: each ISA file includes nothing shared, see its header.)
inline float WidenW(float v) { return v; }
inline float WidenW(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
inline float WidenW(uint8_t b) {  // E4M3 exactly (times the scale apart), as LoadHalf does it
  const uint32_t u = ((static_cast<uint32_t>(b) & 0x7Fu) << 20) | ((static_cast<uint32_t>(b) & 0x80u) << 24);
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f * 0x1p120f;
}

// fp8 weights' scales (kernels.h): s[j * cols + k / block] for column j of a tile; block is the
// row length when a row has one scale (cols == 1), so a chunk never starts a new block then.
// Unused (s null) for f32 and bf16.
struct Scales {
  const float* s = nullptr;
  int64_t cols = 0;
  int64_t block = 0;
};
template <typename W>
constexpr bool kFp8 = false;
template <>
constexpr bool kFp8<uint8_t> = true;

// R rows x C columns; xq / x / w as in kernels_avx512.cc's Tile. The 16 lanes are computed as
// two passes over k, lanes 0-7 and then 8-15 (the tile's weights stay in L1 between them), so a
// pass needs R x C accumulators, 2R x vectors and one column's two weight vectors at a time:
// within the 16 ymm registers for R = 2, C = 4.
template <int R, int C, typename W>
inline void Tile(const float* xq, int64_t stride, const float* x, int64_t K, const W* w, Scales sc, float* y,
                 int64_t ldy) {
  alignas(32) float lanes[R][C][16];
  for (int64_t h = 0; h < 2; ++h) {
    __m256 acc[R][C];
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < C; ++j) acc[i][j] = _mm256_setzero_ps();
    int64_t si = 0, block_end = sc.block;  // fp8: the chunk's scale index and where its block ends
    for (int64_t c = 0; c < stride; c += 32) {
      __m256 xe[R], xo[R];
      for (int i = 0; i < R; ++i) {
        xe[i] = _mm256_loadu_ps(xq + i * stride + c + 8 * h);
        xo[i] = _mm256_loadu_ps(xq + i * stride + c + 16 + 8 * h);
      }
      if constexpr (kFp8<W>) {
        if (c == block_end) {  // blocks are whole chunks: a chunk starts the next one exactly here
          ++si;
          block_end += sc.block;
        }
      }
      for (int j = 0; j < C; ++j) {
        __m256 we, wo;
        if constexpr (kFp8<W>) {
          LoadHalf(w + j * K + c + 16 * h, _mm256_set1_ps(sc.s[j * sc.cols + si]), &we, &wo);
        } else {
          LoadHalf(w + j * K + c + 16 * h, &we, &wo);
        }
        for (int i = 0; i < R; ++i) acc[i][j] = _mm256_fmadd_ps(xe[i], we, acc[i][j]);
        for (int i = 0; i < R; ++i) acc[i][j] = _mm256_fmadd_ps(xo[i], wo, acc[i][j]);
      }
    }
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < C; ++j) _mm256_store_ps(lanes[i][j] + 8 * h, acc[i][j]);
  }
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < C; ++j) {
      const float* a = lanes[i][j];
      float s = (((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))) +
                (((a[8] + a[9]) + (a[10] + a[11])) + ((a[12] + a[13]) + (a[14] + a[15])));
      if constexpr (kFp8<W>) {
        // The tail (fewer than 32 k from a chunk boundary) lies in one scale block: stride's.
        const float scale = sc.s[j * sc.cols + (sc.cols == 1 ? 0 : stride / sc.block)];
        for (int64_t k = stride; k < K; ++k) s = __builtin_fmaf(x[i * K + k], WidenW(w[j * K + k]) * scale, s);
      } else {
        for (int64_t k = stride; k < K; ++k) s = __builtin_fmaf(x[i * K + k], WidenW(w[j * K + k]), s);
      }
      y[i * ldy + j] = s;
    }
  }
}

template <int R, typename W>
inline void RowTile(const float* xq, int64_t stride, const float* x, int64_t K, const W* w, Scales sc, int64_t n0,
                    int64_t n1, float* y, int64_t ldy) {
  // Column n's scales: sc.s + n * sc.cols (fp8 only; s is null otherwise and never read).
  auto at = [&](int64_t n) {
    Scales t = sc;
    if (t.s != nullptr) t.s += n * sc.cols;
    return t;
  };
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) Tile<R, 4>(xq, stride, x, K, w + n * K, at(n), y + n, ldy);
  switch (n1 - n) {
    case 3: Tile<R, 3>(xq, stride, x, K, w + n * K, at(n), y + n, ldy); break;
    case 2: Tile<R, 2>(xq, stride, x, K, w + n * K, at(n), y + n, ldy); break;
    case 1: Tile<R, 1>(xq, stride, x, K, w + n * K, at(n), y + n, ldy); break;
    default: break;
  }
}

template <typename W>
void MatMulColumnsAvx2T(const float* xq, const float* x, int64_t M, int64_t K, const W* w, Scales sc, int64_t n0,
                        int64_t n1, float* y, int64_t ldy) {
  const int64_t stride = PackedRowStride(K);
  // Block the columns so a block of w stays in L2 while all rows of x stream past it.
  int64_t block = int64_t{256} * 1024 / (K * static_cast<int64_t>(sizeof(W)));
  block = block < 4 ? 4 : (block / 4) * 4;
  for (int64_t nb = n0; nb < n1; nb += block) {
    const int64_t ne = nb + block < n1 ? nb + block : n1;
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) RowTile<2>(xq + m * stride, stride, x + m * K, K, w, sc, nb, ne, y + m * ldy, ldy);
    if (m < M) RowTile<1>(xq + m * stride, stride, x + m * K, K, w, sc, nb, ne, y + m * ldy, ldy);
  }
}

// Dot (kernels.h): 8 lanes of fmas over k, the pairwise lane sum, a scalar fma tail.
float Dot8(const float* a, const float* b, int64_t k) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  alignas(32) float l[8];
  _mm256_store_ps(l, acc);
  float s = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
  for (; i < k; ++i) s = __builtin_fmaf(a[i], b[i], s);
  return s;
}

}  // namespace

void MatMulColumnsAvx2(const float* xq, const float* x, int64_t M, int64_t K, const float* w, int64_t n0,
                       int64_t n1, float* y, int64_t ldy) {
  MatMulColumnsAvx2T(xq, x, M, K, w, Scales{}, n0, n1, y, ldy);
}

void MatMulColumnsAvx2(const float* xq, const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0,
                       int64_t n1, float* y, int64_t ldy) {
  MatMulColumnsAvx2T(xq, x, M, K, w, Scales{}, n0, n1, y, ldy);
}

void MatMulColumnsAvx2(const float* xq, const float* x, int64_t M, int64_t K, const uint8_t* w, const float* scales,
                       int64_t scale_cols, int64_t scale_block_cols, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  // One scale per row: a block as long as the row, so no chunk starts a second one.
  const Scales sc{scales, scale_cols, scale_cols == 1 ? K : scale_block_cols};
  MatMulColumnsAvx2T(xq, x, M, K, w, sc, n0, n1, y, ldy);
}

float DotAvx2(const float* a, const float* b, int64_t k) { return Dot8(a, b, k); }

}  // namespace rc::engine::internal
