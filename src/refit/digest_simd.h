// Digest kernels: sums of DigestTerm (rolloutcore/refit/digest.h) over contiguous runs of
// elements, with a scalar reference and AVX2 / AVX-512 versions chosen at run time.
//
// Every kernel computes exactly
//     sum over j in [0, n) of DigestTerm(index + j, bits_j)   (mod 2^64)
// where bits_j is element j's bits zero-extended to 64 (elem_size 1, 2, 4 or 8 bytes), or, for
// the *Bf16AsF32 variants, the source bits of an f32 installed from a bf16 source: u >> 16 when
// the low 16 bits of u are zero, (1 << 40) | u otherwise (the header of digest.h explains why).
// The vector versions run over whole 64-element blocks of the global index (one DigestBlockKey per
// block) and do the elements before the first block boundary and after the last in scalar code.
// For 2- and 4-byte elements they evaluate each block's terms in a factored form, the same value
// mod 2^64 (digest_simd.cc, "the factored form"): per element an XOR and a few adds into per-lane
// sums, and per block one multiply of those sums by K | 1 per lane; the position-dependent
// weights are applied once per run. 1- and 8-byte elements and the *Bf16AsF32 variants compute
// x * B per lane (4 (AVX2) or 8 (AVX-512) lanes, two 32x32->64 multiplies, vpmuludq). Addition
// mod 2^64 is associative and commutative, so every ISA returns the same sum for the same bytes
// (digest_simd_test checks it for every dtype size, length, start index modulo 64, memory offset
// and tail, and for runs long and lopsided enough to overflow any 32-bit lane sum left unflushed).
//
// CopyAndDigest* copy the n elements from src to dst and digest the values they copied (the same
// registers that are stored are mixed), so an install proves what it wrote without a second pass
// over memory. src and dst must not overlap.
//
// AnyNonFiniteF32 is the staged-weights finite check, run on each digest run while it is still in
// cache (AVX2 for every vector ISA).
//
// Dispatch: BestDigestIsa() is the widest ISA the CPU supports, lowered by the environment
// variable ROLLOUTCORE_DIGEST_ISA=scalar|avx2 (for comparisons); the kernels called without an
// ISA use it. Pointers need no alignment.
//
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <string_view>

namespace rc::refit::internal {

enum class DigestIsa { kScalar, kAvx2, kAvx512 };

std::string_view DigestIsaName(DigestIsa isa);
bool DigestIsaSupported(DigestIsa isa);
DigestIsa BestDigestIsa();

uint64_t DigestContiguous(DigestIsa isa, int elem_size, const void* p, uint64_t index, int64_t n);
uint64_t DigestBf16AsF32(DigestIsa isa, const void* p, uint64_t index, int64_t n);
uint64_t CopyAndDigestContiguous(DigestIsa isa, int elem_size, void* dst, const void* src, uint64_t index,
                                 int64_t n);
uint64_t CopyAndDigestBf16AsF32(DigestIsa isa, void* dst, const void* src, uint64_t index, int64_t n);

// The landing copy of a bf16 (elem_size 2) or f32 (elem_size 4) run: CopyAndDigestContiguous that
// also sets *nonfinite when a copied element is NaN or +-Inf (bf16 / f32 exponent all ones; left
// as it is otherwise), in one pass: with AVX-512 the check and the digest run on the registers
// that are stored, and the stores are non-temporal where dst is 64-byte aligned (followed by an
// sfence); other ISAs copy in L1-sized pieces and scan each from L1. Other element sizes: no check.
uint64_t CopyDigestAndScan(DigestIsa isa, int elem_size, void* dst, const void* src, uint64_t index, int64_t n,
                           bool* nonfinite);
inline uint64_t CopyDigestAndScan(int elem_size, void* dst, const void* src, uint64_t index, int64_t n,
                                  bool* nonfinite) {
  return CopyDigestAndScan(BestDigestIsa(), elem_size, dst, src, index, n, nonfinite);
}

// True when any of the n f32 elements at p is NaN or +-Inf (exponent bits all ones).
bool AnyNonFiniteF32(DigestIsa isa, const void* p, int64_t n);
inline bool AnyNonFiniteF32(const void* p, int64_t n) { return AnyNonFiniteF32(BestDigestIsa(), p, n); }
// True when any of the n bf16 elements at p is NaN or +-Inf (exponent bits 0x7f80 all ones).
bool AnyNonFiniteBf16(DigestIsa isa, const void* p, int64_t n);
inline bool AnyNonFiniteBf16(const void* p, int64_t n) { return AnyNonFiniteBf16(BestDigestIsa(), p, n); }

// dst[j] = the f32 whose bits are src[j] << 16 (bf16 -> f32 is exact), n contiguous elements.
void WidenBf16ToF32(DigestIsa isa, void* dst, const void* src, int64_t n);
inline void WidenBf16ToF32(void* dst, const void* src, int64_t n) { WidenBf16ToF32(BestDigestIsa(), dst, src, n); }

inline uint64_t DigestContiguous(int elem_size, const void* p, uint64_t index, int64_t n) {
  return DigestContiguous(BestDigestIsa(), elem_size, p, index, n);
}
inline uint64_t DigestBf16AsF32(const void* p, uint64_t index, int64_t n) {
  return DigestBf16AsF32(BestDigestIsa(), p, index, n);
}
inline uint64_t CopyAndDigestContiguous(int elem_size, void* dst, const void* src, uint64_t index, int64_t n) {
  return CopyAndDigestContiguous(BestDigestIsa(), elem_size, dst, src, index, n);
}
inline uint64_t CopyAndDigestBf16AsF32(void* dst, const void* src, uint64_t index, int64_t n) {
  return CopyAndDigestBf16AsF32(BestDigestIsa(), dst, src, index, n);
}

}  // namespace rc::refit::internal
