// The fp8 quantizer on the GPU: formats/fp8.h's rule, the same bits as the CPU code (checked by
// tests/gpu/gpu_kernels_test.cc). Every f32 operation that the rule rounds is written with its
// explicit round-to-nearest intrinsic so that no compiler flag can contract or approximate it.
#include <cuda_fp8.h>

#include "cuda/fp8_kernels.h"

namespace rc::cuda::internal {
namespace {

// Whether the amax pass found a non-finite element (the later passes then write nothing).
__device__ __forceinline__ bool Failed(const Fp8QuantArgs& a) {
  return *reinterpret_cast<const volatile unsigned long long*>(a.status) != ~0ull;
}

__device__ __forceinline__ int64_t GroupOf(const Fp8QuantArgs& a, int64_t row, int64_t seg) {
  if (a.scheme == 0) return 0;
  if (a.scheme == 1) return row;
  return (row / a.block_rows) * a.segs_per_row + seg;
}

// formats::Fp8ScaleForAmax.
__device__ __forceinline__ float ScaleForAmax(uint8_t scheme, float amax) {
  if (scheme == 0) return __fdiv_rn(amax, 448.0f);
  if (scheme == 1) return fmaxf(__fdiv_rn(amax, 448.0f), 1.0f / 229376.0f);
  return __fmul_rn(fmaxf(amax, 1e-4f), 1.0f / 448.0f);
}

__global__ void __launch_bounds__(kFp8Threads) Fp8AmaxKernel(Fp8QuantArgs a) {
  __shared__ uint32_t best[kFp8Threads];
  const int64_t seg_index = blockIdx.x;
  const int64_t row = seg_index / a.segs_per_row;
  const int64_t seg = seg_index % a.segs_per_row;
  const int64_t c0 = seg * a.seg_cols;
  const int64_t c1 = min(a.cols, c0 + a.seg_cols);
  const auto* src = reinterpret_cast<const uint16_t*>(a.src) + row * a.cols;
  auto* status = reinterpret_cast<unsigned long long*>(a.status);
  uint32_t m = 0;
  for (int64_t c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
    const uint32_t mag = src[c] & 0x7FFFu;
    if ((mag & 0x7F80u) == 0x7F80u) {
      atomicMin(&status[0], static_cast<unsigned long long>(row * a.cols + c));
    } else {
      m = max(m, mag);
    }
  }
  best[threadIdx.x] = m;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) best[threadIdx.x] = max(best[threadIdx.x], best[threadIdx.x + s]);
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<uint32_t*>(a.amax) + GroupOf(a, row, seg), best[0]);
}

__global__ void Fp8ScalesKernel(Fp8QuantArgs a, int64_t groups) {
  if (Failed(a)) return;  // a non-finite input: nothing is written
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  const float amax = __uint_as_float(reinterpret_cast<const uint32_t*>(a.amax)[g] << 16);
  const float s = ScaleForAmax(a.scheme, amax);
  reinterpret_cast<float*>(a.scales)[g] = s;
}

__global__ void __launch_bounds__(kFp8Threads) Fp8QuantizeKernel(Fp8QuantArgs a) {
  if (Failed(a)) return;  // a non-finite input: nothing is written
  const int64_t seg_index = blockIdx.x;
  const int64_t row = seg_index / a.segs_per_row;
  const int64_t seg = seg_index % a.segs_per_row;
  const int64_t c0 = seg * a.seg_cols;
  const int64_t c1 = min(a.cols, c0 + a.seg_cols);
  // Per channel divides by the scale, the others multiply by its reciprocal (inf for a zero
  // per-tensor scale: 0 * inf is NaN and fminf makes it 448, as in vLLM's kernel).
  const float s = reinterpret_cast<const float*>(a.scales)[GroupOf(a, row, seg)];
  const bool divide = a.scheme == 1;
  const float inv = __frcp_rn(s);
  const auto* src = reinterpret_cast<const uint16_t*>(a.src) + row * a.cols;
  auto* q = reinterpret_cast<uint8_t*>(a.q) + row * a.cols;
  for (int64_t c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
    const float x = __uint_as_float(static_cast<uint32_t>(src[c]) << 16);
    const float v = fmaxf(-448.0f, fminf(divide ? __fdiv_rn(x, s) : __fmul_rn(x, inv), 448.0f));
    q[c] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
  }
}

// ---- The vectorized path (Fp8Vectorizable): the same per-element rule, 16-byte loads. ----------
// A tile is 128 columns of one row (one block-scheme segment), read by a half-warp: 16 lanes x 8
// bf16 (one uint4 each). The amax kernel walks tile pairs (one per half-warp) with warp-uniform
// trip counts, so the half-warp shuffles always see every lane.
constexpr int64_t kTileCols = 128;

__global__ void __launch_bounds__(kFp8Threads) Fp8AmaxVecKernel(Fp8QuantArgs a, int64_t chunks, int64_t tiles) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int half = lane >> 4;
  const int sub = lane & 15;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t pairs = (tiles + 1) / 2;
  auto* status = reinterpret_cast<unsigned long long*>(a.status);
  auto* amax = reinterpret_cast<uint32_t*>(a.amax);
  uint32_t m = 0;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; p < pairs; p += warps) {
    const int64_t t = 2 * p + half;
    const bool tile = t < tiles;
    const int64_t row = tile ? t / chunks : 0;
    const int64_t chunk = tile ? t % chunks : 0;
    const int64_t c0 = chunk * kTileCols + sub * 8;
    if (tile && c0 < a.cols) {
      const uint4 v = *reinterpret_cast<const uint4*>(reinterpret_cast<const uint16_t*>(a.src) + row * a.cols + c0);
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const uint32_t mag = (w[k >> 1] >> ((k & 1) * 16)) & 0x7FFFu;
        if ((mag & 0x7F80u) == 0x7F80u) {
          atomicMin(status, static_cast<unsigned long long>(row * a.cols + c0 + k));
        } else {
          m = max(m, mag);
        }
      }
    }
    if (a.scheme != 0) {
      // Per channel and block: this tile's group, from the half-warp's maximum.
      for (int o = 8; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
      if (tile && sub == 0) {
        const int64_t g = a.scheme == 1 ? row : (row / a.block_rows) * a.segs_per_row + chunk;
        atomicMax(amax + g, m);
      }
      m = 0;
    }
  }
  if (a.scheme == 0) {
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0 && m != 0) atomicMax(amax, m);
  }
}

__global__ void __launch_bounds__(kFp8Threads) Fp8QuantizeVecKernel(Fp8QuantArgs a) {
  if (Failed(a)) return;  // a non-finite input: nothing is written
  const int64_t per_row = a.cols / 8;
  const int64_t n = a.rows * per_row;
  const bool divide = a.scheme == 1;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / per_row;
    const int64_t c0 = (i % per_row) * 8;
    const int64_t g = a.scheme == 0   ? 0
                      : a.scheme == 1 ? row
                                      : (row / a.block_rows) * a.segs_per_row + c0 / kTileCols;
    const float s = reinterpret_cast<const float*>(a.scales)[g];
    const float inv = __frcp_rn(s);
    const uint4 v = *reinterpret_cast<const uint4*>(reinterpret_cast<const uint16_t*>(a.src) + row * a.cols + c0);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    uint32_t out[2] = {0, 0};
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float x = __uint_as_float(((w[k >> 1] >> ((k & 1) * 16)) & 0xFFFFu) << 16);
      const float y = fmaxf(-448.0f, fminf(divide ? __fdiv_rn(x, s) : __fmul_rn(x, inv), 448.0f));
      const uint32_t b = static_cast<uint8_t>(__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3));
      out[k >> 2] |= b << ((k & 3) * 8);
    }
    *reinterpret_cast<uint2*>(reinterpret_cast<uint8_t*>(a.q) + row * a.cols + c0) = make_uint2(out[0], out[1]);
  }
}

unsigned GridFor(int64_t units, int64_t per_block) {
  const int64_t b = (units + per_block - 1) / per_block;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 8192 ? 8192 : b));
}

unsigned Blocks(const Fp8QuantArgs& a) { return static_cast<unsigned>(a.rows * a.segs_per_row); }

}  // namespace

bool Fp8Vectorizable(const Fp8QuantArgs& a) {
  return a.cols % 8 == 0 && a.src % 16 == 0 && a.q % 8 == 0 && (a.scheme != 2 || a.seg_cols == kTileCols);
}

cudaError_t LaunchFp8Amax(const Fp8QuantArgs& a, cudaStream_t stream) {
  if (a.rows * a.segs_per_row == 0) return cudaSuccess;
  if (Fp8Vectorizable(a)) {
    const int64_t chunks = (a.cols + kTileCols - 1) / kTileCols;
    const int64_t tiles = a.rows * chunks;
    Fp8AmaxVecKernel<<<GridFor((tiles + 1) / 2, kFp8Threads / 32), kFp8Threads, 0, stream>>>(a, chunks, tiles);
    return cudaGetLastError();
  }
  Fp8AmaxKernel<<<Blocks(a), kFp8Threads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t LaunchFp8Scales(const Fp8QuantArgs& a, int64_t groups, cudaStream_t stream) {
  if (groups == 0) return cudaSuccess;
  Fp8ScalesKernel<<<static_cast<unsigned>((groups + 255) / 256), 256, 0, stream>>>(a, groups);
  return cudaGetLastError();
}

cudaError_t LaunchFp8Quantize(const Fp8QuantArgs& a, cudaStream_t stream) {
  if (a.rows * a.segs_per_row == 0) return cudaSuccess;
  if (Fp8Vectorizable(a)) {
    Fp8QuantizeVecKernel<<<GridFor(a.rows * (a.cols / 8), kFp8Threads), kFp8Threads, 0, stream>>>(a);
    return cudaGetLastError();
  }
  Fp8QuantizeKernel<<<Blocks(a), kFp8Threads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace rc::cuda::internal
