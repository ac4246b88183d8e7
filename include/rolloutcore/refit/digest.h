// Content digests: a sharding-invariant fingerprint of tensor contents.
//
// The digest of tensor T ("rc-digest-2", kDigestAlgorithm in manifest.h: version manifests name
// it and TensorDigestsFromShards refuses a manifest that names another) is
//
//     D(T) = sum over elements e of T of  DigestTerm(i_e, b_e)   (mod 2^64)
//
// where i_e is e's global row-major linear index in T's source (HF) shape and b_e is e's bits in
// T's source dtype zero-extended to 64 bits. The index is cut into 64-element blocks:
//
//     k = i >> 6,  j = i & 63
//     K = Mix64(k + 0x9E3779B97F4A7C15)                      one strong hash per block
//     A = (uint32)(K >> 32) ^ (uint32)(j * 0x9E3779B9)        32-bit per-position key
//     B = (K + j * 0xD1B54A32D192ED03) | 1                    odd 64-bit per-position multiplier
//     DigestTerm(i, b) = (b ^ A) * B   (mod 2^64)
//
// Mix64 is the SplitMix64 finalizer (rolloutcore/base/hash.h), a bijection with full avalanche.
//
// What the design relies on, and why it holds:
// - Sharding-invariant: D is a sum of per-position terms, so it decomposes over any partition of
//   T: trainer ranks digest their shards, engine ranks digest what they installed (mapped back to
//   source coordinates through the captured copies), and the sums agree.
// - Delta-updatable: changing elements updates D by sum over changed e of
//   DigestTerm(i_e, new) - DigestTerm(i_e, old), without reading the rest.
// - Any single-element change is detected with certainty: B is odd, hence invertible mod 2^64,
//   and x = b ^ A changes to some x' with 0 < |x' - x| < 2^64, so (x' - x) * B != 0 mod 2^64.
// - Two elements swapped inside a block change D even when their XOR-differences to the keys are
//   equal: their multipliers differ by (j - j') * 0xD1B54A32D192ED03 (odd constant times a
//   nonzero difference below 64), so B_j != B_j'. Across blocks the keys come from a full-avalanche
//   hash of the block number, so rows swapped, runs shifted or regions missing change D except
//   with probability about 2^-64 for changes spread over the low bits of the values.
// - Known weaker case: a term's change by a multiple of 2^t only moves bits >= t of D, so changes
//   confined to high value bits of several elements cancel with probability about 2^-(64-t) (two
//   f32 sign flips: ~2^-33; two flips of bit 63 of 64-bit elements always cancel). Single-element
//   changes and changes in the low bits are unaffected; 64-bit dtypes are rare in checkpoints.
// - Cost: per 64 elements one Mix64; per element one XOR, one add/or and one multiply of a value
//   below 2^32 (every dtype of at most 32 bits) by a 64-bit constant: x * B =
//   x * lo32(B) + ((x * hi32(B)) << 32), two 32x32->64 multiplies (AVX2 vpmuludq, CUDA
//   mul.wide.u32). Poisoned installed values (bit 40 set, below) and 64-bit dtypes take the full
//   64x64 multiply (DigestTermInBlock handles every case).
//
// Installed elements of another dtype are mapped back to source bits: f32 installed from bf16
// must have zero low 16 bits and f32 installed from f16 must round-trip through f16 exactly;
// anything else maps to a poisoned value (bit 40 set plus the f32 bits) that no source element
// has, so corruption of the extra bits is detected too. Narrowing installs (f32 -> bf16/f16) lose
// information and are not expected to match.
//
// The combined digest of a version is xxh3-64 over (name length, name bytes, tensor digest)
// for every tensor in name order.
//
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <span>
#include <vector>

#include "rolloutcore/base/hash.h"
#include "rolloutcore/base/status.h"
#include "rolloutcore/refit/capture.h"
#include "rolloutcore/refit/manifest.h"
#include "rolloutcore/refit/tensor.h"

namespace rc::refit {

inline constexpr uint64_t kDigestBlockSeed = 0x9E3779B97F4A7C15ULL;
inline constexpr uint32_t kDigestPositionKey = 0x9E3779B9u;
inline constexpr uint64_t kDigestPositionMul = 0xD1B54A32D192ED03ULL;
inline constexpr int kDigestBlockElements = 64;

// K of the 64-element block `block` (= global index >> 6).
constexpr uint64_t DigestBlockKey(uint64_t block) { return Mix64(block + kDigestBlockSeed); }
// A and B of position j (0..63) of a block with key K.
constexpr uint64_t DigestPositionKey(uint64_t block_key, uint32_t j) {
  return static_cast<uint64_t>(static_cast<uint32_t>(block_key >> 32) ^ static_cast<uint32_t>(j * kDigestPositionKey));
}
constexpr uint64_t DigestPositionMul(uint64_t block_key, uint32_t j) {
  return (block_key + static_cast<uint64_t>(j) * kDigestPositionMul) | 1;
}
// The term of position j of a block with key K (block-amortized: compute K once per 64 elements).
constexpr uint64_t DigestTermInBlock(uint64_t block_key, uint32_t j, uint64_t bits) {
  return (bits ^ DigestPositionKey(block_key, j)) * DigestPositionMul(block_key, j);
}
constexpr uint64_t DigestTerm(uint64_t global_index, uint64_t bits) {
  return DigestTermInBlock(DigestBlockKey(global_index >> 6), static_cast<uint32_t>(global_index & 63), bits);
}

// Digest of `box` of a tensor with global shape `tensor_shape`, whose elements are given in
// `data` as the box's row-major contents in `dtype`. The box must lie inside the tensor.
uint64_t DigestBlock(DType dtype, const Shape& tensor_shape, const Box& box, const void* data);

// The source-dtype bits DigestInstalled attributes to one installed element of dtype `installed`
// holding a value of a `source`-dtype tensor (poisoned when it is not an exact widening; see the
// header comment). Delta refit uses it to update a digest from an element's old and new values.
uint64_t InstalledSourceBits(DType source, DType installed, const void* element);

// Hash of (name, digest) pairs in name order.
uint64_t CombineTensorDigests(const TensorDigests& digests);

// Adds `from` into `into`, tensor by tensor, modulo 2^64.
void AddDigests(TensorDigests& into, const TensorDigests& from);

// Several copies (on one rank or across ranks) may install the same source elements (replicated
// parameters, kv heads replicated when tp > kv heads, tied embeddings, overlapping views). To
// digest each source element exactly once, every element is attributed to the first copy in
// (rank, copy) order that installs it: a DigestRegion is that copy plus the sub-box of its view
// box it owns (identical boxes are owned whole by their first copy; partial overlaps are cut into
// disjoint boxes). Returns the regions of each rank.
struct DigestRegion {
  uint32_t copy = 0;
  Box box;  // inside capture.copies[copy].box
};
std::vector<std::vector<DigestRegion>> AssignDigestOwnership(std::span<const Capture* const> ranks);

// Digest contributions of the given regions of `capture`'s copies, read from the installed
// destination buffers (name -> bytes). FailedPrecondition naming the parameter when a buffer is
// missing or has the wrong size; InvalidArgument when a region is not inside its copy.
[[nodiscard]] Result<TensorDigests> DigestInstalled(const Capture& capture,
                                                    const DestinationBuffers& buffers,
                                                    std::span<const DigestRegion> regions);

// Splits regions into pieces of at most about `max_elements` elements (cutting along the first
// dimension whose extent exceeds 1), so digest work can be spread over threads evenly. The
// pieces cover exactly the same elements, so the digests they sum to are unchanged.
std::vector<DigestRegion> SplitDigestRegions(std::span<const DigestRegion> regions, int64_t max_elements);

// DigestInstalled spread over `threads` threads of the shared pool (regions split into even
// pieces first). With any_nonfinite_f32 non-null, it is set to true when an f32 element the
// regions read is NaN or +-Inf (checked on each run while it is in cache; it only says whether,
// not where: a caller that needs the element looks for it then).
[[nodiscard]] Result<TensorDigests> DigestInstalledParallel(const Capture& capture,
                                                            const DestinationBuffers& buffers,
                                                            std::span<const DigestRegion> regions, int threads,
                                                            bool* any_nonfinite_f32 = nullptr);

// Installs and digests in one pass: copies the elements of the given regions from `from` (staged
// buffers) to `to` (live buffers) at the same byte offsets and returns the digest of the values it
// copied -- the same registers that are stored are mixed, so the result is the digest of what was
// written, without a second pass over memory. Same checks and errors as DigestInstalled (a staged
// buffer missing or of the wrong size is FailedPrecondition too).
[[nodiscard]] Result<TensorDigests> CopyAndDigestInstalled(const Capture& capture, const DestinationBuffers& from,
                                                           const DestinationBuffers& to,
                                                           std::span<const DigestRegion> regions);

// Per parameter, the byte ranges (sorted, disjoint) that no run of `regions` covers: bytes other
// copies own (replicated parameters, tied or overlapping views). A fused install copies these
// plainly. Parameters fully covered are absent. Depends only on the capture: compute it once.
struct ByteRange {
  uint64_t begin = 0, end = 0;
};
using UncoveredBytes = std::map<std::string, std::vector<ByteRange>, std::less<>>;
[[nodiscard]] Result<UncoveredBytes> BytesOutsideRegions(const Capture& capture,
                                                         std::span<const DigestRegion> regions);

// CopyAndDigestInstalled over `threads` threads of the shared pool (rolloutcore/base/parallel.h),
// plus a plain copy of `uncovered` (from BytesOutsideRegions of the same regions): afterwards every
// byte of every parameter in `uncovered` or in a region is copied, and the digest covers exactly
// what DigestInstalled over `regions` would read from `to`.
[[nodiscard]] Result<TensorDigests> CopyAndDigestInstalledParallel(const Capture& capture,
                                                                   const DestinationBuffers& from,
                                                                   const DestinationBuffers& to,
                                                                   std::span<const DigestRegion> regions,
                                                                   const UncoveredBytes& uncovered, int threads);

}  // namespace rc::refit
