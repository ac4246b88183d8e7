#include "rolloutcore/refit/digest.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <tuple>

#include "refit/digest_simd.h"
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

// Sum of DigestTerm over n contiguous elements with consecutive global indices (vectorized).
uint64_t SumContiguousAny(DType dtype, const std::byte* p, uint64_t index, int64_t n) {
  return internal::DigestContiguous(static_cast<int>(DTypeSize(dtype)), p, index, n);
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

namespace {

// One inner run of a digest region: `inner` elements, the first at global source index g0 and
// destination element d0, the next ones `gstride` / `dstride` elements further.
struct RegionRun {
  const CapturedCopy* copy;
  const TensorSpec* param;
  std::byte* dst;        // base of the destination buffer being read (or written)
  const std::byte* src;  // base of the buffer copied from (copying only; else == dst)
  int64_t g0, d0, inner, gstride, dstride;
};

// Checks every region against `capture` and `buffers` (and `from`, when copying), then calls
// run(RegionRun) -> uint64_t for every inner run and sums the results per source tensor. With
// buffers == nullptr only the geometry is walked (RegionRun's pointers are null).
template <typename F>
Result<TensorDigests> SumRegionRuns(const Capture& capture, const DestinationBuffers* buffers,
                                    const DestinationBuffers* from, std::span<const DigestRegion> regions, F&& run) {
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
    std::byte* dst_base = nullptr;
    if (buffers != nullptr) {
      auto it = buffers->find(p.name);
      if (it == buffers->end() || it->second.size() != p.bytes()) {
        return FailedPrecondition(fmt::format("destination {}: no installed buffer of {} bytes", p.name, p.bytes()));
      }
      dst_base = it->second.data();
    }
    const std::byte* src_base = dst_base;
    if (from != nullptr) {
      auto f = from->find(p.name);
      if (f == from->end() || f->second.size() != p.bytes()) {
        return FailedPrecondition(fmt::format("source {}: no staged buffer of {} bytes", p.name, p.bytes()));
      }
      src_base = f->second.data();
    }
    if (region.box.numel() == 0) continue;
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
    uint64_t sum = 0;
    internal::ForEachIndex<2>(sizes, strides, {gbase, dbase}, [&](const std::array<int64_t, 2>& o) {
      sum += run(RegionRun{&c, &p, dst_base, src_base, o[0], o[1], inner, inner_stride[0], inner_stride[1]});
    });
    out[c.source] += sum;
  }
  return out;
}

// Digest of one run read at r.src (the vector kernels when the run is contiguous on both sides
// and the dtypes are the same or bf16 installed as f32; element by element otherwise). With
// kCopy the run's bytes are also copied from r.src to r.dst, and the values digested are the ones
// copied.
template <bool kCopy>
uint64_t RunDigest(const RegionRun& r, bool* nonfinite_f32 = nullptr) {
  const DType sd = r.copy->source_dtype, dd = r.param->dtype;
  const size_t des = DTypeSize(dd);
  const bool same = sd == dd;
  const bool bf16_in_f32 = sd == DType::kBF16 && dd == DType::kF32;
  const auto g0 = static_cast<uint64_t>(r.g0);
  if (r.gstride == 1 && r.dstride == 1 && (same || bf16_in_f32)) {
    const std::byte* from = r.src + static_cast<size_t>(r.d0) * des;
    std::byte* to = r.dst + static_cast<size_t>(r.d0) * des;
    if constexpr (kCopy) {
      return same ? internal::CopyAndDigestContiguous(static_cast<int>(des), to, from, g0, r.inner)
                  : internal::CopyAndDigestBf16AsF32(to, from, g0, r.inner);
    } else {
      const uint64_t d = same ? internal::DigestContiguous(static_cast<int>(des), from, g0, r.inner)
                              : internal::DigestBf16AsF32(from, g0, r.inner);
      // The run is still in cache: the finite check costs no memory pass of its own.
      if (nonfinite_f32 != nullptr && dd == DType::kF32 && internal::AnyNonFiniteF32(from, r.inner)) {
        *nonfinite_f32 = true;
      }
      return d;
    }
  }
  uint64_t sum = 0;
  uint64_t block = ~uint64_t{0}, key = 0;  // the block key, recomputed only when the block changes
  for (int64_t j = 0; j < r.inner; ++j) {
    const uint64_t gi = static_cast<uint64_t>(r.g0 + j * r.gstride);
    const size_t off = static_cast<size_t>(r.d0 + j * r.dstride) * des;
    if constexpr (kCopy) std::memcpy(r.dst + off, r.src + off, des);
    if (nonfinite_f32 != nullptr && dd == DType::kF32 && internal::AnyNonFiniteF32(r.src + off, 1)) {
      *nonfinite_f32 = true;
    }
    if ((gi >> 6) != block) {
      block = gi >> 6;
      key = DigestBlockKey(block);
    }
    sum += DigestTermInBlock(key, static_cast<uint32_t>(gi & 63), SourceBits(sd, dd, r.src + off));
  }
  return sum;
}

}  // namespace

Result<TensorDigests> DigestInstalled(const Capture& capture, const DestinationBuffers& buffers,
                                      std::span<const DigestRegion> regions) {
  return SumRegionRuns(capture, &buffers, nullptr, regions, [](const RegionRun& r) { return RunDigest<false>(r); });
}

Result<TensorDigests> DigestInstalledCheckingFinite(const Capture& capture, const DestinationBuffers& buffers,
                                                    std::span<const DigestRegion> regions, bool* any_nonfinite_f32) {
  return SumRegionRuns(capture, &buffers, nullptr, regions,
                       [any_nonfinite_f32](const RegionRun& r) { return RunDigest<false>(r, any_nonfinite_f32); });
}

Result<TensorDigests> CopyAndDigestInstalled(const Capture& capture, const DestinationBuffers& from,
                                             const DestinationBuffers& to, std::span<const DigestRegion> regions) {
  return SumRegionRuns(capture, &to, &from, regions, [](const RegionRun& r) { return RunDigest<true>(r); });
}

Result<UncoveredBytes> BytesOutsideRegions(const Capture& capture, std::span<const DigestRegion> regions) {
  // Byte intervals each region's runs cover, per parameter (geometry only).
  std::map<std::string, std::vector<ByteRange>> covered;
  auto r = SumRegionRuns(capture, nullptr, nullptr, regions, [&](const RegionRun& run) -> uint64_t {
    auto& v = covered[run.param->name];
    const uint64_t es = DTypeSize(run.param->dtype);
    if (run.dstride == 1) {
      const uint64_t b = static_cast<uint64_t>(run.d0) * es, e = b + static_cast<uint64_t>(run.inner) * es;
      if (!v.empty() && v.back().end == b) {
        v.back().end = e;  // runs of one region usually follow each other
      } else {
        v.push_back({b, e});
      }
    } else {
      for (int64_t j = 0; j < run.inner; ++j) {
        const uint64_t b = static_cast<uint64_t>(run.d0 + j * run.dstride) * es;
        v.push_back({b, b + es});
      }
    }
    return 0;
  });
  if (!r.ok()) return r.status();
  UncoveredBytes out;
  for (const TensorSpec& p : capture.params) {
    auto& v = covered[p.name];
    std::sort(v.begin(), v.end(), [](const ByteRange& a, const ByteRange& b) { return a.begin < b.begin; });
    std::vector<ByteRange> rest;
    uint64_t at = 0;
    for (const ByteRange& c : v) {
      if (c.begin > at) rest.push_back({at, c.begin});
      at = std::max(at, c.end);
    }
    if (at < p.bytes()) rest.push_back({at, p.bytes()});
    if (!rest.empty()) out.emplace(p.name, std::move(rest));
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
                                              std::span<const DigestRegion> regions, int threads,
                                              bool* any_nonfinite_f32) {
  if (threads <= 1 || regions.empty()) {
    if (any_nonfinite_f32 == nullptr) return DigestInstalled(capture, buffers, regions);
    return DigestInstalledCheckingFinite(capture, buffers, regions, any_nonfinite_f32);
  }
  int64_t total = 0;
  for (const DigestRegion& r : regions) total += r.box.numel();
  // About 8 pieces per thread so uneven tensors still balance.
  const std::vector<DigestRegion> pieces =
      SplitDigestRegions(regions, std::max<int64_t>(1 << 16, total / (int64_t{threads} * 8)));
  // One result (and one finite flag) per piece, combined in order afterwards.
  std::vector<Result<TensorDigests>> partial(pieces.size(), TensorDigests{});
  std::vector<char> nonfinite(pieces.size(), 0);
  ParallelFor(pieces.size(), threads, [&](size_t i) {
    const std::span<const DigestRegion> one(&pieces[i], 1);
    if (any_nonfinite_f32 == nullptr) {
      partial[i] = DigestInstalled(capture, buffers, one);
    } else {
      bool bad = false;
      partial[i] = DigestInstalledCheckingFinite(capture, buffers, one, &bad);
      nonfinite[i] = bad ? 1 : 0;
    }
  });
  TensorDigests out;
  for (size_t i = 0; i < partial.size(); ++i) {
    if (!partial[i].ok()) return partial[i].status();
    AddDigests(out, *partial[i]);
    if (nonfinite[i] && any_nonfinite_f32 != nullptr) *any_nonfinite_f32 = true;
  }
  return out;
}

Result<TensorDigests> CopyAndDigestInstalledParallel(const Capture& capture, const DestinationBuffers& from,
                                                     const DestinationBuffers& to,
                                                     std::span<const DigestRegion> regions,
                                                     const UncoveredBytes& uncovered, int threads) {
  int64_t total = 0;
  for (const DigestRegion& r : regions) total += r.box.numel();
  const std::vector<DigestRegion> pieces =
      SplitDigestRegions(regions, std::max<int64_t>(1 << 16, total / (int64_t{std::max(1, threads)} * 8)));
  // The bytes no region covers (replicas, tied copies) are copied plainly, in pieces too.
  struct Plain {
    const std::byte* src;
    std::byte* dst;
    uint64_t bytes;
  };
  std::vector<Plain> plain;
  constexpr uint64_t kPlainPiece = uint64_t{4} << 20;
  for (const auto& [name, ranges] : uncovered) {
    auto f = from.find(name);
    auto t = to.find(name);
    if (f == from.end() || t == to.end() || f->second.size() != t->second.size()) {
      return FailedPrecondition(fmt::format("parameter {}: no staged and live buffers of one size", name));
    }
    for (const ByteRange& br : ranges) {
      if (br.end > t->second.size() || br.begin > br.end) {
        return InvalidArgument(fmt::format("parameter {}: uncovered bytes {}..{} outside its {} bytes", name, br.begin,
                                           br.end, t->second.size()));
      }
      for (uint64_t b = br.begin; b < br.end; b += kPlainPiece) {
        plain.push_back({f->second.data() + b, t->second.data() + b, std::min(kPlainPiece, br.end - b)});
      }
    }
  }
  std::vector<Result<TensorDigests>> partial(pieces.size(), TensorDigests{});
  ParallelFor(pieces.size() + plain.size(), threads, [&](size_t i) {
    if (i < pieces.size()) {
      partial[i] = CopyAndDigestInstalled(capture, from, to, std::span<const DigestRegion>(&pieces[i], 1));
    } else {
      const Plain& p = plain[i - pieces.size()];
      std::memcpy(p.dst, p.src, p.bytes);
    }
  });
  TensorDigests out;
  for (auto& p : partial) {
    if (!p.ok()) return p.status();
    AddDigests(out, *p);
  }
  return out;
}

}  // namespace rc::refit
