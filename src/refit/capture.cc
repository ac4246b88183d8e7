#include "rolloutcore/refit/capture.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>

#include "refit/geometry.h"

namespace rc::refit {
namespace {

std::string ListPreview(const std::vector<int64_t>& v) {
  constexpr size_t kMax = 8;
  std::vector<int64_t> head(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(std::min(v.size(), kMax)));
  return fmt::format("[{}{}]", fmt::join(head, ", "), v.size() > kMax ? ", ..." : "");
}

}  // namespace

// ---- SourceView ---------------------------------------------------------------------------------

SourceView::SourceView(std::string name, DType dtype, const Shape& shape)
    : name_(std::move(name)), dtype_(dtype), source_shape_(shape), box_(FullBox(shape)) {
  view_to_source_.resize(shape.size());
  std::iota(view_to_source_.begin(), view_to_source_.end(), 0);
}

Shape SourceView::shape() const { return internal::ViewShape(box_, view_to_source_); }

int64_t SourceView::numel() const { return box_.numel(); }

int64_t SourceView::NormDim(int64_t dim, int64_t ndim) {
  if (dim < 0) dim += ndim;
  return (dim >= 0 && dim < ndim) ? dim : -1;
}

SourceView SourceView::Unsupported(std::string reason) const {
  SourceView v = *this;
  v.reason_ = std::move(reason);
  return v;
}

SourceView SourceView::Narrow(int64_t dim, int64_t start, int64_t length) const {
  if (!supported()) return *this;
  const int64_t d = NormDim(dim, this->dim());
  if (d < 0) return Unsupported(fmt::format("narrow: dim {} out of range for a {}-d view", dim, this->dim()));
  const size_t k = static_cast<size_t>(d);
  const int32_t s = view_to_source_[k];
  const int64_t size = s < 0 ? 1 : box_.extent[static_cast<size_t>(s)];
  if (start < 0 && start >= -size) start += size;
  if (start < 0 || length < 0 || start > size || length > size - start) {
    return Unsupported(fmt::format("narrow: start {} length {} out of range for dim {} of size {}", start,
                                   length, d, size));
  }
  if (s < 0) {
    if (length != 1) return Unsupported(fmt::format("narrow: empty narrow of inserted unit dim {}", d));
    return *this;
  }
  SourceView v = *this;
  v.box_.start[static_cast<size_t>(s)] += start;
  v.box_.extent[static_cast<size_t>(s)] = length;
  return v;
}

SourceView SourceView::Slice(int64_t dim, int64_t start, int64_t stop, int64_t step) const {
  if (!supported()) return *this;
  const int64_t d = NormDim(dim, this->dim());
  if (d < 0) return Unsupported(fmt::format("slice: dim {} out of range for a {}-d view", dim, this->dim()));
  if (step != 1) {
    return Unsupported(fmt::format("slice with step {} along dim {} is not a box (only unit steps)", step, d));
  }
  const int64_t size = shape()[static_cast<size_t>(d)];
  auto clamp = [size](int64_t i) {
    if (i < 0) i = (i < -size) ? 0 : i + size;
    return std::min(i, size);
  };
  const int64_t lo = clamp(start);
  const int64_t hi = std::max(lo, clamp(stop));
  return Narrow(d, lo, hi - lo);
}

SourceView SourceView::Select(int64_t dim, int64_t index) const {
  if (!supported()) return *this;
  const int64_t d = NormDim(dim, this->dim());
  if (d < 0) return Unsupported(fmt::format("select: dim {} out of range for a {}-d view", dim, this->dim()));
  const size_t k = static_cast<size_t>(d);
  const int32_t s = view_to_source_[k];
  const int64_t size = s < 0 ? 1 : box_.extent[static_cast<size_t>(s)];
  if (index < 0 && index >= -size) index += size;
  if (index < 0 || index >= size) {
    return Unsupported(fmt::format("select: index {} out of range for dim {} of size {}", index, d, size));
  }
  SourceView v = *this;
  if (s >= 0) {
    v.box_.start[static_cast<size_t>(s)] += index;
    v.box_.extent[static_cast<size_t>(s)] = 1;
  }
  v.view_to_source_.erase(v.view_to_source_.begin() + d);
  return v;
}

SourceView SourceView::Transpose(int64_t dim0, int64_t dim1) const {
  if (!supported()) return *this;
  const int64_t a = NormDim(dim0, dim());
  const int64_t b = NormDim(dim1, dim());
  if (a < 0 || b < 0) {
    return Unsupported(fmt::format("transpose: dims {}, {} out of range for a {}-d view", dim0, dim1, dim()));
  }
  SourceView v = *this;
  std::swap(v.view_to_source_[static_cast<size_t>(a)], v.view_to_source_[static_cast<size_t>(b)]);
  return v;
}

SourceView SourceView::Permute(const std::vector<int64_t>& order) const {
  if (!supported()) return *this;
  if (static_cast<int64_t>(order.size()) != dim()) {
    return Unsupported(fmt::format("permute: order {} has {} entries for a {}-d view", ListPreview(order),
                                   order.size(), dim()));
  }
  std::vector<bool> seen(order.size(), false);
  SourceView v = *this;
  for (size_t k = 0; k < order.size(); ++k) {
    const int64_t d = NormDim(order[k], dim());
    if (d < 0 || seen[static_cast<size_t>(d)]) {
      return Unsupported(fmt::format("permute: order {} is not a permutation of {} dims", ListPreview(order), dim()));
    }
    seen[static_cast<size_t>(d)] = true;
    v.view_to_source_[k] = view_to_source_[static_cast<size_t>(d)];
  }
  return v;
}

SourceView SourceView::ChunkAt(int64_t chunks, int64_t dim, int64_t index) const {
  if (!supported()) return *this;
  const int64_t d = NormDim(dim, this->dim());
  if (d < 0) return Unsupported(fmt::format("chunk: dim {} out of range for a {}-d view", dim, this->dim()));
  if (chunks <= 0) return Unsupported(fmt::format("chunk: {} chunks (must be positive)", chunks));
  const int64_t size = shape()[static_cast<size_t>(d)];
  const int64_t piece = size == 0 ? 0 : (size - 1) / chunks + 1;
  const int64_t count = size == 0 ? 1 : (size - 1) / piece + 1;
  if (index < 0 || index >= count) {
    return Unsupported(fmt::format("chunk: piece {} of {} does not exist (dim {} of size {} gives {} pieces)",
                                   index, chunks, d, size, count));
  }
  const int64_t start = index * piece;
  return Narrow(d, start, std::min(piece, size - start));
}

std::vector<SourceView> SourceView::Chunk(int64_t chunks, int64_t dim) const {
  if (!supported()) return {*this};
  const int64_t d = NormDim(dim, this->dim());
  if (d < 0 || chunks <= 0) return {ChunkAt(chunks, dim, 0)};
  const int64_t size = shape()[static_cast<size_t>(d)];
  const int64_t piece = size == 0 ? 0 : (size - 1) / chunks + 1;
  const int64_t count = size == 0 ? 1 : (size - 1) / piece + 1;
  std::vector<SourceView> out;
  out.reserve(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) out.push_back(ChunkAt(chunks, d, i));
  return out;
}

std::vector<SourceView> SourceView::Unbind(int64_t dim) const {
  if (!supported()) return {*this};
  const int64_t d = NormDim(dim, this->dim());
  if (d < 0) return {Select(dim, 0)};
  const int64_t size = shape()[static_cast<size_t>(d)];
  std::vector<SourceView> out;
  out.reserve(static_cast<size_t>(size));
  for (int64_t i = 0; i < size; ++i) out.push_back(Select(d, i));
  return out;
}

SourceView SourceView::Unsqueeze(int64_t dim) const {
  if (!supported()) return *this;
  const int64_t d = NormDim(dim, this->dim() + 1);
  if (d < 0) return Unsupported(fmt::format("unsqueeze: dim {} out of range for a {}-d view", dim, this->dim()));
  if (static_cast<size_t>(this->dim()) >= kMaxDims) return Unsupported("unsqueeze: too many dims");
  SourceView v = *this;
  v.view_to_source_.insert(v.view_to_source_.begin() + d, -1);
  return v;
}

SourceView SourceView::Squeeze(int64_t dim) const {
  if (!supported()) return *this;
  const int64_t d = NormDim(dim, this->dim());
  if (d < 0) return Unsupported(fmt::format("squeeze: dim {} out of range for a {}-d view", dim, this->dim()));
  if (shape()[static_cast<size_t>(d)] != 1) return *this;
  SourceView v = *this;
  v.view_to_source_.erase(v.view_to_source_.begin() + d);
  return v;
}

SourceView SourceView::Reshape(const Shape& target) const {
  if (!supported()) return *this;
  const Shape cur = shape();
  Shape resolved = target;
  int64_t infer = -1;
  int64_t known = 1;
  for (size_t i = 0; i < target.size(); ++i) {
    if (target[i] == -1 && infer < 0) {
      infer = static_cast<int64_t>(i);
      continue;
    }
    if (target[i] < 0 || (target[i] != 0 && known > kMaxElements / target[i])) {
      return Unsupported(fmt::format("reshape: invalid shape {}", ShapeToString(target)));
    }
    known *= target[i];
  }
  const int64_t n = NumElements(cur);
  if (infer >= 0) {
    if (known == 0 || n % known != 0) {
      return Unsupported(fmt::format("reshape: cannot infer -1 in {} for {} elements", ShapeToString(target), n));
    }
    resolved[static_cast<size_t>(infer)] = n / known;
    known = n;
  }
  if (known != n || resolved.size() > kMaxDims) {
    return Unsupported(fmt::format("reshape: {} elements do not fit shape {}", n, ShapeToString(target)));
  }
  std::vector<int64_t> old_sizes, new_sizes;
  std::vector<int32_t> old_src;
  for (size_t k = 0; k < cur.size(); ++k) {
    if (cur[k] != 1) {
      old_sizes.push_back(cur[k]);
      old_src.push_back(view_to_source_[k]);
    }
  }
  for (int64_t s : resolved) {
    if (s != 1) new_sizes.push_back(s);
  }
  if (old_sizes != new_sizes) {
    const char* what = new_sizes.size() < old_sizes.size()   ? "merges dimensions"
                       : new_sizes.size() > old_sizes.size() ? "splits dimensions"
                                                             : "regroups dimensions";
    return Unsupported(fmt::format("reshape {} -> {} {}; only unit dims may be added or removed",
                                   ShapeToString(cur), ShapeToString(resolved), what));
  }
  SourceView v = *this;
  v.view_to_source_.clear();
  size_t j = 0;
  for (int64_t s : resolved) v.view_to_source_.push_back(s == 1 ? -1 : old_src[j++]);
  return v;
}

SourceView SourceView::Contiguous() const {
  if (!supported()) return *this;
  int32_t last = -1;
  for (int32_t s : view_to_source_) {
    if (s < 0) continue;
    if (s < last) {
      return Unsupported("contiguous() of a transposed or permuted view materializes a copy");
    }
    last = s;
  }
  return *this;
}

SourceView SourceView::IndexSelect(int64_t dim, const std::vector<int64_t>& indices) const {
  if (!supported()) return *this;
  return Unsupported(fmt::format(
      "integer-index collapse: indexing dim {} with {} ({} indices) gathers elements into a new "
      "dim; not a box view",
      dim, ListPreview(indices), indices.size()));
}

SourceView SourceView::Arithmetic(std::string_view op) const {
  if (!supported()) return *this;
  return Unsupported(fmt::format("arithmetic '{}' changes values; only views can be captured", op));
}

// ---- DestRegion ---------------------------------------------------------------------------------

DestRegion DestRegion::Whole(std::string param, const Shape& shape, bool convert) {
  return DestRegion{std::move(param), 0, shape, RowMajorStrides(shape), convert};
}

DestRegion DestRegion::Rows(std::string param, const Shape& param_shape, int64_t row, int64_t rows,
                            bool convert) {
  Shape shape = param_shape;
  shape[0] = rows;
  const Shape strides = RowMajorStrides(param_shape);
  return DestRegion{std::move(param), row * strides[0], shape, strides, convert};
}

// ---- Contexts -----------------------------------------------------------------------------------

namespace {

using ParamIndex = std::unordered_map<std::string, uint32_t>;

ParamIndex IndexParams(const std::vector<TensorSpec>& params) {
  ParamIndex index;
  for (uint32_t i = 0; i < params.size(); ++i) index.emplace(params[i].name, i);
  return index;
}

// Checks that `dest` (shape, strides, offset) lies inside parameter `p`.
Status CheckRegionBounds(const std::string& source, const DestRegion& dest, const TensorSpec& p) {
  if (dest.strides.size() != dest.shape.size()) {
    return InvalidArgument(fmt::format("tensor {} -> {}: destination strides {} do not match shape {}", source,
                                       dest.param, ShapeToString(dest.strides), ShapeToString(dest.shape)));
  }
  int64_t last = dest.offset;
  bool empty = false;
  for (size_t k = 0; k < dest.shape.size(); ++k) {
    if (dest.strides[k] < 0 || dest.shape[k] < 0) {
      return InvalidArgument(fmt::format("tensor {} -> {}: negative destination stride or extent in {} / {}",
                                         source, dest.param, ShapeToString(dest.shape),
                                         ShapeToString(dest.strides)));
    }
    if (dest.shape[k] == 0) empty = true;
    if (!empty && !internal::MulAdd(dest.shape[k] - 1, dest.strides[k], last, &last)) {
      return InvalidArgument(fmt::format("tensor {} -> {}: destination strides {} overflow", source, dest.param,
                                         ShapeToString(dest.strides)));
    }
  }
  if (dest.offset < 0 || (!empty && last >= p.numel())) {
    return InvalidArgument(fmt::format(
        "tensor {} -> {}: destination region at offset {} shape {} strides {} reaches element {} of a "
        "parameter with {} elements",
        source, dest.param, dest.offset, ShapeToString(dest.shape), ShapeToString(dest.strides), last, p.numel()));
  }
  return OkStatus();
}

Result<CapturedCopy> MakeCopy(const SourceView& view, const DestRegion& dest, const ParamIndex& index,
                              const std::vector<TensorSpec>& params) {
  auto it = index.find(dest.param);
  if (it == index.end()) {
    return InvalidArgument(fmt::format("tensor {}: destination parameter {} is unknown", view.name(), dest.param));
  }
  const TensorSpec& p = params[it->second];
  const Shape vshape = view.shape();
  if (dest.shape != vshape) {
    return InvalidArgument(fmt::format("tensor {} -> {}: view shape {} does not match destination shape {}",
                                       view.name(), dest.param, ShapeToString(vshape), ShapeToString(dest.shape)));
  }
  RC_RETURN_IF_ERROR(CheckRegionBounds(view.name(), dest, p));
  CapturedCopy c;
  c.source = view.name();
  c.source_dtype = view.dtype();
  c.source_shape = view.source_shape();
  c.box = view.box();
  c.view_to_source = view.view_to_source();
  c.param = it->second;
  c.dest_offset = dest.offset;
  c.dest_shape = dest.shape;
  c.dest_strides = dest.strides;
  c.convert = dest.convert;
  return c;
}

Status RecordUnsupported(const SourceView& view, const DestRegion& dest, const ParamIndex& index,
                         Capture* capture) {
  if (!index.count(dest.param)) {
    return InvalidArgument(fmt::format("tensor {}: destination parameter {} is unknown", view.name(), dest.param));
  }
  capture->unsupported.push_back({view.name(), dest.param, view.unsupported_reason()});
  return OkStatus();
}

}  // namespace

CaptureContext::CaptureContext(std::vector<TensorSpec> sources, std::vector<TensorSpec> params) {
  for (auto& s : sources) {
    std::string name = s.name;
    sources_.emplace(std::move(name), std::move(s));
  }
  param_index_ = IndexParams(params);
  capture_.params = std::move(params);
}

Result<SourceView> CaptureContext::Source(std::string_view name) {
  auto it = sources_.find(std::string(name));
  if (it == sources_.end()) return NotFound(fmt::format("source tensor {} is not known", name));
  return SourceView(it->second.name, it->second.dtype, it->second.shape);
}

Status CaptureContext::CopyInto(const SourceView& view, const DestRegion& dest) {
  if (!view.supported()) return RecordUnsupported(view, dest, param_index_, &capture_);
  RC_ASSIGN_OR_RETURN(CapturedCopy c, MakeCopy(view, dest, param_index_, capture_.params));
  capture_.copies.push_back(std::move(c));
  return OkStatus();
}

MaterializeContext::MaterializeContext(Lookup lookup, std::vector<TensorSpec> params, DestinationBuffers buffers)
    : lookup_(std::move(lookup)), buffers_(std::move(buffers)) {
  param_index_ = IndexParams(params);
  capture_.params = std::move(params);
}

Result<SourceView> MaterializeContext::Source(std::string_view name) {
  RC_ASSIGN_OR_RETURN(HostTensor t, lookup_(name));
  RC_RETURN_IF_ERROR(ValidateShape(t.shape, fmt::format("tensor {}", name)));
  if (t.data.size() != static_cast<uint64_t>(NumElements(t.shape)) * DTypeSize(t.dtype)) {
    return InvalidArgument(fmt::format("tensor {}: {} bytes given for shape {} of {}", name, t.data.size(),
                                       ShapeToString(t.shape), DTypeName(t.dtype)));
  }
  return SourceView(std::string(name), t.dtype, t.shape);
}

Status MaterializeContext::CopyInto(const SourceView& view, const DestRegion& dest) {
  if (!view.supported()) {
    return Unimplemented(fmt::format("tensor {} -> {}: unsupported view: {}", view.name(), dest.param,
                                     view.unsupported_reason()));
  }
  RC_ASSIGN_OR_RETURN(CapturedCopy c, MakeCopy(view, dest, param_index_, capture_.params));
  const TensorSpec& p = capture_.params[c.param];
  RC_RETURN_IF_ERROR(CheckConversion(view.name(), view.dtype(), p.dtype, dest.convert));
  RC_ASSIGN_OR_RETURN(HostTensor t, lookup_(view.name()));
  if (t.dtype != view.dtype() || t.shape != view.source_shape() ||
      t.data.size() != static_cast<uint64_t>(NumElements(t.shape)) * DTypeSize(t.dtype)) {
    return FailedPrecondition(fmt::format("tensor {}: source changed between Source() and CopyInto()", view.name()));
  }
  auto buf = buffers_.find(p.name);
  if (buf == buffers_.end() || buf->second.size() != p.bytes()) {
    return FailedPrecondition(fmt::format("destination {}: no buffer of {} bytes given", p.name, p.bytes()));
  }
  internal::CopyViewFromBlock(t.dtype, t.data.data(), FullBox(t.shape), c.box, c.view_to_source, p.dtype,
                              buf->second.data(), c.dest_offset, c.dest_strides);
  capture_.copies.push_back(std::move(c));
  return OkStatus();
}

Status MaterializeContext::CheckCoverage() const { return CheckDestinationCoverage(capture_); }

// ---- Destination coverage -----------------------------------------------------------------------

namespace {

struct Interval {
  int64_t start;
  int64_t end;
  uint32_t copy;
};

std::string DescribeElements(const TensorSpec& p, int64_t lo, int64_t hi) {
  std::string s = fmt::format("elements {}..{}", lo, hi);
  if (p.shape.size() >= 2 && p.shape[0] > 0) {
    const int64_t row = p.numel() / p.shape[0];
    if (row > 0) s += fmt::format(" (rows {}..{})", lo / row, (hi + row - 1) / row);
  }
  return s;
}

}  // namespace

Capture DenseStagingCapture(const Capture& live) {
  Capture s;
  for (size_t i = 0; i < live.copies.size(); ++i) {
    const CapturedCopy& c = live.copies[i];
    s.params.push_back({"rc.staging." + std::to_string(i), live.params[c.param].dtype, c.dest_shape});
    CapturedCopy sc = c;
    sc.param = static_cast<uint32_t>(i);
    sc.dest_offset = 0;
    sc.dest_strides = RowMajorStrides(c.dest_shape);
    s.copies.push_back(std::move(sc));
  }
  return s;
}

Status CheckDestinationCoverage(const Capture& capture, int64_t max_intervals) {
  std::vector<std::vector<Interval>> per_param(capture.params.size());
  int64_t total = 0;
  for (uint32_t ci = 0; ci < capture.copies.size(); ++ci) {
    const CapturedCopy& c = capture.copies[ci];
    std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of non-unit dims
    bool empty = false;
    for (size_t k = 0; k < c.dest_shape.size(); ++k) {
      if (c.dest_shape[k] == 0) empty = true;
      if (c.dest_shape[k] > 1) dims.emplace_back(c.dest_strides[k], c.dest_shape[k]);
    }
    if (empty) continue;
    std::sort(dims.begin(), dims.end());
    int64_t inner = 1;
    size_t i = 0;
    if (!dims.empty() && dims[0].first == 1) {
      inner = dims[0].second;
      i = 1;
      while (i < dims.size() && dims[i].first == inner) inner *= dims[i++].second;
    }
    std::vector<int64_t> sizes;
    std::vector<std::array<int64_t, 1>> strides;
    int64_t count = 1;
    for (size_t k = i; k < dims.size(); ++k) {
      sizes.push_back(dims[k].second);
      strides.push_back({dims[k].first});
      count *= dims[k].second;  // bounded by the view's element count
    }
    total += count;
    if (total > max_intervals) {
      return InvalidArgument(fmt::format(
          "destination {}: the copies need more than {} contiguous intervals to describe (copy of {} with "
          "strides {})",
          capture.params[c.param].name, max_intervals, c.source, ShapeToString(c.dest_strides)));
    }
    auto& out = per_param[c.param];
    // Reverse the stride order so ForEachIndex walks outer (large stride) dims first.
    std::reverse(sizes.begin(), sizes.end());
    std::reverse(strides.begin(), strides.end());
    internal::ForEachIndex<1>(sizes, strides, {c.dest_offset}, [&](const std::array<int64_t, 1>& off) {
      out.push_back({off[0], off[0] + inner, ci});
    });
  }
  // A parameter fed by an unsupported view has a hole where that view would have gone; the
  // planner reports the unsupported source itself when it is selected, so only overlaps are
  // checked there.
  std::unordered_map<std::string_view, const UnsupportedSource*> unsupported;
  for (const auto& u : capture.unsupported) unsupported.emplace(u.param, &u);
  for (size_t pi = 0; pi < capture.params.size(); ++pi) {
    const TensorSpec& p = capture.params[pi];
    const bool partial = unsupported.count(p.name) > 0;
    auto& iv = per_param[pi];
    std::sort(iv.begin(), iv.end(), [](const Interval& a, const Interval& b) {
      return a.start != b.start ? a.start < b.start : a.end < b.end;
    });
    int64_t cursor = 0;
    uint32_t last_copy = 0;
    for (const Interval& x : iv) {
      if (x.start < cursor) {
        return InvalidArgument(fmt::format("destination {}: {} written more than once (by copies of {} and {})",
                                           p.name, DescribeElements(p, x.start, std::min(cursor, x.end)),
                                           capture.copies[last_copy].source, capture.copies[x.copy].source));
      }
      if (x.start > cursor && !partial) {
        return InvalidArgument(
            fmt::format("destination {}: {} never written", p.name, DescribeElements(p, cursor, x.start)));
      }
      cursor = x.end;
      last_copy = x.copy;
    }
    if (cursor < p.numel() && !partial) {
      return InvalidArgument(
          fmt::format("destination {}: {} never written", p.name, DescribeElements(p, cursor, p.numel())));
    }
  }
  return OkStatus();
}

}  // namespace rc::refit
