#include "engine/kernels.h"

#include "rolloutcore/base/cpu_features.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

namespace rc::engine {
namespace internal {
namespace {

inline float Widen(float v) { return v; }
inline float Widen(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Dot: 8 lanes of fmas over k, a pairwise lane sum, a scalar fma tail.
float DotPortableT(const float* a, const float* b, int64_t k) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    for (int l = 0; l < 8; ++l) acc[l] = std::fma(a[i + l], b[i + l], acc[l]);
  }
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < k; ++i) s = std::fma(a[i], b[i], s);
  return s;
}

// MatMulNT's dot product (kernels.h): 16 lanes, lane l taking k = c + 2l then c + 2l + 1 of each
// whole chunk of 32 at c, the fixed pairwise sum of the lanes, a scalar fma tail.
template <typename W>
float ChunkDot(const float* a, const W* b, int64_t k) {
  float acc[16] = {};
  int64_t c = 0;
  for (; c + 32 <= k; c += 32) {
    for (int64_t l = 0; l < 16; ++l) {
      acc[l] = std::fma(a[c + 2 * l], Widen(b[c + 2 * l]), acc[l]);
      acc[l] = std::fma(a[c + 2 * l + 1], Widen(b[c + 2 * l + 1]), acc[l]);
    }
  }
  float s = (((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))) +
            (((acc[8] + acc[9]) + (acc[10] + acc[11])) + ((acc[12] + acc[13]) + (acc[14] + acc[15])));
  for (; c < k; ++c) s = std::fma(a[c], Widen(b[c]), s);
  return s;
}

template <typename W>
void MatMulColumnsPortableT(const float* x, int64_t M, int64_t K, const W* w, int64_t n0, int64_t n1, float* y,
                            int64_t ldy) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n0; n < n1; ++n) y[m * ldy + n] = ChunkDot(x + m * K, w + n * K, K);
}

}  // namespace

float DotPortable(const float* a, const float* b, int64_t k) { return DotPortableT(a, b, k); }

void MatMulColumnsPortable(const float* x, int64_t M, int64_t K, const float* w, int64_t n0,
                           int64_t n1, float* y, int64_t ldy) {
  MatMulColumnsPortableT(x, M, K, w, n0, n1, y, ldy);
}

void MatMulColumnsPortable(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0,
                           int64_t n1, float* y, int64_t ldy) {
  MatMulColumnsPortableT(x, M, K, w, n0, n1, y, ldy);
}

int64_t PackedRowStride(int64_t K) { return (K / 32) * 32; }

void PackEvenOdd(const float* x, int64_t M, int64_t K, float* xq) {
  const int64_t stride = PackedRowStride(K);
  for (int64_t m = 0; m < M; ++m) {
    const float* src = x + m * K;
    float* dst = xq + m * stride;
    for (int64_t c = 0; c < stride; c += 32) {
      for (int64_t i = 0; i < 16; ++i) {
        dst[c + i] = src[c + 2 * i];
        dst[c + 16 + i] = src[c + 2 * i + 1];
      }
    }
  }
}

}  // namespace internal

bool KernelsUseAvx2() { return CpuHasAvx2() && CpuHasFma(); }

bool KernelsUseAvx512() { return KernelsUseAvx2() && CpuHasAvx512(); }

void MatMulNT(ThreadPool* pool, const float* x, int64_t M, int64_t K, WeightRef wr, int64_t N, float* y) {
  // Packed into a buffer of this thread's (grows to the largest M x K seen, then stays).
  thread_local std::vector<float> packed;
  MatMulNT(pool, x, M, K, wr, N, y, &packed);
}

void MatMulNT(ThreadPool* pool, const float* x, int64_t M, int64_t K, WeightRef wr, int64_t N, float* y,
              std::vector<float>* pack) {
  const bool bf16 = wr.type == WeightType::kBF16;
  const float* wf = static_cast<const float*>(wr.data);
  const uint16_t* wb = static_cast<const uint16_t*>(wr.data);
  const bool avx512 = KernelsUseAvx512();
  const bool avx2 = !avx512 && KernelsUseAvx2();
  // Packed once here, read by every thread, from a 64-byte boundary: the kernels' 64-byte loads
  // of it then never straddle two cache lines.
  float* xp = nullptr;
  if (avx512 || avx2) {
    pack->resize(static_cast<size_t>(M * internal::PackedRowStride(K) + 16));
    const auto addr = reinterpret_cast<uintptr_t>(pack->data());
    xp = pack->data() + ((64 - addr % 64) % 64) / sizeof(float);
    internal::PackEvenOdd(x, M, K, xp);
  }
  // Column groups of 16 keep threads' output columns apart.
  const int64_t group = 16;
  const int64_t groups = (N + group - 1) / group;
  auto run = [&](int64_t gb, int64_t ge) {
    const int64_t n0 = gb * group, n1 = ge * group < N ? ge * group : N;
    if (avx512) {
      if (bf16) {
        internal::MatMulColumnsAvx512(xp, x, M, K, wb, n0, n1, y, N);
      } else {
        internal::MatMulColumnsAvx512(xp, x, M, K, wf, n0, n1, y, N);
      }
    } else if (avx2) {
      if (bf16) {
        internal::MatMulColumnsAvx2(xp, x, M, K, wb, n0, n1, y, N);
      } else {
        internal::MatMulColumnsAvx2(xp, x, M, K, wf, n0, n1, y, N);
      }
    } else if (bf16) {
      internal::MatMulColumnsPortable(x, M, K, wb, n0, n1, y, N);
    } else {
      internal::MatMulColumnsPortable(x, M, K, wf, n0, n1, y, N);
    }
  };
  const double flops = 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
  if (pool == nullptr || flops < 2e5) {
    run(0, groups);
  } else {
    pool->ParallelForRange(groups, std::ref(run));  // a reference: std::function allocates nothing
  }
}

float Dot(const float* a, const float* b, int64_t k) {
  return KernelsUseAvx2() ? internal::DotAvx2(a, b, k) : internal::DotPortable(a, b, k);
}

void RmsNorm(const float* x, WeightRef w, int64_t dim, float eps, float* y) {
  double ss = 0;
  for (int64_t i = 0; i < dim; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(dim) + eps));
  if (w.type == WeightType::kF32) {
    const float* wf = static_cast<const float*>(w.data);
    for (int64_t i = 0; i < dim; ++i) y[i] = wf[i] * (x[i] * inv);
  } else {
    const uint16_t* wb = static_cast<const uint16_t*>(w.data);
    for (int64_t i = 0; i < dim; ++i) y[i] = internal::Widen(wb[i]) * (x[i] * inv);
  }
}

void WidenRow(WeightRef w, int64_t n, float* y) {
  if (w.type == WeightType::kF32) {
    std::memcpy(y, w.data, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  const uint16_t* wb = static_cast<const uint16_t*>(w.data);
  for (int64_t i = 0; i < n; ++i) y[i] = internal::Widen(wb[i]);
}

void AddRow(WeightRef w, int64_t n, float* y) {
  if (w.type == WeightType::kF32) {
    const float* wf = static_cast<const float*>(w.data);
    for (int64_t i = 0; i < n; ++i) y[i] += wf[i];
    return;
  }
  const uint16_t* wb = static_cast<const uint16_t*>(w.data);
  for (int64_t i = 0; i < n; ++i) y[i] += internal::Widen(wb[i]);
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
