// The segment table of the GPU content digest (DeviceDigest, gpu_refit.h), built on the host: the
// walk over every block / installed region cut into chunks (contiguous dims merged, rows cut at
// kDigestChunkBytes), and the table of the fused install. EvaluateDigestTableOnHost computes on the CPU exactly what the digest kernel
// computes from a table, so the table construction is tested without a GPU (digest_table_test).
//
// Thread safety: pure functions (the host evaluation reads the addresses in the table).
#pragma once

#include <span>
#include <string>
#include <vector>

#include "cuda/kernels.h"
#include "rolloutcore/base/status.h"
#include "rolloutcore/cuda/gpu_refit.h"

namespace rc::cuda::internal {

struct DigestTable {
  std::vector<DigestChunk> chunks;
  std::vector<std::string> slot_tensors;  // per output slot: its tensor
  uint64_t elements = 0;
};

[[nodiscard]] Result<DigestTable> BuildBlockDigestTable(std::span<const DeviceBlock> blocks);
[[nodiscard]] Result<DigestTable> BuildInstalledDigestTable(const refit::Capture& capture,
                                                            const refit::DestinationBuffers& buffers,
                                                            std::span<const refit::DigestRegion> regions);
// Per-slot sums of the table over host memory (the addresses must be host addresses).
std::vector<uint64_t> EvaluateDigestTableOnHost(const DigestTable& table);

// The fused install (DeviceInstall, gpu_refit.h): copy i of `staging` (dense, same source box,
// view and dtype as copy i of `live`) is copied into the live destination of copy i, and the
// elements `regions` (AssignDigestOwnership over `live`) give to copy i are digested from the
// values written. Copies owned whole are digested in the same pass (FusedChunk.digest = 1); copies
// owned in part or not at all are copied only, and their owned sub-boxes are digested from staging
// (digest_only, slots remapped to slot_tensors). FailedPrecondition when two copies write
// overlapping live elements (one launch would race; the caller copies in order instead), a buffer
// is missing or has the wrong size, or a live stride is negative.
struct FusedInstallTable {
  std::vector<FusedChunk> chunks;
  DigestTable digest_only;               // its slot_tensors emptied: slots index slot_tensors below
  std::vector<std::string> slot_tensors;  // per output slot: its source tensor
  uint64_t elements = 0;                  // digested elements
  uint64_t bytes = 0;                     // copied bytes
};
[[nodiscard]] Result<FusedInstallTable> BuildFusedInstallTable(const refit::Capture& live,
                                                               const refit::DestinationBuffers& live_buffers,
                                                               const refit::Capture& staging,
                                                               const refit::DestinationBuffers& staging_buffers,
                                                               std::span<const refit::DigestRegion> regions);
// Runs the table on host memory: performs the copies and returns the per-slot sums.
std::vector<uint64_t> EvaluateFusedInstallOnHost(const FusedInstallTable& table);

}  // namespace rc::cuda::internal
