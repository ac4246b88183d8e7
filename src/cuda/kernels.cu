// CUDA kernels of the GPU data plane: content digest, batched device copies, strided view copy
// with dtype conversion, seeded fill. The digest term and the seeded values are the constexpr host
// functions themselves (rc::refit::DigestBlockKey / DigestTermInBlock, rc::cuda::SeededElementBits),
// called from device code through --expt-relaxed-constexpr, and the digest kernels' per-thread work
// is ChunkPart (digest_chunk.h), which the host evaluation runs too, so GPU and CPU cannot drift
// apart.
#include <cuda_runtime.h>

#include <type_traits>

#include "cuda/delta_task.h"
#include "cuda/digest_chunk.h"
#include "cuda/dtype_bits.h"
#include "cuda/kernels.h"
#include "rolloutcore/base/hash.h"
#include "rolloutcore/cuda/seeded.h"

namespace rc::cuda::internal {
namespace {

constexpr int kThreads = 256;
static_assert(kThreads == kDigestThreads, "BlockAddToSlot reduces kDigestThreads threads");

// The digest (rc-digest-2) and the fused install run ChunkPart (digest_chunk.h) per thread: one
// Mix64 per 64 elements (one lane per block of a 32-block unit, shared by __shfl_sync), 16-byte
// coalesced loads issued four at a time per lane, and per element an XOR, a multiply-add by a
// constant (two IMADs with immediates) and an add (the block-dependent part of B once per 16 bytes). Main's formula (two
// SplitMix64 finalizers per element, ~47 instructions per bf16 element) read 16.4 GB in ~17 ms
// where a plain read took 3.65 ms; rc-digest-2 with one load in flight per lane took 5.41 ms
// (0.67 x read: one 512-byte load in flight per warp did not cover the memory latency);
// four loads in flight and the cheaper term, 4.43 ms (0.82 x read), and with at most 64
// registers (four blocks an SM), 3.94 ms (0.90 x read; H200, 2026-12-01, docs/refit.md
// "Content digest").

// Block reduction of every thread's `sum` (warps, then the first warp), added to *slot_sum by one
// atomic (none when the block's sum is 0). Every thread of the block must call it.
__device__ __forceinline__ void BlockAddToSlot(uint64_t sum, uint64_t* slot_sum) {
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, off);
  __shared__ uint64_t warp_sums[kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = sum;
  __syncthreads();
  if (warp == 0) {
    sum = lane < kThreads / 32 ? warp_sums[lane] : 0;
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, off);
    if (lane == 0 && sum != 0) atomicAdd(reinterpret_cast<unsigned long long*>(slot_sum), static_cast<unsigned long long>(sum));
  }
}

// At most 64 registers a thread (four 256-thread blocks an SM): at the 80 the compiler picks
// unbounded, only three fit, and the digest read 16.4 GB in 4.40 ms instead of 3.94 (H200).
__global__ void __launch_bounds__(kDigestThreads, 4) DigestKernel(const DigestChunk* chunks, uint64_t* sums) {
  const DigestChunk c = chunks[blockIdx.x];
  BlockAddToSlot(ChunkThreadSum(c, threadIdx.x, blockDim.x), sums + c.slot);
}

__global__ void __launch_bounds__(kDigestThreads) FusedInstallKernel(const FusedChunk* chunks, uint64_t* sums) {
  const FusedChunk c = chunks[blockIdx.x];
  const uint64_t sum = ChunkThreadSum(c, threadIdx.x, blockDim.x);
  if (c.digest) BlockAddToSlot(sum, sums + c.slot);
}

__global__ void __launch_bounds__(kThreads) ReadSweepKernel(const uint4* src, uint64_t nvec, uint64_t* sink) {
  uint32_t acc = 0;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < nvec;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const uint4 q = __ldg(src + i);
    acc ^= q.x ^ q.y ^ q.z ^ q.w;
  }
  if (acc == 0x9e3779b9u) atomicAdd(reinterpret_cast<unsigned long long*>(sink), 1ull);  // practically never
}

__global__ void __launch_bounds__(kThreads) CopyKernel(const CopyChunk* chunks) {
  const CopyChunk c = chunks[blockIdx.x];
  auto* dst = reinterpret_cast<unsigned char*>(c.dst);
  const auto* src = reinterpret_cast<const unsigned char*>(c.src);
  uint64_t done = 0;
  if (((c.src | c.dst) & 15) == 0) {
    const uint64_t nvec = c.bytes / 16;
    auto* d = reinterpret_cast<uint4*>(dst);
    const auto* s = reinterpret_cast<const uint4*>(src);
    for (uint64_t i = threadIdx.x; i < nvec; i += blockDim.x) d[i] = __ldg(s + i);
    done = nvec * 16;
  }
  for (uint64_t i = done + threadIdx.x; i < c.bytes; i += blockDim.x) dst[i] = src[i];
}

template <typename S, typename D>
__device__ __forceinline__ D ConvertElement(S s, uint8_t from, uint8_t to) {
  using refit::DType;
  if (from == to) return static_cast<D>(s);
  const auto f = static_cast<DType>(from), t = static_cast<DType>(to);
  if (t == DType::kF32 && f == DType::kBF16) return static_cast<D>(Bf16ToF32Bits(static_cast<uint16_t>(s)));
  if (t == DType::kF32 && f == DType::kF16) return static_cast<D>(F16ToF32Bits(static_cast<uint16_t>(s)));
  if (f == DType::kF32 && t == DType::kBF16) return static_cast<D>(F32BitsToBf16(static_cast<uint32_t>(s)));
  if (f == DType::kF32 && t == DType::kF16) return static_cast<D>(F32BitsToF16(static_cast<uint32_t>(s)));
  return static_cast<D>(0);
}

template <typename S, typename D>
__global__ void ViewCopyKernel(ViewCopyArgs a) {
  const auto* src = reinterpret_cast<const S*>(a.src);
  auto* dst = reinterpret_cast<D*>(a.dst);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < a.n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t rest = i, so = 0, dof = 0;
    for (int d = a.ndims - 1; d >= 0; --d) {
      const int64_t idx = rest % a.size[d];
      rest /= a.size[d];
      so += idx * a.sstride[d];
      dof += idx * a.dstride[d];
    }
    dst[dof] = ConvertElement<S, D>(src[so], a.src_dtype, a.dst_dtype);
  }
}

template <typename T>
__global__ void FillKernel(FillArgs a) {
  auto* dst = reinterpret_cast<T*>(a.dst);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < a.n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t rest = i, g = a.gbase;
    for (int d = a.ndims - 1; d >= 0; --d) {
      g += (rest % a.extent[d]) * a.gstride[d];
      rest /= a.extent[d];
    }
    dst[i] = static_cast<T>(SeededElementBits(a.dtype, a.key, static_cast<uint64_t>(g)));
  }
}

template <typename S, typename D>
__global__ void ConvertKernel(const S* src, uint8_t from, D* dst, uint8_t to, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = ConvertElement<S, D>(src[i], from, to);
  }
}

unsigned GridFor(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65535 * 8 ? 65535 * 8 : blocks));
}

template <typename S>
cudaError_t ViewCopyFrom(const ViewCopyArgs& a, int dst_size, cudaStream_t stream) {
  switch (dst_size) {
    case 1: ViewCopyKernel<S, uint8_t><<<GridFor(a.n), kThreads, 0, stream>>>(a); break;
    case 2: ViewCopyKernel<S, uint16_t><<<GridFor(a.n), kThreads, 0, stream>>>(a); break;
    case 4: ViewCopyKernel<S, uint32_t><<<GridFor(a.n), kThreads, 0, stream>>>(a); break;
    case 8: ViewCopyKernel<S, unsigned long long><<<GridFor(a.n), kThreads, 0, stream>>>(a); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <typename S>
cudaError_t ConvertFrom(const void* src, uint8_t from, void* dst, uint8_t to, int dst_size, int64_t n,
                        cudaStream_t stream) {
  const auto* s = static_cast<const S*>(src);
  switch (dst_size) {
    case 1: ConvertKernel<<<GridFor(n), kThreads, 0, stream>>>(s, from, static_cast<uint8_t*>(dst), to, n); break;
    case 2: ConvertKernel<<<GridFor(n), kThreads, 0, stream>>>(s, from, static_cast<uint16_t*>(dst), to, n); break;
    case 4: ConvertKernel<<<GridFor(n), kThreads, 0, stream>>>(s, from, static_cast<uint32_t*>(dst), to, n); break;
    case 8:
      ConvertKernel<<<GridFor(n), kThreads, 0, stream>>>(s, from, static_cast<unsigned long long*>(dst), to, n);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

int SizeOf(uint8_t dtype) { return static_cast<int>(refit::DTypeSize(static_cast<refit::DType>(dtype))); }

}  // namespace

// One delta task per thread. The sums are added per warp where every lane's task is of the same
// slot (consecutive tasks mostly are: a piece's tiles are consecutive), else per thread.
__global__ void __launch_bounds__(kThreads) DeltaKernel(const DeltaPieceDesc* pieces, const DeltaOwnedBox* owned,
                                                        const DeltaTask* tasks, uint64_t count,
                                                        const unsigned char* bodies, uint64_t* old_sums,
                                                        uint64_t* new_sums, uint64_t* counts, uint64_t* first_error) {
  const uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  DeltaTaskResult r;
  uint32_t slot = 0;
  if (i < count) {
    const DeltaTask t = tasks[i];
    slot = pieces[t.piece].tensor;
    r = RunDeltaTask(pieces[t.piece], t, bodies, owned);
    if (r.error != kDeltaTaskOk) {
      atomicMin(reinterpret_cast<unsigned long long*>(first_error), static_cast<unsigned long long>((i << 2) | r.error));
      r = DeltaTaskResult{};
    }
  }
  const unsigned full = 0xffffffffu;
  const uint32_t slot0 = __shfl_sync(full, slot, 0);
  if (i >= count) slot = slot0;
  uint64_t w = r.writes, o = r.owned;
  for (int off = 16; off > 0; off >>= 1) {
    w += __shfl_down_sync(full, w, off);
    o += __shfl_down_sync(full, o, off);
  }
  const int lane = threadIdx.x & 31;
  if (lane == 0 && w != 0) atomicAdd(reinterpret_cast<unsigned long long*>(counts), static_cast<unsigned long long>(w));
  if (lane == 0 && o != 0) atomicAdd(reinterpret_cast<unsigned long long*>(counts + 1), static_cast<unsigned long long>(o));
  if (__all_sync(full, slot == slot0)) {
    uint64_t a = r.old_terms, b = r.new_terms;
    for (int off = 16; off > 0; off >>= 1) {
      a += __shfl_down_sync(full, a, off);
      b += __shfl_down_sync(full, b, off);
    }
    if (lane == 0) {
      atomicAdd(reinterpret_cast<unsigned long long*>(old_sums + slot0), static_cast<unsigned long long>(a));
      atomicAdd(reinterpret_cast<unsigned long long*>(new_sums + slot0), static_cast<unsigned long long>(b));
    }
  } else if (r.owned != 0) {
    atomicAdd(reinterpret_cast<unsigned long long*>(old_sums + slot), static_cast<unsigned long long>(r.old_terms));
    atomicAdd(reinterpret_cast<unsigned long long*>(new_sums + slot), static_cast<unsigned long long>(r.new_terms));
  }
}

cudaError_t LaunchDigest(const DigestChunk* chunks, uint64_t count, uint64_t* sums, cudaStream_t stream) {
  // gridDim.x may be up to 2^31 - 1 blocks.
  constexpr uint64_t kMaxBlocks = (1ull << 31) - 1;
  for (uint64_t begin = 0; begin < count; begin += kMaxBlocks) {
    const uint64_t n = count - begin < kMaxBlocks ? count - begin : kMaxBlocks;
    DigestKernel<<<static_cast<unsigned>(n), kDigestThreads, 0, stream>>>(chunks + begin, sums);
  }
  return cudaGetLastError();
}

cudaError_t LaunchFusedInstall(const FusedChunk* chunks, uint64_t count, uint64_t* sums, cudaStream_t stream) {
  constexpr uint64_t kMaxBlocks = (1ull << 31) - 1;
  for (uint64_t begin = 0; begin < count; begin += kMaxBlocks) {
    const uint64_t n = count - begin < kMaxBlocks ? count - begin : kMaxBlocks;
    FusedInstallKernel<<<static_cast<unsigned>(n), kDigestThreads, 0, stream>>>(chunks + begin, sums);
  }
  return cudaGetLastError();
}

cudaError_t LaunchDeltaTasks(const DeltaPieceDesc* pieces, const DeltaOwnedBox* owned, const DeltaTask* tasks,
                             uint64_t count, const unsigned char* bodies, uint64_t* old_sums, uint64_t* new_sums,
                             uint64_t* counts, uint64_t* first_error, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const uint64_t blocks = (count + kThreads - 1) / kThreads;
  if (blocks > (1ull << 31) - 1) return cudaErrorInvalidValue;
  DeltaKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(pieces, owned, tasks, count, bodies, old_sums,
                                                                      new_sums, counts, first_error);
  return cudaGetLastError();
}

cudaError_t LaunchReadSweep(const void* src, uint64_t bytes, uint64_t* sink, cudaStream_t stream) {
  if ((reinterpret_cast<uint64_t>(src) & 15) != 0 || bytes % 16 != 0) return cudaErrorInvalidValue;
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const uint64_t nvec = bytes / 16;
  uint64_t blocks = static_cast<uint64_t>(sms > 0 ? sms : 132) * 16;  // enough loads in flight per SM
  const uint64_t need = (nvec + kThreads - 1) / kThreads;
  if (blocks > need) blocks = need < 1 ? 1 : need;
  ReadSweepKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(static_cast<const uint4*>(src), nvec, sink);
  return cudaGetLastError();
}

cudaError_t LaunchCopyChunks(const CopyChunk* chunks, uint64_t count, cudaStream_t stream) {
  constexpr uint64_t kMaxBlocks = (1ull << 31) - 1;
  for (uint64_t begin = 0; begin < count; begin += kMaxBlocks) {
    const uint64_t n = count - begin < kMaxBlocks ? count - begin : kMaxBlocks;
    CopyKernel<<<static_cast<unsigned>(n), kThreads, 0, stream>>>(chunks + begin);
  }
  return cudaGetLastError();
}

cudaError_t LaunchViewCopy(const ViewCopyArgs& a, cudaStream_t stream) {
  if (a.n <= 0) return cudaSuccess;
  const int dst_size = SizeOf(a.dst_dtype);
  switch (SizeOf(a.src_dtype)) {
    case 1: return ViewCopyFrom<uint8_t>(a, dst_size, stream);
    case 2: return ViewCopyFrom<uint16_t>(a, dst_size, stream);
    case 4: return ViewCopyFrom<uint32_t>(a, dst_size, stream);
    case 8: return ViewCopyFrom<unsigned long long>(a, dst_size, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t LaunchSeededFill(const FillArgs& a, cudaStream_t stream) {
  if (a.n <= 0) return cudaSuccess;
  switch (a.elem_size) {
    case 1: FillKernel<uint8_t><<<GridFor(a.n), kThreads, 0, stream>>>(a); break;
    case 2: FillKernel<uint16_t><<<GridFor(a.n), kThreads, 0, stream>>>(a); break;
    case 4: FillKernel<uint32_t><<<GridFor(a.n), kThreads, 0, stream>>>(a); break;
    case 8: FillKernel<unsigned long long><<<GridFor(a.n), kThreads, 0, stream>>>(a); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t LaunchConvert(const void* src, uint8_t src_dtype, void* dst, uint8_t dst_dtype, int64_t n,
                          cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int dst_size = SizeOf(dst_dtype);
  switch (SizeOf(src_dtype)) {
    case 1: return ConvertFrom<uint8_t>(src, src_dtype, dst, dst_dtype, dst_size, n, stream);
    case 2: return ConvertFrom<uint16_t>(src, src_dtype, dst, dst_dtype, dst_size, n, stream);
    case 4: return ConvertFrom<uint32_t>(src, src_dtype, dst, dst_dtype, dst_size, n, stream);
    case 8: return ConvertFrom<unsigned long long>(src, src_dtype, dst, dst_dtype, dst_size, n, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace rc::cuda::internal
