#include "engine/kernels.h"

#include <cmath>

namespace rc::engine {
namespace internal {

float DotPortable(const float* a, const float* b, int64_t k) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    for (int l = 0; l < 8; ++l) acc[l] = std::fma(a[i + l], b[i + l], acc[l]);
  }
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < k; ++i) s = std::fma(a[i], b[i], s);
  return s;
}

void MatMulColumnsPortable(const float* x, int64_t M, int64_t K, const float* w, int64_t n0,
                           int64_t n1, float* y, int64_t ldy) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n0; n < n1; ++n) y[m * ldy + n] = DotPortable(x + m * K, w + n * K, K);
}

}  // namespace internal

bool KernelsUseAvx2() {
  static const bool kAvx2 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return kAvx2;
}

void MatMulNT(ThreadPool* pool, const float* x, int64_t M, int64_t K, const float* w, int64_t N,
              float* y) {
  const bool avx2 = KernelsUseAvx2();
  // Column groups of 16 keep threads' output columns apart.
  const int64_t group = 16;
  const int64_t groups = (N + group - 1) / group;
  auto run = [&](int64_t gb, int64_t ge) {
    const int64_t n0 = gb * group, n1 = ge * group < N ? ge * group : N;
    if (avx2) {
      internal::MatMulColumnsAvx2(x, M, K, w, n0, n1, y, N);
    } else {
      internal::MatMulColumnsPortable(x, M, K, w, n0, n1, y, N);
    }
  };
  const double flops = 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
  if (pool == nullptr || flops < 2e5) {
    run(0, groups);
  } else {
    pool->ParallelForRange(groups, run);
  }
}

float Dot(const float* a, const float* b, int64_t k) {
  return KernelsUseAvx2() ? internal::DotAvx2(a, b, k) : internal::DotPortable(a, b, k);
}

void RmsNorm(const float* x, const float* w, int64_t dim, float eps, float* y) {
  double ss = 0;
  for (int64_t i = 0; i < dim; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(dim) + eps));
  for (int64_t i = 0; i < dim; ++i) y[i] = w[i] * (x[i] * inv);
}

void ApplyRope(float* x, int64_t heads, int64_t head_dim, int64_t pos, const float* inv_freq) {
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float angle = static_cast<float>(pos) * inv_freq[i];
    const float c = std::cos(angle), s = std::sin(angle);
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + h * head_dim;
      const float a = v[i], b = v[i + half];
      v[i] = a * c - b * s;
      v[i + half] = b * c + a * s;
    }
  }
}

}  // namespace rc::engine
