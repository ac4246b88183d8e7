// View capture: the loader API shared by refit planning and real weight loading.
//
// A loader (layouts.h has the Llama / Qwen loaders) is written once against LoadContext: it asks
// for a source tensor by its HF name, gets a lazy SourceView, applies view operations, and copies
// the view into a region of an engine parameter (DestRegion). Two contexts run the same loader:
//   - CaptureContext records every copy (CapturedCopy) without touching bytes; the planner turns
//     the records into transfers.
//   - MaterializeContext resolves views against source bytes in memory (e.g. safetensors data)
//     and writes destination buffers, converting dtypes where declared.
//
// SourceView records narrow, unit-step slice, select / unbind, chunk, transpose / permute,
// unsqueeze and squeeze, reshape that only adds or removes unit dims, and contiguous() when it is
// a no-op. A view is a box in global source coordinates plus the order in which the view's dims
// walk the source dims. Anything else (arithmetic, a reshape that merges or splits dims,
// integer-array indexing, a contiguous() that would materialize a permuted copy, a non-unit step,
// invalid arguments) marks the view unsupported with the reason; unsupported is sticky, and
// copying an unsupported view marks only that source unsupported in the capture.
//
// Thread safety: SourceView is an immutable value. A context is used by one thread at a time.
// Invariants of SourceView: each source dim appears at most once in view_to_source(); source dims
// that do not appear have box extent 1 (they were selected); box() lies inside the source shape.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "rolloutcore/base/status.h"
#include "rolloutcore/refit/tensor.h"

namespace rc::refit {

class SourceView {
 public:
  SourceView() = default;
  // The whole tensor.
  SourceView(std::string name, DType dtype, const Shape& shape);

  const std::string& name() const { return name_; }
  DType dtype() const { return dtype_; }
  const Shape& source_shape() const { return source_shape_; }
  const Box& box() const { return box_; }
  // Per view dim: the source dim it walks, or -1 for an inserted unit dim.
  const std::vector<int32_t>& view_to_source() const { return view_to_source_; }
  Shape shape() const;
  int64_t dim() const { return static_cast<int64_t>(view_to_source_.size()); }
  int64_t numel() const;
  bool supported() const { return reason_.empty(); }
  const std::string& unsupported_reason() const { return reason_; }

  // Negative dims count from the end, as in PyTorch.
  SourceView Narrow(int64_t dim, int64_t start, int64_t length) const;
  // Python slice semantics for start/stop (negative counts from the end, clamped); step must be 1.
  SourceView Slice(int64_t dim, int64_t start, int64_t stop, int64_t step = 1) const;
  // Removes `dim`, keeping index `index` (what unbind()[index] and x[index] do).
  SourceView Select(int64_t dim, int64_t index) const;
  SourceView Transpose(int64_t dim0, int64_t dim1) const;
  SourceView Permute(const std::vector<int64_t>& order) const;
  // torch.chunk: pieces of ceil(size / chunks); possibly fewer than `chunks` pieces.
  std::vector<SourceView> Chunk(int64_t chunks, int64_t dim) const;
  // The index-th piece of Chunk(chunks, dim) without building the others.
  SourceView ChunkAt(int64_t chunks, int64_t dim, int64_t index) const;
  std::vector<SourceView> Unbind(int64_t dim) const;
  SourceView Unsqueeze(int64_t dim) const;
  // PyTorch semantics: a no-op when the dim's size is not 1.
  SourceView Squeeze(int64_t dim) const;
  // Supported only when it adds or removes unit dims; one extent may be -1.
  SourceView Reshape(const Shape& shape) const;
  // Supported only when the view already walks source dims in order (a no-op).
  SourceView Contiguous() const;
  // Integer-array indexing (x[[i, j, ...]] / index_select): always unsupported.
  SourceView IndexSelect(int64_t dim, const std::vector<int64_t>& indices) const;
  // Any value-changing operation (add, mul, cast, ...): always unsupported.
  SourceView Arithmetic(std::string_view op) const;

 private:
  SourceView Unsupported(std::string reason) const;
  // Normalises a possibly negative dim against `ndim`; -1 when out of range.
  static int64_t NormDim(int64_t dim, int64_t ndim);

  std::string name_;
  DType dtype_ = DType::kF32;
  Shape source_shape_;
  Box box_;
  std::vector<int32_t> view_to_source_;
  std::string reason_;  // empty when supported
};

// Where a view is copied: a region of a destination parameter, in elements of its dtype.
// The region's shape must equal the view's shape; strides may be anything non-negative that keeps
// the region inside the parameter (the coverage gate rejects overlapping writes).
struct DestRegion {
  std::string param;
  int64_t offset = 0;
  Shape shape;
  Shape strides;
  // The loader declares that the parameter's dtype may differ from the source dtype
  // (bf16/f16 <-> f32); without it a dtype mismatch is refused.
  bool convert = false;

  // The whole of a contiguous parameter of this shape.
  static DestRegion Whole(std::string param, const Shape& shape, bool convert = false);
  // Rows [row, row + rows) of a contiguous parameter of shape `param_shape` (dim 0 slab).
  static DestRegion Rows(std::string param, const Shape& param_shape, int64_t row, int64_t rows,
                         bool convert = false);
};

// One recorded copy: a box of a source tensor, walked in view order, into a destination region.
struct CapturedCopy {
  std::string source;
  DType source_dtype = DType::kF32;
  Shape source_shape;
  Box box;
  std::vector<int32_t> view_to_source;
  uint32_t param = 0;  // index into Capture::params
  int64_t dest_offset = 0;
  Shape dest_shape;    // == the view's shape
  Shape dest_strides;  // elements, per view dim
  bool convert = false;
};

// A copy whose view could not be captured.
struct UnsupportedSource {
  std::string source;
  std::string param;
  std::string reason;
};

// Everything one loader run recorded for one destination rank.
struct Capture {
  std::vector<TensorSpec> params;  // destination parameters (name, dtype, shape)
  std::vector<CapturedCopy> copies;
  std::vector<UnsupportedSource> unsupported;
};

// Destination bytes by parameter name.
using DestinationBuffers = std::map<std::string, std::span<std::byte>, std::less<>>;

// The interface loaders are written against.
class LoadContext {
 public:
  virtual ~LoadContext() = default;
  // A lazy view of the whole source tensor `name`. NotFound naming the tensor when unknown.
  [[nodiscard]] virtual Result<SourceView> Source(std::string_view name) = 0;
  // Copies `view` into `dest`. InvalidArgument naming the tensor and parameter when the region
  // does not match the view or the parameter (unknown name, shape, out of bounds).
  [[nodiscard]] virtual Status CopyInto(const SourceView& view, const DestRegion& dest) = 0;
};

// Records copies. Sources and parameters are given up front (the source specs come from the
// model config or a manifest).
class CaptureContext : public LoadContext {
 public:
  CaptureContext(std::vector<TensorSpec> sources, std::vector<TensorSpec> params);
  [[nodiscard]] Result<SourceView> Source(std::string_view name) override;
  [[nodiscard]] Status CopyInto(const SourceView& view, const DestRegion& dest) override;

  const Capture& capture() const { return capture_; }
  Capture Take() { return std::move(capture_); }

 private:
  std::unordered_map<std::string, TensorSpec> sources_;
  std::unordered_map<std::string, uint32_t> param_index_;
  Capture capture_;
};

// A source tensor held in memory: the whole tensor, row-major.
struct HostTensor {
  DType dtype = DType::kF32;
  Shape shape;
  std::span<const std::byte> data;
};

// Resolves views against host tensors and writes destination buffers. `lookup` returns the whole
// source tensor by name (NotFound when absent); `params` lists the destination parameters and
// `buffers` their bytes (each exactly spec.bytes()). Every copy is also recorded, so
// CheckCoverage() can prove afterwards that every parameter byte was written exactly once.
class MaterializeContext : public LoadContext {
 public:
  using Lookup = std::function<Result<HostTensor>(std::string_view name)>;
  MaterializeContext(Lookup lookup, std::vector<TensorSpec> params, DestinationBuffers buffers);
  [[nodiscard]] Result<SourceView> Source(std::string_view name) override;
  [[nodiscard]] Status CopyInto(const SourceView& view, const DestRegion& dest) override;
  [[nodiscard]] Status CheckCoverage() const;
  const Capture& capture() const { return capture_; }

 private:
  Lookup lookup_;
  std::unordered_map<std::string, uint32_t> param_index_;
  DestinationBuffers buffers_;
  Capture capture_;
};

// The destination half of the coverage gate: every byte of every parameter in the capture is
// written exactly once. Errors name the parameter and the element range (with rows for 2-d and
// larger parameters) never written or written twice, and the sources involved.
// InvalidArgument as well when the destination footprint needs more than max_intervals
// contiguous intervals to describe.
[[nodiscard]] Status CheckDestinationCoverage(const Capture& capture,
                                              int64_t max_intervals = int64_t{1} << 24);

// The staging capture of a device receiver (receiver/device_receiver.h): copy i of `live` lands
// densely (row-major, offset 0) in its own parameter "rc.staging.<i>" of the live parameter's
// dtype, so every staging byte is written exactly once. What the vLLM extension allocates, and the
// GPU tests and benchmarks use.
Capture DenseStagingCapture(const Capture& live);

}  // namespace rc::refit
