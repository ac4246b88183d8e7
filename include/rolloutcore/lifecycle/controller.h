// Controller: the pure lifecycle state machine of one engine.
//
// It owns the state, the committed version, the rollout bindings and the update records, and
// it checks typed evidence against each operation's postcondition before it moves. It has no
// threads, sockets or engine of its own: the Runner calls the engine and feeds the evidence in.
//
// Rules it enforces:
//  * Admission only in READY; elsewhere Admit fails with Unavailable (retryable while an update
//    runs, not retryable-soon while TAINTED) and nothing changes.
//  * Every transition follows NextState() (state.h); an illegal one returns FailedPrecondition
//    and changes nothing. Evidence that fails its postcondition also changes nothing.
//  * DRAINING → QUIESCED needs BOTH the engine reporting no work AND zero active bindings.
//  * Every transition, admission and finish is appended to the journal (and synced) before it
//    takes effect; if the journal refuses, the operation fails and nothing changes.
//  * Group commit: a record that authorizes nothing (the stage evidence) is not synced on its
//    own; it is held and written in one batch (one sync) with the next record, before that
//    record's effect, and applied (visible in the update record) only then. A crash before the
//    batch loses only evidence of an update that has not mutated anything (it comes back READY).
//    Transitions into a state that has no effect of its own go in one batch with the next one:
//    DRAINING → QUIESCED → UPDATING (the pause is the strict drain's last step, QuiesceAndBeginInstall)
//    and UPDATING → INVALIDATING → VALIDATING → RESUMING (the cache resets are part of the
//    mutation begin_install authorized, validation only reads: ResetAndValidated); every batch is
//    durable before the effect of its last state (the install; the resume).
//  * Open() rebuilds from the journal: an update that began UPDATING (or a recovery) without a
//    commit record comes back TAINTED; one still DRAINING/QUIESCED comes back READY on the old
//    version; bindings active at the crash are journaled as interrupted, never dropped.
//
// Thread safety: every public method may be called from any thread; one mutex (mu_) guards
// state, version, bindings and records, and is held across the journal append so the journal
// order is the effect order.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "rolloutcore/base/clock.h"
#include "rolloutcore/base/mutex.h"
#include "rolloutcore/lifecycle/journal.h"
#include "rolloutcore/lifecycle/state.h"
#include "rolloutcore/lifecycle/types.h"

namespace rc::lifecycle {

enum class UpdateOutcome { kInProgress, kCommitted, kRejected, kTainted };
std::string_view UpdateOutcomeName(UpdateOutcome o);

// One update or recovery as the controller saw it.
struct UpdateRecord {
  int64_t ordinal = 0;
  bool recovery = false;
  UpdateTarget target;
  WeightVersion from_version;
  UpdateOutcome outcome = UpdateOutcome::kInProgress;
  std::string reason;                  // why it was rejected / tainted
  std::string phase;                   // current (or last) state name
  std::map<std::string, int64_t> phases_ms;  // ms spent in each state, by state name
  int64_t requested_ms = 0;
  int64_t ended_ms = -1;
  Json evidence = Json::object();      // evidence accepted, by event name
  // For a tainted update: the state it was tainted from ("VALIDATING": the new version's evidence
  // failed — its label, digest or replay — not the call that carried it).
  std::string tainted_from;
  // Tainted because a call failed or overran (the engine, not the version's evidence): e.g. the
  // digest read overran in VALIDATING. Such a taint says nothing against the version.
  bool taint_call_failed = false;
};
Json ToJson(const UpdateRecord& u);

struct Counters {
  int64_t admissions = 0;
  int64_t refusals = 0;
  int64_t finishes = 0;
  int64_t aborted_by_drain = 0;
  int64_t interrupted = 0;
  int64_t updates_committed = 0;
  int64_t updates_rejected = 0;
  int64_t updates_tainted = 0;
  int64_t recoveries = 0;
  int64_t taints = 0;  // every move to TAINTED (an update's, a recovery's, an identity check's)
  std::map<std::string, int64_t> updates_by_mode;   // committed updates by PolicyModeName
  // Outcomes, counted from finish records (what the trajectory rows say), never from an update's
  // intent: a rollout the update meant to end may have finished first (issue 36 #6).
  int64_t inflight_spans = 0;        // version boundaries inside finished rollouts' outputs (spans - 1)
  int64_t aborted_at_update = 0;     // finished rollouts whose record says an update ended them
  std::map<std::string, int64_t> phase_ms_total;  // by state name
  std::map<std::string, int64_t> phase_count;
};
Json ToJson(const Counters& c);

// What a journal record of the controller says happened (JournalRecord::event, parsed once): a
// lifecycle transition (kTransition, with its Event), a restart normalization (kRestart: a state
// change that is not an Event), or a record about a rollout or an update's evidence that moves no
// state.
enum class RecordKind { kTransition, kRestart, kAdmit, kFinish, kAbortedByDrain, kInterrupted, kStaged };
struct RecordEvent {
  RecordKind kind = RecordKind::kTransition;
  Event event = Event::kInitialize;  // meaningful for kTransition only
};
// "admit", "finish", "aborted_by_drain", "interrupted", "staged", "restart", or an EventName
// ("request_update", ...); InvalidArgument naming the unknown name otherwise.
Result<RecordEvent> ParseRecordEvent(std::string_view name);
std::string_view RecordEventName(RecordEvent e);

// What Open() found in the journal.
struct RestoreSummary {
  bool restored = false;               // the journal had records
  State state_at_crash = State::kUninitialized;
  State state_now = State::kUninitialized;
  std::vector<std::string> interrupted;  // rollouts recorded interrupted
  bool engine_may_be_paused = false;     // the caller should resume (READY) or recover (TAINTED)
};

// What in-flight updates did to one active rollout (policy modes other than strict).
struct InFlightRecord {
  std::vector<int64_t> spanned;  // ordinals of the updates it lived through, in order
  // Set when an update ended it: {"update": ordinal, "target": label, "reason": "mode_abort" |
  // "max_staleness", "max_staleness": K}.
  Json aborted_at_update = nullptr;
};

class Controller {
 public:
  // Opens a controller over `journal`, restoring from its records if there are any.
  // `clock` and `journal` must outlive the controller.
  static Result<std::unique_ptr<Controller>> Open(const Clock* clock, Journal* journal,
                                                  RestoreSummary* summary = nullptr);

  // ---- Observers ----
  State state() const;
  WeightVersion version() const;
  WeightIdentity identity() const;
  std::optional<UpdateTarget> pending_target() const;  // update or recovery in progress
  int64_t active_count() const;
  std::vector<std::string> ActiveRolloutIds() const;
  std::optional<RolloutBinding> Binding(const std::string& rollout_id) const;
  std::vector<UpdateRecord> Updates() const;
  std::optional<UpdateRecord> Update(int64_t ordinal) const;
  Counters counters() const;

  // ---- Rollouts ----
  // UNINITIALIZED → READY with the version the engine serves at start.
  Status Initialize(const WeightVersion& version, const WeightIdentity& identity);
  // Binds a rollout to the committed version; empty id → a fresh "r-<n>" id. `lease`: the
  // client generates itself (RolloutBinding::lease; journaled with the admission).
  Result<RolloutBinding> Admit(const std::string& rollout_id, bool lease = false);
  // Ends a binding. NotFound for an unknown (or interrupted) rollout.
  Status Finish(const std::string& rollout_id, const Json& detail = Json::object());
  // Why a rollout this controller admitted is no longer active (recorded interrupted at a restart,
  // aborted by the drain policy); nullopt when it is active or unknown here.
  std::optional<std::string> WhyNotActive(const std::string& rollout_id) const;
  // Ends bindings because the drain policy aborted them on the engine (DRAINING only).
  Status AbortForDrain(const std::vector<std::string>& rollout_ids, const AbortEvidence& evidence);

  // What in-flight updates did to an active rollout; nullopt when none touched it.
  std::optional<InFlightRecord> InFlight(const std::string& rollout_id) const;
  // Active leases (RolloutBinding::lease) that an update ended (InFlightRecord::aborted_at_update
  // set): each with that record. The service ends them (row, then finish) as it finds them.
  std::vector<std::pair<std::string, Json>> LeasesEndedByUpdate() const;
  // True when the drain policy aborted `rollout_id` (AbortForDrain): it is no longer active.
  bool AbortedByDrain(const std::string& rollout_id) const;

  // ---- Update path (each needs the evidence of its postcondition) ----
  // The target RequestUpdate would record (its ordinal assigned), checked as RequestUpdate checks
  // it, without recording anything: the Runner issues the prefetch with it before the sync.
  Result<UpdateTarget> PrepareUpdate(UpdateTarget target) const;
  // READY → DRAINING. A target that already carries an ordinal (from PrepareUpdate) must still
  // be the next one (FailedPrecondition otherwise: another update was requested in between).
  Result<UpdateTarget> RequestUpdate(UpdateTarget target);
  // DRAINING → QUIESCED; drained_ms >= 0: when it happened (the pause was issued), else now.
  Status DrainComplete(const DrainStatus& engine, int64_t drained_ms = -1);
  // DRAINING → QUIESCED for an update whose mode is not strict: admissions are closed, the
  // active rollouts stay. Each is recorded as living through this update, or as ended by it
  // (every one in abort mode; in keep/recompute mode those that already lived through
  // max_staleness updates, when max_staleness >= 0). Returns the ids it ends; the runner aborts
  // them on the engine before the install. FailedPrecondition for a strict update.
  Result<std::vector<std::string>> QuiesceInFlight(const DrainStatus& engine, int64_t max_staleness);
  Status BeginInstall(const PauseEvidence& pause);                // QUIESCED → UPDATING
  // Group commit of a strict drain's end (issue 15): DRAINING → QUIESCED → UPDATING in one batch
  // (one sync, with the held stage evidence), once the engine answered the pause that ended the
  // drain: the pause is the drain's last step, QUIESCED has no effect of its own, and the batch is
  // durable before the install it authorizes. `drain` is the idle drain status on which the pause
  // was issued at `pause_issued_ms` (the drain_complete record's time, so QUIESCED and the pause
  // window begin at the pause); `pause` is its answer. Checked as DrainComplete and BeginInstall
  // check their evidence; FailedPrecondition for an update that is not strict. On error nothing
  // was appended.
  Status QuiesceAndBeginInstall(const DrainStatus& drain, int64_t pause_issued_ms, const PauseEvidence& pause);
  // UPDATING → INVALIDATING: the install evidence says installed, for the target label.
  // install_ms >= 0: when the install answered (the record's time), else now.
  Status InstallComplete(const InstallEvidence& install, int64_t install_ms = -1);
  // INVALIDATING → VALIDATING: every cache in `required` reset with success. reset_ms >= 0: when
  // the last reset answered (the record's time), else now.
  Status CachesReset(const std::vector<CacheResetResult>& results, const std::vector<CacheKind>& required,
                     int64_t reset_ms = -1);
  // VALIDATING → RESUMING: label == target; digest == target when the engine offers one; and
  // the replay of the version's probes matched (or was skipped, which the evidence says).
  Status Validated(const LabelEvidence& label, const std::optional<DigestEvidence>& digest,
                   bool digest_offered, const ReplayOutcome& replay = {});
  // Group commit of [UPDATING →] INVALIDATING → VALIDATING → RESUMING (issue 15). The cache
  // resets belong to the mutation begin_install authorized (a crash anywhere after it restarts
  // TAINTED, whatever of install_complete was synced), and the validation reads change nothing:
  // so install_complete (when `install` is given: held by the Runner, timed `install_ms`),
  // caches_reset (timed `reset_ms`, when the last reset answered) and validated go in one batch,
  // durable before the resume they authorize. When the install's and the resets' evidence holds
  // and the validation's does not, install_complete and caches_reset are appended and the
  // validation's error returned (the caller taints from VALIDATING, as after Validated). When the
  // install's or the resets' evidence fails, nothing is appended.
  Status ResetAndValidated(const std::optional<InstallEvidence>& install, int64_t install_ms,
                           const std::vector<CacheResetResult>& results, const std::vector<CacheKind>& required,
                           int64_t reset_ms, const LabelEvidence& label, const std::optional<DigestEvidence>& digest,
                           bool digest_offered, const ReplayOutcome& replay = {});
  Status Resumed(const ResumeEvidence& resume);                   // RESUMING → READY (commit)
  // DRAINING | QUIESCED | UPDATING → READY on the old version. From UPDATING only when the
  // engine refused the install before mutating (install_refused_before_mutation).
  Status RejectBeforeMutation(const std::string& reason, bool install_refused_before_mutation);
  // Records the staging (prefetch) evidence of the update in progress; legal while DRAINING or
  // QUIESCED (staging never touches live weights). Not a transition: it authorizes no engine call,
  // so it is journaled in one batch with the next record (group commit, above) and shows in the
  // update record from then on.
  Status RecordStageEvidence(const StageEvidence& stage);
  // → TAINTED from UPDATING..RESUMING or RECOVERING (an update or recovery failed after
  // mutation may have begun), or from READY (the engine's identity no longer matches the
  // committed version: it restarted, or its label or weights changed behind the controller).
  // An in-flight update (keep | recompute | abort) tainted after its pause ends, in the same
  // record, every active rollout it had not ended yet (aborted_at_update, reason
  // "update_tainted"): they were frozen on an engine whose weights are now unproven; the runner
  // then aborts them on the engine, and a recovery does not wait for them.
  // call_failed: the taint comes from a call that failed or overran (an engine fault), not from
  // evidence that contradicts the version (UpdateRecord::taint_call_failed).
  Status Taint(const std::string& reason, bool call_failed = false);
  // Taint, only from READY (FailedPrecondition otherwise, nothing recorded): for what a check of
  // a READY engine found, which means nothing once an update has begun (e.g. paused by it).
  Status TaintIfReady(const std::string& reason);
  // The rollouts Taint ended for the update it closed (empty unless the last taint did).
  std::vector<std::string> EndedByLastTaint() const;

  // ---- Recovery ----
  Result<UpdateTarget> BeginRecovery(UpdateTarget target);        // TAINTED → RECOVERING
  // RECOVERING → READY: a full install, the label read back, and a digest of ALL live weights
  // equal to the target's (a target without a digest cannot be recovered to).
  Status Recovered(const InstallEvidence& install, const LabelEvidence& label, const DigestEvidence& digest);

 private:
  Controller(const Clock* clock, Journal* journal) : clock_(clock), journal_(journal) {}
  Status Restore(RestoreSummary* summary);

  // Appends a transition record and applies it. Caller holds mu_ and has checked evidence.
  Status TransitionLocked(Event event, Json detail) REQUIRES(mu_);
  // One transition of a batch; t_ms < 0: now (else when it happened, clamped to [previous, now]).
  struct Step {
    Event event;
    Json detail;
    int64_t t_ms = -1;
  };
  // Appends the steps' records as one batch (with the held records) and applies them in order.
  // Each must be legal from the state the previous one leads to; on error nothing changed.
  Status TransitionsLocked(std::vector<Step> steps) REQUIRES(mu_);
  // One step timed t_ms (the time its transition happened; < 0: now).
  Status TransitionAtLocked(Event event, Json detail, int64_t t_ms) REQUIRES(mu_);
  Result<UpdateTarget> PrepareUpdateLocked(UpdateTarget target) const REQUIRES(mu_);
  // The evidence checks of DrainComplete, BeginInstall, InstallComplete, CachesReset and Validated: the record's
  // detail, or the FailedPrecondition naming what the evidence lacks (legality is the caller's).
  Result<Json> DrainCompleteDetailLocked(const DrainStatus& engine) const REQUIRES(mu_);
  Result<Json> BeginInstallDetailLocked(const PauseEvidence& pause) const REQUIRES(mu_);
  Result<Json> InstallCompleteDetailLocked(const InstallEvidence& install) const REQUIRES(mu_);
  Result<Json> CachesResetDetailLocked(const std::vector<CacheResetResult>& results,
                                       const std::vector<CacheKind>& required) const REQUIRES(mu_);
  Result<Json> ValidatedDetailLocked(const LabelEvidence& label, const std::optional<DigestEvidence>& digest,
                                     bool digest_offered, const ReplayOutcome& replay) const REQUIRES(mu_);
  Status CheckLegalLocked(Event event) const REQUIRES(mu_);
  Status TaintLocked(const std::string& reason, bool call_failed = false) REQUIRES(mu_);
  // Appends rec (AppendRecordsLocked: recs, in order), together with the held records
  // (deferred_) in one batch, and applies the held ones; the caller applies rec. On error nothing
  // was appended or applied.
  Status AppendLocked(JournalRecord& rec) REQUIRES(mu_);
  Status AppendRecordsLocked(const std::vector<JournalRecord*>& recs) REQUIRES(mu_);
  // Applies a record of a known kind (live operations know it; Restore parses each record once).
  void ApplyRecordLocked(const JournalRecord& rec, RecordEvent type) REQUIRES(mu_);
  void ApplyTransitionLocked(const JournalRecord& rec, RecordEvent type) REQUIRES(mu_);

  const Clock* clock_;
  Journal* journal_;

  mutable rc::Mutex mu_;
  State state_ GUARDED_BY(mu_) = State::kUninitialized;                 // guarded by mu_
  int64_t state_entered_ms_ GUARDED_BY(mu_) = 0;                        // guarded by mu_
  WeightVersion version_ GUARDED_BY(mu_);                               // guarded by mu_
  WeightIdentity identity_ GUARDED_BY(mu_);                             // guarded by mu_
  std::optional<UpdateTarget> pending_ GUARDED_BY(mu_);                 // guarded by mu_
  std::map<std::string, RolloutBinding> active_ GUARDED_BY(mu_);        // guarded by mu_
  std::set<std::string> interrupted_ GUARDED_BY(mu_);                   // guarded by mu_
  std::set<std::string> aborted_ GUARDED_BY(mu_);                       // guarded by mu_
  std::map<std::string, InFlightRecord> inflight_ GUARDED_BY(mu_);      // guarded by mu_ (active rollouts only)
  std::vector<std::string> ended_by_last_taint_ GUARDED_BY(mu_);         // guarded by mu_
  std::map<int64_t, UpdateRecord> updates_ GUARDED_BY(mu_);             // guarded by mu_
  int64_t last_ordinal_ GUARDED_BY(mu_) = 0;                            // guarded by mu_
  int64_t next_rollout_ GUARDED_BY(mu_) = 1;                            // guarded by mu_
  Counters counters_ GUARDED_BY(mu_);                                   // guarded by mu_
  // Records that authorize nothing, waiting for the next append (group commit); not applied yet.
  std::vector<std::pair<JournalRecord, RecordEvent>> deferred_ GUARDED_BY(mu_);  // guarded by mu_
};

}  // namespace rc::lifecycle
