// UpdateOrchestrator: update orchestration in the controller service. It keeps the update ops
// (their journal, updates.journal.db, restored at Create), queues requests on the engines
// (Enqueue: stage-ahead, the same version requested twice, a version marked failed), runs one
// driver thread per engine (update_driver.cc: starts queued ops within --max-updating, polls the
// Runner, sweeps leases, runs the identity checks) and the auto-update follower, and answers
// update status.
//
// Thread safety: every public method may be called from any thread; RestoreOps at Create before
// StartDrivers. Its fields are guarded by the service's one mutex (ServiceCore::mu).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include "controller/identity_monitor.h"
#include "controller/rollout_admission.h"
#include "controller/service_core.h"

namespace rc::controller {

class UpdateOrchestrator {
 public:
  UpdateOrchestrator(ServiceCore* core, IdentityMonitor* identity, RolloutAdmission* admission)
      : core_(core), identity_(identity), admission_(admission) {}

  // Opens the update journal; restores the ops it records (before the drivers start).
  Status Open(bool must_exist);
  Status RestoreOps() EXCLUDES(core_->mu);
  // One driver thread per engine.
  void StartDrivers();
  // The auto-update follower (options.auto_update, with a model and a directory).
  void StartFollower();
  // Stops and joins them (idempotent).
  void StopThreads();

  // ControllerService's update API (service.h).
  Result<std::string> RequestUpdate(const std::string& model, const std::string& version,
                                    std::optional<lifecycle::PolicyMode> mode, bool retry_failed);
  Result<std::string> RequestRecovery(const std::string& model, const std::string& version);
  Result<Json> UpdateStatus(const std::string& id) const EXCLUDES(core_->mu);
  Result<Json> WaitForUpdate(const std::string& id, int64_t timeout_ms) const EXCLUDES(core_->mu);
  // Queues on every engine, or only on engine `only` when given.
  Result<std::string> Enqueue(const std::string& model, const std::string& version, bool recovery,
                              std::optional<size_t> only = std::nullopt,
                              lifecycle::PolicyMode mode = lifecycle::PolicyMode::kStrict, bool retry_failed = false)
      EXCLUDES(core_->mu);

  // Engines holding an update place now (/v1/status "updating").
  int updating() const EXCLUDES(core_->mu);
  const lifecycle::Journal& journal() const { return *ops_journal_; }

 private:
  struct OpRecord {
    std::string id;
    std::string model;
    std::string version;
    bool recovery = false;
    lifecycle::PolicyMode mode = lifecycle::PolicyMode::kStrict;
    std::string stopped;                   // why it stopped rolling (a taint on one engine); "" while not
    std::map<size_t, int64_t> ordinals;  // engine → ordinal once started
    std::map<size_t, std::string> errors;  // engine → why it did not start
    std::set<size_t> already_live;         // engines READY on the version when it was requested
    int64_t requested_wall_ms = 0;
    std::optional<size_t> only;            // the one engine it is for (an auto-recovery); else all
  };

  // ---- the driver (update_driver.cc) ----
  void Drive(EngineSlot* slot);
  // One pass of the driver while the Runner has nothing in flight: the ended op's bookkeeping,
  // the identity check when due, then a stage ahead or the next queued op, else a short wait.
  void DriveIdle(EngineSlot* slot) EXCLUDES(core_->mu);
  // The op that ran on `slot` ended: its bookkeeping; true when one had been running.
  bool EndRunningOp(EngineSlot* slot) EXCLUDES(core_->mu);
  // The identity check right after an operation, periodically, and until verified.
  void VerifyIfDue(EngineSlot* slot, bool just_ended);
  // A queued op the engine's state does not allow: refused (update_not_started) when it never
  // will, else left queued.
  void RefuseOpLocked(EngineSlot* slot, const Op& op, lifecycle::State st) REQUIRES(core_->mu);
  // Starts `op` (already taken off the queue, its place counted) and journals the start.
  void StartOp(EngineSlot* slot, const Op& op) EXCLUDES(core_->mu);
  // After an operation ended on `slot`: a tainted update stops rolling (service.h).
  void StopOpIfTaintedLocked(EngineSlot* slot, const std::string& op_id) REQUIRES(core_->mu);

  // ---- requests (update_orchestrator.cc) ----
  void FollowDirectory();
  // Idle engines that do not serve `version` start staging it (Runner::Prefetch).
  void StageAhead(const std::string& model, const std::string& version, std::optional<size_t> only)
      EXCLUDES(core_->mu);
  // FailedPrecondition for a version marked failed (unless retry_failed, which clears the mark).
  Status CheckNotFailed(const std::string& model, const std::string& version, bool retry_failed)
      EXCLUDES(core_->mu);
  // The id to answer a request for a version already being installed (or live everywhere), or
  // the refusal of another mode; nullopt when a new op is needed. Fills `already_live`.
  std::optional<Result<std::string>> ExistingOpLocked(const std::string& model, const std::string& version,
                                                      lifecycle::PolicyMode mode,
                                                      const lifecycle::UpdateTarget& target,
                                                      std::set<size_t>* already_live) REQUIRES(core_->mu);
  Json OpJson(const OpRecord& rec) const REQUIRES(core_->mu);
  // Journals an update-id event (update_requested / update_started / update_not_started).
  Status JournalOpLocked(const std::string& event, Json detail) REQUIRES(core_->mu);
  // Withdraws the stage-ahead requests for `version` that no driver took yet (its request was
  // refused or answered without a new op).
  void DropPrefetchLocked(const std::string& version) REQUIRES(core_->mu);
  static std::string VersionKey(const std::string& model, const std::string& version) {
    return model + '\n' + version;
  }

  ServiceCore* const core_;
  IdentityMonitor* const identity_;
  RolloutAdmission* const admission_;
  std::unique_ptr<lifecycle::Journal> ops_journal_;           // appends under mu
  std::map<std::string, OpRecord> ops_ GUARDED_BY(core_->mu);                 // guarded by mu
  // Versions whose validation failed on an engine (VersionKey → why), from the update journal.
  std::map<std::string, std::string> failed_versions_ GUARDED_BY(core_->mu);  // guarded by mu
  int updating_ GUARDED_BY(core_->mu) = 0;                                    // guarded by mu
  int64_t next_op_ GUARDED_BY(core_->mu) = 1;                                 // guarded by mu
  std::thread follower_;
};

}  // namespace rc::controller
