// ControllerService: the front of the controller service (service.h). It creates the shared
// state and the three components (service_core.h) and forwards the public API to them; the
// state dir marker, rollout id validation and the observation answers (status, journal,
// metrics) live here.
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

#include "controller/identity_monitor.h"
#include "controller/rollout_admission.h"
#include "controller/service_core.h"
#include "controller/update_orchestrator.h"
#include "rolloutcore/base/clock.h"
#include "rolloutcore/base/log.h"
#include "rolloutcore/base/metrics_writer.h"
#include "rolloutcore/base/mutex.h"

namespace rc::controller {

using lifecycle::State;

int64_t SteadyMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string Join(const std::vector<std::string>& parts) {
  std::string out;
  for (const auto& p : parts) out += (out.empty() ? "" : "; ") + p;
  return out;
}

std::vector<int64_t> IntArray(const Json& j) {
  std::vector<int64_t> out;
  if (j.is_array()) {
    for (const auto& x : j) {
      if (x.is_number_integer()) out.push_back(x.get<int64_t>());
    }
  }
  return out;
}

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

ControllerService::ControllerService()
    : core_(std::make_unique<ServiceCore>()),
      identity_(std::make_unique<IdentityMonitor>(
          core_.get(),
          [this](const std::string& model, const std::string& version, size_t engine) {
            return updates_->Enqueue(model, version, /*recovery=*/true, engine);
          })),
      admission_(std::make_unique<RolloutAdmission>(core_.get(), identity_.get())),
      updates_(std::make_unique<UpdateOrchestrator>(core_.get(), identity_.get(), admission_.get())) {}

Result<std::unique_ptr<ControllerService>> ControllerService::Create(std::vector<EngineHandle> engines,
                                                                     VersionSource* versions, const ServiceOptions& options) {
  if (engines.empty()) return InvalidArgument("controller: at least one engine is needed");
  if (options.state_dir.empty()) return InvalidArgument("controller: --state-dir is required");
  if (options.max_updating < 1) return InvalidArgument("controller: --max-updating must be at least 1");
  std::error_code ec;
  std::filesystem::create_directories(options.state_dir, ec);
  if (ec) return Unavailable("cannot create state dir '" + options.state_dir + "': " + ec.message());

  std::unique_ptr<ControllerService> s(new ControllerService());
  ServiceCore* core = s->core_.get();
  core->versions = versions;
  core->options = options;
  // A state dir that was started before holds a marker; from then on a missing, empty or
  // damaged store is an error naming the file, never a silent fresh start.
  RC_ASSIGN_OR_RETURN(int64_t marked_engines, ReadStateMarker(options.state_dir));
  const bool initialized = marked_engines >= 0;
  const std::string how = initialized ? " (state dir initialized before: " + StateMarkerPath(options.state_dir) +
                                            "; restore the file or start with an empty --state-dir)"
                                      : "";
  auto opened = TrajectoryStore::Open(options.state_dir + "/trajectories.db", initialized);
  if (!opened.ok()) return opened.status().WithContext("controller: refusing to start" + how);
  core->trajectories = std::move(opened).value();
  if (Status ops = s->updates_->Open(initialized); !ops.ok()) {
    return ops.WithContext("controller: refusing to start" + how);
  }
  for (size_t i = 0; i < engines.size(); ++i) {
    auto slot = std::make_unique<EngineSlot>();
    slot->index = i;
    slot->handle = std::move(engines[i]);
    const bool must_exist = static_cast<int64_t>(i) < marked_engines;
    Status st = s->identity_->InitEngine(slot.get(), must_exist);
    if (!st.ok()) {
      st = st.WithContext("engine " + std::to_string(i) + " (" + slot->handle.name + ")");
      return must_exist ? st.WithContext("controller: refusing to start" + how) : st;
    }
    core->engines.push_back(std::move(slot));
  }
  RC_RETURN_IF_ERROR(s->updates_->RestoreOps());
  if (marked_engines < static_cast<int64_t>(core->engines.size())) {
    RC_RETURN_IF_ERROR(WriteStateMarker(options.state_dir, static_cast<int64_t>(core->engines.size())));
  }
  s->updates_->StartDrivers();
  if (options.auto_update) {
    if (options.model.empty()) return InvalidArgument("controller: --auto-update needs --model");
    if (versions == nullptr) return InvalidArgument("controller: --auto-update needs a directory");
    s->updates_->StartFollower();
  }
  return s;
}

ControllerService::~ControllerService() { updates_->StopThreads(); }

// ---- The API, forwarded ---------------------------------------------------------------------------

Result<Json> ControllerService::Rollout(const Json& request) { return admission_->Rollout(request); }

Result<Json> ControllerService::Admit(const std::string& rollout_id) { return admission_->Admit(rollout_id); }

Status ControllerService::FinishLease(const std::string& rollout_id, const Json& body) {
  return admission_->FinishLease(rollout_id, body);
}

Result<Json> ControllerService::ExtendLease(const std::string& rollout_id) {
  return admission_->ExtendLease(rollout_id);
}

Result<std::string> ControllerService::RequestUpdate(const std::string& model, const std::string& version,
                                                     std::optional<lifecycle::PolicyMode> mode, bool retry_failed) {
  return updates_->RequestUpdate(model, version, mode, retry_failed);
}

Result<std::string> ControllerService::RequestRecovery(const std::string& model, const std::string& version) {
  return updates_->RequestRecovery(model, version);
}

Result<Json> ControllerService::UpdateStatus(const std::string& id) const { return updates_->UpdateStatus(id); }

Result<Json> ControllerService::WaitForUpdate(const std::string& id, int64_t timeout_ms) const {
  return updates_->WaitForUpdate(id, timeout_ms);
}

TrajectoryStore* ControllerService::trajectories() { return core_->trajectories.get(); }

lifecycle::Controller* ControllerService::controller(size_t engine) {
  return core_->engines[engine]->controller.get();
}

// ---- Observation --------------------------------------------------------------------------------

Json ControllerService::StatusJson() const {
  // The states are read together under the service mutex, so the answer is one instant: an engine
  // leaves READY only after its operation was counted in `updating` (under that mutex) and the
  // count drops only after it is back, so at most max_updating engines show an operation's state
  // in one answer. Read one by one, an engine sampled before its operation ended and another after the next one began
  // showed max_updating + 1 (ReplicasTest saw 5 of 8 READY with --max-updating 2).
  std::vector<lifecycle::State> states;
  {
    rc::MutexLock lock(core_->mu);
    states.reserve(core_->engines.size());
    for (const auto& slot : core_->engines) states.push_back(slot->controller->state());
  }
  Json engines = Json::array();
  for (size_t i = 0; i < core_->engines.size(); ++i) {
    const auto& slot = core_->engines[i];
    auto v = slot->controller->version();
    const Json engine_identity = IdentityMonitor::IdentityJson(*slot);
    engines.push_back(Json{{"engine", slot->handle.name},
                           {"engine_identity", engine_identity},
                           {"state", lifecycle::StateName(states[i])},
                           {"label", v.label},
                           {"generation", v.generation},
                           {"identity", lifecycle::ToJson(slot->controller->identity())},
                           {"active_rollouts", slot->controller->active_count()},
                           {"counters", lifecycle::ToJson(slot->controller->counters())}});
  }
  const RolloutAdmission::Counts rollouts = admission_->counts();
  return Json{{"engines", engines},
              {"updating", updates_->updating()},
              {"max_updating", core_->options.max_updating},
              {"state_dir", core_->options.state_dir},
              {"trajectories", core_->trajectories->path()},
              {"verify_interval_ms", core_->options.verify_interval_ms},
              {"auto_recover", core_->options.auto_recover},
              {"update_mode", lifecycle::PolicyModeName(core_->options.default_mode)},
              {"max_staleness", core_->options.runner.max_staleness},
              {"rollouts", {{"ok", rollouts.ok}, {"refused", rollouts.refused},
                            {"failed", rollouts.failed}, {"identity_mismatch", rollouts.identity_mismatch}}}};
}

Result<Json> ControllerService::Journal(int64_t since, int engine) const {
  if (engine < 0 || static_cast<size_t>(engine) >= core_->engines.size()) {
    return InvalidArgument("engine: " + std::to_string(engine) + " is not an engine index (0.." +
                           std::to_string(core_->engines.size() - 1) + ")");
  }
  RC_ASSIGN_OR_RETURN(auto records, core_->engines[engine]->journal->ReadSince(since));
  Json out = Json::array();
  for (const auto& r : records) out.push_back(lifecycle::ToJson(r));
  return Json{{"engine", core_->engines[engine]->handle.name}, {"records", out}};
}

lifecycle::JournalAppendStats ControllerService::JournalAppendTotals() const {
  lifecycle::JournalAppendStats total = updates_->journal().append_stats();
  for (const auto& slot : core_->engines) {
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
  for (const auto& slot : core_->engines) {
    for (int s = 0; s < lifecycle::kNumStates; ++s) {
      auto st = static_cast<State>(s);
      w.Sample("rolloutcore_controller_state",
               WithLabel(engine_labels(*slot), "state", std::string(lifecycle::StateName(st))),
               slot->controller->state() == st ? 1 : 0);
    }
  }
  auto counter = [&](const char* name, const char* help, auto get) {
    w.Family(name, kCounter, help);
    for (const auto& slot : core_->engines) w.Sample(name, engine_labels(*slot), get(slot->controller->counters()));
  };
  counter("rolloutcore_admissions_total", "Rollouts admitted.", [](const lifecycle::Counters& c) { return c.admissions; });
  counter("rolloutcore_refusals_total", "Admissions refused (not READY).",
          [](const lifecycle::Counters& c) { return c.refusals; });
  counter("rolloutcore_interrupted_total", "Rollouts recorded interrupted by a controller restart.",
          [](const lifecycle::Counters& c) { return c.interrupted; });
  w.Family("rolloutcore_updates_total", kCounter, "Updates by outcome.");
  for (const auto& slot : core_->engines) {
    auto c = slot->controller->counters();
    const std::pair<const char*, int64_t> outcomes[] = {
        {"committed", c.updates_committed}, {"rejected", c.updates_rejected}, {"tainted", c.updates_tainted}};
    for (const auto& [outcome, n] : outcomes) {
      w.Sample("rolloutcore_updates_total", WithLabel(engine_labels(*slot), "outcome", outcome), n);
    }
  }
  w.Family("rolloutcore_updates_by_mode_total", kCounter, "Committed updates by policy mode.");
  for (const auto& slot : core_->engines) {
    auto c = slot->controller->counters();
    for (lifecycle::PolicyMode mode : lifecycle::kAllPolicyModes) {
      const std::string name(lifecycle::PolicyModeName(mode));
      auto it = c.updates_by_mode.find(name);
      w.Sample("rolloutcore_updates_by_mode_total", WithLabel(engine_labels(*slot), "mode", name),
               it == c.updates_by_mode.end() ? 0 : it->second);
    }
  }
  {
    const std::map<std::string, int64_t> tokens_by_kv = admission_->TokensByKv();
    w.Family("rolloutcore_rollout_tokens_by_kv_total", kCounter,
             "Output tokens of proxied rollouts by the KV state of their version span (fresh | stale | recomputed).");
    for (const char* kv : {"fresh", "stale", "recomputed"}) {
      auto it = tokens_by_kv.find(kv);
      w.Sample("rolloutcore_rollout_tokens_by_kv_total", {{"kv", kv}}, it == tokens_by_kv.end() ? 0 : it->second);
    }
  }
  // Outcomes from the engines' finish records (the counters /v1/status shows per engine), so
  // metrics, status and the trajectory rows agree, also across a restart (issue 36 #6).
  {
    int64_t aborted = 0, spans = 0;
    for (const auto& slot : core_->engines) {
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
  for (const auto& slot : core_->engines) {
    auto c = slot->controller->counters();
    for (const auto& [phase, ms] : c.phase_ms_total) {
      w.Sample("rolloutcore_phase_ms_total", WithLabel(engine_labels(*slot), "phase", phase), ms);
    }
  }
  const RolloutAdmission::Counts rollouts = admission_->counts();
  w.Family("rolloutcore_rollouts_total", kCounter, "Proxied rollouts by result.");
  w.Sample("rolloutcore_rollouts_total", {{"result", "ok"}}, rollouts.ok);
  w.Sample("rolloutcore_rollouts_total", {{"result", "refused"}}, rollouts.refused);
  w.Sample("rolloutcore_rollouts_total", {{"result", "failed"}}, rollouts.failed);
  w.Metric("rolloutcore_rollouts_identity_mismatch_total", kCounter,
           "Proxied rollouts whose completion did not match the binding (also counted failed).", {},
           rollouts.identity_mismatch);
  w.Family("rolloutcore_identity_mismatches_total", kCounter,
           "Identity checks and completions that did not match the verified engine.");
  for (const auto& slot : core_->engines) {
    rc::MutexLock lock(slot->id_mu);
    w.Sample("rolloutcore_identity_mismatches_total", engine_labels(*slot), slot->id.mismatches);
  }
  return w.Text();
}

}  // namespace rc::controller
