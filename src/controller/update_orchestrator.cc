// Update orchestration in the controller service (update_orchestrator.h): update requests, the
// update journal, update status. The driver threads are in update_driver.cc.
#include "controller/update_orchestrator.h"

#include <algorithm>
#include <chrono>

#include <fmt/format.h>

#include "rolloutcore/base/clock.h"
#include "rolloutcore/base/log.h"
#include "rolloutcore/base/mutex.h"

namespace rc::controller {

using lifecycle::State;
using lifecycle::UpdateOutcome;

namespace {

// "u-12" → 12; 0 when the id is not of that form.
int64_t OpNumber(const std::string& id) {
  if (id.rfind("u-", 0) != 0 || id.size() < 3 || id.size() > 20) return 0;
  int64_t n = 0;
  for (size_t i = 2; i < id.size(); ++i) {
    if (id[i] < '0' || id[i] > '9') return 0;
    n = n * 10 + (id[i] - '0');
  }
  return n;
}

}  // namespace

Status UpdateOrchestrator::Open(bool must_exist) {
  RC_ASSIGN_OR_RETURN(ops_journal_,
                      lifecycle::SqliteJournal::Open(core_->options.state_dir + "/updates.journal.db", must_exist));
  return OkStatus();
}

void UpdateOrchestrator::StartDrivers() {
  for (auto& slot : core_->engines) {
    EngineSlot* raw = slot.get();
    slot->driver = std::thread([this, raw] { Drive(raw); });
  }
}

void UpdateOrchestrator::StartFollower() {
  follower_ = std::thread([this] { FollowDirectory(); });
}

void UpdateOrchestrator::StopThreads() {
  core_->stop = true;
  core_->cv.notify_all();
  for (auto& slot : core_->engines) {
    if (slot->driver.joinable()) slot->driver.join();
  }
  if (follower_.joinable()) follower_.join();
}

int UpdateOrchestrator::updating() const {
  rc::MutexLock lock(core_->mu);
  return updating_;
}

void UpdateOrchestrator::FollowDirectory() {
  uint64_t seq = 0;
  // Start from the newest commit so a restart does not replay history.
  while (!core_->stop) {
    auto commits = core_->versions->WaitForCommits(core_->options.model, seq, 1000);
    if (!commits.ok()) {
      RC_LOG_WARN("auto-update: {}", commits.status().ToString());
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      continue;
    }
    if (commits->empty()) continue;
    const auto& latest = commits->back();
    seq = latest.seq;
    auto id = Enqueue(core_->options.model, latest.version, false, std::nullopt, core_->options.default_mode);
    if (!id.ok()) RC_LOG_WARN("auto-update to {}: {}", latest.version, id.status().ToString());
  }
}

// ---- Updates ----------------------------------------------------------------------------------

void UpdateOrchestrator::StageAhead(const std::string& model, const std::string& version, std::optional<size_t> only) {
  // Idle engines that do not serve this version start staging it now, while the directory
  // resolves it: their update adopts the stage (Runner::Prefetch). A request the directory
  // refuses leaves a staged image nothing installs (the next stage replaces it).
  // At most as many as may update now (--max-updating): a stage can hold an engine's serving
  // briefly (vLLM stages between scheduler steps), so a rolling update keeps the rest serving.
  rc::MutexLock lock(core_->mu);
  bool any = false;
  // (Counted by the operations running, not by updating_: an engine whose update ended holds its
  // place until its identity check settled, but stages nothing.)
  int64_t places = core_->options.max_updating;
  for (const auto& slot : core_->engines) places -= slot->running_op.empty() ? 0 : 1;
  for (auto& slot : core_->engines) {
    if (places <= 0) break;
    if (only && slot->index != *only) continue;
    if (!slot->queue.empty() || !slot->running_op.empty()) continue;
    if (slot->controller->state() != State::kReady || slot->controller->version().label == version) continue;
    slot->prefetch = std::make_pair(model, version);
    any = true;
    --places;
  }
  if (any) core_->cv.notify_all();
}

Status UpdateOrchestrator::CheckNotFailed(const std::string& model, const std::string& version, bool retry_failed) {
  rc::MutexLock lock(core_->mu);
  auto failed = failed_versions_.find(VersionKey(model, version));
  if (failed != failed_versions_.end() && !retry_failed) {
    DropPrefetchLocked(version);
    return FailedPrecondition("version " + version + " of " + model + " is marked failed: " + failed->second +
                              "; it is not rolled to any engine (publish a new version, or request it again with "
                              "retry_failed: true once the cause is fixed)");
  }
  if (failed != failed_versions_.end()) {
    RC_RETURN_IF_ERROR(JournalOpLocked("version_retry", Json{{"id", ""}, {"model", model}, {"version", version}}));
    RC_LOG_WARN("version {} of {}: the failed mark is cleared on request (retry_failed)", version, model);
    failed_versions_.erase(failed);
  }
  return OkStatus();
}

std::optional<Result<std::string>> UpdateOrchestrator::ExistingOpLocked(const std::string& model,
                                                                        const std::string& version,
                                                                        lifecycle::PolicyMode mode,
                                                                        const lifecycle::UpdateTarget& target,
                                                                        std::set<size_t>* already_live) {
  // The same version requested again while an update to it is still running (or queued):
  // one cycle, one id.
  const OpRecord* latest = nullptr;  // the newest update (or recovery) that committed this version
  for (const auto& [id, rec] : ops_) {
    if (rec.model != model || rec.version != version) continue;
    const Json op = OpJson(rec);
    if (op["done"].get<bool>() && op["outcome"] == "committed" &&
        (latest == nullptr || OpNumber(id) > OpNumber(latest->id))) {
      latest = &rec;
    }
    if (rec.recovery) continue;
    if (!op["done"].get<bool>()) {
      DropPrefetchLocked(version);
      if (rec.mode != mode) {
        // The caller asked for a mode that would not run: say so rather than hand out an id
        // whose update runs another (issue 36 #5).
        return Result<std::string>(FailedPrecondition(fmt::format(
            "update {} of {} {} is already in progress in mode {}; this request asks for mode {}: wait for {} to "
            "end, or request mode {}",
            id, model, version, lifecycle::PolicyModeName(rec.mode), lifecycle::PolicyModeName(mode), id,
            lifecycle::PolicyModeName(rec.mode))));
      }
      return Result<std::string>(id);
    }
  }
  for (const auto& slot : core_->engines) {
    const auto& c = *slot->controller;
    // The driver clears running_op only on its next pass after the update ended.
    bool idle = slot->running_op.empty();
    if (!idle) {
      auto op = ops_.find(slot->running_op);
      if (op != ops_.end()) {
        auto ord = op->second.ordinals.find(slot->index);
        if (ord != op->second.ordinals.end()) {
          auto u = c.Update(ord->second);
          idle = u && u->outcome != UpdateOutcome::kInProgress;
        }
      }
    }
    const bool live = slot->queue.empty() && idle && c.state() == State::kReady &&
                      c.version().label == target.label &&
                      c.identity().content_digest == target.identity.content_digest;
    if (live) already_live->insert(slot->index);
  }
  // Live everywhere already: the update that installed it, if this controller ran one.
  if (already_live->size() == core_->engines.size() && latest != nullptr) {
    DropPrefetchLocked(version);
    return Result<std::string>(latest->id);
  }
  return std::nullopt;
}

Result<std::string> UpdateOrchestrator::Enqueue(const std::string& model, const std::string& version, bool recovery,
                                                std::optional<size_t> only, lifecycle::PolicyMode mode,
                                                bool retry_failed) {
  if (core_->versions == nullptr) {
    return FailedPrecondition("controller has no directory (--directory) to resolve versions");
  }
  if (!core_->options.model.empty() && model != core_->options.model) {
    // Its engines stage --model: another model's version would be resolved here and then staged
    // as a version of --model.
    return InvalidArgument("model: this controller updates '" + core_->options.model + "' (--model), not '" + model +
                           "'");
  }
  if (mode != lifecycle::PolicyMode::kStrict) {
    for (const auto& slot : core_->engines) {
      Status ok = slot->handle.adapter->SupportsPolicyMode(mode);
      if (!ok.ok()) return FailedPrecondition("mode: engine " + slot->handle.name + ": " + ok.message());
    }
  }
  if (!recovery && core_->options.runner.prefetch) StageAhead(model, version, only);
  if (!recovery) RC_RETURN_IF_ERROR(CheckNotFailed(model, version, retry_failed));
  auto resolved = core_->versions->Resolve(model, version);
  if (!resolved.ok()) {
    rc::MutexLock lock(core_->mu);
    DropPrefetchLocked(version);
    return resolved.status();
  }
  lifecycle::UpdateTarget target = std::move(resolved).value();
  target.mode = mode;
  rc::MutexLock lock(core_->mu);
  std::set<size_t> already_live;
  if (!recovery) {
    if (auto existing = ExistingOpLocked(model, version, mode, target, &already_live)) return *std::move(existing);
  }
  Op op;
  op.id = "u-" + std::to_string(next_op_);
  op.recovery = recovery;
  op.target = target;
  // The request is synced below, after it is queued: the engine's update starts meanwhile (the
  // stage, which changes nothing served), and its Runner waits for this before anything is
  // paused (UpdateTarget::request_journaled); the id is handed out only once it is durable.
  Pending<bool> journaled;
  op.target.request_journaled = journaled;
  OpRecord rec;
  rec.id = op.id;
  rec.model = model;
  rec.version = version;
  rec.recovery = recovery;
  rec.mode = mode;
  rec.already_live = already_live;
  rec.requested_wall_ms = WallTimeMs();
  rec.only = only;
  Json live = Json::array();
  for (size_t e : already_live) live.push_back(e);
  lifecycle::JournalRecord requested;
  requested.t_ms = SteadyMs();
  requested.event = "update_requested";
  requested.detail = Json{{"id", op.id},
                          {"model", model},
                          {"version", version},
                          {"recovery", recovery},
                          {"mode", lifecycle::PolicyModeName(mode)},
                          {"requested_wall_ms", rec.requested_wall_ms},
                          {"already_live", live},
                          {"only", only ? Json(*only) : Json()}};
  ++next_op_;
  ops_[op.id] = rec;
  for (auto& slot : core_->engines) {
    if ((!only || slot->index == *only) && !already_live.count(slot->index)) slot->queue.push_back(op);
  }
  core_->cv.notify_all();
  lock.unlock();
  // Durable before the id is handed out: GET /v1/updates/<id> must work after a restart. The
  // update journal serializes its own appends; a driver journals nothing of this op before this
  // answers (Drive waits for `journaled`), so update_requested comes first.
  Status j = ops_journal_->Append(requested)
                 .WithContext("update journal " + core_->options.state_dir + "/updates.journal.db");
  journaled.Fulfill(j.ok() ? Result<bool>(true) : Result<bool>(j));
  if (!j.ok()) {
    // Never handed out: forget it. A driver that already started it rejects it before the pause.
    lock.lock();
    ops_.erase(op.id);
    for (auto& slot : core_->engines) {
      std::erase_if(slot->queue, [&](const Op& q) { return q.id == op.id; });
    }
    core_->cv.notify_all();
    return j;
  }
  return op.id;
}

void UpdateOrchestrator::DropPrefetchLocked(const std::string& version) {
  // A stage the driver already issued stays (nothing installs it; the next stage replaces it).
  for (auto& slot : core_->engines) {
    if (slot->prefetch && slot->prefetch->second == version) slot->prefetch.reset();
  }
}

Status UpdateOrchestrator::JournalOpLocked(const std::string& event, Json detail) {
  lifecycle::JournalRecord r;
  r.t_ms = SteadyMs();
  r.event = event;
  r.detail = std::move(detail);
  return ops_journal_->Append(r).WithContext("update journal " + core_->options.state_dir + "/updates.journal.db");
}

Status UpdateOrchestrator::RestoreOps() {
  RC_ASSIGN_OR_RETURN(auto records, ops_journal_->ReadAll());
  rc::MutexLock lock(core_->mu);
  if (records.empty()) {
    // A first record, so that an update journal that existed is never legitimately empty.
    RC_RETURN_IF_ERROR(JournalOpLocked("created", Json::object()));
  }
  int64_t highest = 0;
  for (const auto& r : records) {
    if (r.event == "created") continue;
    const Json& d = r.detail;
    if (r.event == "version_retry") {
      failed_versions_.erase(VersionKey(d.value("model", ""), d.value("version", "")));
      continue;
    }
    const std::string id = d.value("id", "");
    const std::string where =
        "update journal '" + core_->options.state_dir + "/updates.journal.db' record " + std::to_string(r.seq);
    if (id.empty()) return DataLoss(where + ": no update id");
    if (r.event == "update_requested") {
      OpRecord rec;
      rec.id = id;
      rec.model = d.value("model", "");
      rec.version = d.value("version", "");
      rec.recovery = d.value("recovery", false);
      if (d.contains("mode") && d["mode"].is_string()) {
        auto m = lifecycle::PolicyModeFromName(d["mode"].get<std::string>(), "mode");
        if (!m.ok()) return DataLoss(where + ": " + m.status().message());
        rec.mode = *m;
      }
      rec.requested_wall_ms = d.value("requested_wall_ms", int64_t{0});
      for (const auto& e : d.value("already_live", Json::array())) {
        if (e.is_number_unsigned()) rec.already_live.insert(e.get<size_t>());
      }
      if (d.contains("only") && d["only"].is_number_unsigned()) rec.only = d["only"].get<size_t>();
      ops_[id] = rec;
      highest = std::max(highest, OpNumber(id));
      continue;
    }
    auto it = ops_.find(id);
    if (it == ops_.end()) return DataLoss(fmt::format("{}: {} of {}, which was never requested", where, r.event, id));
    const size_t engine = d.value("engine", size_t{0});
    if (r.event == "update_started") {
      it->second.ordinals[engine] = d.value("ordinal", int64_t{0});
    } else if (r.event == "update_not_started") {
      it->second.errors[engine] = d.value("reason", "");
    } else if (r.event == "update_stopped") {
      it->second.stopped = d.value("reason", "");
      if (d.value("version_failed", false)) {
        failed_versions_[VersionKey(it->second.model, it->second.version)] = it->second.stopped;
      }
    }
  }
  // Updates still queued on an engine when the controller stopped never started there.
  for (auto& [id, rec] : ops_) {
    for (const auto& slot : core_->engines) {
      const size_t e = slot->index;
      if (rec.only && e != *rec.only) continue;
      if (!rec.ordinals.count(e) && !rec.errors.count(e) && !rec.already_live.count(e)) {
        rec.errors[e] = "the controller restarted before this update started on this engine";
      }
    }
  }
  next_op_ = highest + 1;
  return OkStatus();
}

Result<std::string> UpdateOrchestrator::RequestUpdate(const std::string& model, const std::string& version,
                                                     std::optional<lifecycle::PolicyMode> mode, bool retry_failed) {
  return Enqueue(model, version, false, std::nullopt, mode.value_or(core_->options.default_mode), retry_failed);
}

Result<std::string> UpdateOrchestrator::RequestRecovery(const std::string& model, const std::string& version) {
  std::string states;
  bool any_tainted = false;
  for (const auto& slot : core_->engines) {
    State st = slot->controller->state();
    any_tainted = any_tainted || st == State::kTainted;
    states += (states.empty() ? "" : ", ") + slot->handle.name + " is " + std::string(lifecycle::StateName(st));
  }
  if (!any_tainted) return FailedPrecondition("recover: no engine is TAINTED (" + states + "): nothing to recover");
  return Enqueue(model, version, true);
}

Json UpdateOrchestrator::OpJson(const OpRecord& rec) const {
  Json engines = Json::array();
  bool all_done = true;
  std::string overall = "committed";
  for (const auto& slot : core_->engines) {
    if (rec.only && slot->index != *rec.only) continue;
    Json e{{"engine", slot->handle.name}, {"index", slot->index}};
    auto err = rec.errors.find(slot->index);
    auto ord = rec.ordinals.find(slot->index);
    if (rec.already_live.count(slot->index)) {
      e["outcome"] = "already_live";
      e["reason"] = "the engine was READY on " + rec.version + " when the update was requested";
    } else if (err != rec.errors.end()) {
      e["outcome"] = "not_started";
      e["reason"] = err->second;
      overall = "partial";
    } else if (ord == rec.ordinals.end()) {
      e["outcome"] = "queued";
      all_done = false;
    } else {
      auto u = slot->controller->Update(ord->second);
      if (!u) {
        e["outcome"] = "unknown";
      } else {
        Json uj = lifecycle::ToJson(*u);
        e["ordinal"] = u->ordinal;
        e["phase"] = u->phase;
        e["outcome"] = uj["outcome"];
        e["reason"] = u->reason;
        e["phases_ms"] = uj["phases_ms"];
        e["evidence"] = u->evidence;
        if (u->outcome == UpdateOutcome::kInProgress) all_done = false;
        if (u->outcome != UpdateOutcome::kCommitted && overall == "committed") {
          overall = std::string(lifecycle::UpdateOutcomeName(u->outcome));
        }
      }
    }
    engines.push_back(e);
  }
  return Json{{"id", rec.id},
              {"model", rec.model},
              {"version", rec.version},
              {"recovery", rec.recovery},
              {"mode", lifecycle::PolicyModeName(rec.mode)},
              {"stopped", rec.stopped.empty() ? Json() : Json(rec.stopped)},
              {"done", all_done},
              {"outcome", all_done ? overall : "in_progress"},
              {"requested_wall_ms", rec.requested_wall_ms},
              {"engines", engines}};
}

Result<Json> UpdateOrchestrator::UpdateStatus(const std::string& id) const {
  rc::MutexLock lock(core_->mu);
  auto it = ops_.find(id);
  if (it == ops_.end()) return NotFound("no update '" + id + "'");
  return OpJson(it->second);
}

Result<Json> UpdateOrchestrator::WaitForUpdate(const std::string& id, int64_t timeout_ms) const {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  rc::MutexLock lock(core_->mu);
  while (true) {
    auto it = ops_.find(id);
    if (it == ops_.end()) return NotFound("no update '" + id + "'");
    Json j = OpJson(it->second);
    const auto now = std::chrono::steady_clock::now();
    if (j["done"].get<bool>()) {
      // Done, and (within the deadline) past the post-operation identity check that lets the
      // engines admit again, so a caller's next rollout is not refused as "finishing an operation".
      bool settling = false;
      for (const auto& slot : core_->engines) settling = settling || slot->settling.load();
      if (!settling || now >= deadline) return j;
    } else if (now >= deadline) {
      return DeadlineExceeded("update " + id + " still in progress");
    }
    // The driver notifies cv_ (under mu_) when an operation ends and when it settled, so a waiter
    // learns of the commit at once (issue 15); the bounded wait is only a safety net.
    core_->cv.wait_for(lock, std::min<std::chrono::steady_clock::duration>(deadline - now, std::chrono::milliseconds(2)));
  }
}

}  // namespace rc::controller
