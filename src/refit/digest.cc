#include "rolloutcore/refit/digest.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <tuple>

#include "refit/geometry.h"
#include "rolloutcore/base/parallel.h"

namespace rc::refit {
namespace {

constexpr uint64_t kPoison = uint64_t{1} << 40;

template <typename T>
T LoadAs(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Sum of DigestTerm over n contiguous elements with consecutive global indices.
template <typename T>
uint64_t SumContiguous(const std::byte* p, uint64_t index, int64_t n) {
  uint64_t sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    sum += DigestTerm(index + static_cast<uint64_t>(j), LoadAs<T>(p + static_cast<size_t>(j) * sizeof(T)));
  }
  return sum;
}

uint64_t SumContiguousAny(DType dtype, const std::byte* p, uint64_t index, int64_t n) {
  switch (DTypeSize(dtype)) {
    case 1: return SumContiguous<uint8_t>(p, index, n);
    case 2: return SumContiguous<uint16_t>(p, index, n);
    case 4: return SumContiguous<uint32_t>(p, index, n);
    default: return SumContiguous<uint64_t>(p, index, n);
  }
}

// The source-dtype bits of an installed element (see the header comment).
uint64_t SourceBits(DType src, DType dst, const std::byte* p) {
  if (src == dst) return ElementBits(dst, p);
  if (dst == DType::kF32) {
    const uint32_t u = LoadAs<uint32_t>(p);
    if (src == DType::kBF16) return (u & 0xffffu) == 0 ? (u >> 16) : (kPoison | u);
    if (src == DType::kF16) {
      const uint16_t h = F32ToF16Bits(std::bit_cast<float>(u));
      return std::bit_cast<uint32_t>(F16BitsToF32(h)) == u ? h : (kPoison | u);
    }
  }
  if (src == DType::kF32 && dst == DType::kBF16) return std::bit_cast<uint32_t>(Bf16BitsToF32(LoadAs<uint16_t>(p)));
  if (src == DType::kF32 && dst == DType::kF16) return std::bit_cast<uint32_t>(F16BitsToF32(LoadAs<uint16_t>(p)));
  return (kPoison << 1) | ElementBits(dst, p);
}

}  // namespace

uint64_t DigestBlock(DType dtype, const Shape& tensor_shape, const Box& box, const void* data) {
  const auto* bytes = static_cast<const std::byte*>(data);
  const size_t n = box.ndim();
  if (box.numel() == 0) return 0;
  const Shape g = RowMajorStrides(tensor_shape);
  const Shape l = RowMajorStrides(box.extent);
  int64_t gbase = 0;
  for (size_t d = 0; d < n; ++d) gbase += box.start[d] * g[d];
  if (n == 0) return SumContiguousAny(dtype, bytes, 0, 1);
  std::vector<int64_t> sizes(box.extent.begin(), box.extent.end() - 1);
  std::vector<std::array<int64_t, 2>> strides;
  for (size_t d = 0; d + 1 < n; ++d) strides.push_back({l[d], g[d]});
  const int64_t inner = box.extent[n - 1];
  const size_t es = DTypeSize(dtype);
  uint64_t sum = 0;
  internal::ForEachIndex<2>(sizes, strides, {0, gbase}, [&](const std::array<int64_t, 2>& o) {
    sum += SumContiguousAny(dtype, bytes + static_cast<size_t>(o[0]) * es, static_cast<uint64_t>(o[1]), inner);
  });
  return sum;
}

uint64_t InstalledSourceBits(DType source, DType installed, const void* element) {
  return SourceBits(source, installed, static_cast<const std::byte*>(element));
}

uint64_t CombineTensorDigests(const TensorDigests& digests) {
  Hasher h;
  for (const auto& [name, d] : digests) {
    h.UpdateU64(name.size());
    h.Update(name);
    h.UpdateU64(d);
  }
  return h.Digest();
}

void AddDigests(TensorDigests& into, const TensorDigests& from) {
  for (const auto& [name, d] : from) into[name] += d;
}

namespace {

// Appends the parts of `b` outside `a` (disjoint boxes) to `out`.
void Subtract(const Box& b, const Box& a, std::vector<Box>* out) {
  Box rest = b;
  for (size_t d = 0; d < b.ndim(); ++d) {
    const int64_t lo = std::max(rest.start[d], a.start[d]);
    const int64_t hi = std::min(rest.start[d] + rest.extent[d], a.start[d] + a.extent[d]);
    if (lo > rest.start[d]) {
      Box piece = rest;
      piece.extent[d] = lo - rest.start[d];
      out->push_back(piece);
    }
    if (hi < rest.start[d] + rest.extent[d]) {
      Box piece = rest;
      piece.start[d] = hi;
      piece.extent[d] = rest.start[d] + rest.extent[d] - hi;
      out->push_back(piece);
    }
    rest.start[d] = lo;
    rest.extent[d] = hi - lo;
  }
}

}  // namespace

std::vector<std::vector<DigestRegion>> AssignDigestOwnership(std::span<const Capture* const> ranks) {
  struct Owned {
    Box box;
    uint32_t rank;
  };
  std::map<std::string_view, std::vector<Owned>> per_tensor;
  std::vector<std::vector<DigestRegion>> out(ranks.size());
  std::vector<Box> pieces, next;
  Box overlap;
  for (uint32_t r = 0; r < ranks.size(); ++r) {
    const Capture& cap = *ranks[r];
    for (uint32_t i = 0; i < cap.copies.size(); ++i) {
      const CapturedCopy& c = cap.copies[i];
      if (c.box.numel() == 0) continue;
      auto& owned = per_tensor[c.source];
      pieces.assign(1, c.box);
      for (const Owned& o : owned) {
        if (pieces.empty()) break;
        if (o.box == c.box) {
          pieces.clear();
          break;
        }
        next.clear();
        for (const Box& p : pieces) {
          if (Intersect(p, o.box, &overlap)) {
            Subtract(p, o.box, &next);
          } else {
            next.push_back(p);
          }
        }
        pieces.swap(next);
      }
      for (Box& p : pieces) {
        owned.push_back({p, r});
        out[r].push_back({i, std::move(p)});
      }
    }
  }
  return out;
}

Result<TensorDigests> DigestInstalled(const Capture& capture, const DestinationBuffers& buffers,
                                      std::span<const DigestRegion> regions) {
  TensorDigests out;
  for (const DigestRegion& region : regions) {
    if (region.copy >= capture.copies.size()) {
      return InvalidArgument(fmt::format("copy index {} out of range", region.copy));
    }
    const CapturedCopy& c = capture.copies[region.copy];
    if (!Contains(c.box, region.box)) {
      return InvalidArgument(fmt::format("tensor {}: digest region {} is outside the copy's box {}", c.source,
                                         BoxToString(region.box), BoxToString(c.box)));
    }
    const TensorSpec& p = capture.params[c.param];
    auto it = buffers.find(p.name);
    if (it == buffers.end() || it->second.size() != p.bytes()) {
      return FailedPrecondition(fmt::format("destination {}: no installed buffer of {} bytes", p.name, p.bytes()));
    }
    if (region.box.numel() == 0) continue;
    const std::byte* base = it->second.data();
    const size_t n = c.box.ndim();
    // Per source dim: global stride and destination stride (0 for dims the view selected).
    const Shape g = RowMajorStrides(c.source_shape);
    Shape ds(n, 0);
    for (size_t k = 0; k < c.view_to_source.size(); ++k) {
      if (c.view_to_source[k] >= 0) ds[static_cast<size_t>(c.view_to_source[k])] = c.dest_strides[k];
    }
    int64_t gbase = 0, dbase = c.dest_offset;
    std::vector<int64_t> sizes;
    std::vector<std::array<int64_t, 2>> strides;
    for (size_t s = 0; s < n; ++s) {
      gbase += region.box.start[s] * g[s];
      dbase += (region.box.start[s] - c.box.start[s]) * ds[s];
      if (region.box.extent[s] > 1) {
        sizes.push_back(region.box.extent[s]);
        strides.push_back({g[s], ds[s]});
      }
    }
    int64_t inner = 1;
    std::array<int64_t, 2> inner_stride{0, 0};
    if (!sizes.empty()) {
      inner = sizes.back();
      inner_stride = strides.back();
      sizes.pop_back();
      strides.pop_back();
    }
    const size_t des = DTypeSize(p.dtype);
    uint64_t sum = 0;
    internal::ForEachIndex<2>(sizes, strides, {gbase, dbase}, [&](const std::array<int64_t, 2>& o) {
      for (int64_t j = 0; j < inner; ++j) {
        const uint64_t gi = static_cast<uint64_t>(o[0] + j * inner_stride[0]);
        const std::byte* e = base + static_cast<size_t>(o[1] + j * inner_stride[1]) * des;
        sum += DigestTerm(gi, SourceBits(c.source_dtype, p.dtype, e));
      }
    });
    out[c.source] += sum;
  }
  return out;
}

std::vector<DigestRegion> SplitDigestRegions(std::span<const DigestRegion> regions, int64_t max_elements) {
  std::vector<DigestRegion> out;
  max_elements = std::max<int64_t>(1, max_elements);
  for (const DigestRegion& r : regions) {
    const int64_t n = r.box.numel();
    size_t dim = r.box.ndim();
    for (size_t d = 0; d < r.box.ndim(); ++d) {
      if (r.box.extent[d] > 1) {
        dim = d;
        break;
      }
    }
    if (n <= max_elements || dim == r.box.ndim()) {
      out.push_back(r);
      continue;
    }
    const int64_t per_row = n / r.box.extent[dim];  // elements per unit of `dim`
    const int64_t rows = std::max<int64_t>(1, max_elements / std::max<int64_t>(1, per_row));
    for (int64_t s = 0; s < r.box.extent[dim]; s += rows) {
      DigestRegion piece = r;
      piece.box.start[dim] = r.box.start[dim] + s;
      piece.box.extent[dim] = std::min(rows, r.box.extent[dim] - s);
      out.push_back(std::move(piece));
    }
  }
  return out;
}

Result<TensorDigests> DigestInstalledParallel(const Capture& capture, const DestinationBuffers& buffers,
                                              std::span<const DigestRegion> regions, int threads) {
  if (threads <= 1 || regions.empty()) return DigestInstalled(capture, buffers, regions);
  int64_t total = 0;
  for (const DigestRegion& r : regions) total += r.box.numel();
  // About 8 pieces per thread so uneven tensors still balance.
  const std::vector<DigestRegion> pieces =
      SplitDigestRegions(regions, std::max<int64_t>(1 << 16, total / (int64_t{threads} * 8)));
  // One result per piece, summed in order afterwards.
  std::vector<Result<TensorDigests>> partial(pieces.size(), TensorDigests{});
  ParallelFor(pieces.size(), threads, [&](size_t i) {
    partial[i] = DigestInstalled(capture, buffers, std::span<const DigestRegion>(&pieces[i], 1));
  });
  TensorDigests out;
  for (auto& p : partial) {
    if (!p.ok()) return p.status();
    AddDigests(out, *p);
  }
  return out;
}

}  // namespace rc::refit
