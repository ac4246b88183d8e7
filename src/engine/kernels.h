// CPU compute kernels of the embedded engine (f32).
//
// Batch invariance is the contract that matters here: MatMulNT computes every output element
// as the same fixed-order dot product (8 lanes of fused multiply-adds over k, a fixed pairwise
// lane sum, then a scalar fma tail), whatever M, the tile an element falls in, or the thread
// count. Dot() is that same dot product. So a token's logits do not depend on which other
// tokens share its batch, on chunked prefill, or on prefix caching: greedy decoding is bitwise
// reproducible. An AVX2+FMA path is chosen at run time; the portable path emulates the same
// lane order with std::fma and gives identical bits.
//
// Thread safety: pure functions; MatMulNT uses the given pool (one caller at a time).
#pragma once

#include <cstdint>

#include "engine/thread_pool.h"

namespace rc::engine {

// y[m, n] = sum_k x[m, k] * w[n, k]  (x: [M, K] row-major, w: [N, K] row-major, y: [M, N]).
void MatMulNT(ThreadPool* pool, const float* x, int64_t M, int64_t K, const float* w, int64_t N,
              float* y);
float Dot(const float* a, const float* b, int64_t k);
// y = x / sqrt(mean(x^2) + eps) * w over one row of `dim` (y may alias x).
void RmsNorm(const float* x, const float* w, int64_t dim, float eps, float* y);
// Rotary embedding, Hugging Face "rotate_half" convention, in place on `heads` vectors of
// head_dim at position pos. inv_freq has head_dim/2 entries.
void ApplyRope(float* x, int64_t heads, int64_t head_dim, int64_t pos, const float* inv_freq);
bool KernelsUseAvx2();

namespace internal {
// Implementations (kernels_avx2.cc is compiled with -mavx2 -mfma; kernels.cc is portable).
void MatMulColumnsAvx2(const float* x, int64_t M, int64_t K, const float* w, int64_t n0,
                       int64_t n1, float* y, int64_t ldy);
float DotAvx2(const float* a, const float* b, int64_t k);
void MatMulColumnsPortable(const float* x, int64_t M, int64_t K, const float* w, int64_t n0,
                           int64_t n1, float* y, int64_t ldy);
float DotPortable(const float* a, const float* b, int64_t k);
}  // namespace internal

}  // namespace rc::engine
