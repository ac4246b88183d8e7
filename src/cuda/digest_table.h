// The segment table of the GPU content digest (DeviceDigest, gpu_refit.h), built on the host: the
// walk over every block / installed region cut into chunks (contiguous dims merged, rows cut at
// kDigestChunkBytes). EvaluateDigestTableOnHost computes on the CPU exactly what the digest kernel
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

}  // namespace rc::cuda::internal
