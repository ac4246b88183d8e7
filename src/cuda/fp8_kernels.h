// Launchers of the fp8 quantizer's kernels (fp8_quant.cu), formats/fp8.h's rule on the GPU. Plain
// argument structs, no rolloutcore types, so this header compiles in host C++ and in CUDA. Every
// launcher enqueues on `stream` and returns the launch error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace rc::cuda::internal {

// A row-major rows × cols bf16 matrix cut into segments: row r, column group g (cols [g * seg_cols,
// min(cols, (g + 1) * seg_cols))). Per tensor and per channel have one segment per row (seg_cols =
// cols); block has ceil(cols / block_cols) per row. One thread block per segment.
struct Fp8QuantArgs {
  uint64_t src = 0;      // const uint16_t* (bf16)
  uint64_t q = 0;        // uint8_t* (E4M3FN)
  uint64_t scales = 0;   // float* [groups]
  uint64_t amax = 0;     // uint32_t* [groups], bf16 magnitude bits; must start zeroed
  uint64_t status = 0;   // unsigned long long*: the smallest flat index of a non-finite element
                         // (must start at ~0)
  int64_t rows = 0, cols = 0;
  int64_t seg_cols = 0;      // columns per segment
  int64_t segs_per_row = 1;  // segments per row
  int64_t block_rows = 1;    // rows per scale group (block scheme)
  uint8_t scheme = 0;        // 0 per tensor, 1 per channel, 2 block (formats::Fp8Scheme order)
  uint8_t pad[7] = {};
};

inline constexpr int kFp8Threads = 256;

// Whether the vectorized kernels apply (16-byte loads of 8 bf16, 8-byte stores): cols % 8 == 0,
// src 16-byte and q 8-byte aligned, and 128-column segments for the block scheme. They compute the
// same bits as the per-segment kernels (the same per-element rule; a maximum is order-free).
bool Fp8Vectorizable(const Fp8QuantArgs& a);
// Pass 1: the largest magnitude of each group, and the first non-finite element. Passes 2 and 3
// write nothing once a non-finite element was found (status != ~0), so the host checks once, at
// the end.
cudaError_t LaunchFp8Amax(const Fp8QuantArgs& a, cudaStream_t stream);
// Pass 2: scales[g] from amax[g] (formats::Fp8ScaleForAmax).
cudaError_t LaunchFp8Scales(const Fp8QuantArgs& a, int64_t groups, cudaStream_t stream);
// Pass 3: q = E4M3(clamp(x * (1 / s))) (per channel: x / s), round to nearest even, saturating.
cudaError_t LaunchFp8Quantize(const Fp8QuantArgs& a, cudaStream_t stream);

}  // namespace rc::cuda::internal
