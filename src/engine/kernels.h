// CPU compute kernels of the embedded engine (f32 activations; f32, bf16 or fp8 E4M3 weights).
//
// Weights come as a WeightRef (pointer + f32 / bf16 / fp8). A bf16 weight is widened in registers
// (bits << 16, exact) right where the f32 path loads its f32 value, and enters the same fused
// multiply-add in the same order: every output over bf16 weights is bitwise the output of the
// f32 path over the same weights widened to f32 (kernels_test.cc asserts it for every path).
//
// FP8 weights (E4M3FN, rolloutcore/formats/fp8.h) carry f32 scales, always in a per-row form: row
// n has scale_cols scales, scales[n * scale_cols + k / scale_block_cols] for column k (one scale
// per row: scale_cols = 1; the caller expands per-tensor, per-channel or block scales into this).
// Element (n, k) is the f32 value fl32(E4M3(q[n, k]) * scale): the byte decoded exactly, then one
// rounded multiply. The kernels compute that value in registers where the f32 path loads its
// weight (the byte's 7 low bits << 20 and its sign << 24 are the f32 bits of E4M3 / 2^120, a
// multiply by 2^120 makes it exact, subnormal codes included, then the multiply by the scale) and
// feed it to the same fma in the same order: every output over fp8 weights is bitwise the output
// of the f32 path over the weights dequantized element by element (kernels_test.cc, every path).
// A whole chunk of 32 k must share one scale, so scale_block_cols is a multiple of 32 unless
// there is one scale per row (MatMulNT aborts otherwise, naming the values). Subnormal codes widen
// through f32 denormals: DAZ / FTZ must be off (the default), and CPUs may take a slow path on
// them (kernels_benchmark.cc's "fp8 every code" rows; quantized weights have few).
//
// Batch invariance is the contract that matters here: MatMulNT computes every output element
// as the same fixed-order dot product whatever M, the tile an element falls in, or the thread
// count: k in chunks of 32; 16 lane accumulators, lane i taking k = 32c + 2i and then 32c + 2i + 1
// of every whole chunk c (fused multiply-adds, chunk after chunk); a fixed pairwise sum of the 16
// lanes; then a scalar fma tail over the k past the last whole chunk. So a token's logits do not
// depend on which other tokens share its batch, on chunked prefill, or on prefix caching: greedy
// decoding is bitwise reproducible. The order is the one bf16 weights give for free: 32 bf16
// loaded as 16 32-bit words hold element 2i in the low half of word i (<< 16 makes it an f32) and
// element 2i + 1 in the high half (masking the low half makes it one), so widening costs a shift
// and an AND on the FMA ports' neighbours instead of a cross-lane permute; x is packed once per
// call into the same even / odd order (PackEvenOdd). (32 fp8 bytes zero-extended from 16-bit words
// to 32-bit lanes put byte 2i and 2i + 1 in lane i the same way.) An AVX-512 (F, BW, DQ, VL) kernel
// is chosen at run time, else AVX2+FMA, else the portable path, which computes that order with
// std::fma: identical bits on every path (kernels_test.cc), so results do not depend on the CPU
// either. Dot() (attention's q.k, f32 by f32) is a separate fixed-order dot product: 8 lanes over
// k, a fixed pairwise lane sum, a scalar fma tail.
//
// Thread safety: pure functions; MatMulNT uses the given pool (one caller at a time).
#pragma once

#include <cstdint>
#include <vector>

#include "engine/thread_pool.h"

namespace rc::engine {

enum class WeightType : uint8_t { kF32, kBF16, kFP8 };

// A read-only view of weights (a parameter's storage), f32, bf16 or fp8 E4M3 with f32 scales;
// null when data is null.
struct WeightRef {
  const void* data = nullptr;
  WeightType type = WeightType::kF32;
  // kFP8 only: element (n, k) of a row-major [N, K] matrix is
  //   fl32(E4M3ToF32(q[n * K + k]) * scales[n * scale_cols + k / scale_block_cols])
  // i.e. every row carries its own scales (the caller expands per-tensor / per-channel / block
  // scales into this per-row form). With scale_cols == 1 every element of row n takes scales[n]
  // (scale_block_cols is then not used). MatMulNT requires scale_cols == 1, or scale_block_cols a
  // positive multiple of 32 with scale_cols * scale_block_cols >= K (it aborts otherwise).
  const float* scales = nullptr;
  int64_t scale_cols = 0;
  int64_t scale_block_cols = 0;
  WeightRef() = default;
  WeightRef(const float* p) : data(p), type(WeightType::kF32) {}  // NOLINT: f32 pointers convert
  WeightRef(const uint16_t* p) : data(p), type(WeightType::kBF16) {}  // NOLINT: bf16 bits
  // E4M3FN bytes q (the NaN codes 0x7F / 0xFF must not occur) with their per-row scales.
  static WeightRef Fp8(const uint8_t* q, const float* row_scales, int64_t scale_cols, int64_t scale_block_cols) {
    WeightRef r;
    r.data = q;
    r.type = WeightType::kFP8;
    r.scales = row_scales;
    r.scale_cols = scale_cols;
    r.scale_block_cols = scale_block_cols;
    return r;
  }
  explicit operator bool() const { return data != nullptr; }
  // Element i as f32: widened (f32, bf16; exact) or dequantized (fp8: the view is one row, element
  // i taking scale i / scale_block_cols, so Row(r, K).At(k) is element (r, k) of the matrix).
  float At(int64_t i) const {
    if (type == WeightType::kF32) return static_cast<const float*>(data)[i];
    if (type == WeightType::kBF16) {
      const uint32_t u = static_cast<uint32_t>(static_cast<const uint16_t*>(data)[i]) << 16;
      float f;
      __builtin_memcpy(&f, &u, 4);
      return f;
    }
    // E4M3 / 2^120 as f32 bits, times 2^120: exact for every non-NaN code (the subnormal ones are
    // f32 denormals here, so this needs DAZ off, the default), then the one rounded multiply.
    const uint32_t b = static_cast<const uint8_t*>(data)[i];
    const uint32_t u = ((b & 0x7Fu) << 20) | ((b & 0x80u) << 24);
    float f;
    __builtin_memcpy(&f, &u, 4);
    return (f * 0x1p120f) * scales[scale_cols == 1 ? 0 : i / scale_block_cols];
  }
  // The view of rows [row, ...) of a row-major matrix with `cols` columns (fp8: the scales advance
  // by row * scale_cols too).
  WeightRef Row(int64_t row, int64_t cols) const {
    WeightRef r = *this;
    switch (type) {
      case WeightType::kF32: r.data = static_cast<const float*>(data) + row * cols; break;
      case WeightType::kBF16: r.data = static_cast<const uint16_t*>(data) + row * cols; break;
      case WeightType::kFP8:
        r.data = static_cast<const uint8_t*>(data) + row * cols;
        r.scales = scales + row * scale_cols;
        break;
    }
    return r;
  }
};

// y[m, n] = sum_k x[m, k] * w[n, k]  (x: [M, K] row-major, w: [N, K] row-major, y: [M, N]).
void MatMulNT(ThreadPool* pool, const float* x, int64_t M, int64_t K, WeightRef w, int64_t N, float* y);
// The same, packing x into `pack` (grown as needed, kept by the caller) instead of a buffer of the
// calling thread's own: a caller that keeps one (Model's forward scratch) allocates nothing once
// warm, whichever thread it runs on.
void MatMulNT(ThreadPool* pool, const float* x, int64_t M, int64_t K, WeightRef w, int64_t N, float* y,
              std::vector<float>* pack);
float Dot(const float* a, const float* b, int64_t k);
// The row-wise helpers read w[i] as w.At(i): widened, or for fp8 dequantized with scale
// i / scale_block_cols of the view (pass an fp8 row as Row(r, cols)).
// y = x / sqrt(mean(x^2) + eps) * w over one row of `dim` (y may alias x).
void RmsNorm(const float* x, WeightRef w, int64_t dim, float eps, float* y);
// y[i] = w[i] widened (an embedding row), i in [0, n).
void WidenRow(WeightRef w, int64_t n, float* y);
// y[i] += w[i] widened (a bias), i in [0, n).
void AddRow(WeightRef w, int64_t n, float* y);
// Rotary embedding, Hugging Face "rotate_half" convention, in place on `heads` vectors of
// head_dim at position pos. inv_freq has head_dim/2 entries.
void ApplyRope(float* x, int64_t heads, int64_t head_dim, int64_t pos, const float* inv_freq);
bool KernelsUseAvx2();
// AVX-512 F, BW, DQ and VL with FMA (MatMulNT's kernel wherever the CPU has them).
bool KernelsUseAvx512();

namespace internal {
// x packed for the matmul kernels: row m occupies PackedRowStride(K) = 32 * (K / 32) floats,
// chunk c of it 32 floats: x[m, 32c + 2i] for i = 0..15, then x[m, 32c + 2i + 1] for i = 0..15.
// The k past the last whole chunk are read from x itself. PackEvenOdd writes M rows.
int64_t PackedRowStride(int64_t K);
void PackEvenOdd(const float* x, int64_t M, int64_t K, float* xq);
// The kernels, each computing columns [n0, n1) of y = x w^T in the order above (ldy: y's row
// stride). kernels.cc: portable (reads x directly); kernels_avx2.cc (-mavx2 -mfma) and
// kernels_avx512.cc (-mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma): from xq, x for the tail.
// Each takes f32, bf16 or fp8 weights (fp8: w the [N, K] bytes, then scales, scale_cols and
// scale_block_cols as in WeightRef, which MatMulNT checks and these do not).
void MatMulColumnsPortable(const float* x, int64_t M, int64_t K, const float* w, int64_t n0,
                           int64_t n1, float* y, int64_t ldy);
void MatMulColumnsPortable(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0,
                           int64_t n1, float* y, int64_t ldy);
void MatMulColumnsPortable(const float* x, int64_t M, int64_t K, const uint8_t* w, const float* scales,
                           int64_t scale_cols, int64_t scale_block_cols, int64_t n0, int64_t n1, float* y, int64_t ldy);
void MatMulColumnsAvx2(const float* xq, const float* x, int64_t M, int64_t K, const float* w, int64_t n0,
                       int64_t n1, float* y, int64_t ldy);
void MatMulColumnsAvx2(const float* xq, const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0,
                       int64_t n1, float* y, int64_t ldy);
void MatMulColumnsAvx2(const float* xq, const float* x, int64_t M, int64_t K, const uint8_t* w, const float* scales,
                       int64_t scale_cols, int64_t scale_block_cols, int64_t n0, int64_t n1, float* y, int64_t ldy);
void MatMulColumnsAvx512(const float* xq, const float* x, int64_t M, int64_t K, const float* w, int64_t n0,
                         int64_t n1, float* y, int64_t ldy);
void MatMulColumnsAvx512(const float* xq, const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0,
                         int64_t n1, float* y, int64_t ldy);
void MatMulColumnsAvx512(const float* xq, const float* x, int64_t M, int64_t K, const uint8_t* w, const float* scales,
                         int64_t scale_cols, int64_t scale_block_cols, int64_t n0, int64_t n1, float* y, int64_t ldy);
// Dot's two paths (8 lanes).
float DotAvx2(const float* a, const float* b, int64_t k);
float DotPortable(const float* a, const float* b, int64_t k);
}  // namespace internal

}  // namespace rc::engine
