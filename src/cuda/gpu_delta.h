// Runs a delta refit's tasks (delta_task.h) on the GPU: uploads the tables and the pulled tile
// bodies, launches LaunchDeltaTasks once, and returns the per-slot digest terms of the old and of
// the stored values (receiver/device_delta.h builds the tables and turns the sums into the image's
// predicted digests). Used by receiver::DeviceReceiver for a delta stage into vLLM's staging image.
//
// Thread safety: none beyond the CUDA runtime's; one call at a time per image.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "cuda/delta_task.h"
#include "rolloutcore/base/status.h"

namespace rc::cuda {

struct DeviceDeltaInput {
  std::span<const internal::DeltaPieceDesc> pieces;
  std::span<const internal::DeltaOwnedBox> owned;
  std::span<const internal::DeltaTask> tasks;
  // The tile bodies: the concatenation of these views, uploaded into one device buffer (a task's
  // `body` is an offset into it). Views, so the receiver's pulled shard bodies are not copied on
  // the host first.
  std::span<const std::span<const std::byte>> bodies;
  size_t slots = 0;  // output slots (tensors)
};

struct DeviceDeltaOutput {
  std::vector<uint64_t> old_terms, new_terms;  // per slot
  uint64_t writes = 0, owned = 0;
  std::optional<uint64_t> failed_task;  // the first task that failed (it stored nothing)
  uint32_t error = internal::kDeltaTaskOk;
  uint64_t uploaded_bytes = 0;  // tables + bodies copied to the device
  double upload_ms = 0;         // wall time of the uploads
  double kernel_ms = 0;         // GPU time of the kernel
};

// InvalidArgument when a task names a piece or body bytes outside the tables; Unavailable when the
// device memory for the tables cannot be had; Internal for a CUDA failure.
[[nodiscard]] Result<DeviceDeltaOutput> RunDeltaOnDevice(int device, const DeviceDeltaInput& in);

}  // namespace rc::cuda
