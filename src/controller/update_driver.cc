// The driver threads of the controller service (update_orchestrator.h): one per engine, owning
// that engine's Runner. It starts queued updates when at most `max_updating` engines are
// updating, polls the Runner, sweeps the engine's leases and runs its identity checks.
#include <algorithm>
#include <chrono>

#include <fmt/format.h>

#include "controller/update_orchestrator.h"
#include "rolloutcore/base/log.h"
#include "rolloutcore/base/mutex.h"

namespace rc::controller {

using lifecycle::State;
using lifecycle::UpdateOutcome;

namespace {
// How often an engine whose identity is not verified yet (unreachable at a restart) is retried.
constexpr int64_t kUnverifiedRetryMs = 200;
// How long a driver waits for an op's update_requested to be synced before journaling its start
// (the sync normally takes well under a millisecond; a journal that hangs longer fails the op).
constexpr int64_t kRequestJournalWaitMs = 60'000;
}  // namespace

void UpdateOrchestrator::Drive(EngineSlot* slot) {
  RolloutAdmission::LeaseSweep sweep;  // sweeps once at start (a restart's leases)
  // While an operation runs the driver blocks on the call in flight (Runner::WaitForProgress) and
  // polls the Runner the moment it answers: no fixed poll interval between a call's answer and the
  // next transition (issue 15, controller overhead). When no call is in flight unanswered (the
  // drain waits for rollouts, a refused reset waits for its retry slot) it sleeps 1 ms, or 100 us
  // for 20 ms after each state change.
  State last_state = slot->controller->state();
  int64_t hot_until_ms = 0;
  while (!core_->stop) {
    admission_->SweepLeases(slot, &sweep);
    if (!slot->runner->Poll()) {
      DriveIdle(slot);
      continue;
    }
    if (const State st = slot->controller->state(); st != last_state) {
      last_state = st;
      hot_until_ms = SteadyMs() + 20;
    }
    if (slot->runner->WaitForProgress(std::chrono::milliseconds(1))) continue;
    if (SteadyMs() < hot_until_ms) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
}

void UpdateOrchestrator::DriveIdle(EngineSlot* slot) {
  const bool just_ended = EndRunningOp(slot);
  VerifyIfDue(slot, just_ended);
  rc::MutexLock lock(core_->mu);
  if (slot->holds_update_place && !slot->settling.load()) {
    // Settled (its identity re-checked): only now may another engine leave service.
    slot->holds_update_place = false;
    --updating_;
    core_->cv.notify_all();
  }
  if (slot->prefetch && slot->queue.empty()) {
    // A request for this engine is being resolved: stage it meanwhile.
    lifecycle::UpdateTarget ahead;
    ahead.model = slot->prefetch->first;
    ahead.label = slot->prefetch->second;
    slot->prefetch.reset();
    lock.unlock();
    Status s = slot->runner->Prefetch(std::move(ahead));
    if (!s.ok()) RC_LOG_DEBUG("engine {}: no stage ahead of the request: {}", slot->handle.name, s.ToString());
    return;
  }
  if (!slot->queue.empty() && updating_ < core_->options.max_updating) {
    slot->prefetch.reset();  // the op itself is here: its StartUpdate stages (or adopts)
    Op op = slot->queue.front();
    State st = slot->controller->state();
    bool can = op.recovery ? st == State::kTainted : st == State::kReady;
    if (can) {
      slot->queue.pop_front();
      ++updating_;
      slot->holds_update_place = true;
      slot->running_op = op.id;
      slot->settling = true;
      lock.unlock();
      StartOp(slot, op);
      return;
    }
    RefuseOpLocked(slot, op, st);
  }
  core_->cv.wait_for(lock, std::chrono::milliseconds(5));
}

bool UpdateOrchestrator::EndRunningOp(EngineSlot* slot) {
  rc::MutexLock lock(core_->mu);
  if (slot->running_op.empty()) return false;
  const std::string ended_op = slot->running_op;
  slot->running_op.clear();
  StopOpIfTaintedLocked(slot, ended_op);
  core_->cv.notify_all();
  slot->after_op_pending = true;
  return true;
}

void UpdateOrchestrator::VerifyIfDue(EngineSlot* slot, bool just_ended) {
  identity_->RetryAutoRecovery(slot);
  // The identity check right after every operation (the install generation may have moved),
  // periodically while READY, and until a (re)started controller verified the engine.
  const int64_t interval = core_->options.verify_interval_ms;
  const int64_t now = SteadyMs();
  const bool verified = identity_->IdentityVerified(slot);
  const bool due = now >= slot->next_verify_ms;
  if ((slot->after_op_pending && (just_ended || due)) || (!verified && due) || (interval > 0 && due)) {
    // A failed probe leaves after_op_pending set: the next check is still the post-op one.
    identity_->VerifyIdentity(slot, slot->after_op_pending, /*claim=*/!verified);
    const bool ok = identity_->IdentityVerified(slot);
    slot->next_verify_ms = SteadyMs() + (ok ? (interval > 0 ? interval : kUnverifiedRetryMs) : kUnverifiedRetryMs);
  }
}

void UpdateOrchestrator::RefuseOpLocked(EngineSlot* slot, const Op& op, State st) {
  std::string why;
  if (op.recovery && st == State::kReady) why = "engine is READY: nothing to recover";
  if (!op.recovery && st == State::kTainted) why = "engine is TAINTED: recover it first";
  if (why.empty()) return;  // wait (e.g. UNINITIALIZED, or a restore in progress)
  slot->queue.pop_front();
  // After its update_requested (Enqueue syncs it without holding mu, so this wait is short).
  const bool op_journaled =
      !op.target.request_journaled ||
      (op.target.request_journaled->WaitFor(std::chrono::milliseconds(kRequestJournalWaitMs)) &&
       op.target.request_journaled->Get().ok());
  if (op_journaled && ops_.count(op.id)) {
    ops_[op.id].errors[slot->index] = why;
    Status j = JournalOpLocked("update_not_started", Json{{"id", op.id}, {"engine", slot->index}, {"reason", why}});
    if (!j.ok()) RC_LOG_ERROR("update {}: {}", op.id, j.ToString());
  }
}

void UpdateOrchestrator::StartOp(EngineSlot* slot, const Op& op) {
  slot->running_recovery = op.recovery;
  slot->generation_before_op = slot->controller->version().generation;
  bool was_settled;
  {
    // From here to the check after the operation, the install generation may move.
    rc::MutexLock id_lock(slot->id_mu);
    was_settled = slot->id.generation_settled;
    slot->id.generation_settled = false;
  }
  auto started = op.recovery ? slot->runner->StartRecovery(op.target) : slot->runner->StartUpdate(op.target);
  if (!started.ok()) {
    rc::MutexLock id_lock(slot->id_mu);
    slot->id.generation_settled = was_settled;
  }
  // This op's update_requested goes first in the update journal (Enqueue syncs it while
  // the update starts): wait for it before journaling anything of the op.
  bool op_journaled = true;
  if (op.target.request_journaled) {
    (void)op.target.request_journaled->WaitFor(std::chrono::milliseconds(kRequestJournalWaitMs));
    op_journaled = op.target.request_journaled->Ready() && op.target.request_journaled->Get().ok();
  }
  rc::MutexLock lock(core_->mu);
  Status j;
  if (!op_journaled) {
    // Enqueue refused the request (its caller got the error) and forgot the op; a started
    // update rejects itself before the pause (UpdateTarget::request_journaled).
    RC_LOG_WARN("update {}: the update journal did not record the request; not journaling its start", op.id);
    if (!started.ok()) {
      slot->running_op.clear();
      slot->holds_update_place = false;
      --updating_;
      slot->settling = false;
    }
  } else if (started.ok()) {
    ops_[op.id].ordinals[slot->index] = started->ordinal;
    j = JournalOpLocked("update_started", Json{{"id", op.id}, {"engine", slot->index}, {"ordinal", started->ordinal}});
  } else {
    ops_[op.id].errors[slot->index] = started.status().ToString();
    if (op.recovery && core_->options.auto_recover && started.status().code() == StatusCode::kFailedPrecondition &&
        slot->controller->state() == State::kTainted) {
      // Refused for now (rollouts still active on the engine): --auto-recover asks again.
      slot->auto_recover_retry_ms = SteadyMs() + IdentityMonitor::kAutoRecoverRetryMs;
    }
    slot->running_op.clear();
    slot->holds_update_place = false;
    --updating_;
    slot->settling = false;  // nothing started: the engine is as it was
    j = JournalOpLocked("update_not_started",
                        Json{{"id", op.id}, {"engine", slot->index}, {"reason", started.status().ToString()}});
  }
  if (!j.ok()) RC_LOG_ERROR("update {}: {}", op.id, j.ToString());
  core_->cv.notify_all();
}

void UpdateOrchestrator::StopOpIfTaintedLocked(EngineSlot* slot, const std::string& op_id) {
  auto it = ops_.find(op_id);
  if (it == ops_.end() || it->second.recovery) return;
  OpRecord& rec = it->second;
  auto ord = rec.ordinals.find(slot->index);
  if (ord == rec.ordinals.end()) return;
  auto u = slot->controller->Update(ord->second);
  if (!u || u->outcome != UpdateOutcome::kTainted) return;
  // The new version's own evidence failed (label, digest or replay read while paused): the
  // version is what is wrong, not this engine's call, so no engine gets it (issue 36 #4). Any
  // other taint stops this update too (a canary that failed), without marking the version: one
  // from VALIDATING whose read failed or overran (the engine died or hung) included.
  const bool validation =
      u->tainted_from == lifecycle::StateName(State::kValidating) && !u->taint_call_failed;
  const std::string why = fmt::format("update {} stopped: engine {} was tainted {}: {}", op_id, slot->handle.name,
                                      validation ? "in validation" : "from " + u->tainted_from, u->reason);
  rec.stopped = why;
  for (auto& other : core_->engines) {
    const size_t n = other->queue.size();
    std::erase_if(other->queue, [&](const Op& q) { return q.id == op_id; });
    if (other->queue.size() == n) continue;
    rec.errors[other->index] = why;
    Status j = JournalOpLocked("update_not_started", Json{{"id", op_id}, {"engine", other->index}, {"reason", why}});
    if (!j.ok()) RC_LOG_ERROR("update {}: {}", op_id, j.ToString());
  }
  DropPrefetchLocked(rec.version);
  Status j = JournalOpLocked("update_stopped", Json{{"id", op_id},
                                                    {"engine", slot->index},
                                                    {"reason", why},
                                                    {"version_failed", validation}});
  if (!j.ok()) RC_LOG_ERROR("update {}: {}", op_id, j.ToString());
  if (validation) failed_versions_[VersionKey(rec.model, rec.version)] = why;
  RC_LOG_ERROR("{}{}", why, validation ? "; the version is marked failed" : "");
}

}  // namespace rc::controller
