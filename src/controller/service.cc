#include "rolloutcore/controller/service.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "rolloutcore/base/clock.h"
#include "rolloutcore/base/log.h"
#include "rolloutcore/base/metrics_writer.h"
#include "rolloutcore/base/mutex.h"

namespace rc::controller {

using lifecycle::State;
using lifecycle::UpdateOutcome;

namespace {

int64_t SteadyMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string Join(const std::vector<std::string>& parts) {
  std::string out;
  for (const auto& p : parts) out += (out.empty() ? "" : "; ") + p;
  return out;
}

// How often an engine whose identity is not verified yet (unreachable at a restart) is retried.
constexpr int64_t kUnverifiedRetryMs = 200;

std::vector<int64_t> IntArray(const Json& j) {
  std::vector<int64_t> out;
  if (j.is_array()) {
    for (const auto& x : j) {
      if (x.is_number_integer()) out.push_back(x.get<int64_t>());
    }
  }
  return out;
}

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

std::string StateMarkerPath(const std::string& state_dir) { return state_dir + "/rolloutcore-state.json"; }

Result<int64_t> ReadStateMarker(const std::string& state_dir) {
  const std::string path = StateMarkerPath(state_dir);
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return int64_t{-1};
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) return DataLoss("state dir marker " + path + " cannot be read");
  auto j = ParseJson(text.str(), "state dir marker " + path);
  if (!j.ok()) return DataLoss(j.status().message());
  if (!j->is_object() || !(*j).contains("engines") || !(*j)["engines"].is_number_unsigned()) {
    return DataLoss("state dir marker " + path + ": no engines count");
  }
  return (*j)["engines"].get<int64_t>();
}

Status WriteStateMarker(const std::string& state_dir, int64_t engines) {
  const std::string path = StateMarkerPath(state_dir);
  const std::string tmp = path + ".tmp";
  const std::string body =
      Json{{"format", 1}, {"engines", engines}, {"written_wall_ms", WallTimeMs()},
           {"note", "written by the rolloutcore controller after its first start over this dir; while it exists, "
                    "a missing, empty or damaged journal or trajectory store stops the controller from starting"}}
          .dump(2) +
      "\n";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return Unavailable("cannot write state dir marker " + tmp + ": " + std::strerror(errno));
  bool ok = ::write(fd, body.data(), body.size()) == static_cast<ssize_t>(body.size()) && ::fsync(fd) == 0;
  ::close(fd);
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    return Unavailable("cannot write state dir marker " + path + ": " + std::strerror(errno));
  }
  int dfd = ::open(state_dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dfd >= 0) {
    (void)::fsync(dfd);
    ::close(dfd);
  }
  return OkStatus();
}

Status ValidateRolloutId(const std::string& id, const std::string& field) {
  if (id.empty() || id.size() > 128) {
    return InvalidArgument(field + ": must be 1..128 characters, got " + std::to_string(id.size()) +
                           " (allowed: " + kRolloutIdPattern + ")");
  }
  for (size_t i = 0; i < id.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(id[i]);
    const bool ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
                    c == '_' || c == '-';
    if (!ok) {
      char what[32];
      if (c >= 0x20 && c < 0x7f) {
        std::snprintf(what, sizeof what, "'%c'", c);
      } else {
        std::snprintf(what, sizeof what, "byte 0x%02x", c);
      }
      return InvalidArgument(field + ": character " + std::to_string(i) + " (" + what + ") is not allowed (allowed: " +
                             kRolloutIdPattern + ")");
    }
  }
  if (id.find("..") != std::string::npos || id == ".") {
    return InvalidArgument(field + ": '" + id + "' contains '..' or is '.' (allowed: " + kRolloutIdPattern + ")");
  }
  return OkStatus();
}

Result<std::unique_ptr<ControllerService>> ControllerService::Create(std::vector<EngineHandle> engines,
                                                                     VersionSource* versions, const ServiceOptions& options) {
  if (engines.empty()) return InvalidArgument("controller: at least one engine is needed");
  if (options.state_dir.empty()) return InvalidArgument("controller: --state-dir is required");
  if (options.max_updating < 1) return InvalidArgument("controller: --max-updating must be at least 1");
  std::error_code ec;
  std::filesystem::create_directories(options.state_dir, ec);
  if (ec) return Unavailable("cannot create state dir '" + options.state_dir + "': " + ec.message());

  std::unique_ptr<ControllerService> s(new ControllerService());
  s->versions_ = versions;
  s->options_ = options;
  // A state dir that was started before holds a marker; from then on a missing, empty or
  // damaged store is an error naming the file, never a silent fresh start.
  RC_ASSIGN_OR_RETURN(int64_t marked_engines, ReadStateMarker(options.state_dir));
  const bool initialized = marked_engines >= 0;
  const std::string how = initialized ? " (state dir initialized before: " + StateMarkerPath(options.state_dir) +
                                            "; restore the file or start with an empty --state-dir)"
                                      : "";
  auto opened = TrajectoryStore::Open(options.state_dir + "/trajectories.db", initialized);
  if (!opened.ok()) return opened.status().WithContext("controller: refusing to start" + how);
  s->trajectories_ = std::move(opened).value();
  auto ops = lifecycle::SqliteJournal::Open(options.state_dir + "/updates.journal.db", initialized);
  if (!ops.ok()) return ops.status().WithContext("controller: refusing to start" + how);
  s->ops_journal_ = std::move(ops).value();
  for (size_t i = 0; i < engines.size(); ++i) {
    auto slot = std::make_unique<EngineSlot>();
    slot->index = i;
    slot->handle = std::move(engines[i]);
    const bool must_exist = static_cast<int64_t>(i) < marked_engines;
    Status st = s->InitEngine(slot.get(), must_exist);
    if (!st.ok()) {
      st = st.WithContext("engine " + std::to_string(i) + " (" + slot->handle.name + ")");
      return must_exist ? st.WithContext("controller: refusing to start" + how) : st;
    }
    s->engines_.push_back(std::move(slot));
  }
  RC_RETURN_IF_ERROR(s->RestoreOps());
  if (marked_engines < static_cast<int64_t>(s->engines_.size())) {
    RC_RETURN_IF_ERROR(WriteStateMarker(options.state_dir, static_cast<int64_t>(s->engines_.size())));
  }
  for (auto& slot : s->engines_) {
    EngineSlot* raw = slot.get();
    slot->driver = std::thread([svc = s.get(), raw] { svc->Drive(raw); });
  }
  if (options.auto_update) {
    if (options.model.empty()) return InvalidArgument("controller: --auto-update needs --model");
    if (versions == nullptr) return InvalidArgument("controller: --auto-update needs a directory");
    s->follower_ = std::thread([svc = s.get()] { svc->FollowDirectory(); });
  }
  return s;
}

ControllerService::~ControllerService() {
  stop_ = true;
  cv_.notify_all();
  for (auto& slot : engines_) {
    if (slot->driver.joinable()) slot->driver.join();
  }
  if (follower_.joinable()) follower_.join();
}

Status ControllerService::InitEngine(EngineSlot* slot, bool must_exist) {
  auto path = options_.state_dir + "/engine-" + std::to_string(slot->index) + ".journal.db";
  RC_ASSIGN_OR_RETURN(auto journal, lifecycle::SqliteJournal::Open(path, must_exist));
  slot->journal = std::move(journal);
  lifecycle::RestoreSummary summary;
  RC_ASSIGN_OR_RETURN(slot->controller,
                      lifecycle::Controller::Open(SystemClock::Default(), slot->journal.get(), &summary));
  slot->runner = std::make_unique<lifecycle::Runner>(slot->controller.get(), slot->handle.adapter.get(),
                                                     SystemClock::Default(), options_.runner);
  if (slot->controller->state() == State::kUninitialized) {
    // A fresh journal: the engine serves whatever it loaded; record that as generation 0.
    RC_ASSIGN_OR_RETURN(auto desc, slot->handle.adapter->Describe());
    RC_ASSIGN_OR_RETURN(auto label, AwaitPending(slot->handle.adapter->ReadLabel(), 10000, "reading the label"));
    lifecycle::WeightIdentity identity;
    if (desc.offers_content_digest) {
      RC_ASSIGN_OR_RETURN(auto digest,
                          AwaitPending(slot->handle.adapter->ReadContentDigest(), 60000, "reading the digest"));
      identity.content_digest = digest.content_digest;
    }
    identity.checkpoint = "initial";
    RC_RETURN_IF_ERROR(slot->controller->Initialize({label.label, 0}, identity));
  } else {
    RC_LOG_WARN("engine {}: restored from {} in {} (was {} at the crash; {} rollouts recorded interrupted)",
                slot->handle.name, path, lifecycle::StateName(summary.state_now),
                lifecycle::StateName(summary.state_at_crash), summary.interrupted.size());
    if (summary.state_now == State::kReady && summary.engine_may_be_paused) {
      slot->runner->ResumeBestEffort("controller restarted while the engine may have been paused");
    }
  }
  // Nothing is admitted before the engine was checked against what the journal claims (label and
  // content digest); an engine unreachable now stays unverified (no admissions) and is retried.
  VerifyIdentity(slot, /*after_op=*/false, /*claim=*/true);
  return OkStatus();
}

// ---- Engine identity --------------------------------------------------------------------------

bool ControllerService::IdentityVerified(const EngineSlot* slot) const {
  rc::MutexLock lock(slot->id_mu);
  return slot->id.verified;
}

void ControllerService::VerifyIdentity(EngineSlot* slot, bool after_op, bool claim) {
  if (slot->controller->state() != State::kReady) {
    // TAINTED admits nothing (a recovery re-verifies); other states belong to an operation.
    if (after_op) {
      slot->after_op_pending = false;
      slot->settling = false;  // not READY: the state itself admits nothing
    }
    return;
  }
  lifecycle::EngineAdapter* adapter = slot->handle.adapter.get();
  const int64_t timeout = std::max<int64_t>(options_.runner.deadlines.poll_ms, 1);
  auto fail = [&](const Status& st) {
    RC_LOG_WARN("engine {}: identity probe failed: {}", slot->handle.name, st.ToString());
    rc::MutexLock lock(slot->id_mu);
    slot->id.last_error = st.ToString();
  };
  lifecycle::IdentityEvidence e;
  auto probe = AwaitPending(adapter->ProbeIdentity(), timeout, "identity probe of " + slot->handle.name);
  if (probe.ok()) {
    e = *probe;
  } else if (probe.status().code() == StatusCode::kUnimplemented) {
    // The engine cannot report boot id or install generation: its label is what can be checked.
    auto label = AwaitPending(adapter->ReadLabel(), timeout, "reading the label of " + slot->handle.name);
    if (!label.ok()) return fail(label.status());
    e.label = label->label;
  } else {
    return fail(probe.status());
  }
  const lifecycle::WeightVersion committed = slot->controller->version();
  const lifecycle::WeightIdentity committed_id = slot->controller->identity();
  if (claim && e.content_digest.empty() && !committed_id.content_digest.empty()) {
    // A (re)started controller proves the digest too, computing it when none is cached.
    auto desc = adapter->Describe();
    if (!desc.ok()) return fail(desc.status());
    if (desc->offers_content_digest) {
      auto d = AwaitPending(adapter->ReadContentDigest(), std::max<int64_t>(options_.runner.deadlines.validate_ms, 1),
                            "reading the content digest of " + slot->handle.name);
      if (!d.ok()) return fail(d.status());
      e.content_digest = d->content_digest;
    }
  }
  std::vector<std::string> why;
  if (e.label != committed.label) {
    why.push_back("the engine reports label '" + e.label + "', the committed version is '" + committed.label + "'");
  }
  if (!e.content_digest.empty() && !committed_id.content_digest.empty() &&
      e.content_digest != committed_id.content_digest) {
    why.push_back("live content digest " + e.content_digest + " != committed digest " + committed_id.content_digest);
  }
  {
    rc::MutexLock lock(slot->id_mu);
    VerifiedIdentity& v = slot->id;
    const bool committed_op = after_op && committed.generation > slot->generation_before_op;
    const bool committed_recovery = committed_op && slot->running_recovery;
    const bool restarted = v.verified && !v.boot_id.empty() && e.boot_id != v.boot_id;
    if (restarted && !committed_recovery) {
      why.push_back("the engine restarted (boot id " + v.boot_id + " -> " + (e.boot_id.empty() ? "none" : e.boot_id) +
                    "): what this controller installed and verified is gone");
    }
    if (!restarted && v.verified && v.install_generation >= 0 && e.install_generation != v.install_generation &&
        !committed_op && (v.generation_settled || after_op)) {
      why.push_back("the engine's install generation moved " + std::to_string(v.install_generation) + " -> " +
                    std::to_string(e.install_generation) + " with no update by this controller: weights were "
                    "installed behind its back");
    }
    if (!v.suspect.empty() && !committed_op) why.push_back(v.suspect);
    v.suspect.clear();
    ++v.checks;
    v.checked_wall_ms = WallTimeMs();
    v.last_error.clear();
    if (why.empty()) {
      v.verified = true;
      v.boot_id = e.boot_id;
      v.install_generation = e.install_generation;
      v.generation_settled = true;
    } else {
      ++v.mismatches;
    }
  }
  if (after_op) slot->after_op_pending = false;
  if (why.empty()) {
    if (after_op) slot->settling = false;
    return;
  }
  std::string reason = claim ? "controller start: the journal claims label '" + committed.label + "' (digest " +
                                   (committed_id.content_digest.empty() ? "unknown" : committed_id.content_digest) +
                                   ") but " + Join(why)
                             : "identity check: " + Join(why);
  TaintForIdentity(slot, reason);
  if (after_op) slot->settling = false;
}

void ControllerService::TaintForIdentity(EngineSlot* slot, const std::string& reason) {
  RC_LOG_ERROR("engine {}: {}", slot->handle.name, reason);
  Status s = slot->controller->Taint(reason);
  if (!s.ok()) {
    // Not READY (an update runs, or already TAINTED): the check after the operation decides.
    rc::MutexLock lock(slot->id_mu);
    if (slot->id.suspect.empty()) slot->id.suspect = reason;
    return;
  }
  if (!options_.auto_recover) return;
  if (versions_ == nullptr || options_.model.empty()) {
    RC_LOG_WARN("engine {}: --auto-recover needs --directory and --model; the engine stays TAINTED", slot->handle.name);
    return;
  }
  const std::string label = slot->controller->version().label;
  auto id = Enqueue(options_.model, label, /*recovery=*/true, slot->index);
  if (!id.ok()) {
    RC_LOG_WARN("engine {}: auto-recovery to {}: {}", slot->handle.name, label, id.status().ToString());
  } else {
    RC_LOG_WARN("engine {}: auto-recovery {} to {} queued", slot->handle.name, *id, label);
  }
}

std::string ControllerService::CompletionMismatch(EngineSlot* slot, const lifecycle::RolloutBinding& binding,
                                                  const Json& resp) const {
  VerifiedIdentity v;
  {
    rc::MutexLock lock(slot->id_mu);
    v = slot->id;
  }
  const bool compare_generation = v.verified && v.generation_settled && v.install_generation >= 0;
  const std::string& bound = binding.version.label;
  std::vector<std::string> why;
  if (resp.contains("choices") && resp["choices"].is_array()) {
    for (size_t i = 0; i < resp["choices"].size(); ++i) {
      const Json& c = resp["choices"][i];
      if (!c.is_object()) continue;
      const std::string at = "choice " + std::to_string(i);
      if (c.contains("weight_version") && c["weight_version"].is_string() && c["weight_version"] != bound) {
        why.push_back(fmt::format("{} was generated under label '{}', the binding is '{}'", at,
                                  c["weight_version"].get<std::string>(), bound));
      }
      if (compare_generation && c.contains("install_generation") && c["install_generation"].is_number_integer() &&
          c["install_generation"].get<int64_t>() != v.install_generation) {
        why.push_back(at + " was admitted at install generation " +
                      std::to_string(c["install_generation"].get<int64_t>()) + ", the verified one is " +
                      std::to_string(v.install_generation));
      }
    }
  }
  if (resp.contains("rolloutcore") && resp["rolloutcore"].is_object()) {
    const Json& r = resp["rolloutcore"];
    if (v.verified && !v.boot_id.empty() && r.contains("boot_id") && r["boot_id"].is_string() &&
        r["boot_id"] != v.boot_id) {
      why.push_back("the engine's boot id is " + r["boot_id"].get<std::string>() + ", the verified one is " +
                    v.boot_id + " (it restarted)");
    }
    if (r.contains("label") && r["label"].is_string() && r["label"] != bound) {
      why.push_back("the engine reported label '" + r["label"].get<std::string>() + "' when it answered, the binding is '" +
                    bound + "'");
    }
    if (compare_generation && r.contains("install_generation") && r["install_generation"].is_number_integer() &&
        r["install_generation"].get<int64_t>() != v.install_generation) {
      why.push_back("the engine was at install generation " + std::to_string(r["install_generation"].get<int64_t>()) +
                    " when it answered, the verified one is " + std::to_string(v.install_generation));
    }
  }
  return Join(why);
}

// ---- Driver ---------------------------------------------------------------------------------

namespace {
// How long a driver waits for an op's update_requested to be synced before journaling its start
// (the sync normally takes well under a millisecond; a journal that hangs longer fails the op).
constexpr int64_t kRequestJournalWaitMs = 60'000;
}  // namespace

void ControllerService::Drive(EngineSlot* slot) {
  int64_t next_expiry_check = 0;
  // While an operation runs the driver blocks on the call in flight (Runner::WaitForProgress) and
  // polls the Runner the moment it answers: no fixed poll interval between a call's answer and the
  // next transition (issue 15, controller overhead). When no call is in flight unanswered (the
  // drain waits for rollouts, a refused reset waits for its retry slot) it sleeps 1 ms, or 100 us
  // for 20 ms after each state change.
  State last_state = slot->controller->state();
  State last_sweep_state = State::kUninitialized;  // sweep once at start (a restart's leases)
  int64_t hot_until_ms = 0;
  while (!stop_) {
    if (open_leases_.load() > 0) {
      // Leases an update ended are closed at once, so the next drain never waits for them. Only
      // an operation (quiesce, drain abort, taint) ends one: sweep while the engine is not READY,
      // once more when it is back, and while a closed lease's record is still to be written
      // (heartbeat and finish check for themselves). Nothing is scanned per pass while serving.
      const State now_state = slot->controller->state();
      if (now_state != State::kReady || last_sweep_state != State::kReady || closing_leases_pending_.load() > 0) {
        EndLeasesOfUpdates(slot->index);
        last_sweep_state = now_state;
      }
      if (SteadyMs() >= next_expiry_check) {
        ExpireLeases(slot->index);
        next_expiry_check =
            SteadyMs() + (options_.lease_timeout_ms > 0 ? std::min<int64_t>(50, options_.lease_timeout_ms) : 50);
      }
    }
    bool busy = slot->runner->Poll();
    if (!busy) {
      bool just_ended = false;
      {
        rc::MutexLock lock(mu_);
        if (!slot->running_op.empty()) {
          const std::string ended_op = slot->running_op;
          slot->running_op.clear();
          StopOpIfTaintedLocked(slot, ended_op);
          cv_.notify_all();
          slot->after_op_pending = just_ended = true;
        }
      }
      // The identity check right after every operation (the install generation may have moved),
      // periodically while READY, and until a (re)started controller verified the engine.
      const int64_t now = SteadyMs();
      const bool verified = IdentityVerified(slot);
      const bool due = now >= slot->next_verify_ms;
      if ((slot->after_op_pending && (just_ended || due)) || (!verified && due) ||
          (options_.verify_interval_ms > 0 && due)) {
        // A failed probe leaves after_op_pending set: the next check is still the post-op one.
        VerifyIdentity(slot, slot->after_op_pending, /*claim=*/!verified);
        const bool ok = IdentityVerified(slot);
        slot->next_verify_ms =
            SteadyMs() + (ok ? (options_.verify_interval_ms > 0 ? options_.verify_interval_ms : kUnverifiedRetryMs)
                             : kUnverifiedRetryMs);
      }
      rc::MutexLock lock(mu_);
      if (slot->holds_update_place && !slot->settling.load()) {
        // Settled (its identity re-checked): only now may another engine leave service.
        slot->holds_update_place = false;
        --updating_;
        cv_.notify_all();
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
        continue;
      }
      if (!slot->queue.empty() && updating_ < options_.max_updating) {
        slot->prefetch.reset();  // the op itself is here: its StartUpdate stages (or adopts)
        Op op = slot->queue.front();
        State st = slot->controller->state();
        bool can = op.recovery ? st == State::kTainted : st == State::kReady;
        if (!can) {
          std::string why;
          if (op.recovery && st == State::kReady) why = "engine is READY: nothing to recover";
          if (!op.recovery && st == State::kTainted) why = "engine is TAINTED: recover it first";
          if (!why.empty()) {
            slot->queue.pop_front();
            // After its update_requested (Enqueue syncs it without holding mu_, so this wait is short).
            const bool op_journaled =
                !op.target.request_journaled ||
                (op.target.request_journaled->WaitFor(std::chrono::milliseconds(kRequestJournalWaitMs)) &&
                 op.target.request_journaled->Get().ok());
            if (op_journaled && ops_.count(op.id)) {
              ops_[op.id].errors[slot->index] = why;
              Status j =
                  JournalOpLocked("update_not_started", Json{{"id", op.id}, {"engine", slot->index}, {"reason", why}});
              if (!j.ok()) RC_LOG_ERROR("update {}: {}", op.id, j.ToString());
            }
          }
          // Otherwise wait (e.g. UNINITIALIZED, or a restore in progress).
        } else {
          slot->queue.pop_front();
          ++updating_;
          slot->holds_update_place = true;
          slot->running_op = op.id;
          slot->settling = true;
          lock.unlock();
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
          lock.lock();
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
            j = JournalOpLocked("update_started",
                                Json{{"id", op.id}, {"engine", slot->index}, {"ordinal", started->ordinal}});
          } else {
            ops_[op.id].errors[slot->index] = started.status().ToString();
            slot->running_op.clear();
            slot->holds_update_place = false;
            --updating_;
            slot->settling = false;  // nothing started: the engine is as it was
            j = JournalOpLocked("update_not_started",
                                Json{{"id", op.id}, {"engine", slot->index}, {"reason", started.status().ToString()}});
          }
          if (!j.ok()) RC_LOG_ERROR("update {}: {}", op.id, j.ToString());
          cv_.notify_all();
          continue;
        }
      }
      cv_.wait_for(lock, std::chrono::milliseconds(busy ? 1 : 5));
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

void ControllerService::FollowDirectory() {
  uint64_t seq = 0;
  // Start from the newest commit so a restart does not replay history.
  while (!stop_) {
    auto commits = versions_->WaitForCommits(options_.model, seq, 1000);
    if (!commits.ok()) {
      RC_LOG_WARN("auto-update: {}", commits.status().ToString());
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      continue;
    }
    if (commits->empty()) continue;
    const auto& latest = commits->back();
    seq = latest.seq;
    auto id = Enqueue(options_.model, latest.version, false, std::nullopt, options_.default_mode);
    if (!id.ok()) RC_LOG_WARN("auto-update to {}: {}", latest.version, id.status().ToString());
  }
}

// ---- Updates ----------------------------------------------------------------------------------

Result<std::string> ControllerService::Enqueue(const std::string& model, const std::string& version, bool recovery,
                                               std::optional<size_t> only, lifecycle::PolicyMode mode,
                                               bool retry_failed) {
  if (versions_ == nullptr) return FailedPrecondition("controller has no directory (--directory) to resolve versions");
  if (mode != lifecycle::PolicyMode::kStrict) {
    for (const auto& slot : engines_) {
      Status ok = slot->handle.adapter->SupportsPolicyMode(mode);
      if (!ok.ok()) return FailedPrecondition("mode: engine " + slot->handle.name + ": " + ok.message());
    }
  }
  if (!recovery && options_.runner.prefetch) {
    // Idle engines that do not serve this version start staging it now, while the directory
    // resolves it: their update adopts the stage (Runner::Prefetch). A request the directory
    // refuses leaves a staged image nothing installs (the next stage replaces it).
    // At most as many as may update now (--max-updating): a stage can hold an engine's serving
    // briefly (vLLM stages between scheduler steps), so a rolling update keeps the rest serving.
    rc::MutexLock lock(mu_);
    bool any = false;
    // (Counted by the operations running, not by updating_: an engine whose update ended holds its
    // place until its identity check settled, but stages nothing.)
    int64_t places = options_.max_updating;
    for (const auto& slot : engines_) places -= slot->running_op.empty() ? 0 : 1;
    for (auto& slot : engines_) {
      if (places <= 0) break;
      if (only && slot->index != *only) continue;
      if (!slot->queue.empty() || !slot->running_op.empty()) continue;
      if (slot->controller->state() != State::kReady || slot->controller->version().label == version) continue;
      slot->prefetch = std::make_pair(model, version);
      any = true;
      --places;
    }
    if (any) cv_.notify_all();
  }
  if (!recovery) {
    rc::MutexLock lock(mu_);
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
  }
  auto resolved = versions_->Resolve(model, version);
  if (!resolved.ok()) {
    rc::MutexLock lock(mu_);
    DropPrefetchLocked(version);
    return resolved.status();
  }
  lifecycle::UpdateTarget target = std::move(resolved).value();
  target.mode = mode;
  rc::MutexLock lock(mu_);
  std::set<size_t> already_live;
  if (!recovery) {
    // The same version requested again while an update to it is still running (or queued):
    // one cycle, one id.
    const OpRecord* latest = nullptr;
    for (const auto& [id, rec] : ops_) {
      if (rec.recovery || rec.model != model || rec.version != version) continue;
      if (!OpJson(rec)["done"].get<bool>()) {
        DropPrefetchLocked(version);
        if (rec.mode != mode) {
          // The caller asked for a mode that would not run: say so rather than hand out an id
          // whose update runs another (issue 36 #5).
          return FailedPrecondition(fmt::format(
              "update {} of {} {} is already in progress in mode {}; this request asks for mode {}: wait for {} to "
              "end, or request mode {}",
              id, model, version, lifecycle::PolicyModeName(rec.mode), lifecycle::PolicyModeName(mode), id,
              lifecycle::PolicyModeName(rec.mode)));
        }
        return id;
      }
      if (latest == nullptr || OpNumber(id) > OpNumber(latest->id)) latest = &rec;
    }
    for (const auto& slot : engines_) {
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
      if (live) already_live.insert(slot->index);
    }
    // Live everywhere already: the update that installed it, if this controller ran one.
    if (already_live.size() == engines_.size() && latest != nullptr) {
      DropPrefetchLocked(version);
      return latest->id;
    }
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
  for (auto& slot : engines_) {
    if ((!only || slot->index == *only) && !already_live.count(slot->index)) slot->queue.push_back(op);
  }
  cv_.notify_all();
  lock.unlock();
  // Durable before the id is handed out: GET /v1/updates/<id> must work after a restart. The
  // update journal serializes its own appends; a driver journals nothing of this op before this
  // answers (Drive waits for `journaled`), so update_requested comes first.
  Status j = ops_journal_->Append(requested)
                 .WithContext("update journal " + options_.state_dir + "/updates.journal.db");
  journaled.Fulfill(j.ok() ? Result<bool>(true) : Result<bool>(j));
  if (!j.ok()) {
    // Never handed out: forget it. A driver that already started it rejects it before the pause.
    lock.lock();
    ops_.erase(op.id);
    for (auto& slot : engines_) {
      std::erase_if(slot->queue, [&](const Op& q) { return q.id == op.id; });
    }
    cv_.notify_all();
    return j;
  }
  return op.id;
}

void ControllerService::DropPrefetchLocked(const std::string& version) {
  // A stage the driver already issued stays (nothing installs it; the next stage replaces it).
  for (auto& slot : engines_) {
    if (slot->prefetch && slot->prefetch->second == version) slot->prefetch.reset();
  }
}

void ControllerService::StopOpIfTaintedLocked(EngineSlot* slot, const std::string& op_id) {
  auto it = ops_.find(op_id);
  if (it == ops_.end() || it->second.recovery) return;
  OpRecord& rec = it->second;
  auto ord = rec.ordinals.find(slot->index);
  if (ord == rec.ordinals.end()) return;
  auto u = slot->controller->Update(ord->second);
  if (!u || u->outcome != UpdateOutcome::kTainted) return;
  // The new version's own evidence failed (label, digest or replay read while paused): the
  // version is what is wrong, not this engine's call, so no engine gets it (issue 36 #4). Any
  // other taint stops this update too (a canary that failed), without marking the version.
  const bool validation = u->tainted_from == lifecycle::StateName(State::kValidating);
  const std::string why = fmt::format("update {} stopped: engine {} was tainted {}: {}", op_id, slot->handle.name,
                                      validation ? "in validation" : "from " + u->tainted_from, u->reason);
  rec.stopped = why;
  for (auto& other : engines_) {
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

Status ControllerService::JournalOpLocked(const std::string& event, Json detail) {
  lifecycle::JournalRecord r;
  r.t_ms = SteadyMs();
  r.event = event;
  r.detail = std::move(detail);
  return ops_journal_->Append(r).WithContext("update journal " + options_.state_dir + "/updates.journal.db");
}

Status ControllerService::RestoreOps() {
  RC_ASSIGN_OR_RETURN(auto records, ops_journal_->ReadAll());
  rc::MutexLock lock(mu_);
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
        "update journal '" + options_.state_dir + "/updates.journal.db' record " + std::to_string(r.seq);
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
    for (const auto& slot : engines_) {
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

Result<std::string> ControllerService::RequestUpdate(const std::string& model, const std::string& version,
                                                     std::optional<lifecycle::PolicyMode> mode, bool retry_failed) {
  return Enqueue(model, version, false, std::nullopt, mode.value_or(options_.default_mode), retry_failed);
}

Result<std::string> ControllerService::RequestRecovery(const std::string& model, const std::string& version) {
  std::string states;
  bool any_tainted = false;
  for (const auto& slot : engines_) {
    State st = slot->controller->state();
    any_tainted = any_tainted || st == State::kTainted;
    states += (states.empty() ? "" : ", ") + slot->handle.name + " is " + std::string(lifecycle::StateName(st));
  }
  if (!any_tainted) return FailedPrecondition("recover: no engine is TAINTED (" + states + "): nothing to recover");
  return Enqueue(model, version, true);
}

Json ControllerService::OpJson(const OpRecord& rec) const {
  Json engines = Json::array();
  bool all_done = true;
  std::string overall = "committed";
  for (const auto& slot : engines_) {
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

Result<Json> ControllerService::UpdateStatus(const std::string& id) const {
  rc::MutexLock lock(mu_);
  auto it = ops_.find(id);
  if (it == ops_.end()) return NotFound("no update '" + id + "'");
  return OpJson(it->second);
}

Result<Json> ControllerService::WaitForUpdate(const std::string& id, int64_t timeout_ms) const {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  rc::MutexLock lock(mu_);
  while (true) {
    auto it = ops_.find(id);
    if (it == ops_.end()) return NotFound("no update '" + id + "'");
    Json j = OpJson(it->second);
    const auto now = std::chrono::steady_clock::now();
    if (j["done"].get<bool>()) {
      // Done, and (within the deadline) past the post-operation identity check that lets the
      // engines admit again, so a caller's next rollout is not refused as "finishing an operation".
      bool settling = false;
      for (const auto& slot : engines_) settling = settling || slot->settling.load();
      if (!settling || now >= deadline) return j;
    } else if (now >= deadline) {
      return DeadlineExceeded("update " + id + " still in progress");
    }
    // The driver notifies cv_ (under mu_) when an operation ends and when it settled, so a waiter
    // learns of the commit at once (issue 15); the bounded wait is only a safety net.
    cv_.wait_for(lock, std::min<std::chrono::steady_clock::duration>(deadline - now, std::chrono::milliseconds(2)));
  }
}

// ---- Rollouts ---------------------------------------------------------------------------------

Result<std::pair<size_t, lifecycle::RolloutBinding>> ControllerService::AdmitSomewhere(const std::string& rollout_id,
                                                                                       bool lease) {
  RC_RETURN_IF_ERROR(ValidateRolloutId(rollout_id));
  size_t n = engines_.size();
  size_t start = round_robin_.fetch_add(1) % n;
  std::string reasons;
  for (size_t k = 0; k < n; ++k) {
    auto& slot = engines_[(start + k) % n];
    if (slot->controller->state() != State::kReady) {
      reasons += (reasons.empty() ? "" : "; ") + slot->handle.name + " is " +
                 std::string(lifecycle::StateName(slot->controller->state()));
      continue;
    }
    if (!IdentityVerified(slot.get())) {
      reasons += (reasons.empty() ? "" : "; ") + slot->handle.name + " is READY but its identity is not verified yet";
      continue;
    }
    if (slot->settling.load()) {
      reasons += (reasons.empty() ? "" : "; ") + slot->handle.name + " is finishing an operation (identity re-check)";
      continue;
    }
    auto b = slot->controller->Admit(rollout_id, lease);
    if (b.ok()) return std::make_pair(slot->index, *b);
    if (b.status().code() == StatusCode::kAlreadyExists) return b.status();
    reasons += (reasons.empty() ? "" : "; ") + slot->handle.name + ": " + b.status().message();
  }
  rollouts_refused_.fetch_add(1);
  return Unavailable("no engine is READY (" + reasons + "); retry");
}

Result<Json> ControllerService::Rollout(const Json& request) {
  if (!request.is_object()) return InvalidArgument("body: expected a JSON object");
  RC_ASSIGN_OR_RETURN(std::string rollout_id, GetString(request, "rollout_id", "", std::string()));
  if (rollout_id.empty()) rollout_id = "ro-" + std::to_string(WallTimeMs()) + "-" + std::to_string(next_rollout_++);
  Json body = request;
  body.erase("rollout_id");
  // One rollout is one prompt: a string, or a non-empty list of token ids. Anything else would be
  // passed on and read differently by the engine (a string prompt_token_ids is text to it; a list
  // of prompts gives several choices of which one would be recorded).
  auto token_list = [](const Json& v, const char* field) -> Status {
    if (!v.is_array() || v.empty()) {
      return InvalidArgument(std::string(field) + ": expected a non-empty list of token ids, got " +
                             (v.is_array() ? std::string("an empty list") : JsonTypeName(v)));
    }
    for (size_t i = 0; i < v.size(); ++i) {
      if (!v[i].is_number_integer()) {
        return InvalidArgument(std::string(field) + "[" + std::to_string(i) + "]: expected a token id (integer), got " +
                               JsonTypeName(v[i]));
      }
    }
    return OkStatus();
  };
  if (body.contains("prompt_token_ids")) {
    if (body.contains("prompt")) return InvalidArgument("give either prompt or prompt_token_ids, not both");
    RC_RETURN_IF_ERROR(token_list(body["prompt_token_ids"], "prompt_token_ids"));
    body["prompt"] = body["prompt_token_ids"];
    body.erase("prompt_token_ids");
  }
  if (!body.contains("prompt")) return InvalidArgument("prompt: required field is missing (or prompt_token_ids)");
  if (!body["prompt"].is_string()) RC_RETURN_IF_ERROR(token_list(body["prompt"], "prompt"));
  if (body.contains("stream") && !body["stream"].is_null() && body["stream"] != false) {
    return InvalidArgument("stream: a rollout is returned whole by the controller (stream must be false or absent); "
                           "stream from the engine's /v1/completions directly");
  }
  if (body.contains("n") && body["n"] != 1) return InvalidArgument("n: one rollout is one completion (n must be 1)");
  body["request_id"] = rollout_id;
  body["return_token_ids"] = true;
  body["stream"] = false;

  RC_ASSIGN_OR_RETURN(auto admitted, AdmitSomewhere(rollout_id));
  auto [index, binding] = admitted;
  EngineSlot* slot = engines_[index].get();
  int64_t admitted_ms = WallTimeMs();
  int64_t admitted_install_generation = -1;  // what was verified when it was admitted
  {
    rc::MutexLock lock(slot->id_mu);
    if (slot->id.generation_settled) admitted_install_generation = slot->id.install_generation;
  }
  auto result = slot->handle.complete(body);

  Trajectory t;
  t.binding = binding;
  t.engine = slot->handle.name;
  t.admitted_ms = admitted_ms;
  t.finished_ms = WallTimeMs();
  Json finish_detail{{"engine", slot->handle.name}};
  if (!result.ok()) {
    // Row first, then the finish (the invariant in service.h); neither result is dropped: a row
    // that could not be written is named in the finish record, a finish that could not be
    // journaled leaves the rollout admitted (recorded interrupted at the next restart).
    t.finish_reason = "error";
    finish_detail["error"] = result.status().ToString();
    // An engine that turns requests away while paused (vLLM 0.33 answers 503 in wait/abort
    // pauses): the rollout produced nothing; its record names the update that paused the engine.
    if (auto pending = slot->controller->pending_target()) {
      finish_detail["update_in_progress"] = pending->label;
      t.extra = Json{{"update_in_progress", pending->label},
                     {"engine_state", lifecycle::StateName(slot->controller->state())}};
    }
    Status stored = trajectories_->Insert(t);
    if (!stored.ok()) finish_detail["trajectory_error"] = stored.ToString();
    Status finished = slot->controller->Finish(rollout_id, finish_detail);
    if (!stored.ok() || !finished.ok()) {
      RC_LOG_ERROR("rollout {} failed on {} and its record is incomplete: trajectory {}, finish {}", rollout_id,
                   slot->handle.name, stored.ToString(), finished.ToString());
    }
    rollouts_failed_.fetch_add(1);
    return result.status().WithContext("rollout " + rollout_id + " on " + slot->handle.name);
  }
  Json& resp = *result;
  // Policy modes: what in-flight updates did to it, and its version spans (service_spans.cc).
  const auto inflight = slot->controller->InFlight(rollout_id);
  std::string span_why, inflight_why;
  const Json first_choice = resp.contains("choices") && resp["choices"].is_array() && !resp["choices"].empty() &&
                                    resp["choices"][0].is_object()
                                ? resp["choices"][0]
                                : Json::object();
  t.version_spans = VersionSpans(slot, binding, first_choice,
                                 static_cast<int64_t>(first_choice.value("token_ids", Json::array()).size()),
                                 inflight ? &*inflight : nullptr, &span_why);
  const Json checked =
      inflight ? InFlightAdjusted(slot, resp, admitted_install_generation, binding, *inflight, &inflight_why) : resp;
  std::string mismatch = CompletionMismatch(slot, binding, checked);
  for (const std::string* w : {&span_why, &inflight_why}) {
    if (!w->empty()) mismatch += (mismatch.empty() ? "" : "; ") + *w;
  }
  if (inflight && !inflight->aborted_at_update.is_null() && first_choice.value("finish_reason", "") == "abort") {
    t.aborted_at_update = inflight->aborted_at_update;
  }
  if (!mismatch.empty()) {
    // Not what the binding names: the output is discarded, never stored or returned as bound;
    // the rollout is recorded failed with the reason and the engine is tainted.
    t.finish_reason = "identity_mismatch";
    if (resp.contains("choices") && resp["choices"].is_array() && !resp["choices"].empty() &&
        resp["choices"][0].is_object()) {
      t.engine_weight_version = resp["choices"][0].value("weight_version", "");
    }
    t.extra = Json{{"identity_mismatch", mismatch}, {"engine_reported", resp.value("rolloutcore", Json())}};
    finish_detail["error"] = "identity mismatch";
    finish_detail["identity_mismatch"] = mismatch;
    Status inserted = trajectories_->Insert(t);
    Status finished = slot->controller->Finish(rollout_id, finish_detail);
    rollouts_failed_.fetch_add(1);
    rollouts_mismatched_.fetch_add(1);
    {
      rc::MutexLock lock(slot->id_mu);
      ++slot->id.mismatches;
    }
    TaintForIdentity(slot, "rollout " + rollout_id + ": " + mismatch);
    std::string msg = "rollout " + rollout_id + " on " + slot->handle.name + " is not bound: " + mismatch +
                      "; its output was discarded and the engine is tainted";
    if (!inserted.ok()) msg += " (recording it failed: " + inserted.ToString() + ")";
    if (!finished.ok()) msg += " (journaling it failed: " + finished.ToString() + ")";
    return DataLoss(msg);
  }
  if (resp.contains("choices") && resp["choices"].is_array() && !resp["choices"].empty()) {
    const Json& c = resp["choices"][0];
    t.finish_reason = c.value("finish_reason", "");
    t.output_token_ids = IntArray(c.value("token_ids", Json::array()));
    t.prompt_token_ids = IntArray(c.value("prompt_token_ids", Json::array()));
    t.engine_weight_version = c.value("weight_version", "");
    if (c.contains("logprobs") && c["logprobs"].is_object() && c["logprobs"].contains("token_logprobs")) {
      for (const auto& x : c["logprobs"]["token_logprobs"]) {
        if (x.is_number()) t.logprobs.push_back(x.get<double>());
      }
    }
  }
  if (resp.contains("usage") && resp["usage"].is_object()) {
    const Json& u = resp["usage"];
    if (u.contains("prompt_tokens_details") && u["prompt_tokens_details"].is_object()) {
      t.cached_tokens = u["prompt_tokens_details"].value("cached_tokens", int64_t{0});
    }
  }
  if (t.prompt_token_ids.empty() && body["prompt"].is_array()) t.prompt_token_ids = IntArray(body["prompt"]);
  finish_detail["finish_reason"] = t.finish_reason;
  finish_detail["completion_tokens"] = t.output_token_ids.size();
  if (t.version_spans.size() > 1 || !t.aborted_at_update.is_null()) {
    // Journal: the spans of a rollout an update touched (tokens per version and kv state).
    finish_detail["version_spans"] = t.version_spans;
    if (!t.aborted_at_update.is_null()) finish_detail["aborted_at_update"] = t.aborted_at_update;
  }
  // The trajectory row is written before the finish is journaled: a crash between the two then
  // leaves an admitted rollout without a finish record, which the restart records interrupted
  // (its row is kept). The other order would leave a rollout finished in the journal whose
  // output exists nowhere — a lost rollout (issue #6, crash safety).
  if (Status stored = trajectories_->Insert(t); !stored.ok()) {
    // The output exists only in this answer, which the client will not get: finish the binding
    // (it must not hold a drain forever) with the failure in its journal record.
    finish_detail["trajectory_error"] = stored.ToString();
    Status finished = slot->controller->Finish(rollout_id, finish_detail);
    if (!finished.ok()) {
      RC_LOG_ERROR("rollout {}: {}; and its finish: {}", rollout_id, stored.ToString(), finished.ToString());
    }
    rollouts_failed_.fetch_add(1);
    return stored.WithContext("rollout " + rollout_id + ": the trajectory could not be stored");
  }
  RC_RETURN_IF_ERROR(slot->controller->Finish(rollout_id, finish_detail));
  rollouts_ok_.fetch_add(1);
  CountSpanTokens(t.version_spans);
  resp["version_spans"] = t.version_spans;
  resp["aborted_at_update"] = t.aborted_at_update;
  resp["binding"] = lifecycle::ToJson(binding);
  resp["binding"]["engine"] = slot->handle.name;
  return resp;
}

Result<Json> ControllerService::Admit(const std::string& rollout_id_in) {
  std::string rollout_id = rollout_id_in;
  if (rollout_id.empty()) rollout_id = "ro-" + std::to_string(WallTimeMs()) + "-" + std::to_string(next_rollout_++);
  {
    rc::MutexLock lock(mu_);
    if (closing_leases_.count(rollout_id) || leases_.count(rollout_id)) {
      return AlreadyExists("rollout " + rollout_id + " is already active");
    }
  }
  RC_ASSIGN_OR_RETURN(auto admitted, AdmitSomewhere(rollout_id, /*lease=*/true));
  auto [index, binding] = admitted;
  Lease lease;
  lease.engine = index;
  lease.admitted_wall_ms = WallTimeMs();
  lease.binding = binding;
  if (options_.lease_timeout_ms > 0) lease.expires_ms = SteadyMs() + options_.lease_timeout_ms;
  {
    rc::MutexLock lock(mu_);
    leases_[rollout_id] = lease;
    expired_leases_.erase(rollout_id);
    ended_leases_.erase(rollout_id);
    open_leases_.store(static_cast<int64_t>(leases_.size() + closing_leases_.size()));
    closing_leases_pending_.store(static_cast<int64_t>(closing_leases_.size()));
  }
  Json j = lifecycle::ToJson(binding);
  j["engine"] = engines_[index]->handle.name;
  j["lease_timeout_ms"] = options_.lease_timeout_ms;
  return j;
}

std::optional<Status> ControllerService::ClosedLeaseStatusLocked(const std::string& rollout_id) const {
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
                              std::to_string(options_.lease_timeout_ms) +
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

Status ControllerService::FinishLease(const std::string& rollout_id, const Json& body) {
  Lease lease;
  {
    rc::MutexLock lock(mu_);
    if (auto closed = ClosedLeaseStatusLocked(rollout_id)) return *closed;
    auto it = leases_.find(rollout_id);
    if (it == leases_.end()) return NotFound("no lease for rollout '" + rollout_id + "'");
    // Taken out while it is finished: a concurrent finish, the expiry or an update's end cannot
    // write a second row.
    lease = it->second;
    leases_.erase(it);
  }
  auto put_back = [&](bool row_written) {
    rc::MutexLock lock(mu_);
    lease.row_written = lease.row_written || row_written;
    leases_[rollout_id] = lease;
  };
  EngineSlot* slot = engines_[lease.engine].get();
  if (const Json why = EndedByUpdate(*slot->controller, rollout_id); !why.is_null()) {
    // An update ended it before this finish arrived (the sweep had not run yet): the client's
    // output may hold tokens of the new weights, so it is not stored as a bound rollout.
    {
      rc::MutexLock lock(mu_);
      ended_leases_[rollout_id] = why;
    }
    Status recorded = RecordLeaseEndedByUpdate(slot, rollout_id, lease, why);
    rc::MutexLock lock(mu_);
    if (!recorded.ok()) closing_leases_[rollout_id] = Closing{lease, why};  // the driver retries the record
    open_leases_.store(static_cast<int64_t>(leases_.size() + closing_leases_.size()));
    closing_leases_pending_.store(static_cast<int64_t>(closing_leases_.size()));
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
  if (auto inflight = slot->controller->InFlight(rollout_id); inflight && !inflight->spanned.empty()) {
    // It lived through in-flight updates: only the engine knows where its tokens' weights
    // changed. Spans the client passes on are checked as a proxied rollout's; without them the
    // row says which updates it spanned and records no spans (never a single bound span).
    Json spanned = Json::array();
    for (int64_t u : inflight->spanned) spanned.push_back(u);
    t.extra["spanned_updates"] = spanned;
    finish_detail["spanned_updates"] = spanned;
    if (body.contains("version_spans") && !body["version_spans"].is_null()) {
      std::string why;
      Json spans = VersionSpans(slot, *binding, Json{{"version_spans", body["version_spans"]}},
                                static_cast<int64_t>(t.output_token_ids.size()), &*inflight, &why);
      if (!body["version_spans"].is_array() || body["version_spans"].empty()) why = "expected a non-empty list";
      if (!why.empty()) {
        put_back(lease.row_written);
        return InvalidArgument("version_spans: " + why + " (lease " + rollout_id +
                               " lived through in-flight updates; pass the engine's per-choice version_spans, or "
                               "none); the lease stays open");
      }
      t.version_spans = spans;
      if (spans.size() > 1) finish_detail["version_spans"] = spans;
    } else {
      t.extra["version_spans"] = "not reported by the client";
    }
  }
  // Row first, then the finish (service.h): a crash between the two leaves the rollout admitted
  // in the journal (recorded interrupted at restart) with its row kept, never finished and lost.
  if (!lease.row_written) {
    if (Status stored = trajectories_->Insert(t); !stored.ok()) {
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
    rc::MutexLock lock(mu_);
    open_leases_.store(static_cast<int64_t>(leases_.size() + closing_leases_.size()));
    closing_leases_pending_.store(static_cast<int64_t>(closing_leases_.size()));
  }
  return OkStatus();
}

Result<Json> ControllerService::ExtendLease(const std::string& rollout_id) {
  rc::MutexLock lock(mu_);
  if (auto closed = ClosedLeaseStatusLocked(rollout_id)) return *closed;
  auto it = leases_.find(rollout_id);
  if (it == leases_.end()) return NotFound("no lease for rollout '" + rollout_id + "'");
  if (const Json why = EndedByUpdate(*engines_[it->second.engine]->controller, rollout_id); !why.is_null()) {
    // Ended by an update; the driver's sweep records it. The client hears it now.
    ended_leases_[rollout_id] = why;
    closing_leases_[rollout_id] = Closing{it->second, why};
    leases_.erase(it);
    open_leases_.store(static_cast<int64_t>(leases_.size() + closing_leases_.size()));
    closing_leases_pending_.store(static_cast<int64_t>(closing_leases_.size()));
    return *ClosedLeaseStatusLocked(rollout_id);
  }
  if (options_.lease_timeout_ms > 0) it->second.expires_ms = SteadyMs() + options_.lease_timeout_ms;
  return Json{{"rollout_id", rollout_id},
              {"expires_in_ms", options_.lease_timeout_ms > 0 ? Json(options_.lease_timeout_ms) : Json()}};
}

Status ControllerService::RecordLeaseEndedByUpdate(EngineSlot* slot, const std::string& rollout_id, const Lease& lease,
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
    return trajectories_->Insert(t);
  }
  Trajectory t;
  t.binding = *binding;
  t.engine = slot->handle.name;
  t.finish_reason = "abort";
  t.aborted_at_update = why;
  t.admitted_ms = lease.admitted_wall_ms;
  t.finished_ms = WallTimeMs();
  t.extra = Json{{"lease", true}};
  if (!lease.row_written) RC_RETURN_IF_ERROR(trajectories_->Insert(t));
  return slot->controller->Finish(rollout_id,
                                  Json{{"lease", true}, {"finish_reason", "abort"}, {"aborted_at_update", why}});
}

void ControllerService::EndLeasesOfUpdates(size_t engine) {
  EngineSlot* slot = engines_[engine].get();
  auto ended = slot->controller->LeasesEndedByUpdate();
  std::vector<std::pair<std::string, Closing>> todo;
  {
    rc::MutexLock lock(mu_);
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
    rc::MutexLock lock(mu_);
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
  rc::MutexLock lock(mu_);
  open_leases_.store(static_cast<int64_t>(leases_.size() + closing_leases_.size()));
  closing_leases_pending_.store(static_cast<int64_t>(closing_leases_.size()));
}

void ControllerService::ExpireLeases(size_t engine) {
  std::vector<std::pair<std::string, Lease>> due;
  {
    rc::MutexLock lock(mu_);
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
  EngineSlot* slot = engines_[engine].get();
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
      t.extra = Json{{"lease_timeout_ms", options_.lease_timeout_ms}};
      s = lease.row_written ? OkStatus() : trajectories_->Insert(t);
      if (s.ok()) lease.row_written = true;
      if (s.ok()) {
        s = slot->controller->Finish(id, Json{{"lease", true},
                                              {"expired", true},
                                              {"finish_reason", "expired"},
                                              {"lease_timeout_ms", options_.lease_timeout_ms}});
      }
    }  // else ended another way (drain abort); nothing holds the drain
    rc::MutexLock lock(mu_);
    if (s.ok()) {
      if (binding) {
        RC_LOG_WARN("lease of rollout {} on {} expired after {} ms without a finish or heartbeat", id,
                    slot->handle.name, options_.lease_timeout_ms);
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
  rc::MutexLock lock(mu_);
  open_leases_.store(static_cast<int64_t>(leases_.size() + closing_leases_.size()));
  closing_leases_pending_.store(static_cast<int64_t>(closing_leases_.size()));
}

// ---- Observation --------------------------------------------------------------------------------

Json ControllerService::StatusJson() const {
  // The states are read together under mu_, so the answer is one instant: an engine leaves READY
  // only after its operation was counted in updating_ (under mu_) and the count drops only after
  // it is back, so at most max_updating engines show an operation's state in one answer. Read one
  // by one, an engine sampled before its operation ended and another after the next one began
  // showed max_updating + 1 (ReplicasTest saw 5 of 8 READY with --max-updating 2).
  std::vector<lifecycle::State> states;
  {
    rc::MutexLock lock(mu_);
    states.reserve(engines_.size());
    for (const auto& slot : engines_) states.push_back(slot->controller->state());
  }
  Json engines = Json::array();
  for (size_t i = 0; i < engines_.size(); ++i) {
    const auto& slot = engines_[i];
    auto v = slot->controller->version();
    Json engine_identity;
    {
      rc::MutexLock lock(slot->id_mu);
      const VerifiedIdentity id = slot->id;  // a copy: the analysis cannot follow a reference
      engine_identity = Json{{"verified", id.verified},
                             {"boot_id", id.boot_id},
                             {"install_generation", id.install_generation},
                             {"install_generation_settled", id.generation_settled},
                             {"checks", id.checks},
                             {"mismatches", id.mismatches},
                             {"checked_wall_ms", id.checked_wall_ms},
                             {"last_error", id.last_error}};
    }
    engines.push_back(Json{{"engine", slot->handle.name},
                           {"engine_identity", engine_identity},
                           {"state", lifecycle::StateName(states[i])},
                           {"label", v.label},
                           {"generation", v.generation},
                           {"identity", lifecycle::ToJson(slot->controller->identity())},
                           {"active_rollouts", slot->controller->active_count()},
                           {"counters", lifecycle::ToJson(slot->controller->counters())}});
  }
  rc::MutexLock lock(mu_);
  return Json{{"engines", engines},
              {"updating", updating_},
              {"max_updating", options_.max_updating},
              {"state_dir", options_.state_dir},
              {"trajectories", trajectories_->path()},
              {"verify_interval_ms", options_.verify_interval_ms},
              {"auto_recover", options_.auto_recover},
              {"update_mode", lifecycle::PolicyModeName(options_.default_mode)},
              {"max_staleness", options_.runner.max_staleness},
              {"rollouts", {{"ok", rollouts_ok_.load()}, {"refused", rollouts_refused_.load()},
                            {"failed", rollouts_failed_.load()}, {"identity_mismatch", rollouts_mismatched_.load()}}}};
}

Result<Json> ControllerService::Journal(int64_t since, int engine) const {
  if (engine < 0 || static_cast<size_t>(engine) >= engines_.size()) {
    return InvalidArgument("engine: " + std::to_string(engine) + " is not an engine index (0.." +
                           std::to_string(engines_.size() - 1) + ")");
  }
  RC_ASSIGN_OR_RETURN(auto records, engines_[engine]->journal->ReadSince(since));
  Json out = Json::array();
  for (const auto& r : records) out.push_back(lifecycle::ToJson(r));
  return Json{{"engine", engines_[engine]->handle.name}, {"records", out}};
}

lifecycle::JournalAppendStats ControllerService::JournalAppendTotals() const {
  lifecycle::JournalAppendStats total = ops_journal_->append_stats();
  for (const auto& slot : engines_) {
    const lifecycle::JournalAppendStats s = slot->journal->append_stats();
    total.appends += s.appends;
    total.syncs += s.syncs;
    total.append_ms += s.append_ms;
    total.recent.insert(total.recent.end(), s.recent.begin(), s.recent.end());
  }
  std::sort(total.recent.begin(), total.recent.end(),
            [](const lifecycle::JournalAppendInterval& a, const lifecycle::JournalAppendInterval& b) {
              return a.start < b.start;
            });
  return total;
}

std::string ControllerService::Metrics() const {
  constexpr MetricType kCounter = MetricType::kCounter;
  MetricsWriter w;
  auto engine_labels = [](const EngineSlot& slot) { return MetricLabels{{"engine", slot.handle.name}}; };
  w.Family("rolloutcore_controller_state", MetricType::kGauge,
           "Lifecycle state of each engine (1 for the current state).");
  for (const auto& slot : engines_) {
    for (int s = 0; s < lifecycle::kNumStates; ++s) {
      auto st = static_cast<State>(s);
      w.Sample("rolloutcore_controller_state",
               WithLabel(engine_labels(*slot), "state", std::string(lifecycle::StateName(st))),
               slot->controller->state() == st ? 1 : 0);
    }
  }
  auto counter = [&](const char* name, const char* help, auto get) {
    w.Family(name, kCounter, help);
    for (const auto& slot : engines_) w.Sample(name, engine_labels(*slot), get(slot->controller->counters()));
  };
  counter("rolloutcore_admissions_total", "Rollouts admitted.", [](const lifecycle::Counters& c) { return c.admissions; });
  counter("rolloutcore_refusals_total", "Admissions refused (not READY).",
          [](const lifecycle::Counters& c) { return c.refusals; });
  counter("rolloutcore_interrupted_total", "Rollouts recorded interrupted by a controller restart.",
          [](const lifecycle::Counters& c) { return c.interrupted; });
  w.Family("rolloutcore_updates_total", kCounter, "Updates by outcome.");
  for (const auto& slot : engines_) {
    auto c = slot->controller->counters();
    const std::pair<const char*, int64_t> outcomes[] = {
        {"committed", c.updates_committed}, {"rejected", c.updates_rejected}, {"tainted", c.updates_tainted}};
    for (const auto& [outcome, n] : outcomes) {
      w.Sample("rolloutcore_updates_total", WithLabel(engine_labels(*slot), "outcome", outcome), n);
    }
  }
  w.Family("rolloutcore_updates_by_mode_total", kCounter, "Committed updates by policy mode.");
  for (const auto& slot : engines_) {
    auto c = slot->controller->counters();
    for (lifecycle::PolicyMode mode : lifecycle::kAllPolicyModes) {
      const std::string name(lifecycle::PolicyModeName(mode));
      auto it = c.updates_by_mode.find(name);
      w.Sample("rolloutcore_updates_by_mode_total", WithLabel(engine_labels(*slot), "mode", name),
               it == c.updates_by_mode.end() ? 0 : it->second);
    }
  }
  {
    rc::MutexLock lock(mu_);
    w.Family("rolloutcore_rollout_tokens_by_kv_total", kCounter,
             "Output tokens of proxied rollouts by the KV state of their version span (fresh | stale | recomputed).");
    for (const char* kv : {"fresh", "stale", "recomputed"}) {
      auto it = tokens_by_kv_.find(kv);
      w.Sample("rolloutcore_rollout_tokens_by_kv_total", {{"kv", kv}}, it == tokens_by_kv_.end() ? 0 : it->second);
    }
  }
  // Outcomes from the engines' finish records (the counters /v1/status shows per engine), so
  // metrics, status and the trajectory rows agree, also across a restart (issue 36 #6).
  {
    int64_t aborted = 0, spans = 0;
    for (const auto& slot : engines_) {
      const auto c = slot->controller->counters();
      aborted += c.aborted_at_update;
      spans += c.inflight_spans;
    }
    w.Metric("rolloutcore_rollouts_aborted_at_update_total", kCounter,
             "Finished rollouts and leases whose record says an in-flight update ended them (abort mode, max "
             "staleness, a lease under keep/recompute, a tainted in-flight update); = rows with aborted_at_update.",
             {}, aborted);
    w.Metric("rolloutcore_inflight_spans_total", kCounter,
             "Version boundaries inside finished rollouts' outputs (sum over rows of version_spans - 1).", {}, spans);
  }
  w.Family("rolloutcore_phase_ms_total", kCounter, "Milliseconds spent in each lifecycle phase during updates.");
  for (const auto& slot : engines_) {
    auto c = slot->controller->counters();
    for (const auto& [phase, ms] : c.phase_ms_total) {
      w.Sample("rolloutcore_phase_ms_total", WithLabel(engine_labels(*slot), "phase", phase), ms);
    }
  }
  w.Family("rolloutcore_rollouts_total", kCounter, "Proxied rollouts by result.");
  w.Sample("rolloutcore_rollouts_total", {{"result", "ok"}}, rollouts_ok_.load());
  w.Sample("rolloutcore_rollouts_total", {{"result", "refused"}}, rollouts_refused_.load());
  w.Sample("rolloutcore_rollouts_total", {{"result", "failed"}}, rollouts_failed_.load());
  w.Metric("rolloutcore_rollouts_identity_mismatch_total", kCounter,
           "Proxied rollouts whose completion did not match the binding (also counted failed).", {},
           rollouts_mismatched_.load());
  w.Family("rolloutcore_identity_mismatches_total", kCounter,
           "Identity checks and completions that did not match the verified engine.");
  for (const auto& slot : engines_) {
    rc::MutexLock lock(slot->id_mu);
    w.Sample("rolloutcore_identity_mismatches_total", engine_labels(*slot), slot->id.mismatches);
  }
  return w.Text();
}

}  // namespace rc::controller
