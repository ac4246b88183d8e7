// Launchers of the CUDA kernels of the GPU data plane (kernels.cu). Plain argument structs, no
// refit types, so this header compiles in host C++ and in CUDA. Every launcher enqueues on
// `stream` and returns the launch error (cudaSuccess when enqueued).
//
// Thread safety: launchers may be called from any thread with the right device current.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace rc::cuda::internal {

inline constexpr int kMaxKernelDims = 16;
// Threads per block of the digest and fused install kernels (one block per chunk); the host
// evaluation (digest_table.h) partitions each chunk over the same number of threads.
inline constexpr int kDigestThreads = 256;

// A run of elements the digest kernel sums (one thread block per chunk).
struct DigestChunk {
  uint64_t addr = 0;    // device address of the first installed element
  uint64_t gindex = 0;  // its global row-major index in the source tensor
  int64_t dstride = 1;  // memory step between elements, in elements
  int64_t gstride = 1;  // global index step between elements
  uint32_t count = 0;   // elements
  uint32_t slot = 0;    // output accumulator index
  uint8_t elem_size = 2;  // bytes per installed element: 1, 2, 4 or 8
  uint8_t mode = 0;       // BitsMode (dtype_bits.h)
  uint8_t pad[6] = {};
};
static_assert(sizeof(DigestChunk) == 48);
inline constexpr uint32_t kDigestChunkBytes = 128 * 1024;  // contiguous chunks are cut at this size

// sums[slot] += sum of DigestTerm over each chunk (mod 2^64; sums must start zeroed). The per-thread
// work is ChunkPart (digest_chunk.h), shared with the host evaluation.
cudaError_t LaunchDigest(const DigestChunk* chunks, uint64_t count, uint64_t* sums, cudaStream_t stream);

// A run of the fused install (staging -> live copy that digests what it writes, one pass): count
// elements read densely from src (step 1) and written at dst + j * dstride (elements); when
// `digest` is 1 each written element also adds DigestTerm(gindex + j * gstride, source bits) into
// sums[slot] (the run is owned by its copy, digest.h AssignDigestOwnership); 0: copy only.
struct FusedChunk {
  uint64_t src = 0;
  uint64_t dst = 0;
  uint64_t gindex = 0;
  int64_t dstride = 1;
  int64_t gstride = 1;
  uint32_t count = 0;
  uint32_t slot = 0;
  uint8_t elem_size = 2;
  uint8_t mode = 0;    // BitsMode (dtype_bits.h)
  uint8_t digest = 1;  // 1: copy + digest, 0: copy only
  uint8_t pad[5] = {};
};
static_assert(sizeof(FusedChunk) == 56);
cudaError_t LaunchFusedInstall(const FusedChunk* chunks, uint64_t count, uint64_t* sums, cudaStream_t stream);

// Plain read of `bytes` at `src` (16-byte loads, grid-stride, the XOR of everything folded into
// *sink so the loads cannot be removed): the device's read bandwidth over the same bytes the digest
// reads, for the benchmark's ratio. src must be 16-byte aligned; bytes a multiple of 16.
cudaError_t LaunchReadSweep(const void* src, uint64_t bytes, uint64_t* sink, cudaStream_t stream);

struct CopyChunk {
  uint64_t src = 0, dst = 0, bytes = 0;
};
inline constexpr uint64_t kCopyChunkBytes = 1 << 20;
// Device-to-device copies of every chunk (one block per chunk; 16-byte accesses when aligned).
cudaError_t LaunchCopyChunks(const CopyChunk* chunks, uint64_t count, cudaStream_t stream);

// Delta refit onto a device image (delta_task.h): thread i runs tasks[i] (RunDeltaTask over the
// bodies). Per slot, old_sums / new_sums += the task's old / new digest terms; counts[0] += writes,
// counts[1] += digest-owned writes (all zeroed by the caller); a failed task stores nothing and
// sets *first_error = min(*first_error, task << 2 | error) (the caller sets it to ~0 first).
struct DeltaPieceDesc;
struct DeltaOwnedBox;
struct DeltaTask;
cudaError_t LaunchDeltaTasks(const DeltaPieceDesc* pieces, const DeltaOwnedBox* owned, const DeltaTask* tasks,
                             uint64_t count, const unsigned char* bodies, uint64_t* old_sums, uint64_t* new_sums,
                             uint64_t* counts, uint64_t* first_error, cudaStream_t stream);

// Strided view copy with dtype conversion: element i (row-major over size[0..ndims)) is read at
// src + sum(idx[d] * sstride[d]) and written at dst + sum(idx[d] * dstride[d]) (strides in
// elements of the respective dtype). dtypes are refit::DType values; the pair must be identical or
// one of bf16/f16 <-> f32.
struct ViewCopyArgs {
  uint64_t src = 0, dst = 0;
  int64_t n = 0;
  int32_t ndims = 0;
  uint8_t src_dtype = 0, dst_dtype = 0;
  int64_t size[kMaxKernelDims] = {};
  int64_t sstride[kMaxKernelDims] = {};
  int64_t dstride[kMaxKernelDims] = {};
};
cudaError_t LaunchViewCopy(const ViewCopyArgs& args, cudaStream_t stream);

// Fills a dense row-major box with SeededElementBits(dtype, key, global index), where the global
// index of box element (c_0..c_{k-1}) is gbase + sum(c_d * gstride[d]).
struct FillArgs {
  uint64_t dst = 0;
  uint64_t key = 0;
  int64_t n = 0;
  int64_t gbase = 0;
  int32_t ndims = 0;
  uint8_t dtype = 0;
  uint8_t elem_size = 2;
  int64_t extent[kMaxKernelDims] = {};
  int64_t gstride[kMaxKernelDims] = {};
};
cudaError_t LaunchSeededFill(const FillArgs& args, cudaStream_t stream);

// Converts n contiguous elements (dtypes as refit::DType values; identical or bf16/f16 <-> f32).
cudaError_t LaunchConvert(const void* src, uint8_t src_dtype, void* dst, uint8_t dst_dtype, int64_t n,
                          cudaStream_t stream);

}  // namespace rc::cuda::internal
