// The synthetic trainer's probes: deterministic per (config, seed, step), different per version,
// and equal to what an engine that loads the version's export from disk computes.
#include "rolloutcore/trainer/probes.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "rolloutcore/engine/engine.h"
#include "rolloutcore/engine/loader.h"
#include "rolloutcore/trainer/export.h"

namespace rc::trainer {
namespace {

TEST(SyntheticProbesTest, MatchAnEngineLoadedFromTheExportAndChangeWithTheVersion) {
  const refit::ModelConfig config = *refit::ModelPreset("tiny");
  SyntheticWeights w;
  w.seed = 5;
  w.lr = 0.05f;
  ProbeOptions o;
  o.count = 2;
  o.tokens = 6;
  o.top_k = 4;
  auto a = ComputeSyntheticProbes(config, w, 2, o);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_EQ(a->size(), 2u);
  EXPECT_EQ((*a)[1].name, "p1");
  EXPECT_EQ((*a)[0].steps.size(), 6u);
  EXPECT_NE((*a)[0].prompt, (*a)[1].prompt);
  auto again = ComputeSyntheticProbes(config, w, 2, o);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(refit::ProbesToJson(*a), refit::ProbesToJson(*again)) << "deterministic";
  auto other = ComputeSyntheticProbes(config, w, 3, o);
  ASSERT_TRUE(other.ok());
  EXPECT_NE(refit::ProbesToJson(*a), refit::ProbesToJson(*other)) << "another version, other numbers";

  const std::string dir =
      (std::filesystem::temp_directory_path() / ("rc_probes_" + std::to_string(::getpid()))).string();
  ASSERT_TRUE(ExportVersion(config, w, 2, dir).ok());
  engine::EngineOptions eo;
  eo.num_threads = 1;
  auto e = engine::CreateEngine({dir, "auto", 0}, eo);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  ASSERT_TRUE((*e)->Pause(engine::PauseMode::kAbort).ok());
  for (const refit::Probe& p : *a) {
    auto r = (*e)->Replay(p.prompt, static_cast<int64_t>(p.steps.size()), p.top_k);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    for (size_t s = 0; s < p.steps.size(); ++s) {
      EXPECT_EQ(r->steps[s].token, p.steps[s].token) << p.name << " step " << s;
      EXPECT_EQ(r->steps[s].logprob, p.steps[s].logprob) << p.name << " step " << s;
      EXPECT_EQ(r->steps[s].top_logprobs, p.steps[s].top) << p.name << " step " << s;
    }
  }
  std::filesystem::remove_all(dir);
  o.tokens = 0;
  EXPECT_NE(ComputeSyntheticProbes(config, w, 2, o).status().message().find("probe_tokens"), std::string::npos);
}

}  // namespace
}  // namespace rc::trainer
