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
// Thread safety: one call works on its own buffers (and its own arena); the transport must be
// safe to call from this thread. With transform_threads > 1 the install steps of a wave run on
// that many short-lived threads (they write disjoint destination bytes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "rolloutcore/base/status.h"
#include "rolloutcore/refit/capture.h"
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

// `params` must hold a buffer of exactly PlanBuffer::bytes for every parameter the plan writes.
[[nodiscard]] Result<ExecuteStats> ExecutePlan(const TransferPlan& plan, transport::Transport& transport,
                                               const DestinationBuffers& params,
                                               const ExecuteOptions& options = {});

}  // namespace rc::refit
