// Plan specs: arbitrary source layouts and destination views as JSON, for `rolloutcore plan --spec`.
//
//   {"tensors": [{"name": "w", "dtype": "bf16", "shape": [8, 4],
//                 "shards": [{"rank": 0, "offset": [0, 0], "shape": [4, 4]}, ...]}],
//    "targets": [{"name": "w_t", "dtype": "bf16", "shape": [4, 8], "convert": false,
//                 "copies": [{"source": "w", "ops": [["narrow", 0, 0, 8], ["permute", [1, 0]]],
//                             "dest_offset": 0, "dest_shape": [4, 8], "dest_strides": [8, 1]}]}]}
//
// Ops (arguments are integers unless noted): ["narrow", dim, start, length],
// ["slice", dim, start, stop(, step)], ["select", dim, index], ["unbind", dim, index],
// ["transpose", d0, d1], ["permute", [order]], ["chunk", chunks, dim, index], ["unsqueeze", dim],
// ["squeeze", dim], ["reshape", [shape]] (alias "view"), ["contiguous"], ["index", dim, [indices]]
// (integer-array index, always refused), and the arithmetic ops "add", "sub", "mul", "div",
// "scale", "to" (always refused). dest_offset defaults to 0, dest_shape to the view's shape,
// dest_strides to row-major strides of dest_shape; "convert" declares a dtype conversion.
//
// The targets describe one destination rank; replaying them through a LoadContext
// (LoadSpecTargets) is the spec's loader, so capture and reference loading use the same code.
//
// Thread safety: values and pure functions.
// Invariant: a PlanSpec from ParsePlanSpec has unique tensor and target names, valid dtypes and
// shapes (ValidateShape) and well-typed ops; geometry (bounds, overlaps, coverage) is checked by
// the capture and the planner, whose errors name the tensor.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/json.h"
#include "rolloutcore/base/status.h"
#include "rolloutcore/refit/capture.h"
#include "rolloutcore/refit/manifest.h"

namespace rc::refit {

struct ViewOp {
  enum class Kind : uint8_t {
    kNarrow, kSlice, kSelect, kTranspose, kPermute, kChunk, kUnsqueeze, kSqueeze, kReshape,
    kContiguous, kIndex, kArithmetic,
  };
  Kind kind = Kind::kContiguous;
  std::vector<int64_t> args;  // integer arguments in order
  std::vector<int64_t> list;  // the array argument (permute order, reshape shape, indices)
  std::string name;           // the op as written
};

SourceView ApplyViewOp(const SourceView& view, const ViewOp& op);

struct SpecCopy {
  std::string source;
  std::vector<ViewOp> ops;
  int64_t dest_offset = 0;
  std::optional<Shape> dest_shape;
  std::optional<Shape> dest_strides;
};

struct SpecTarget {
  TensorSpec spec;
  bool convert = false;
  std::vector<SpecCopy> copies;
};

struct PlanSpec {
  std::vector<ShardTable> tensors;
  std::vector<SpecTarget> targets;
};

[[nodiscard]] Result<PlanSpec> ParsePlanSpec(const Json& json);
[[nodiscard]] Result<PlanSpec> ParsePlanSpecText(std::string_view text);

std::vector<TensorSpec> SpecSources(const PlanSpec& spec);
std::vector<TensorSpec> SpecParams(const PlanSpec& spec);
Manifest SpecManifest(const PlanSpec& spec);
// The spec's loader.
[[nodiscard]] Status LoadSpecTargets(const PlanSpec& spec, LoadContext& ctx);
[[nodiscard]] Result<Capture> CaptureSpec(const PlanSpec& spec);

}  // namespace rc::refit
