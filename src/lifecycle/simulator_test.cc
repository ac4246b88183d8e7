// Every example scenario's report matches the expectation written beside it, plus checks that
// need ordering across the journal.
#include "rolloutcore/lifecycle/simulator.h"

#include <gtest/gtest.h>

#include <filesystem>

namespace rc::lifecycle {
namespace {

namespace fs = std::filesystem;

std::vector<fs::path> Scenarios() {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator("examples/scenarios")) {
    std::string name = e.path().filename().string();
    if (e.path().extension() == ".json" && name.find(".expected.") == std::string::npos) out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST(SimulatorTest, EveryExampleMatchesItsExpectation) {
  auto scenarios = Scenarios();
  ASSERT_GE(scenarios.size(), 7u) << "run from the repository root";
  for (const auto& path : scenarios) {
    SCOPED_TRACE(path.string());
    auto expected_path = path;
    expected_path.replace_extension(".expected.json");
    ASSERT_TRUE(fs::exists(expected_path)) << "every scenario has its expected outcome beside it";
    auto scenario = ReadJsonFile(path.string());
    ASSERT_TRUE(scenario.ok()) << scenario.status().ToString();
    auto report = RunScenario(*scenario);
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    auto expected = ReadJsonFile(expected_path.string());
    ASSERT_TRUE(expected.ok());
    Status m = MatchExpected(*report, *expected);
    EXPECT_TRUE(m.ok()) << m.message();
    // Whatever the scenario, these invariants hold.
    EXPECT_TRUE((*report)["checks"]["no_binding_spans_mutation"].get<bool>());
    EXPECT_TRUE((*report)["checks"]["every_admitted_rollout_accounted"].get<bool>());
    for (const auto& u : (*report)["updates"]) {
      if (u["outcome"] == "committed") {
        EXPECT_TRUE(u["reason"].get<std::string>().empty());
      }
    }
  }
}

int64_t SeqOf(const Json& journal, const std::string& event, const std::string& rollout = "") {
  for (const auto& r : journal) {
    if (r["event"] == event && (rollout.empty() || r["rollout"] == rollout)) return r["seq"].get<int64_t>();
  }
  return -1;
}

TEST(SimulatorTest, LiveRolloutFinishesBeforeInstallBegins) {
  auto report = RunScenario(ReadJsonFile("examples/scenarios/live_rollout_during_update.json").value()).value();
  const Json& j = report["journal"];
  int64_t finish = SeqOf(j, "finish", "r1");
  int64_t install = SeqOf(j, "begin_install");
  ASSERT_GT(finish, 0);
  ASSERT_GT(install, 0);
  EXPECT_LT(finish, install);
  EXPECT_LT(SeqOf(j, "request_update"), finish) << "the update was requested while r1 was live";
}

TEST(SimulatorTest, HungInstallNeverCommits) {
  auto report = RunScenario(ReadJsonFile("examples/scenarios/install_hang.json").value()).value();
  EXPECT_EQ(SeqOf(report["journal"], "resumed"), -1);
  EXPECT_EQ(report["final"]["state"], "TAINTED");
  EXPECT_LE(report["updates"][0]["phases_ms"]["UPDATING"].get<int64_t>(), 1100);
}

TEST(SimulatorTest, ErrorsNameTheField) {
  auto r = RunScenario(ParseJson(R"({"initial": {"label": "a"}, "events": [{"at_ms": -3, "admit": "r"}]})").value());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("events[0].at_ms"), std::string::npos) << r.status().message();
  r = RunScenario(ParseJson(R"({"initial": {"label": "a"}, "engine": {"ops": {"install": {"behavior": "explode"}}}})").value());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("engine.ops.install.behavior"), std::string::npos) << r.status().message();
  r = RunScenario(ParseJson(R"({"initial": {"label": "a"}, "drain_policy": "later"})").value());
  EXPECT_FALSE(r.ok());
  r = RunScenario(ParseJson(R"({"initial": {"label": "a"}, "events": [{"at_ms": 1}]})").value());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("exactly one"), std::string::npos);
}

TEST(MatchExpectedTest, OperatorsAndMismatchPaths) {
  Json actual = ParseJson(R"({"a": [1, 2], "b": {"c": "hello world", "n": 5}})").value();
  EXPECT_TRUE(MatchExpected(actual, ParseJson(R"({"b": {"c": {"$contains": "world"}, "n": {"$ge": 5, "$le": 5}}})").value()).ok());
  EXPECT_TRUE(MatchExpected(actual, ParseJson(R"({"a": {"$len": 2}})").value()).ok());
  EXPECT_TRUE(MatchExpected(actual, ParseJson(R"({"a": {"$any": 2}})").value()).ok());
  Status s = MatchExpected(actual, ParseJson(R"({"b": {"n": {"$le": 4}}})").value());
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("$.b.n"), std::string::npos);
  EXPECT_FALSE(MatchExpected(actual, ParseJson(R"({"a": [1]})").value()).ok());
  EXPECT_FALSE(MatchExpected(actual, ParseJson(R"({"z": 1})").value()).ok());
}

}  // namespace
}  // namespace rc::lifecycle
