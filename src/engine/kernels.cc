#include "engine/kernels.h"

#include "rolloutcore/base/cpu_features.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
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

// E4M3FN byte -> f32, exact for every non-NaN code: the 7 low bits << 20 and the sign << 24 are
// the f32 bits of E4M3(b) / 2^120 (exponent bias 127 against 7), a subnormal code an f32 denormal
// (so this relies on DAZ / FTZ being off, the default), and the multiply by 2^120 is exact.
inline float Fp8Widen(uint8_t b) {
  const uint32_t u = ((static_cast<uint32_t>(b) & 0x7Fu) << 20) | ((static_cast<uint32_t>(b) & 0x80u) << 24);
  float f;
  std::memcpy(&f, &u, 4);
  return f * 0x1p120f;
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

// ChunkDot over one row of fp8 weights b with that row's scales s: the weight fed to each fma is
// fl32(E4M3(b[k]) * s[k / block]) (s[0] throughout when scale_cols == 1). A whole chunk lies in
// one scale block (block % 32 == 0), so its scale is read once.
float ChunkDotFp8(const float* a, const uint8_t* b, const float* s, int64_t scale_cols, int64_t block, int64_t k) {
  float acc[16] = {};
  int64_t c = 0;
  for (; c + 32 <= k; c += 32) {
    const float sc = s[scale_cols == 1 ? 0 : c / block];
    for (int64_t l = 0; l < 16; ++l) {
      acc[l] = std::fma(a[c + 2 * l], Fp8Widen(b[c + 2 * l]) * sc, acc[l]);
      acc[l] = std::fma(a[c + 2 * l + 1], Fp8Widen(b[c + 2 * l + 1]) * sc, acc[l]);
    }
  }
  float sum = (((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))) +
              (((acc[8] + acc[9]) + (acc[10] + acc[11])) + ((acc[12] + acc[13]) + (acc[14] + acc[15])));
  for (; c < k; ++c) sum = std::fma(a[c], Fp8Widen(b[c]) * s[scale_cols == 1 ? 0 : c / block], sum);
  return sum;
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

void MatMulColumnsPortable(const float* x, int64_t M, int64_t K, const uint8_t* w, const float* scales,
                           int64_t scale_cols, int64_t scale_block_cols, int64_t n0, int64_t n1, float* y,
                           int64_t ldy) {
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = n0; n < n1; ++n) {
      y[m * ldy + n] = ChunkDotFp8(x + m * K, w + n * K, scales + n * scale_cols, scale_cols, scale_block_cols, K);
    }
  }
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

namespace {

// The kernels' fp8 requirement (kernels.h): one scale per row, or scale blocks of whole chunks
// that cover the row. A violation is a caller's bug that would read the wrong scales: abort,
// naming the values.
void CheckFp8Scales(const WeightRef& w, int64_t K) {
  if (w.scales == nullptr && w.data != nullptr) {
    std::fprintf(stderr, "MatMulNT: fp8 weights without scales\n");
    std::abort();
  }
  if (w.scale_cols == 1) return;
  if (w.scale_cols < 1 || w.scale_block_cols <= 0 || w.scale_block_cols % 32 != 0 ||
      w.scale_cols * w.scale_block_cols < K) {
    std::fprintf(stderr,
                 "MatMulNT: fp8 scales need scale_cols == 1, or scale_block_cols a positive multiple of 32 "
                 "with scale_cols * scale_block_cols >= K; got scale_cols %lld, scale_block_cols %lld, K %lld\n",
                 static_cast<long long>(w.scale_cols), static_cast<long long>(w.scale_block_cols),
                 static_cast<long long>(K));
    std::abort();
  }
}

}  // namespace

void MatMulNT(ThreadPool* pool, const float* x, int64_t M, int64_t K, WeightRef wr, int64_t N, float* y,
              std::vector<float>* pack) {
  const WeightType type = wr.type;
  if (type == WeightType::kFP8) CheckFp8Scales(wr, K);
  const float* wf = static_cast<const float*>(wr.data);
  const uint16_t* wb = static_cast<const uint16_t*>(wr.data);
  const uint8_t* wq = static_cast<const uint8_t*>(wr.data);
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
      switch (type) {
        case WeightType::kF32: internal::MatMulColumnsAvx512(xp, x, M, K, wf, n0, n1, y, N); break;
        case WeightType::kBF16: internal::MatMulColumnsAvx512(xp, x, M, K, wb, n0, n1, y, N); break;
        case WeightType::kFP8:
          internal::MatMulColumnsAvx512(xp, x, M, K, wq, wr.scales, wr.scale_cols, wr.scale_block_cols, n0, n1, y, N);
          break;
      }
    } else if (avx2) {
      switch (type) {
        case WeightType::kF32: internal::MatMulColumnsAvx2(xp, x, M, K, wf, n0, n1, y, N); break;
        case WeightType::kBF16: internal::MatMulColumnsAvx2(xp, x, M, K, wb, n0, n1, y, N); break;
        case WeightType::kFP8:
          internal::MatMulColumnsAvx2(xp, x, M, K, wq, wr.scales, wr.scale_cols, wr.scale_block_cols, n0, n1, y, N);
          break;
      }
    } else {
      switch (type) {
        case WeightType::kF32: internal::MatMulColumnsPortable(x, M, K, wf, n0, n1, y, N); break;
        case WeightType::kBF16: internal::MatMulColumnsPortable(x, M, K, wb, n0, n1, y, N); break;
        case WeightType::kFP8:
          internal::MatMulColumnsPortable(x, M, K, wq, wr.scales, wr.scale_cols, wr.scale_block_cols, n0, n1, y, N);
          break;
      }
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
  } else if (w.type == WeightType::kBF16) {
    const uint16_t* wb = static_cast<const uint16_t*>(w.data);
    for (int64_t i = 0; i < dim; ++i) y[i] = internal::Widen(wb[i]) * (x[i] * inv);
  } else {
    for (int64_t i = 0; i < dim; ++i) y[i] = w.At(i) * (x[i] * inv);
  }
}

void WidenRow(WeightRef w, int64_t n, float* y) {
  if (w.type == WeightType::kF32) {
    std::memcpy(y, w.data, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  if (w.type == WeightType::kFP8) {
    for (int64_t i = 0; i < n; ++i) y[i] = w.At(i);
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
  if (w.type == WeightType::kFP8) {
    for (int64_t i = 0; i < n; ++i) y[i] += w.At(i);
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
