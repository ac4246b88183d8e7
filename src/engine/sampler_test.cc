#include "rolloutcore/engine/sampler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <set>

namespace rc::engine {
namespace {

TEST(SamplerTest, GreedyPicksArgmaxLowestIdOnTies) {
  std::vector<float> l = {0.1f, 2.f, 2.f, -1.f};
  SamplingParams p;
  p.temperature = 0;
  p.num_logprobs = 2;
  SamplerRng rng(1);
  auto r = Sample(l, p, &rng);
  EXPECT_EQ(r.token, 1);
  ASSERT_EQ(r.top_logprobs.size(), 2u);
  EXPECT_EQ(r.top_logprobs[0].first, 1);
  EXPECT_EQ(r.top_logprobs[1].first, 2);
  double sum = 0;
  for (float v : LogSoftmax(l)) sum += std::exp(v);
  EXPECT_NEAR(sum, 1.0, 1e-6);
}

TEST(SamplerTest, SeededSamplingIsReproducibleAndFiltersApply) {
  std::vector<float> l = {1.f, 1.5f, 0.2f, 1.4f, -3.f};
  SamplingParams p;
  p.temperature = 1.0;
  std::vector<int32_t> a, b;
  SamplerRng r1(42), r2(42);
  for (int i = 0; i < 50; ++i) {
    a.push_back(Sample(l, p, &r1).token);
    b.push_back(Sample(l, p, &r2).token);
  }
  EXPECT_EQ(a, b);
  EXPECT_GT(std::set<int32_t>(a.begin(), a.end()).size(), 1u);
  p.top_k = 2;
  SamplerRng r3(7);
  for (int i = 0; i < 50; ++i) {
    int32_t t = Sample(l, p, &r3).token;
    EXPECT_TRUE(t == 1 || t == 3);
  }
  p.top_k = -1;
  p.top_p = 0.01;
  for (int i = 0; i < 20; ++i) EXPECT_EQ(Sample(l, p, &r3).token, 1);
}

}  // namespace
}  // namespace rc::engine
