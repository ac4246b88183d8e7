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

}  // namespace

Status ValidateScenario(const Json& scenario) { return ParseScenario(scenario).status(); }

Result<Json> RunScenario(const Json& scenario) {
  RC_ASSIGN_OR_RETURN(ParsedScenario parsed, ParseScenario(scenario));
  const std::string& initial_label = parsed.initial_label;
  const std::string& initial_digest = parsed.initial_digest;
  const RunnerOptions& options = parsed.options;
  const ScriptedEngineConfig& engine_config = parsed.engine_config;
  const std::vector<SimEvent>& events = parsed.events;
  const std::string& journal_spec = parsed.journal_spec;

  ManualClock clock(0);
  std::unique_ptr<Journal> journal;
  if (journal_spec == "memory") {
    journal = std::make_unique<MemoryJournal>();
  } else if (journal_spec.rfind("sqlite:", 0) == 0) {
    RC_ASSIGN_OR_RETURN(journal, SqliteJournal::Open(journal_spec.substr(7)));
  } else {
    return InvalidArgument("journal: '" + journal_spec + "' (expected memory or sqlite:PATH)");
  }

  ScriptedEngine engine(&clock, engine_config);
  std::unique_ptr<Controller> controller;
  std::unique_ptr<Runner> runner;
  RC_ASSIGN_OR_RETURN(controller, Controller::Open(&clock, journal.get()));
  if (controller->state() != State::kUninitialized) {
    return FailedPrecondition("journal '" + journal_spec + "' is not empty: a scenario starts from a fresh journal");
  }
  WeightIdentity initial_identity;
  initial_identity.content_digest = initial_digest;
  RC_RETURN_IF_ERROR(controller->Initialize(WeightVersion{initial_label, 0}, initial_identity));
  runner = std::make_unique<Runner>(controller.get(), &engine, &clock, options);

  std::map<std::string, RolloutRow> rows;
  std::vector<std::string> row_order;
  std::deque<SimEvent> queued;  // updates / recoveries waiting for the runner
  Json restarts = Json::array();
  Json notes = Json::array();
  const int64_t last_event_ms = events.empty() ? 0 : events.back().at_ms;
  size_t next_event = 0;
  int64_t t = 0;

  auto flush_notes = [&]() {
    for (const auto& n : runner->notes()) notes.push_back(n);
  };

  for (;; ++t) {
    clock.Set(t * 1'000'000);
    // The engine completes due calls and finishes generation; finished rollouts are reported.
    for (const auto& id : engine.Tick()) {
      auto it = rows.find(id);
      if (it == rows.end()) continue;  // an external request
      Status s = controller->Finish(id, Json{{"t_ms", t}});
      if (s.ok()) it->second.finished_t_ms = t;
      // NotFound: interrupted by a restart or aborted by the drain policy; already recorded.
    }
    while (next_event < events.size() && events[next_event].at_ms <= t) {
      const SimEvent& ev = events[next_event++];
      if (ev.kind == "admit") {
        if (!rows.count(ev.id)) row_order.push_back(ev.id);
        RolloutRow& row = rows[ev.id];
        row.id = ev.id;
        auto b = controller->Admit(ev.id);
        if (b.ok()) {
          row.admitted = true;
          row.label = b->version.label;
          row.generation = b->version.generation;
          row.admitted_t_ms = t;
          engine.StartRequest(ev.id, ev.duration_ms);
        } else {
          row.admitted = false;
          row.refused_reason = b.status().message();
        }
      } else if (ev.kind == "external_request") {
        engine.StartRequest(ev.id, ev.duration_ms);
      } else if (ev.kind == "update" || ev.kind == "recover") {
        queued.push_back(ev);
      } else if (ev.kind == "crash_controller") {
        flush_notes();
        runner.reset();
        controller.reset();
        RestoreSummary summary;
        RC_ASSIGN_OR_RETURN(controller, Controller::Open(&clock, journal.get(), &summary));
        runner = std::make_unique<Runner>(controller.get(), &engine, &clock, options);
        for (const auto& id : summary.interrupted) {
          if (rows.count(id)) rows[id].interrupted = true;
        }
        restarts.push_back(Json{{"t_ms", t},
                                {"state_at_crash", StateName(summary.state_at_crash)},
                                {"state_now", StateName(summary.state_now)},
                                {"interrupted", summary.interrupted}});
        if (summary.state_now == State::kReady && summary.engine_may_be_paused) {
          runner->ResumeBestEffort("controller restarted while the engine may have been paused");
        }
      }
    }
    // Start the next queued operation when the runner is free and the state allows it.
    if (!runner->busy() && !queued.empty()) {
      const SimEvent& ev = queued.front();
      State st = controller->state();
      if (ev.kind == "update" && st == State::kReady) {
        auto r = runner->StartUpdate(ev.target);
        if (!r.ok()) notes.push_back("t=" + std::to_string(t) + "ms update " + ev.target.label + " not started: " + r.status().ToString());
        queued.pop_front();
      } else if (ev.kind == "recover" && st == State::kTainted && controller->active_count() == 0) {
        auto r = runner->StartRecovery(ev.target);
        if (!r.ok()) notes.push_back("t=" + std::to_string(t) + "ms recovery " + ev.target.label + " not started: " + r.status().ToString());
        queued.pop_front();
      } else if (ev.kind == "recover" && st == State::kReady) {
        notes.push_back("t=" + std::to_string(t) + "ms recovery to " + ev.target.label + " skipped: engine is READY");
        queued.pop_front();
      }
    }
    runner->Poll();

    bool events_done = next_event >= events.size();
    bool engine_idle = true;
    for (const auto& [id, row] : rows) {
      if (row.admitted && engine.running(id)) engine_idle = false;
    }
    bool queue_stuck = !queued.empty() && controller->state() == State::kTainted && queued.front().kind == "update";
    if (events_done && !runner->busy() && (queued.empty() || queue_stuck) && engine_idle) break;
    if (t > last_event_ms + kMaxTailMs) {
      notes.push_back("simulation stopped " + std::to_string(kMaxTailMs) + " ms after the last event with work pending");
      break;
    }
  }
  flush_notes();
  for (const auto& ev : queued) {
    notes.push_back(ev.kind + " to " + ev.target.label + " never started (engine " +
                    std::string(StateName(controller->state())) + ")");
  }

  // ---- Report ----
  Json report;
  auto v = controller->version();
  report["final"] = Json{{"state", StateName(controller->state())},
                         {"label", v.label},
                         {"generation", v.generation},
                         {"content_digest", controller->identity().content_digest},
                         {"engine_label", engine.label()},
                         {"engine_digest", engine.digest()},
                         {"engine_paused", engine.paused()}};
  RC_ASSIGN_OR_RETURN(auto records, journal->ReadAll());
  Json jr = Json::array();
  for (const auto& r : records) jr.push_back(ToJson(r));
  report["journal"] = jr;

  Json rollouts = Json::array();
  for (const auto& id : row_order) {
    RolloutRow& row = rows[id];
    if (engine.aborted().count(id)) row.aborted = true;
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
  report["rollouts"] = rollouts;

  Json updates = Json::array();
  for (const auto& u : controller->Updates()) updates.push_back(ToJson(u));
  report["updates"] = updates;
  report["restarts"] = restarts;
  report["counters"] = ToJson(controller->counters());
  Json windows = Json::array();
  for (const auto& [s, e] : engine.mutation_windows()) windows.push_back(Json::array({s, e < 0 ? Json() : Json(e)}));
  report["mutation_windows"] = windows;
  report["notes"] = notes;
  report["end_t_ms"] = t;

  // ---- Invariant checks, computed from what the engine saw ----
  bool no_span = true;
  bool accounted = true;
  Json violations = Json::array();
  for (const auto& id : row_order) {
    const RolloutRow& row = rows[id];
    if (!row.admitted) continue;
    int64_t end = row.finished_t_ms >= 0 ? row.finished_t_ms : t;
    for (const auto& [s, e] : engine.mutation_windows()) {
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
  for (const auto& u : controller->Updates()) {
    if (u.outcome == UpdateOutcome::kCommitted && !u.target.identity.content_digest.empty() &&
        engine.digest() != u.target.identity.content_digest && u.ordinal == controller->Updates().back().ordinal &&
        controller->state() == State::kReady) {
      committed_verified = false;
      violations.push_back("update " + std::to_string(u.ordinal) + " committed but the engine holds digest " +
                           engine.digest());
    }
  }
  report["checks"] = Json{{"no_binding_spans_mutation", no_span},
                          {"every_admitted_rollout_accounted", accounted},
                          {"committed_version_is_live", committed_verified},
                          {"violations", violations}};
  return report;
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
