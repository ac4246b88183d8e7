// CPU compute kernels of the embedded engine (f32 activations; f32 or bf16 weights).
//
// Weights come as a WeightRef (pointer + f32 / bf16). A bf16 weight is widened in registers
// (bits << 16, exact) right where the f32 path loads its f32 value, and enters the same fused
// multiply-add in the same order: every output over bf16 weights is bitwise the output of the
// f32 path over the same weights widened to f32 (kernels_test.cc asserts it for both paths).
//
// Batch invariance is the contract that matters here: MatMulNT computes every output element
// as the same fixed-order dot product (8 lanes of fused multiply-adds over k, a fixed pairwise
// lane sum, then a scalar fma tail), whatever M, the tile an element falls in, or the thread
// count. Dot() is that same dot product. So a token's logits do not depend on which other
// tokens share its batch, on chunked prefill, or on prefix caching: greedy decoding is bitwise
// reproducible. An AVX2+FMA path is chosen at run time; the portable path emulates the same
// lane order with std::fma and gives identical bits. On a CPU with AVX-512 (F, BW, DQ, VL),
// MatMulNT with M >= 4 runs an AVX-512 kernel that keeps that lane order too, two rows to a
// register (kernels_avx512.cc): the same bits again, so results do not depend on the CPU either.
//
// Thread safety: pure functions; MatMulNT uses the given pool (one caller at a time).
#pragma once

#include <cstdint>

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
// AVX-512 F, BW, DQ and VL with FMA (MatMulNT's row-pair kernel for M >= kAvx512MinRows).
bool KernelsUseAvx512();
inline constexpr int64_t kAvx512MinRows = 4;

namespace internal {
// Implementations (kernels_avx2.cc is compiled with -mavx2 -mfma; kernels.cc is portable).
void MatMulColumnsAvx2(const float* x, int64_t M, int64_t K, const float* w, int64_t n0,
                       int64_t n1, float* y, int64_t ldy);
void MatMulColumnsAvx2(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0,
                       int64_t n1, float* y, int64_t ldy);
float DotAvx2(const float* a, const float* b, int64_t k);
void MatMulColumnsPortable(const float* x, int64_t M, int64_t K, const float* w, int64_t n0,
                           int64_t n1, float* y, int64_t ldy);
void MatMulColumnsPortable(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0,
                           int64_t n1, float* y, int64_t ldy);
float DotPortable(const float* a, const float* b, int64_t k);
// kernels_avx512.cc (-mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma). x packed by row pairs:
// pair p occupies PackedPairStride(K) floats, block b of it 16 floats (row 2p's k 8b..8b+7, then
// row 2p+1's; zeros for the row past M when M is odd); the k past the last whole block are read
// from x itself. PackRowPairs writes ((M + 1) / 2) * PackedPairStride(K) floats.
int64_t PackedPairStride(int64_t K);
void PackRowPairs(const float* x, int64_t M, int64_t K, float* xp);
void MatMulColumnsAvx512(const float* xp, const float* x, int64_t M, int64_t K, const float* w, int64_t n0,
                         int64_t n1, float* y, int64_t ldy);
void MatMulColumnsAvx512(const float* xp, const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0,
                         int64_t n1, float* y, int64_t ldy);
}  // namespace internal

}  // namespace rc::engine
