// RefitReceiver: the engine side of receiver-driven refit (ENGINE_API.md: /rc/refit/stage,
// /rc/refit/install, /rc/weights/digest).
//
// Stage(model, version, directory): discover the committed version in the directory → capture
// the geometry of every tensor-parallel rank through the engine's own loader (cached) → plan
// each rank's reads against the manifest (cached while the source topology — every shard's
// tensor, box and handle — is unchanged) → pull the bytes through the transport the handles
// name (shm or ucx) into shadow copies of the parameters (staging; the live weights are not
// touched, so the engine keeps serving) → digest what was staged in global source coordinates
// and compare it, tensor by tensor, with the manifest. A mismatch refuses the stage.
// Install(version): only while the engine is paused (FailedPrecondition otherwise, and when
// nothing or another version is staged — in both cases nothing live was touched): copies the
// staged parameters into the live ones through Engine::InstallWeights, which sets the label in
// the same critical section, then digests the live weights and compares them with the manifest.
// LiveDigest(): per-tensor content digests of the live weights in global source coordinates and
// the combined digest (the same formula the trainer used over its shards).
//
// Timing: every stage and install reports its stages in milliseconds: discovery,
// source_preparation (capture), registration (staging allocation), planning, wire,
// receive_sync (digest of the staged bytes), transform (dtype conversion happens during the
// wire step's install pass and is included there), install, post_install (live digest), ready.
//
// Thread safety: all methods may be called from any thread; one mutex serializes them.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "rolloutcore/base/json.h"
#include "rolloutcore/engine/engine.h"
#include "rolloutcore/refit/capture.h"
#include "rolloutcore/refit/digest.h"
#include "rolloutcore/refit/manifest.h"
#include "rolloutcore/refit/model_config.h"
#include "rolloutcore/refit/planner.h"

namespace rc::engine {

struct StageRequest {
  std::string model;
  std::string version;
  std::string directory;  // base URL of the directory
};

class RefitReceiver {
 public:
  explicit RefitReceiver(Engine* engine);
  ~RefitReceiver();

  Result<Json> Stage(const StageRequest& request);
  // skip_cache_reset is for the stale-cache negative control only (docs/engine.md).
  Result<Json> Install(const std::string& version, bool skip_cache_reset = false);
  Result<Json> LiveDigest();
  // The version staged and not yet installed ("" when none).
  std::string staged_version() const;

 private:
  struct Staged;
  Status EnsureCaptures();
  Result<refit::TensorDigests> DigestOf(const std::vector<refit::DestinationBuffers>& buffers);
  std::vector<refit::DestinationBuffers> LiveBuffers();

  Engine* engine_;
  refit::ModelConfig config_;
  mutable std::mutex mu_;
  std::vector<refit::Capture> captures_;                            // guarded by mu_, per rank
  std::vector<std::vector<refit::DigestRegion>> digest_regions_;    // guarded by mu_
  uint64_t plan_topology_ = 0;                                      // guarded by mu_
  std::vector<refit::TransferPlan> plans_;                          // guarded by mu_
  std::unique_ptr<Staged> staged_;                                  // guarded by mu_
  int64_t generation_ = 0;                                          // guarded by mu_
  int64_t plans_built_ = 0;                                         // guarded by mu_
};

}  // namespace rc::engine
