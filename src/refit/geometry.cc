#include "refit/geometry.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

namespace rc::refit::internal {

std::string DescribeRange(size_t dim, int64_t lo, int64_t hi) {
  if (dim == 0) return fmt::format("rows {}..{}", lo, hi);
  if (dim == 1) return fmt::format("columns {}..{}", lo, hi);
  return fmt::format("dim {} indices {}..{}", dim, lo, hi);
}

std::string DescribeMissing(const Box& want, const std::vector<Box>& have) {
  int64_t covered = 0;
  for (const Box& b : have) covered += b.numel();
  const int64_t total = want.numel();
  if (covered >= total) return "";
  for (size_t d = 0; d < want.ndim(); ++d) {
    std::vector<std::pair<int64_t, int64_t>> iv;
    iv.reserve(have.size());
    for (const Box& b : have) iv.emplace_back(b.start[d], b.start[d] + b.extent[d]);
    std::sort(iv.begin(), iv.end());
    int64_t cursor = want.start[d];
    const int64_t end = want.start[d] + want.extent[d];
    for (const auto& [lo, hi] : iv) {
      if (lo > cursor) return DescribeRange(d, cursor, std::min(lo, end));
      cursor = std::max(cursor, hi);
      if (cursor >= end) break;
    }
    if (cursor < end) return DescribeRange(d, cursor, end);
  }
  return fmt::format("{} of {} elements of {}", total - covered, total, BoxToString(want));
}

Shape ViewShape(const Box& box, std::span<const int32_t> view_to_source) {
  Shape s(view_to_source.size());
  for (size_t k = 0; k < view_to_source.size(); ++k) {
    s[k] = view_to_source[k] < 0 ? 1 : box.extent[static_cast<size_t>(view_to_source[k])];
  }
  return s;
}

void CopyViewFromBlock(DType src_dtype, const std::byte* src, const Box& block, const Box& box,
                       std::span<const int32_t> view_to_source, DType dst_dtype, std::byte* dst,
                       int64_t dest_offset, std::span<const int64_t> dest_strides) {
  const Shape block_strides = RowMajorStrides(block.extent);
  int64_t src_base = 0;
  for (size_t s = 0; s < block.ndim(); ++s) src_base += (box.start[s] - block.start[s]) * block_strides[s];
  // Per view dim: size, source stride, destination stride. Unit dims drop out.
  struct Dim {
    int64_t size, ss, ds;
  };
  std::vector<Dim> dims;
  dims.reserve(view_to_source.size());
  for (size_t k = 0; k < view_to_source.size(); ++k) {
    const int32_t s = view_to_source[k];
    if (s < 0) continue;
    const int64_t size = box.extent[static_cast<size_t>(s)];
    if (size == 0) return;
    if (size == 1) continue;
    dims.push_back({size, block_strides[static_cast<size_t>(s)], dest_strides[k]});
  }
  // Innermost loop: prefer the dim that is contiguous in the destination, else in the source.
  if (!dims.empty()) {
    size_t best = dims.size() - 1;
    for (size_t i = 0; i < dims.size(); ++i) {
      if (dims[i].ds == 1 && dims[i].ss == 1) { best = i; break; }
    }
    if (!(dims[best].ds == 1 && dims[best].ss == 1)) {
      for (size_t i = 0; i < dims.size(); ++i) {
        if (dims[i].ds == 1) { best = i; break; }
      }
    }
    std::rotate(dims.begin() + static_cast<std::ptrdiff_t>(best),
                dims.begin() + static_cast<std::ptrdiff_t>(best) + 1, dims.end());
  }
  const Dim inner = dims.empty() ? Dim{1, 1, 1} : dims.back();
  if (!dims.empty()) dims.pop_back();
  std::vector<int64_t> sizes;
  std::vector<std::array<int64_t, 2>> strides;
  for (const Dim& d : dims) {
    sizes.push_back(d.size);
    strides.push_back({d.ss, d.ds});
  }
  const size_t ses = DTypeSize(src_dtype);
  const size_t des = DTypeSize(dst_dtype);
  ForEachIndex<2>(sizes, strides, {src_base, dest_offset}, [&](const std::array<int64_t, 2>& off) {
    ConvertElements(src_dtype, src + static_cast<size_t>(off[0]) * ses, inner.ss, dst_dtype,
                    dst + static_cast<size_t>(off[1]) * des, inner.ds, inner.size);
  });
}

}  // namespace rc::refit::internal
