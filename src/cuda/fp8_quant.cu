// The fp8 quantizer on the GPU: formats/fp8.h's rule, the same bits as the CPU code (checked by
// tests/gpu/gpu_kernels_test.cc). Every f32 operation that the rule rounds is written with its
// explicit round-to-nearest intrinsic so that no compiler flag can contract or approximate it.
#include <cuda_fp8.h>

#include "cuda/fp8_kernels.h"

namespace rc::cuda::internal {
namespace {

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
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  const float amax = __uint_as_float(reinterpret_cast<const uint32_t*>(a.amax)[g] << 16);
  const float s = ScaleForAmax(a.scheme, amax);
  reinterpret_cast<float*>(a.scales)[g] = s;
}

__global__ void __launch_bounds__(kFp8Threads) Fp8QuantizeKernel(Fp8QuantArgs a) {
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

unsigned Blocks(const Fp8QuantArgs& a) { return static_cast<unsigned>(a.rows * a.segs_per_row); }

}  // namespace

cudaError_t LaunchFp8Amax(const Fp8QuantArgs& a, cudaStream_t stream) {
  if (a.rows * a.segs_per_row == 0) return cudaSuccess;
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
  Fp8QuantizeKernel<<<Blocks(a), kFp8Threads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace rc::cuda::internal
