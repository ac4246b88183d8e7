// RefitReceiver (module `receiver`, below the engine: it reaches the live weights only through
// LiveWeights, live_weights.h, which the embedded engine implements): the engine side of
// receiver-driven refit (ENGINE_API.md: /rc/refit/stage,
// /rc/refit/install, /rc/weights/digest).
//
// Stage(model, version, directory): discover the committed version in the directory → capture
// the geometry of every tensor-parallel rank through the engine's own loader (cached) → plan
// each rank's reads against the manifest (cached while the source topology — every shard's
// tensor, box and handle — is unchanged) → pull the bytes through the transport the handles
// name (shm or ucx) into shadow copies of the parameters (staging; the live weights are not
// touched, so the engine keeps serving) → digest what was staged in global source coordinates
// and compare it, tensor by tensor, with the manifest. A mismatch refuses the stage.
// Install(version): only while the engine is paused (refused otherwise, and when nothing or
// another version is staged — in both cases nothing live was touched), through
// LiveWeights::InstallLive, which sets the label in the same critical section. A full stage's image
// covers every live parameter in its dtype (the shadow is allocated in the live dtype and layout),
// so the install swaps it in: staged and live storage are exchanged (no live byte is copied) and
// the live digest is the staged digest, sound because the shadow was made read-only (mprotect)
// when that digest matched and stays so until swapped in or re-used by the next stage (writable
// again first); the retired live storage is the next stage's staging. Otherwise (an image that
// does not cover every parameter) it copies the staged parameters into the live ones, digesting
// the values it copies as it copies them. Either way the digest is compared with the manifest.
// Its InstallOutcome is established at the mutation point (the swap's first exchange, or the
// copy's first memcpy): refused_untouched when the install ended before that point, whatever the
// error; failed_after_mutation when it ended after it; installed when the live digest matched.
// Delta refit (docs/refit.md "Delta refit"; receiver_delta.cc, delta_apply.h): when the version's
// shards carry deltas on the version the engine serves and the live digests prove that base, Stage
// pulls only the delta tiles each rank's copies touch, and — when a staging image of the live
// layout exists — brings that image to the live version (re-applying the previous install's delta,
// or copying the live weights), applies the delta to it while the old version serves, predicting
// every tensor's digest from the old and new values (refusing a mismatch before anything live
// changes); Install then swaps the image in like a full refit. Without a staging image, Install
// writes the changed elements into the live weights and re-checks them from live memory
// (O(changed)). Every full_verify_every-th delta install digests all live weights (anchor check).
// Otherwise Stage pulls in full. The stage report says which (StageReport::mode(), `mode_reason`,
// and DeltaStageReport's `delta_apply`, `staging_from`, `delta_apply_why`).
// Pre-replay (docs/lifecycle.md "Replay validation"): after a stage succeeded with a staging
// image that an install will swap in (full, or delta applied to the staging image) and the
// manifest carries probes, Stage replays them on that image (read-only since its digest) through
// LiveWeights::PreReplay while the old version still serves, within what is left of the stage's
// deadline; the stage evidence says `prereplay: {probes, ms, ran, why, batched}`. A pre-replay
// that cannot run (no free KV blocks, deadline, ...) never fails the stage. Only an install that
// swaps that very image in (LiveWeights::AdoptPreReplay, right after the install succeeded and its
// digest matched) makes the results servable, for exactly the install generation it produced;
// every other install, WriteLiveForTesting and every new Stage (which reuses the shadow) drop or
// invalidate them, and Engine::Replay computes on the live weights as before.
// LiveDigest(): per-tensor content digests of the live weights in global source coordinates and
// the combined digest (the same formula the trainer used over its shards).
//
// Reports (reports.h): Stage, Install, Relay and LiveDigest return typed reports (StageReport,
// InstallResult::report, RelayReport, LiveDigestReport), and the private steps below pass them
// (and StepTimings for the per-step milliseconds) as structs. Nothing here returns JSON: the
// callers that send a report on (the engine's refit routes, the embedded adapter's evidence) call
// its ToJson(), which is the documented wire format. Where this comment says "the stage
// evidence", it names the stage report's JSON keys.
//
// Timing: every stage and install reports its stages in milliseconds: discovery,
// source_preparation (capture), planning, registration (shadow allocation on first use, transport
// creation, descriptor import and mapping), wire (reads posted until all completed), transform
// (view replay and dtype conversion from the read staging into the shadow parameters; ~0 when
// the source dtype is the live one), receive_sync (digest of the staged bytes, with the finite
// check on the same pass), finite_check (f32: replica bytes no digest region reads; bf16: 0, done
// in receive_sync), protect (mprotect of the shadow: writable before the pull, read-only after
// its digest), install (swap, or copy + live digest), post_install (summing the
// per-rank digests), ready. The
// figures of the last stage and install, and counters, are exported as rolloutcore_refit_*
// series (MetricsText, served on the engine's /metrics).
//
// Memory: the shadow parameters (one copy of the model in the engine's dtype) and the read
// staging arena are allocated on the first stage and kept for the next refits, so a steady-state
// refit neither allocates nor faults pages in. The transport object and the imported (mapped)
// source descriptors are kept too while the source topology is unchanged ("transport_cached" in
// the stage evidence). A new Stage replaces whatever was staged; if it
// fails, nothing is staged.
//
// Work is spread over `threads` threads (default: the hardware threads): dtype conversion,
// digests and the install copy.
//
// Refused at stage (nothing staged, nothing live touched): a non-finite (NaN / ±Inf) staged
// weight, named by its source tensor and global element index — the digest cannot catch a NaN
// the trainer itself published.
//
// Deadlines: every step of a stage runs under its timeout_ms (1 ms .. kMaxStageTimeoutMs):
// discovery (the directory request), imports (the transports never block opening a handle) and
// the pull. Stages are serialized (one set of shadow buffers); a stage that cannot start before
// its own deadline because another one is still running fails with Unavailable naming the stage
// in progress, instead of queueing behind it without bound.
//
// Thread safety: all methods may be called from any thread; one mutex serializes them.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "rolloutcore/base/json.h"
#include "rolloutcore/base/metrics_writer.h"
#include "rolloutcore/base/mutex.h"
#include "rolloutcore/receiver/live_weights.h"
#include "rolloutcore/receiver/refit_choice.h"
#include "rolloutcore/receiver/reports.h"
#include "rolloutcore/receiver/source_imports.h"
#include "rolloutcore/receiver/weights.h"
#include "rolloutcore/refit/capture.h"
#include "rolloutcore/refit/digest.h"
#include "rolloutcore/refit/executor.h"
#include "rolloutcore/refit/manifest.h"
#include "rolloutcore/refit/model_config.h"
#include "rolloutcore/refit/planner.h"

namespace rc::refit {
class LandingDigest;  // src/refit/landing_digest.h
}  // namespace rc::refit

namespace rc::receiver {

namespace internal {
class RankPlans;  // src/receiver/pipeline.h
struct DeltaStaged;
struct DeltaChain;
}  // namespace internal

inline constexpr int64_t kMaxStageTimeoutMs = 3'600'000;

struct StageRequest {
  std::string model;
  std::string version;
  std::string directory;  // base URL of the directory
  int64_t timeout_ms = 60'000;  // deadline for the pull; Unavailable/DeadlineExceeded past it
  // Fan-out (docs/refit.md): also read from engines that relay this version ("<model>@relay"
  // holder records), which then serve every box they hold instead of the trainer; a holder whose
  // memory cannot be reached is excluded and its part re-read from the others (or the trainer)
  // within the same deadline. receiver_rank spreads receivers over holders (round robin).
  bool use_relays = false;
  int32_t receiver_rank = 0;
};

// Serve a staged or installed version as a source of it (docs/refit.md "Fan-out").
struct RelayRequest {
  std::string model;
  std::string version;
  std::string directory;
  std::string holder;  // this engine's name in the holder record (directory naming rule)
  int64_t lease_ttl_ms = 60'000;
};

// What an install did to the live weights (the wire names of lifecycle::InstallOutcome).
enum class InstallOutcome { kRefusedUntouched, kInstalled, kFailedAfterMutation };
std::string_view InstallOutcomeName(InstallOutcome o);  // refused_untouched | installed | failed_after_mutation

struct InstallResult {
  InstallOutcome outcome = InstallOutcome::kRefusedUntouched;
  Status status;         // OK exactly when outcome is kInstalled
  InstallReport report;  // what the install established (reports.h); meaningful only when installed
};

struct RelayHolding;

class RefitReceiver {
 public:
  // `live` (the embedded engine, or any other LiveWeights) outlives the receiver.
  explicit RefitReceiver(LiveWeights* live, int threads = 0);
  ~RefitReceiver();

  // The stage's report (reports.h; its ToJson() is the /rc/refit/stage answer).
  Result<StageReport> Stage(const StageRequest& request);
  // skip_cache_reset is for the stale-cache negative control only (docs/engine.md).
  InstallResult Install(const std::string& version, bool skip_cache_reset = false);
  // Rebuilds `version` (staged here, or installed and live) in its published dtype, checks every
  // shard against its published digest, registers it with the transport of the version's sources
  // (shm or ucx) and publishes the holder record.
  // Replaces this engine's previous relay (its record is marked unavailable). FailedPrecondition
  // when the version is neither staged nor live here, or its sources are neither shm nor ucx.
  Result<RelayReport> Relay(const RelayRequest& request);
  // Test-only fault (docs/engine.md "Fault injection"): while on, an install fails with
  // FailedPrecondition right after rank 0 copied its staged weights into the live ones.
  void SetFailAfterFirstRankForTesting(bool on) { fail_after_first_rank_ = on; }
  // Test-only fault: while on, a delta install flips bit 0 of the first value it wrote (the write
  // "does not land"), which only the post-install check can see.
  void SetCorruptDeltaInstallForTesting(bool on) { corrupt_delta_install_ = on; }
  // Test-only fault: while on, the next re-apply of the previous delta to the staging image flips
  // bit 0 of one of its new values (a wrong previous delta): the stage is refused, nothing live
  // changes, and the following stage copies the live weights into staging instead.
  void SetCorruptPreviousDeltaForTesting(bool on) { corrupt_previous_delta_ = on; }
  // Test-only fault: flips bit 0 of the first element of rank 0's model.norm.weight in place,
  // outside any install (memory corrupted between updates: only an anchor check sees it).
  [[nodiscard]] Status CorruptLiveWeightForTesting();
  // Anchor checks (docs/refit.md "Delta refit"): after every n-th consecutive delta install a full
  // digest of the live weights is compared with the manifest (0: never; full installs always do).
  void SetFullVerifyEvery(int n);
  // Full or delta when a version carries deltas the engine could apply (refit_choice.h; default
  // auto: the cheaper by this receiver's own measurements, per transport).
  void SetDeltaPolicy(DeltaPolicy policy);
  // Test-only: the staging buffer of `name` on `rank` (empty when none). Read-only between a
  // stage's digest and the next stage (a write faults).
  std::span<std::byte> StagedBytesForTesting(int rank, const std::string& name);
  // Test-only fault, the negative control of replay validation (docs/engine.md "Fault
  // injection"): while on, the captured install mapping of every rank sends the rows of the
  // first two query heads of layer 0's q_proj (within the rank's slice) to each other's place in
  // qkv_proj. Plans and digest regions both come from the capture, so the staged and live digests
  // still match the manifest; only running the model (a replay) shows the difference. Changing
  // it drops the cached captures and plans (rebuilt on the next stage).
  void SetSwapQHeadsForTesting(bool on);
  // The live weights change only through Install (which bumps the engine's generation), so the
  // digest computed from the live parameters right after an install (or by an earlier call) is
  // served again while the generation is unchanged; fresh=true recomputes it regardless.
  Result<LiveDigestReport> LiveDigest(bool fresh = false);
  // The combined content digest of the live weights if one was computed at the current install
  // generation (nothing computed now: cheap enough for every identity probe); nullopt otherwise,
  // or while a stage or install holds the receiver.
  std::optional<std::string> CachedLiveDigest() const;
  // The version staged and not yet installed ("" when none).
  std::string staged_version() const;
  // Writes the rolloutcore_refit_* series, each sample with `labels` first.
  void WriteMetrics(MetricsWriter* out, const MetricLabels& labels) const;

 private:
  struct Staged;
  Status EnsureCaptures() REQUIRES(mu_);
  // The staging pipeline (receiver.cc): StageLocked runs its named steps in order, each on the
  // stage's state (FullStage): ResolveInDirectory → EnsureCaptures → TryStageDelta (a delta
  // stage ends there) → FindRelaySources → PlanRanks → EnsureShadow → EnsureSourceImports (the
  // import cache keyed by topology) → PullRanks (again from PlanRanks after a relay failover) →
  // VerifyOnLanding → SealStaged → KeepStaged.
  struct FullStage;
  Result<StageReport> StageLocked(const StageRequest& request) REQUIRES(mu_);
  // Discovery under the stage's deadline: the manifest and its published digests.
  Status ResolveInDirectory(FullStage* s) REQUIRES(mu_);
  // Fan-out: the version's holder records merged into the sources planned against.
  Status FindRelaySources(FullStage* s) REQUIRES(mu_);
  // One plan per rank, rebuilt only when the source topology (and receiver rank) changes.
  Status PlanRanks(FullStage* s) REQUIRES(mu_);
  // The shadow parameters (staging image in the live layout), allocated on the first stage.
  Status EnsureShadow(FullStage* s) REQUIRES(mu_);
  // The sources' transport and import cache for the stage's topology; a replaced shm one goes to
  // *retired (released after the pull).
  Status EnsureSourceImports(FullStage* s, SourceImports* retired) REQUIRES(mu_);
  // Pulls every rank's plan into the shadow. True when a relay holder proved dead was excluded
  // and the sources merged again (the caller plans and pulls again).
  Result<bool> PullRanks(FullStage* s, refit::LandingDigest* landing) REQUIRES(mu_);
  // The staged digest (what the landing did not digest) and the finite check, compared with the
  // manifest tensor by tensor.
  Status VerifyOnLanding(FullStage* s, refit::LandingDigest* landing) REQUIRES(mu_);
  // f32 staging: whether the bytes no digest region read (replicas) hold a non-finite value.
  bool AnyNonFiniteUncoveredF32(const std::vector<refit::UncoveredBytes>& uncovered) REQUIRES(mu_);
  // Makes the staged image read-only, releases `retired` off the stage's path, records metrics.
  Result<StageReport> SealStaged(FullStage* s, SourceImports retired) REQUIRES(mu_);
  StageReport FullStageEvidence(const FullStage& s, double gbps) const REQUIRES(mu_);
  // Keeps the stage (staged_) and returns its report.
  StageReport KeepStaged(FullStage* s, StageReport report, refit::TensorDigests staged_digest) REQUIRES(mu_);
  // Sets *touched before the first live byte is written.
  Result<InstallReport> InstallLocked(const std::string& version, bool skip_cache_reset, std::atomic<bool>* touched) REQUIRES(mu_);
  // With any_nonfinite_f32, also checks (in the same pass) that the f32 elements read are finite.
  Result<refit::TensorDigests> DigestOf(const std::vector<refit::DestinationBuffers>& buffers,
                                        bool* any_nonfinite_f32 = nullptr) REQUIRES(mu_);
  std::vector<refit::DestinationBuffers> LiveBuffers();
  // Delta refit (receiver_delta.cc). TryStageDelta: nullopt (with *why_full set) when the
  // manifest cannot be applied as a delta here; otherwise the delta stage's report or refusal.
  std::optional<Result<StageReport>> TryStageDelta(const StageRequest& request, const refit::Manifest& manifest,
                                                   const refit::TensorDigests& published, const StepTimings& stages,
                                                   std::string* why_full) REQUIRES(mu_);
  Result<InstallReport> InstallDeltaLocked(const std::string& version, bool skip_cache_reset,
                                           std::atomic<bool>* touched, const StageReport& stage,
                                           const refit::TensorDigests& published,
                                           const refit::Manifest& manifest) REQUIRES(mu_);
  // The end of a delta install (swap or in place): the O(changed) check of the live weights, the
  // anchor check, the report; keeps the delta as the staging chain after a swap.
  Result<InstallReport> FinishDeltaInstall(const std::string& version, bool skip_cache_reset, const StageReport& stage,
                                           const refit::TensorDigests& published, const refit::Manifest& manifest,
                                           uint64_t bytes_installed, StepTimings stages) REQUIRES(mu_);
  // Brings the staging image to the live version before a delta is applied to it (re-applying the
  // previous delta, or copying the live weights), proving its digest; sets *from and *why.
  Status PrepareStagingForDelta(const std::string& live_version, int64_t generation, StepTimings* stages,
                                StagingFrom* from, std::string* why) REQUIRES(mu_);
  // True when the staging image has a buffer for every live parameter (aliases aside), of its
  // size (the capture's dtype is the live dtype); with require_read_only, each also read-only.
  bool StagingFitsLive(bool require_read_only = false) REQUIRES(mu_);
  // The anchor check of a full install (which digests every live byte anyway).
  AnchorCheckReport FullInstallAnchor() REQUIRES(mu_);
  // True when the staged image can be swapped in: every live parameter (aliases aside) has a
  // staged buffer of its size and dtype, read-only since the stage's digest.
  bool SwapCoversLive() REQUIRES(mu_);
  [[nodiscard]] Status SetShadowReadOnly(bool read_only) REQUIRES(mu_);
  // The end of a full install (swap or copy): checks `live` against the manifest, caches it,
  // and builds the report.
  Result<InstallReport> FinishFullInstall(const std::string& version, bool skip_cache_reset,
                                          const refit::TensorDigests& live, uint64_t bytes, StepTimings stages,
                                          InstallMode mode) REQUIRES(mu_);
  // Pre-replay (Stage, after a successful stage): runs the staged version's probes on the staged
  // image through LiveWeights::PreReplay, bounded by `deadline`; returns the stage report's
  // pre-replay and records the image id in staged_ when the results were cached.
  StagePreReplay PreReplayLocked(std::chrono::steady_clock::time_point deadline) REQUIRES(mu_);

  LiveWeights* live_;
  refit::ModelConfig config_;
  const int threads_;
  // Held for the whole of a Stage (before mu_), taken with the stage's deadline. A flag under a
  // mutex + condition variable rather than std::timed_mutex: libstdc++'s timed lock uses
  // pthread_mutex_clocklock, which ThreadSanitizer (GCC 12) does not intercept.
  rc::Mutex gate_mu_;
  rc::CondVar gate_cv_;
  bool stage_busy_ GUARDED_BY(gate_mu_) = false;  // guarded by gate_mu_
  mutable rc::Mutex mu_;
  std::vector<refit::Capture> captures_ GUARDED_BY(mu_);                            // guarded by mu_, per rank
  std::vector<std::vector<refit::DigestRegion>> digest_regions_ GUARDED_BY(mu_);    // guarded by mu_
  // Per rank, the parameter bytes no digest region covers (copied plainly by the fused install).
  std::vector<refit::UncoveredBytes> uncovered_ GUARDED_BY(mu_);                    // guarded by mu_
  // One plan per rank, cached while the stage topology is unchanged (pipeline.h).
  const std::unique_ptr<internal::RankPlans> plans_ PT_GUARDED_BY(mu_);            // guarded by mu_
  std::unique_ptr<Staged> staged_ GUARDED_BY(mu_);                                  // guarded by mu_
  int64_t generation_ GUARDED_BY(mu_) = 0;                                          // guarded by mu_
  // Shadow parameters per rank (name -> bytes in the live parameter's dtype), kept across refits.
  std::vector<std::map<std::string, std::shared_ptr<WeightBuffer>>> shadow_ GUARDED_BY(mu_);  // guarded by mu_
  std::vector<refit::DestinationBuffers> shadow_buffers_ GUARDED_BY(mu_);           // guarded by mu_
  std::unique_ptr<refit::StagingArena> arena_ GUARDED_BY(mu_);                      // guarded by mu_
  // The transport and the imported source descriptors, kept across stages while the source
  // topology (which includes every handle) and the transport name are unchanged; dropped when
  // either changes or a stage fails (SourceImports releases the imports first).
  SourceImports sources_ GUARDED_BY(mu_);                                           // guarded by mu_
  int64_t transports_built_ GUARDED_BY(mu_) = 0;                                    // guarded by mu_
  // Releases a replaced shm transport and its imports (unmapping the old sources: ~40 ms per GB
  // of 4 KiB pages) off the stage's path; joined before the next one starts and at destruction.
  std::thread retiring_ GUARDED_BY(mu_);                                            // guarded by mu_
  refit::TensorDigests live_cache_ GUARDED_BY(mu_);                                 // guarded by mu_
  int64_t live_cache_generation_ GUARDED_BY(mu_) = -1;                              // guarded by mu_
  bool live_cache_valid_ GUARDED_BY(mu_) = false;                                   // guarded by mu_
  std::atomic<bool> fail_after_first_rank_{false};                  // test-only fault
  // Fan-out: the manifest of the version installed last, and what this engine relays.
  std::optional<refit::Manifest> installed_manifest_ GUARDED_BY(mu_);               // guarded by mu_
  std::string installed_model_ GUARDED_BY(mu_);                                     // guarded by mu_
  std::unique_ptr<RelayHolding> relay_ GUARDED_BY(mu_);                             // guarded by mu_
  std::string relay_directory_ GUARDED_BY(mu_);                                     // guarded by mu_
  std::atomic<bool> corrupt_delta_install_{false};                  // test-only fault
  std::unique_ptr<internal::DeltaStaged> delta_staged_ GUARDED_BY(mu_);            // guarded by mu_; set with staged_
  int full_verify_every_ GUARDED_BY(mu_) = 16;                                      // guarded by mu_
  DeltaPolicy delta_policy_ GUARDED_BY(mu_) = DeltaPolicy::kAuto;
  RefitCostModel stage_costs_ GUARDED_BY(mu_);  // measured by every successful stage (KeepStaged)
  int64_t deltas_since_anchor_ GUARDED_BY(mu_) = 0;                                 // guarded by mu_
  // An install failed after it began writing: until a full install proves the live weights
  // again (recovery), no delta is applied on them.
  bool mutated_unproven_ GUARDED_BY(mu_) = false;                                   // guarded by mu_
  // What the staging image holds after the last delta install by swap (nullptr: unknown).
  std::unique_ptr<internal::DeltaChain> delta_chain_ GUARDED_BY(mu_);             // guarded by mu_
  std::atomic<bool> corrupt_previous_delta_{false};                 // test-only fault
  bool swap_q_heads_ GUARDED_BY(mu_) = false;                                       // guarded by mu_; test-only fault
  uint64_t prereplay_seq_ GUARDED_BY(mu_) = 0;  // ids of the staged images pre-replayed (LiveWeights::PreReplay)
  // Metrics: their own mutex, so /metrics never waits for a stage in progress.
  mutable rc::Mutex metrics_mu_;
  StepTimings last_stage_ms_ GUARDED_BY(metrics_mu_);                                       // guarded by metrics_mu_
  StepTimings last_install_ms_ GUARDED_BY(metrics_mu_);                                     // guarded by metrics_mu_
  double last_wire_gbps_ GUARDED_BY(metrics_mu_) = 0;                                       // guarded by metrics_mu_
  uint64_t stages_ok_ GUARDED_BY(metrics_mu_) = 0, stages_failed_ GUARDED_BY(metrics_mu_) = 0;                      // guarded by metrics_mu_
  uint64_t installs_ok_ GUARDED_BY(metrics_mu_) = 0, installs_refused_ GUARDED_BY(metrics_mu_) = 0, installs_failed_ GUARDED_BY(metrics_mu_) = 0;  // guarded by metrics_mu_
  uint64_t bytes_pulled_total_ GUARDED_BY(metrics_mu_) = 0, bytes_installed_total_ GUARDED_BY(metrics_mu_) = 0;    // guarded by metrics_mu_
  std::string stage_running_ GUARDED_BY(metrics_mu_);                                       // guarded by metrics_mu_ ("" when none)
  std::chrono::steady_clock::time_point stage_started_ GUARDED_BY(metrics_mu_);             // guarded by metrics_mu_
};

}  // namespace rc::receiver
