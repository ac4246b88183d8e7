// Runner: executes updates and recoveries against an EngineAdapter, feeding typed evidence to
// the Controller, with a deadline on every adapter call.
//
// The runner is a non-blocking, step-wise machine: Poll() looks at the calls in flight, checks
// their deadlines against the injected Clock, and issues the next call. A driver calls Poll()
// repeatedly — RunToCompletion() does so in real time, the simulator in virtual time — so a
// hung call is detected at its deadline to within one poll interval, and the controller reaches
// TAINTED (mutation may have begun) or READY on the old version (provably no mutation) then.
//
// Update sequence: Stage() (the prefetch, non-mutating) is issued first and RequestUpdate
// (DRAINING) is synced while it runs → poll drain status until the engine is idle AND no binding
// is active (drain policy after the drain deadline: wait | abort | cancel) → Pause (read back; the
// drain's last step) → QUIESCED and UPDATING in one sync (Controller::QuiesceAndBeginInstall) →
// Install → the label and content-digest reads and the cache resets are issued at once (the
// reads only read; the resets are part of the mutation UPDATING authorized) with install_complete
// held → every cache reset confirmed (refusals retried within the reset deadline) → label ==
// target, content digest == target when offered, then every probe of the version replayed on the
// engine (still paused) and compared with the trainer's numbers (replay.h; skipped, and the
// evidence says so, without probes or a replay path) → INVALIDATING, VALIDATING and RESUMING in
// one sync (Controller::ResetAndValidated) → Resume (read back) → READY on the new version. A
// replay that differs taints the engine. Every engine call that changes something (pause,
// install, reset, resume) is issued only once the record that authorizes it is synced (the
// resets: begin_install's). A held record whose phase outlasts the group-commit window is
// journaled on its own then, so /v1/status and a restart see INVALIDATING or VALIDATING.
// Failure classes: stage/drain/pause failure or an install refused with FailedPrecondition ⇒
// READY on the old version (plus a best-effort resume); any other failure after the install was
// issued ⇒ TAINTED.
// In-flight modes (target.mode keep | recompute | abort, docs/lifecycle.md): the adapter must
// accept the mode (SupportsPolicyMode, checked before anything changes); DRAINING waits only for
// the staging, then Controller::QuiesceInFlight records which active rollouts live through the
// update and which it ends (abort mode: all; max_staleness), those are aborted on the engine
// (keep/recompute), then PauseForUpdate freezes (or, abort mode, ends) the running requests and
// the sequence continues as above.
// Recovery: TAINTED → RECOVERING → Pause → full Install → cache resets → label + content digest
// of all live weights → Resume → READY; any failure ⇒ TAINTED.
//
// Thread safety: one thread drives a Runner (StartUpdate/StartRecovery/Poll). The Controller it
// drives may be used by other threads concurrently (admissions, finishes).
#pragma once

#include <chrono>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "rolloutcore/base/clock.h"
#include "rolloutcore/lifecycle/controller.h"
#include "rolloutcore/lifecycle/engine_adapter.h"

namespace rc::lifecycle {

struct RunnerOptions {
  Deadlines deadlines;
  DrainPolicy drain_policy = DrainPolicy::kWait;
  PauseMode pause_mode = PauseMode::kWait;
  int64_t drain_poll_interval_ms = 5;
  int64_t reset_retry_interval_ms = 5;
  int max_reset_attempts = 3;
  bool prefetch = true;  // Stage() while draining
  // In-flight modes: a rollout may live through at most this many updates; the update that would
  // make it more is ended for it (aborted on the engine before the install). -1: no limit.
  int64_t max_staleness = -1;
  // Replay validation (replay.h): < 0 uses the engine's own bound (EngineDescription).
  double replay_tolerance = -1;
  // Group commit (issue 15): QUIESCED is journaled with UPDATING, and VALIDATING with RESUMING, in
  // one sync, when the work between them (the pause; the validation reads and replay) answers
  // within this window; work that takes longer gets its state journaled on its own once the
  // window has passed, so /v1/status and a restart see QUIESCED or VALIDATING while it runs.
  int64_t group_commit_window_ms = 5;
};

class Runner {
 public:
  Runner(Controller* controller, EngineAdapter* adapter, Clock* clock, RunnerOptions options);
  ~Runner();

  // READY → DRAINING and starts the update. FailedPrecondition while another runs.
  Result<UpdateTarget> StartUpdate(UpdateTarget target);
  // Issues the stage of `target` (its label and model) ahead of its update, while the request is
  // still being resolved (the directory lookup): StartUpdate of the same label, model and ordinal
  // adopts the stage in flight (or its answer) instead of staging again; any other StartUpdate,
  // StartRecovery or a later Prefetch drops it. The stage changes nothing the engine serves.
  // Nothing is issued (OK) with prefetch off; FailedPrecondition while an operation runs or when
  // the controller is not READY.
  Status Prefetch(UpdateTarget target);
  // TAINTED → RECOVERING and starts a verified full re-install of `target`.
  Result<UpdateTarget> StartRecovery(UpdateTarget target);
  // Issues a resume whose outcome nobody waits for (after a restart that came back READY from
  // DRAINING/QUIESCED, the engine may still be paused).
  void ResumeBestEffort(const std::string& why);

  // Advances the operation in progress as far as possible without blocking.
  // Returns true while an operation is still in progress.
  bool Poll();
  bool busy() const { return phase_ != Phase::kIdle; }
  // For a driver on real time (the controller service): blocks until one of the calls in flight
  // completes, or up to `max`; then Poll() again. Waits on the first call in flight that has not
  // answered yet (the one the phase needs next: stage, the target's probe fetch while draining,
  // drain status, abort, pause, install, each cache reset, label, digest, replay, resume), so a completion is noticed when its Pending is
  // fulfilled instead of at the next fixed poll. Returns false at once when no call is in flight
  // unanswered (waiting for rollouts to finish, a reset's retry slot): the driver then sleeps.
  // Never touches the Clock; deadlines are still checked by Poll.
  bool WaitForProgress(std::chrono::microseconds max);
  // Blocks (sleeping on the clock in small steps) until the operation ends; returns its record.
  Result<UpdateRecord> RunToCompletion();
  // Notes about the operation (deadline passes, retries, best-effort resume results).
  const std::vector<std::string>& notes() const { return notes_; }
  const RunnerOptions& options() const { return options_; }

 private:
  enum class Phase { kIdle, kDraining, kInFlightAborting, kPausing, kInstalling, kResetting, kValidating, kResuming,
                     kRecoverPausing, kRecoverInstalling, kRecoverResetting, kRecoverValidating,
                     kRecoverResuming, kRejectResuming, kRecordRetrying };
  template <typename T>
  struct Call {
    std::optional<Pending<T>> pending;
    int64_t deadline_ms = 0;
    bool active() const { return pending.has_value(); }
    // In flight and not answered: blocks up to `max` for the answer and returns true.
    bool WaitIfUnanswered(std::chrono::microseconds max) const {
      if (!pending || pending->Ready()) return false;
      (void)pending->WaitFor(max);
      return true;
    }
    bool AnsweredNow() const { return pending && pending->ReadyNow(); }
    void Start(Pending<T> p, int64_t deadline) { pending = std::move(p); deadline_ms = deadline; }
    void Clear() { pending.reset(); }
  };

  int64_t Now() const { return clock_->NowMs(); }
  std::string reject_reason_;          // kRejectResuming: why the update was given up
  bool reject_install_refused_ = false;  // kRejectResuming: the install refused before mutation
  bool reject_resumed_ = false;          // kRejectResuming: a resume answered that the engine runs
  // True when a call in flight has answered (no lock, no wait).
  bool AnyAnswered() const;
  void Finish();
  // An update given up before any weight changed. Before the engine was paused: back to READY
  // at once. After (or during) the pause: kRejectResuming resumes and goes back to READY only once
  // the resume answered that the engine is not paused; a pause given up at its deadline gets one
  // more pause deadline to land, and if it does the engine is resumed again after it. A resume
  // that fails, overruns or leaves it paused gives READY, then TAINTED naming why (READY while the
  // engine stays paused would hang every rollout admitted).
  void RejectAndResume(const std::string& reason, bool install_refused);
  void StepRejectResuming();
  // The journal refused the record that ends the operation (the taint, the rejection): the disk
  // is full or read-only. The state has not moved (the journal comes first), so nothing is
  // admitted meanwhile; kRecordRetrying writes it again every kRecordRetryMs, logging an error,
  // until the journal takes it (or the state no longer allows it).
  // taints: the record ends in a taint (AfterTaint follows it).
  void RetryRecordLater(const std::string& what, std::function<Status()> record, bool taints);
  void StepRecordRetrying();
  // After a taint was recorded: aborts the frozen rollouts it ended, then Finish.
  void AfterTaint();
  static constexpr int64_t kRecordRetryMs = 100;
  std::string record_what_;
  std::function<Status()> record_;
  int64_t record_next_ms_ = 0;
  int64_t record_attempts_ = 0;
  bool record_taints_ = false;
  // Journals the rejection (READY), then, when `taint_why` is set, the taint that follows it.
  void FinishReject(const std::optional<std::string>& taint_why);
  // call_failed: a call failed or overran (Controller::Taint); not evidence against the version.
  void TaintWith(const std::string& reason, bool call_failed = false);
  // Journals the held install_complete on its own (the group-commit window passed, or a taint
  // follows); OK when none is held.
  Status JournalHeldInstall();
  // Journals the held install once the group-commit window since it answered has passed; false
  // (and the runner tainted) when journaling it failed.
  bool JournalHeldInstallAfterWindow(int64_t now);
  void Note(const std::string& text);
  void IssueResets();
  void IssueValidation();
  void StepDraining();
  // A value the drain waits for (UpdateTarget::facts_fetch, request_journaled): moved into
  // *value once it answered. A failure (`failed` + the error) or no answer within the stage
  // deadline (`what` overran ...) rejects the update, nothing paused, and returns false.
  template <typename T>
  bool TakeBeforeTheDrainEnds(std::optional<Pending<T>>& pending, int64_t now, T* value, const std::string& failed,
                              const std::string& what);
  void StepQuiescingInFlight(int64_t now);
  void StepAbortingInFlight();
  void StepPausing(bool recovery);
  void StepInstalling(bool recovery);
  void StepResetting(bool recovery);
  void StepValidating(bool recovery);
  // Runs the target's probes one after another; true once every answer is in (or none is due).
  // Taints (and returns false) when a replay call fails or overruns.
  bool StepReplay();
  ReplayOutcome MakeReplayOutcome() const;
  void StepResuming(bool recovery);

  Controller* controller_;
  EngineAdapter* adapter_;
  Clock* clock_;
  RunnerOptions options_;
  EngineDescription description_;

  Phase phase_ = Phase::kIdle;
  UpdateTarget target_;
  int64_t started_ms_ = 0;
  int64_t next_drain_poll_ms_ = 0;
  bool drain_deadline_noted_ = false;
  bool stage_done_ = false;
  // The stage Prefetch issued while idle (stage_call_), for the StartUpdate that may adopt it.
  struct Prefetched {
    std::string label, model;
    int64_t ordinal = 0;
  };
  std::optional<Prefetched> prefetched_;
  bool abort_issued_ = false;
  std::vector<std::string> abort_ids_;
  int64_t reset_deadline_ms_ = 0;
  std::vector<int> reset_attempts_;
  std::vector<std::optional<CacheResetResult>> reset_results_;
  // The last drain status of this drain, when it saw the engine idle with no binding active.
  std::optional<DrainStatus> idle_seen_;
  // A strict drain ends with the pause: the idle drain status it was issued on, and when.
  std::optional<DrainStatus> drained_;
  int64_t pause_issued_ms_ = 0;
  // The install's evidence, not journaled yet (install_complete goes with caches_reset and
  // validated): when it answered.
  std::optional<InstallEvidence> install_held_;
  int64_t install_done_ms_ = 0;
  // Every cache reset answered, not journaled yet (it goes with validated): when the last answered.
  bool resets_held_ = false;
  int64_t resets_done_ms_ = 0;
  std::optional<InstallEvidence> install_evidence_;
  std::optional<LabelEvidence> label_evidence_;
  std::optional<DigestEvidence> digest_evidence_;
  std::vector<ReplayEvidence> replay_evidence_;  // per probe, in order
  // Probes computed under another quantization than the engine serves (ReplayProbe::quantization),
  // left out of the replay when it starts; the first one's quantization, for the skip reason.
  bool probes_selected_ = false;
  int64_t probes_other_quantization_ = 0;
  std::string other_quantization_;
  int64_t replay_started_ms_ = -1;
  int64_t replay_ended_ms_ = -1;
  std::vector<std::string> notes_;
  // When Poll last saw the phase change (real time: WaitForProgress spins only early in a phase).
  Phase spin_phase_ = Phase::kIdle;
  std::chrono::steady_clock::time_point phase_since_{};

  Call<DrainStatus> drain_call_;
  Call<StageEvidence> stage_call_;
  Call<AbortEvidence> abort_call_;
  Call<PauseEvidence> pause_call_;
  Call<InstallEvidence> install_call_;
  std::vector<Call<CacheResetResult>> reset_calls_;
  Call<LabelEvidence> label_call_;
  Call<DigestEvidence> digest_call_;
  Call<ReplayEvidence> replay_call_;
  Call<ResumeEvidence> resume_call_;
  std::vector<Pending<ResumeEvidence>> background_resumes_;
  // Aborts of the rollouts a taint ended (Controller::Taint), issued after the taint is journaled;
  // nobody waits for them (a recovery's own pause aborts whatever is left).
  std::vector<Pending<AbortEvidence>> background_aborts_;
};

}  // namespace rc::lifecycle
