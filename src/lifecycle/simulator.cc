#include "rolloutcore/lifecycle/simulator.h"

#include <algorithm>
#include <deque>
#include <map>
#include <memory>

#include "rolloutcore/base/clock.h"
#include "rolloutcore/lifecycle/controller.h"
#include "rolloutcore/lifecycle/journal.h"
#include "rolloutcore/lifecycle/runner.h"
#include "rolloutcore/lifecycle/scripted_engine.h"

namespace rc::lifecycle {
namespace {

constexpr int64_t kMaxTailMs = 600'000;        // how long to run past the last event at most
constexpr int64_t kMaxScenarioMs = 3'600'000;  // the latest time a scenario may name

struct SimEvent {
  int64_t at_ms = 0;
  size_t index = 0;
  std::string kind;  // admit | update | recover | crash_controller | external_request
  std::string id;
  int64_t duration_ms = 0;
  UpdateTarget target;
};

struct RolloutRow {
  std::string id;
  bool admitted = false;
  std::string refused_reason;
  std::string label;
  int64_t generation = -1;
  int64_t admitted_t_ms = -1;
  int64_t finished_t_ms = -1;
  bool interrupted = false;
  bool aborted = false;
};

Result<UpdateTarget> ParseTarget(const Json& j, const std::string& path) {
  RC_RETURN_IF_ERROR(CheckKnownKeys(j, {"label", "digest", "step", "checkpoint", "run", "model"}, path));
  UpdateTarget t;
  RC_ASSIGN_OR_RETURN(t.label, GetString(j, "label", path));
  RC_ASSIGN_OR_RETURN(t.identity.content_digest, GetString(j, "digest", path, std::string()));
  RC_ASSIGN_OR_RETURN(t.identity.step, GetInt(j, "step", path, -1));
  RC_ASSIGN_OR_RETURN(t.identity.checkpoint, GetString(j, "checkpoint", path, std::string()));
  RC_ASSIGN_OR_RETURN(t.identity.run, GetString(j, "run", path, std::string()));
  RC_ASSIGN_OR_RETURN(t.model, GetString(j, "model", path, std::string()));
  return t;
}

Result<std::vector<SimEvent>> ParseEvents(const Json& scenario) {
  if (!scenario.contains("events")) return std::vector<SimEvent>{};
  const Json& events = scenario["events"];
  if (!events.is_array()) return InvalidArgument("events: expected an array, got " + JsonTypeName(events));
  std::vector<SimEvent> out;
  for (size_t i = 0; i < events.size(); ++i) {
    const Json& e = events[i];
    std::string path = "events[" + std::to_string(i) + "]";
    RC_RETURN_IF_ERROR(CheckKnownKeys(
        e, {"at_ms", "admit", "duration_ms", "update", "recover", "crash_controller", "external_request", "comment"},
        path));
    SimEvent ev;
    ev.index = i;
    RC_ASSIGN_OR_RETURN(ev.at_ms, GetNonNegativeInt(e, "at_ms", path));
    int kinds = 0;
    if (e.contains("admit")) {
      ++kinds;
      ev.kind = "admit";
      RC_ASSIGN_OR_RETURN(ev.id, GetString(e, "admit", path));
      RC_ASSIGN_OR_RETURN(ev.duration_ms, GetNonNegativeInt(e, "duration_ms", path, 100));
    }
    if (e.contains("external_request")) {
      ++kinds;
      ev.kind = "external_request";
      RC_ASSIGN_OR_RETURN(ev.id, GetString(e, "external_request", path));
      RC_ASSIGN_OR_RETURN(ev.duration_ms, GetNonNegativeInt(e, "duration_ms", path, 100));
    }
    if (e.contains("update")) {
      ++kinds;
      ev.kind = "update";
      RC_ASSIGN_OR_RETURN(ev.target, ParseTarget(e["update"], path + ".update"));
    }
    if (e.contains("recover")) {
      ++kinds;
      ev.kind = "recover";
      RC_ASSIGN_OR_RETURN(ev.target, ParseTarget(e["recover"], path + ".recover"));
    }
    if (e.contains("crash_controller")) {
      ++kinds;
      ev.kind = "crash_controller";
      RC_ASSIGN_OR_RETURN(bool b, GetBool(e, "crash_controller", path));
      if (!b) return InvalidArgument(path + ".crash_controller: must be true when present");
    }
    if (kinds != 1) {
      return InvalidArgument(path + ": needs exactly one of admit | update | recover | crash_controller | external_request");
    }
    out.push_back(ev);
  }
  std::stable_sort(out.begin(), out.end(), [](const SimEvent& a, const SimEvent& b) { return a.at_ms < b.at_ms; });
  return out;
}

Result<RunnerOptions> ParseRunnerOptions(const Json& s) {
  RunnerOptions o;
  if (s.contains("deadlines_ms")) {
    const Json& d = s["deadlines_ms"];
    const std::string p = "deadlines_ms";
    RC_RETURN_IF_ERROR(CheckKnownKeys(d, {"drain", "stage", "pause", "install", "reset", "validate", "resume", "poll"}, p));
    RC_ASSIGN_OR_RETURN(o.deadlines.drain_ms, GetNonNegativeInt(d, "drain", p, o.deadlines.drain_ms));
    RC_ASSIGN_OR_RETURN(o.deadlines.stage_ms, GetNonNegativeInt(d, "stage", p, o.deadlines.stage_ms));
    RC_ASSIGN_OR_RETURN(o.deadlines.pause_ms, GetNonNegativeInt(d, "pause", p, o.deadlines.pause_ms));
    RC_ASSIGN_OR_RETURN(o.deadlines.install_ms, GetNonNegativeInt(d, "install", p, o.deadlines.install_ms));
    RC_ASSIGN_OR_RETURN(o.deadlines.reset_ms, GetNonNegativeInt(d, "reset", p, o.deadlines.reset_ms));
    RC_ASSIGN_OR_RETURN(o.deadlines.validate_ms, GetNonNegativeInt(d, "validate", p, o.deadlines.validate_ms));
    RC_ASSIGN_OR_RETURN(o.deadlines.resume_ms, GetNonNegativeInt(d, "resume", p, o.deadlines.resume_ms));
    RC_ASSIGN_OR_RETURN(o.deadlines.poll_ms, GetNonNegativeInt(d, "poll", p, o.deadlines.poll_ms));
  }
  RC_ASSIGN_OR_RETURN(std::string policy, GetString(s, "drain_policy", "", std::string("wait")));
  auto dp = DrainPolicyFromName(policy);
  if (!dp) return InvalidArgument("drain_policy: '" + policy + "' (expected wait|abort|cancel)");
  o.drain_policy = *dp;
  RC_ASSIGN_OR_RETURN(std::string pm, GetString(s, "pause_mode", "", std::string("wait")));
  if (pm == "wait") o.pause_mode = PauseMode::kWait;
  else if (pm == "abort") o.pause_mode = PauseMode::kAbort;
  else if (pm == "keep") o.pause_mode = PauseMode::kKeep;
  else return InvalidArgument("pause_mode: '" + pm + "' (expected wait|abort|keep)");
  RC_ASSIGN_OR_RETURN(int64_t attempts, GetNonNegativeInt(s, "max_reset_attempts", "", 3));
  o.max_reset_attempts = static_cast<int>(std::max<int64_t>(attempts, 1));
  RC_ASSIGN_OR_RETURN(o.prefetch, GetBool(s, "prefetch", "", true));
  return o;
}

// Does [a0, a1] intersect [b0, b1) (b1 = -1: open-ended)?
bool Overlaps(int64_t a0, int64_t a1, int64_t b0, int64_t b1) {
  int64_t b_end = b1 < 0 ? INT64_MAX : b1;
  return a0 < b_end && b0 <= a1;
}

struct ParsedScenario {
  std::string initial_label;
  std::string initial_digest;
  RunnerOptions options;
  ScriptedEngineConfig engine_config;
  std::vector<SimEvent> events;
  std::string journal_spec;
};

Result<ParsedScenario> ParseScenario(const Json& scenario) {
  ParsedScenario p;
  RC_RETURN_IF_ERROR(CheckKnownKeys(scenario,
                                    {"initial", "deadlines_ms", "drain_policy", "pause_mode", "max_reset_attempts",
                                     "prefetch", "journal", "engine", "events", "comment", "expect"},
                                    ""));
  RC_ASSIGN_OR_RETURN(const Json* initial, GetObject(scenario, "initial", ""));
  RC_RETURN_IF_ERROR(CheckKnownKeys(*initial, {"label", "digest", "step", "checkpoint", "run"}, "initial"));
  RC_ASSIGN_OR_RETURN(p.initial_label, GetString(*initial, "label", "initial"));
  RC_ASSIGN_OR_RETURN(p.initial_digest, GetString(*initial, "digest", "initial", std::string()));
  RC_ASSIGN_OR_RETURN(p.options, ParseRunnerOptions(scenario));
  RC_ASSIGN_OR_RETURN(p.engine_config, ParseScriptedEngineConfig(scenario.value("engine", Json()), "engine"));
  p.engine_config.label = p.initial_label;
  p.engine_config.digest = p.initial_digest;
  RC_ASSIGN_OR_RETURN(p.events, ParseEvents(scenario));
  RC_ASSIGN_OR_RETURN(p.journal_spec, GetString(scenario, "journal", "", std::string("memory")));
  // Virtual time is stepped 1 ms at a time: keep every time in the scenario within the horizon.
  auto check = [](int64_t v, const std::string& what) -> Status {
    if (v > kMaxScenarioMs) {
      return InvalidArgument(what + ": " + std::to_string(v) + " ms is beyond the simulator's horizon of " +
                             std::to_string(kMaxScenarioMs) + " ms");
    }
    return OkStatus();
  };
  for (const auto& e : p.events) {
    RC_RETURN_IF_ERROR(check(e.at_ms, "events[" + std::to_string(e.index) + "].at_ms"));
    RC_RETURN_IF_ERROR(check(e.duration_ms, "events[" + std::to_string(e.index) + "].duration_ms"));
  }
  for (const auto& [op, list] : p.engine_config.ops) {
    for (const auto& sc : list) RC_RETURN_IF_ERROR(check(sc.latency_ms, "engine.ops." + op + ".latency_ms"));
  }
  const Deadlines& d = p.options.deadlines;
  for (int64_t v : {d.drain_ms, d.stage_ms, d.pause_ms, d.install_ms, d.reset_ms, d.validate_ms, d.resume_ms, d.poll_ms}) {
    RC_RETURN_IF_ERROR(check(v, "deadlines_ms"));
  }
  return p;
}

// The scenario's journal: "memory" or "sqlite:PATH".
Result<std::unique_ptr<Journal>> OpenScenarioJournal(const std::string& journal_spec) {
  std::unique_ptr<Journal> journal;
  if (journal_spec == "memory") {
    journal = std::make_unique<MemoryJournal>();
  } else if (journal_spec.rfind("sqlite:", 0) == 0) {
    RC_ASSIGN_OR_RETURN(journal, SqliteJournal::Open(journal_spec.substr(7)));
  } else {
    return InvalidArgument("journal: '" + journal_spec + "' (expected memory or sqlite:PATH)");
  }
  return journal;
}

// One run of a parsed scenario in virtual time, 1 ms a step: the clock, the journal, the scripted
// engine, the controller and its runner (both opened again at a crash_controller event), and what
// the report is made of.
class Simulation {
 public:
  Simulation(const ParsedScenario& parsed, std::unique_ptr<Journal> journal)
      : parsed_(parsed), journal_(std::move(journal)), engine_(&clock_, parsed.engine_config) {}

  // Opens the controller on the journal (which must be fresh), initializes it to the initial
  // version and starts its runner.
  Status Start();
  // Steps time until every event ran and the work they made is done, or kMaxTailMs after the
  // last event.
  Status Run();
  // The report (final state, journal, rollouts, updates, restarts, counters, mutation windows,
  // notes, end time) and the invariant checks.
  Result<Json> Report();

 private:
  void FlushNotes() {
    for (const auto& n : runner_->notes()) notes_.push_back(n);
  }
  // The engine completes due calls and finishes generation; finished rollouts are reported.
  void FinishRollouts();
  Status Apply(const SimEvent& ev);
  Status CrashController();
  // Starts the next queued operation when the runner is free and the state allows it.
  void StartQueued();
  // Nothing left to run: the runner is idle, the queue is empty (or stuck behind a tainted
  // engine) and no admitted rollout is still generating.
  bool Idle() const;
  Json Rollouts();  // also records the rollouts the engine aborted
  Json Checks() const;

  const ParsedScenario& parsed_;
  ManualClock clock_{0};
  std::unique_ptr<Journal> journal_;
  ScriptedEngine engine_;
  std::unique_ptr<Controller> controller_;
  std::unique_ptr<Runner> runner_;
  std::map<std::string, RolloutRow> rows_;
  std::vector<std::string> row_order_;
  std::deque<SimEvent> queued_;  // updates / recoveries waiting for the runner
  Json restarts_ = Json::array();
  Json notes_ = Json::array();
  int64_t t_ = 0;
};

Status Simulation::Start() {
  RC_ASSIGN_OR_RETURN(controller_, Controller::Open(&clock_, journal_.get()));
  if (controller_->state() != State::kUninitialized) {
    return FailedPrecondition("journal '" + parsed_.journal_spec +
                              "' is not empty: a scenario starts from a fresh journal");
  }
  WeightIdentity initial_identity;
  initial_identity.content_digest = parsed_.initial_digest;
  RC_RETURN_IF_ERROR(controller_->Initialize(WeightVersion{parsed_.initial_label, 0}, initial_identity));
  runner_ = std::make_unique<Runner>(controller_.get(), &engine_, &clock_, parsed_.options);
  return OkStatus();
}

Status Simulation::Run() {
  const std::vector<SimEvent>& events = parsed_.events;
  const int64_t last_event_ms = events.empty() ? 0 : events.back().at_ms;
  size_t next_event = 0;
  for (;; ++t_) {
    clock_.Set(t_ * 1'000'000);
    FinishRollouts();
    while (next_event < events.size() && events[next_event].at_ms <= t_) {
      RC_RETURN_IF_ERROR(Apply(events[next_event++]));
    }
    StartQueued();
    runner_->Poll();

    bool events_done = next_event >= events.size();
    if (events_done && Idle()) break;
    if (t_ > last_event_ms + kMaxTailMs) {
      notes_.push_back("simulation stopped " + std::to_string(kMaxTailMs) + " ms after the last event with work pending");
      break;
    }
  }
  FlushNotes();
  for (const auto& ev : queued_) {
    notes_.push_back(ev.kind + " to " + ev.target.label + " never started (engine " +
                     std::string(StateName(controller_->state())) + ")");
  }
  return OkStatus();
}

void Simulation::FinishRollouts() {
  for (const auto& id : engine_.Tick()) {
    auto it = rows_.find(id);
    if (it == rows_.end()) continue;  // an external request
    Status s = controller_->Finish(id, Json{{"t_ms", t_}});
    if (s.ok()) it->second.finished_t_ms = t_;
    // NotFound: interrupted by a restart or aborted by the drain policy; already recorded.
  }
}

Status Simulation::Apply(const SimEvent& ev) {
  if (ev.kind == "admit") {
    if (!rows_.count(ev.id)) row_order_.push_back(ev.id);
    RolloutRow& row = rows_[ev.id];
    row.id = ev.id;
    auto b = controller_->Admit(ev.id);
    if (b.ok()) {
      row.admitted = true;
      row.label = b->version.label;
      row.generation = b->version.generation;
      row.admitted_t_ms = t_;
      engine_.StartRequest(ev.id, ev.duration_ms);
    } else {
      row.admitted = false;
      row.refused_reason = b.status().message();
    }
  } else if (ev.kind == "external_request") {
    engine_.StartRequest(ev.id, ev.duration_ms);
  } else if (ev.kind == "update" || ev.kind == "recover") {
    queued_.push_back(ev);
  } else if (ev.kind == "crash_controller") {
    RC_RETURN_IF_ERROR(CrashController());
  }
  return OkStatus();
}

// The controller and its runner are dropped and opened again from the journal, as after a crash.
Status Simulation::CrashController() {
  FlushNotes();
  runner_.reset();
  controller_.reset();
  RestoreSummary summary;
  RC_ASSIGN_OR_RETURN(controller_, Controller::Open(&clock_, journal_.get(), &summary));
  runner_ = std::make_unique<Runner>(controller_.get(), &engine_, &clock_, parsed_.options);
  for (const auto& id : summary.interrupted) {
    if (rows_.count(id)) rows_[id].interrupted = true;
  }
  restarts_.push_back(Json{{"t_ms", t_},
                           {"state_at_crash", StateName(summary.state_at_crash)},
                           {"state_now", StateName(summary.state_now)},
                           {"interrupted", summary.interrupted}});
  if (summary.state_now == State::kReady && summary.engine_may_be_paused) {
    runner_->ResumeBestEffort("controller restarted while the engine may have been paused");
  }
  return OkStatus();
}

void Simulation::StartQueued() {
  if (runner_->busy() || queued_.empty()) return;
  const SimEvent& ev = queued_.front();
  State st = controller_->state();
  if (ev.kind == "update" && st == State::kReady) {
    auto r = runner_->StartUpdate(ev.target);
    if (!r.ok()) notes_.push_back("t=" + std::to_string(t_) + "ms update " + ev.target.label + " not started: " + r.status().ToString());
    queued_.pop_front();
  } else if (ev.kind == "recover" && st == State::kTainted && controller_->active_count() == 0) {
    auto r = runner_->StartRecovery(ev.target);
    if (!r.ok()) notes_.push_back("t=" + std::to_string(t_) + "ms recovery " + ev.target.label + " not started: " + r.status().ToString());
    queued_.pop_front();
  } else if (ev.kind == "recover" && st == State::kReady) {
    notes_.push_back("t=" + std::to_string(t_) + "ms recovery to " + ev.target.label + " skipped: engine is READY");
    queued_.pop_front();
  }
}

bool Simulation::Idle() const {
  bool engine_idle = true;
  for (const auto& [id, row] : rows_) {
    if (row.admitted && engine_.running(id)) engine_idle = false;
  }
  bool queue_stuck = !queued_.empty() && controller_->state() == State::kTainted && queued_.front().kind == "update";
  return !runner_->busy() && (queued_.empty() || queue_stuck) && engine_idle;
}

Result<Json> Simulation::Report() {
  Json report;
  auto v = controller_->version();
  report["final"] = Json{{"state", StateName(controller_->state())},
                         {"label", v.label},
                         {"generation", v.generation},
                         {"content_digest", controller_->identity().content_digest},
                         {"engine_label", engine_.label()},
                         {"engine_digest", engine_.digest()},
                         {"engine_paused", engine_.paused()}};
  RC_ASSIGN_OR_RETURN(auto records, journal_->ReadAll());
  Json jr = Json::array();
  for (const auto& r : records) jr.push_back(ToJson(r));
  report["journal"] = jr;
  report["rollouts"] = Rollouts();

  Json updates = Json::array();
  for (const auto& u : controller_->Updates()) updates.push_back(ToJson(u));
  report["updates"] = updates;
  report["restarts"] = restarts_;
  report["counters"] = ToJson(controller_->counters());
  Json windows = Json::array();
  for (const auto& [s, e] : engine_.mutation_windows()) windows.push_back(Json::array({s, e < 0 ? Json() : Json(e)}));
  report["mutation_windows"] = windows;
  report["notes"] = notes_;
  report["end_t_ms"] = t_;
  report["checks"] = Checks();
  return report;
}

Json Simulation::Rollouts() {
  Json rollouts = Json::array();
  for (const auto& id : row_order_) {
    RolloutRow& row = rows_[id];
    if (engine_.aborted().count(id)) row.aborted = true;
    Json r{{"id", row.id},
           {"admitted", row.admitted},
           {"refused_reason", row.refused_reason.empty() ? Json() : Json(row.refused_reason)},
           {"label", row.admitted ? Json(row.label) : Json()},
           {"generation", row.admitted ? Json(row.generation) : Json()},
           {"admitted_t_ms", row.admitted ? Json(row.admitted_t_ms) : Json()},
           {"finished_t_ms", row.finished_t_ms >= 0 ? Json(row.finished_t_ms) : Json()},
           {"interrupted", row.interrupted},
           {"aborted", row.aborted}};
    rollouts.push_back(r);
  }
  return rollouts;
}

// Invariant checks, computed from what the engine saw.
Json Simulation::Checks() const {
  bool no_span = true;
  bool accounted = true;
  Json violations = Json::array();
  for (const auto& id : row_order_) {
    const RolloutRow& row = rows_.at(id);
    if (!row.admitted) continue;
    int64_t end = row.finished_t_ms >= 0 ? row.finished_t_ms : t_;
    for (const auto& [s, e] : engine_.mutation_windows()) {
      if (Overlaps(row.admitted_t_ms, end, s, e) && !row.interrupted && !row.aborted) {
        no_span = false;
        violations.push_back("rollout " + id + " was live during a weight mutation at t=" + std::to_string(s));
      }
    }
    if (row.finished_t_ms < 0 && !row.interrupted && !row.aborted) {
      accounted = false;
      violations.push_back("rollout " + id + " is neither finished nor recorded interrupted/aborted");
    }
  }
  bool committed_verified = true;
  for (const auto& u : controller_->Updates()) {
    if (u.outcome == UpdateOutcome::kCommitted && !u.target.identity.content_digest.empty() &&
        engine_.digest() != u.target.identity.content_digest && u.ordinal == controller_->Updates().back().ordinal &&
        controller_->state() == State::kReady) {
      committed_verified = false;
      violations.push_back("update " + std::to_string(u.ordinal) + " committed but the engine holds digest " +
                           engine_.digest());
    }
  }
  return Json{{"no_binding_spans_mutation", no_span},
              {"every_admitted_rollout_accounted", accounted},
              {"committed_version_is_live", committed_verified},
              {"violations", violations}};
}

}  // namespace

Status ValidateScenario(const Json& scenario) { return ParseScenario(scenario).status(); }

Result<Json> RunScenario(const Json& scenario) {
  RC_ASSIGN_OR_RETURN(ParsedScenario parsed, ParseScenario(scenario));
  RC_ASSIGN_OR_RETURN(std::unique_ptr<Journal> journal, OpenScenarioJournal(parsed.journal_spec));
  Simulation sim(parsed, std::move(journal));
  RC_RETURN_IF_ERROR(sim.Start());
  RC_RETURN_IF_ERROR(sim.Run());
  return sim.Report();
}

Status MatchExpected(const Json& actual, const Json& expected, const std::string& path) {
  auto mismatch = [&](const std::string& what) {
    return InvalidArgument(path + ": " + what + " (actual: " + actual.dump() + ")");
  };
  bool all_ops = expected.is_object() && !expected.empty();
  for (auto it = expected.begin(); all_ops && it != expected.end(); ++it) all_ops = it.key().rfind('$', 0) == 0;
  if (all_ops && expected.size() > 1) {
    for (auto it = expected.begin(); it != expected.end(); ++it) {
      RC_RETURN_IF_ERROR(MatchExpected(actual, Json{{it.key(), it.value()}}, path));
    }
    return OkStatus();
  }
  if (all_ops) {
    const std::string& op = expected.begin().key();
    const Json& arg = expected.begin().value();
    if (op == "$le" || op == "$ge") {
      if (!actual.is_number() || !arg.is_number()) return mismatch("expected a number for " + op);
      double a = actual.get<double>(), b = arg.get<double>();
      if (op == "$le" ? a <= b : a >= b) return OkStatus();
      return mismatch("expected " + op + " " + arg.dump());
    }
    if (op == "$contains") {
      if (!actual.is_string() || !arg.is_string()) return mismatch("expected a string containing " + arg.dump());
      if (actual.get<std::string>().find(arg.get<std::string>()) != std::string::npos) return OkStatus();
      return mismatch("expected to contain " + arg.dump());
    }
    if (op == "$len") {
      if (!actual.is_array() || !arg.is_number_integer()) return mismatch("expected an array for $len");
      if (static_cast<int64_t>(actual.size()) == arg.get<int64_t>()) return OkStatus();
      return mismatch("expected length " + arg.dump());
    }
    if (op == "$any") {
      if (!actual.is_array()) return mismatch("expected an array for $any");
      for (size_t i = 0; i < actual.size(); ++i) {
        if (MatchExpected(actual[i], arg, path + "[" + std::to_string(i) + "]").ok()) return OkStatus();
      }
      return mismatch("no element matches " + arg.dump());
    }
    return InvalidArgument(path + ": unknown operator " + op);
  }
  if (expected.is_object()) {
    if (!actual.is_object()) return mismatch("expected an object");
    for (auto it = expected.begin(); it != expected.end(); ++it) {
      if (!actual.contains(it.key())) return InvalidArgument(path + "." + it.key() + ": missing in the report");
      RC_RETURN_IF_ERROR(MatchExpected(actual[it.key()], it.value(), path + "." + it.key()));
    }
    return OkStatus();
  }
  if (expected.is_array()) {
    if (!actual.is_array()) return mismatch("expected an array");
    if (actual.size() != expected.size()) {
      return mismatch("expected " + std::to_string(expected.size()) + " elements, got " + std::to_string(actual.size()));
    }
    for (size_t i = 0; i < expected.size(); ++i) {
      RC_RETURN_IF_ERROR(MatchExpected(actual[i], expected[i], path + "[" + std::to_string(i) + "]"));
    }
    return OkStatus();
  }
  if (expected.is_number() && actual.is_number()) {
    if (actual.get<double>() == expected.get<double>()) return OkStatus();
    return mismatch("expected " + expected.dump());
  }
  if (actual != expected) return mismatch("expected " + expected.dump());
  return OkStatus();
}

}  // namespace rc::lifecycle
