#include "rolloutcore/refit/planner.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <unordered_map>

#include "refit/geometry.h"
#include "refit/shard_index.h"

namespace rc::refit {

// ---- Selector -----------------------------------------------------------------------------------

namespace {

// The integer that follows `marker` in `name`, if any.
std::optional<int64_t> NumberAfter(std::string_view name, std::string_view marker) {
  const size_t pos = name.find(marker);
  if (pos == std::string_view::npos) return std::nullopt;
  const char* begin = name.data() + pos + marker.size();
  const char* end = name.data() + name.size();
  int64_t v = 0;
  auto [ptr, ec] = std::from_chars(begin, end, v);
  if (ec != std::errc() || ptr == begin) return std::nullopt;
  return v;
}

}  // namespace

bool Selector::Matches(std::string_view name) const {
  if (name_filter && !name_filter(name)) return false;
  if (layers) {
    const auto layer = NumberAfter(name, "layers.");
    if (!layer || *layer < layers->first || *layer > layers->second) return false;
  }
  if (!experts.empty()) {
    const auto expert = NumberAfter(name, "experts.");
    if (!expert || std::find(experts.begin(), experts.end(), *expert) == experts.end()) return false;
  }
  return true;
}

// ---- Planning -----------------------------------------------------------------------------------

namespace {

struct TensorIndex {
  bool built = false;
  internal::ShardIndex shards;
  std::vector<uint64_t> next_replica;  // per box: rotating replica cursor
  std::vector<uint32_t> source_id;      // per shard: index into plan.sources, or kNone
  uint32_t plan_tensor = UINT32_MAX;    // index into plan.tensors
  bool dim0_partition = false;
  int64_t row_elems = 0;  // elements per dim-0 row
};
constexpr uint32_t kNone = UINT32_MAX;

// Runs of one intersection: `inner` contiguous elements at each index of the outer dims.
struct RunShape {
  int64_t inner = 1;
  int64_t count = 1;
  std::vector<int64_t> sizes;
  std::vector<std::array<int64_t, 2>> strides;  // {source, dest} element strides
};

// Coalesces trailing dims that are contiguous in both the shard (ss) and the destination (ds).
void ComputeRunShape(const Box& sub, const Shape& ss, const Shape& ds, RunShape* rs) {
  rs->inner = 1;
  rs->count = 1;
  rs->sizes.clear();
  rs->strides.clear();
  int64_t active[kMaxDims];
  size_t k = 0;
  for (size_t d = 0; d < sub.ndim(); ++d) {
    if (sub.extent[d] > 1) active[k++] = static_cast<int64_t>(d);
  }
  auto ext = [&](size_t i) { return sub.extent[static_cast<size_t>(active[i])]; };
  auto sst = [&](size_t i) { return ss[static_cast<size_t>(active[i])]; };
  auto dst = [&](size_t i) { return ds[static_cast<size_t>(active[i])]; };
  if (k > 0 && sst(k - 1) == 1 && dst(k - 1) == 1) {
    rs->inner = ext(k - 1);
    --k;
    while (k > 0 && sst(k - 1) == rs->inner && dst(k - 1) == rs->inner) {
      rs->inner *= ext(k - 1);
      --k;
    }
  }
  for (size_t i = 0; i < k; ++i) {
    rs->sizes.push_back(ext(i));
    rs->strides.push_back({sst(i), dst(i)});
    rs->count *= ext(i);
  }
}

class Planner {
 public:
  Planner(const Capture& capture, const Manifest& manifest, const PlanOptions& options)
      : cap_(capture), man_(manifest), opt_(options) {}

  Result<TransferPlan> Run();

 private:
  Status PlanCopy(uint32_t ci);
  Result<TensorIndex*> Index(uint32_t table);
  uint32_t SourceId(uint32_t table, uint32_t shard);
  uint32_t PickReplica(TensorIndex& idx, size_t box);
  void Push(std::vector<ReadRun>& runs, const ReadRun& r);
  Status CheckDescriptorLimit(const CapturedCopy& c, int64_t more);
  // Emits the exact runs of the current intersections into `buffer`, whose element layout is
  // `ds` (per source dim) from `dest_base`.
  void EmitExactRuns(const CapturedCopy& c, uint32_t table_id, TensorIndex& idx, const Shape& ds, int64_t dest_base,
                     uint32_t buffer, uint64_t es, std::vector<ReadRun>& out);

  const Capture& cap_;
  const Manifest& man_;
  const PlanOptions& opt_;
  TransferPlan plan_;
  std::unordered_map<std::string_view, uint32_t> tables_;
  std::vector<TensorIndex> index_;
  std::vector<ReadRun> direct_;
  std::vector<ReadRun> staged_;
  // Scratch reused across copies.
  // Intersections of the current copy: inters_[0 .. n_inters_) are live; elements are reused
  // across copies so their vectors keep their capacity.
  std::vector<std::pair<size_t, Box>> inters_;
  size_t n_inters_ = 0;
  std::vector<Shape> shard_strides_;
  Shape ds_;
  RunShape rs_;
  int64_t descriptors_ = 0;
};

Result<TensorIndex*> Planner::Index(uint32_t table) {
  TensorIndex& idx = index_[table];
  if (!idx.built) {
    const ShardTable& t = man_.tables[table];
    RC_RETURN_IF_ERROR(internal::IndexShards(t, &idx.shards));
    idx.next_replica.assign(idx.shards.boxes.size(), 0);
    idx.source_id.assign(t.shards.size(), kNone);
    idx.dim0_partition = internal::IsDim0Partition(t.shape, idx.shards);
    idx.row_elems = t.shape.empty() ? 1 : NumElements(Shape(t.shape.begin() + 1, t.shape.end()));
    idx.built = true;
  }
  return &idx;
}

uint32_t Planner::SourceId(uint32_t table, uint32_t shard) {
  uint32_t& id = index_[table].source_id[shard];
  if (id == kNone) {
    id = static_cast<uint32_t>(plan_.sources.size());
    const ShardTable& t = man_.tables[table];
    const ShardInfo& s = t.shards[shard];
    uint32_t& tensor = index_[table].plan_tensor;
    if (tensor == kNone) {
      tensor = static_cast<uint32_t>(plan_.tensors.size());
      plan_.tensors.push_back(t.name);
    }
    plan_.sources.push_back(PlanSource{tensor, s.rank, shard, s.handle,
                                       static_cast<uint64_t>(NumElements(s.shape)) * DTypeSize(t.dtype)});
  }
  return id;
}

uint32_t Planner::PickReplica(TensorIndex& idx, size_t box) {
  const uint64_t turn = idx.next_replica[box]++ + static_cast<uint64_t>(std::max(opt_.dest_rank, 0));
  return idx.shards.replica(idx.shards.boxes[box], turn);
}

void Planner::Push(std::vector<ReadRun>& runs, const ReadRun& r) {
  if (!runs.empty()) {
    ReadRun& last = runs.back();
    if (last.source == r.source && last.buffer == r.buffer && last.source_offset + last.length == r.source_offset &&
        last.dest_offset + last.length == r.dest_offset) {
      last.length += r.length;
      return;
    }
  }
  runs.push_back(r);
}

Status Planner::CheckDescriptorLimit(const CapturedCopy& c, int64_t more) {
  descriptors_ += more;
  if (descriptors_ > opt_.max_descriptors) {
    return InvalidArgument(fmt::format("tensor {}: the plan needs more than {} descriptors (copy into {} alone needs {})",
                                       c.source, opt_.max_descriptors, cap_.params[c.param].name, more));
  }
  return OkStatus();
}

void Planner::EmitExactRuns(const CapturedCopy& c, uint32_t table_id, TensorIndex& idx, const Shape& ds,
                            int64_t dest_base, uint32_t buffer, uint64_t es, std::vector<ReadRun>& out) {
  const size_t n = c.box.ndim();
  for (size_t i = 0; i < n_inters_; ++i) {
    const Shape& ub_start = *idx.shards.boxes[inters_[i].first].start;
    const Box& sb = inters_[i].second;
    const uint32_t src = SourceId(table_id, PickReplica(idx, inters_[i].first));
    int64_t src_base = 0, dst_base = dest_base;
    for (size_t d = 0; d < n; ++d) {
      src_base += (sb.start[d] - ub_start[d]) * shard_strides_[i][d];
      dst_base += (sb.start[d] - c.box.start[d]) * ds[d];
    }
    ComputeRunShape(sb, shard_strides_[i], ds, &rs_);
    const uint64_t len = static_cast<uint64_t>(rs_.inner) * es;
    internal::ForEachIndex<2>(rs_.sizes, rs_.strides, {src_base, dst_base}, [&](const std::array<int64_t, 2>& o) {
      Push(out, ReadRun{src, buffer, static_cast<uint64_t>(o[0]) * es, static_cast<uint64_t>(o[1]) * es, len});
    });
  }
}

Status Planner::PlanCopy(uint32_t ci) {
  const CapturedCopy& c = cap_.copies[ci];
  const TensorSpec& param = cap_.params[c.param];
  auto tit = tables_.find(c.source);
  if (tit == tables_.end()) {
    return NotFound(fmt::format("tensor {}: not published in manifest {} (needed for {})", c.source,
                                man_.version.empty() ? man_.model : man_.version, param.name));
  }
  const uint32_t table_id = tit->second;
  const ShardTable& table = man_.tables[table_id];
  if (table.shape != c.source_shape) {
    return InvalidArgument(fmt::format("tensor {}: published shape {} but the loader expects {}", c.source,
                                       ShapeToString(table.shape), ShapeToString(c.source_shape)));
  }
  const DType sdt = table.dtype;
  RC_RETURN_IF_ERROR(CheckConversion(c.source, sdt, param.dtype, c.convert));
  RC_ASSIGN_OR_RETURN(TensorIndex * idx, Index(table_id));

  const int64_t numel = c.box.numel();
  const uint64_t es = DTypeSize(sdt);
  plan_.stats.selected_copies++;
  plan_.stats.bytes_needed += static_cast<uint64_t>(numel) * es;
  plan_.stats.dest_bytes_selected += static_cast<uint64_t>(numel) * DTypeSize(param.dtype);
  if (numel == 0) return OkStatus();

  // Intersect the view box with the distinct shard boxes.
  n_inters_ = 0;
  const size_t n = c.box.ndim();
  int64_t covered = 0;
  {
    size_t first = 0;
    if (idx->dim0_partition) {
      // Boxes are sorted by dim-0 start: skip those that end before the view starts.
      const auto& boxes = idx->shards.boxes;
      auto it = std::partition_point(boxes.begin(), boxes.end(), [&](const internal::UniqueBox& u) {
        return (*u.start)[0] + (*u.extent)[0] <= c.box.start[0];
      });
      first = static_cast<size_t>(it - boxes.begin());
    }
    for (size_t b = first; b < idx->shards.boxes.size(); ++b) {
      const internal::UniqueBox& ub = idx->shards.boxes[b];
      if (n > 0 && (*ub.start)[0] >= c.box.start[0] + c.box.extent[0]) break;
      if (n_inters_ == inters_.size()) inters_.emplace_back();
      auto& slot = inters_[n_inters_];
      if (internal::Intersect(ub, c.box, &slot.second)) {
        slot.first = b;
        covered += slot.second.numel();
        ++n_inters_;
      }
    }
  }
  if (covered != numel) {
    std::vector<Box> have;
    for (size_t i = 0; i < n_inters_; ++i) have.push_back(inters_[i].second);
    return InvalidArgument(fmt::format("tensor {}: {} missing from the published shards (needed for {})", c.source,
                                       internal::DescribeMissing(c.box, have), param.name));
  }

  const bool convert = sdt != param.dtype;
  // Destination strides per source dim: the parameter's own (direct) or a dense staging block of
  // the view's box (conversion).
  Shape& ds = ds_;
  ds.assign(n, 0);
  int64_t dest_base = 0;
  if (!convert) {
    for (size_t k = 0; k < c.view_to_source.size(); ++k) {
      if (c.view_to_source[k] >= 0) ds[static_cast<size_t>(c.view_to_source[k])] = c.dest_strides[k];
    }
    dest_base = c.dest_offset;
  } else {
    ds = RowMajorStrides(c.box.extent);
  }

  // Count exact runs first; only materialize them if they fit the budget (or must be used).
  int64_t exact = 0;
  std::vector<Shape>& shard_strides = shard_strides_;
  if (shard_strides.size() < n_inters_) shard_strides.resize(n_inters_);
  for (size_t i = 0; i < n_inters_; ++i) {
    const Shape& ext = *idx->shards.boxes[inters_[i].first].extent;
    Shape& st = shard_strides[i];
    st.resize(n);
    int64_t stride = 1;
    for (size_t d = n; d-- > 0;) {
      st[d] = stride;
      stride *= std::max<int64_t>(ext[d], 1);
    }
    ComputeRunShape(inters_[i].second, shard_strides[i], ds, &rs_);
    exact += rs_.count;
  }
  const bool full_pull = exact > opt_.descriptor_budget && idx->dim0_partition && n > 0 &&
                         static_cast<int64_t>(n_inters_) < exact;

  if (!convert && !full_pull) {
    RC_RETURN_IF_ERROR(CheckDescriptorLimit(c, exact));
    EmitExactRuns(c, table_id, *idx, ds, dest_base, c.param, es, direct_);
    return OkStatus();
  }

  // Staged: a source-dtype block, then an install step replays the view into the parameter.
  InstallStep step;
  step.staging = static_cast<uint32_t>(plan_.buffers.size());
  step.param = c.param;
  step.source = c.source;
  step.source_dtype = sdt;
  step.param_dtype = param.dtype;
  step.box = c.box;
  step.view_to_source = c.view_to_source;
  step.dest_offset = c.dest_offset;
  step.dest_strides = c.dest_strides;
  step.full_pull = full_pull;
  step.run_begin = staged_.size();
  if (full_pull) {
    step.block.start = Shape(n, 0);
    step.block.extent = table.shape;
    step.block.start[0] = c.box.start[0];
    step.block.extent[0] = c.box.extent[0];
    RC_RETURN_IF_ERROR(CheckDescriptorLimit(c, static_cast<int64_t>(n_inters_)));
    const int64_t row = idx->row_elems;
    for (size_t i = 0; i < n_inters_; ++i) {
      const size_t b = inters_[i].first;
      const Box& sb = inters_[i].second;
      const int64_t ub_start0 = (*idx->shards.boxes[b].start)[0];
      const uint32_t src = SourceId(table_id, PickReplica(*idx, b));
      const int64_t lo = sb.start[0], hi = sb.start[0] + sb.extent[0];
      Push(staged_, ReadRun{src, step.staging, static_cast<uint64_t>((lo - ub_start0) * row) * es,
                            static_cast<uint64_t>((lo - c.box.start[0]) * row) * es,
                            static_cast<uint64_t>((hi - lo) * row) * es});
    }
    plan_.stats.full_pulls++;
    plan_.stats.full_pull_bytes += static_cast<uint64_t>(step.block.numel()) * es;
  } else {
    step.block = c.box;
    RC_RETURN_IF_ERROR(CheckDescriptorLimit(c, exact));
    EmitExactRuns(c, table_id, *idx, ds, 0, step.staging, es, staged_);
  }
  if (convert) plan_.stats.converted_copies++;
  step.run_end = staged_.size();
  const uint64_t staging_bytes = static_cast<uint64_t>(step.block.numel()) * es;
  plan_.buffers.push_back(PlanBuffer{PlanBuffer::Kind::kStaging, "staging:" + c.source, sdt, staging_bytes});
  plan_.stats.staging_bytes += staging_bytes;
  plan_.installs.push_back(std::move(step));
  return OkStatus();
}

Result<TransferPlan> Planner::Run() {
  // Gate, part 1: nothing selected may be unsupported; destinations are written exactly once.
  for (const UnsupportedSource& u : cap_.unsupported) {
    if (opt_.selector.Matches(u.source)) {
      return InvalidArgument(fmt::format("tensor {}: unsupported view into {}: {}", u.source, u.param, u.reason));
    }
  }
  RC_RETURN_IF_ERROR(CheckDestinationCoverage(cap_, opt_.max_descriptors));

  tables_.reserve(man_.tables.size());
  for (uint32_t i = 0; i < man_.tables.size(); ++i) {
    if (!tables_.emplace(man_.tables[i].name, i).second) {
      return InvalidArgument(fmt::format("tensor {}: published twice in the manifest", man_.tables[i].name));
    }
  }
  index_.resize(man_.tables.size());
  plan_.buffers.reserve(cap_.params.size());
  for (const TensorSpec& p : cap_.params) {
    plan_.buffers.push_back(PlanBuffer{PlanBuffer::Kind::kParam, p.name, p.dtype, p.bytes()});
    plan_.stats.dest_bytes += p.bytes();
  }
  plan_.stats.copies = cap_.copies.size();
  // Gate, part 2 (per copy, inside PlanCopy): published, same shape, dtype declared, covered.
  for (uint32_t ci = 0; ci < cap_.copies.size(); ++ci) {
    if (!opt_.selector.Matches(cap_.copies[ci].source)) continue;
    RC_RETURN_IF_ERROR(PlanCopy(ci));
  }

  plan_.direct_runs = direct_.size();
  plan_.runs = std::move(direct_);
  plan_.runs.reserve(plan_.runs.size() + staged_.size());
  plan_.runs.insert(plan_.runs.end(), staged_.begin(), staged_.end());
  for (InstallStep& s : plan_.installs) {
    s.run_begin += plan_.direct_runs;
    s.run_end += plan_.direct_runs;
  }
  plan_.stats.descriptors = plan_.runs.size();
  for (const ReadRun& r : plan_.runs) plan_.stats.bytes_planned += r.length;
  plan_.stats.source_shards = plan_.sources.size();
  return std::move(plan_);
}

}  // namespace

Result<TransferPlan> BuildPlan(const Capture& capture, const Manifest& manifest, const PlanOptions& options) {
  Planner planner(capture, manifest, options);
  return planner.Run();
}

}  // namespace rc::refit
