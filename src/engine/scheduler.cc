#include "rolloutcore/engine/scheduler.h"

#include <algorithm>
#include <string>

namespace rc::engine {

Result<PauseMode> PauseModeFromName(std::string_view name) {
  if (name == "abort") return PauseMode::kAbort;
  if (name == "wait") return PauseMode::kWait;
  if (name == "keep") return PauseMode::kKeep;
  return InvalidArgument("mode: expected one of abort, wait, keep; got '" + std::string(name) + "'");
}

std::string_view PauseStateName(PauseState s) {
  switch (s) {
    case PauseState::kUnpaused: return "unpaused";
    case PauseState::kDraining: return "draining";
    case PauseState::kPaused: return "paused";
  }
  return "unknown";
}

PauseState PauseStateOnRequest(PauseState current, PauseMode mode) {
  if (mode != PauseMode::kWait) return PauseState::kPaused;
  return current == PauseState::kPaused ? PauseState::kPaused : PauseState::kDraining;
}

bool HasRunnableWork(PauseState state, int64_t num_running, int64_t num_waiting) {
  if (state == PauseState::kPaused) return false;
  return num_running > 0 || (state != PauseState::kDraining && num_waiting > 0);
}

StepPlan Scheduler::Schedule(PauseState state, std::span<const SchedRequest> running,
                             std::span<const SchedRequest> waiting, const KvCacheManager& kv) const {
  StepPlan out;
  if (state == PauseState::kPaused) return out;
  const int64_t budget0 = config_.max_num_batched_tokens;
  int64_t budget = budget0;

  // 1. Running requests, oldest first; preempt the newest while their blocks do not fit.
  size_t kept = running.size();
  for (;;) {
    KvPlan plan;
    for (size_t v = kept; v < running.size(); ++v) kv.PlanRelease(running[v].blocks, &plan);
    std::vector<int64_t> tokens;
    tokens.reserve(kept);
    bool ok = true;
    int64_t b = budget0;
    for (size_t i = 0; i < kept; ++i) {
      const SchedRequest& s = running[i];
      const int64_t remaining = static_cast<int64_t>(s.tokens.size()) - s.num_computed;
      const int64_t step = std::max<int64_t>(0, std::min(remaining, b));
      b -= step;
      KvDemand d;
      d.seq_id = s.seq_id;
      d.held_blocks = static_cast<int64_t>(s.blocks.size());
      d.need_tokens = s.num_computed + step;
      if (!kv.PlanDemand(d, &plan)) {
        ok = false;
        break;
      }
      tokens.push_back(step);
    }
    if (ok) {
      out.kv = std::move(plan);
      out.running_tokens = std::move(tokens);
      budget = b;
      break;
    }
    // Preempt the most recently admitted one and plan again (with none left the plan is only
    // the releases, and fits).
    --kept;
  }
  out.num_preempted = static_cast<int64_t>(running.size() - kept);

  // 2. Admissions, FIFO over "preempted (in running order), then waiting".
  const size_t queue_len = (running.size() - kept) + waiting.size();
  auto queued = [&](size_t q) -> SchedRequest {
    if (q < running.size() - kept) {
      SchedRequest s = running[kept + q];
      s.num_computed = 0;  // preempted: its KV is released
      s.blocks = {};
      return s;
    }
    return waiting[q - (running.size() - kept)];
  };
  int64_t num_running = static_cast<int64_t>(kept);
  for (size_t q = 0; state != PauseState::kDraining && q < queue_len && budget > 0 &&
                     num_running < config_.max_num_seqs;
       ++q) {
    const SchedRequest s = queued(q);
    KvDemand d;
    d.seq_id = s.seq_id;
    d.match_prefix = true;
    d.prefix_tokens = s.tokens.first(s.tokens.size() - 1);
    d.cache_salt = s.cache_salt;
    d.need_tokens = static_cast<int64_t>(s.tokens.size());
    if (!kv.PlanDemand(d, &out.kv)) break;  // head of line: wait for blocks to free up
    const int64_t computed = static_cast<int64_t>(out.kv.grants.back().hit_blocks.size()) * config_.block_size;
    const int64_t step = std::min(static_cast<int64_t>(s.tokens.size()) - computed, budget);
    budget -= step;
    out.admitted_tokens.push_back(step);
    ++out.num_admitted;
    ++num_running;
  }
  out.num_scheduled_tokens = budget0 - budget;
  return out;
}

}  // namespace rc::engine
