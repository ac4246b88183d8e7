// The Scheduler without a model (scheduler.h): plans over a real KvCacheManager and request
// views; nothing runs a forward pass. Each test states the rule of the contract it checks.
#include "rolloutcore/engine/scheduler.h"

#include <gtest/gtest.h>

#include <deque>
#include <numeric>

namespace rc::engine {
namespace {

constexpr int64_t kBs = 4;  // block size of every pool below

// A request as the engine holds it, and the view the scheduler gets.
struct Req {
  int64_t id = 0;
  std::vector<int32_t> tokens;
  std::string salt;
  int64_t computed = 0;
  std::vector<int32_t> blocks;
  SchedRequest View() const { return SchedRequest{id, tokens, salt, computed, blocks}; }
};

std::vector<int32_t> Tokens(int n, int salt = 0) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) t[static_cast<size_t>(i)] = (i * 37 + salt * 11 + 5) % 256;
  return t;
}

Req Waiting(int64_t id, int n, int salt = 0) { return Req{id, Tokens(n, salt), "", 0, {}}; }

template <typename Container>
std::vector<SchedRequest> Views(const Container& rs) {
  std::vector<SchedRequest> v;
  for (const Req& r : rs) v.push_back(r.View());
  return v;
}

// A miniature of Engine::ApplyPlanLocked + the forward's bookkeeping (no logits): applies the plan
// to the pool and the queues, then marks the scheduled tokens computed and, for a request whose
// sequence is fully computed, "samples" one token (so the next step is a decode).
void ApplyAndRun(const StepPlan& plan, KvCacheManager* kv, std::vector<Req>* running, std::deque<Req>* waiting) {
  kv->Apply(plan.kv);
  for (int64_t i = 0; i < plan.num_preempted; ++i) {
    Req v = std::move(running->back());
    running->pop_back();
    v.blocks.clear();
    v.computed = 0;
    waiting->push_front(std::move(v));
  }
  std::vector<int64_t> step(plan.running_tokens);
  size_t g = 0;
  for (size_t i = 0; i < plan.running_tokens.size(); ++i, ++g) {
    auto& nb = plan.kv.grants[g].new_blocks;
    (*running)[i].blocks.insert((*running)[i].blocks.end(), nb.begin(), nb.end());
  }
  for (int64_t a = 0; a < plan.num_admitted; ++a, ++g) {
    Req r = std::move(waiting->front());
    waiting->pop_front();
    const KvGrant& gr = plan.kv.grants[g];
    r.blocks = gr.hit_blocks;
    r.blocks.insert(r.blocks.end(), gr.new_blocks.begin(), gr.new_blocks.end());
    r.computed = static_cast<int64_t>(gr.hit_blocks.size()) * kBs;
    running->push_back(std::move(r));
    step.push_back(plan.admitted_tokens[static_cast<size_t>(a)]);
  }
  for (size_t i = 0; i < running->size(); ++i) {
    Req& r = (*running)[i];
    r.computed += step[i];
    if (step[i] > 0 && r.computed == static_cast<int64_t>(r.tokens.size())) r.tokens.push_back(7);
  }
}

SchedulerConfig Config(int64_t max_seqs, int64_t budget) { return SchedulerConfig{max_seqs, budget, kBs}; }

TEST(SchedulerTest, NothingToRunPlansNothing) {
  KvCacheManager kv(16, kBs, true);
  Scheduler s(Config(4, 64));
  StepPlan p = s.Schedule(PauseState::kUnpaused, {}, {}, kv);
  EXPECT_EQ(p.num_preempted, 0);
  EXPECT_EQ(p.num_admitted, 0);
  EXPECT_TRUE(p.kv.grants.empty());
  EXPECT_EQ(p.num_scheduled_tokens, 0);
  EXPECT_FALSE(HasRunnableWork(PauseState::kUnpaused, 0, 0));
}

// Admission: FIFO under max_num_batched_tokens; the budget chunks the prefill that does not fit,
// and a request admitted with no budget left is not admitted at all.
TEST(SchedulerTest, AdmitsFifoUnderTheTokenBudgetAndChunksTheLastPrefill) {
  KvCacheManager kv(64, kBs, true);
  Scheduler s(Config(8, 30));
  std::vector<Req> waiting = {Waiting(1, 12), Waiting(2, 12, 1), Waiting(3, 12, 2)};
  StepPlan p = s.Schedule(PauseState::kUnpaused, {}, Views(waiting), kv);
  EXPECT_EQ(p.num_admitted, 3);
  EXPECT_EQ(p.admitted_tokens, (std::vector<int64_t>{12, 12, 6}));
  EXPECT_EQ(p.num_scheduled_tokens, 30);
  ASSERT_EQ(p.kv.grants.size(), 3u);
  // An admission takes blocks for its whole sequence, even when its prefill is chunked.
  for (const KvGrant& g : p.kv.grants) EXPECT_EQ(g.new_blocks.size(), 3u);
  EXPECT_EQ(kv.BlocksInUse(), 0) << "Schedule must not mutate the pool";

  Scheduler tight(Config(8, 24));
  StepPlan q = tight.Schedule(PauseState::kUnpaused, {}, Views(waiting), kv);
  EXPECT_EQ(q.num_admitted, 2) << "the budget is used up by the first two: the third waits";
  EXPECT_EQ(q.admitted_tokens, (std::vector<int64_t>{12, 12}));
}

TEST(SchedulerTest, AdmitsAtMostMaxNumSeqs) {
  KvCacheManager kv(64, kBs, true);
  Scheduler s(Config(2, 1000));
  std::vector<Req> running = {Req{1, Tokens(5), "", 4, {0, 1}}};
  std::vector<Req> waiting = {Waiting(2, 3), Waiting(3, 3, 1)};
  StepPlan p = s.Schedule(PauseState::kUnpaused, Views(running), Views(waiting), kv);
  EXPECT_EQ(p.running_tokens, (std::vector<int64_t>{1}));
  EXPECT_EQ(p.num_admitted, 1) << "one running + one admitted = max_num_seqs 2";
}

// Order: running requests are served before any admission, oldest first, so an older prefill
// takes the budget before a younger one, and a decode before a new prefill.
TEST(SchedulerTest, RunningRequestsOldestFirstThenAdmissions) {
  KvCacheManager kv(64, kBs, true);
  Scheduler s(Config(8, 10));
  // Request 1 mid-prefill (8 of 20 computed), request 2 decoding.
  KvPlan setup;
  KvDemand d1{1, false, {}, "", 0, 20};
  KvDemand d2{2, false, {}, "", 0, 9};
  ASSERT_TRUE(kv.PlanDemand(d1, &setup));
  ASSERT_TRUE(kv.PlanDemand(d2, &setup));
  kv.Apply(setup);
  std::vector<Req> running = {Req{1, Tokens(20), "", 8, setup.grants[0].new_blocks},
                              Req{2, Tokens(9, 1), "", 8, setup.grants[1].new_blocks}};
  std::vector<Req> waiting = {Waiting(3, 4, 2)};
  StepPlan p = s.Schedule(PauseState::kUnpaused, Views(running), Views(waiting), kv);
  EXPECT_EQ(p.running_tokens, (std::vector<int64_t>{10, 0})) << "the older prefill takes the whole budget";
  EXPECT_EQ(p.num_admitted, 0) << "no budget left for admissions";

  Scheduler roomy(Config(8, 14));
  StepPlan q = roomy.Schedule(PauseState::kUnpaused, Views(running), Views(waiting), kv);
  EXPECT_EQ(q.running_tokens, (std::vector<int64_t>{12, 1}));
  EXPECT_EQ(q.num_admitted, 1);
  EXPECT_EQ(q.admitted_tokens, (std::vector<int64_t>{1})) << "admitted with what is left of the budget";
}

// Head of line: when the first waiting request cannot get its blocks, no later one is admitted
// past it, even one that would fit.
TEST(SchedulerTest, AdmissionStopsAtTheFirstRequestThatDoesNotFit) {
  KvCacheManager kv(4, kBs, true);  // 16 positions
  Scheduler s(Config(8, 1000));
  std::vector<Req> waiting = {Waiting(1, 20), Waiting(2, 4, 1)};
  StepPlan p = s.Schedule(PauseState::kUnpaused, {}, Views(waiting), kv);
  EXPECT_EQ(p.num_admitted, 0);
  EXPECT_TRUE(p.kv.grants.empty());
}

// Preemption: when running requests cannot all get the blocks of their next tokens, the most
// recently admitted one is preempted (all its blocks released in the plan) and the rest is
// planned again; the preempted request is first in line to be admitted again.
TEST(SchedulerTest, PreemptsTheNewestRunningRequestWhenBlocksRunOut) {
  KvCacheManager kv(4, kBs, false);
  Scheduler s(Config(8, 1000));
  // Three running requests, each with 4 positions computed and a sampled 5th token: each needs a
  // second block, the pool has one free.
  KvPlan setup;
  for (int64_t id : {1, 2, 3}) ASSERT_TRUE(kv.PlanDemand(KvDemand{id, false, {}, "", 0, 4}, &setup));
  kv.Apply(setup);
  ASSERT_EQ(kv.NumFreeBlocks(), 1);
  std::vector<Req> running;
  for (int64_t i = 0; i < 3; ++i) {
    running.push_back(Req{i + 1, Tokens(5, static_cast<int>(i)), "", 4, setup.grants[static_cast<size_t>(i)].new_blocks});
  }
  const int32_t newest_block = running[2].blocks[0];
  StepPlan p = s.Schedule(PauseState::kUnpaused, Views(running), {}, kv);
  EXPECT_EQ(p.num_preempted, 1) << "releasing the newest gives the two older ones a block each";
  EXPECT_EQ(p.running_tokens, (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(p.kv.released, (std::vector<int32_t>{newest_block}));
  ASSERT_EQ(p.kv.grants.size(), 2u);
  EXPECT_EQ(p.kv.grants[0].new_blocks.size() + p.kv.grants[1].new_blocks.size(), 2u);
  // Its own block went to an older request, so it is not admitted again in the same step.
  EXPECT_EQ(p.num_admitted, 0);
  EXPECT_EQ(kv.BlocksInUse(), 3) << "Schedule must not mutate the pool";

  // Applying the plan: pool consistent, the preempted request waits at the front of the queue.
  std::deque<Req> waiting = {Waiting(9, 3, 9)};
  ApplyAndRun(p, &kv, &running, &waiting);
  EXPECT_EQ(kv.BlocksInUse(), 4);
  ASSERT_EQ(waiting.size(), 2u);
  EXPECT_EQ(waiting.front().id, 3);
  EXPECT_TRUE(waiting.front().blocks.empty());
}

// Preempting several: victims go back in their running order, ahead of the waiting queue; a
// victim whose released blocks another victim's admission can use is admitted in the same step.
TEST(SchedulerTest, PreemptedRequestsReturnInRunningOrderAheadOfTheQueue) {
  KvCacheManager kv(6, kBs, false);
  Scheduler s(Config(8, 1000));
  // Request 1 holds 4 blocks and needs a 5th; requests 2 and 3 hold one each (fully computed).
  KvPlan setup;
  ASSERT_TRUE(kv.PlanDemand(KvDemand{1, false, {}, "", 0, 16}, &setup));
  ASSERT_TRUE(kv.PlanDemand(KvDemand{2, false, {}, "", 0, 2}, &setup));
  ASSERT_TRUE(kv.PlanDemand(KvDemand{3, false, {}, "", 0, 2}, &setup));
  kv.Apply(setup);
  ASSERT_EQ(kv.NumFreeBlocks(), 0);
  std::vector<Req> running = {Req{1, Tokens(17), "", 16, setup.grants[0].new_blocks},
                              Req{2, Tokens(3, 1), "", 2, setup.grants[1].new_blocks},
                              Req{3, Tokens(3, 2), "", 2, setup.grants[2].new_blocks}};
  std::vector<Req> waiting = {Waiting(4, 2, 4)};
  StepPlan p = s.Schedule(PauseState::kUnpaused, Views(running), Views(waiting), kv);
  EXPECT_EQ(p.num_preempted, 1) << "one block (request 3's) is enough for request 1";
  EXPECT_EQ(p.running_tokens, (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(p.num_admitted, 0) << "no block left for request 3 again or request 4";

  // Now with request 1 needing two more blocks: 3, then 2 are preempted; 2 is first in line.
  KvCacheManager kv2(6, kBs, false);
  KvPlan setup2;
  ASSERT_TRUE(kv2.PlanDemand(KvDemand{1, false, {}, "", 0, 12}, &setup2));
  ASSERT_TRUE(kv2.PlanDemand(KvDemand{2, false, {}, "", 0, 2}, &setup2));
  ASSERT_TRUE(kv2.PlanDemand(KvDemand{3, false, {}, "", 0, 2}, &setup2));
  ASSERT_TRUE(kv2.PlanDemand(KvDemand{-1, false, {}, "", 0, 4}, &setup2));  // a block held elsewhere
  kv2.Apply(setup2);
  ASSERT_EQ(kv2.NumFreeBlocks(), 0);
  std::vector<Req> running2 = {Req{1, Tokens(20), "", 12, setup2.grants[0].new_blocks},
                               Req{2, Tokens(3, 1), "", 2, setup2.grants[1].new_blocks},
                               Req{3, Tokens(3, 2), "", 2, setup2.grants[2].new_blocks}};
  StepPlan q = s.Schedule(PauseState::kUnpaused, Views(running2), Views(waiting), kv2);
  EXPECT_EQ(q.num_preempted, 2);
  EXPECT_EQ(q.running_tokens, (std::vector<int64_t>{8}));
  std::deque<Req> wq(waiting.begin(), waiting.end());
  ApplyAndRun(q, &kv2, &running2, &wq);
  ASSERT_EQ(wq.size(), 3u);
  EXPECT_EQ(wq[0].id, 2);
  EXPECT_EQ(wq[1].id, 3);
  EXPECT_EQ(wq[2].id, 4);
  EXPECT_EQ(kv2.BlocksInUse(), 6);
}

// Prefix cache: an admission revives cached blocks and computes only the rest; a preempted
// request's released, hashed blocks can be revived by the admission planned after the release.
TEST(SchedulerTest, AdmissionCountsCachedPrefixBlocks) {
  KvCacheManager kv(16, kBs, true);
  Scheduler s(Config(8, 1000));
  const std::vector<int32_t> t = Tokens(13);
  // A finished request left 3 full, hashed blocks.
  KvPlan setup;
  ASSERT_TRUE(kv.PlanDemand(KvDemand{1, false, {}, "", 0, 13}, &setup));
  kv.Apply(setup);
  std::vector<uint64_t> hashes;
  for (size_t b = 0; b < 3; ++b) {
    hashes.push_back(KvBlockHash(hashes.empty() ? 0 : hashes.back(),
                                 std::span<const int32_t>(t.data() + b * kBs, kBs), ""));
  }
  kv.RegisterFullBlocks(setup.grants[0].new_blocks, hashes, 0);
  kv.Release(setup.grants[0].new_blocks);
  std::vector<Req> waiting = {Req{2, t, "", 0, {}}};
  StepPlan p = s.Schedule(PauseState::kUnpaused, {}, Views(waiting), kv);
  ASSERT_EQ(p.num_admitted, 1);
  EXPECT_EQ(p.kv.grants[0].hit_blocks.size(), 3u);
  EXPECT_EQ(p.admitted_tokens, (std::vector<int64_t>{1})) << "12 positions from the cache, 1 computed";
  // Another salt: no hit.
  std::vector<Req> salted = {Req{3, t, "other", 0, {}}};
  StepPlan q = s.Schedule(PauseState::kUnpaused, {}, Views(salted), kv);
  EXPECT_TRUE(q.kv.grants[0].hit_blocks.empty());
  EXPECT_EQ(q.admitted_tokens, (std::vector<int64_t>{13}));
}

// Pause keep: a paused engine schedules nothing and releases nothing: frozen requests keep their
// KV; after resume they continue where they were.
TEST(SchedulerTest, PausedSchedulesNothingAndFrozenRequestsKeepTheirBlocks) {
  KvCacheManager kv(16, kBs, true);
  Scheduler s(Config(8, 1000));
  std::vector<Req> running;
  std::deque<Req> waiting = {Waiting(1, 6)};
  ApplyAndRun(s.Schedule(PauseState::kUnpaused, {}, Views(waiting), kv), &kv, &running,
              &waiting);
  ASSERT_EQ(running.size(), 1u);
  const int64_t held = kv.BlocksInUse();
  ASSERT_GT(held, 0);
  waiting.push_back(Waiting(2, 3, 1));
  const PauseState paused = PauseStateOnRequest(PauseState::kUnpaused, PauseMode::kKeep);
  EXPECT_EQ(paused, PauseState::kPaused);
  EXPECT_FALSE(PauseAbortsRequests(PauseMode::kKeep));
  StepPlan p = s.Schedule(paused, Views(running), Views(waiting), kv);
  EXPECT_TRUE(p.kv.grants.empty());
  EXPECT_TRUE(p.kv.released.empty());
  EXPECT_EQ(p.num_scheduled_tokens, 0);
  EXPECT_FALSE(HasRunnableWork(paused, 1, 1));
  EXPECT_EQ(kv.BlocksInUse(), held);
  // Resume: the frozen request decodes its next token on the blocks it kept, then 2 is admitted.
  StepPlan r = s.Schedule(PauseState::kUnpaused, Views(running), Views(waiting), kv);
  EXPECT_EQ(r.num_preempted, 0);
  EXPECT_EQ(r.running_tokens, (std::vector<int64_t>{1}));
  EXPECT_EQ(r.num_admitted, 1);
}

// Pause wait: draining serves the running requests and admits none; the pause completes (paused)
// once none runs.
TEST(SchedulerTest, DrainingServesRunningRequestsAndAdmitsNone) {
  KvCacheManager kv(16, kBs, true);
  Scheduler s(Config(8, 1000));
  std::vector<Req> running;
  std::deque<Req> waiting = {Waiting(1, 6)};
  ApplyAndRun(s.Schedule(PauseState::kUnpaused, {}, Views(waiting), kv), &kv, &running,
              &waiting);
  waiting.push_back(Waiting(2, 3, 1));
  const PauseState draining = PauseStateOnRequest(PauseState::kUnpaused, PauseMode::kWait);
  EXPECT_EQ(draining, PauseState::kDraining);
  EXPECT_TRUE(PauseWaitsForDrain(draining));
  StepPlan p = s.Schedule(draining, Views(running), Views(waiting), kv);
  EXPECT_EQ(p.running_tokens, (std::vector<int64_t>{1}));
  EXPECT_EQ(p.num_admitted, 0);
  EXPECT_TRUE(HasRunnableWork(draining, 1, 1));
  EXPECT_FALSE(HasRunnableWork(draining, 0, 1)) << "waiting requests alone are not work while draining";
  EXPECT_EQ(PauseStateOnDrained(draining), PauseState::kPaused);
}

// The pause state machine: wait drains (unless already paused), abort and keep pause at once
// from any state, only abort ends the requests.
TEST(SchedulerTest, PauseStateTransitions) {
  for (PauseState from : {PauseState::kUnpaused, PauseState::kDraining, PauseState::kPaused}) {
    EXPECT_EQ(PauseStateOnRequest(from, PauseMode::kAbort), PauseState::kPaused) << PauseStateName(from);
    EXPECT_EQ(PauseStateOnRequest(from, PauseMode::kKeep), PauseState::kPaused) << PauseStateName(from);
  }
  EXPECT_EQ(PauseStateOnRequest(PauseState::kUnpaused, PauseMode::kWait), PauseState::kDraining);
  EXPECT_EQ(PauseStateOnRequest(PauseState::kDraining, PauseMode::kWait), PauseState::kDraining);
  EXPECT_EQ(PauseStateOnRequest(PauseState::kPaused, PauseMode::kWait), PauseState::kPaused)
      << "a wait pause on a paused engine changes nothing";
  EXPECT_FALSE(PauseWaitsForDrain(PauseState::kPaused));
  EXPECT_TRUE(PauseAbortsRequests(PauseMode::kAbort));
  EXPECT_FALSE(PauseAbortsRequests(PauseMode::kWait));
  EXPECT_FALSE(PauseAbortsRequests(PauseMode::kKeep));
  EXPECT_EQ(PauseModeFromName("bogus").status().message(), "mode: expected one of abort, wait, keep; got 'bogus'");
}

// Driving plan → apply to the end: every request finishes, the pool never over-commits, and the
// budget is respected in every step (continuous batching under pressure, with preemptions).
TEST(SchedulerTest, PlanApplyLoopRunsEverythingToCompletionUnderPressure) {
  KvCacheManager kv(10, kBs, true);
  Scheduler s(Config(4, 9));
  std::vector<Req> running;
  std::deque<Req> waiting;
  for (int64_t i = 0; i < 6; ++i) waiting.push_back(Waiting(i + 1, 5 + static_cast<int>(i), static_cast<int>(i)));
  const size_t kOut = 8;  // tokens to generate each
  std::vector<size_t> prompt_len;
  for (const Req& r : waiting) prompt_len.push_back(r.tokens.size());
  int64_t preemptions = 0, finished = 0;
  for (int step = 0; step < 500 && (!running.empty() || !waiting.empty()); ++step) {
    std::vector<SchedRequest> w = Views(waiting);
    StepPlan p = s.Schedule(PauseState::kUnpaused, Views(running), w, kv);
    EXPECT_LE(p.num_scheduled_tokens, 9);
    preemptions += p.num_preempted;
    ApplyAndRun(p, &kv, &running, &waiting);
    EXPECT_LE(kv.BlocksInUse(), kv.num_blocks());
    for (auto it = running.begin(); it != running.end();) {
      if (it->tokens.size() >= prompt_len[static_cast<size_t>(it->id - 1)] + kOut) {
        kv.Release(it->blocks);
        it = running.erase(it);
        ++finished;
      } else {
        ++it;
      }
    }
  }
  EXPECT_EQ(finished, 6);
  EXPECT_GT(preemptions, 0) << "the pool (40 positions) cannot hold 4 sequences of up to 18 tokens";
  EXPECT_EQ(kv.BlocksInUse(), 0);
}

}  // namespace
}  // namespace rc::engine
