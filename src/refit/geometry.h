// Internal geometry helpers of refit: describing missing regions, odometer iteration over
// N-d index spaces, and the strided view copy shared by the materializing loader and the executor.
//
// Thread safety: pure functions.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "rolloutcore/refit/tensor.h"

namespace rc::refit::internal {

// Names a region of `want` that the disjoint boxes `have` do not cover, e.g. "rows 1024..1280",
// "columns 8..16" or "dim 2 indices 0..4"; when no single dim shows a gap in projection,
// "N of M elements of [box]". Returns "" when `have` covers `want` (by volume).
std::string DescribeMissing(const Box& want, const std::vector<Box>& have);

// "rows a..b" / "columns a..b" / "dim d indices a..b" for a half-open range in dim d.
std::string DescribeRange(size_t dim, int64_t lo, int64_t hi);

// Calls fn(offsets) once per index tuple of `sizes` (outer dims, row-major order), where
// offsets[m] = base[m] + sum_d idx[d] * strides[d][m]. Nothing is called when any size is 0.
template <size_t M, typename Fn>
void ForEachIndex(std::span<const int64_t> sizes, std::span<const std::array<int64_t, M>> strides,
                  std::array<int64_t, M> base, Fn&& fn) {
  const size_t n = sizes.size();
  for (int64_t s : sizes) {
    if (s <= 0) return;
  }
  std::vector<int64_t> idx(n, 0);
  std::array<int64_t, M> off = base;
  while (true) {
    fn(off);
    size_t d = n;
    while (true) {
      if (d == 0) return;
      --d;
      if (++idx[d] < sizes[d]) {
        for (size_t m = 0; m < M; ++m) off[m] += strides[d][m];
        break;
      }
      for (size_t m = 0; m < M; ++m) off[m] -= strides[d][m] * (sizes[d] - 1);
      idx[d] = 0;
    }
  }
}

// Copies a view of a source tensor out of a dense block of that tensor into a destination.
//   block:      the region of the source tensor held in `src` (row-major, src_dtype)
//   box:        the view's box in source coordinates (must lie inside block)
//   view_to_source: per view dim the source dim it walks, or -1 for an inserted unit dim
//   dest:       element offset and per-view-dim element strides into `dst` (dst_dtype)
// The dtype pair must satisfy IsConversionSupported; bounds are the caller's to check.
void CopyViewFromBlock(DType src_dtype, const std::byte* src, const Box& block, const Box& box,
                       std::span<const int32_t> view_to_source, DType dst_dtype, std::byte* dst,
                       int64_t dest_offset, std::span<const int64_t> dest_strides);

// The view's shape: per view dim the box extent of its source dim, or 1 for a unit dim.
Shape ViewShape(const Box& box, std::span<const int32_t> view_to_source);

// Overflow-checked a * b + c on non-negative values; false on overflow.
inline bool MulAdd(int64_t a, int64_t b, int64_t c, int64_t* out) {
  int64_t p;
  if (__builtin_mul_overflow(a, b, &p)) return false;
  return !__builtin_add_overflow(p, c, out);
}

}  // namespace rc::refit::internal
