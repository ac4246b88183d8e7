// Delta refit onto an image in GPU memory (issue 39, "Delta on the GPU"; docs/refit.md "Delta on the
// GPU"): the device form of the apply pass of delta_apply.h. The receiver pulls and plans a delta as
// the CPU path does (PullDelta: only the tiles its copies touch, into host memory, ~3.3 bytes per
// changed bf16 element), then BuildDeviceDeltaTable flattens the plan into one task per (piece,
// tile) (cuda/delta_task.h) over the pulled bodies (views, not copies: at 8B and 1 % they are
// ~0.3 GB, whose copy into fresh pages took longer than the kernel), which the device uploads into
// one buffer and runs
// with one kernel (cuda::DeviceDelta, gpu_refit.h): every changed element of the staging image is
// overwritten with its new value, and the kernel sums per tensor the digest terms of the old and of
// the stored values, so the staging image's digest after the delta is predicted without reading the
// rest of it (refit/digest.h). The receiver checks the prediction against the manifest as the CPU
// path does, and installs the image with the fused install of a full refit.
//
// EvaluateDeviceDeltaOnHost runs the kernel's own per-task code (RunDeltaTask) on host memory, so
// the CPU tests check the table and the task code against PredictDelta's apply pass.
//
// Thread safety: pure functions over the caller's data.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "cuda/delta_task.h"
#include "receiver/delta_apply.h"
#include "rolloutcore/base/status.h"
#include "rolloutcore/refit/capture.h"
#include "rolloutcore/refit/digest.h"
#include "rolloutcore/refit/executor.h"
#include "rolloutcore/refit/manifest.h"

namespace rc::receiver::internal {

struct DeviceDeltaTable {
  std::vector<cuda::internal::DeltaPieceDesc> pieces;
  std::vector<cuda::internal::DeltaOwnedBox> owned;
  std::vector<cuda::internal::DeltaTask> tasks;
  // Every pulled tile body of the rank, shard after shard: views of the DeltaStaged's shard bodies
  // (the DeltaStaged must outlive the table). A task's `body` is an offset into their
  // concatenation, body_bytes long: what the device's bodies buffer holds.
  std::vector<std::span<const std::byte>> bodies;
  std::vector<uint64_t> body_begin;   // per view: its offset in the concatenation
  uint64_t body_bytes = 0;
  std::vector<uint32_t> task_piece;   // per task: index into the DeltaStaged's pieces (for messages)
  std::vector<std::string> tensors;   // per output slot: its tensor (the DeltaStaged's tensors)
  uint64_t changed_in_tasks = 0;      // changed elements of the tiles the tasks decode
};

// Why rank `rank` of `staged` cannot run on the device ("" when it can): a parameter or source
// dtype pair the device conversion does not cover (same dtype, or bf16/f16 <-> f32), a source of
// more than 4 bytes, or a shard of more than kDeltaMaxLead + 1 dims.
std::string DeviceDeltaIneligibility(const DeltaStaged& staged, const refit::Manifest& manifest, size_t rank,
                                     const refit::Capture& capture);

// The device table of rank `rank`'s jobs in `staged`, writing into `image` (the rank's staging
// parameters by name: device addresses on the GPU, host addresses for EvaluateDeviceDeltaOnHost).
// FailedPrecondition naming the parameter when `image` lacks one; InvalidArgument for what
// DeviceDeltaIneligibility names.
[[nodiscard]] Result<DeviceDeltaTable> BuildDeviceDeltaTable(const DeltaStaged& staged, const refit::Manifest& manifest,
                                                             size_t rank, const refit::Capture& capture,
                                                             const refit::DestinationBuffers& image);

// The body of task `task` of `table`: bytes [body, body + bytes) of the concatenation; empty when
// they do not lie inside one view.
std::span<const std::byte> TaskBody(const DeviceDeltaTable& table, const cuda::internal::DeltaTask& task);

// What the kernel (or its host evaluation) found: per slot the sums of old and new terms, writes
// and owned counts, and the first task (in task order) that failed, if any, with its error code.
struct DeviceDeltaSums {
  std::vector<uint64_t> old_terms, new_terms;
  uint64_t writes = 0, owned = 0;
  std::optional<uint64_t> failed_task;
  uint32_t error = cuda::internal::kDeltaTaskOk;
};

// Runs every task of `table` on host memory (the table's image addresses must be host addresses).
// A failed task stores nothing; the others run, as on the device.
DeviceDeltaSums EvaluateDeviceDeltaOnHost(const DeviceDeltaTable& table);

// The status a failed task gives: the CPU decoder's own DataLoss for a malformed tile, or the
// non-finite refusal naming the tensor, rank and element, as PredictDelta words them.
[[nodiscard]] Status DeviceDeltaTaskError(const DeviceDeltaTable& table, const DeltaStaged& staged,
                                          const refit::Manifest& manifest, uint64_t task, uint32_t error);

// base + sum(new - old) per tensor: the image's per-tensor digests after the delta, given that
// `base` were its digests before.
refit::TensorDigests PredictedAfterDeviceDelta(const refit::TensorDigests& base, const DeviceDeltaTable& table,
                                               const DeviceDeltaSums& sums);

}  // namespace rc::receiver::internal
