// The refit planner: turns a capture (what one engine rank's loader copies) and a manifest (what
// the trainer published) into a TransferPlan of byte runs, after proving coverage.
//
// For every selected copy the planner resolves the view to a box in global source coordinates,
// intersects it with the published shards and emits runs (source shard, source byte offset,
// destination buffer, destination byte offset, length) that honour the real destination strides,
// coalescing trailing dimensions that are contiguous on both sides. Replicas (identical boxes on
// several ranks) are read once, the choice rotating over replicas. A copy whose exact runs exceed
// the descriptor budget pulls, when the tensor's shards form a gap-free dim-0 partition, the
// whole dim-0 rows of the shards it touches (whole shards when it spans their rows) into staging
// and replays its view locally at install; otherwise it keeps its exact runs. A copy whose
// destination dtype differs (declared bf16/f16 <-> f32) reads into a source-dtype staging block
// and converts at install.
//
// Coverage gate (before anything moves): every destination byte is written exactly once, every
// source element a selected copy reads is published, shards of a tensor do not overlap, shapes and
// dtypes agree, and no selected copy uses an unsupported view. Every refusal names the tensor.
//
// Thread safety: BuildPlan is a pure function of its arguments (no threads, no I/O).
// Invariants of a TransferPlan: buffers[0 .. params) are the capture's parameters in order, the
// rest staging; runs[0 .. direct_runs) write parameters, the other runs write staging and each
// InstallStep owns the contiguous range of them that fills its staging buffer; every run lies
// inside its source shard and its destination buffer.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/status.h"
#include "rolloutcore/refit/capture.h"
#include "rolloutcore/refit/manifest.h"
#include "rolloutcore/refit/tensor.h"

namespace rc::refit {

// Partial refit: which source tensors to move. All given criteria must hold.
struct Selector {
  // Keeps tensors whose (source) name satisfies it; unset keeps all.
  std::function<bool(std::string_view)> name_filter;
  // Keeps only tensors of layers first..last (inclusive); tensors outside layers are dropped.
  std::optional<std::pair<int64_t, int64_t>> layers;
  // Keeps only expert tensors ("...experts.{e}....") whose id is listed.
  std::vector<int64_t> experts;

  bool empty() const { return !name_filter && !layers && experts.empty(); }
  bool Matches(std::string_view source_name) const;
};

struct PlanOptions {
  int64_t descriptor_budget = 64;  // per copy
  Selector selector;
  int32_t dest_rank = 0;           // rotates replica choice so ranks spread their reads
  // Hard limit on runs in one plan, and on destination intervals the gate describes; protects
  // against pathological element-wise views of huge tensors.
  int64_t max_descriptors = int64_t{1} << 26;
};

struct PlanSource {
  uint32_t tensor = 0;  // index into TransferPlan::tensors
  int32_t rank = 0;
  uint32_t shard = 0;  // index into the tensor's ShardTable::shards
  std::string handle;
  uint64_t bytes = 0;  // size of the shard
};

struct PlanBuffer {
  enum class Kind : uint8_t { kParam, kStaging };
  Kind kind = Kind::kParam;
  std::string name;  // parameter name, or "staging:<source tensor>" for staging
  DType dtype = DType::kF32;
  uint64_t bytes = 0;
};

struct ReadRun {
  uint32_t source = 0;  // index into TransferPlan::sources
  uint32_t buffer = 0;  // index into TransferPlan::buffers
  uint64_t source_offset = 0;
  uint64_t dest_offset = 0;
  uint64_t length = 0;
};

// Work done after the reads of a staging buffer land: the copy's view is replayed from the
// staged block of the source tensor into the parameter, converting dtype if they differ.
struct InstallStep {
  uint32_t staging = 0;  // buffer index
  uint32_t param = 0;    // buffer index (== capture parameter index)
  std::string source;
  DType source_dtype = DType::kF32;
  DType param_dtype = DType::kF32;
  Box block;  // region of the source tensor held in staging, row-major
  Box box;    // the copy's view box
  std::vector<int32_t> view_to_source;
  int64_t dest_offset = 0;
  Shape dest_strides;
  uint64_t run_begin = 0, run_end = 0;  // runs filling the staging buffer
  bool full_pull = false;
};

struct PlanStats {
  uint64_t copies = 0;           // captured copies
  uint64_t selected_copies = 0;  // copies in the plan
  uint64_t bytes_needed = 0;     // source bytes the selected views cover
  uint64_t bytes_planned = 0;    // bytes the runs move
  uint64_t descriptors = 0;      // runs
  uint64_t full_pulls = 0;       // copies served by whole-row pulls
  uint64_t full_pull_bytes = 0;
  uint64_t converted_copies = 0;
  uint64_t staging_bytes = 0;
  uint64_t dest_bytes = 0;           // all parameter bytes of the rank
  uint64_t dest_bytes_selected = 0;  // parameter bytes the plan writes
  uint64_t source_shards = 0;        // distinct shards read
  // Wall time of BuildPlan, filled by the caller that timed it: BuildPlan reads no clock
  // (refit_core is pure) and leaves it 0.
  double plan_ms = 0;
};

struct TransferPlan {
  std::vector<std::string> tensors;  // names of the source tensors read
  std::vector<PlanSource> sources;
  std::vector<PlanBuffer> buffers;
  std::vector<ReadRun> runs;
  uint64_t direct_runs = 0;
  std::vector<InstallStep> installs;
  PlanStats stats;
};

[[nodiscard]] Result<TransferPlan> BuildPlan(const Capture& capture, const Manifest& manifest,
                                             const PlanOptions& options = {});

}  // namespace rc::refit
