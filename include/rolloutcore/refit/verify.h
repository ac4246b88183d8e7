// End-to-end verification of refit plans in one process (what `rolloutcore plan --verify` runs).
//
// Given the published tensors' shard geometry, the destination ranks and their loader, Verify:
//   1. fills every source tensor with seeded random values (finite for float dtypes);
//   2. cuts the trainer shards out of them, registers each with the `local` transport and
//      publishes a manifest with handles and per-shard digests;
//   3. per destination rank: captures the loader, plans, executes the plan through `local` into
//      sentinel-filled buffers, runs the same loader through a MaterializeContext over the whole
//      source tensors (the direct reference load) into other sentinel-filled buffers, and compares
//      every destination byte;
//   4. digests what the ranks installed (each source box once, see AssignDigestOwnership) and
//      compares per tensor with the trainer side: the published per-tensor digest when the ranks
//      install the whole tensor, else the digest of exactly the installed boxes.
// With a selector, both the plan and the reference load apply only the selected copies.
//
// Thread safety: a call owns everything it allocates; it registers and deregisters regions of the
// process-wide local transport table.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "rolloutcore/base/status.h"
#include "rolloutcore/refit/capture.h"
#include "rolloutcore/refit/executor.h"
#include "rolloutcore/refit/layouts.h"
#include "rolloutcore/refit/manifest.h"
#include "rolloutcore/refit/planner.h"
#include "rolloutcore/refit/spec.h"

namespace rc::refit {

struct VerifyProblem {
  std::vector<ShardTable> tables;  // geometry only; handles and digests are filled in
  int32_t ranks = 1;               // destination ranks 0 .. ranks-1
  std::function<Result<std::vector<TensorSpec>>(int32_t rank)> params;
  std::function<Status(int32_t rank, LoadContext& ctx)> load;
};

[[nodiscard]] Result<VerifyProblem> ModelVerifyProblem(const ModelConfig& config, const TrainerLayout& source,
                                                       const EngineLayout& target);
VerifyProblem SpecVerifyProblem(const PlanSpec& spec);

struct VerifyOptions {
  uint64_t seed = 1;
  // Refuse (FailedPrecondition) when sources plus two copies of the destinations exceed this.
  uint64_t max_bytes = uint64_t{1} << 30;
  std::vector<int32_t> ranks;  // empty: all
  PlanOptions plan;            // dest_rank is set per rank
  ExecuteOptions execute;
};

struct RankVerification {
  int32_t rank = 0;
  PlanStats plan;
  ExecuteStats execute;
  bool bytes_equal = false;
  std::string mismatch;  // first differing parameter and byte, when !bytes_equal
};

struct VerifyReport {
  std::vector<RankVerification> ranks;
  uint64_t content_digest = 0;  // of the published manifest
  uint64_t tensors_compared = 0;
  bool digests_match = false;
  std::string digest_mismatch;
  bool verified() const;
};

// Errors (planning refusals, execution failures) are returned as Status; a completed run that
// found differences returns a report with verified() == false.
[[nodiscard]] Result<VerifyReport> Verify(const VerifyProblem& problem, const VerifyOptions& options);

}  // namespace rc::refit
