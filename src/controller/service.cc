#include "rolloutcore/controller/service.h"

#include <chrono>
#include <filesystem>
#include <sstream>

#include "rolloutcore/base/clock.h"
#include "rolloutcore/base/log.h"

namespace rc::controller {

using lifecycle::State;
using lifecycle::UpdateOutcome;

namespace {

std::vector<int64_t> IntArray(const Json& j) {
  std::vector<int64_t> out;
  if (j.is_array()) {
    for (const auto& x : j) {
      if (x.is_number_integer()) out.push_back(x.get<int64_t>());
    }
  }
  return out;
}

}  // namespace

Result<std::unique_ptr<ControllerService>> ControllerService::Create(std::vector<EngineHandle> engines,
                                                                     VersionSource* versions, ServiceOptions options) {
  if (engines.empty()) return InvalidArgument("controller: at least one engine is needed");
  if (options.state_dir.empty()) return InvalidArgument("controller: --state-dir is required");
  if (options.max_updating < 1) return InvalidArgument("controller: --max-updating must be at least 1");
  std::error_code ec;
  std::filesystem::create_directories(options.state_dir, ec);
  if (ec) return Unavailable("cannot create state dir '" + options.state_dir + "': " + ec.message());

  std::unique_ptr<ControllerService> s(new ControllerService());
  s->versions_ = versions;
  s->options_ = options;
  RC_ASSIGN_OR_RETURN(s->trajectories_, TrajectoryStore::Open(options.state_dir + "/trajectories.db"));
  for (size_t i = 0; i < engines.size(); ++i) {
    auto slot = std::make_unique<EngineSlot>();
    slot->index = i;
    slot->handle = std::move(engines[i]);
    RC_RETURN_IF_ERROR(s->InitEngine(slot.get()).WithContext("engine " + std::to_string(i) + " (" +
                                                              slot->handle.name + ")"));
    s->engines_.push_back(std::move(slot));
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

Status ControllerService::InitEngine(EngineSlot* slot) {
  auto path = options_.state_dir + "/engine-" + std::to_string(slot->index) + ".journal.db";
  RC_ASSIGN_OR_RETURN(auto journal, lifecycle::SqliteJournal::Open(path));
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
  return OkStatus();
}

// ---- Driver ---------------------------------------------------------------------------------

void ControllerService::Drive(EngineSlot* slot) {
  while (!stop_) {
    bool busy = slot->runner->Poll();
    if (!busy) {
      std::unique_lock<std::mutex> lock(mu_);
      if (!slot->running_op.empty()) {
        slot->running_op.clear();
        --updating_;
        cv_.notify_all();
      }
      if (!slot->queue.empty() && updating_ < options_.max_updating) {
        Op op = slot->queue.front();
        State st = slot->controller->state();
        bool can = op.recovery ? st == State::kTainted : st == State::kReady;
        if (!can) {
          if (op.recovery && st == State::kReady) {
            ops_[op.id].errors[slot->index] = "engine is READY: nothing to recover";
            slot->queue.pop_front();
          } else if (!op.recovery && st == State::kTainted) {
            ops_[op.id].errors[slot->index] = "engine is TAINTED: recover it first";
            slot->queue.pop_front();
          }
          // Otherwise wait (e.g. UNINITIALIZED, or a restore in progress).
        } else {
          slot->queue.pop_front();
          ++updating_;
          slot->running_op = op.id;
          lock.unlock();
          auto started = op.recovery ? slot->runner->StartRecovery(op.target) : slot->runner->StartUpdate(op.target);
          lock.lock();
          if (started.ok()) {
            ops_[op.id].ordinals[slot->index] = started->ordinal;
          } else {
            ops_[op.id].errors[slot->index] = started.status().ToString();
            slot->running_op.clear();
            --updating_;
          }
          cv_.notify_all();
          continue;
        }
      }
      cv_.wait_for(lock, std::chrono::milliseconds(busy ? 1 : 5));
      continue;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
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
    auto id = Enqueue(options_.model, latest.version, false);
    if (!id.ok()) RC_LOG_WARN("auto-update to {}: {}", latest.version, id.status().ToString());
  }
}

// ---- Updates ----------------------------------------------------------------------------------

Result<std::string> ControllerService::Enqueue(const std::string& model, const std::string& version, bool recovery) {
  if (versions_ == nullptr) return FailedPrecondition("controller has no directory (--directory) to resolve versions");
  RC_ASSIGN_OR_RETURN(lifecycle::UpdateTarget target, versions_->Resolve(model, version));
  std::lock_guard<std::mutex> lock(mu_);
  Op op;
  op.id = "u-" + std::to_string(next_op_++);
  op.recovery = recovery;
  op.target = target;
  OpRecord rec;
  rec.id = op.id;
  rec.model = model;
  rec.version = version;
  rec.recovery = recovery;
  rec.requested_wall_ms = WallTimeMs();
  ops_[op.id] = rec;
  for (auto& slot : engines_) slot->queue.push_back(op);
  cv_.notify_all();
  return op.id;
}

Result<std::string> ControllerService::RequestUpdate(const std::string& model, const std::string& version) {
  return Enqueue(model, version, false);
}

Result<std::string> ControllerService::RequestRecovery(const std::string& model, const std::string& version) {
  return Enqueue(model, version, true);
}

Json ControllerService::OpJson(const OpRecord& rec) const {
  Json engines = Json::array();
  bool all_done = true;
  std::string overall = "committed";
  for (const auto& slot : engines_) {
    Json e{{"engine", slot->handle.name}, {"index", slot->index}};
    auto err = rec.errors.find(slot->index);
    auto ord = rec.ordinals.find(slot->index);
    if (err != rec.errors.end()) {
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
              {"done", all_done},
              {"outcome", all_done ? overall : "in_progress"},
              {"requested_wall_ms", rec.requested_wall_ms},
              {"engines", engines}};
}

Result<Json> ControllerService::UpdateStatus(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ops_.find(id);
  if (it == ops_.end()) return NotFound("no update '" + id + "'");
  return OpJson(it->second);
}

Result<Json> ControllerService::WaitForUpdate(const std::string& id, int64_t timeout_ms) const {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    RC_ASSIGN_OR_RETURN(Json j, UpdateStatus(id));
    if (j["done"].get<bool>()) return j;
    if (std::chrono::steady_clock::now() >= deadline) return DeadlineExceeded("update " + id + " still in progress");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// ---- Rollouts ---------------------------------------------------------------------------------

Result<std::pair<size_t, lifecycle::RolloutBinding>> ControllerService::AdmitSomewhere(const std::string& rollout_id) {
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
    auto b = slot->controller->Admit(rollout_id);
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
  auto result = slot->handle.complete(body);

  Trajectory t;
  t.binding = binding;
  t.engine = slot->handle.name;
  t.admitted_ms = admitted_ms;
  t.finished_ms = WallTimeMs();
  Json finish_detail{{"engine", slot->handle.name}};
  if (!result.ok()) {
    t.finish_reason = "error";
    finish_detail["error"] = result.status().ToString();
    (void)slot->controller->Finish(rollout_id, finish_detail);
    (void)trajectories_->Insert(t);
    rollouts_failed_.fetch_add(1);
    return result.status().WithContext("rollout " + rollout_id + " on " + slot->handle.name);
  }
  Json& resp = *result;
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
  // The engine's own label per choice (rolloutcore reports it) must equal the binding's: the
  // controller refuses to have mutated weights under a live rollout, and this checks it.
  if (!t.engine_weight_version.empty() && t.engine_weight_version != binding.version.label) {
    finish_detail["label_mismatch"] = t.engine_weight_version;
    RC_LOG_ERROR("rollout {}: bound to {} but the engine reports {}", rollout_id, binding.version.label,
                 t.engine_weight_version);
  }
  // The trajectory row is written before the finish is journaled: a crash between the two then
  // leaves an admitted rollout without a finish record, which the restart records interrupted
  // (its row is kept). The other order would leave a rollout finished in the journal whose
  // output exists nowhere — a lost rollout (issue #6, crash safety).
  RC_RETURN_IF_ERROR(trajectories_->Insert(t));
  RC_RETURN_IF_ERROR(slot->controller->Finish(rollout_id, finish_detail));
  rollouts_ok_.fetch_add(1);
  resp["binding"] = lifecycle::ToJson(binding);
  resp["binding"]["engine"] = slot->handle.name;
  return resp;
}

Result<Json> ControllerService::Admit(const std::string& rollout_id_in) {
  std::string rollout_id = rollout_id_in;
  if (rollout_id.empty()) rollout_id = "ro-" + std::to_string(WallTimeMs()) + "-" + std::to_string(next_rollout_++);
  RC_ASSIGN_OR_RETURN(auto admitted, AdmitSomewhere(rollout_id));
  auto [index, binding] = admitted;
  {
    std::lock_guard<std::mutex> lock(mu_);
    leases_[rollout_id] = index;
  }
  Json j = lifecycle::ToJson(binding);
  j["engine"] = engines_[index]->handle.name;
  return j;
}

Status ControllerService::FinishLease(const std::string& rollout_id, const Json& body) {
  size_t index;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = leases_.find(rollout_id);
    if (it == leases_.end()) return NotFound("no lease for rollout '" + rollout_id + "'");
    index = it->second;
  }
  EngineSlot* slot = engines_[index].get();
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
  t.finished_ms = WallTimeMs();
  t.admitted_ms = t.finished_ms;
  t.extra = body.value("extra", Json::object());
  RC_RETURN_IF_ERROR(slot->controller->Finish(rollout_id, Json{{"lease", true}, {"finish_reason", t.finish_reason}}));
  RC_RETURN_IF_ERROR(trajectories_->Insert(t));
  std::lock_guard<std::mutex> lock(mu_);
  leases_.erase(rollout_id);
  return OkStatus();
}

// ---- Observation --------------------------------------------------------------------------------

Json ControllerService::StatusJson() const {
  Json engines = Json::array();
  for (const auto& slot : engines_) {
    auto v = slot->controller->version();
    engines.push_back(Json{{"engine", slot->handle.name},
                           {"state", lifecycle::StateName(slot->controller->state())},
                           {"label", v.label},
                           {"generation", v.generation},
                           {"identity", lifecycle::ToJson(slot->controller->identity())},
                           {"active_rollouts", slot->controller->active_count()},
                           {"counters", lifecycle::ToJson(slot->controller->counters())}});
  }
  std::lock_guard<std::mutex> lock(mu_);
  return Json{{"engines", engines},
              {"updating", updating_},
              {"max_updating", options_.max_updating},
              {"state_dir", options_.state_dir},
              {"trajectories", trajectories_->path()},
              {"rollouts", {{"ok", rollouts_ok_.load()}, {"refused", rollouts_refused_.load()},
                            {"failed", rollouts_failed_.load()}}}};
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

std::string ControllerService::Metrics() const {
  std::ostringstream m;
  m << "# HELP rolloutcore_controller_state Lifecycle state of each engine (1 for the current state).\n"
    << "# TYPE rolloutcore_controller_state gauge\n";
  for (const auto& slot : engines_) {
    for (int s = 0; s < lifecycle::kNumStates; ++s) {
      auto st = static_cast<State>(s);
      m << "rolloutcore_controller_state{engine=\"" << slot->handle.name << "\",state=\"" << lifecycle::StateName(st)
        << "\"} " << (slot->controller->state() == st ? 1 : 0) << "\n";
    }
  }
  auto counter = [&](const char* name, const char* help, auto get) {
    m << "# HELP " << name << " " << help << "\n# TYPE " << name << " counter\n";
    for (const auto& slot : engines_) {
      m << name << "{engine=\"" << slot->handle.name << "\"} " << get(slot->controller->counters()) << "\n";
    }
  };
  counter("rolloutcore_admissions_total", "Rollouts admitted.", [](const lifecycle::Counters& c) { return c.admissions; });
  counter("rolloutcore_refusals_total", "Admissions refused (not READY).",
          [](const lifecycle::Counters& c) { return c.refusals; });
  counter("rolloutcore_interrupted_total", "Rollouts recorded interrupted by a controller restart.",
          [](const lifecycle::Counters& c) { return c.interrupted; });
  m << "# HELP rolloutcore_updates_total Updates by outcome.\n# TYPE rolloutcore_updates_total counter\n";
  for (const auto& slot : engines_) {
    auto c = slot->controller->counters();
    m << "rolloutcore_updates_total{engine=\"" << slot->handle.name << "\",outcome=\"committed\"} "
      << c.updates_committed << "\n";
    m << "rolloutcore_updates_total{engine=\"" << slot->handle.name << "\",outcome=\"rejected\"} "
      << c.updates_rejected << "\n";
    m << "rolloutcore_updates_total{engine=\"" << slot->handle.name << "\",outcome=\"tainted\"} " << c.updates_tainted
      << "\n";
  }
  m << "# HELP rolloutcore_phase_ms_total Milliseconds spent in each lifecycle phase during updates.\n"
    << "# TYPE rolloutcore_phase_ms_total counter\n";
  for (const auto& slot : engines_) {
    auto c = slot->controller->counters();
    for (const auto& [phase, ms] : c.phase_ms_total) {
      m << "rolloutcore_phase_ms_total{engine=\"" << slot->handle.name << "\",phase=\"" << phase << "\"} " << ms
        << "\n";
    }
  }
  m << "# HELP rolloutcore_rollouts_total Proxied rollouts by result.\n# TYPE rolloutcore_rollouts_total counter\n"
    << "rolloutcore_rollouts_total{result=\"ok\"} " << rollouts_ok_.load() << "\n"
    << "rolloutcore_rollouts_total{result=\"refused\"} " << rollouts_refused_.load() << "\n"
    << "rolloutcore_rollouts_total{result=\"failed\"} " << rollouts_failed_.load() << "\n";
  return m.str();
}

}  // namespace rc::controller
