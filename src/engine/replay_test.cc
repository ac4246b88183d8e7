// Engine::Replay: refuses unless paused, reproduces exactly what a greedy request with logprobs
// computes on the same weights, and leaves the prefix cache and frozen requests alone.
#include <gtest/gtest.h>

#include "rolloutcore/engine/engine.h"
#include "rolloutcore/engine/engine_loop.h"
#include "rolloutcore/engine/loader.h"

namespace rc::engine {
namespace {

std::unique_ptr<Engine> Make() {
  EngineOptions o;
  o.num_threads = 1;
  auto e = CreateEngine({"tiny", "dummy", 3}, o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return std::move(e).value();
}

std::vector<int32_t> Prompt() { return {5, 17, 42, 99, 3, 250, 7, 64, 33, 12, 8, 1, 200, 150, 90, 31, 77}; }

TEST(EngineReplayTest, RefusedWhileServingAndBadArgumentsNameTheField) {
  auto e = Make();
  auto r = e->Replay(Prompt(), 4, 3);
  ASSERT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().ToString();
  EXPECT_NE(r.status().message().find("paused"), std::string::npos);
  ASSERT_TRUE(e->Pause(PauseMode::kAbort).ok());
  EXPECT_NE(e->Replay({}, 4, 3).status().message().find("prompt"), std::string::npos);
  EXPECT_NE(e->Replay({1, 999999}, 4, 3).status().message().find("prompt[1]"), std::string::npos);
  EXPECT_NE(e->Replay(Prompt(), 0, 3).status().message().find("steps"), std::string::npos);
  EXPECT_NE(e->Replay(Prompt(), kMaxReplaySteps + 1, 3).status().message().find("steps"), std::string::npos);
  EXPECT_NE(e->Replay(Prompt(), 4, kMaxReplayTopK + 1).status().message().find("top_k"), std::string::npos);
}

TEST(EngineReplayTest, MatchesAGreedyRequestAndTouchesNoCache) {
  auto e = Make();
  EngineLoop loop(e.get());
  loop.Start();
  GenerateRequest g;
  g.prompt = Prompt();
  g.sampling.temperature = 0;
  g.sampling.num_logprobs = 5;
  g.sampling.max_tokens = 8;
  g.sampling.ignore_eos = true;
  auto stream = e->AddRequest(g);
  ASSERT_TRUE(stream.ok());
  RequestStream::Snapshot want = (*stream)->Wait();
  ASSERT_EQ(want.tokens.size(), 8u);

  ASSERT_TRUE(e->Pause(PauseMode::kWait).ok());
  const EngineState before = e->State();
  const EngineMetrics m0 = e->Metrics();
  ASSERT_GT(before.cached_blocks, 0) << "the request left its prompt blocks in the prefix cache";
  auto r = e->Replay(Prompt(), 8, 5);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->steps.size(), 8u);
  for (size_t i = 0; i < 8; ++i) {
    EXPECT_EQ(r->steps[i].token, want.tokens[i]) << "step " << i;
    EXPECT_EQ(r->steps[i].logprob, want.logprobs[i]) << "step " << i << ": same weights, same kernels, same numbers";
    ASSERT_EQ(r->steps[i].top_logprobs.size(), 5u);
    EXPECT_EQ(r->steps[i].top_logprobs, want.top_logprobs[i]) << "step " << i;
  }
  EXPECT_GT(r->elapsed_ms, 0);
  const EngineState after = e->State();
  EXPECT_EQ(after.cached_blocks, before.cached_blocks) << "nothing entered or left the prefix cache";
  EXPECT_EQ(after.blocks_in_use, before.blocks_in_use) << "every borrowed block went back";
  EXPECT_EQ(e->Metrics().prefix_cache_queries, m0.prefix_cache_queries) << "no request was admitted";
  EXPECT_EQ(e->Metrics().generation_tokens, m0.generation_tokens);
  EXPECT_TRUE(e->IsPaused());
  e->Resume();
  loop.Stop();
}

}  // namespace
}  // namespace rc::engine
