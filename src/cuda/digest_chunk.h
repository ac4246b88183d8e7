// The per-thread work of the GPU digest and fused install kernels (kernels.cu), written once for
// host and device: ChunkPart<ES, MODE, kCopy>(c, thread, threads) is the sum of the digest terms
// (rc-digest-2, rolloutcore/refit/digest.h) of the elements of one chunk that thread `thread` of a
// `threads`-thread block handles, and performs that thread's copies. The kernels call it with
// threadIdx.x / blockDim.x; EvaluateDigestTableOnHost / EvaluateFusedInstallOnHost (digest_table.h)
// call it for every thread in turn, so the host evaluation the unit tests check against the CPU
// digest is the kernels' own partition, index arithmetic and term code. The only device-specific
// parts are the 16-byte loads (__ldg) and how a lane gets its block's key (a warp shuffle from the
// lane that computed it; the host computes the same key directly).
//
// A chunk is cut in three: the elements before its first 64-aligned global index (head), whole
// 64-element blocks, and the rest (tail). Head and tail (< 64 each) are done element by element
// (one Mix64 per element). The whole blocks take the block path when the chunk is contiguous
// (element and global steps 1) and 16-byte aligned at the first block: warp w of the thread block
// handles units of 32 consecutive blocks; lane l computes the key K of block l of the unit once
// (one Mix64 per 64 elements), then in each of 4 * ES steps the warp reads 512 consecutive bytes
// (16 bytes per lane, coalesced), and each lane gets the key of the block its 16 bytes belong to
// by __shfl_sync. Per element: one XOR with A, one 64-bit add and OR for B, and x * B with
// x < 2^32 (two 32x32->64 multiplies) for every dtype of at most 32 bits; modes whose source bits
// may exceed 32 bits (poisoned f32 installs, 8-byte elements) take the full 64x64 multiply.
// Anything else (strided chunks, misaligned starts) is element by element.
//
// Thread safety: pure functions of the chunk and the memory it names. On the device every lane of
// a warp must call ChunkPart with the same chunk (the shuffles are warp-wide): blockDim.x must be
// a multiple of 32, which kDigestThreads is.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cuda/dtype_bits.h"
#include "cuda/kernels.h"
#include "rolloutcore/refit/digest.h"

// Loop unrolling hints for the device pass only (host compilers warn about the unknown pragma).
#ifdef __CUDA_ARCH__
#define RC_UNROLL(n) _Pragma(#n)
#else
#define RC_UNROLL(n)
#endif

namespace rc::cuda::internal {

// Whether a mode's source bits always fit in 32 bits for element size ES (then x = bits ^ A < 2^32).
template <int ES, int MODE>
inline constexpr bool kNarrowBits = (MODE == kBitsRaw && ES <= 4) || MODE == kBitsBf16FromF32
                                    || MODE == kBitsF16FromF32;

// The geometry of the block path for element size ES: elements per 16-byte load, lanes per block,
// blocks per warp step, steps per 32-block unit.
template <int ES>
struct BlockLanes {
  static constexpr int kPer = 16 / ES;
  static constexpr int kLanesPerBlock = 64 / kPer;
  static constexpr int kBlocksPerStep = 32 / kLanesPerBlock;
  static constexpr int kSteps = 32 / kBlocksPerStep;
};

// One chunk as both kernels see it: n elements read at src + j * sstride, written (kCopy) at
// dst + j * dstride, with global index gindex + j * gstride; digest = false: copy only.
struct ChunkView {
  uint64_t src = 0, dst = 0, gindex = 0;
  int64_t sstride = 1, dstride = 1, gstride = 1;
  uint32_t count = 0;
  bool digest = true;
};

// head / whole blocks / tail of a chunk; blocks == 0 means element by element throughout.
struct ChunkSplit {
  uint32_t head = 0, blocks = 0;
};

template <int ES, bool kCopy>
RC_HD ChunkSplit SplitChunk(const ChunkView& c) {
  ChunkSplit s;
  const uint32_t to_boundary = static_cast<uint32_t>((64 - (c.gindex & 63)) & 63);
  s.head = c.count < to_boundary ? c.count : to_boundary;
  const bool contiguous = c.sstride == 1 && c.gstride == 1 && (!kCopy || c.dstride == 1);
  const uint64_t first = static_cast<uint64_t>(s.head) * ES;
  const bool aligned = ((c.src + first) & 15) == 0 && (!kCopy || ((c.dst + first) & 15) == 0);
  if (c.digest && contiguous && aligned) {
    s.blocks = (c.count - s.head) / 64;
  }
  if (s.blocks == 0) s.head = c.count;  // no block path: all elements one by one
  return s;
}

template <int ES>
RC_HD uint64_t LoadRaw(const unsigned char* p) {
  uint64_t v = 0;
  if constexpr (ES == 1) v = *p;
  if constexpr (ES == 2) v = *reinterpret_cast<const uint16_t*>(p);
  if constexpr (ES == 4) v = *reinterpret_cast<const uint32_t*>(p);
  if constexpr (ES == 8) v = *reinterpret_cast<const unsigned long long*>(p);
  return v;
}

template <int ES>
RC_HD void StoreRaw(unsigned char* p, uint64_t v) {
  if constexpr (ES == 1) *p = static_cast<unsigned char>(v);
  if constexpr (ES == 2) *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(v);
  if constexpr (ES == 4) *reinterpret_cast<uint32_t*>(p) = static_cast<uint32_t>(v);
  if constexpr (ES == 8) *reinterpret_cast<unsigned long long*>(p) = v;
}

RC_HD uint4 Load16(const unsigned char* p) {
#ifdef __CUDA_ARCH__
  return __ldg(reinterpret_cast<const uint4*>(p));
#else
  uint4 q;
  memcpy(&q, p, 16);
  return q;
#endif
}

RC_HD void Store16(unsigned char* p, const uint4& q) {
#ifdef __CUDA_ARCH__
  *reinterpret_cast<uint4*>(p) = q;
#else
  memcpy(p, &q, 16);
#endif
}

// Block numbers are global index >> 6: they wrap modulo 2^58 where the index wraps modulo 2^64.
inline constexpr uint64_t kBlockNumberMask = (uint64_t{1} << 58) - 1;

// The key of block `bi` (0..31) of a unit whose lane l holds
// lane_key = DigestBlockKey((first + l) & kBlockNumberMask).
RC_HD uint64_t UnitBlockKey(uint64_t lane_key, int bi, uint64_t first_block) {
#ifdef __CUDA_ARCH__
  (void)first_block;
  return __shfl_sync(0xffffffffu, lane_key, bi);
#else
  (void)lane_key;
  return refit::DigestBlockKey((first_block + static_cast<uint64_t>(bi)) & kBlockNumberMask);
#endif
}

// Term of position j of a block with key K for source bits `bits` (DigestTermInBlock; the narrow
// form when the bits fit in 32 bits, the same value).
template <int ES, int MODE>
RC_HD uint64_t BlockTerm(uint64_t key, uint32_t j, uint64_t bits) {
  if constexpr (kNarrowBits<ES, MODE>) {
    const uint32_t x = static_cast<uint32_t>(bits) ^ static_cast<uint32_t>(refit::DigestPositionKey(key, j));
    return static_cast<uint64_t>(x) * refit::DigestPositionMul(key, j);
  } else {
    return refit::DigestTermInBlock(key, j, bits);
  }
}

// Element e of the chunk one by one: copy (kCopy) and its term (when digesting).
template <int ES, int MODE, bool kCopy>
RC_HD uint64_t OneElement(const ChunkView& c, uint32_t e) {
  const auto* src = reinterpret_cast<const unsigned char*>(c.src) + static_cast<int64_t>(e) * c.sstride * ES;
  const uint64_t raw = LoadRaw<ES>(src);
  if constexpr (kCopy) {
    StoreRaw<ES>(reinterpret_cast<unsigned char*>(c.dst) + static_cast<int64_t>(e) * c.dstride * ES, raw);
  }
  if (!c.digest) return 0;
  return refit::DigestTerm(c.gindex + static_cast<uint64_t>(static_cast<int64_t>(e) * c.gstride),
                           SourceBitsFromInstalled(MODE, raw));
}

// A copy-only chunk: 16-byte copies strided over the threads when contiguous and aligned.
template <int ES>
RC_HD void CopyOnly(const ChunkView& c, uint32_t thread, uint32_t threads) {
  uint32_t done = 0;
  if (c.sstride == 1 && c.dstride == 1 && ((c.src | c.dst) & 15) == 0) {
    constexpr uint32_t kPer = 16 / ES;
    const uint32_t nvec = c.count / kPer;
    const auto* s = reinterpret_cast<const unsigned char*>(c.src);
    auto* d = reinterpret_cast<unsigned char*>(c.dst);
    for (uint32_t i = thread; i < nvec; i += threads) Store16(d + 16ull * i, Load16(s + 16ull * i));
    done = nvec * kPer;
  }
  for (uint32_t e = done + thread; e < c.count; e += threads) {
    StoreRaw<ES>(reinterpret_cast<unsigned char*>(c.dst) + static_cast<int64_t>(e) * c.dstride * ES,
                 LoadRaw<ES>(reinterpret_cast<const unsigned char*>(c.src) + static_cast<int64_t>(e) * c.sstride * ES));
  }
}

// The terms of one lane's 16 bytes: elements jbase .. jbase + 16 / ES - 1 of a block with key K.
template <int ES, int MODE>
RC_HD uint64_t LaneTerms(uint64_t key, uint32_t jbase, const uint4& q) {
  constexpr uint64_t kMask = ES == 8 ? ~0ull : ((1ull << (8 * ES)) - 1);
  const uint64_t w[2] = {q.x | (static_cast<uint64_t>(q.y) << 32), q.z | (static_cast<uint64_t>(q.w) << 32)};
  if constexpr (kNarrowBits<ES, MODE>) {
    // x_k < 2^32 and jbase even, so with K' = K & ~1 and p = K & 1, B_j = (K + j M) | 1 is
    // K' + jbase M + f_k + 2p [k odd] where f_k = k M + 1 - (k & 1) is a constant of k (j M has the
    // parity of j: K + j M is even exactly when p == (j & 1), and then the | 1 adds one). The sum
    // of x_k B_j over the lane is therefore (K' + jbase M) X + 2p X_odd + sum x_k f_k with
    // X = sum x_k: per element one multiply by an immediate and one add, and the block-dependent
    // part once per 16 bytes. Exact modulo 2^64, the same value as the term by term sum.
    const auto kh = static_cast<uint32_t>(key >> 32);
    uint64_t f = 0, x_even = 0, x_odd = 0;
    RC_UNROLL(unroll)
    for (int k = 0; k < 16 / ES; ++k) {
      const uint64_t raw = (w[(k * ES) / 8] >> ((k * ES * 8) % 64)) & kMask;
      const uint32_t j = jbase + static_cast<uint32_t>(k);
      const uint32_t x = static_cast<uint32_t>(SourceBitsFromInstalled(MODE, raw)) ^ kh ^
                         static_cast<uint32_t>(j * refit::kDigestPositionKey);
      const uint64_t fk = static_cast<uint64_t>(k) * refit::kDigestPositionMul + 1 - static_cast<uint64_t>(k & 1);
      f += static_cast<uint64_t>(x) * fk;
      if (k & 1) {
        x_odd += x;
      } else {
        x_even += x;
      }
    }
    const uint64_t g = (key & ~uint64_t{1}) + static_cast<uint64_t>(jbase) * refit::kDigestPositionMul;
    return g * (x_even + x_odd) + ((key & 1) != 0 ? 2 * x_odd : 0) + f;
  } else {
    uint64_t sum = 0;
    RC_UNROLL(unroll)
    for (int k = 0; k < 16 / ES; ++k) {
      const uint64_t raw = (w[(k * ES) / 8] >> ((k * ES * 8) % 64)) & kMask;
      sum += BlockTerm<ES, MODE>(key, jbase + static_cast<uint32_t>(k), SourceBitsFromInstalled(MODE, raw));
    }
    return sum;
  }
}

template <int ES, int MODE, bool kCopy>
RC_HD uint64_t ChunkPart(const ChunkView& c, uint32_t thread, uint32_t threads) {
  using L = BlockLanes<ES>;
  if constexpr (kCopy) {
    if (!c.digest) {
      CopyOnly<ES>(c, thread, threads);
      return 0;
    }
  }
  const ChunkSplit s = SplitChunk<ES, kCopy>(c);
  uint64_t sum = 0;
  // Head and tail, element by element, strided over the threads.
  const uint32_t tail = s.head + 64 * s.blocks;
  for (uint32_t e = thread; e < s.head; e += threads) sum += OneElement<ES, MODE, kCopy>(c, e);
  for (uint32_t e = tail + thread; e < c.count; e += threads) sum += OneElement<ES, MODE, kCopy>(c, e);
  if (s.blocks == 0) return sum;
  // Whole blocks: warps over units of 32 blocks (warp-uniform loops: every lane shuffles).
  const uint32_t lane = thread & 31, warp = thread >> 5, warps = threads >> 5;
  const uint64_t block0 = (c.gindex + s.head) >> 6;  // global block number of the first whole block
  const auto* src0 = reinterpret_cast<const unsigned char*>(c.src) + static_cast<uint64_t>(s.head) * ES;
  auto* dst0 = reinterpret_cast<unsigned char*>(c.dst) + static_cast<uint64_t>(s.head) * ES;
  const uint32_t jbase = (lane % L::kLanesPerBlock) * L::kPer;  // first position of this lane's 16 bytes
  const uint32_t units = (s.blocks + 31) / 32;
  for (uint32_t u = warp; u < units; u += warps) {
    const uint64_t first = block0 + static_cast<uint64_t>(u) * 32;
    uint64_t lane_key = 0;
#ifdef __CUDA_ARCH__
    lane_key = refit::DigestBlockKey((first + lane) & kBlockNumberMask);
#endif
    if (u * 32 + 32 <= s.blocks) {
      // A whole unit: the loads of kBatch steps are issued before any of their terms is computed,
      // so each lane has kBatch 16-byte loads in flight (one at a time left the kernel waiting on
      // memory latency: at 64 registers a thread, 32 warps an SM cannot cover it with one each).
      constexpr int kBatch = L::kSteps < 4 ? L::kSteps : 4;
      RC_UNROLL(unroll 1)
      for (int s0 = 0; s0 < L::kSteps; s0 += kBatch) {
        uint4 q[kBatch];
        RC_UNROLL(unroll)
        for (int i = 0; i < kBatch; ++i) {
          const int bi = (s0 + i) * L::kBlocksPerStep + static_cast<int>(lane / L::kLanesPerBlock);
          q[i] = Load16(src0 + (static_cast<uint64_t>(u * 32 + static_cast<uint32_t>(bi)) * 64 + jbase) * ES);
        }
        RC_UNROLL(unroll)
        for (int i = 0; i < kBatch; ++i) {
          const int bi = (s0 + i) * L::kBlocksPerStep + static_cast<int>(lane / L::kLanesPerBlock);
          const uint64_t off = (static_cast<uint64_t>(u * 32 + static_cast<uint32_t>(bi)) * 64 + jbase) * ES;
          if constexpr (kCopy) Store16(dst0 + off, q[i]);
          sum += LaneTerms<ES, MODE>(UnitBlockKey(lane_key, bi, first), jbase, q[i]);
        }
      }
      continue;
    }
    RC_UNROLL(unroll 4)
    for (int step = 0; step < L::kSteps; ++step) {
      const int bi = step * L::kBlocksPerStep + static_cast<int>(lane / L::kLanesPerBlock);
      const uint64_t key = UnitBlockKey(lane_key, bi, first);
      const uint32_t b = u * 32 + static_cast<uint32_t>(bi);  // block within the chunk's whole blocks
      if (b >= s.blocks) continue;
      const uint64_t off = (static_cast<uint64_t>(b) * 64 + jbase) * ES;
      const uint4 q = Load16(src0 + off);
      if constexpr (kCopy) Store16(dst0 + off, q);
      sum += LaneTerms<ES, MODE>(key, jbase, q);
    }
  }
  return sum;
}

// One (element size, bits mode) pair of a chunk.
template <int ES, int MODE>
struct ChunkKind {
  static constexpr int kElemSize = ES;
  static constexpr int kMode = MODE;
};

// Runs op.Run<ES, MODE>() for the one of Kinds that is (elem_size, mode); 0 when none is.
template <typename... Kinds, typename Op>
RC_HD uint64_t DispatchKind(int elem_size, int mode, const Op& op) {
  uint64_t sum = 0;
  (void)((elem_size == Kinds::kElemSize && mode == Kinds::kMode &&
          (sum = op.template Run<Kinds::kElemSize, Kinds::kMode>(), true)) ||
         ...);
  return sum;
}

// Runs op.Run<ES, MODE>() for a chunk's element size and bits mode: the (size, mode) pairs the host
// builds chunks for (0 for any other).
template <typename Op>
RC_HD uint64_t DispatchElemAndMode(int elem_size, int mode, const Op& op) {
  return DispatchKind<ChunkKind<1, kBitsRaw>, ChunkKind<2, kBitsRaw>, ChunkKind<4, kBitsRaw>, ChunkKind<8, kBitsRaw>,
                      ChunkKind<4, kBitsF32FromBf16>, ChunkKind<4, kBitsF32FromF16>, ChunkKind<2, kBitsBf16FromF32>,
                      ChunkKind<2, kBitsF16FromF32>, ChunkKind<1, kBitsMismatch>, ChunkKind<2, kBitsMismatch>,
                      ChunkKind<4, kBitsMismatch>, ChunkKind<8, kBitsMismatch>>(elem_size, mode, op);
}

RC_HD ChunkView ViewOf(const DigestChunk& c) {
  ChunkView v;
  v.src = c.addr;
  v.gindex = c.gindex;
  v.sstride = c.dstride;
  v.gstride = c.gstride;
  v.count = c.count;
  return v;
}

RC_HD ChunkView ViewOf(const FusedChunk& c) {
  ChunkView v;
  v.src = c.src;
  v.dst = c.dst;
  v.gindex = c.gindex;
  v.sstride = 1;
  v.dstride = c.dstride;
  v.gstride = c.gstride;
  v.count = c.count;
  v.digest = c.digest != 0;
  return v;
}

// The per-thread work of a chunk of either kind (DigestChunk: digest only; FusedChunk: copy, and
// digest what is written when c.digest), for the chunk's element size and bits mode.
template <typename Chunk>
struct ChunkWork {
  const ChunkView v;
  uint32_t thread, threads;
  template <int ES, int MODE>
  RC_HD uint64_t Run() const {
    return ChunkPart<ES, MODE, !std::is_same_v<Chunk, DigestChunk>>(v, thread, threads);
  }
};

template <typename Chunk>
RC_HD uint64_t ChunkThreadSum(const Chunk& c, uint32_t thread, uint32_t threads) {
  return DispatchElemAndMode(c.elem_size, c.mode, ChunkWork<Chunk>{ViewOf(c), thread, threads});
}

}  // namespace rc::cuda::internal
