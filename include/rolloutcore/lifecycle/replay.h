// Replay validation (docs/lifecycle.md, "Replay validation"): in VALIDATING, with the engine
// still paused, the Runner has the engine replay each probe the trainer attached to the version
// (a prompt and the trainer's own greedy continuation with top-k log-probabilities) and compares
// the engine's numbers with the trainer's. The content digest proves the live bytes are the
// published bytes through the captured install mapping; the replay proves that mapping computes
// the trainer's model (a wrong fused-qkv split or a transposed shard passes the digest).
//
// Comparison rules (CompareReplay), per probe, step by step:
//  * the engine must produce as many steps as the trainer, and the same greedy token at every
//    step (a different token ends the comparison of that probe: later steps see another prefix),
//    except, when the engine asks for it (EngineDescription::replay_accepts_ties: vLLM's bf16
//    kernels round differently from the trainer's reference), a tie for first place: each side's
//    logprob of the other's token within the tolerance of its own choice and the two chosen
//    logprobs within it; the probe then ends there as matched, and the outcome counts it (`ties`);
//  * |engine logprob - trainer logprob| <= tolerance for the chosen token;
//  * every token in the trainer's top-k must be in the engine's top-k with its log-probability
//    within tolerance — except a token whose trainer log-probability is within tolerance of the
//    engine's k-th (a tie at the boundary may order differently).
// The worst absolute log-probability difference seen is the evidence.
//
// Tolerance: the engine proposes one for its dtype and kernels (EngineDescription::replay_tolerance;
// the embedded engine computes in f32: 1e-4); RunnerOptions::replay_tolerance >= 0 overrides it
// (`controller serve --replay-tolerance`).
//
// Thread safety: values and pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "rolloutcore/base/json.h"
#include "rolloutcore/base/status.h"

namespace rc::lifecycle {

// What the engine is asked to run: a greedy continuation of `steps` tokens after `prompt`,
// reporting the top_k alternatives of every step, under the live weights, while paused.
struct ReplayRequest {
  std::string probe;  // the probe's name (for messages)
  std::vector<int32_t> prompt;
  int32_t steps = 0;
  int32_t top_k = 0;
};
Json ToJson(const ReplayRequest& r);
[[nodiscard]] Result<ReplayRequest> ReplayRequestFromJson(const Json& j, int64_t max_steps, int64_t max_top_k);

struct ReplayStep {
  int32_t token = 0;
  float logprob = 0.f;
  std::vector<std::pair<int32_t, float>> top;  // best first
};

// The engine's answer.
struct ReplayEvidence {
  std::vector<ReplayStep> steps;
  double engine_ms = 0;  // time the engine spent on it, as it reports
  // Where the numbers were computed, as the engine reports: "live" (now, on the live weights, in
  // the pause) or "staged_image" (precomputed: before the pause, on the staged image that the
  // install swapped in, byte for byte the live weights; staged_ms is that pre-replay's time).
  bool precomputed = false;
  std::string computed_on = "live";
  double staged_ms = 0;
};
// {"steps": [{"token", "logprob", "top": [[id, lp], ...]}], "engine_ms", "precomputed",
// "computed_on", "staged_ms"} (the last three optional when parsed: an engine that does not send
// them computed live).
Json ToJson(const ReplayEvidence& e);
[[nodiscard]] Result<ReplayEvidence> ReplayEvidenceFromJson(const Json& j, std::string_view path);

// A probe of the version being validated, as the Runner holds it (converted from the directory's
// refit::Probe by the controller's version source).
struct ReplayProbe {
  std::string name;
  std::vector<int32_t> prompt;
  int32_t top_k = 0;
  std::vector<ReplayStep> expected;  // the trainer's continuation
  // The quantization the trainer computed it under ("" = the weights as published; refit/probes.h):
  // compared only with an engine serving the same (EngineDescription::quantization).
  std::string quantization = {};
  ReplayRequest Request() const;
};

// One probe compared.
struct ReplayComparison {
  bool match = true;
  std::string mismatch;  // "probe p0 step 3: engine token 17, trainer token 42 (...)"
  int64_t mismatch_step = -1;
  double worst_logprob_diff = 0;  // over every compared log-probability of the probe
  int64_t worst_step = -1;
  // The greedy paths parted at this step on a tie for first place (accept_ties only); the steps
  // before it were compared, none after. -1: no tie.
  int64_t diverged_on_tie_step = -1;
};
ReplayComparison CompareReplay(const ReplayProbe& probe, const ReplayEvidence& engine, double tolerance,
                               bool accept_ties = false);

// What the validation step established about the replay, journaled with the validation evidence.
struct ReplayOutcome {
  bool skipped = true;
  std::string skip_reason;  // "version has no probes", "engine ... offers no replay path"
  bool match = true;
  std::string mismatch;  // the first probe that differed, named with its step
  double tolerance = 0;
  double worst_logprob_diff = 0;
  std::string worst_probe;
  int64_t worst_step = -1;
  int64_t probes = 0;
  int64_t tokens = 0;    // steps replayed over all probes
  int64_t ties = 0;  // probes whose greedy paths parted on a tie for first place (accept_ties)
  double engine_ms = 0;  // summed over probes, as the engine reports
  // Probes whose numbers the engine computed before the pause on the staged image that became
  // live (ReplayEvidence::precomputed), and that pre-replay's time (the largest reported: one
  // batch covers every probe).
  int64_t precomputed = 0;
  double staged_ms = 0;
  int64_t wall_ms = 0;   // from the first replay call to the last answer, by the Runner's clock
};
Json ToJson(const ReplayOutcome& o);

}  // namespace rc::lifecycle
