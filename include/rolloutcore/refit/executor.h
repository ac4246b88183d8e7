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
// Timing: ExecuteStats separates import (descriptor import and mapping), wire (posting the reads
// until every read of every wave completed) and transform (view replay and dtype conversion from
// staging into the parameters), so callers can report wire bandwidth without the conversion.
//
// One wave loop for host and device memory (after ggml's buffer types): what differs between
// them (allocating staging, running the install steps, copying to the host, the content digest)
// is behind PlanMemory; ExecuteWaves is the loop. ExecutePlan runs it over HostPlanMemory; the GPU
// executor (rolloutcore/cuda/gpu_refit.h, ExecutePlanOnDevice) over device memory.
//
// Thread safety: one call works on its own buffers (and its own arena); the transport must be
// safe to call from this thread. With transform_threads > 1 the install steps of a wave run on
// that many threads of the shared pool (they write disjoint destination bytes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/status.h"
#include "rolloutcore/refit/capture.h"
#include "rolloutcore/refit/digest.h"
#include "rolloutcore/refit/planner.h"
#include "rolloutcore/transport/transport.h"

namespace rc::refit {

// Staging memory kept across calls: a caller that refits repeatedly passes the same arena so the
// staging pages are allocated (and faulted in) once instead of on every refit.
class StagingArena {
 public:
  // At least `bytes` of storage; contents unspecified. Invalidates earlier pointers when it grows.
  std::byte* Reserve(uint64_t bytes);
  uint64_t capacity() const { return capacity_; }

 private:
  std::unique_ptr<std::byte[]> data_;
  uint64_t capacity_ = 0;
};

// Imported source descriptors kept across ExecutePlan calls (a receiver that refits repeatedly
// from the same sources imports and maps them once). Release() (and the destructor) hands every
// import back to the transport, which must outlive the cache. Not thread-safe: one caller.
class ImportCache {
 public:
  explicit ImportCache(transport::Transport& t) : t_(t) {}
  ~ImportCache() { Release(); }
  ImportCache(const ImportCache&) = delete;
  ImportCache& operator=(const ImportCache&) = delete;
  Result<transport::RemoteMemory> Get(const std::string& handle);
  void Release();
  size_t size() const { return by_handle_.size(); }
  transport::Transport& transport() { return t_; }

 private:
  transport::Transport& t_;
  std::map<std::string, transport::RemoteMemory> by_handle_;
};

struct ExecuteOptions {
  int64_t timeout_ms = 60'000;
  uint64_t max_staging_bytes = uint64_t{1} << 30;  // per wave; one larger step runs alone
  StagingArena* arena = nullptr;                   // null: staging allocated per wave and freed
  int transform_threads = 1;                       // threads for a wave's install steps
  // Imports to reuse (and keep) across calls; must belong to the transport given to ExecutePlan.
  // Null: descriptors are imported for this call and released when it returns.
  ImportCache* imports = nullptr;
  // Given to the transport with every direct run's read (transport::LandingObserver): a backend
  // that lands bytes with the CPU reports them while they are in cache. Null: none.
  transport::LandingObserver* landing_observer = nullptr;
};

struct ExecuteStats {
  uint64_t bytes_read = 0;
  uint64_t reads = 0;
  uint64_t batches = 0;
  uint64_t waves = 0;
  uint64_t installs = 0;
  int64_t import_ns = 0;     // importing the source descriptors
  int64_t staging_ns = 0;    // growing the arena (allocation and first touch)
  int64_t wire_ns = 0;       // posting reads until all completed, summed over waves
  int64_t transform_ns = 0;  // install steps (view replay, dtype conversion), summed over waves
};

// Where a plan's parameters and staging live. The wave loop (ExecuteWaves) calls, per wave,
// AllocateStaging once (when the wave has install steps), posts the reads into the staging
// buffers it carves out of it (and into the parameters for direct runs), waits, then Install()
// for the wave's steps. One object serves one ExecuteWaves call at a time (one caller).
class PlanMemory {
 public:
  virtual ~PlanMemory() = default;
  // What a destination buffer is called in messages: "buffer", "device buffer".
  virtual std::string_view buffer_noun() const = 0;
  // Staging buffers of a wave are carved out of one allocation at this alignment (a power of 2).
  virtual uint64_t staging_alignment() const = 0;
  // At least `bytes` of staging for the next wave; the previous wave's staging may be freed or
  // reused (its install steps have run).
  [[nodiscard]] virtual Result<std::byte*> AllocateStaging(uint64_t bytes) = 0;
  // Runs plan.installs[begin, end): view replay and dtype conversion from ptr[step.staging] into
  // ptr[step.param]; returns once every destination byte is written.
  [[nodiscard]] virtual Status Install(const TransferPlan& plan, size_t begin, size_t end,
                                       std::span<std::byte* const> ptr) = 0;
  // Copies `n` bytes of this memory at `src` to host memory.
  [[nodiscard]] virtual Status CopyToHost(void* dst, const std::byte* src, uint64_t n) = 0;
  // DigestInstalled (digest.h) over buffers of this memory.
  [[nodiscard]] virtual Result<TensorDigests> Digest(const Capture& capture, const DestinationBuffers& buffers,
                                                     std::span<const DigestRegion> regions) = 0;
};

// Host memory: staging from an arena (or allocated per wave when null), install steps on
// `transform_threads` threads of the shared pool, the CPU digest.
class HostPlanMemory final : public PlanMemory {
 public:
  explicit HostPlanMemory(StagingArena* arena = nullptr, int transform_threads = 1)
      : arena_(arena), transform_threads_(transform_threads) {}
  std::string_view buffer_noun() const override { return "buffer"; }
  uint64_t staging_alignment() const override { return 64; }
  Result<std::byte*> AllocateStaging(uint64_t bytes) override;
  Status Install(const TransferPlan& plan, size_t begin, size_t end, std::span<std::byte* const> ptr) override;
  Status CopyToHost(void* dst, const std::byte* src, uint64_t n) override;
  Result<TensorDigests> Digest(const Capture& capture, const DestinationBuffers& buffers,
                               std::span<const DigestRegion> regions) override;

 private:
  StagingArena* arena_;
  const int transform_threads_;
  std::unique_ptr<std::byte[]> wave_;  // staging of the current wave when there is no arena
};

// Per plan source (TransferPlan::sources order) its RemoteMemory, imported through `imports`
// (each distinct descriptor once). FailedPrecondition for a source without a handle or one that
// registered fewer bytes than the plan reads; the import's error, naming the tensor, otherwise.
[[nodiscard]] Result<std::vector<transport::RemoteMemory>> ImportPlanSources(const TransferPlan& plan,
                                                                             ImportCache& imports);

// The wave loop over `memory` (see the header comment): `remotes` per plan source, every
// parameter the plan writes in `params` (exactly PlanBuffer::bytes, in `memory`), waves of at most
// `max_staging_bytes` of staging (one larger step runs alone), every wait under `deadline_ns` of
// the transport's clock. Fills every ExecuteStats field but import_ns. `direct_observer` goes with
// the reads of the direct runs (those that land in the parameters themselves).
[[nodiscard]] Result<ExecuteStats> ExecuteWaves(const TransferPlan& plan, transport::Transport& transport,
                                                std::span<const transport::RemoteMemory> remotes,
                                                const DestinationBuffers& params, PlanMemory& memory,
                                                int64_t deadline_ns, uint64_t max_staging_bytes,
                                                transport::LandingObserver* direct_observer = nullptr);

// `params` must hold a buffer of exactly PlanBuffer::bytes for every parameter the plan writes.
[[nodiscard]] Result<ExecuteStats> ExecutePlan(const TransferPlan& plan, transport::Transport& transport,
                                               const DestinationBuffers& params,
                                               const ExecuteOptions& options = {});

}  // namespace rc::refit
