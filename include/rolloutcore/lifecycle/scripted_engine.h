// ScriptedEngine: an EngineAdapter whose behaviour is scripted per operation, running in the
// virtual time of a ManualClock. It is the engine of `rolloutcore simulate` and of the
// lifecycle tests: a real adapter implementation (every call returns a Pending that completes
// at call time + latency, or never for "hang"), with a tiny engine model behind it (label,
// content digest, paused flag, running requests, the windows in which weights were mutated).
//
// Scripts: per op name, a list of {latency_ms, behavior, on_update} — `on_update` is the
// 1-based update ordinal the script applies to (0: every update). Ops and behaviours:
//   install:  ok | hang | fail_before_mutation | fail_after_mutation | wrong_digest
//   reset_prefix_cache / reset_encoder_cache / reset_mm_cache: ok | refuse | hang | fail
//   report_label: ok | stale | hang | fail      content_digest: ok | wrong | hang | fail
//   pause / resume / stage / drain_status / abort / identity: ok | hang | fail
// Ops not listed behave "ok" with no latency.
//
// Thread safety: not thread-safe; one thread calls the adapter methods and Tick().
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "rolloutcore/base/clock.h"
#include "rolloutcore/lifecycle/engine_adapter.h"

namespace rc::lifecycle {

struct OpScript {
  int64_t latency_ms = 0;
  std::string behavior = "ok";
  int64_t on_update = 0;  // 0 = every update
};

struct ScriptedEngineConfig {
  std::string label = "default";
  std::string digest;
  bool offers_content_digest = true;
  std::vector<CacheKind> caches = {CacheKind::kPrefix, CacheKind::kEncoder, CacheKind::kMultimodal};
  std::map<std::string, std::vector<OpScript>> ops;
};

// Parses the "engine" object of a scenario: {"ops": {NAME: {..} | [{..}, ..]},
// "offers_digest": bool, "caches": ["prefix", ...]}. Unknown op names and behaviours are errors.
Result<ScriptedEngineConfig> ParseScriptedEngineConfig(const Json& j, std::string_view path);

class ScriptedEngine final : public EngineAdapter {
 public:
  ScriptedEngine(const Clock* clock, ScriptedEngineConfig config);

  // ---- EngineAdapter ----
  Result<EngineDescription> Describe() override;
  Pending<DrainStatus> GetDrainStatus() override;
  Pending<PauseEvidence> Pause(PauseMode mode) override;
  Pending<AbortEvidence> AbortRequests(const std::vector<std::string>& rollout_ids) override;
  Pending<StageEvidence> Stage(const UpdateTarget& target) override;
  Pending<InstallEvidence> Install(const UpdateTarget& target, bool full) override;
  Pending<CacheResetResult> ResetCache(CacheKind kind) override;
  Pending<LabelEvidence> ReadLabel() override;
  Pending<DigestEvidence> ReadContentDigest() override;
  Pending<ResumeEvidence> Resume() override;
  // Boot id "boot-<restarts>", the label, installs begun so far, and the digest.
  Pending<IdentityEvidence> ProbeIdentity() override;

  // ---- The simulated engine ----
  // Completes every call due by now; returns the requests that finished generating (ids).
  std::vector<std::string> Tick();
  // A request starts generating now and finishes after duration_ms (while not paused: a
  // paused engine freezes running requests until resume).
  void StartRequest(const std::string& id, int64_t duration_ms);
  bool running(const std::string& id) const { return running_.count(id) > 0; }
  // The engine process restarts: a new boot id, back on its starting label and digest, no
  // installs, not paused, running requests lost (recorded aborted).
  void Restart();
  const std::string& label() const { return label_; }
  const std::string& digest() const { return digest_; }
  bool paused() const { return paused_; }
  // The label of every Stage call, in call order.
  const std::vector<std::string>& stage_calls() const { return stage_calls_; }
  // [start, end) of every window in which live weights were being written; end = -1 when the
  // write never finished (a hung install).
  const std::vector<std::pair<int64_t, int64_t>>& mutation_windows() const { return mutations_; }
  // Requests aborted by a pause(abort) or abort_requests.
  const std::set<std::string>& aborted() const { return aborted_; }

 private:
  const OpScript& ScriptFor(const std::string& op) const;
  template <typename T>
  Pending<T> Schedule(const OpScript& script, std::function<Result<T>()> effect);

  const Clock* clock_;
  ScriptedEngineConfig config_;
  std::string label_;
  std::string digest_;
  std::string previous_label_;
  bool paused_ = false;
  int64_t install_generation_ = 0;
  int64_t boots_ = 0;
  int64_t current_update_ = 0;
  std::map<std::string, int64_t> running_;  // id → remaining ms of generation
  int64_t last_tick_ms_ = 0;
  std::set<std::string> aborted_;
  std::vector<std::string> stage_calls_;
  std::vector<std::pair<int64_t, int64_t>> mutations_;
  struct Due {
    int64_t at_ms;
    std::function<void()> complete;
  };
  std::vector<Due> due_;
};

}  // namespace rc::lifecycle
