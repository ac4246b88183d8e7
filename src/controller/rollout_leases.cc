// Lease-mode admission in the controller service (rollout_admission.h): admit, heartbeat, finish,
// expiry, and the leases an update ended, closed for the client at once and recorded by the
// driver's sweep.
#include <algorithm>

#include <fmt/format.h>

#include "controller/rollout_admission.h"
#include "rolloutcore/base/clock.h"
#include "rolloutcore/base/log.h"
#include "rolloutcore/base/mutex.h"

namespace rc::controller {

using lifecycle::State;

void RolloutAdmission::PublishLeaseCountsLocked() {
  open_leases_.store(static_cast<int64_t>(leases_.size() + closing_leases_.size()));
  closing_leases_pending_.store(static_cast<int64_t>(closing_leases_.size()));
}

Result<Json> RolloutAdmission::Admit(const std::string& rollout_id_in) {
  std::string rollout_id = rollout_id_in;
  if (rollout_id.empty()) rollout_id = NewRolloutId();
  {
    rc::MutexLock lock(core_->mu);
    if (closing_leases_.count(rollout_id) || leases_.count(rollout_id)) {
      return AlreadyExists("rollout " + rollout_id + " is already active");
    }
  }
  // Read before the admission, so a taint after it is never missed (one in between can only make
  // the finish say "tainted during the lease" of a lease admitted after a recovery: the safe side).
  std::vector<int64_t> taints;
  for (const auto& slot : core_->engines) taints.push_back(slot->controller->counters().taints);
  RC_ASSIGN_OR_RETURN(auto admitted, AdmitSomewhere(rollout_id, /*lease=*/true));
  auto [index, binding] = admitted;
  Lease lease;
  lease.engine = index;
  lease.taints_at_admission = taints[index];
  lease.admitted_wall_ms = WallTimeMs();
  lease.binding = binding;
  if (core_->options.lease_timeout_ms > 0) lease.expires_ms = SteadyMs() + core_->options.lease_timeout_ms;
  {
    rc::MutexLock lock(core_->mu);
    leases_[rollout_id] = lease;
    expired_leases_.erase(rollout_id);
    ended_leases_.erase(rollout_id);
    PublishLeaseCountsLocked();
  }
  Json j = lifecycle::ToJson(binding);
  j["engine"] = core_->engines[index]->handle.name;
  j["lease_timeout_ms"] = core_->options.lease_timeout_ms;
  return j;
}

std::optional<Status> RolloutAdmission::ClosedLeaseStatusLocked(const std::string& rollout_id) const {
  if (auto e = ended_leases_.find(rollout_id); e != ended_leases_.end()) {
    const Json& why = e->second;
    return FailedPrecondition(fmt::format(
        "the lease of rollout '{}' was ended by update {} (to '{}', reason {}): it is recorded with aborted_at_update "
        "and without the output reported after it ended; admit a new rollout",
        rollout_id, why.value("update", int64_t{0}), why.value("target", ""), why.value("reason", "")));
  }
  if (auto e = expired_leases_.find(rollout_id); e != expired_leases_.end()) {
    return FailedPrecondition("the lease of rollout '" + rollout_id + "' expired at wall ms " +
                              std::to_string(e->second) + " (no finish or heartbeat within " +
                              std::to_string(core_->options.lease_timeout_ms) +
                              " ms); it is recorded with finish_reason expired");
  }
  return std::nullopt;
}

namespace {
// Why an update (or a strict update's drain policy) ended `rollout_id`, or null while it lives.
Json EndedByUpdate(const lifecycle::Controller& c, const std::string& rollout_id) {
  if (auto inflight = c.InFlight(rollout_id); inflight && !inflight->aborted_at_update.is_null()) {
    return inflight->aborted_at_update;
  }
  if (!c.Binding(rollout_id) && c.AbortedByDrain(rollout_id)) {
    const auto pending = c.pending_target();
    return Json{{"update", pending ? pending->ordinal : 0},
                {"target", pending ? pending->label : ""},
                {"reason", "drain_abort"}};
  }
  return Json();
}
}  // namespace

Status RolloutAdmission::FinishLease(const std::string& rollout_id, const Json& body) {
  Lease lease;
  {
    rc::MutexLock lock(core_->mu);
    if (auto closed = ClosedLeaseStatusLocked(rollout_id)) return *closed;
    auto it = leases_.find(rollout_id);
    if (it == leases_.end()) {
      for (const auto& slot : core_->engines) {
        if (auto why = slot->controller->WhyNotActive(rollout_id)) {
          return NotFound("no lease for rollout '" + rollout_id + "' (on " + slot->handle.name + ": " + *why + ")");
        }
      }
      return NotFound("no lease for rollout '" + rollout_id + "'");
    }
    // Taken out while it is finished: a concurrent finish, the expiry or an update's end cannot
    // write a second row.
    lease = it->second;
    leases_.erase(it);
  }
  auto put_back = [&](bool row_written) {
    rc::MutexLock lock(core_->mu);
    lease.row_written = lease.row_written || row_written;
    leases_[rollout_id] = lease;
  };
  EngineSlot* slot = core_->engines[lease.engine].get();
  if (const Json why = EndedByUpdate(*slot->controller, rollout_id); !why.is_null()) {
    // An update ended it before this finish arrived (the sweep had not run yet): the client's
    // output may hold tokens of the new weights, so it is not stored as a bound rollout.
    {
      rc::MutexLock lock(core_->mu);
      ended_leases_[rollout_id] = why;
    }
    Status recorded = RecordLeaseEndedByUpdate(slot, rollout_id, lease, why);
    rc::MutexLock lock(core_->mu);
    if (!recorded.ok()) closing_leases_[rollout_id] = Closing{lease, why};  // the driver retries the record
    PublishLeaseCountsLocked();
    return *ClosedLeaseStatusLocked(rollout_id);
  }
  auto binding = slot->controller->Binding(rollout_id);
  if (!binding) return NotFound("rollout '" + rollout_id + "' is not active on " + slot->handle.name);
  Trajectory t;
  t.binding = *binding;
  t.engine = slot->handle.name;
  t.output_token_ids = IntArray(body.value("token_ids", Json::array()));
  t.prompt_token_ids = IntArray(body.value("prompt_token_ids", Json::array()));
  if (body.contains("logprobs") && body["logprobs"].is_array()) {
    for (const auto& x : body["logprobs"]) {
      if (x.is_number()) t.logprobs.push_back(x.get<double>());
    }
  }
  t.finish_reason = body.value("finish_reason", "stop");
  t.cached_tokens = body.value("cached_tokens", int64_t{0});
  t.admitted_ms = lease.admitted_wall_ms;
  t.finished_ms = WallTimeMs();
  t.extra = body.value("extra", Json::object());
  if (!t.extra.is_object()) t.extra = Json{{"client_extra", t.extra}};
  Json finish_detail{{"lease", true}, {"finish_reason", t.finish_reason}};
  if (const int64_t taints = slot->controller->counters().taints; taints > lease.taints_at_admission) {
    // The engine was tainted while the client generated (an identity check found other weights,
    // a restart, a pause behind the controller's back): its output is not bound to the version it
    // was admitted under. Recorded as a proxied rollout's mismatch is, never as a clean row.
    const std::string why = "engine " + slot->handle.name + " was tainted while the lease was open (" +
                            std::to_string(taints - lease.taints_at_admission) + " taint(s) since the admission; now " +
                            std::string(lifecycle::StateName(slot->controller->state())) + ")";
    t.extra["client_finish_reason"] = t.finish_reason;
    t.extra["identity_mismatch"] = why;
    t.finish_reason = "identity_mismatch";
    finish_detail["finish_reason"] = t.finish_reason;
    finish_detail["error"] = "identity mismatch";
    finish_detail["identity_mismatch"] = why;
    if (!lease.row_written) {
      if (Status stored = core_->trajectories->Insert(t); !stored.ok()) {
        put_back(false);
        return stored.WithContext("lease " + rollout_id + ": the trajectory was not stored; retry the finish");
      }
    }
    if (Status finished = slot->controller->Finish(rollout_id, finish_detail); !finished.ok()) {
      if (slot->controller->Binding(rollout_id)) put_back(true);
      return finished.WithContext("lease " + rollout_id + ": the finish was not journaled; retry the finish");
    }
    {
      rc::MutexLock lock(core_->mu);
      PublishLeaseCountsLocked();
    }
    return FailedPrecondition("rollout " + rollout_id + " is not bound to " + binding->version.label + ": " + why +
                              "; it is recorded with finish_reason identity_mismatch; admit a new rollout");
  }
  if (Status spans = AddLeaseSpans(slot, rollout_id, *binding, body, &t, &finish_detail); !spans.ok()) {
    put_back(lease.row_written);
    return spans;
  }
  // Row first, then the finish (service.h): a crash between the two leaves the rollout admitted
  // in the journal (recorded interrupted at restart) with its row kept, never finished and lost.
  if (!lease.row_written) {
    if (Status stored = core_->trajectories->Insert(t); !stored.ok()) {
      put_back(false);
      return stored.WithContext("lease " + rollout_id + ": the trajectory was not stored and the lease stays open; "
                                "retry the finish");
    }
  }
  if (Status finished = slot->controller->Finish(rollout_id, finish_detail); !finished.ok()) {
    if (!slot->controller->Binding(rollout_id)) return finished;  // ended meanwhile (drain abort)
    put_back(true);
    return finished.WithContext("lease " + rollout_id + ": the trajectory is stored but the finish was not journaled; "
                                "retry the finish");
  }
  {
    rc::MutexLock lock(core_->mu);
    PublishLeaseCountsLocked();
  }
  return OkStatus();
}

Status RolloutAdmission::AddLeaseSpans(EngineSlot* slot, const std::string& rollout_id,
                                       const lifecycle::RolloutBinding& binding, const Json& body, Trajectory* t,
                                       Json* finish_detail) {
  auto inflight = slot->controller->InFlight(rollout_id);
  if (!inflight || inflight->spanned.empty()) return OkStatus();
  // It lived through in-flight updates: only the engine knows where its tokens' weights
  // changed. Spans the client passes on are checked as a proxied rollout's; without them the
  // row says which updates it spanned and records no spans (never a single bound span).
  Json spanned = Json::array();
  for (int64_t u : inflight->spanned) spanned.push_back(u);
  t->extra["spanned_updates"] = spanned;
  (*finish_detail)["spanned_updates"] = spanned;
  if (body.contains("version_spans") && !body["version_spans"].is_null()) {
    std::string why;
    Json spans = VersionSpans(slot, binding, Json{{"version_spans", body["version_spans"]}},
                              static_cast<int64_t>(t->output_token_ids.size()), &*inflight, &why);
    if (!body["version_spans"].is_array() || body["version_spans"].empty()) why = "expected a non-empty list";
    if (!why.empty()) {
      return InvalidArgument("version_spans: " + why + " (lease " + rollout_id +
                             " lived through in-flight updates; pass the engine's per-choice version_spans, or "
                             "none); the lease stays open");
    }
    t->version_spans = spans;
    if (spans.size() > 1) (*finish_detail)["version_spans"] = spans;
  } else {
    t->extra["version_spans"] = "not reported by the client";
  }
  return OkStatus();
}

Result<Json> RolloutAdmission::ExtendLease(const std::string& rollout_id) {
  rc::MutexLock lock(core_->mu);
  if (auto closed = ClosedLeaseStatusLocked(rollout_id)) return *closed;
  auto it = leases_.find(rollout_id);
  if (it == leases_.end()) return NotFound("no lease for rollout '" + rollout_id + "'");
  if (const Json why = EndedByUpdate(*core_->engines[it->second.engine]->controller, rollout_id); !why.is_null()) {
    // Ended by an update; the driver's sweep records it. The client hears it now.
    ended_leases_[rollout_id] = why;
    closing_leases_[rollout_id] = Closing{it->second, why};
    leases_.erase(it);
    PublishLeaseCountsLocked();
    return *ClosedLeaseStatusLocked(rollout_id);
  }
  if (core_->options.lease_timeout_ms > 0) it->second.expires_ms = SteadyMs() + core_->options.lease_timeout_ms;
  return Json{{"rollout_id", rollout_id},
              {"expires_in_ms", core_->options.lease_timeout_ms > 0 ? Json(core_->options.lease_timeout_ms) : Json()}};
}

Status RolloutAdmission::RecordLeaseEndedByUpdate(EngineSlot* slot, const std::string& rollout_id, const Lease& lease,
                                                   const Json& why) {
  auto binding = slot->controller->Binding(rollout_id);
  if (!binding) {
    // Aborted by the drain (the journal's aborted_by_drain record ends it): its row says so.
    // Otherwise recorded already (a retry after the finish went through).
    if (!slot->controller->AbortedByDrain(rollout_id) || lease.row_written) return OkStatus();
    Trajectory t;
    t.binding = lease.binding;
    t.engine = slot->handle.name;
    t.finish_reason = "abort";
    t.admitted_ms = lease.admitted_wall_ms;
    t.finished_ms = WallTimeMs();
    t.extra = Json{{"lease", true}, {"aborted_by_drain", why}};
    return core_->trajectories->Insert(t);
  }
  Trajectory t;
  t.binding = *binding;
  t.engine = slot->handle.name;
  t.finish_reason = "abort";
  t.aborted_at_update = why;
  t.admitted_ms = lease.admitted_wall_ms;
  t.finished_ms = WallTimeMs();
  t.extra = Json{{"lease", true}};
  if (!lease.row_written) RC_RETURN_IF_ERROR(core_->trajectories->Insert(t));
  return slot->controller->Finish(rollout_id,
                                  Json{{"lease", true}, {"finish_reason", "abort"}, {"aborted_at_update", why}});
}

void RolloutAdmission::EndLeasesOfUpdates(size_t engine) {
  EngineSlot* slot = core_->engines[engine].get();
  auto ended = slot->controller->LeasesEndedByUpdate();
  std::vector<std::pair<std::string, Closing>> todo;
  {
    rc::MutexLock lock(core_->mu);
    // A strict update's drain policy (abort) ended the binding itself (journaled aborted_by_drain):
    // the lease is over too, the same way.
    for (const auto& [id, lease] : leases_) {
      if (lease.engine != engine || !slot->controller->AbortedByDrain(id)) continue;
      if (Json why = EndedByUpdate(*slot->controller, id); !why.is_null()) ended.emplace_back(id, std::move(why));
    }
    for (const auto& [id, why] : ended) {
      auto it = leases_.find(id);
      if (it == leases_.end() || it->second.engine != engine) continue;  // a finish holds it, or closing
      ended_leases_[id] = why;
      closing_leases_[id] = Closing{it->second, why};
      leases_.erase(it);
    }
    for (const auto& [id, c] : closing_leases_) {
      if (c.lease.engine == engine && !c.why.is_null()) todo.emplace_back(id, c);
    }
  }
  for (auto& [id, c] : todo) {
    Status s = RecordLeaseEndedByUpdate(slot, id, c.lease, c.why);
    rc::MutexLock lock(core_->mu);
    if (s.ok()) {
      RC_LOG_WARN("lease of rollout {} on {} ended by update {} ({})", id, slot->handle.name,
                  c.why.value("update", int64_t{0}), c.why.value("reason", ""));
      closing_leases_.erase(id);
      if (ended_leases_.size() > 100000) ended_leases_.erase(ended_leases_.begin());
    } else {
      RC_LOG_ERROR("lease of rollout {} was ended by an update but could not be recorded ({}); retrying", id,
                   s.ToString());
    }
  }
  rc::MutexLock lock(core_->mu);
  PublishLeaseCountsLocked();
}

void RolloutAdmission::ExpireLeases(size_t engine) {
  std::vector<std::pair<std::string, Lease>> due;
  {
    rc::MutexLock lock(core_->mu);
    const int64_t now = SteadyMs();
    for (auto it = leases_.begin(); it != leases_.end();) {
      if (it->second.engine == engine && it->second.expires_ms != 0 && now >= it->second.expires_ms) {
        // Closed for the client from this moment (a finish racing the record gets 409 expired,
        // not 404), recorded below and retried while that fails.
        expired_leases_[it->first] = WallTimeMs();
        if (expired_leases_.size() > 100000) expired_leases_.erase(expired_leases_.begin());
        closing_leases_[it->first] = Closing{it->second, Json()};
        it = leases_.erase(it);
      } else {
        ++it;
      }
    }
    for (const auto& [id, c] : closing_leases_) {
      if (c.lease.engine == engine && c.why.is_null() && now >= c.lease.expires_ms) due.emplace_back(id, c.lease);
    }
  }
  EngineSlot* slot = core_->engines[engine].get();
  for (auto& [id, lease] : due) {
    auto binding = slot->controller->Binding(id);
    Status s = OkStatus();
    if (binding) {
      Trajectory t;
      t.binding = *binding;
      t.engine = slot->handle.name;
      t.finish_reason = "expired";
      t.admitted_ms = lease.admitted_wall_ms;
      t.finished_ms = WallTimeMs();
      t.extra = Json{{"lease_timeout_ms", core_->options.lease_timeout_ms}};
      s = lease.row_written ? OkStatus() : core_->trajectories->Insert(t);
      if (s.ok()) lease.row_written = true;
      if (s.ok()) {
        s = slot->controller->Finish(id, Json{{"lease", true},
                                              {"expired", true},
                                              {"finish_reason", "expired"},
                                              {"lease_timeout_ms", core_->options.lease_timeout_ms}});
      }
    }  // else ended another way (drain abort); nothing holds the drain
    rc::MutexLock lock(core_->mu);
    if (s.ok()) {
      if (binding) {
        RC_LOG_WARN("lease of rollout {} on {} expired after {} ms without a finish or heartbeat", id,
                    slot->handle.name, core_->options.lease_timeout_ms);
      }
      closing_leases_.erase(id);
    } else {
      RC_LOG_ERROR("lease of rollout {} expired but could not be recorded ({}); retrying", id, s.ToString());
      auto it = closing_leases_.find(id);
      if (it != closing_leases_.end()) {
        it->second.lease.row_written = lease.row_written;
        it->second.lease.expires_ms = SteadyMs() + 1000;
      }
    }
  }
  rc::MutexLock lock(core_->mu);
  PublishLeaseCountsLocked();
}

void RolloutAdmission::SweepLeases(EngineSlot* slot, LeaseSweep* sweep) {
  if (open_leases_.load() <= 0) return;
  // Leases an update ended are closed at once, so the next drain never waits for them. Only
  // an operation (quiesce, drain abort, taint) ends one: sweep while the engine is not READY,
  // once more when it is back, and while a closed lease's record is still to be written
  // (heartbeat and finish check for themselves). Nothing is scanned per pass while serving.
  const State now_state = slot->controller->state();
  if (now_state != State::kReady || sweep->last_sweep_state != State::kReady || closing_leases_pending_.load() > 0) {
    EndLeasesOfUpdates(slot->index);
    sweep->last_sweep_state = now_state;
  }
  if (SteadyMs() >= sweep->next_expiry_check) {
    ExpireLeases(slot->index);
    const int64_t timeout = core_->options.lease_timeout_ms;
    sweep->next_expiry_check = SteadyMs() + (timeout > 0 ? std::min<int64_t>(50, timeout) : 50);
  }
}

}  // namespace rc::controller
