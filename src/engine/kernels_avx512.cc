// AVX-512 kernels (F, BW, DQ, VL). This file is compiled with -mavx512f -mavx512bw -mavx512dq
// -mavx512vl -mfma and includes nothing that could leak those instructions into inline functions
// shared with other translation units; it runs only after a run-time CPU check.
//
// MatMulNT's order (kernels.h): a zmm is one output's 16 lane accumulators; per whole chunk of 32
// k, lane i takes the fma of k = 32c + 2i (the "even" vector) and then of 32c + 2i + 1 (the "odd"
// one). x comes packed in that order (PackEvenOdd). bf16 weights: one 64-byte load is the chunk's
// 32 elements as 16 words, element 2i in the low half of word i, 2i + 1 in the high half; a shift
// left by 16 gives the even f32s and an AND with 0xFFFF0000 the odd ones, both exact. f32 weights:
// two loads and two two-source permutes split the chunk into its even and odd elements. A tile is
// up to 5 rows x 4 columns (20 accumulators, 8 weight vectors and 2 x vectors of the 32 zmm), so
// each widened weight vector serves up to 5 fmas; then the 16 lanes are summed in the fixed
// pairwise order and the tail's k are added with scalar fmas, as the portable path does. The
// results are its bits exactly (kernels_test.cc).
// fp8 weights: the chunk's 32 bytes, loaded as 16 words and zero-extended to 32-bit lanes
// (vpmovzxwd), hold byte 2i in bits 0-7 of lane i and byte 2i + 1 in bits 8-15. Shifting the byte
// to the top of the lane and arithmetically back down by 4, then an AND with 0x87F00000, leaves its
// sign in bit 31 and its 7 low bits in bits 20-26: the f32 bits of E4M3 / 2^120 (a subnormal code
// is an f32 denormal, which needs DAZ off, the default). A multiply by 2^120 (exact) and one by the
// chunk's scale (a whole chunk shares one, kernels.h) give fl32(E4M3 * scale), the value the f32
// path would load from the dequantized matrix. 2^120 is not folded into the scale: 2^120 * scale
// overflows f32 from scale = 256 on (the kernels_test.cc scales go to 1e3), and the product with it.
// GCC 12's AVX-512 intrinsics fill unused lanes from _mm512_undefined_ps(), which its own
// -Wmaybe-uninitialized then reports at every inlined use (a known false positive).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <cstdint>

namespace rc::engine::internal {

int64_t PackedRowStride(int64_t K);  // kernels.cc

namespace {

// The chunk's even and odd weights of one column, widened to f32.
inline void LoadChunk(const uint16_t* p, __m512* even, __m512* odd) {
  const __m512i v = _mm512_loadu_si512(p);
  *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void LoadChunk(const float* p, __m512* even, __m512* odd) {
  const __m512 lo = _mm512_loadu_ps(p), hi = _mm512_loadu_ps(p + 16);
  const __m512i ie = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i io = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  *even = _mm512_permutex2var_ps(lo, ie, hi);
  *odd = _mm512_permutex2var_ps(lo, io, hi);
}
// The chunk's even and odd fp8 weights of one column, dequantized with the chunk's scale.
inline void LoadChunk(const uint8_t* p, __m512 scale, __m512* even, __m512* odd) {
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i mask = _mm512_set1_epi32(static_cast<int>(0x87F00000u));
  const __m512 pow120 = _mm512_set1_ps(0x1p120f);
  const __m512i e = _mm512_and_si512(_mm512_srai_epi32(_mm512_slli_epi32(v, 24), 4), mask);
  const __m512i o = _mm512_and_si512(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 4), mask);
  *even = _mm512_mul_ps(_mm512_mul_ps(_mm512_castsi512_ps(e), pow120), scale);
  *odd = _mm512_mul_ps(_mm512_mul_ps(_mm512_castsi512_ps(o), pow120), scale);
}
// (kernels_avx2.cc has the same: each ISA file includes nothing shared, see its header.)
inline float WidenW(float v) { return v; }
inline float WidenW(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
inline float WidenW(uint8_t b) {  // E4M3 exactly (times the scale apart), as LoadChunk does it
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

// The fixed pairwise sum of the 16 lanes (kernels.cc's ChunkDot).
inline float LaneSum16(__m512 v) {
  alignas(64) float a[16];
  _mm512_store_ps(a, v);
  return (((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))) +
         (((a[8] + a[9]) + (a[10] + a[11])) + ((a[12] + a[13]) + (a[14] + a[15])));
}

// R rows x C columns. xq: the tile's first packed row (row stride `stride` = 32 * chunks); x: the
// same rows unpacked (row stride K) for the tail; w: the first column's weights (row stride K).
// next: when not null, the next tile's first column, fetched into L1 chunk by chunk alongside
// (the first row tile of a column block reads its weights from memory; the prefetch keeps the
// next columns' streams ahead of it: lm_head's 151936 columns, 20-30 % faster at M = 16).
template <int R, int C, typename W>
inline void Tile(const float* xq, int64_t stride, const float* x, int64_t K, const W* w, const W* next, Scales sc,
                 float* y, int64_t ldy) {
  __m512 acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t si = 0, block_end = sc.block;  // fp8: the chunk's scale index and where its block ends
  for (int64_t c = 0; c < stride; c += 32) {
    __m512 we[C], wo[C];
    if constexpr (kFp8<W>) {
      if (c == block_end) {  // blocks are whole chunks: a chunk starts the next one exactly here
        ++si;
        block_end += sc.block;
      }
      for (int j = 0; j < C; ++j) LoadChunk(w + j * K + c, _mm512_set1_ps(sc.s[j * sc.cols + si]), &we[j], &wo[j]);
    } else {
      for (int j = 0; j < C; ++j) LoadChunk(w + j * K + c, &we[j], &wo[j]);
    }
    if (next != nullptr) {
      for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(next + j * K + c), _MM_HINT_T0);
    }
    for (int i = 0; i < R; ++i) {
      const __m512 xe = _mm512_loadu_ps(xq + i * stride + c);
      const __m512 xo = _mm512_loadu_ps(xq + i * stride + c + 16);
      for (int j = 0; j < C; ++j) acc[i][j] = _mm512_fmadd_ps(xe, we[j], acc[i][j]);
      for (int j = 0; j < C; ++j) acc[i][j] = _mm512_fmadd_ps(xo, wo[j], acc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < C; ++j) {
      float s = LaneSum16(acc[i][j]);
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

// Columns [n0, n1) for R rows. prefetch: fetch each next tile's columns while computing one, as
// long as that tile lies before n_end (the caller's last column + 1; past the block's end it is
// the next block's first tile).
template <int R, typename W>
inline void RowTile(const float* xq, int64_t stride, const float* x, int64_t K, const W* w, Scales sc, int64_t n0,
                    int64_t n1, int64_t n_end, bool prefetch, float* y, int64_t ldy) {
  // Column n's scales: sc.s + n * sc.cols (fp8 only; s is null otherwise and never read).
  auto at = [&](int64_t n) {
    Scales t = sc;
    if (t.s != nullptr) t.s += n * sc.cols;
    return t;
  };
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const W* next = prefetch && n + 8 <= n_end ? w + (n + 4) * K : nullptr;
    Tile<R, 4>(xq, stride, x, K, w + n * K, next, at(n), y + n, ldy);
  }
  const W* none = nullptr;
  switch (n1 - n) {
    case 3: Tile<R, 3>(xq, stride, x, K, w + n * K, none, at(n), y + n, ldy); break;
    case 2: Tile<R, 2>(xq, stride, x, K, w + n * K, none, at(n), y + n, ldy); break;
    case 1: Tile<R, 1>(xq, stride, x, K, w + n * K, none, at(n), y + n, ldy); break;
    default: break;
  }
}

template <typename W>
void MatMulColumnsAvx512T(const float* xq, const float* x, int64_t M, int64_t K, const W* w, Scales sc, int64_t n0,
                          int64_t n1, float* y, int64_t ldy) {
  const int64_t stride = PackedRowStride(K);
  // Rows in tiles of at most 5, as even as can be (M = 16: 4 x 4; 28: 5,5,5,5,4,4; 30: 6 x 5).
  const int64_t tiles = (M + 4) / 5;
  // Block the columns so a block of w stays in L2 while all rows of x stream past it.
  int64_t block = int64_t{256} * 1024 / (K * static_cast<int64_t>(sizeof(W)));
  block = block < 4 ? 4 : (block / 4) * 4;
  for (int64_t nb = n0; nb < n1; nb += block) {
    const int64_t ne = nb + block < n1 ? nb + block : n1;
    int64_t m = 0;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t rows = (M - m) / (tiles - t);  // the larger tiles last
      const float* tq = xq + m * stride;
      const float* tx = x + m * K;
      float* ty = y + m * ldy;
      const bool first = t == 0;  // reads this block of w from memory: prefetches
      switch (rows) {
        case 5: RowTile<5>(tq, stride, tx, K, w, sc, nb, ne, n1, first, ty, ldy); break;
        case 4: RowTile<4>(tq, stride, tx, K, w, sc, nb, ne, n1, first, ty, ldy); break;
        case 3: RowTile<3>(tq, stride, tx, K, w, sc, nb, ne, n1, first, ty, ldy); break;
        case 2: RowTile<2>(tq, stride, tx, K, w, sc, nb, ne, n1, first, ty, ldy); break;
        default: RowTile<1>(tq, stride, tx, K, w, sc, nb, ne, n1, first, ty, ldy); break;
      }
      m += rows;
    }
  }
}

}  // namespace

void MatMulColumnsAvx512(const float* xq, const float* x, int64_t M, int64_t K, const float* w, int64_t n0,
                         int64_t n1, float* y, int64_t ldy) {
  MatMulColumnsAvx512T(xq, x, M, K, w, Scales{}, n0, n1, y, ldy);
}

void MatMulColumnsAvx512(const float* xq, const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0,
                         int64_t n1, float* y, int64_t ldy) {
  MatMulColumnsAvx512T(xq, x, M, K, w, Scales{}, n0, n1, y, ldy);
}

void MatMulColumnsAvx512(const float* xq, const float* x, int64_t M, int64_t K, const uint8_t* w, const float* scales,
                         int64_t scale_cols, int64_t scale_block_cols, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  // One scale per row: a block as long as the row, so no chunk starts a second one.
  const Scales sc{scales, scale_cols, scale_cols == 1 ? K : scale_block_cols};
  MatMulColumnsAvx512T(xq, x, M, K, w, sc, n0, n1, y, ldy);
}

}  // namespace rc::engine::internal
