// Parity with Hugging Face Transformers: loads each fixture folder written by
// tests/engine/make_parity_fixture.py (tests/engine/fixtures/<arch>/: config.json,
// model.safetensors, expected.json) and checks greedy tokens and top-5 logprobs. Steps are
// compared up to (not including) the first one where Transformers' top-2 logprob margin is
// under 1e-3, since a near tie may legitimately flip between implementations.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>

#include "rolloutcore/base/json.h"
#include "rolloutcore/engine/loader.h"

namespace rc::engine {
namespace {

// Issue 15's bound ("top-5 logprobs equal Hugging Face within 1e-4"); the committed fixtures
// differ by at most ~1e-5 at tp 1 and 2.
constexpr double kLogprobTol = 1e-4;
constexpr double kMinMargin = 1e-3;

class ParityTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ParityTest, GreedyTokensAndTop5LogprobsMatchTransformers) {
  const std::string dir = std::string(ROLLOUTCORE_SOURCE_DIR) + "/tests/engine/fixtures/" + GetParam();
  if (!std::filesystem::exists(dir + "/expected.json")) {
    GTEST_SKIP() << "fixture folder " << dir
                 << " is missing: run tests/engine/make_parity_fixture.py (needs torch + transformers)";
  }
  auto expected = ReadJsonFile(dir + "/expected.json");
  ASSERT_TRUE(expected.ok()) << expected.status().ToString();
  for (int tp : {1, 2}) {
    EngineOptions o;
    o.num_threads = 2;
    o.tensor_parallel_size = tp;
    auto engine = CreateEngine({dir, "auto", 0}, o);
    if (!engine.ok() && tp > 1) continue;  // layout does not divide at this tp
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    int compared_steps = 0;
    double max_diff = 0;
    for (const Json& c : (*expected)["cases"]) {
      GenerateRequest r;
      r.prompt = c["prompt"].get<std::vector<int32_t>>();
      r.sampling.temperature = 0;
      r.sampling.max_tokens = static_cast<int64_t>(c["tokens"].size());
      r.sampling.num_logprobs = 10;
      r.sampling.ignore_eos = true;
      auto s = (*engine)->AddRequest(r);
      ASSERT_TRUE(s.ok()) << s.status().ToString();
      while ((*engine)->Step()) {
      }
      auto snap = (*s)->Wait();
      const auto tokens = c["tokens"].get<std::vector<int32_t>>();
      const auto margins = c["margins"].get<std::vector<double>>();
      for (size_t i = 0; i < tokens.size(); ++i) {
        if (margins[i] < kMinMargin) break;
        SCOPED_TRACE("tp " + std::to_string(tp) + ", prompt of " + std::to_string(r.prompt.size()) +
                     " tokens, step " + std::to_string(i));
        ASSERT_LT(i, snap.tokens.size());
        ASSERT_EQ(snap.tokens[i], tokens[i]);
        std::map<int32_t, float> ours(snap.top_logprobs[i].begin(), snap.top_logprobs[i].end());
        for (const Json& e : c["top5"][i]) {
          const int32_t id = e[0].get<int32_t>();
          const double lp = e[1].get<double>();
          ASSERT_TRUE(ours.count(id)) << "token " << id << " missing from the engine's top-10";
          EXPECT_NEAR(ours[id], lp, kLogprobTol) << "token " << id;
          max_diff = std::max(max_diff, std::abs(ours[id] - lp));
        }
        ++compared_steps;
      }
      // Later steps of this prompt are not compared once a near tie was hit.
    }
    EXPECT_GT(compared_steps, 0);
    std::printf("[ parity ] %s tp=%d: %d steps compared, max |logprob diff| %.2e\n", GetParam().c_str(), tp,
                compared_steps, max_diff);
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ParityTest, ::testing::Values("qwen3", "qwen2", "llama"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
}  // namespace rc::engine
