// The lifecycle simulator: runs the real Controller and Runner against a ScriptedEngine in
// virtual time (1 ms steps of a ManualClock) and reports what happened. It backs
// `rolloutcore simulate SCENARIO.json` and the example-scenario tests.
//
// Scenario (JSON):
//   {"initial": {"label", "digest"}, "deadlines_ms": {drain, stage, pause, install, reset,
//    validate, resume, poll}, "drain_policy": "wait|abort|cancel", "pause_mode": "wait|abort|keep",
//    "max_reset_attempts": N, "journal": "memory" | "sqlite:PATH",
//    "engine": {"ops": {...}, "offers_digest": bool, "caches": [...]}   (see scripted_engine.h),
//    "events": [{"at_ms": T, <one of>}]}
//   events: "admit": ID + "duration_ms"; "update": {label, digest, step, checkpoint, run};
//   "recover": {label, digest, ...}; "crash_controller": true; "external_request": ID +
//   "duration_ms" (a request sent to the engine by someone other than the controller).
//   Updates and recoveries queue until the previous operation has ended.
//
// Report (JSON): {"final": {state, label, generation}, "journal": [...], "rollouts": [{id,
//   admitted, refused_reason, label, generation, finished_t_ms, interrupted, aborted}],
//   "updates": [{ordinal, target, outcome, reason, phases_ms, ...}], "restarts": [...],
//   "mutation_windows": [[start, end]], "checks": {...}, "notes": [...], "end_t_ms"}.
//
// Thread safety: RunScenario is reentrant; it uses no global state.
#pragma once

#include <string>

#include "rolloutcore/base/json.h"
#include "rolloutcore/base/status.h"

namespace rc::lifecycle {

Result<Json> RunScenario(const Json& scenario);
// Parses and checks a scenario without running it (every time it names must be ≤ 1 hour).
Status ValidateScenario(const Json& scenario);

// Checks that `actual` contains `expected`: objects key by key (extra actual keys are fine),
// arrays element by element with equal length, scalars equal. Operators inside expected:
// {"$le": N}, {"$ge": N}, {"$contains": "text"}, {"$len": N}, {"$any": X} (some element of an
// array matches X). Returns InvalidArgument naming the first mismatching path.
Status MatchExpected(const Json& actual, const Json& expected, const std::string& path = "$");

}  // namespace rc::lifecycle
