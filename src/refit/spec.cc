#include "rolloutcore/refit/spec.h"

#include <fmt/format.h>

#include <set>

namespace rc::refit {
namespace {

Result<Shape> IntArray(const Json& v, const std::string& path) {
  if (!v.is_array()) return InvalidArgument(fmt::format("{}: expected an array of integers, got {}", path, JsonTypeName(v)));
  if (v.size() > kMaxDims * 1024) return InvalidArgument(fmt::format("{}: array too long", path));
  Shape s;
  s.reserve(v.size());
  for (const auto& e : v) {
    if (e.is_number_unsigned()) {
      if (e.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
        return InvalidArgument(fmt::format("{}: integer out of range", path));
      }
      s.push_back(static_cast<int64_t>(e.get<uint64_t>()));
    } else if (e.is_number_integer()) {
      s.push_back(e.get<int64_t>());
    } else {
      return InvalidArgument(fmt::format("{}: expected an array of integers, found {}", path, JsonTypeName(e)));
    }
  }
  return s;
}

Result<Shape> IntArrayField(const Json& obj, std::string_view key, const std::string& path) {
  auto it = obj.find(key);
  if (it == obj.end()) return InvalidArgument(fmt::format("{}.{}: required field is missing", path, key));
  return IntArray(*it, fmt::format("{}.{}", path, key));
}

struct OpSignature {
  std::string_view name;
  ViewOp::Kind kind;
  int ints_before;  // integer args before the optional list
  bool list;        // takes an array argument after the ints
  int optional_ints;  // extra trailing integers allowed
};

constexpr OpSignature kOps[] = {
    {"narrow", ViewOp::Kind::kNarrow, 3, false, 0},
    {"slice", ViewOp::Kind::kSlice, 3, false, 1},
    {"select", ViewOp::Kind::kSelect, 2, false, 0},
    {"unbind", ViewOp::Kind::kSelect, 2, false, 0},
    {"transpose", ViewOp::Kind::kTranspose, 2, false, 0},
    {"permute", ViewOp::Kind::kPermute, 0, true, 0},
    {"chunk", ViewOp::Kind::kChunk, 3, false, 0},
    {"unsqueeze", ViewOp::Kind::kUnsqueeze, 1, false, 0},
    {"squeeze", ViewOp::Kind::kSqueeze, 1, false, 0},
    {"reshape", ViewOp::Kind::kReshape, 0, true, 0},
    {"view", ViewOp::Kind::kReshape, 0, true, 0},
    {"contiguous", ViewOp::Kind::kContiguous, 0, false, 0},
    {"index", ViewOp::Kind::kIndex, 1, true, 0},
};

Result<ViewOp> ParseOp(const Json& j, const std::string& path) {
  if (!j.is_array() || j.empty() || !j[0].is_string()) {
    return InvalidArgument(fmt::format("{}: expected [\"op\", args...]", path));
  }
  ViewOp op;
  op.name = j[0].get<std::string>();
  for (std::string_view a : {"add", "sub", "mul", "div", "scale", "to"}) {
    if (op.name == a) {
      op.kind = ViewOp::Kind::kArithmetic;
      return op;
    }
  }
  const OpSignature* sig = nullptr;
  for (const auto& s : kOps) {
    if (s.name == op.name) sig = &s;
  }
  if (sig == nullptr) return InvalidArgument(fmt::format("{}: unknown op '{}'", path, op.name));
  op.kind = sig->kind;
  const size_t want_min = 1 + static_cast<size_t>(sig->ints_before) + (sig->list ? 1 : 0);
  const size_t want_max = want_min + static_cast<size_t>(sig->optional_ints);
  if (j.size() < want_min || j.size() > want_max) {
    return InvalidArgument(fmt::format("{}: '{}' takes {} argument(s), got {}", path, op.name, want_min - 1, j.size() - 1));
  }
  size_t i = 1;
  for (; i < j.size(); ++i) {
    if (sig->list && i == 1 + static_cast<size_t>(sig->ints_before)) {
      RC_ASSIGN_OR_RETURN(op.list, IntArray(j[i], fmt::format("{}[{}]", path, i)));
      continue;
    }
    if (!j[i].is_number_integer()) {
      return InvalidArgument(fmt::format("{}: argument {} of '{}' must be an integer", path, i, op.name));
    }
    if (j[i].is_number_unsigned() && j[i].get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      return InvalidArgument(fmt::format("{}: argument {} of '{}' is out of range", path, i, op.name));
    }
    op.args.push_back(j[i].get<int64_t>());
  }
  return op;
}

}  // namespace

SourceView ApplyViewOp(const SourceView& v, const ViewOp& op) {
  const auto& a = op.args;
  switch (op.kind) {
    case ViewOp::Kind::kNarrow: return v.Narrow(a[0], a[1], a[2]);
    case ViewOp::Kind::kSlice: return v.Slice(a[0], a[1], a[2], a.size() > 3 ? a[3] : 1);
    case ViewOp::Kind::kSelect: return v.Select(a[0], a[1]);
    case ViewOp::Kind::kTranspose: return v.Transpose(a[0], a[1]);
    case ViewOp::Kind::kPermute: return v.Permute(op.list);
    case ViewOp::Kind::kChunk: return v.ChunkAt(a[0], a[1], a[2]);
    case ViewOp::Kind::kUnsqueeze: return v.Unsqueeze(a[0]);
    case ViewOp::Kind::kSqueeze: return v.Squeeze(a[0]);
    case ViewOp::Kind::kReshape: return v.Reshape(op.list);
    case ViewOp::Kind::kContiguous: return v.Contiguous();
    case ViewOp::Kind::kIndex: return v.IndexSelect(a[0], op.list);
    case ViewOp::Kind::kArithmetic: return v.Arithmetic(op.name);
  }
  return v;
}

Result<PlanSpec> ParsePlanSpec(const Json& j) {
  RC_RETURN_IF_ERROR(CheckKnownKeys(j, {"tensors", "targets"}, "spec"));
  PlanSpec spec;
  auto tensors = j.find("tensors");
  if (tensors == j.end() || !tensors->is_array()) return InvalidArgument("spec.tensors: expected an array");
  std::set<std::string, std::less<>> names;
  for (size_t i = 0; i < tensors->size(); ++i) {
    const Json& tj = (*tensors)[i];
    std::string path = fmt::format("tensors[{}]", i);
    RC_RETURN_IF_ERROR(CheckKnownKeys(tj, {"name", "dtype", "shape", "shards"}, path));
    ShardTable t;
    RC_ASSIGN_OR_RETURN(t.name, GetString(tj, "name", path));
    if (t.name.empty()) return InvalidArgument(path + ".name: must not be empty");
    path = fmt::format("tensor {}", t.name);
    if (!names.insert(t.name).second) return InvalidArgument(path + ": listed twice");
    RC_ASSIGN_OR_RETURN(std::string dtype, GetString(tj, "dtype", path));
    auto d = ParseDType(dtype);
    if (!d.ok()) return d.status().WithContext(path);
    t.dtype = *d;
    RC_ASSIGN_OR_RETURN(t.shape, IntArrayField(tj, "shape", path));
    RC_RETURN_IF_ERROR(ValidateShape(t.shape, path));
    auto shards = tj.find("shards");
    if (shards == tj.end() || !shards->is_array()) return InvalidArgument(path + ".shards: expected an array");
    for (size_t k = 0; k < shards->size(); ++k) {
      const Json& sj = (*shards)[k];
      const std::string spath = fmt::format("{} shards[{}]", path, k);
      RC_RETURN_IF_ERROR(CheckKnownKeys(sj, {"rank", "offset", "shape"}, spath));
      ShardInfo s;
      RC_ASSIGN_OR_RETURN(int64_t rank, GetNonNegativeInt(sj, "rank", spath));
      if (rank > INT32_MAX) return InvalidArgument(spath + ".rank: out of range");
      s.rank = static_cast<int32_t>(rank);
      RC_ASSIGN_OR_RETURN(s.offset, IntArrayField(sj, "offset", spath));
      RC_ASSIGN_OR_RETURN(s.shape, IntArrayField(sj, "shape", spath));
      t.shards.push_back(std::move(s));
    }
    spec.tensors.push_back(std::move(t));
  }
  auto targets = j.find("targets");
  if (targets == j.end() || !targets->is_array()) return InvalidArgument("spec.targets: expected an array");
  std::set<std::string, std::less<>> target_names;
  for (size_t i = 0; i < targets->size(); ++i) {
    const Json& tj = (*targets)[i];
    std::string path = fmt::format("targets[{}]", i);
    RC_RETURN_IF_ERROR(CheckKnownKeys(tj, {"name", "dtype", "shape", "convert", "copies"}, path));
    SpecTarget t;
    RC_ASSIGN_OR_RETURN(t.spec.name, GetString(tj, "name", path));
    if (t.spec.name.empty()) return InvalidArgument(path + ".name: must not be empty");
    path = fmt::format("target {}", t.spec.name);
    if (!target_names.insert(t.spec.name).second) return InvalidArgument(path + ": listed twice");
    RC_ASSIGN_OR_RETURN(std::string dtype, GetString(tj, "dtype", path));
    auto d = ParseDType(dtype);
    if (!d.ok()) return d.status().WithContext(path);
    t.spec.dtype = *d;
    RC_ASSIGN_OR_RETURN(t.spec.shape, IntArrayField(tj, "shape", path));
    RC_RETURN_IF_ERROR(ValidateShape(t.spec.shape, path));
    RC_ASSIGN_OR_RETURN(t.convert, GetBool(tj, "convert", path, false));
    auto copies = tj.find("copies");
    if (copies == tj.end() || !copies->is_array()) return InvalidArgument(path + ".copies: expected an array");
    for (size_t k = 0; k < copies->size(); ++k) {
      const Json& cj = (*copies)[k];
      const std::string cpath = fmt::format("{} copies[{}]", path, k);
      RC_RETURN_IF_ERROR(CheckKnownKeys(cj, {"source", "ops", "dest_offset", "dest_shape", "dest_strides"}, cpath));
      SpecCopy c;
      RC_ASSIGN_OR_RETURN(c.source, GetString(cj, "source", cpath));
      RC_ASSIGN_OR_RETURN(c.dest_offset, GetNonNegativeInt(cj, "dest_offset", cpath, 0));
      if (auto it = cj.find("dest_shape"); it != cj.end()) {
        RC_ASSIGN_OR_RETURN(Shape s, IntArray(*it, cpath + ".dest_shape"));
        RC_RETURN_IF_ERROR(ValidateShape(s, cpath + ".dest_shape"));
        c.dest_shape = std::move(s);
      }
      if (auto it = cj.find("dest_strides"); it != cj.end()) {
        RC_ASSIGN_OR_RETURN(Shape s, IntArray(*it, cpath + ".dest_strides"));
        if (s.size() > kMaxDims) return InvalidArgument(cpath + ".dest_strides: too many dims");
        c.dest_strides = std::move(s);
      }
      if (auto it = cj.find("ops"); it != cj.end()) {
        if (!it->is_array()) return InvalidArgument(cpath + ".ops: expected an array");
        for (size_t o = 0; o < it->size(); ++o) {
          RC_ASSIGN_OR_RETURN(ViewOp op, ParseOp((*it)[o], fmt::format("{} ops[{}]", cpath, o)));
          c.ops.push_back(std::move(op));
        }
      }
      t.copies.push_back(std::move(c));
    }
    spec.targets.push_back(std::move(t));
  }
  return spec;
}

Result<PlanSpec> ParsePlanSpecText(std::string_view text) {
  RC_ASSIGN_OR_RETURN(Json j, ParseJson(text, "plan spec"));
  return ParsePlanSpec(j);
}

std::vector<TensorSpec> SpecSources(const PlanSpec& spec) {
  std::vector<TensorSpec> out;
  for (const auto& t : spec.tensors) out.push_back(t.spec());
  return out;
}

std::vector<TensorSpec> SpecParams(const PlanSpec& spec) {
  std::vector<TensorSpec> out;
  for (const auto& t : spec.targets) out.push_back(t.spec);
  return out;
}

Manifest SpecManifest(const PlanSpec& spec) {
  Manifest m;
  m.model = "spec";
  m.tables = spec.tensors;
  int32_t ranks = 0;
  for (const auto& t : spec.tensors) {
    for (const auto& s : t.shards) ranks = std::max(ranks, s.rank + 1);
  }
  m.expected_ranks = ranks;
  return m;
}

Status LoadSpecTargets(const PlanSpec& spec, LoadContext& ctx) {
  for (const SpecTarget& t : spec.targets) {
    for (size_t k = 0; k < t.copies.size(); ++k) {
      const SpecCopy& c = t.copies[k];
      auto src = ctx.Source(c.source);
      if (!src.ok()) return src.status().WithContext(fmt::format("target {} copies[{}]", t.spec.name, k));
      SourceView v = *src;
      for (const ViewOp& op : c.ops) v = ApplyViewOp(v, op);
      DestRegion dest;
      dest.param = t.spec.name;
      dest.offset = c.dest_offset;
      dest.shape = c.dest_shape ? *c.dest_shape : v.shape();
      dest.strides = c.dest_strides ? *c.dest_strides : RowMajorStrides(dest.shape);
      dest.convert = t.convert;
      RC_RETURN_IF_ERROR(ctx.CopyInto(v, dest));
    }
  }
  return OkStatus();
}

Result<Capture> CaptureSpec(const PlanSpec& spec) {
  CaptureContext ctx(SpecSources(spec), SpecParams(spec));
  RC_RETURN_IF_ERROR(LoadSpecTargets(spec, ctx));
  return ctx.Take();
}

}  // namespace rc::refit
