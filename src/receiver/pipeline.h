// The steps of the staging pipeline that do not depend on where the staged image lives (module
// `receiver`, internal): the host receiver (RefitReceiver, receiver.cc: the embedded engine's
// weights) and the device receiver (DeviceReceiver, device_receiver.cc: vLLM's GPU parameters)
// both run them, in this order: ResolveInDirectory → RankPlans::Ensure → SourceImports::Ensure
// (source_imports.h, the import cache keyed by the same topology) → the pull (host or device
// memory) → the staged digest → CheckStagedDigests.
//
// Thread safety: none; each object has one owner (the receiver, under its mutex or its thread).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/status.h"
#include "rolloutcore/directory/client.h"
#include "rolloutcore/refit/capture.h"
#include "rolloutcore/refit/manifest.h"
#include "rolloutcore/refit/planner.h"

namespace rc::receiver::internal {

// Milliseconds left until `deadline`, at least 1 (a step given 0 would wait without bound).
int64_t MsLeft(std::chrono::steady_clock::time_point deadline);

// A committed version found in the directory: its manifest, the per-tensor digests its shards
// publish, and the client that found it (kept: fan-out reads holder records and marks holders
// through it).
struct ResolvedVersion {
  std::optional<directory::DirectoryClient> dir;
  refit::Manifest manifest;
  refit::TensorDigests published;
};

// Discovery under the stage's deadline (the client's connect and request timeouts are cut to
// what is left of it; its default would be 30 s): the manifest of `model` `version` and its
// published digests, into *out. The directory's error (NotFound, Unavailable, ...) otherwise.
[[nodiscard]] Status ResolveInDirectory(const std::string& directory, const std::string& model,
                                        const std::string& version, std::chrono::steady_clock::time_point deadline,
                                        ResolvedVersion* out);

// The topology key of a stage: the sources' topology (every shard's tensor, box and handle) and
// the receiver rank, which picks among replicated sources. Plans and imports are cached under it.
uint64_t StageTopology(const refit::Manifest& sources, int32_t receiver_rank);

// One transfer plan per rank of the receiver (rank r of receiver `receiver_rank` plans as
// destination rank receiver_rank * ranks + r), rebuilt only when the topology key changes.
class RankPlans {
 public:
  // Plans `captures` against `sources` unless plans for the same key and rank count are held.
  // Returns whether they were kept; on error nothing is held.
  [[nodiscard]] Result<bool> Ensure(std::span<const refit::Capture> captures, const refit::Manifest& sources,
                                    uint64_t topology, int32_t receiver_rank);
  void Reset();
  const std::vector<refit::TransferPlan>& plans() const { return plans_; }
  uint64_t topology() const { return topology_; }
  int64_t built() const { return built_; }  // plans built since construction (cache misses)
  // Sums over the ranks' plans.
  refit::PlanStats TotalStats() const;

 private:
  std::vector<refit::TransferPlan> plans_;
  uint64_t topology_ = 0;
  int64_t built_ = 0;
};

// The staged digests against the published ones, tensor by tensor: DataLoss naming the first
// difference. With `subset` (an engine that loads only some of the manifest's tensors, e.g. vLLM
// ignoring a tied lm_head) every staged tensor must be published with its digest and the
// published tensors not staged are not compared; without it the two sets must be equal too.
[[nodiscard]] Status CheckStagedDigests(const refit::TensorDigests& staged, const refit::TensorDigests& published,
                                        std::string_view model, std::string_view version, bool subset);

}  // namespace rc::receiver::internal
