#include "rolloutcore/lifecycle/runner.h"

#include <algorithm>

#include "rolloutcore/base/log.h"

namespace rc::lifecycle {

namespace {
// WaitForProgress's spin: at most kSpinUs per call, only in the first kSpinPhaseUs of a phase.
constexpr int64_t kSpinUs = 250;
constexpr int64_t kSpinPhaseUs = 3000;
}  // namespace

Runner::Runner(Controller* controller, EngineAdapter* adapter, Clock* clock, RunnerOptions options)
    : controller_(controller), adapter_(adapter), clock_(clock), options_(options) {}

Runner::~Runner() = default;

void Runner::Note(const std::string& text) {
  notes_.push_back("t=" + std::to_string(Now()) + "ms " + text);
  RC_LOG_INFO("runner: {}", text);
}

Result<UpdateTarget> Runner::StartUpdate(UpdateTarget target) {
  if (busy()) return FailedPrecondition("update " + std::to_string(target_.ordinal) + " is still in progress");
  RC_ASSIGN_OR_RETURN(description_, adapter_->Describe());
  if (target.mode != PolicyMode::kStrict) {
    // Refused before anything changes: the engine cannot give this mode exact spans.
    Status supported = adapter_->SupportsPolicyMode(target.mode);
    if (!supported.ok()) return FailedPrecondition(supported.message());
  }
  // The prefetch changes nothing the engine serves, so it is issued before RequestUpdate is
  // synced and the sync runs while it stages (issue 15); if the sync fails the stage is dropped
  // (its image waits in staging for the next stage to replace it) and nothing else happened.
  RC_ASSIGN_OR_RETURN(UpdateTarget prepared, controller_->PrepareUpdate(std::move(target)));
  const int64_t issued_ms = Now();
  // A stage Prefetch issued for exactly this update (same label, model and ordinal) is adopted:
  // in flight or answered, it is this update's stage. Any other is dropped.
  const bool adopt = options_.prefetch && prefetched_ && stage_call_.active() &&
                     prefetched_->label == prepared.label && prefetched_->model == prepared.model &&
                     prefetched_->ordinal == prepared.ordinal;
  prefetched_.reset();
  if (!adopt) {
    stage_call_.Clear();
    if (options_.prefetch) stage_call_.Start(adapter_->Stage(prepared), issued_ms + options_.deadlines.stage_ms);
  }
  auto requested = controller_->RequestUpdate(std::move(prepared));
  if (!requested.ok()) {
    stage_call_.Clear();
    return requested.status();
  }
  target_ = std::move(requested).value();
  notes_.clear();
  phase_ = Phase::kDraining;
  started_ms_ = issued_ms;
  next_drain_poll_ms_ = started_ms_;
  drain_deadline_noted_ = false;
  abort_issued_ = false;
  drained_.reset();
  idle_seen_.reset();
  install_held_.reset();
  resets_held_ = false;
  stage_done_ = !options_.prefetch;
  Poll();
  return target_;
}

Status Runner::Prefetch(UpdateTarget target) {
  if (busy()) return FailedPrecondition("update " + std::to_string(target_.ordinal) + " is still in progress");
  if (!options_.prefetch) return OkStatus();
  // Before anything is asked of the engine, as StartUpdate does: an adapter learns there what it
  // talks to (a controller restarted just before the request has not asked yet: the HTTP adapter
  // sent vLLM the rolloutcore engine's stage, a 404, and the update was refused).
  RC_ASSIGN_OR_RETURN(description_, adapter_->Describe());
  RC_ASSIGN_OR_RETURN(UpdateTarget prepared, controller_->PrepareUpdate(std::move(target)));
  stage_call_.Clear();
  stage_call_.Start(adapter_->Stage(prepared), Now() + options_.deadlines.stage_ms);
  prefetched_ = Prefetched{prepared.label, prepared.model, prepared.ordinal};
  return OkStatus();
}

Result<UpdateTarget> Runner::StartRecovery(UpdateTarget target) {
  if (busy()) return FailedPrecondition("operation " + std::to_string(target_.ordinal) + " is still in progress");
  prefetched_.reset();
  stage_call_.Clear();  // a prefetched stage (a recovery stages inside its full install)
  RC_ASSIGN_OR_RETURN(description_, adapter_->Describe());
  // A recovery proves label, digest and the quantized image (against the engine's own quantization
  // and, when the version's manifest can be read in time, the trainer's published image); it
  // replays nothing, so the fetched probes are dropped.
  if (target.request_journaled) {
    // A recovery pauses at once: the request must be durable first.
    (void)target.request_journaled->WaitFor(std::chrono::milliseconds(options_.deadlines.stage_ms));
    auto journaled = target.request_journaled->Ready() ? target.request_journaled->Get()
                                                       : Result<bool>(DeadlineExceeded("not synced in time"));
    if (!journaled.ok()) {
      return FailedPrecondition("the recovery request for " + target.label +
                                " was not journaled: " + journaled.status().ToString());
    }
    target.request_journaled.reset();
  }
  RC_ASSIGN_OR_RETURN(target_, controller_->BeginRecovery(std::move(target)));
  notes_.clear();
  started_ms_ = Now();
  if (!description_.offers_content_digest) {
    phase_ = Phase::kRecoverValidating;  // so TaintWith closes it
    TaintWith("engine '" + description_.name + "' offers no content digest: recovery cannot be proven");
    return target_;
  }
  phase_ = Phase::kRecoverPausing;
  // No rollout is admitted in TAINTED; abort anything an outside client may have started.
  pause_call_.Start(adapter_->Pause(PauseMode::kAbort), Now() + options_.deadlines.pause_ms);
  Poll();
  return target_;
}

void Runner::ResumeBestEffort(const std::string& why) {
  Note("best-effort resume: " + why);
  background_resumes_.push_back(adapter_->Resume());
}

void Runner::Finish() {
  phase_ = Phase::kIdle;
  drained_.reset();
  idle_seen_.reset();
  install_held_.reset();
  resets_held_ = false;
  drain_call_.Clear();
  stage_call_.Clear();
  abort_call_.Clear();
  pause_call_.Clear();
  install_call_.Clear();
  reset_calls_.clear();
  label_call_.Clear();
  digest_call_.Clear();
  replay_call_.Clear();
  replay_evidence_.clear();
  replay_started_ms_ = replay_ended_ms_ = -1;
  probes_selected_ = false;
  probes_other_quantization_ = 0;
  other_quantization_.clear();
  resume_call_.Clear();
  install_evidence_.reset();
  label_evidence_.reset();
  digest_evidence_.reset();
}

void Runner::RejectAndResume(const std::string& reason, bool install_refused) {
  const bool paused = phase_ != Phase::kDraining;
  reject_reason_ = reason;
  reject_install_refused_ = install_refused;
  if (!paused || (phase_ == Phase::kInstalling && !install_refused)) {
    // Not paused yet: READY at once. (From UPDATING without a refusal the controller refuses
    // READY and FinishReject taints: nothing proves the install did not mutate.)
    return FinishReject(std::nullopt);
  }
  Note("giving up before mutation: " + reason + "; resuming the engine before READY");
  phase_ = Phase::kRejectResuming;
  reject_resumed_ = false;
  // A pause that overran its deadline is still in flight and may land after the resume: it gets
  // one more pause deadline, and if it answers, the engine is resumed again after it.
  if (pause_call_.active()) pause_call_.deadline_ms = Now() + options_.deadlines.pause_ms;
  resume_call_.Start(adapter_->Resume(), Now() + options_.deadlines.resume_ms);
  StepRejectResuming();
}

void Runner::StepRejectResuming() {
  const int64_t now = Now();
  if (resume_call_.active()) {
    if (!resume_call_.pending->Ready()) {
      if (now <= resume_call_.deadline_ms) return;
      resume_call_.Clear();
      return FinishReject("the resume overran its " + std::to_string(options_.deadlines.resume_ms) + " ms deadline");
    }
    auto r = resume_call_.pending->Get();
    resume_call_.Clear();
    if (!r.ok()) return FinishReject("the resume failed: " + r.status().ToString());
    if (r->paused_after) return FinishReject("the engine still reports itself paused after the resume");
    reject_resumed_ = true;
  }
  if (!reject_resumed_) return;
  if (pause_call_.active()) {
    if (!pause_call_.pending->Ready()) {
      if (now <= pause_call_.deadline_ms) return;
      // It may never land; if it does, the identity check of READY engines finds it paused.
      pause_call_.Clear();
      Note("the pause given up at its deadline never answered");
      return FinishReject(std::nullopt);
    }
    pause_call_.Clear();
    Note("the pause given up at its deadline answered after all: resuming again after it");
    reject_resumed_ = false;
    resume_call_.Start(adapter_->Resume(), now + options_.deadlines.resume_ms);
    return;
  }
  FinishReject(std::nullopt);
}

void Runner::FinishReject(const std::optional<std::string>& taint_why) {
  const std::string reason = reject_reason_;
  Status s = controller_->RejectBeforeMutation(reason, reject_install_refused_);
  if (!s.ok() && s.code() != StatusCode::kFailedPrecondition) {
    const bool refused = reject_install_refused_;
    return RetryRecordLater("the rejection (" + reason + ")", [this, reason, refused, taint_why]() -> Status {
      if (controller_->state() != State::kReady) RC_RETURN_IF_ERROR(controller_->RejectBeforeMutation(reason, refused));
      if (!taint_why) return OkStatus();
      return controller_->Taint("after the update was given up (" + reason + "): " + *taint_why);
    }, /*taints=*/taint_why.has_value());
  }
  if (!s.ok()) {
    // Only possible if the state moved under us; taint is the safe answer after an install.
    Note("reject failed: " + s.ToString());
    if (phase_ == Phase::kInstalling) (void)controller_->Taint(reason + "; " + s.message());
  }
  Note("rejected before mutation: " + reason);
  if (s.ok() && taint_why) {
    // READY was true of the weights; the engine may still be paused, which would hang every
    // rollout admitted to it: tainted, so none is, until a recovery resumes it.
    Status t = controller_->Taint("after the update was given up (" + reason + "): " + *taint_why);
    if (!t.ok()) Note("taint failed: " + t.ToString());
    Note("tainted: " + *taint_why);
  }
  Finish();
}

Status Runner::JournalHeldInstall() {
  if (!install_held_) return OkStatus();
  const InstallEvidence held = std::move(*install_held_);
  install_held_.reset();
  return controller_->InstallComplete(held, install_done_ms_);
}

void Runner::TaintWith(const std::string& reason, bool call_failed) {
  if (install_held_) {
    // The install answered installed and that is not journaled yet: record it first (at the time
    // it answered), so the journal says what happened before the taint. Evidence the controller
    // refuses (another label) stays out: the taint then comes from UPDATING, its reason says why.
    Status recorded = JournalHeldInstall();
    if (!recorded.ok()) {
      Note("recording the held install failed: " + recorded.ToString());
      resets_held_ = false;  // caches_reset is not legal from UPDATING; the taint's reason stands
    }
  }
  if (resets_held_) {
    // The caches were reset and that is not journaled yet: record it first (at the time the last
    // reset answered), so the journal says what happened before the taint.
    resets_held_ = false;
    std::vector<CacheResetResult> results;
    for (auto& r : reset_results_) {
      if (r) results.push_back(*r);
    }
    Status recorded = controller_->CachesReset(results, description_.caches, resets_done_ms_);
    if (!recorded.ok()) Note("recording the held cache resets failed: " + recorded.ToString());
  }
  Status s = controller_->Taint(reason, call_failed);
  if (!s.ok() && s.code() != StatusCode::kFailedPrecondition) {
    return RetryRecordLater("the taint (" + reason + ")",
                            [this, reason, call_failed] { return controller_->Taint(reason, call_failed); },
                            /*taints=*/true);
  }
  if (!s.ok()) Note("taint failed: " + s.ToString());
  Note("tainted: " + reason);
  if (!s.ok()) return Finish();
  AfterTaint();
}

void Runner::AfterTaint() {
  // The rollouts frozen inside the engine that the taint ended (an in-flight update): abort
  // them now so their proxies are answered, instead of at a call timeout (issue 36 #2).
  std::vector<std::string> ended = controller_->EndedByLastTaint();
  if (!ended.empty()) {
    Note("aborting the " + std::to_string(ended.size()) + " frozen rollouts the taint ended");
    background_aborts_.push_back(adapter_->AbortRequests(ended));
  }
  Finish();
}

void Runner::RetryRecordLater(const std::string& what, std::function<Status()> record, bool taints) {
  phase_ = Phase::kRecordRetrying;
  record_taints_ = taints;
  record_what_ = what;
  record_ = std::move(record);
  record_attempts_ = 1;
  record_next_ms_ = Now() + kRecordRetryMs;
  RC_LOG_ERROR("engine '{}': the journal refused {}; the state stays as it is (nothing is admitted) and the record "
               "is written again every {} ms",
               description_.name, what, kRecordRetryMs);
  Note("the journal refused " + what + "; retrying");
}

void Runner::StepRecordRetrying() {
  if (Now() < record_next_ms_) return;
  ++record_attempts_;
  Status s = record_();
  if (s.ok()) {
    RC_LOG_WARN("engine '{}': {} recorded after {} attempts", description_.name, record_what_, record_attempts_);
    Note(record_what_ + " recorded after " + std::to_string(record_attempts_) + " attempts");
    record_ = nullptr;
    return record_taints_ ? AfterTaint() : Finish();
  }
  if (s.code() == StatusCode::kFailedPrecondition) {
    RC_LOG_ERROR("engine '{}': {} can no longer be recorded: {}", description_.name, record_what_, s.ToString());
    Note(record_what_ + " not recorded: " + s.ToString());
    record_ = nullptr;
    return Finish();
  }
  if (record_attempts_ % 50 == 0) {
    RC_LOG_ERROR("engine '{}': the journal still refuses {} ({} attempts): {}", description_.name, record_what_,
                 record_attempts_, s.ToString());
  }
  record_next_ms_ = Now() + kRecordRetryMs;
}

bool Runner::Poll() {
  // Drop finished background resumes, noting their outcome.
  for (auto it = background_resumes_.begin(); it != background_resumes_.end();) {
    if (it->Ready()) {
      auto r = it->Get();
      Note(std::string("best-effort resume ") + (r.ok() && !r->paused_after ? "confirmed" : "not confirmed"));
      it = background_resumes_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = background_aborts_.begin(); it != background_aborts_.end();) {
    if (it->Ready()) {
      auto r = it->Get();
      Note(r.ok() ? "aborted " + std::to_string(r->aborted) + " frozen rollouts after the taint"
                  : "aborting the frozen rollouts after the taint failed: " + r.status().ToString());
      it = background_aborts_.erase(it);
    } else {
      ++it;
    }
  }
  // Each step may complete several calls; loop until nothing moves.
  for (int guard = 0; guard < 16; ++guard) {
    Phase before = phase_;
    switch (phase_) {
      case Phase::kIdle: return false;
      case Phase::kDraining: StepDraining(); break;
      case Phase::kInFlightAborting: StepAbortingInFlight(); break;
      case Phase::kPausing: StepPausing(false); break;
      case Phase::kInstalling: StepInstalling(false); break;
      case Phase::kResetting: StepResetting(false); break;
      case Phase::kValidating: StepValidating(false); break;
      case Phase::kResuming: StepResuming(false); break;
      case Phase::kRecoverPausing: StepPausing(true); break;
      case Phase::kRecoverInstalling: StepInstalling(true); break;
      case Phase::kRecoverResetting: StepResetting(true); break;
      case Phase::kRecoverValidating: StepValidating(true); break;
      case Phase::kRecoverResuming: StepResuming(true); break;
      case Phase::kRejectResuming: StepRejectResuming(); break;
      case Phase::kRecordRetrying: StepRecordRetrying(); break;
    }
    if (phase_ == before) break;
  }
  return busy();
}

bool Runner::AnyAnswered() const {
  if (stage_call_.AnsweredNow() || drain_call_.AnsweredNow() || abort_call_.AnsweredNow() ||
      pause_call_.AnsweredNow() || install_call_.AnsweredNow() || label_call_.AnsweredNow() ||
      digest_call_.AnsweredNow() || replay_call_.AnsweredNow() || resume_call_.AnsweredNow()) {
    return true;
  }
  for (const auto& c : reset_calls_) {
    if (c.AnsweredNow()) return true;
  }
  return false;
}

bool Runner::WaitForProgress(std::chrono::microseconds max) {
  if (phase_ == Phase::kIdle) return false;
  // From the pause to the resume the engine's calls (pause, reset, reads, replay of precomputed
  // probes, resume) answer in microseconds, and each answer would otherwise cost a thread wake-up
  // (tens to hundreds of microseconds on a virtual machine) inside the pause window: spin for it
  // during the first milliseconds of each phase (a long install sleeps after that).
  if (phase_ != Phase::kDraining && phase_ != Phase::kInFlightAborting) {
    const auto now = std::chrono::steady_clock::now();
    if (phase_ != spin_phase_) {
      spin_phase_ = phase_;
      phase_since_ = now;
    }
    if (now - phase_since_ < std::chrono::microseconds(kSpinPhaseUs)) {
      const auto until = now + std::min<std::chrono::microseconds>(max, std::chrono::microseconds(kSpinUs));
      while (std::chrono::steady_clock::now() < until) {
        if (AnyAnswered()) return true;
        for (int i = 0; i < 16; ++i) internal::CpuRelax();
      }
    }
  }
  if (phase_ == Phase::kDraining && !stage_call_.active()) {
    // Nothing else in flight may answer first: wait on what the drain still needs.
    if (target_.facts_fetch && !target_.facts_fetch->Ready()) {
      (void)target_.facts_fetch->WaitFor(max);
      return true;
    }
    if (target_.request_journaled && !target_.request_journaled->Ready()) {
      (void)target_.request_journaled->WaitFor(max);
      return true;
    }
  }
  if (stage_call_.WaitIfUnanswered(max) || drain_call_.WaitIfUnanswered(max) || abort_call_.WaitIfUnanswered(max) ||
      pause_call_.WaitIfUnanswered(max) || install_call_.WaitIfUnanswered(max)) {
    return true;
  }
  for (const auto& c : reset_calls_) {
    if (c.WaitIfUnanswered(max)) return true;
  }
  return label_call_.WaitIfUnanswered(max) || digest_call_.WaitIfUnanswered(max) ||
         replay_call_.WaitIfUnanswered(max) || resume_call_.WaitIfUnanswered(max);
}

Result<UpdateRecord> Runner::RunToCompletion() {
  int64_t ordinal = target_.ordinal;
  while (Poll()) clock_->SleepForMs(1);
  auto u = controller_->Update(ordinal);
  if (!u) return NotFound("no record of update " + std::to_string(ordinal));
  return *u;
}

// ---- Draining ------------------------------------------------------------------------------

template <typename T>
bool Runner::TakeBeforeTheDrainEnds(std::optional<Pending<T>>& pending, int64_t now, T* value,
                                    const std::string& failed, const std::string& what) {
  if (!pending) return true;
  if (pending->Ready()) {
    auto r = pending->Get();
    pending.reset();
    if (!r.ok()) {
      RejectAndResume(failed + r.status().ToString(), false);
      return false;
    }
    *value = std::move(r).value();
    next_drain_poll_ms_ = now;  // it may be what the drain waited for
  } else if (now > started_ms_ + options_.deadlines.stage_ms) {
    pending.reset();
    RejectAndResume(what + " overran the " + std::to_string(options_.deadlines.stage_ms) + " ms stage deadline",
                    false);
    return false;
  }
  return true;
}

void Runner::StepDraining() {
  const int64_t now = Now();
  // The probes and the published FP8 images come from a fetch that started with the update, the
  // requester's record of the request is synced while the update starts (types.h); both are taken
  // here, before the drain can complete, so a failure rejects with nothing paused.
  const bool fetching = target_.facts_fetch.has_value();
  VersionFacts facts;
  if (!TakeBeforeTheDrainEnds(target_.facts_fetch, now, &facts,
                              "fetching the replay probes and FP8 images of " + target_.label + " failed: ",
                              "fetching the replay probes and FP8 images of " + target_.label)) {
    return;
  }
  if (fetching && !target_.facts_fetch) {
    target_.probes = std::move(facts.probes);
    target_.published_fp8 = std::move(facts.published_fp8);
  }
  bool journaled = false;
  if (!TakeBeforeTheDrainEnds(target_.request_journaled, now, &journaled,
                              "the request for " + target_.label + " was not journaled: ",
                              "journaling the request for " + target_.label)) {
    return;
  }
  if (stage_call_.active()) {
    if (stage_call_.pending->Ready()) {
      auto r = stage_call_.pending->Get();
      stage_call_.Clear();
      if (!r.ok()) return RejectAndResume("staging " + target_.label + " failed: " + r.status().ToString(), false);
      Status recorded = controller_->RecordStageEvidence(*r);
      if (!recorded.ok()) return RejectAndResume("recording the staging evidence failed: " + recorded.ToString(), false);
      stage_done_ = true;
      // The stage was what the drain waited for: ask for the drain status now, not at the next
      // poll interval (issue 15: up to drain_poll_interval_ms of every cycle went here).
      next_drain_poll_ms_ = now;
    } else if (now > stage_call_.deadline_ms) {
      stage_call_.Clear();
      return RejectAndResume("staging " + target_.label + " overran its " + std::to_string(options_.deadlines.stage_ms) +
                                 " ms deadline",
                             false);
    }
  }

  if (target_.mode != PolicyMode::kStrict) return StepQuiescingInFlight(now);

  if (abort_call_.active()) {
    if (abort_call_.pending->Ready()) {
      auto r = abort_call_.pending->Get();
      abort_call_.Clear();
      if (!r.ok()) return RejectAndResume("aborting stragglers failed: " + r.status().ToString(), false);
      Status s = controller_->AbortForDrain(abort_ids_, *r);
      if (!s.ok()) return RejectAndResume("recording aborted stragglers failed: " + s.ToString(), false);
    } else if (now > abort_call_.deadline_ms) {
      abort_call_.Clear();
      return RejectAndResume("aborting stragglers overran its deadline", false);
    }
  }

  if (now - started_ms_ > options_.deadlines.drain_ms && controller_->active_count() > 0) {
    switch (options_.drain_policy) {
      case DrainPolicy::kWait:
        if (!drain_deadline_noted_) {
          Note("drain deadline passed with " + std::to_string(controller_->active_count()) +
               " active rollouts; policy 'wait' keeps waiting");
          drain_deadline_noted_ = true;
        }
        break;
      case DrainPolicy::kAbort:
        if (!abort_issued_) {
          abort_ids_ = controller_->ActiveRolloutIds();
          Note("drain deadline passed; aborting " + std::to_string(abort_ids_.size()) + " stragglers");
          abort_call_.Start(adapter_->AbortRequests(abort_ids_), now + options_.deadlines.poll_ms);
          abort_issued_ = true;
        }
        break;
      case DrainPolicy::kCancel:
        return RejectAndResume("drain deadline of " + std::to_string(options_.deadlines.drain_ms) + " ms passed with " +
                                   std::to_string(controller_->active_count()) + " active rollouts (policy 'cancel')",
                               false);
    }
  }

  if (drain_call_.active()) {
    if (drain_call_.pending->Ready()) {
      auto r = drain_call_.pending->Get();
      drain_call_.Clear();
      if (!r.ok()) return RejectAndResume("drain status failed: " + r.status().ToString(), false);
      // DRAINING admits nothing, so an engine seen idle with no binding active stays drained of
      // rollouts: that answer ends the drain once the stage (and the probes, and the request's
      // record) are in, without asking again (the pause's read-back is what BeginInstall checks).
      if (r->idle() && controller_->active_count() == 0) {
        idle_seen_ = *r;
      } else {
        idle_seen_.reset();
      }
      next_drain_poll_ms_ = now + options_.drain_poll_interval_ms;
    } else if (now > drain_call_.deadline_ms) {
      drain_call_.Clear();
      return RejectAndResume("drain status overran its " + std::to_string(options_.deadlines.poll_ms) + " ms deadline",
                             false);
    }
  }
  if (idle_seen_ && !drain_call_.active() && controller_->active_count() == 0 && stage_done_ &&
      !target_.facts_fetch && !target_.request_journaled) {
    // Drained: the pause is the drain's last step; QUIESCED and UPDATING are synced together once
    // it answers (StepPausing), before the install.
    drained_ = *idle_seen_;
    idle_seen_.reset();
    pause_issued_ms_ = now;
    phase_ = Phase::kPausing;
    pause_call_.Start(adapter_->Pause(options_.pause_mode), now + options_.deadlines.pause_ms);
    return;
  }
  if (!drain_call_.active() && now >= next_drain_poll_ms_ && controller_->active_count() == 0) {
    drain_call_.Start(adapter_->GetDrainStatus(), now + options_.deadlines.poll_ms);
  }
}

// ---- In-flight modes -----------------------------------------------------------------------

void Runner::StepQuiescingInFlight(int64_t now) {
  if (!stage_done_ || target_.facts_fetch || target_.request_journaled) return;
  if (!drain_call_.active()) {
    drain_call_.Start(adapter_->GetDrainStatus(), now + options_.deadlines.poll_ms);
    return;
  }
  if (!drain_call_.pending->Ready()) {
    if (now > drain_call_.deadline_ms) {
      drain_call_.Clear();
      return RejectAndResume("drain status overran its " + std::to_string(options_.deadlines.poll_ms) + " ms deadline",
                             false);
    }
    return;
  }
  auto r = drain_call_.pending->Get();
  drain_call_.Clear();
  if (!r.ok()) return RejectAndResume("drain status failed: " + r.status().ToString(), false);
  auto ends = controller_->QuiesceInFlight(*r, options_.max_staleness);
  if (!ends.ok()) return RejectAndResume(ends.status().message(), false);
  if (!ends->empty() && target_.mode != PolicyMode::kAbort) {
    abort_ids_ = *ends;
    Note("update " + std::to_string(target_.ordinal) + " ends " + std::to_string(abort_ids_.size()) +
         " rollouts that would exceed max staleness " + std::to_string(options_.max_staleness));
    phase_ = Phase::kInFlightAborting;
    abort_call_.Start(adapter_->AbortRequests(abort_ids_), now + options_.deadlines.poll_ms);
    return;
  }
  phase_ = Phase::kPausing;
  pause_call_.Start(adapter_->PauseForUpdate(target_.mode), now + options_.deadlines.pause_ms);
}

void Runner::StepAbortingInFlight() {
  if (!abort_call_.active()) return;
  const int64_t now = Now();
  if (!abort_call_.pending->Ready()) {
    if (now > abort_call_.deadline_ms) {
      abort_call_.Clear();
      return RejectAndResume("aborting rollouts past max staleness overran its deadline", false);
    }
    return;
  }
  auto r = abort_call_.pending->Get();
  abort_call_.Clear();
  if (!r.ok()) return RejectAndResume("aborting rollouts past max staleness failed: " + r.status().ToString(), false);
  phase_ = Phase::kPausing;
  pause_call_.Start(adapter_->PauseForUpdate(target_.mode), now + options_.deadlines.pause_ms);
}

// ---- Pause ---------------------------------------------------------------------------------

void Runner::StepPausing(bool recovery) {
  if (!pause_call_.active()) return;
  const int64_t now = Now();
  if (!pause_call_.pending->Ready()) {
    if (now > pause_call_.deadline_ms) {
      std::string why = "pause overran its " + std::to_string(options_.deadlines.pause_ms) + " ms deadline";
      if (!recovery) return RejectAndResume(why, false);  // keeps the pause call: it may still land
      pause_call_.Clear();
      return TaintWith("recovery: " + why);
    }
    if (drained_ && now - pause_issued_ms_ >= options_.group_commit_window_ms) {
      // A pause that takes longer than the group-commit window: journal QUIESCED on its own now
      // (timed at the pause), so /v1/status and a restart see it; UPDATING follows alone.
      Status s = controller_->DrainComplete(*drained_, pause_issued_ms_);
      drained_.reset();
      if (!s.ok()) return RejectAndResume(s.message(), false);
    }
    return;
  }
  auto r = pause_call_.pending->Get();
  pause_call_.Clear();
  if (!r.ok()) {
    std::string why = "pause failed: " + r.status().ToString();
    return recovery ? TaintWith("recovery: " + why) : RejectAndResume(why, false);
  }
  if (recovery) {
    if (!r->paused || r->running != 0) return TaintWith("recovery: the engine did not confirm it is paused and idle");
    phase_ = Phase::kRecoverInstalling;
  } else {
    Status s = drained_ ? controller_->QuiesceAndBeginInstall(*drained_, pause_issued_ms_, *r)
                        : controller_->BeginInstall(*r);
    drained_.reset();
    if (!s.ok()) return RejectAndResume(s.message(), false);
    phase_ = Phase::kInstalling;
  }
  install_call_.Start(adapter_->Install(target_, recovery), now + options_.deadlines.install_ms);
}

// ---- Install -------------------------------------------------------------------------------

void Runner::StepInstalling(bool recovery) {
  if (!install_call_.active()) return;
  const int64_t now = Now();
  if (!install_call_.pending->Ready()) {
    if (now > install_call_.deadline_ms) {
      install_call_.Clear();
      return TaintWith("install overran its " + std::to_string(options_.deadlines.install_ms) +
                       " ms deadline: mutation may have begun");
    }
    return;
  }
  auto r = install_call_.pending->Get();
  install_call_.Clear();
  // The engine says what the install did (InstallOutcome, set where the first live byte is
  // written); only an explicit "refused, untouched" returns to READY. An error is an answer
  // without that fact: the outcome is unknown and mutation may have begun.
  if (!r.ok()) return TaintWith("install failed, outcome unknown: " + r.status().ToString());
  if (r->outcome == InstallOutcome::kRefusedUntouched) {
    if (recovery) return TaintWith("recovery: install refused: " + r->error);
    return RejectAndResume("install refused before mutation: " + r->error, true);
  }
  if (r->outcome != InstallOutcome::kInstalled) {
    return TaintWith("install failed after mutation began (" + std::string(InstallOutcomeName(r->outcome)) +
                     "): " + r->error);
  }
  if (recovery) {
    install_evidence_ = *r;
    phase_ = Phase::kRecoverResetting;
  } else {
    // The validation reads change nothing and the cache resets are part of the mutation
    // begin_install authorized: both go out now, and install_complete is held for the batch
    // that authorizes the resume (a replay, which does depend on the resets, waits for them).
    IssueValidation();
    install_held_ = *r;
    install_done_ms_ = now;
    phase_ = Phase::kResetting;
  }
  IssueResets();
}

void Runner::IssueResets() {
  reset_calls_.assign(description_.caches.size(), {});
  reset_attempts_.assign(description_.caches.size(), 1);
  reset_results_.assign(description_.caches.size(), std::nullopt);
  reset_deadline_ms_ = Now() + options_.deadlines.reset_ms;
  for (size_t i = 0; i < description_.caches.size(); ++i) {
    reset_calls_[i].Start(adapter_->ResetCache(description_.caches[i]), reset_deadline_ms_);
  }
}

// ---- Cache resets ----------------------------------------------------------------------------

void Runner::StepResetting(bool recovery) {
  const int64_t now = Now();
  if (!recovery && install_held_ && now - install_done_ms_ >= options_.group_commit_window_ms) {
    // Resets that take longer than the group-commit window: journal INVALIDATING on its own now
    // (timed when the install answered), so /v1/status and a restart see it.
    Status s = JournalHeldInstall();
    if (!s.ok()) return TaintWith(s.message());
  }
  bool all_done = true;
  for (size_t i = 0; i < reset_calls_.size(); ++i) {
    if (reset_results_[i] && reset_results_[i]->done()) continue;
    auto& call = reset_calls_[i];
    std::string cache(CacheKindName(description_.caches[i]));
    if (!call.active()) {
      // A refused reset waiting for its retry slot.
      all_done = false;
      if (now > reset_deadline_ms_) {
        return TaintWith("the " + cache + " cache reset was refused " + std::to_string(reset_attempts_[i]) +
                         " times within " + std::to_string(options_.deadlines.reset_ms) + " ms: stale KV may remain");
      }
      if (now >= call.deadline_ms) {
        ++reset_attempts_[i];
        call.Start(adapter_->ResetCache(description_.caches[i]), reset_deadline_ms_);
      }
      continue;
    }
    if (!call.pending->Ready()) {
      all_done = false;
      if (now > reset_deadline_ms_) {
        return TaintWith("the " + cache + " cache reset overran its " + std::to_string(options_.deadlines.reset_ms) +
                         " ms deadline");
      }
      continue;
    }
    auto r = call.pending->Get();
    call.Clear();
    if (!r.ok()) return TaintWith("the " + cache + " cache reset failed: " + r.status().ToString());
    reset_results_[i] = *r;
    if (!r->done()) {
      all_done = false;
      if (reset_attempts_[i] >= options_.max_reset_attempts) {
        return TaintWith("the " + cache + " cache reset was refused " + std::to_string(reset_attempts_[i]) +
                         " times (" + std::to_string(r->blocks_in_use) + " blocks in use): stale KV may remain");
      }
      Note("the " + cache + " cache reset was refused; retrying");
      call.deadline_ms = now + options_.reset_retry_interval_ms;  // retry slot (call inactive)
    }
  }
  if (!all_done) return;
  std::vector<CacheResetResult> results;
  for (auto& r : reset_results_) results.push_back(*r);
  if (recovery) {
    phase_ = Phase::kRecoverValidating;
    IssueValidation();
    return;
  }
  // Held, not synced: caches_reset goes in one batch with validated (ResetAndValidated), or alone
  // before a taint (TaintWith). The validation reads are already in flight (StepInstalling).
  resets_held_ = true;
  resets_done_ms_ = now;
  phase_ = Phase::kValidating;
}

void Runner::IssueValidation() {
  int64_t deadline = Now() + options_.deadlines.validate_ms;
  label_evidence_.reset();
  digest_evidence_.reset();
  replay_evidence_.clear();
  replay_started_ms_ = replay_ended_ms_ = -1;
  label_call_.Start(adapter_->ReadLabel(), deadline);
  if (description_.offers_content_digest) digest_call_.Start(adapter_->ReadContentDigest(), deadline);
}

// ---- Validation ------------------------------------------------------------------------------

void Runner::StepValidating(bool recovery) {
  const int64_t now = Now();
  for (auto* call : {&label_call_}) {
    if (!call->active()) continue;
    if (call->pending->Ready()) {
      auto r = call->pending->Get();
      call->Clear();
      if (!r.ok()) return TaintWith("reading the label failed: " + r.status().ToString(), /*call_failed=*/true);
      label_evidence_ = *r;
    } else if (now > call->deadline_ms) {
      call->Clear();
      return TaintWith("reading the label overran its " + std::to_string(options_.deadlines.validate_ms) +
                       " ms deadline", /*call_failed=*/true);
    }
  }
  if (digest_call_.active()) {
    if (digest_call_.pending->Ready()) {
      auto r = digest_call_.pending->Get();
      digest_call_.Clear();
      if (!r.ok()) return TaintWith("reading the content digest failed: " + r.status().ToString(), /*call_failed=*/true);
      digest_evidence_ = *r;
    } else if (now > digest_call_.deadline_ms) {
      digest_call_.Clear();
      return TaintWith("reading the content digest overran its " + std::to_string(options_.deadlines.validate_ms) +
                       " ms deadline", /*call_failed=*/true);
    }
  }
  if (!recovery && install_held_ && now - install_done_ms_ >= options_.group_commit_window_ms) {
    Status s = JournalHeldInstall();  // as in StepResetting: INVALIDATING on its own
    if (!s.ok()) return TaintWith(s.message());
  }
  if (!recovery && resets_held_ && now - resets_done_ms_ >= options_.group_commit_window_ms) {
    // Validation that takes longer than the group-commit window: journal VALIDATING on its own
    // now (timed when the last reset answered), so /v1/status and a restart see it.
    Status installed = JournalHeldInstall();
    if (!installed.ok()) return TaintWith(installed.message());
    resets_held_ = false;
    std::vector<CacheResetResult> results;
    for (auto& r : reset_results_) results.push_back(*r);
    Status s = controller_->CachesReset(results, description_.caches, resets_done_ms_);
    if (!s.ok()) return TaintWith(s.message());
  }
  if (label_call_.active() || digest_call_.active()) return;
  if (!label_evidence_) return;
  if (recovery && target_.facts_fetch) {
    // The manifest's facts of a recovery target (read since the recovery began): only its
    // published FP8 images are used. Past the stage deadline, or when the read failed, the engine's
    // own quantization is what the image is held to, and the note says why.
    if (target_.facts_fetch->Ready()) {
      auto facts = target_.facts_fetch->Get();
      target_.facts_fetch.reset();
      if (facts.ok()) {
        target_.published_fp8 = std::move(facts->published_fp8);
      } else {
        Note("recovery: the published FP8 images of " + target_.label +
             " could not be read: " + facts.status().ToString());
      }
    } else if (now <= started_ms_ + options_.deadlines.stage_ms) {
      return;
    } else {
      target_.facts_fetch.reset();
      Note("recovery: the manifest of " + target_.label + " was not read within the " +
           std::to_string(options_.deadlines.stage_ms) + " ms stage deadline; its published FP8 images are not checked");
    }
  }
  if (digest_evidence_ && digest_evidence_->quantized) {
    // The trainer's own image of the quantization the engine serves, when it published one.
    auto p = target_.published_fp8.find(digest_evidence_->quantized->quantization);
    if (p != target_.published_fp8.end()) digest_evidence_->quantized->published = p->second;
  }
  if (recovery) {
    if (label_evidence_->label != target_.label) {
      return TaintWith("recovery: the engine reports label '" + label_evidence_->label + "', target is '" +
                       target_.label + "'");
    }
    if (!digest_evidence_ || digest_evidence_->content_digest != target_.identity.content_digest) {
      return TaintWith("recovery: live content digest " + (digest_evidence_ ? digest_evidence_->content_digest : "?") +
                       " != target digest " + target_.identity.content_digest);
    }
    phase_ = Phase::kRecoverResuming;
  } else {
    if (!StepReplay()) return;
    Status s;
    if (resets_held_) {
      std::vector<CacheResetResult> results;
      for (auto& r : reset_results_) results.push_back(*r);
      s = controller_->ResetAndValidated(install_held_, install_done_ms_, results, description_.caches,
                                         resets_done_ms_, *label_evidence_, digest_evidence_,
                                         description_.offers_content_digest, MakeReplayOutcome());
      // Journaled (with or without validated) unless the install's or the resets' evidence failed.
      const State at = controller_->state();
      if (at != State::kUpdating) install_held_.reset();
      if (at != State::kUpdating && at != State::kInvalidating) resets_held_ = false;
    } else {
      // VALIDATING was journaled on its own (the window passed): so was INVALIDATING before it.
      s = controller_->Validated(*label_evidence_, digest_evidence_, description_.offers_content_digest,
                                 MakeReplayOutcome());
    }
    if (!s.ok()) return TaintWith(s.message());
    phase_ = Phase::kResuming;
  }
  resume_call_.Start(adapter_->Resume(), now + options_.deadlines.resume_ms);
}

bool Runner::StepReplay() {
  if (!probes_selected_ && description_.offers_replay) {
    // Only the probes computed under the quantization the engine serves are its numbers to match.
    probes_selected_ = true;
    std::erase_if(target_.probes, [this](const ReplayProbe& p) {
      if (p.quantization == description_.quantization) return false;
      if (probes_other_quantization_++ == 0) other_quantization_ = p.quantization;
      return true;
    });
  }
  if (target_.probes.empty() || !description_.offers_replay) return true;
  const int64_t now = Now();
  if (replay_call_.active()) {
    const std::string& name = target_.probes[replay_evidence_.size()].name;
    if (!replay_call_.pending->Ready()) {
      if (now > replay_call_.deadline_ms) {
        replay_call_.Clear();
        TaintWith("replaying probe " + name + " overran its " + std::to_string(options_.deadlines.validate_ms) +
                  " ms deadline", /*call_failed=*/true);
      }
      return false;
    }
    auto r = replay_call_.pending->Get();
    replay_call_.Clear();
    if (!r.ok()) {
      TaintWith("replaying probe " + name + " failed: " + r.status().ToString(), /*call_failed=*/true);
      return false;
    }
    replay_evidence_.push_back(std::move(*r));
    replay_ended_ms_ = now;
  }
  if (replay_evidence_.size() == target_.probes.size()) return true;
  if (replay_started_ms_ < 0) replay_started_ms_ = now;
  replay_call_.Start(adapter_->Replay(target_.probes[replay_evidence_.size()].Request()),
                     now + options_.deadlines.validate_ms);
  return false;
}

ReplayOutcome Runner::MakeReplayOutcome() const {
  ReplayOutcome o;
  if (!description_.offers_replay) {
    o.skip_reason = "engine '" + description_.name + "' (" + description_.kind + ") offers no replay path";
    return o;
  }
  if (target_.probes.empty() && probes_other_quantization_ > 0) {
    // docs/fp8.md: a bf16 trainer's numbers are not an FP8 engine's; the FP8 image digest still
    // proves what it computes with.
    o.skip_reason = "version " + target_.label + " has " + std::to_string(probes_other_quantization_) +
                    " probes, all computed under quantization '" + other_quantization_ +
                    "', none under the engine's '" + description_.quantization + "'";
    return o;
  }
  if (target_.probes.empty()) {
    o.skip_reason = "version " + target_.label + " has no probes";
    return o;
  }
  o.skipped = false;
  o.tolerance = options_.replay_tolerance >= 0 ? options_.replay_tolerance : description_.replay_tolerance;
  o.wall_ms = replay_ended_ms_ - replay_started_ms_;
  for (size_t i = 0; i < target_.probes.size() && i < replay_evidence_.size(); ++i) {
    const ReplayComparison c = CompareReplay(target_.probes[i], replay_evidence_[i], o.tolerance,
                                               description_.replay_accepts_ties);
    ++o.probes;
    o.tokens += static_cast<int64_t>(replay_evidence_[i].steps.size());
    o.engine_ms += replay_evidence_[i].engine_ms;
    if (replay_evidence_[i].precomputed) {
      ++o.precomputed;
      o.staged_ms = std::max(o.staged_ms, replay_evidence_[i].staged_ms);
    }
    if (c.diverged_on_tie_step >= 0) ++o.ties;
    if (o.worst_probe.empty() || c.worst_logprob_diff > o.worst_logprob_diff) {
      o.worst_logprob_diff = c.worst_logprob_diff;
      o.worst_probe = target_.probes[i].name;
      o.worst_step = c.worst_step;
    }
    if (!c.match && o.match) {
      o.match = false;
      o.mismatch = c.mismatch;
    }
  }
  return o;
}

// ---- Resume ----------------------------------------------------------------------------------

void Runner::StepResuming(bool recovery) {
  if (!resume_call_.active()) return;
  const int64_t now = Now();
  if (!resume_call_.pending->Ready()) {
    if (now > resume_call_.deadline_ms) {
      resume_call_.Clear();
      return TaintWith("resume overran its " + std::to_string(options_.deadlines.resume_ms) + " ms deadline");
    }
    return;
  }
  auto r = resume_call_.pending->Get();
  resume_call_.Clear();
  if (!r.ok()) return TaintWith("resume failed: " + r.status().ToString());
  Status s = recovery ? (r->paused_after ? FailedPrecondition("the engine still reports itself paused")
                                         : controller_->Recovered(*install_evidence_, *label_evidence_, *digest_evidence_))
                      : controller_->Resumed(*r);
  if (!s.ok()) return TaintWith(std::string(recovery ? "recovery: " : "") + s.message());
  Note(std::string(recovery ? "recovered to " : "committed ") + target_.label);
  Finish();
}

}  // namespace rc::lifecycle
