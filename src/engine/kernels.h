// CPU compute kernels of the embedded engine (f32 activations; f32 or bf16 weights).
//
// Weights come as a WeightRef (pointer + f32 / bf16). A bf16 weight is widened in registers
// (bits << 16, exact) right where the f32 path loads its f32 value, and enters the same fused
// multiply-add in the same order: every output over bf16 weights is bitwise the output of the
// f32 path over the same weights widened to f32 (kernels_test.cc asserts it for both paths).
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
// call into the same even / odd order (PackEvenOdd). An AVX-512 (F, BW, DQ, VL) kernel is chosen
// at run time, else AVX2+FMA, else the portable path, which computes that order with std::fma:
// identical bits on every path (kernels_test.cc), so results do not depend on the CPU either.
// Dot() (attention's q.k, f32 by f32) is a separate fixed-order dot product: 8 lanes over k, a
// fixed pairwise lane sum, a scalar fma tail.
//
// Thread safety: pure functions; MatMulNT uses the given pool (one caller at a time).
#pragma once

#include <cstdint>
#include <vector>

#include "engine/thread_pool.h"

namespace rc::engine {

enum class WeightType : uint8_t { kF32, kBF16 };

// A read-only view of weights (a parameter's storage), f32 or bf16; null when data is null.
struct WeightRef {
  const void* data = nullptr;
  WeightType type = WeightType::kF32;
  WeightRef() = default;
  WeightRef(const float* p) : data(p), type(WeightType::kF32) {}  // NOLINT: f32 pointers convert
  WeightRef(const uint16_t* p) : data(p), type(WeightType::kBF16) {}  // NOLINT: bf16 bits
  explicit operator bool() const { return data != nullptr; }
  // Element i widened to f32 (exact).
  float At(int64_t i) const {
    if (type == WeightType::kF32) return static_cast<const float*>(data)[i];
    const uint32_t u = static_cast<uint32_t>(static_cast<const uint16_t*>(data)[i]) << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
  }
  // The view of rows [row, ...) of a row-major matrix with `cols` columns.
  WeightRef Row(int64_t row, int64_t cols) const {
    WeightRef r = *this;
    r.data = type == WeightType::kF32 ? static_cast<const void*>(static_cast<const float*>(data) + row * cols)
                                      : static_cast<const void*>(static_cast<const uint16_t*>(data) + row * cols);
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
void MatMulColumnsPortable(const float* x, int64_t M, int64_t K, const float* w, int64_t n0,
                           int64_t n1, float* y, int64_t ldy);
void MatMulColumnsPortable(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0,
                           int64_t n1, float* y, int64_t ldy);
void MatMulColumnsAvx2(const float* xq, const float* x, int64_t M, int64_t K, const float* w, int64_t n0,
                       int64_t n1, float* y, int64_t ldy);
void MatMulColumnsAvx2(const float* xq, const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0,
                       int64_t n1, float* y, int64_t ldy);
void MatMulColumnsAvx512(const float* xq, const float* x, int64_t M, int64_t K, const float* w, int64_t n0,
                         int64_t n1, float* y, int64_t ldy);
void MatMulColumnsAvx512(const float* xq, const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0,
                         int64_t n1, float* y, int64_t ldy);
// Dot's two paths (8 lanes).
float DotAvx2(const float* a, const float* b, int64_t k);
float DotPortable(const float* a, const float* b, int64_t k);
}  // namespace internal

}  // namespace rc::engine
