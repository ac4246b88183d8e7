// Scheduler: plans one continuous-batching step of the embedded engine, without touching
// anything. Engine::Step asks it for a StepPlan over a read-only view of its queues and of the KV
// block pool, applies the plan (the only place a step mutates queues and blocks), runs the
// forward pass and applies its outputs. The same split as vLLM's schedule() /
// update_from_output() and llama.cpp's "plan a batch, then apply": because Schedule is a pure
// function of its inputs it is unit-tested without a model (scheduler_test.cc).
//
// The contract of Schedule (what Engine::Step did inline before; docs/engine.md "Step"):
//   1. Paused (PauseState::kPaused): nothing runs, nothing is admitted, nothing is released:
//      requests frozen by a keep pause hold their KV until resume.
//   2. Running requests, oldest first, each get min(tokens not yet computed, budget left)
//      positions of the max_num_batched_tokens budget: one token for a decode, the next chunk of
//      an unfinished prefill (so an older request's prefill is served before a younger one's).
//      They must get the blocks those positions need; when the pool cannot give them, the most
//      recently admitted running request is preempted (all its blocks released, its KV
//      recomputed later) and the running set is planned again, until it fits or none is left.
//   3. Admissions, FIFO, from the queue "preempted requests (in their running order), then the
//      waiting queue", while not draining (PauseState::kDraining: a wait pause in progress), the
//      budget is positive and fewer than max_num_seqs requests run. An admission takes blocks for
//      its whole sequence (cached prefix blocks are revived instead: at most tokens-1 positions
//      come from the cache, so one is always computed) and then min(uncomputed, budget) tokens of
//      the budget. When the head of the queue cannot get its blocks admission stops there
//      (head-of-line: a later, smaller request is not admitted past it).
// The plan's KvPlan holds, in apply order, the preempted requests' releases, one grant per
// remaining running request (in order) and one per admission (in order); KvCacheManager::Apply
// commits it. It is valid only against the pool state it was made on.
//
// Pause (PauseState): kUnpaused → Pause(kWait) → kDraining (running requests finish, none is
// admitted) → kPaused once none runs; Pause(kAbort) and Pause(kKeep) go to kPaused at once from
// any state (abort then finishes every running and waiting request with "abort"; keep leaves them
// frozen with their KV); Resume → kUnpaused. What an install does with frozen KV (InFlightKv) is
// the engine's, not a pause state: the scheduler never sees weights.
//
// Thread safety: Scheduler is immutable after construction; Schedule is const and reentrant. The
// caller must keep the pool and the request views unchanged while it runs and until the plan is
// applied (the engine holds its queue mutex).
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "rolloutcore/base/status.h"
#include "rolloutcore/engine/kv_cache.h"

namespace rc::engine {

enum class PauseMode { kAbort, kWait, kKeep };
Result<PauseMode> PauseModeFromName(std::string_view name);

enum class PauseState {
  kUnpaused,  // steps run, waiting requests are admitted
  kDraining,  // Pause(kWait) in progress: running requests continue, none is admitted
  kPaused,    // no step runs (Pause returned: nothing reads parameters until Resume)
};
std::string_view PauseStateName(PauseState s);  // unpaused | draining | paused

// The pause state machine, pure. PauseStateOnRequest: the state Pause(mode) moves to before it
// waits (kWait from kUnpaused or kDraining: kDraining; a kWait on a paused engine changes nothing;
// kAbort, kKeep: kPaused). PauseStateOnDrained: where a waiting Pause(kWait) ends once no request
// runs, another pause paused the engine, or a Resume unpaused it: kPaused, except after the Resume
// (kUnpaused stays: the Resume wins, as on vLLM). PauseAbortsRequests: whether Pause(mode)
// finishes the running and waiting requests with "abort" once no step is in flight.
PauseState PauseStateOnRequest(PauseState current, PauseMode mode);
inline PauseState PauseStateOnDrained(PauseState current) {
  return current == PauseState::kUnpaused ? PauseState::kUnpaused : PauseState::kPaused;
}
inline bool PauseWaitsForDrain(PauseState after_request) { return after_request == PauseState::kDraining; }
inline bool PauseAbortsRequests(PauseMode mode) { return mode == PauseMode::kAbort; }
// Whether a step could run anything: not paused, and a running request or (unless draining) a
// waiting one.
bool HasRunnableWork(PauseState state, int64_t num_running, int64_t num_waiting);

struct SchedulerConfig {
  int64_t max_num_seqs = 32;
  int64_t max_num_batched_tokens = 2048;
  int64_t block_size = 16;
};

// What the scheduler sees of one request. A waiting request holds no blocks and has nothing
// computed (the engine keeps it so: preemption releases everything).
struct SchedRequest {
  int64_t seq_id = 0;
  std::span<const int32_t> tokens;  // prompt followed by the tokens generated so far
  std::string_view cache_salt;
  int64_t num_computed = 0;          // positions with KV in `blocks` (running requests)
  std::span<const int32_t> blocks;   // blocks held (running requests)
};

struct StepPlan {
  // Running requests preempted, newest first: running[n-1], running[n-2], ... running[n-k].
  int64_t num_preempted = 0;
  // Tokens computed this step by each running request that was not preempted (in order; may be 0
  // when the budget ran out before it).
  std::vector<int64_t> running_tokens;
  // Admitted from the front of the queue "preempted requests in running order, then waiting":
  // queue[0..num_admitted), each computing admitted_tokens[i] tokens this step.
  int64_t num_admitted = 0;
  std::vector<int64_t> admitted_tokens;
  // Releases of the preempted, then grants: running_tokens.size() for the running requests, then
  // num_admitted for the admissions.
  KvPlan kv;
  // Tokens scheduled this step (<= max_num_batched_tokens).
  int64_t num_scheduled_tokens = 0;
};

class Scheduler {
 public:
  explicit Scheduler(SchedulerConfig config) : config_(config) {}
  const SchedulerConfig& config() const { return config_; }

  // Plans one step (the contract above). `running` in admission order (oldest first); `waiting`
  // the head of the waiting queue in FIFO order (the caller may pass only its first
  // max_num_seqs entries: no step admits more).
  StepPlan Schedule(PauseState state, std::span<const SchedRequest> running, std::span<const SchedRequest> waiting,
                    const KvCacheManager& kv) const;

 private:
  SchedulerConfig config_;
};

}  // namespace rc::engine
