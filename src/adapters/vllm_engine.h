// VllmEngine: vLLM 0.26.x or 0.33.x with rolloutcore's worker extension, as an engine kind
// (rolloutcore/adapters/blocking_engine.h; internal to rc::adapters). It drives vLLM's own
// endpoints (/pause, /is_paused, /resume, /reset_*_cache, /metrics, /v1/completions; on 0.33 also
// /update_weight_version and /weight_info) and rolloutcore's worker extension through POST
// /collective_rpc, with the protocol of docs/vllm.md: rc_describe, rc_stage, rc_install, rc_label,
// rc_digest, rc_frozen, one result per worker (TP rank).
//
// The release is read from GET /version at every Describe (a vLLM restarted on another release is
// seen at once, and the release is part of the identity ProbeIdentity reports). What differs:
//  * 0.26: no weight label of vLLM's own, no per-token versions: strict and abort updates only.
//  * 0.33: vLLM's own label is set to rolloutcore's while still paused after the install
//    (POST /update_weight_version) and read back at VALIDATING (GET /weight_info, required equal
//    to the extension's label; both journaled); rollouts ask for return_weight_versions and their
//    weight_versions become the rollout's version spans (the controller checks them against the
//    binding); keep and recompute updates run (PauseForUpdate), with the swap index of every
//    frozen request read from the worker (rc_frozen) and cross-checked against vLLM's spans.
//    A request that reaches a 0.33 paused by /pause in wait/abort mode is refused with 503 (0.26
//    queued it): the rollout fails with Unavailable and is recorded so (never served late).
//
// Evidence is observed, never assumed:
//  * the canary prompt is warmed before every update (in Stage, or in Pause when no Stage ran
//    this cycle) by sending it twice; the second answer must report cached tokens, else the
//    post-resume check cannot fail and is recorded as "unable to verify";
//  * after the resume (in a cycle whose prefix cache was reset) the canary must report 0 cached
//    tokens, else DataLoss (stale prefix KV survived: the controller taints);
//  * /reset_prefix_cache's {"success"} is checked and refusals are retried with bounded backoff;
//    /reset_mm_cache and /reset_encoder_cache answer an empty 200 and are recorded unverified;
//  * the drain rule of Pause is documented at VllmEngine::Pause;
//  * Install stages first when no Stage staged the target this cycle (prefetch off) or in a
//    recovery; a failed stage there is a refusal before mutation (a stage touches nothing live);
//  * the label and digest read right after an install come from rc_install's own reply (the
//    extension sets the label in rc_install and returns what rc_label and rc_digest(fresh=false)
//    would), when every rank's reply carries them; otherwise rc_label / rc_digest are called.
//  * with native_transfer (--vllm-transfer native-nccl) Stage is a preflight of the trainer's
//    sender and Install runs vLLM's own start/update/finish_weight_update session, the sender's
//    broadcast concurrent with /update_weights, then rc_adopt, which sets the label only when a
//    fresh live digest equals the manifest's (VllmEngine::NativeInstall; docs/vllm.md).
// A cycle starts at Describe() (the Runner calls it at the start of every update and recovery).
//
// Thread safety: all methods may be called from any thread, concurrently (the Runner may abandon
// a call at its deadline and issue the next one while the first still runs); the cycle state is
// guarded by mu_.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "adapters/engine_http.h"
#include "rolloutcore/adapters/blocking_engine.h"
#include "rolloutcore/adapters/http_adapter.h"
#include "rolloutcore/base/json.h"
#include "rolloutcore/base/mutex.h"
#include "rolloutcore/lifecycle/types.h"

namespace rc::adapters::internal {

// The vLLM releases with a behaviour of their own (see the header).
enum class VllmRelease { k026, k033 };

// The release a GET /version string names: 0.26.x and 0.33.x; another is FailedPrecondition naming
// it and the supported ones, unless allow_untested (then the nearest: below 0.33 → 0.26, else 0.33).
Result<VllmRelease> VllmReleaseOf(const std::string& version, bool allow_untested, const std::string& where);

class VllmEngine final : public BlockingEngine {
 public:
  // `trainer_call` reaches the native sender (native_transfer only; may be empty otherwise). It
  // is used from detached threads, so it must not refer to the engine (copy what it needs).
  VllmEngine(HttpAdapterOptions options, HttpCall call, HttpCall trainer_call = nullptr);

  // GET /version (the release), then rc_describe on every worker; FailedPrecondition naming the
  // `vllm serve` flags when the extension (or dev mode) is missing, naming the release when it is
  // not supported. Starts a new cycle (forgets the canary warm-up).
  Result<lifecycle::EngineDescription> Describe() override;
  // Running/waiting from /metrics; a non-zero reading is refreshed by one probe request first
  // (see the rule at the definition).
  Result<lifecycle::DrainStatus> Drain() override;
  Result<lifecycle::PauseEvidence> Pause(lifecycle::PauseMode mode) override;
  // strict and abort on every release (/pause?mode=wait|abort: an aborted request's tokens were
  // all generated before the pause, so its one span is exact). keep and recompute on 0.33 only:
  // vLLM 0.26 reports no per-request token index at which the weights changed, so their spans
  // could not be exact (Unimplemented naming the mode and the release).
  Status SupportsPolicyMode(lifecycle::PolicyMode mode) override;
  Result<lifecycle::PauseEvidence> PauseForUpdate(lifecycle::PolicyMode mode) override;
  // POST /abort_requests with vLLM's ids of the rollouts (cmpl-<rollout id>-0); never an empty
  // list (vLLM aborts every request then).
  Result<lifecycle::AbortEvidence> AbortRequests(const std::vector<std::string>& rollout_ids) override;
  Result<lifecycle::StageEvidence> Stage(const lifecycle::UpdateTarget& target) override;
  Result<lifecycle::InstallEvidence> Install(const lifecycle::UpdateTarget& target, bool full) override;
  Result<lifecycle::CacheResetResult> ResetCache(lifecycle::CacheKind kind) override;
  Result<lifecycle::LabelEvidence> ReadLabel() override;
  Result<lifecycle::DigestEvidence> ReadContentDigest() override;
  Result<lifecycle::ResumeEvidence> Resume() override;
  // rc_replay on every worker (while paused and drained): a greedy continuation through vLLM's
  // own model runner, never through the scheduler. Rank 0's numbers; every rank must have
  // sampled the same tokens (DataLoss otherwise).
  Result<lifecycle::ReplayEvidence> Replay(const lifecycle::ReplayRequest& request) override;
  // rc_label on every worker (label, install generation, boot id, cached digest; the workers
  // must agree, DataLoss otherwise). The boot id also names the release (GET /version), and on
  // 0.33 the label is also vLLM's own (GET /weight_info): a disagreement is DataLoss.
  Result<lifecycle::IdentityEvidence> ProbeIdentity() override;
  // One rollout. On 0.33 it asks for return_weight_versions and turns vLLM's weight_versions into
  // the choice's version_spans (docs/controller.md; kv from the update mode that changed the
  // label, the swap index rc_frozen reported at that update's pause); an answer without them is
  // kept as it is and fails the controller's span check. A 503 (0.33 paused) is Unavailable.
  Result<Json> Complete(const Json& body) override;

  // Sends the canary twice; the evidence says whether the post-resume check can fail. `where`
  // ("stage", "pause") is recorded.
  Result<Json> WarmCanary(const std::string& where);

  // POST /collective_rpc {method, kwargs}; one result object per worker. The extension or dev
  // mode missing → FailedPrecondition naming the flags; the request rejected (400/422) →
  // FailedPrecondition (the method did not run); the method raised (500) → Internal.
  Result<std::vector<Json>> CollectiveRpc(const std::string& method, const Json& kwargs, int64_t timeout_ms);

 private:
  // What an update that changed vLLM's label did to the requests it froze (keep/recompute).
  struct LabelChange {
    lifecycle::PolicyMode mode = lifecycle::PolicyMode::kStrict;
    std::map<std::string, int64_t> swap_index;  // rollout id → output tokens at the pause
  };

  Result<Json> PostJson(const std::string& path, const std::string& body);
  Result<bool> IsPaused();
  Result<lifecycle::DrainStatus> Gauges();  // the /metrics gauges as they are (no probe)
  Result<int64_t> Canary();                 // sends the canary once: the cached prompt tokens vLLM reports
  Result<Json> StageWorkers(const lifecycle::UpdateTarget& target, int64_t* bytes);
  Result<std::string> ReadVersion();         // GET /version
  Result<std::string> ReadWeightInfo();      // 0.33: GET /weight_info's weight_version
  Status SetWeightVersion(const std::string& label);  // 0.33: POST /update_weight_version
  Result<Json> Frozen();                      // rc_frozen on rank 0, rollout ids matched
  bool Is033() const;
  // The release (GET /version) and, on 0.33, the served label, when no Describe read them yet.
  Status EnsureRelease();
  // The native path (native_transfer). NativePreflight: GET the sender's state and the version's
  // update_info (nothing in vLLM touched). NativeInstall: the whole session, see the definition;
  // its steps below.
  Result<Json> NativePreflight(const lifecycle::UpdateTarget& target);
  Result<lifecycle::InstallEvidence> NativeInstall(const lifecycle::UpdateTarget& target, bool full);
  struct NativeInstallLog;  // the session's start, calls and evidence detail so far
  // Steps 1 and 2 (nothing in vLLM touched): the target's digest, the sender's update_info for
  // the version (this cycle's Stage's, else fetched now) and the weight-transfer group. Why the
  // install is refused, or none (then *update_info is set).
  std::optional<std::string> NativePrepare(const lifecycle::UpdateTarget& target, bool full, NativeInstallLog* log,
                                           Json* update_info);
  // The evidence of an install refused before /start_weight_update (a recovery: the error).
  static Result<lifecycle::InstallEvidence> NativeRefused(const lifecycle::UpdateTarget& target, bool full,
                                                          NativeInstallLog* log, const std::string& why);
  // The evidence of a failure from /start_weight_update on (failed_after_mutation), after the
  // cleanup (finish, restore, fresh digest) when every call answered (`update_answered`).
  Result<lifecycle::InstallEvidence> NativeFailedAfter(const lifecycle::UpdateTarget& target, NativeInstallLog* log,
                                                       bool update_answered, const std::string& why);
  // Steps 4 to 6, after /start_weight_update succeeded: the concurrent send and
  // /update_weights, /finish_weight_update, and rc_adopt's proof.
  Result<lifecycle::InstallEvidence> NativeSendAndAdopt(const lifecycle::UpdateTarget& target, const Json& update_info,
                                                        NativeInstallLog* log);
  // rc_stage (when needed) + rc_install through the extension (the default transfer).
  Result<lifecycle::InstallEvidence> ExtensionInstall(const lifecycle::UpdateTarget& target, bool full);
  Result<Json> NativeInitGroup(const Json& trainer_state, int64_t workers, Json* calls);

  const HttpAdapterOptions options_;  // vLLM-only settings in options_.vllm
  HttpCall call_;
  HttpCall trainer_call_;

  mutable rc::Mutex mu_;
  std::string served_model_ GUARDED_BY(mu_);  // from GET /v1/models at Describe (for the canary)
  std::string version_ GUARDED_BY(mu_);       // GET /version at the last Describe ("" before)
  std::string current_label_ GUARDED_BY(mu_);  // the label vLLM serves (Describe, installs; "" unknown)
  VllmRelease release_ GUARDED_BY(mu_) = VllmRelease::k026;
  bool untested_ GUARDED_BY(mu_) = false;     // started with allow_untested_version on another release
  std::optional<Json> warmup_ GUARDED_BY(mu_);  // this cycle's canary warm-up evidence
  bool prefix_reset_done_ GUARDED_BY(mu_) = false;  // this cycle's prefix cache reset succeeded
  std::string staged_version_ GUARDED_BY(mu_);  // the version this cycle's Stage staged ("" none)
  // This cycle's policy mode (PauseForUpdate) and the requests its pause froze (rc_frozen).
  lifecycle::PolicyMode cycle_mode_ GUARDED_BY(mu_) = lifecycle::PolicyMode::kStrict;
  Json cycle_frozen_ GUARDED_BY(mu_);
  // label → what the keep/recompute update that set it did (for the spans of rollouts that lived
  // through it); bounded to the last kMaxLabelChanges labels.
  std::map<std::string, LabelChange> label_changes_ GUARDED_BY(mu_);
  std::vector<std::string> label_order_ GUARDED_BY(mu_);
  // Every rank's rc_install reply of this cycle's install, when each carries the label,
  // generation and digest fields rc_label / rc_digest(fresh=false) would answer: ReadLabel and
  // ReadContentDigest use it once instead of two more round trips inside the pause.
  std::optional<std::vector<Json>> install_replies_ GUARDED_BY(mu_);
  // rc_describe's install.atomic.available at the last Describe (one worker only): rc_install can
  // reach vLLM's engine core (options_.vllm.fold_engine_calls).
  bool engine_side_available_ GUARDED_BY(mu_) = false;
  // This cycle's rc_install engine-side report when the install folded the cache resets and vLLM's
  // label into its call (rc_install's "atomic"); ResetCache and Install then make no further call.
  std::optional<Json> folded_ GUARDED_BY(mu_);
  std::string boot_id_ GUARDED_BY(mu_);                   // rank 0's boot_id at the last Describe
  std::string native_group_boot_ GUARDED_BY(mu_);         // the vLLM boot the adapter formed the group with
  std::optional<Json> native_preflight_ GUARDED_BY(mu_);  // this cycle's NativePreflight (for staged_version_)
  lifecycle::DrainStatus last_gauges_ GUARDED_BY(mu_);
  std::chrono::steady_clock::time_point gauges_since_ GUARDED_BY(mu_){};  // last_gauges_ first seen
  std::chrono::steady_clock::time_point last_gauge_probe_ GUARDED_BY(mu_){};
};

// vLLM's internal id of a rollout's request (/v1/completions with "request_id": R): "cmpl-R-0"
// followed by "-" and 8 random characters (0.26 and 0.33; docs/vllm.md). The rollout id, or "" when
// `internal` is not of that form.
std::string RolloutIdOfVllmRequest(const std::string& internal);

// vLLM 0.33's weight_versions of a choice ([{version, start, end}]) as version spans
// ([{from_token, to_token, label, reported_by_engine}]); InvalidArgument when malformed.
Result<Json> SpansFromWeightVersions(const Json& weight_versions);

// A worker's {"ok": false, "code", "error"} as a Status ("vLLM at URL rank R: METHOD: error");
// OK when ok is true. An unknown or missing code is Internal.
Status WorkerStatus(const Json& result, size_t rank, const std::string& method, const std::string& where);

// Maps rc_install's per-worker outcomes to the lifecycle's install contract (one place, so it
// can switch to a typed InstallOutcome): every worker refused_untouched → FailedPrecondition
// (nothing live was written: READY on the old version); every worker installed with one label
// and generation → InstallEvidence; anything else (failed_after_mutation, a mix, a missing or
// unknown outcome) → Internal (the weights are in an unknown state: taint).
Result<lifecycle::InstallEvidence> InstallEvidenceFromOutcomes(const std::vector<Json>& workers,
                                                               const std::string& version, const std::string& where);

// Combines rc_digest results of the TP ranks into the content digest (16 hex digits): one
// worker → its content_digest; several → per tensor, all ranks `full` → equal sums, else the
// partial sums added mod 2^64 with element counts adding up to the tensor's `numel` (or the
// elements of a full rank); then refit::CombineTensorDigests in name order. DataLoss on any
// disagreement.
Result<std::string> CombineWorkerDigests(const std::vector<Json>& workers, const std::string& where);

}  // namespace rc::adapters::internal
