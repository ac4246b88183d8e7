// The executor: runs a TransferPlan through a Transport and installs the result.
//
// It imports every source descriptor once, then works in waves bounded by a staging budget: per
// wave it allocates the staging buffers of that wave's install steps, posts the wave's reads as
// one batch per source rank (all ranks posted before any wait), waits for all of them under one
// deadline, and runs the install steps (local view replay and dtype conversion into the
// parameters). Direct runs (same dtype, exact runs) go in the first wave.
//
// On any failure it cancels the transfers still outstanding, waits for them up to the deadline,
// and returns the error; destination buffers may then be partly written (the caller treats the
// install as ambiguous, as the lifecycle contract says).
//
// Thread safety: one call works on its own buffers; the transport must be safe to call from this
// thread. The executor starts no threads.
#pragma once

#include <cstdint>

#include "rolloutcore/base/status.h"
#include "rolloutcore/refit/capture.h"
#include "rolloutcore/refit/planner.h"
#include "rolloutcore/transport/transport.h"

namespace rc::refit {

struct ExecuteOptions {
  int64_t timeout_ms = 60'000;
  uint64_t max_staging_bytes = uint64_t{1} << 30;  // per wave; one larger step runs alone
};

struct ExecuteStats {
  uint64_t bytes_read = 0;
  uint64_t reads = 0;
  uint64_t batches = 0;
  uint64_t waves = 0;
  uint64_t installs = 0;
};

// `params` must hold a buffer of exactly PlanBuffer::bytes for every parameter the plan writes.
[[nodiscard]] Result<ExecuteStats> ExecutePlan(const TransferPlan& plan, transport::Transport& transport,
                                               const DestinationBuffers& params,
                                               const ExecuteOptions& options = {});

}  // namespace rc::refit
