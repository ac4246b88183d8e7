// Delta refit on the receiver side (docs/refit.md "Delta refit"), used by RefitReceiver.
//
// StageDelta: for a manifest whose shards carry deltas against the version the engine serves,
// pulls for each rank only the delta tiles its captured copies touch (header and tile table of
// every shard it reads, then the tiles), decodes them, maps each changed source element through
// the captured copies to the parameter elements it lands in, and predicts each tensor's digest
// after the install from the live (old) values and the new ones:
//     D_new(T) = D_live(T) + sum over changed owned elements (DigestTerm(i, new) - DigestTerm(i, old))
// A prediction that differs from the manifest's per-tensor digest refuses the stage (nothing live
// is touched). Reads live parameters, never writes them.
// ApplyDeltaWrites writes one rank's changes into its live parameters (only inside
// Engine::InstallWeights). DigestAfterDelta recomputes the digest of every changed owned element
// from the live parameters after the install and returns the updated per-tensor digests.
//
// Thread safety: pure functions over the caller's data; the caller serializes them with installs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "rolloutcore/base/json.h"
#include "rolloutcore/base/status.h"
#include "rolloutcore/engine/parameters.h"
#include "rolloutcore/refit/capture.h"
#include "rolloutcore/refit/digest.h"
#include "rolloutcore/refit/executor.h"
#include "rolloutcore/refit/manifest.h"

namespace rc::engine::internal {

// Why `manifest` cannot be applied as a delta on live weights labelled `live_version` whose
// per-tensor digests are `live` (nullptr: none known for the current install generation); ""
// when it can: every shard carries a delta on one base, the base is the live label, and every
// tensor's live digest equals the sum of its shards' base digests.
std::string DeltaIneligibility(const refit::Manifest& manifest, const std::string& live_version,
                               const refit::TensorDigests* live);

// True when every shard of `manifest` carries a delta.
bool CarriesDelta(const refit::Manifest& manifest);

struct DeltaWrite {
  uint32_t param = 0;  // index into the rank's capture params
  uint32_t bits = 0;   // the new value in the parameter's dtype (at most 4 bytes)
  int64_t offset = 0;  // element offset in the parameter
};

// One changed source element counted by the digest (each element once over all ranks): 24 bytes,
// since a delta of a large model at F = 0.1 has tens of millions of them.
struct DeltaCheck {
  uint64_t global = 0;    // global element index in the source tensor
  uint64_t old_term = 0;  // DigestTerm of the live value before the install
  uint32_t write = 0;     // index into DeltaStaged::writes[rank]
  uint16_t tensor = 0;    // index into DeltaStaged::tensors
  uint8_t rank = 0;
  refit::DType source = refit::DType::kBF16;
};

struct DeltaStaged {
  std::string base;
  int64_t generation = -1;  // install generation whose live values the prediction read
  std::vector<std::vector<DeltaWrite>> writes;  // per rank
  std::vector<DeltaCheck> checks;
  std::vector<std::string> tensors;
  refit::TensorDigests base_digests;  // live digests the prediction started from
  refit::TensorDigests predicted;     // equal to the manifest's when staged
  uint64_t bytes_pulled = 0;
  int64_t changed = 0;  // distinct changed source elements decoded
  Json ranks = Json::array();  // per rank: bytes_pulled, region_delta_bytes, changed_in_region, reads
  Json stages_ms = Json::object();
};

struct DeltaStageInput {
  const refit::Manifest* manifest = nullptr;
  const refit::TensorDigests* published = nullptr;  // per tensor, from the manifest's shards
  const std::vector<refit::Capture>* captures = nullptr;
  const std::vector<std::vector<refit::DigestRegion>>* regions = nullptr;
  const std::vector<refit::DestinationBuffers>* live = nullptr;
  const refit::TensorDigests* live_digests = nullptr;
  int64_t generation = -1;
  int64_t timeout_ms = 60'000;
};

[[nodiscard]] Result<DeltaStaged> StageDelta(const DeltaStageInput& in);

// Writes `writes` into the live parameters of one rank (`capture` names them).
[[nodiscard]] Status ApplyDeltaWrites(const std::vector<DeltaWrite>& writes, const refit::Capture& capture,
                                      const ParameterStore& params);

// The per-tensor digests of the live weights after the install: base_digests plus, for every
// checked element, its term recomputed from the live parameter minus its old term.
[[nodiscard]] Result<refit::TensorDigests> DigestAfterDelta(const DeltaStaged& staged,
                                                            const std::vector<refit::Capture>& captures,
                                                            const std::vector<refit::DestinationBuffers>& live);

}  // namespace rc::engine::internal
