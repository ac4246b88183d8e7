#include "rolloutcore/engine/engine.h"

#include <gtest/gtest.h>

#include <future>

#include <cmath>
#include <thread>

#include "rolloutcore/engine/engine_loop.h"
#include "rolloutcore/engine/loader.h"

namespace rc::engine {

// Fault injection into the engine's own state: a KV block referenced outside any request (the
// broken invariant under which a reset stays refused even after every request was preempted).
class EngineTestPeer {
 public:
  static void HoldBlockOutsideAnyRequest(Engine* e) {
    rc::MutexLock l(e->mu_);
    KvPlan plan;
    KvDemand d;
    d.seq_id = -1;
    d.need_tokens = 1;
    ASSERT_TRUE(e->kv_->PlanDemand(d, &plan));
    e->kv_->Apply(plan);
  }
};

namespace {

std::unique_ptr<Engine> MakeEngine(EngineOptions o = {}, const std::string& model = "tiny", uint64_t seed = 1) {
  if (o.num_threads == 0) o.num_threads = 2;
  auto e = CreateEngine({model, "dummy", seed}, o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return std::move(e).value();
}

std::vector<int32_t> Prompt(int n, int salt = 0) {
  std::vector<int32_t> p;
  p.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) p.push_back((i * 37 + salt * 11 + 5) % 256);
  return p;
}

GenerateRequest Greedy(std::vector<int32_t> prompt, int64_t max_tokens = 12, int64_t logprobs = 5) {
  GenerateRequest r;
  r.prompt = std::move(prompt);
  r.sampling.temperature = 0;
  r.sampling.max_tokens = max_tokens;
  r.sampling.num_logprobs = logprobs;
  return r;
}

void RunToCompletion(Engine* e) {
  while (e->Step()) {
  }
}

RequestStream::Snapshot RunOne(Engine* e, GenerateRequest r) {
  auto s = e->AddRequest(std::move(r));
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  RunToCompletion(e);
  return (*s)->Wait();
}

void ExpectSameOutput(const RequestStream::Snapshot& a, const RequestStream::Snapshot& b, double tol) {
  ASSERT_EQ(a.tokens, b.tokens);
  ASSERT_EQ(a.logprobs.size(), b.logprobs.size());
  for (size_t i = 0; i < a.logprobs.size(); ++i) EXPECT_NEAR(a.logprobs[i], b.logprobs[i], tol) << i;
  for (size_t i = 0; i < a.top_logprobs.size(); ++i) {
    ASSERT_EQ(a.top_logprobs[i].size(), b.top_logprobs[i].size());
    for (size_t k = 0; k < a.top_logprobs[i].size(); ++k) {
      EXPECT_NEAR(a.top_logprobs[i][k].second, b.top_logprobs[i][k].second, tol);
    }
  }
}

TEST(EngineTest, GreedyIsBitwiseReproducibleAndBatchInvariant) {
  auto e = MakeEngine();
  std::vector<RequestStream::Snapshot> solo;
  solo.reserve(3);
  for (int i = 0; i < 3; ++i) solo.push_back(RunOne(e.get(), Greedy(Prompt(5 + 9 * i, i))));
  for (const auto& s : solo) {
    EXPECT_EQ(s.tokens.size(), 12u);
    EXPECT_EQ(s.finish, FinishReason::kLength);
  }
  // All three at once, in a fresh engine: same bits.
  auto e2 = MakeEngine();
  std::vector<std::shared_ptr<RequestStream>> streams;
  streams.reserve(3);
  for (int i = 0; i < 3; ++i) streams.push_back(*e2->AddRequest(Greedy(Prompt(5 + 9 * i, i))));
  RunToCompletion(e2.get());
  for (int i = 0; i < 3; ++i) ExpectSameOutput(solo[i], streams[i]->Wait(), 0.0);
}

// Weights stay in their published dtype (parameters.h): the dummy weights are bf16, so a default
// engine keeps them as bf16, in half the memory of the f32 engine over the same weights, and
// computes bit for bit what the f32 engine computes (every model family, tp 1 and 2, tied).
TEST(EngineTest, Bf16WeightsHalveMemoryAndGiveTheF32BitsExactly) {
  for (const char* model : {"tiny", "tiny-qwen2", "tiny-llama", "tiny-tied"}) {
    for (int tp : {1, 2}) {
      SCOPED_TRACE(std::string(model) + " tp=" + std::to_string(tp));
      EngineOptions o;
      o.num_threads = 2;
      o.tensor_parallel_size = tp;
      auto bf16 = CreateEngine({model, "dummy", 1}, o);
      auto f32 = CreateEngine({model, "dummy", 1, "f32"}, o);
      ASSERT_TRUE(bf16.ok() && f32.ok());
      EXPECT_EQ((*bf16)->weight_dtype(), DType::kBF16);
      EXPECT_EQ((*f32)->weight_dtype(), DType::kF32);
      EXPECT_EQ(2 * (*bf16)->WeightBytes(), (*f32)->WeightBytes());
      std::vector<std::shared_ptr<RequestStream>> a, b;
      for (int i = 0; i < 3; ++i) {
        a.push_back(*(*bf16)->AddRequest(Greedy(Prompt(5 + 9 * i, i), 12, 5)));
        b.push_back(*(*f32)->AddRequest(Greedy(Prompt(5 + 9 * i, i), 12, 5)));
      }
      RunToCompletion(bf16->get());
      RunToCompletion(f32->get());
      for (int i = 0; i < 3; ++i) ExpectSameOutput(b[i]->Wait(), a[i]->Wait(), 0.0);
    }
  }
}

// Live weights are read-only outside an install: a stray write faults instead of silently
// changing bytes whose digest was proven; WriteLiveForTesting (the fault routes) can still write.
TEST(EngineDeathTest, LiveWeightsAreReadOnlyOutsideAnInstall) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the engine has threads
  auto e = MakeEngine();
  const Parameter* p = e->Parameters(0).Find("model.norm.weight");
  ASSERT_NE(p, nullptr);
  EXPECT_TRUE(p->storage->read_only());
  EXPECT_DEATH({ p->bytes()[0] ^= std::byte{1}; }, "");
  const std::byte before = p->bytes()[0];
  ASSERT_TRUE(e->WriteLiveForTesting(0, [](ParameterStore* ps) -> Status {
                 ps->Find("model.norm.weight")->bytes()[0] ^= std::byte{1};
                 return OkStatus();
               }).ok());
  EXPECT_EQ(p->bytes()[0], before ^ std::byte{1});
  EXPECT_TRUE(p->storage->read_only());
}

TEST(EngineTest, PrefixCacheReportsHitsAndKeepsOutputs) {
  EngineOptions o;
  o.block_size = 8;
  auto e = MakeEngine(o);
  auto first = RunOne(e.get(), Greedy(Prompt(30)));
  EXPECT_EQ(first.cached_tokens, 0);
  auto second = RunOne(e.get(), Greedy(Prompt(30)));
  EXPECT_EQ(second.cached_tokens, 24);  // 3 full blocks of the 29 matchable tokens
  ExpectSameOutput(first, second, 0.0);
  auto m = e->Metrics();
  EXPECT_EQ(m.prefix_cache_queries, 60);
  EXPECT_EQ(m.prefix_cache_hits, 24);
  // A salt isolates the cache.
  auto salted = Greedy(Prompt(30));
  salted.cache_salt = "tenant-a";
  EXPECT_EQ(RunOne(e.get(), salted).cached_tokens, 0);

  o.enable_prefix_caching = false;
  auto nc = MakeEngine(o);
  auto a = RunOne(nc.get(), Greedy(Prompt(30)));
  auto b = RunOne(nc.get(), Greedy(Prompt(30)));
  EXPECT_EQ(b.cached_tokens, 0);
  ExpectSameOutput(first, a, 1e-4);
  ExpectSameOutput(first, b, 1e-4);
}

TEST(EngineTest, TensorParallelMatchesSingleRank) {
  for (const char* model : {"tiny", "tiny-qwen2", "tiny-llama", "tiny-tied"}) {
    EngineOptions o;
    auto ref = RunOne(MakeEngine(o, model).get(), Greedy(Prompt(17), 16));
    for (int tp : {2, 4}) {
      o.tensor_parallel_size = tp;
      auto got = RunOne(MakeEngine(o, model).get(), Greedy(Prompt(17), 16));
      SCOPED_TRACE(std::string(model) + " tp=" + std::to_string(tp));
      ExpectSameOutput(ref, got, 1e-4);
    }
  }
}

TEST(EngineTest, ChunkedPrefillAndPreemptionKeepOutputs) {
  auto ref_engine = MakeEngine();
  std::vector<RequestStream::Snapshot> ref;
  ref.reserve(4);
  for (int i = 0; i < 4; ++i) ref.push_back(RunOne(ref_engine.get(), Greedy(Prompt(20 + i, i), 20)));
  EngineOptions o;
  o.block_size = 4;
  o.num_kv_blocks = 24;  // 96 positions for 4 sequences of ~40: forces preemption
  o.max_model_len = 64;
  o.max_num_batched_tokens = 7;  // forces chunked prefill
  auto e = MakeEngine(o);
  std::vector<std::shared_ptr<RequestStream>> s;
  s.reserve(4);
  for (int i = 0; i < 4; ++i) s.push_back(*e->AddRequest(Greedy(Prompt(20 + i, i), 20)));
  RunToCompletion(e.get());
  for (int i = 0; i < 4; ++i) ExpectSameOutput(ref[i], s[i]->Wait(), 0.0);
  EXPECT_GT(e->Metrics().num_preemptions, 0);
  EXPECT_EQ(e->State().blocks_in_use, 0);
}

TEST(EngineTest, StopTokensIgnoreEosAndValidation) {
  auto e = MakeEngine();
  auto ref = RunOne(e.get(), Greedy(Prompt(9), 12));
  size_t idx = 1;
  while (idx < ref.tokens.size() &&
         std::find(ref.tokens.begin(), ref.tokens.begin() + static_cast<long>(idx), ref.tokens[idx]) !=
             ref.tokens.begin() + static_cast<long>(idx)) {
    ++idx;
  }
  ASSERT_LT(idx, ref.tokens.size());
  auto r = Greedy(Prompt(9), 12);
  r.sampling.stop_token_ids = {ref.tokens[idx]};
  auto stopped = RunOne(e.get(), r);
  EXPECT_EQ(stopped.finish, FinishReason::kStop);
  EXPECT_EQ(stopped.tokens, std::vector<int32_t>(ref.tokens.begin(), ref.tokens.begin() + static_cast<long>(idx) + 1));

  auto bad = e->AddRequest(Greedy(Prompt(600)));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("prompt"), std::string::npos);
  auto neg = Greedy(Prompt(3));
  neg.sampling.max_tokens = -1;
  EXPECT_NE(e->AddRequest(neg).status().message().find("max_tokens"), std::string::npos);
  auto oov = Greedy({1, 999});
  EXPECT_NE(e->AddRequest(oov).status().message().find("prompt[1]"), std::string::npos);
}

TEST(EngineTest, SeededSamplingIsReproducible) {
  auto e = MakeEngine();
  GenerateRequest r = Greedy(Prompt(6), 16);
  r.sampling.temperature = 1.0;
  r.sampling.top_p = 0.9;
  r.sampling.seed = 1234;
  auto a = RunOne(e.get(), r);
  auto b = RunOne(e.get(), r);
  EXPECT_EQ(a.tokens, b.tokens);
}

TEST(EngineTest, PauseKeepResumesToTheSameOutput) {
  auto ref = RunOne(MakeEngine().get(), Greedy(Prompt(11), 20));
  auto e = MakeEngine();
  auto s = *e->AddRequest(Greedy(Prompt(11), 20));
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(e->Step());
  ASSERT_TRUE(e->Pause(PauseMode::kKeep).ok());
  EXPECT_TRUE(e->IsPaused());
  EXPECT_FALSE(e->Step());
  EXPECT_EQ(e->State().num_running, 1);
  EXPECT_EQ(s->WaitFrom(SIZE_MAX, std::chrono::milliseconds(0)).tokens.size(), 5u);
  e->Resume();
  RunToCompletion(e.get());
  ExpectSameOutput(ref, s->Wait(), 0.0);
}

TEST(EngineTest, PauseWaitReturnsAfterRunningRequestsFinish) {
  auto e = MakeEngine();
  EngineLoop loop(e.get());
  loop.Start();
  auto s = *e->AddRequest(Greedy(Prompt(11), 40));
  // Make sure it is running (admitted) before pausing.
  s->WaitFrom(0, std::chrono::seconds(10));
  ASSERT_TRUE(e->Pause(PauseMode::kWait).ok());
  auto snap = s->WaitFrom(SIZE_MAX, std::chrono::milliseconds(0));
  EXPECT_TRUE(snap.finished);
  EXPECT_EQ(snap.finish, FinishReason::kLength);
  EXPECT_EQ(snap.tokens.size(), 40u);
  EXPECT_TRUE(e->IsPaused());
  // Queued while paused: not admitted until resume.
  auto later = *e->AddRequest(Greedy(Prompt(4), 3));
  EXPECT_FALSE(later->WaitFrom(SIZE_MAX, std::chrono::milliseconds(50)).finished);
  e->Resume();
  EXPECT_TRUE(later->Wait().finished);
  loop.Stop();
}

TEST(EngineTest, PauseAbortFinishesRunningWithAbort) {
  auto e = MakeEngine();
  auto s = *e->AddRequest(Greedy(Prompt(11), 40));
  ASSERT_TRUE(e->Step());
  ASSERT_TRUE(e->Pause(PauseMode::kAbort).ok());
  auto snap = s->Wait();
  EXPECT_EQ(snap.finish, FinishReason::kAbort);
  EXPECT_EQ(e->State().blocks_in_use, 0);
  EXPECT_EQ(e->Metrics().finished_by_reason["abort"], 1);
}

TEST(EngineTest, AbortByIdAndAll) {
  auto e = MakeEngine();
  auto a = Greedy(Prompt(5), 30);
  a.request_id = "a";
  auto b = Greedy(Prompt(6), 30);
  b.request_id = "b";
  auto sa = *e->AddRequest(a);
  auto sb = *e->AddRequest(b);
  ASSERT_TRUE(e->Step());
  EXPECT_EQ(e->Abort({"a", "zzz"}), 1);
  EXPECT_EQ(sa->Wait().finish, FinishReason::kAbort);
  EXPECT_FALSE(sb->WaitFrom(SIZE_MAX, std::chrono::milliseconds(0)).finished);
  EXPECT_EQ(e->Abort({}), 1);
  EXPECT_EQ(sb->Wait().finish, FinishReason::kAbort);
}

TEST(EngineTest, ResetPrefixCacheRefusesWhileBlocksAreInUse) {
  EngineOptions o;
  o.block_size = 4;
  auto ref = RunOne(MakeEngine(o).get(), Greedy(Prompt(13), 10));
  auto e = MakeEngine(o);
  RunOne(e.get(), Greedy(Prompt(8, 3), 2));  // leaves cached blocks
  const int64_t cached = e->State().cached_blocks;
  ASSERT_GT(cached, 0);
  auto s = *e->AddRequest(Greedy(Prompt(13), 10));
  ASSERT_TRUE(e->Step());
  const auto before = e->State();
  auto ev = e->ResetPrefixCache(false);
  EXPECT_FALSE(ev.success);
  EXPECT_EQ(ev.freed_blocks, 0);
  EXPECT_EQ(ev.blocks_in_use, before.blocks_in_use);
  EXPECT_EQ(e->State().cached_blocks, before.cached_blocks);
  EXPECT_EQ(e->State().blocks_in_use, before.blocks_in_use);
  ev = e->ResetPrefixCache(true);
  EXPECT_TRUE(ev.success);
  EXPECT_GE(ev.freed_blocks, cached);
  EXPECT_EQ(e->State().cached_blocks, 0);
  // The preempted request recomputes and still gives the uninterrupted answer.
  RunToCompletion(e.get());
  ExpectSameOutput(ref, s->Wait(), 0.0);
}

TEST(EngineTest, InstallWeightsOnlyWhilePausedAndSetsVersion) {
  auto e = MakeEngine();
  auto before = RunOne(e.get(), Greedy(Prompt(7), 8));
  const ModelSpec spec = e->spec();
  WeightFill fill = MakeWeightFill(spec, [spec]() -> Result<std::unique_ptr<TensorSource>> {
    return MakeDummySource(spec, 99);
  });
  Status st = e->InstallWeights(fill, "v2", 2);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(e->WeightVersion(), "default");
  ASSERT_TRUE(e->Pause(PauseMode::kWait).ok());
  ASSERT_TRUE(e->InstallWeights(fill, "v2", 2).ok());
  EXPECT_EQ(e->State().weight_version, "v2");
  EXPECT_EQ(e->State().install_generation, 2);
  EXPECT_EQ(e->State().cached_blocks, 0);
  e->Resume();
  auto after = RunOne(e.get(), Greedy(Prompt(7), 8));
  EXPECT_EQ(after.cached_tokens, 0);
  auto fresh = RunOne(MakeEngine({}, "tiny", 99).get(), Greedy(Prompt(7), 8));
  ExpectSameOutput(fresh, after, 0.0);
  EXPECT_NE(before.tokens, after.tokens);
}

// Identity: a boot id per instance; the install generation moves when an install begins writing
// (so a failed, partial install moves it too) and never when one is refused before it writes.
TEST(EngineTest, BootIdPerInstanceAndInstallGenerationCountsEveryWriteAttempt) {
  auto e = MakeEngine();
  auto other = MakeEngine();
  EXPECT_EQ(e->boot_id().size(), 16u);
  EXPECT_NE(e->boot_id(), other->boot_id());
  EXPECT_EQ(e->State().install_generation, 0);
  WeightFill failing = [](int, const RankLayout&, ParameterStore*) -> Status {
    return Internal("fill broke after writing part of rank 0");
  };
  EXPECT_EQ(e->InstallWeights(failing, "vX", 1).code(), StatusCode::kFailedPrecondition) << "not paused";
  EXPECT_EQ(e->State().install_generation, 0) << "refused before writing: unchanged";
  ASSERT_TRUE(e->Pause(PauseMode::kWait).ok());
  EXPECT_FALSE(e->InstallWeights(failing, "vX", 1).ok());
  EXPECT_EQ(e->State().install_generation, 1) << "the live weights may be partial: the generation moved";
  EXPECT_EQ(e->WeightVersion(), "default") << "the label is set only by a completed install";
  // A stale counter from the caller cannot move the generation backwards.
  EXPECT_FALSE(e->InstallWeights(failing, "vX", 1).ok());
  EXPECT_EQ(e->State().install_generation, 2);
  const std::string boot = e->boot_id();
  EXPECT_EQ(e->boot_id(), boot);
}

// Issue 13 #10: a reset that stays refused inside an install is not counted as a reset, and the
// install fails (after the weights were written) instead of claiming a clean install.
TEST(EngineTest, InstallCountsOnlyObservedCacheResets) {
  auto e = MakeEngine();
  const ModelSpec spec = e->spec();
  WeightFill fill = MakeWeightFill(spec, [spec]() -> Result<std::unique_ptr<TensorSource>> {
    return MakeDummySource(spec, 99);
  });
  // A keep-mode request holds blocks: the first reset is refused, the request is preempted and
  // the second reset succeeds: one reset, counted once.
  auto s = *e->AddRequest(Greedy(Prompt(9), 30));
  ASSERT_TRUE(e->Step());
  ASSERT_TRUE(e->Pause(PauseMode::kKeep).ok());
  ASSERT_GT(e->State().blocks_in_use, 0);
  ASSERT_TRUE(e->InstallWeights(fill, "v1", 1).ok());
  EXPECT_EQ(e->Metrics().cache_resets, 1);
  EXPECT_EQ(e->Metrics().cache_resets_refused, 0);
  EXPECT_EQ(e->State().weight_version, "v1");
  // Blocks held outside any request: even after preempting everything the reset is refused.
  EngineTestPeer::HoldBlockOutsideAnyRequest(e.get());
  Status st = e->InstallWeights(fill, "v2", 2);
  EXPECT_EQ(st.code(), StatusCode::kInternal) << st.ToString();
  EXPECT_NE(st.message().find("prefix cache could not be reset"), std::string::npos) << st.message();
  EXPECT_EQ(e->Metrics().cache_resets, 1) << "a refused reset is not a reset";
  EXPECT_EQ(e->Metrics().cache_resets_refused, 1);
  EXPECT_EQ(e->State().weight_version, "v1") << "label unchanged after a failed install";
  EXPECT_EQ(e->State().install_generation, 2) << "the weights were written: the install generation moved";
}

// Issue 13 #12 and #14: overflowing max_tokens, out-of-vocabulary stop ids and duplicate live
// request ids are refused, naming the field.
TEST(EngineTest, AdmissionRefusesOverflowOutOfVocabStopIdsAndDuplicateIds) {
  auto e = MakeEngine();
  GenerateRequest r = Greedy(Prompt(4), INT64_MAX);
  auto a = e->AddRequest(r);
  EXPECT_EQ(a.status().code(), StatusCode::kInvalidArgument) << a.status().ToString();
  EXPECT_NE(a.status().message().find("max_tokens"), std::string::npos) << a.status().message();
  r = Greedy(Prompt(4), INT64_MAX - 2);
  EXPECT_EQ(e->AddRequest(r).status().code(), StatusCode::kInvalidArgument);
  r = Greedy(Prompt(4), 3);
  r.sampling.stop_token_ids = {1, static_cast<int32_t>(e->spec().vocab_size)};
  auto b = e->AddRequest(r);
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument) << b.status().ToString();
  EXPECT_NE(b.status().message().find("stop_token_ids[1]"), std::string::npos) << b.status().message();
  r = Greedy(Prompt(4), 3);
  r.request_id = "same";
  auto first = e->AddRequest(r);
  ASSERT_TRUE(first.ok());
  auto second = e->AddRequest(r);
  EXPECT_EQ(second.status().code(), StatusCode::kAlreadyExists) << second.status().ToString();
  EXPECT_NE(second.status().message().find("request_id"), std::string::npos);
  RunToCompletion(e.get());
  EXPECT_EQ((*first)->Wait().tokens.size(), 3u);
  EXPECT_TRUE(e->AddRequest(r).ok()) << "a finished request's id can be reused";
  RunToCompletion(e.get());
  EXPECT_EQ(e->State().num_running + e->State().num_waiting, 0);
}

}  // namespace
TEST(EngineTest, AResumeThatOvertakesAPauseWaitWins) {
  auto e = MakeEngine();
  auto s = *e->AddRequest(Greedy(Prompt(11), 40));
  ASSERT_TRUE(e->Step());  // running; no loop, so it stays running until stepped
  auto pause = std::async(std::launch::async, [&] { return e->Pause(PauseMode::kWait); });
  for (int i = 0; i < 1000 && !e->IsPausedOrDraining(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_TRUE(e->IsPausedOrDraining());  // vLLM's /is_paused while draining
  EXPECT_FALSE(e->IsPaused());           // but no install may begin
  e->Resume();
  const Status st = pause.get();
  EXPECT_EQ(st.code(), StatusCode::kAborted) << st.ToString();
  EXPECT_FALSE(e->IsPausedOrDraining());
  // Serving goes on, and new requests are admitted.
  auto later = *e->AddRequest(Greedy(Prompt(4), 3));
  RunToCompletion(e.get());
  EXPECT_EQ(s->Wait().finish, FinishReason::kLength);
  EXPECT_EQ(later->Wait().finish, FinishReason::kLength);
}

TEST(EngineTest, AbortGetsInWhileTheLoopSteps) {
  auto e = MakeEngine();
  EngineLoop loop(e.get());
  loop.Start();
  for (int round = 0; round < 5; ++round) {
    auto r = Greedy(Prompt(7, round), e->max_model_len() - 7, -1);
    r.request_id = "long-" + std::to_string(round);
    auto s = *e->AddRequest(r);
    s->WaitFrom(0, std::chrono::seconds(10));  // generating
    // The abort takes step_mu_ between two steps (a PriorityLock), not after the request ended.
    EXPECT_EQ(e->Abort({r.request_id}), 1) << round;
    EXPECT_EQ(s->Wait().finish, FinishReason::kAbort) << round;
  }
  loop.Stop();
}

}  // namespace rc::engine
