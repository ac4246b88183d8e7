// EngineAdapter: how the lifecycle talks to one inference engine.
//
// Every operation is asynchronous and returns a Pending<Evidence>: the Runner polls it against
// the operation's deadline and abandons it when it overruns (the adapter must keep its own state
// alive until the call returns; see Pending). Evidence must be observed, not assumed: e.g.
// Pause() reads is_paused back, ResetCache() returns the engine's own success flag, ReadLabel()
// reads the label the engine reports.
//
// Stage() is a separate, non-mutating step (pull new weights into staging while the engine
// still serves); Install() is the only call that mutates live weights and is called only while
// the engine is paused.
//
// ProbeIdentity() is the cheap identity read (boot id, label, install generation, the engine's
// cached live digest) that the controller service runs periodically and after every lifecycle
// operation; it never mutates and never computes a digest.
//
// Thread safety: implementations must accept calls from any one thread at a time (the Runner's),
// plus AbortRequests from the Runner only and ProbeIdentity from the controller's driver thread
// (which does not call it while the Runner has an operation in flight); completions may happen
// on any thread.
#pragma once

#include <string>
#include <vector>

#include "rolloutcore/base/pending.h"
#include "rolloutcore/lifecycle/types.h"

namespace rc::lifecycle {

class EngineAdapter {
 public:
  virtual ~EngineAdapter() = default;

  virtual Result<EngineDescription> Describe() = 0;
  virtual Pending<DrainStatus> GetDrainStatus() = 0;
  virtual Pending<PauseEvidence> Pause(PauseMode mode) = 0;
  virtual Pending<AbortEvidence> AbortRequests(const std::vector<std::string>& rollout_ids) = 0;
  virtual Pending<StageEvidence> Stage(const UpdateTarget& target) = 0;
  // `full` asks for a complete re-install (recovery): every parameter is rewritten. An answer
  // from the engine is evidence with its InstallOutcome (a refusal or a failure included); an
  // error means the outcome is unknown (types.h).
  virtual Pending<InstallEvidence> Install(const UpdateTarget& target, bool full) = 0;
  virtual Pending<CacheResetResult> ResetCache(CacheKind kind) = 0;
  virtual Pending<LabelEvidence> ReadLabel() = 0;
  // Only when Describe().offers_content_digest; otherwise Unimplemented.
  virtual Pending<DigestEvidence> ReadContentDigest() = 0;
  virtual Pending<ResumeEvidence> Resume() = 0;
  // Unimplemented when the engine has no way to report its identity.
  virtual Pending<IdentityEvidence> ProbeIdentity() = 0;

  // ---- Policy modes other than strict (docs/lifecycle.md, "Policy modes") ----
  // OK when this engine can run an update in `mode` with exact per-token version spans;
  // otherwise Unimplemented saying why (checked when the update is requested). Strict always is.
  virtual Status SupportsPolicyMode(PolicyMode mode) {
    if (mode == PolicyMode::kStrict) return OkStatus();
    return Unimplemented("this engine cannot run updates in mode '" + std::string(PolicyModeName(mode)) +
                         "': it does not report the token index at which each request's weights changed");
  }
  // The pause of an in-flight update: keep/recompute freeze running requests (their KV kept for
  // keep, re-prefilled under the new weights after the install for recompute), abort ends them.
  // Until the next Resume, ResetCache(kPrefix) must drop every cached block without preempting
  // the frozen requests. Only called for a mode SupportsPolicyMode accepted.
  virtual Pending<PauseEvidence> PauseForUpdate(PolicyMode mode) {
    return Pending<PauseEvidence>::Completed(
        Unimplemented("this engine cannot pause for mode '" + std::string(PolicyModeName(mode)) + "'"));
  }
  // Replay validation (replay.h): runs one probe on the live weights while the engine is paused,
  // on a path that admits no user request (the embedded engine's POST /rc/validate/replay; for
  // vLLM a worker-extension method). Only when Describe().offers_replay; the default answers
  // Unimplemented.
  virtual Pending<ReplayEvidence> Replay(const ReplayRequest& request);
};

}  // namespace rc::lifecycle
