// Engine::Replay: the engine's replay-validation path (engine.h, docs/engine.md). Kept in its
// own file: it shares nothing with the scheduler but the model, the KV pool and the locks.
#include <chrono>
#include <string>

#include "rolloutcore/base/mutex.h"
#include "engine/model.h"
#include "rolloutcore/engine/engine.h"

namespace rc::engine {

Result<ReplayOutput> Engine::Replay(const std::vector<int32_t>& prompt, int64_t steps, int64_t top_k) {
  const auto t0 = std::chrono::steady_clock::now();
  const ModelSpec& s = model_->spec();
  if (prompt.empty()) return InvalidArgument("prompt: must contain at least one token");
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= s.vocab_size) {
      return InvalidArgument("prompt[" + std::to_string(i) + "]: token id " + std::to_string(prompt[i]) +
                             " is outside the vocabulary [0, " + std::to_string(s.vocab_size) + ")");
    }
  }
  if (steps < 1 || steps > kMaxReplaySteps) {
    return InvalidArgument("steps: must be in 1.." + std::to_string(kMaxReplaySteps) + ", got " +
                           std::to_string(steps));
  }
  if (top_k < 0 || top_k > kMaxReplayTopK) {
    return InvalidArgument("top_k: must be in 0.." + std::to_string(kMaxReplayTopK) + ", got " + std::to_string(top_k));
  }
  const auto plen = static_cast<int64_t>(prompt.size());
  if (steps > max_model_len_ - plen) {
    return InvalidArgument("steps: prompt (" + std::to_string(plen) + " tokens) + steps (" + std::to_string(steps) +
                           ") exceeds max_model_len " + std::to_string(max_model_len_));
  }

  rc::MutexLock sl(step_mu_);  // no Step, install or reset runs meanwhile
  std::vector<int32_t> blocks;
  {
    rc::MutexLock l(mu_);
    if (pause_ != PauseState::kPaused) {
      return FailedPrecondition(
          "replay runs only while the engine is paused (POST /pause first): it must not "
          "interleave with user requests");
    }
    KvPlan plan;
    KvDemand d;
    d.seq_id = -1;  // not a sequence; never registered
    d.need_tokens = plen + steps;
    if (!kv_->PlanDemand(d, &plan)) {
      return Unavailable("replay needs " +
                         std::to_string((plen + steps + options_.block_size - 1) / options_.block_size) +
                         " KV blocks; " + std::to_string(kv_->NumFreeBlocks()) + " are free");
    }
    kv_->Apply(plan);
    blocks = plan.grants[0].new_blocks;
  }

  ReplayOutput out;
  std::vector<int32_t> tokens = prompt;
  SamplingParams greedy;
  greedy.temperature = 0.0;
  greedy.num_logprobs = top_k;
  SamplerRng rng(0);
  Status st;
  int64_t computed = 0;
  for (int64_t k = 0; k < steps; ++k) {
    ForwardSeq f;
    f.tokens = tokens.data() + computed;
    f.num_tokens = static_cast<int64_t>(tokens.size()) - computed;
    f.start_pos = computed;
    f.block_table = &blocks;
    f.want_logits = true;
    std::vector<float> logits;
    st = model_->Forward({f}, &logits);
    if (!st.ok()) break;
    computed = static_cast<int64_t>(tokens.size());
    SampleResult r = Sample(std::span<const float>(logits.data(), static_cast<size_t>(s.vocab_size)), greedy, &rng);
    tokens.push_back(r.token);
    out.steps.push_back(std::move(r));
  }
  {
    rc::MutexLock l(mu_);
    kv_->Release(blocks);  // unhashed: back to the free list, nothing enters the prefix cache
  }
  if (!st.ok()) return st.WithContext("replay forward");
  out.elapsed_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

}  // namespace rc::engine
