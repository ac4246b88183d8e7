#include "rolloutcore/lifecycle/controller.h"

#include <algorithm>

#include "rolloutcore/base/mutex.h"

namespace rc::lifecycle {

std::string_view UpdateOutcomeName(UpdateOutcome o) {
  switch (o) {
    case UpdateOutcome::kInProgress: return "in_progress";
    case UpdateOutcome::kCommitted: return "committed";
    case UpdateOutcome::kRejected: return "rejected";
    case UpdateOutcome::kTainted: return "tainted";
  }
  return "unknown";
}

Json ToJson(const UpdateRecord& u) {
  Json phases = Json::object();
  for (const auto& [k, v] : u.phases_ms) phases[k] = v;
  return Json{{"ordinal", u.ordinal},
              {"recovery", u.recovery},
              {"target", u.target.label},
              {"target_identity", ToJson(u.target.identity)},
              {"from", ToJson(u.from_version)},
              {"outcome", UpdateOutcomeName(u.outcome)},
              {"reason", u.reason},
              {"phase", u.phase},
              {"phases_ms", phases},
              {"requested_ms", u.requested_ms},
              {"ended_ms", u.ended_ms},
              {"evidence", u.evidence},
              {"tainted_from", u.tainted_from.empty() ? Json() : Json(u.tainted_from)},
              {"taint_call_failed", u.taint_call_failed}};
}

Json ToJson(const Counters& c) {
  Json j{{"admissions", c.admissions},
         {"refusals", c.refusals},
         {"finishes", c.finishes},
         {"aborted_by_drain", c.aborted_by_drain},
         {"interrupted", c.interrupted},
         {"updates_committed", c.updates_committed},
         {"updates_rejected", c.updates_rejected},
         {"updates_tainted", c.updates_tainted},
         {"recoveries", c.recoveries},
         {"taints", c.taints},
         {"inflight_spans", c.inflight_spans},
         {"aborted_at_update", c.aborted_at_update}};
  Json by_mode = Json::object();
  for (const auto& [k, v] : c.updates_by_mode) by_mode[k] = v;
  j["updates_by_mode"] = by_mode;
  Json phases = Json::object();
  for (const auto& [k, v] : c.phase_ms_total) {
    phases[k] = Json{{"total_ms", v}, {"count", c.phase_count.at(k)}};
  }
  j["phases"] = phases;
  return j;
}

namespace {

Json ResetResultsJson(const std::vector<CacheResetResult>& results) {
  Json arr = Json::array();
  for (const auto& r : results) {
    arr.push_back(Json{{"cache", CacheKindName(r.kind)},
                       {"success", r.success},
                       {"freed_blocks", r.freed_blocks},
                       {"blocks_in_use", r.blocks_in_use},
                       {"verified", r.verified},
                       {"attempts", r.attempts}});
    if (!r.isolation.empty()) arr.back()["isolation"] = r.isolation;
  }
  return arr;
}

}  // namespace

namespace {

struct RecordName {
  RecordKind kind;
  std::string_view name;
};
constexpr RecordName kRecordNames[] = {{RecordKind::kRestart, "restart"},
                                       {RecordKind::kAdmit, "admit"},
                                       {RecordKind::kFinish, "finish"},
                                       {RecordKind::kAbortedByDrain, "aborted_by_drain"},
                                       {RecordKind::kInterrupted, "interrupted"},
                                       {RecordKind::kStaged, "staged"}};

RecordEvent Kind(RecordKind k) { return RecordEvent{k, Event::kInitialize}; }
RecordEvent Transition(Event e) { return RecordEvent{RecordKind::kTransition, e}; }

}  // namespace

Result<RecordEvent> ParseRecordEvent(std::string_view name) {
  for (const RecordName& n : kRecordNames) {
    if (n.name == name) return Kind(n.kind);
  }
  if (auto e = EventFromName(name)) return Transition(*e);
  std::string known;
  for (const RecordName& n : kRecordNames) known += std::string(n.name) + ", ";
  for (int i = 0; i < kNumEvents; ++i) {
    known += std::string(EventName(static_cast<Event>(i))) + (i + 1 < kNumEvents ? ", " : "");
  }
  return InvalidArgument("event: unknown journal event '" + std::string(name) + "' (known: " + known + ")");
}

std::string_view RecordEventName(RecordEvent e) {
  if (e.kind == RecordKind::kTransition) return EventName(e.event);
  for (const RecordName& n : kRecordNames) {
    if (n.kind == e.kind) return n.name;
  }
  return "unknown";
}

// ---------------------------------------------------------------------------------------------
// Opening and restoring

Result<std::unique_ptr<Controller>> Controller::Open(const Clock* clock, Journal* journal,
                                                     RestoreSummary* summary) {
  if (clock == nullptr || journal == nullptr) return InvalidArgument("Controller::Open needs a clock and a journal");
  std::unique_ptr<Controller> c(new Controller(clock, journal));
  RestoreSummary local;
  RC_RETURN_IF_ERROR(c->Restore(summary ? summary : &local));
  return c;
}

Status Controller::Restore(RestoreSummary* summary) {
  RC_ASSIGN_OR_RETURN(std::vector<JournalRecord> records, journal_->ReadAll());
  rc::MutexLock lock(mu_);
  *summary = RestoreSummary();
  if (records.empty()) return OkStatus();
  summary->restored = true;
  for (const auto& r : records) {
    // Parsed once here; a name this controller does not know is a journal it cannot justify.
    auto type = ParseRecordEvent(r.event);
    if (!type.ok()) return DataLoss("journal record " + std::to_string(r.seq) + ": " + type.status().message());
    ApplyRecordLocked(r, *type);
  }
  summary->state_at_crash = state_;

  // Normalize: the controller must come back in a state it can justify from the journal.
  State to = state_;
  std::string reason;
  if (state_ == State::kDraining || state_ == State::kQuiesced) {
    to = State::kReady;
    reason = "controller restarted in " + std::string(StateName(state_)) +
             ": no weight was touched, the update is rejected and the old version stays";
  } else if (MutationMayHaveBegun(state_) && state_ != State::kTainted) {
    to = State::kTainted;
    reason = "controller restarted in " + std::string(StateName(state_)) +
             " with no commit record: live weights are unproven";
  }
  JournalRecord rr;
  rr.t_ms = clock_->NowMs();
  rr.event = std::string(RecordEventName(Kind(RecordKind::kRestart)));
  rr.from = std::string(StateName(state_));
  rr.to = std::string(StateName(to));
  rr.update = pending_ ? pending_->ordinal : 0;
  rr.detail = Json{{"reason", reason.empty() ? "restarted in a settled state" : reason},
                   {"active_at_crash", static_cast<int64_t>(active_.size())}};
  RC_RETURN_IF_ERROR(AppendLocked(rr));
  ApplyRecordLocked(rr, Kind(RecordKind::kRestart));

  // Bindings alive at the crash: their rollouts may have finished or not; we cannot know, so
  // they are recorded interrupted (never silently dropped).
  std::vector<std::string> ids;
  for (const auto& [id, b] : active_) ids.push_back(id);
  for (const auto& id : ids) {
    JournalRecord ir;
    ir.t_ms = clock_->NowMs();
    ir.event = std::string(RecordEventName(Kind(RecordKind::kInterrupted)));
    ir.rollout = id;
    ir.detail = Json{{"reason", "active when the controller restarted"},
                     {"label", active_[id].version.label},
                     {"generation", active_[id].version.generation}};
    RC_RETURN_IF_ERROR(AppendLocked(ir));
    ApplyRecordLocked(ir, Kind(RecordKind::kInterrupted));
    summary->interrupted.push_back(id);
  }
  summary->state_now = state_;
  summary->engine_may_be_paused = EngineMayBePaused(summary->state_at_crash);
  return OkStatus();
}

// Applies one journal record to the in-memory state. Live operations append a record and then
// call this, and Restore replays the same function: what a restart rebuilds is exactly what the
// live controller had.
void Controller::ApplyRecordLocked(const JournalRecord& r, RecordEvent type) {
  switch (type.kind) {
    case RecordKind::kAdmit: {
      RolloutBinding b;
      b.rollout_id = r.rollout;
      b.version.label = r.detail.value("label", "");
      b.version.generation = r.detail.value("generation", int64_t{0});
      if (r.detail.contains("identity")) {
        auto id = WeightIdentityFromJson(r.detail["identity"], "identity");
        if (id.ok()) b.identity = *id;
      }
      b.admitted_at_ms = r.t_ms;
      b.lease = r.detail.value("lease", false);
      active_[r.rollout] = b;
      ++counters_.admissions;
      // Keep generated ids unique across restarts.
      if (r.rollout.rfind("r-", 0) == 0) {
        try {
          next_rollout_ = std::max<int64_t>(next_rollout_, std::stoll(r.rollout.substr(2)) + 1);
        } catch (...) {
        }
      }
      return;
    }
    case RecordKind::kFinish: {
      active_.erase(r.rollout);
      inflight_.erase(r.rollout);
      ++counters_.finishes;
      // Outcomes, as the finish (and the trajectory row written before it) says them.
      // (A finish whose row could not be written, trajectory_error, has no row to agree with.)
      if (!r.detail.contains("trajectory_error")) {
        if (r.detail.contains("aborted_at_update") && !r.detail["aborted_at_update"].is_null()) {
          ++counters_.aborted_at_update;
        }
        const Json spans = r.detail.value("version_spans", Json());
        if (spans.is_array() && spans.size() > 1) counters_.inflight_spans += static_cast<int64_t>(spans.size()) - 1;
      }
      return;
    }
    case RecordKind::kAbortedByDrain:
      active_.erase(r.rollout);
      inflight_.erase(r.rollout);
      aborted_.insert(r.rollout);
      ++counters_.aborted_by_drain;
      return;
    case RecordKind::kInterrupted:
      active_.erase(r.rollout);
      inflight_.erase(r.rollout);
      interrupted_.insert(r.rollout);
      ++counters_.interrupted;
      return;
    case RecordKind::kStaged:
      if (pending_) {
        auto it = updates_.find(pending_->ordinal);
        if (it != updates_.end()) it->second.evidence["staged"] = r.detail;
      }
      return;
    case RecordKind::kTransition:
    case RecordKind::kRestart:
      ApplyTransitionLocked(r, type);
      return;
  }
}

// A transition (or a restart): accounts the time spent in the state it leaves, moves, and updates
// the pending update's record by what the event means.
void Controller::ApplyTransitionLocked(const JournalRecord& r, RecordEvent type) {
  auto prev = state_;
  auto next = StateFromName(r.to).value_or(state_);
  int64_t spent = std::max<int64_t>(0, r.t_ms - state_entered_ms_);
  if (pending_ && prev != State::kReady && prev != State::kUninitialized && prev != State::kTainted) {
    auto it = updates_.find(pending_->ordinal);
    if (it != updates_.end()) it->second.phases_ms[std::string(StateName(prev))] += spent;
    counters_.phase_ms_total[std::string(StateName(prev))] += spent;
    counters_.phase_count[std::string(StateName(prev))] += 1;
  }
  state_ = next;
  state_entered_ms_ = r.t_ms;

  auto current = [&]() REQUIRES(mu_) -> UpdateRecord* {
    if (!pending_) return nullptr;
    auto it = updates_.find(pending_->ordinal);
    return it == updates_.end() ? nullptr : &it->second;
  };
  if (UpdateRecord* u = current()) {
    u->phase = std::string(StateName(next));
    if (!r.detail.is_null() && r.detail.contains("evidence")) {
      u->evidence[std::string(RecordEventName(type))] = r.detail["evidence"];
    }
  }
  auto close = [&](UpdateOutcome outcome, const std::string& reason) REQUIRES(mu_) {
    if (UpdateRecord* u = current()) {
      u->outcome = outcome;
      u->reason = reason;
      u->ended_ms = r.t_ms;
      if (outcome == UpdateOutcome::kTainted) u->tainted_from = std::string(StateName(prev));
      switch (outcome) {
        case UpdateOutcome::kCommitted: ++counters_.updates_committed; break;
        case UpdateOutcome::kRejected: ++counters_.updates_rejected; break;
        case UpdateOutcome::kTainted: ++counters_.updates_tainted; break;
        case UpdateOutcome::kInProgress: break;
      }
    }
    pending_.reset();
  };
  auto read_version = [&]() REQUIRES(mu_) {
    if (r.detail.contains("version")) {
      version_.label = r.detail["version"].value("label", version_.label);
      version_.generation = r.detail["version"].value("generation", version_.generation);
    }
    if (r.detail.contains("identity")) {
      auto id = WeightIdentityFromJson(r.detail["identity"], "identity");
      if (id.ok()) identity_ = *id;
    }
  };

  // The record's `abort` entries ({rollout, update, target, reason, ...}): the active rollouts an
  // update ends (QuiesceInFlight, or the Taint of an in-flight update).
  auto apply_abort_list = [&]() REQUIRES(mu_) {
    for (const auto& a : r.detail.value("abort", Json::array())) {
      const std::string id = a.value("rollout", "");
      if (!active_.count(id)) continue;
      Json why = a;
      why.erase("rollout");
      inflight_[id].aborted_at_update = why;
    }
  };

  if (type.kind == RecordKind::kRestart) {
    if (next == State::kTainted && prev != State::kTainted) {
      close(UpdateOutcome::kTainted, r.detail.value("reason", ""));
    } else if (next == State::kReady && prev != State::kReady) {
      close(UpdateOutcome::kRejected, r.detail.value("reason", ""));
    }
    return;
  }
  switch (type.event) {
    case Event::kInitialize:
      read_version();
      return;
    case Event::kRequestUpdate:
    case Event::kBeginRecovery: {
      auto t = UpdateTargetFromJson(r.detail.value("target", Json::object()), "target");
      if (!t.ok()) return;
      pending_ = *t;
      last_ordinal_ = std::max(last_ordinal_, t->ordinal);
      UpdateRecord u;
      u.ordinal = t->ordinal;
      u.recovery = type.event == Event::kBeginRecovery;
      u.target = *t;
      u.from_version = version_;
      u.requested_ms = r.t_ms;
      u.phase = std::string(StateName(next));
      updates_[t->ordinal] = u;
      return;
    }
    case Event::kDrainComplete:
      if (r.detail.contains("in_flight") && pending_) {
        // An in-flight quiesce (QuiesceInFlight): the rollouts that live through this update,
        // and those it ends.
        for (const auto& id : r.detail["in_flight"]) {
          if (!id.is_string() || !active_.count(id.get<std::string>())) continue;
          inflight_[id.get<std::string>()].spanned.push_back(pending_->ordinal);
        }
        apply_abort_list();
      }
      return;
    case Event::kResumed:
    case Event::kRecovered:
      if (type.event == Event::kResumed && pending_) {
        ++counters_.updates_by_mode[std::string(PolicyModeName(pending_->mode))];
      }
      read_version();
      if (type.event == Event::kRecovered) ++counters_.recoveries;
      close(UpdateOutcome::kCommitted, "");
      return;
    case Event::kRejectBeforeMutation:
      close(UpdateOutcome::kRejected, r.detail.value("reason", ""));
      return;
    case Event::kTaint:
      ++counters_.taints;
      // An in-flight update tainted after its pause: the frozen rollouts it ends (Taint).
      apply_abort_list();
      if (UpdateRecord* u = current(); u != nullptr && r.detail.is_object() && r.detail.value("call_failed", false)) {
        u->taint_call_failed = true;
      }
      close(UpdateOutcome::kTainted, r.detail.value("reason", ""));
      return;
    case Event::kBeginInstall:
    case Event::kInstallComplete:
    case Event::kCachesReset:
    case Event::kValidated:
      return;  // the move and the evidence above are all they do
  }
}

// ---------------------------------------------------------------------------------------------
// Observers

State Controller::state() const {
  rc::MutexLock lock(mu_);
  return state_;
}
WeightVersion Controller::version() const {
  rc::MutexLock lock(mu_);
  return version_;
}
WeightIdentity Controller::identity() const {
  rc::MutexLock lock(mu_);
  return identity_;
}
std::optional<UpdateTarget> Controller::pending_target() const {
  rc::MutexLock lock(mu_);
  return pending_;
}
int64_t Controller::active_count() const {
  rc::MutexLock lock(mu_);
  return static_cast<int64_t>(active_.size());
}
std::vector<std::string> Controller::ActiveRolloutIds() const {
  rc::MutexLock lock(mu_);
  std::vector<std::string> ids;
  for (const auto& [id, b] : active_) ids.push_back(id);
  return ids;
}
std::optional<RolloutBinding> Controller::Binding(const std::string& rollout_id) const {
  rc::MutexLock lock(mu_);
  auto it = active_.find(rollout_id);
  if (it == active_.end()) return std::nullopt;
  return it->second;
}
std::vector<UpdateRecord> Controller::Updates() const {
  rc::MutexLock lock(mu_);
  std::vector<UpdateRecord> out;
  for (const auto& [k, u] : updates_) out.push_back(u);
  return out;
}
std::optional<UpdateRecord> Controller::Update(int64_t ordinal) const {
  rc::MutexLock lock(mu_);
  auto it = updates_.find(ordinal);
  if (it == updates_.end()) return std::nullopt;
  return it->second;
}
Counters Controller::counters() const {
  rc::MutexLock lock(mu_);
  return counters_;
}

// ---------------------------------------------------------------------------------------------
// Helpers

Status Controller::AppendLocked(JournalRecord& rec) {
  std::vector<JournalRecord*> recs{&rec};
  return AppendRecordsLocked(recs);
}

Status Controller::AppendRecordsLocked(const std::vector<JournalRecord*>& recs) {
  // Named only when the journal refused (not on every append).
  auto what = [&recs] {
    return recs.size() == 1 ? "'" + recs.front()->event + "'"
                            : "'" + recs.front()->event + "' .. '" + recs.back()->event + "'";
  };
  if (deferred_.empty()) {
    Status s = recs.size() == 1 ? journal_->Append(*recs.front()) : journal_->AppendBatch(recs);
    if (!s.ok()) return s.WithContext("journal refused " + what() + ", nothing changed");
    return OkStatus();
  }
  std::vector<JournalRecord*> batch;
  batch.reserve(deferred_.size() + recs.size());
  for (auto& d : deferred_) batch.push_back(&d.first);
  batch.insert(batch.end(), recs.begin(), recs.end());
  Status s = journal_->AppendBatch(batch);
  if (!s.ok()) {
    return s.WithContext("journal refused " + what() + " (with " + std::to_string(deferred_.size()) +
                         " held record(s)), nothing changed");
  }
  for (const auto& [held, type] : deferred_) ApplyRecordLocked(held, type);
  deferred_.clear();
  return OkStatus();
}

Status Controller::CheckLegalLocked(Event event) const {
  if (!NextState(state_, event)) {
    return FailedPrecondition("illegal transition: '" + std::string(EventName(event)) + "' in state " +
                              std::string(StateName(state_)));
  }
  return OkStatus();
}

Status Controller::TransitionLocked(Event event, Json detail) {
  std::vector<Step> steps;
  steps.push_back(Step{event, std::move(detail)});
  return TransitionsLocked(std::move(steps));
}

Status Controller::TransitionAtLocked(Event event, Json detail, int64_t t_ms) {
  std::vector<Step> steps;
  steps.push_back(Step{event, std::move(detail), t_ms});
  return TransitionsLocked(std::move(steps));
}

Status Controller::TransitionsLocked(std::vector<Step> steps) {
  std::vector<JournalRecord> recs(steps.size());
  State at = state_;
  const int64_t now = clock_->NowMs();
  for (size_t i = 0; i < steps.size(); ++i) {
    const Event event = steps[i].event;
    const auto next = NextState(at, event);
    if (!next) {
      return FailedPrecondition("illegal transition: '" + std::string(EventName(event)) + "' in state " +
                                std::string(StateName(at)));
    }
    JournalRecord& rec = recs[i];
    // A step's own time (when its transition happened: the pause issued, the last reset
    // answered) when the caller gives one; never later than now, never before the previous step.
    int64_t t = steps[i].t_ms >= 0 ? std::min(steps[i].t_ms, now) : now;
    if (i > 0) t = std::max(t, recs[i - 1].t_ms);
    rec.t_ms = t;
    rec.event = std::string(EventName(event));
    rec.from = std::string(StateName(at));
    rec.to = std::string(StateName(*next));
    rec.update = pending_ ? pending_->ordinal : 0;
    if (event == Event::kRequestUpdate || event == Event::kBeginRecovery) {
      rec.update = steps[i].detail["target"].value("ordinal", int64_t{0});
    }
    rec.detail = std::move(steps[i].detail);
    at = *next;
  }
  std::vector<JournalRecord*> ptrs;
  ptrs.reserve(recs.size());
  for (auto& r : recs) ptrs.push_back(&r);
  RC_RETURN_IF_ERROR(AppendRecordsLocked(ptrs));
  for (size_t i = 0; i < recs.size(); ++i) ApplyRecordLocked(recs[i], Transition(steps[i].event));
  return OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Rollouts

Status Controller::Initialize(const WeightVersion& version, const WeightIdentity& identity) {
  rc::MutexLock lock(mu_);
  RC_RETURN_IF_ERROR(CheckLegalLocked(Event::kInitialize));
  if (version.label.empty()) return InvalidArgument("initialize: the version label is empty");
  return TransitionLocked(Event::kInitialize,
                          Json{{"version", ToJson(version)}, {"identity", ToJson(identity)}});
}

Result<RolloutBinding> Controller::Admit(const std::string& rollout_id, bool lease) {
  rc::MutexLock lock(mu_);
  if (state_ != State::kReady) {
    ++counters_.refusals;
    std::string why = "engine is " + std::string(StateName(state_));
    if (state_ == State::kTainted || state_ == State::kRecovering) {
      return Unavailable(why + ": live weights are unproven until a recovery completes");
    }
    if (pending_) why += " for update " + std::to_string(pending_->ordinal) + " to " + pending_->label;
    return Unavailable(why + "; admissions resume when it is READY (retry)");
  }
  std::string id = rollout_id;
  if (id.empty()) id = "r-" + std::to_string(next_rollout_);
  if (active_.count(id)) return AlreadyExists("rollout " + id + " is already active");
  JournalRecord rec;
  rec.t_ms = clock_->NowMs();
  rec.event = std::string(RecordEventName(Kind(RecordKind::kAdmit)));
  rec.rollout = id;
  rec.detail = Json{{"label", version_.label}, {"generation", version_.generation}, {"identity", ToJson(identity_)}};
  if (lease) rec.detail["lease"] = true;
  RC_RETURN_IF_ERROR(AppendLocked(rec));
  ApplyRecordLocked(rec, Kind(RecordKind::kAdmit));
  return active_.at(id);
}

std::optional<std::string> Controller::WhyNotActive(const std::string& rollout_id) const {
  rc::MutexLock lock(mu_);
  if (active_.count(rollout_id)) return std::nullopt;
  if (interrupted_.count(rollout_id)) return "it was recorded interrupted at a controller restart";
  if (aborted_.count(rollout_id)) return "the drain policy aborted it";
  return std::nullopt;
}

Status Controller::Finish(const std::string& rollout_id, const Json& detail) {
  if (auto why = WhyNotActive(rollout_id)) return NotFound("rollout " + rollout_id + " is not active: " + *why);
  rc::MutexLock lock(mu_);
  if (!active_.count(rollout_id)) return NotFound("rollout " + rollout_id + " is not active");
  JournalRecord rec;
  rec.t_ms = clock_->NowMs();
  rec.event = std::string(RecordEventName(Kind(RecordKind::kFinish)));
  rec.rollout = rollout_id;
  rec.detail = detail.is_object() ? detail : Json::object();
  rec.detail["label"] = active_[rollout_id].version.label;
  rec.detail["generation"] = active_[rollout_id].version.generation;
  RC_RETURN_IF_ERROR(AppendLocked(rec));
  ApplyRecordLocked(rec, Kind(RecordKind::kFinish));
  return OkStatus();
}

Status Controller::AbortForDrain(const std::vector<std::string>& rollout_ids, const AbortEvidence& evidence) {
  rc::MutexLock lock(mu_);
  if (state_ != State::kDraining) {
    return FailedPrecondition("abort for drain is only legal in DRAINING, not " + std::string(StateName(state_)));
  }
  for (const auto& id : rollout_ids) {
    if (!active_.count(id)) continue;
    JournalRecord rec;
    rec.t_ms = clock_->NowMs();
    rec.event = std::string(RecordEventName(Kind(RecordKind::kAbortedByDrain)));
    rec.rollout = id;
    rec.update = pending_ ? pending_->ordinal : 0;
    rec.detail = Json{{"engine_aborted", evidence.aborted}, {"label", active_[id].version.label}};
    RC_RETURN_IF_ERROR(AppendLocked(rec));
    ApplyRecordLocked(rec, Kind(RecordKind::kAbortedByDrain));
  }
  return OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Update path

Result<UpdateTarget> Controller::PrepareUpdateLocked(UpdateTarget target) const {
  RC_RETURN_IF_ERROR(CheckLegalLocked(Event::kRequestUpdate));
  if (target.label.empty()) return InvalidArgument("update: the target label is empty");
  target.ordinal = last_ordinal_ + 1;
  return target;
}

Result<UpdateTarget> Controller::PrepareUpdate(UpdateTarget target) const {
  rc::MutexLock lock(mu_);
  return PrepareUpdateLocked(std::move(target));
}

Result<UpdateTarget> Controller::RequestUpdate(UpdateTarget target) {
  rc::MutexLock lock(mu_);
  const int64_t asked = target.ordinal;
  RC_ASSIGN_OR_RETURN(target, PrepareUpdateLocked(std::move(target)));
  if (asked != 0 && asked != target.ordinal) {
    return FailedPrecondition("update: prepared as ordinal " + std::to_string(asked) + ", but the next ordinal is " +
                              std::to_string(target.ordinal));
  }
  RC_RETURN_IF_ERROR(TransitionLocked(Event::kRequestUpdate, Json{{"target", ToJson(target)}}));
  return target;
}

Result<Json> Controller::DrainCompleteDetailLocked(const DrainStatus& engine) const {
  if (!engine.idle()) {
    return FailedPrecondition("drain not complete: the engine reports " + std::to_string(engine.running) +
                              " running and " + std::to_string(engine.waiting) + " waiting requests");
  }
  if (!active_.empty()) {
    return FailedPrecondition("drain not complete: " + std::to_string(active_.size()) +
                              " admitted rollouts are still active (first: " + active_.begin()->first + ")");
  }
  return Json{{"evidence", {{"engine_running", engine.running}, {"engine_waiting", engine.waiting}, {"active_bindings", 0}}}};
}

Status Controller::DrainComplete(const DrainStatus& engine, int64_t drained_ms) {
  rc::MutexLock lock(mu_);
  RC_RETURN_IF_ERROR(CheckLegalLocked(Event::kDrainComplete));
  RC_ASSIGN_OR_RETURN(Json detail, DrainCompleteDetailLocked(engine));
  return TransitionAtLocked(Event::kDrainComplete, std::move(detail), drained_ms);
}

Status Controller::QuiesceAndBeginInstall(const DrainStatus& drain, int64_t pause_issued_ms, const PauseEvidence& pause) {
  rc::MutexLock lock(mu_);
  RC_RETURN_IF_ERROR(CheckLegalLocked(Event::kDrainComplete));
  if (pending_ && pending_->mode != PolicyMode::kStrict) {
    return FailedPrecondition("quiesce and begin install: update " + std::to_string(pending_->ordinal) + " is " +
                              std::string(PolicyModeName(pending_->mode)) + ", not strict: it quiesces in flight");
  }
  RC_ASSIGN_OR_RETURN(Json drained, DrainCompleteDetailLocked(drain));
  RC_ASSIGN_OR_RETURN(Json install, BeginInstallDetailLocked(pause));
  std::vector<Step> steps;
  steps.push_back(Step{Event::kDrainComplete, std::move(drained), pause_issued_ms});
  steps.push_back(Step{Event::kBeginInstall, std::move(install)});
  return TransitionsLocked(std::move(steps));
}

Result<std::vector<std::string>> Controller::QuiesceInFlight(const DrainStatus& engine, int64_t max_staleness) {
  rc::MutexLock lock(mu_);
  RC_RETURN_IF_ERROR(CheckLegalLocked(Event::kDrainComplete));
  if (!pending_ || pending_->mode == PolicyMode::kStrict) {
    return FailedPrecondition("quiesce in flight: update " + std::to_string(pending_ ? pending_->ordinal : 0) +
                              " is strict: it must drain");
  }
  const PolicyMode mode = pending_->mode;
  Json in_flight = Json::array(), abort = Json::array();
  std::vector<std::string> ends;
  for (const auto& [id, b] : active_) {
    auto it = inflight_.find(id);
    const int64_t spanned = it == inflight_.end() ? 0 : static_cast<int64_t>(it->second.spanned.size());
    if (it != inflight_.end() && !it->second.aborted_at_update.is_null()) continue;  // ended already
    Json why{{"rollout", id}, {"update", pending_->ordinal}, {"target", pending_->label}};
    if (mode == PolicyMode::kAbort) {
      why["reason"] = "mode_abort";
    } else if (max_staleness >= 0 && spanned + 1 > max_staleness) {
      why["reason"] = "max_staleness";
      why["max_staleness"] = max_staleness;
      why["updates_spanned"] = spanned;
    } else {
      in_flight.push_back(id);
      continue;
    }
    abort.push_back(why);
    ends.push_back(id);
  }
  RC_RETURN_IF_ERROR(TransitionLocked(Event::kDrainComplete,
                                      Json{{"evidence", {{"engine_running", engine.running},
                                                         {"engine_waiting", engine.waiting},
                                                         {"active_bindings", active_.size()},
                                                         {"mode", PolicyModeName(mode)}}},
                                           {"in_flight", in_flight},
                                           {"abort", abort},
                                           {"max_staleness", max_staleness}}));
  return ends;
}

std::optional<InFlightRecord> Controller::InFlight(const std::string& rollout_id) const {
  rc::MutexLock lock(mu_);
  auto it = inflight_.find(rollout_id);
  if (it == inflight_.end()) return std::nullopt;
  return it->second;
}

Result<Json> Controller::BeginInstallDetailLocked(const PauseEvidence& pause) const {
  if (!pause.paused) return FailedPrecondition("install refused: the engine does not report itself paused");
  if (pending_ && pending_->mode != PolicyMode::kStrict) {
    // In flight: keep/recompute install under frozen requests; abort mode ended them all.
    if (pending_->mode == PolicyMode::kAbort && pause.running != 0) {
      return FailedPrecondition("install refused: abort mode, but the paused engine still reports " +
                                std::to_string(pause.running) + " running requests");
    }
    Json ev{{"paused", pause.paused}, {"running", pause.running}, {"mode", PolicyModeName(pending_->mode)},
            {"active_bindings", active_.size()}};
    if (!pause.detail.is_null()) ev["detail"] = pause.detail;
    return Json{{"evidence", ev}};
  }
  if (pause.running != 0) {
    return FailedPrecondition("install refused: the paused engine still reports " + std::to_string(pause.running) +
                              " running requests");
  }
  if (!active_.empty()) {
    return FailedPrecondition("install refused: " + std::to_string(active_.size()) + " admitted rollouts are active");
  }
  Json ev{{"paused", pause.paused}, {"running", pause.running}};
  if (!pause.detail.is_null()) ev["detail"] = pause.detail;
  return Json{{"evidence", ev}};
}

Status Controller::BeginInstall(const PauseEvidence& pause) {
  rc::MutexLock lock(mu_);
  RC_RETURN_IF_ERROR(CheckLegalLocked(Event::kBeginInstall));
  RC_ASSIGN_OR_RETURN(Json detail, BeginInstallDetailLocked(pause));
  return TransitionLocked(Event::kBeginInstall, std::move(detail));
}

Result<Json> Controller::InstallCompleteDetailLocked(const InstallEvidence& install) const {
  if (install.outcome != InstallOutcome::kInstalled) {
    return FailedPrecondition("install evidence says " + std::string(InstallOutcomeName(install.outcome)) +
                              ", not installed: " + install.error);
  }
  if (install.label != pending_->label) {
    return FailedPrecondition("install evidence is for '" + install.label + "', not the target '" +
                              pending_->label + "'");
  }
  return Json{{"evidence", {{"label", install.label},
                            {"bytes", install.bytes},
                            {"install_outcome", InstallOutcomeName(install.outcome)},
                            {"detail", install.detail}}}};
}

Status Controller::InstallComplete(const InstallEvidence& install, int64_t install_ms) {
  rc::MutexLock lock(mu_);
  RC_RETURN_IF_ERROR(CheckLegalLocked(Event::kInstallComplete));
  RC_ASSIGN_OR_RETURN(Json detail, InstallCompleteDetailLocked(install));
  return TransitionAtLocked(Event::kInstallComplete, std::move(detail), install_ms);
}

Result<Json> Controller::CachesResetDetailLocked(const std::vector<CacheResetResult>& results,
                                                 const std::vector<CacheKind>& required) const {
  for (CacheKind kind : required) {
    auto it = std::find_if(results.begin(), results.end(), [&](const CacheResetResult& r) { return r.kind == kind; });
    if (it == results.end()) {
      return FailedPrecondition("no reset result for the " + std::string(CacheKindName(kind)) + " cache");
    }
    if (!it->done()) {
      return FailedPrecondition("the " + std::string(CacheKindName(kind)) + " cache reset was refused (" +
                                std::to_string(it->blocks_in_use) + " blocks in use)");
    }
    if (kind == CacheKind::kPrefix && !it->verified) {
      return FailedPrecondition("the prefix cache reset is unverified: the engine's reply (after " +
                                std::to_string(it->attempts) + " attempts) does not prove the cache was cleared");
    }
  }
  Json unverified = Json::array();
  for (const auto& r : results) {
    if (!r.verified) unverified.push_back(CacheKindName(r.kind));
  }
  return Json{{"evidence", ResetResultsJson(results)}, {"unverified", unverified}};
}

Status Controller::CachesReset(const std::vector<CacheResetResult>& results, const std::vector<CacheKind>& required,
                               int64_t reset_ms) {
  rc::MutexLock lock(mu_);
  RC_RETURN_IF_ERROR(CheckLegalLocked(Event::kCachesReset));
  RC_ASSIGN_OR_RETURN(Json detail, CachesResetDetailLocked(results, required));
  return TransitionAtLocked(Event::kCachesReset, std::move(detail), reset_ms);
}

namespace {

// The quantized image must be the quantization of the weights the content digest proved.
Status CheckQuantized(const QuantizedDigestEvidence& q, const char* what) {
  if (q.Match()) return OkStatus();
  return FailedPrecondition(std::string(what) + " failed: " +
                            q.Mismatch("its live weights, which the content digest proved to be the published bytes"));
}

Json QuantizedJson(const QuantizedDigestEvidence& q) {
  Json j{{"quantization", q.quantization}, {"live", q.live}, {"expected", q.expected}, {"match", q.Match()}};
  // Whose expected image the live one was held to: the trainer's published parts as well, or the
  // engine's own quantization of the proven weights only.
  if (!q.published.empty()) j["published"] = q.published;
  j["expected_from"] = q.published.empty() ? "engine" : "trainer";
  if (!q.detail.empty()) j["detail"] = q.detail;
  return j;
}

}  // namespace

Result<Json> Controller::ValidatedDetailLocked(const LabelEvidence& label, const std::optional<DigestEvidence>& digest,
                                               bool digest_offered, const ReplayOutcome& replay) const {
  if (label.label != pending_->label) {
    return FailedPrecondition("validation failed: the engine reports label '" + label.label + "', target is '" +
                              pending_->label + "'");
  }
  Json ev{{"label", label.label}};
  if (!label.detail.is_null()) ev["label_evidence"] = label.detail;
  const std::string& want = pending_->identity.content_digest;
  if (digest_offered && !want.empty()) {
    if (!digest) return FailedPrecondition("validation failed: the engine offers a content digest but none was read");
    if (digest->content_digest != want) {
      return FailedPrecondition("validation failed: live content digest " + digest->content_digest +
                                " != target digest " + want);
    }
  }
  if (digest && digest->quantized) {
    RC_RETURN_IF_ERROR(CheckQuantized(*digest->quantized, "validation"));
  }
  if (!replay.skipped && !replay.match) {
    const bool digest_agreed = digest_offered && !want.empty() && digest;
    return FailedPrecondition("validation failed: replay: " + replay.mismatch +
                              (digest_agreed ? " (the live content digest " + digest->content_digest +
                                                   " matched: the weights are the published bytes, but the engine "
                                                   "does not compute the trainer's model with them)"
                                             : std::string()));
  }
  if (digest) ev["content_digest"] = digest->content_digest;
  if (digest && digest->quantized) ev["quantized"] = QuantizedJson(*digest->quantized);
  ev["digest_checked"] = digest_offered && !want.empty();
  ev["replay"] = ToJson(replay);
  return Json{{"evidence", ev}};
}

Status Controller::Validated(const LabelEvidence& label, const std::optional<DigestEvidence>& digest,
                             bool digest_offered, const ReplayOutcome& replay) {
  rc::MutexLock lock(mu_);
  RC_RETURN_IF_ERROR(CheckLegalLocked(Event::kValidated));
  RC_ASSIGN_OR_RETURN(Json detail, ValidatedDetailLocked(label, digest, digest_offered, replay));
  return TransitionLocked(Event::kValidated, std::move(detail));
}

Status Controller::ResetAndValidated(const std::optional<InstallEvidence>& install, int64_t install_ms,
                                     const std::vector<CacheResetResult>& results, const std::vector<CacheKind>& required,
                                     int64_t reset_ms, const LabelEvidence& label,
                                     const std::optional<DigestEvidence>& digest, bool digest_offered,
                                     const ReplayOutcome& replay) {
  rc::MutexLock lock(mu_);
  std::vector<Step> steps;
  if (install) {
    RC_RETURN_IF_ERROR(CheckLegalLocked(Event::kInstallComplete));
    RC_ASSIGN_OR_RETURN(Json installed, InstallCompleteDetailLocked(*install));
    steps.push_back(Step{Event::kInstallComplete, std::move(installed), install_ms});
  } else {
    RC_RETURN_IF_ERROR(CheckLegalLocked(Event::kCachesReset));
  }
  RC_ASSIGN_OR_RETURN(Json reset, CachesResetDetailLocked(results, required));
  steps.push_back(Step{Event::kCachesReset, std::move(reset), reset_ms});
  auto validated = ValidatedDetailLocked(label, digest, digest_offered, replay);
  if (!validated.ok()) {
    // The caches were reset; the validation failed: record the install and the reset (VALIDATING)
    // and return the validation's failure, for the caller to taint from VALIDATING.
    RC_RETURN_IF_ERROR(TransitionsLocked(std::move(steps)));
    return validated.status();
  }
  steps.push_back(Step{Event::kValidated, std::move(validated).value()});
  return TransitionsLocked(std::move(steps));
}

Status Controller::Resumed(const ResumeEvidence& resume) {
  rc::MutexLock lock(mu_);
  RC_RETURN_IF_ERROR(CheckLegalLocked(Event::kResumed));
  if (resume.paused_after) return FailedPrecondition("resume not confirmed: the engine still reports itself paused");
  WeightVersion v{pending_->label, version_.generation + 1};
  Json ev{{"paused_after", resume.paused_after}};
  if (!resume.detail.is_null()) ev["detail"] = resume.detail;
  return TransitionLocked(Event::kResumed,
                          Json{{"version", ToJson(v)}, {"identity", ToJson(pending_->identity)}, {"evidence", ev}});
}

Status Controller::RejectBeforeMutation(const std::string& reason, bool install_refused_before_mutation) {
  rc::MutexLock lock(mu_);
  RC_RETURN_IF_ERROR(CheckLegalLocked(Event::kRejectBeforeMutation));
  if (state_ == State::kUpdating && !install_refused_before_mutation) {
    return FailedPrecondition("cannot return to READY from UPDATING: nothing proves the install did not mutate");
  }
  return TransitionLocked(Event::kRejectBeforeMutation,
                          Json{{"reason", reason}, {"install_refused_before_mutation", install_refused_before_mutation}});
}

Status Controller::RecordStageEvidence(const StageEvidence& stage) {
  rc::MutexLock lock(mu_);
  if (state_ != State::kDraining && state_ != State::kQuiesced) {
    return FailedPrecondition("stage evidence is only recorded while DRAINING or QUIESCED, not " +
                              std::string(StateName(state_)));
  }
  JournalRecord rec;
  rec.t_ms = clock_->NowMs();
  rec.event = std::string(RecordEventName(Kind(RecordKind::kStaged)));
  rec.update = pending_ ? pending_->ordinal : 0;
  rec.detail = Json{{"label", stage.label}, {"bytes", stage.bytes}, {"engine", stage.detail}};
  // Group commit: held for the next record's batch (the header says why that is enough).
  deferred_.emplace_back(std::move(rec), Kind(RecordKind::kStaged));
  return OkStatus();
}

Status Controller::Taint(const std::string& reason, bool call_failed) {
  rc::MutexLock lock(mu_);
  return TaintLocked(reason, call_failed);
}

Status Controller::TaintLocked(const std::string& reason, bool call_failed) {
  RC_RETURN_IF_ERROR(CheckLegalLocked(Event::kTaint));
  Json detail{{"reason", reason}};
  if (call_failed) detail["call_failed"] = true;
  std::vector<std::string> ends;
  // An in-flight update paused with rollouts frozen inside the engine: nothing will resume them
  // on proven weights, so the taint ends them (the runner aborts them on the engine) instead of
  // leaving them to hold the engine, and a recovery, until a call timeout.
  const bool frozen = state_ == State::kUpdating || state_ == State::kInvalidating ||
                      state_ == State::kValidating || state_ == State::kResuming;
  if (frozen && pending_ && pending_->mode != PolicyMode::kStrict) {
    Json abort = Json::array();
    for (const auto& [id, b] : active_) {
      auto it = inflight_.find(id);
      if (it != inflight_.end() && !it->second.aborted_at_update.is_null()) continue;  // ended already
      abort.push_back(Json{{"rollout", id},
                           {"update", pending_->ordinal},
                           {"target", pending_->label},
                           {"reason", "update_tainted"}});
      ends.push_back(id);
    }
    if (!abort.empty()) detail["abort"] = abort;
  }
  RC_RETURN_IF_ERROR(TransitionLocked(Event::kTaint, detail));
  ended_by_last_taint_ = std::move(ends);
  return OkStatus();
}

Status Controller::TaintIfReady(const std::string& reason) {
  rc::MutexLock lock(mu_);
  if (state_ != State::kReady) {
    return FailedPrecondition("not READY but " + std::string(StateName(state_)) + ": " + reason);
  }
  return TaintLocked(reason);
}

std::vector<std::string> Controller::EndedByLastTaint() const {
  rc::MutexLock lock(mu_);
  return ended_by_last_taint_;
}

bool Controller::AbortedByDrain(const std::string& rollout_id) const {
  rc::MutexLock lock(mu_);
  return aborted_.count(rollout_id) > 0;
}

std::vector<std::pair<std::string, Json>> Controller::LeasesEndedByUpdate() const {
  rc::MutexLock lock(mu_);
  std::vector<std::pair<std::string, Json>> out;
  for (const auto& [id, rec] : inflight_) {
    if (rec.aborted_at_update.is_null()) continue;
    auto b = active_.find(id);
    if (b != active_.end() && b->second.lease) out.emplace_back(id, rec.aborted_at_update);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Recovery

Result<UpdateTarget> Controller::BeginRecovery(UpdateTarget target) {
  rc::MutexLock lock(mu_);
  RC_RETURN_IF_ERROR(CheckLegalLocked(Event::kBeginRecovery));
  if (target.label.empty()) return InvalidArgument("recovery: the target label is empty");
  if (target.identity.content_digest.empty()) {
    return InvalidArgument("recovery to '" + target.label +
                           "' needs the version's content digest: recovery is proven byte for byte");
  }
  // Rollouts an update ended (the taint of an in-flight update ends those it froze) are over on
  // proven-or-not weights alike: their proxies are answered by the engine's abort, or by the
  // recovery's own pause (abort), and finish whenever that arrives. Only others hold a recovery.
  int64_t live = 0;
  std::string first;
  for (const auto& [id, b] : active_) {
    auto it = inflight_.find(id);
    if (it != inflight_.end() && !it->second.aborted_at_update.is_null()) continue;
    if (live++ == 0) first = id;
  }
  if (live > 0) {
    return FailedPrecondition("recovery refused: " + std::to_string(live) + " rollouts still active (first: " + first +
                              ")");
  }
  target.ordinal = last_ordinal_ + 1;
  RC_RETURN_IF_ERROR(TransitionLocked(Event::kBeginRecovery, Json{{"target", ToJson(target)}}));
  return target;
}

Status Controller::Recovered(const InstallEvidence& install, const LabelEvidence& label, const DigestEvidence& digest) {
  rc::MutexLock lock(mu_);
  RC_RETURN_IF_ERROR(CheckLegalLocked(Event::kRecovered));
  if (install.outcome != InstallOutcome::kInstalled) {
    return FailedPrecondition("recovery install evidence says " + std::string(InstallOutcomeName(install.outcome)) +
                              ", not installed: " + install.error);
  }
  if (install.label != pending_->label) {
    return FailedPrecondition("recovery install evidence is for '" + install.label + "', not '" + pending_->label + "'");
  }
  if (label.label != pending_->label) {
    return FailedPrecondition("recovery failed: the engine reports label '" + label.label + "', target is '" +
                              pending_->label + "'");
  }
  if (digest.content_digest != pending_->identity.content_digest) {
    return FailedPrecondition("recovery failed: live content digest " + digest.content_digest +
                              " != target digest " + pending_->identity.content_digest);
  }
  if (digest.quantized) RC_RETURN_IF_ERROR(CheckQuantized(*digest.quantized, "recovery"));
  WeightVersion v{pending_->label, version_.generation + 1};
  Json evidence{{"label", label.label}, {"content_digest", digest.content_digest}, {"bytes", install.bytes}};
  if (digest.quantized) evidence["quantized"] = QuantizedJson(*digest.quantized);
  if (!label.detail.is_null()) evidence["label_evidence"] = label.detail;
  // The engine's refit mode (delta | full, and why) and anchor check, journaled when it reports them.
  for (const char* key : {"mode", "mode_reason", "anchor_check"}) {
    if (install.detail.is_object() && install.detail.contains(key)) evidence[key] = install.detail[key];
  }
  return TransitionLocked(Event::kRecovered,
                          Json{{"version", ToJson(v)}, {"identity", ToJson(pending_->identity)}, {"evidence", evidence}});
}

}  // namespace rc::lifecycle
