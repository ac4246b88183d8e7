// Probe records: bounds and errors that name the bad field; JSON round trip (also through a
// manifest, which carries them only when present).
#include "rolloutcore/refit/probes.h"

#include <gtest/gtest.h>

#include <cmath>

#include "rolloutcore/refit/manifest.h"

namespace rc::refit {
namespace {

Probe Good() {
  Probe p;
  p.name = "p0";
  p.prompt = {1, 2, 3};
  p.top_k = 2;
  p.steps = {ProbeStep{7, -0.5f, {{7, -0.5f}, {9, -1.5f}}}};
  return p;
}

std::string Error(const std::vector<Probe>& probes) { return ValidateProbes(probes).message(); }

TEST(ProbesTest, ValidProbesRoundTrip) {
  std::vector<Probe> ps = {Good(), Good()};
  ps[1].name = "p1";
  ASSERT_TRUE(ValidateProbes(ps).ok());
  auto back = ProbesFromJson(ProbesToJson(ps));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ASSERT_EQ(back->size(), 2u);
  EXPECT_EQ((*back)[1].name, "p1");
  EXPECT_EQ((*back)[0].steps[0].top, ps[0].steps[0].top);
}

TEST(ProbesTest, BadFieldsAreNamed) {
  Probe p = Good();
  p.steps[0].top[1].second = std::nanf("");
  EXPECT_NE(Error({p}).find("probes[0].steps[0].top[1].logprob"), std::string::npos) << Error({p});
  p = Good();
  p.steps[0].logprob = 0.5f;
  EXPECT_NE(Error({p}).find("probes[0].steps[0].logprob"), std::string::npos) << Error({p});
  p = Good();
  p.top_k = 3;
  EXPECT_NE(Error({p}).find("probes[0].steps[0].top: 2 entries, top_k is 3"), std::string::npos) << Error({p});
  p = Good();
  p.prompt.clear();
  EXPECT_NE(Error({p}).find("probes[0].prompt"), std::string::npos);
  p = Good();
  p.prompt.assign(kMaxProbePromptTokens + 1, 1);
  EXPECT_NE(Error({p}).find("probes[0].prompt"), std::string::npos);
  p = Good();
  p.steps.assign(kMaxProbeSteps + 1, p.steps[0]);
  EXPECT_NE(Error({p}).find("probes[0].steps: must have 1..64"), std::string::npos) << Error({p});
  p = Good();
  p.steps[0].top = {{9, -1.5f}, {7, -0.5f}};
  EXPECT_NE(Error({p}).find("best first"), std::string::npos) << Error({p});
  p = Good();
  p.name = "a b";
  EXPECT_NE(Error({p}).find("probes[0].name"), std::string::npos);
  EXPECT_NE(Error({Good(), Good()}).find("probes[1].name: 'p0' appears twice"), std::string::npos);
  std::vector<Probe> many(kMaxProbes + 1, Good());
  for (size_t i = 0; i < many.size(); ++i) many[i].name = "p" + std::to_string(i);
  EXPECT_NE(Error(many).find("at most 16"), std::string::npos);
  auto parsed = ProbesFromJson(Json::array({Json{{"name", "x"}, {"prompt", {1, -4}}, {"steps", Json::array()}}}));
  EXPECT_NE(parsed.status().message().find("probes[0].prompt[1]"), std::string::npos) << parsed.status().ToString();
}

TEST(ProbesTest, ManifestCarriesProbesOnlyWhenPresent) {
  Manifest m;
  m.model = "m";
  m.version = "v1";
  EXPECT_FALSE(ManifestToJson(m).contains("probes"));
  m.probes = {Good()};
  Json j = ManifestToJson(m);
  ASSERT_TRUE(j.contains("probes"));
  auto back = ManifestFromJson(j);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ASSERT_EQ(back->probes.size(), 1u);
  EXPECT_EQ(back->probes[0].steps[0].token, 7);
  j["probes"][0]["top_k"] = 99;
  EXPECT_NE(ManifestFromJson(j).status().message().find("probes[0].top_k"), std::string::npos);
}

}  // namespace
}  // namespace rc::refit
