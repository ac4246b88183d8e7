// Engine::Replay and Engine::PreReplay: the engine's replay-validation paths (engine.h,
// docs/engine.md). Kept in their own file: they share nothing with the scheduler but the model,
// the KV pool and the locks.
#include <algorithm>
#include <chrono>
#include <functional>
#include <span>
#include <string>

#include "rolloutcore/base/mutex.h"
#include "engine/model.h"
#include "rolloutcore/engine/engine.h"

namespace rc::engine {
namespace {

double MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

Status CheckReplayArgs(const ModelSpec& s, int64_t max_model_len, const std::vector<int32_t>& prompt, int64_t steps,
                       int64_t top_k) {
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
  if (steps > max_model_len - plen) {
    return InvalidArgument("steps: prompt (" + std::to_string(plen) + " tokens) + steps (" + std::to_string(steps) +
                           ") exceeds max_model_len " + std::to_string(max_model_len));
  }
  return OkStatus();
}

SamplingParams GreedyWithTopK(int64_t top_k) {
  SamplingParams greedy;
  greedy.temperature = 0.0;
  greedy.num_logprobs = top_k;
  return greedy;
}

// Pre-replay probes run as one Forward per step (every probe still generating). Forward is
// batch-invariant (each row's kernels reduce in the same order whatever the batch), which
// replay_test.cc checks bit for bit against one-by-one live replays; set false to run them one
// by one if a kernel ever stops being so.
constexpr bool kPreReplayBatched = true;

// One pre-replay's probes as they run on the staged image: each probe's tokens, how many of them
// its KV blocks hold (computed), and its output so far. `why` says what stopped the run.
class PreReplayRun {
 public:
  PreReplayRun(Model* model, rc::Mutex* step_mu, rc::Turnstile* step_turnstile, ThreadPool* pool, const WeightBinding& binding,
               const std::vector<ReplayProbeRequest>& probes, const std::vector<std::vector<int32_t>>& blocks,
               std::chrono::steady_clock::time_point deadline, std::vector<float>* logits, PreReplayReport* rep)
      : model_(model),
        step_mu_(step_mu),
        step_turnstile_(step_turnstile),
        pool_(pool),
        binding_(binding),
        spec_(model->spec()),
        probes_(probes),
        blocks_(blocks),
        deadline_(deadline),
        logits_(logits),
        rep_(rep),
        n_(probes.size()),
        tokens_(n_),
        computed_(n_, 0),
        outs_(n_) {
    for (size_t i = 0; i < n_; ++i) tokens_[i] = probes_[i].prompt;
  }

  // Teacher forcing: prompt + the recorded continuation (all but its last token) in one forward
  // scores every step at once. Up to the first step whose greedy token differs from the hint the
  // rows are exactly the decode's (same prefix, same kernels); from there the probe decodes on.
  bool TeacherForce();
  // Decoding: one batch per step of every probe not done yet (probes without a hint from the
  // prompt, diverged ones from their divergence).
  bool Decode();

  std::vector<ReplayOutput>& outs() { return outs_; }
  const std::string& why() const { return why_; }

 private:
  // One forward: the probes in `who`, as one batch, each from its first uncomputed position,
  // with `logit_tokens[j]` logits rows for who[j]. step_mu is held for this forward only, so user
  // requests' steps run between ours. Samples every row (greedy, with the probe's top-k; rows in
  // parallel on the engine's pool, outside step_mu) and hands each probe's rows to `take` in order.
  bool Forward(const std::string& what, const std::vector<size_t>& who, const std::vector<int64_t>& logit_tokens,
               const std::function<void(size_t, SampleResult)>& take);
  bool PastDeadline(const std::string& at) {
    if (std::chrono::steady_clock::now() < deadline_) return false;
    why_ = "the stage's deadline passed " + at;
    return true;
  }

  Model* model_;  // touched only under step_mu_
  rc::Mutex* step_mu_;
  rc::Turnstile* step_turnstile_;
  ThreadPool* pool_;
  const WeightBinding& binding_;
  const ModelSpec& spec_;
  const std::vector<ReplayProbeRequest>& probes_;
  const std::vector<std::vector<int32_t>>& blocks_;
  const std::chrono::steady_clock::time_point deadline_;
  std::vector<float>* logits_;
  PreReplayReport* rep_;
  const size_t n_;
  std::vector<std::vector<int32_t>> tokens_;
  std::vector<int64_t> computed_;
  std::vector<ReplayOutput> outs_;
  std::string why_;
};

bool PreReplayRun::Forward(const std::string& what, const std::vector<size_t>& who,
                           const std::vector<int64_t>& logit_tokens,
                           const std::function<void(size_t, SampleResult)>& take) {
  std::vector<ForwardSeq> batch;
  for (size_t j = 0; j < who.size(); ++j) {
    const size_t i = who[j];
    ForwardSeq f;
    f.tokens = tokens_[i].data() + computed_[i];
    f.num_tokens = static_cast<int64_t>(tokens_[i].size()) - computed_[i];
    f.start_pos = computed_[i];
    f.block_table = &blocks_[i];
    f.want_logits = true;
    f.logit_tokens = logit_tokens[j];
    batch.push_back(f);
  }
  std::vector<float>& logits = *logits_;
  logits.clear();  // keeps its capacity
  Status st;
  {
    rc::PriorityLock sl(*step_mu_, *step_turnstile_);
    st = model_->Forward(binding_, batch, &logits);
  }
  ++rep_->forwards;
  if (!st.ok()) {
    why_ = what + ": " + std::string(st.message());
    return false;
  }
  // Row r belongs to probe row_probe[r]. Greedy sampling draws no random number (the rng is
  // never read at temperature 0), so every row is sampled on its own, in any order, with the
  // same result as one after the other.
  std::vector<size_t> row_probe;
  for (size_t j = 0; j < who.size(); ++j) row_probe.insert(row_probe.end(), static_cast<size_t>(logit_tokens[j]), who[j]);
  std::vector<SampleResult> sampled(row_probe.size());
  pool_->ParallelFor(static_cast<int64_t>(row_probe.size()), [&](int64_t r) {
    SamplerRng unused(0);
    sampled[static_cast<size_t>(r)] =
        Sample(std::span<const float>(logits.data() + static_cast<size_t>(r) * static_cast<size_t>(spec_.vocab_size),
                                      static_cast<size_t>(spec_.vocab_size)),
               GreedyWithTopK(probes_[row_probe[static_cast<size_t>(r)]].top_k), &unused);
  });
  for (size_t i : who) computed_[i] = static_cast<int64_t>(tokens_[i].size());
  for (size_t r = 0; r < row_probe.size(); ++r) take(row_probe[r], std::move(sampled[r]));
  return true;
}

bool PreReplayRun::TeacherForce() {
  const std::vector<ReplayProbeRequest>& probes = probes_;
  bool ok = true;
  std::vector<size_t> forced;
  for (size_t i = 0; i < n_; ++i) {
    const ReplayProbeRequest& p = probes[i];
    const bool usable = static_cast<int64_t>(p.forced.size()) == p.steps &&
                        std::all_of(p.forced.begin(), p.forced.end(), [&](int32_t t) { return t >= 0 && t < spec_.vocab_size; });
    if (usable) forced.push_back(i);
  }
  for (size_t g = 0; g < forced.size() && ok;) {
    std::vector<size_t> who;
    std::vector<int64_t> rows;
    int64_t positions = 0;
    while (g < forced.size()) {
      const ReplayProbeRequest& p = probes[forced[g]];
      const int64_t len = static_cast<int64_t>(p.prompt.size()) + p.steps - 1;
      if (!who.empty() && positions + len > kPreReplayForcedTokens) break;
      who.push_back(forced[g]);
      rows.push_back(p.steps);
      positions += len;
      tokens_[forced[g]].insert(tokens_[forced[g]].end(), p.forced.begin(), p.forced.end() - 1);
      ++g;
    }
    if (PastDeadline("before the teacher-forced forward of probe " + std::to_string(who.front()))) {
      ok = false;
      break;
    }
    std::vector<bool> diverged(n_, false);
    ok = Forward("teacher-forced forward of probe " + std::to_string(who.front()), who, rows,
                 [&](size_t i, SampleResult r) {
                   if (diverged[i]) return;  // rows after the divergence are of another prefix
                   const size_t k = outs_[i].steps.size();
                   diverged[i] = k + 1 < static_cast<size_t>(probes[i].steps) && r.token != probes[i].forced[k];
                   outs_[i].steps.push_back(std::move(r));
                 });
    for (size_t i : who) {
      if (!diverged[i]) {
        ++rep_->forced;
        continue;
      }
      // Decode on from the divergence: the prefix up to it is the engine's own (it equals the
      // hint there), the diverging token is the engine's; its KV slot and those after it are
      // written again by the decode steps.
      ++rep_->diverged;
      const size_t k = outs_[i].steps.size() - 1;
      tokens_[i].resize(probes[i].prompt.size() + k);
      tokens_[i].push_back(outs_[i].steps[k].token);
      computed_[i] = static_cast<int64_t>(probes[i].prompt.size() + k);
    }
  }
  return ok;
}

bool PreReplayRun::Decode() {
  bool ok = true;
  for (int64_t k = 0; ok; ++k) {
    std::vector<size_t> who;
    for (size_t i = 0; i < n_; ++i) {
      if (static_cast<int64_t>(outs_[i].steps.size()) < probes_[i].steps) who.push_back(i);
    }
    if (who.empty()) break;
    auto take = [&](size_t i, SampleResult r) {
      tokens_[i].push_back(r.token);
      outs_[i].steps.push_back(std::move(r));
    };
    if (kPreReplayBatched) {
      if (PastDeadline("after " + std::to_string(k) + " decode steps")) {
        ok = false;
        break;
      }
      ok = Forward("forward step " + std::to_string(k), who, std::vector<int64_t>(who.size(), 1), take);
    } else {
      for (size_t i : who) {
        if (PastDeadline("at decode step " + std::to_string(k))) {
          ok = false;
          break;
        }
        ok = Forward("forward step " + std::to_string(k), {i}, {1}, take);
        if (!ok) break;
      }
    }
  }
  return ok;
}

}  // namespace

Result<ReplayOutput> Engine::Replay(const std::vector<int32_t>& prompt, int64_t steps, int64_t top_k,
                                    bool allow_precomputed) {
  const auto t0 = std::chrono::steady_clock::now();
  const ModelSpec& s = model_->spec();
  RC_RETURN_IF_ERROR(CheckReplayArgs(s, max_model_len_, prompt, steps, top_k));
  const auto plen = static_cast<int64_t>(prompt.size());

  rc::PriorityLock sl(step_mu_, step_turnstile_);  // no Step, install or reset runs meanwhile
  std::vector<int32_t> blocks;
  {
    rc::MutexLock l(mu_);
    if (pause_ != PauseState::kPaused) {
      return FailedPrecondition(
          "replay runs only while the engine is paused (POST /pause first): it must not "
          "interleave with user requests");
    }
    // Computed before the pause on the image that is now live (exactly this generation).
    if (allow_precomputed && prereplay_.live_generation >= 0 && prereplay_.live_generation == generation_) {
      const ReplayProbeRequest key{prompt, steps, top_k};
      for (const auto& [req, cached] : prereplay_.entries) {
        if (!(req == key)) continue;
        ReplayOutput out = cached;
        out.precomputed = true;
        out.computed_on = "staged_image";
        out.staged_ms = prereplay_.ms;
        out.elapsed_ms = MsSince(t0);
        return out;
      }
    }
  }
  // The replay reserve (engine.h): blocks outside the pool, held only under step_mu_, so frozen
  // requests filling the pool never make a proven install fail validation for lack of KV.
  const int64_t need = (plen + steps + options_.block_size - 1) / options_.block_size;
  if (need > replay_reserve_blocks_) {
    return Internal("replay needs " + std::to_string(need) + " KV blocks, the replay reserve has " +
                    std::to_string(replay_reserve_blocks_) + " (max_model_len " + std::to_string(max_model_len_) + ")");
  }
  blocks.resize(static_cast<size_t>(need));
  for (int64_t i = 0; i < need; ++i) blocks[static_cast<size_t>(i)] = replay_reserve_first_ + static_cast<int32_t>(i);

  ReplayOutput out;
  std::vector<int32_t> tokens = prompt;
  const SamplingParams greedy = GreedyWithTopK(top_k);
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
  if (!st.ok()) return st.WithContext("replay forward");
  out.elapsed_ms = MsSince(t0);
  return out;
}

PreReplayReport Engine::PreReplay(const WeightImage& image, uint64_t image_id,
                                  const std::vector<ReplayProbeRequest>& probes,
                                  std::chrono::steady_clock::time_point deadline) {
  const auto t0 = std::chrono::steady_clock::now();
  PreReplayReport rep;
  rep.probes = static_cast<int64_t>(probes.size());
  rep.batched = kPreReplayBatched;
  auto not_run = [&](std::string why) {
    rep.ran = false;
    rep.why = std::move(why);
    rep.ms = MsSince(t0);
    return rep;
  };
  if (probes.empty()) return not_run("no probes");
  // The logits buffer of the last pre-replay (engine.h), given back on every return unless this
  // run grew it past kKeepPreReplayLogitsBytes.
  std::vector<float> logits;
  {
    rc::MutexLock l(prereplay_logits_mu_);
    logits.swap(prereplay_logits_);
  }
  struct GiveBackLogits {
    Engine* e;
    std::vector<float>* v;
    ~GiveBackLogits() {
      if (v->capacity() * sizeof(float) > kKeepPreReplayLogitsBytes) return;
      rc::MutexLock l(e->prereplay_logits_mu_);
      if (v->capacity() > e->prereplay_logits_.capacity()) e->prereplay_logits_.swap(*v);
    }
  } give_back_logits{this, &logits};
  const ModelSpec& s = model_->spec();
  for (size_t i = 0; i < probes.size(); ++i) {
    Status st = CheckReplayArgs(s, max_model_len_, probes[i].prompt, probes[i].steps, probes[i].top_k);
    if (!st.ok()) return not_run("probe " + std::to_string(i) + ": " + std::string(st.message()));
  }
  WeightBinding binding;
  {
    rc::PriorityLock sl(step_mu_, step_turnstile_);  // model_ is touched only under step_mu_
    auto b = model_->BindImage(image);
    if (!b.ok()) return not_run("staged image: " + std::string(b.status().message()));
    binding = std::move(b).value();
  }

  // Borrow every probe's blocks at once, from the free list only: a pre-replay runs beside user
  // requests and must not evict a cached prefix (nor starve them: when the free list is short it
  // does not run at all, and VALIDATING replays in the pause as before).
  const size_t n = probes.size();
  std::vector<std::vector<int32_t>> blocks(n);
  int64_t borrowed = 0;
  {
    rc::MutexLock l(mu_);
    for (const ReplayProbeRequest& p : probes) {
      borrowed += (static_cast<int64_t>(p.prompt.size()) + p.steps + options_.block_size - 1) / options_.block_size;
    }
    if (borrowed > kv_->NumUnhashedFreeBlocks()) {
      return not_run("the KV pool cannot spare " + std::to_string(borrowed) + " blocks (" +
                     std::to_string(kv_->NumUnhashedFreeBlocks()) +
                     " free without evicting a cached prefix); validation replays on the live weights in the pause");
    }
    KvPlan plan;
    for (size_t i = 0; i < n; ++i) {
      KvDemand d;
      d.seq_id = -1 - static_cast<int64_t>(i);  // not a sequence; never registered
      d.need_tokens = static_cast<int64_t>(probes[i].prompt.size()) + probes[i].steps;
      if (!kv_->PlanDemand(d, &plan)) {
        return not_run("the KV pool cannot spare the blocks of probe " + std::to_string(i));
      }
    }
    kv_->Apply(plan);
    for (size_t i = 0; i < n; ++i) blocks[i] = plan.grants[i].new_blocks;
    prereplay_blocks_ += borrowed;
  }

  // Teacher-forced probes first, then decoding; step_mu_ is held for each forward only.
  PreReplayRun run(model_.get(), &step_mu_, &step_turnstile_, pool_.get(), binding, probes, blocks, deadline, &logits, &rep);
  const bool ok = run.TeacherForce() && run.Decode();
  {
    rc::MutexLock l(mu_);
    for (const auto& b : blocks) kv_->Release(b);  // unhashed: back to the free list
    prereplay_blocks_ -= borrowed;
  }
  if (!ok) return not_run(run.why());
  rep.ran = true;
  rep.ms = MsSince(t0);
  rc::MutexLock l(mu_);
  prereplay_ = PreReplayCache{};
  prereplay_.image_id = image_id;
  prereplay_.ms = rep.ms;
  prereplay_.image = std::make_shared<const WeightBinding>(std::move(binding));
  for (size_t i = 0; i < n; ++i) prereplay_.entries.emplace_back(probes[i], std::move(run.outs()[i]));
  return rep;
}

bool Engine::AdoptPreReplay(uint64_t image_id, int64_t generation) {
  rc::PriorityLock sl(step_mu_, step_turnstile_);  // the live binding changes only under step_mu_
  rc::MutexLock l(mu_);
  const bool ok = image_id != 0 && prereplay_.image_id == image_id && !prereplay_.entries.empty() &&
                  !prereplay_.adopted && generation == generation_ && prereplay_.image != nullptr &&
                  model_->IsLive(*prereplay_.image);
  prereplay_.adopted = true;
  prereplay_.live_generation = ok ? generation : -1;
  return ok;
}

void Engine::DropPreReplay() {
  rc::MutexLock l(mu_);
  prereplay_ = PreReplayCache{};
}

}  // namespace rc::engine
