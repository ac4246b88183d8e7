// `rolloutcore plan-fleet` as a user runs it: a small MoE config through the real binary, JSON
// totals checked against each other and against the model, a links file, and bad input refused.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>

#include "rolloutcore/base/json.h"

namespace rc {
namespace {

struct Output {
  int code = -1;
  std::string out;
};

Output RunPlanFleet(const std::string& args) {
  Output o;
  FILE* p = ::popen((std::string(ROLLOUTCORE_BIN) + " plan-fleet " + args + " 2>&1").c_str(), "r");
  if (p == nullptr) return o;
  char buf[4096];
  size_t n = 0;
  while ((n = ::fread(buf, 1, sizeof buf, p)) > 0) o.out.append(buf, n);
  const int status = ::pclose(p);
  o.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return o;
}

uint64_t Sum(const Json& a) {
  uint64_t s = 0;
  for (const Json& x : a) s += x.get<uint64_t>();
  return s;
}

TEST(PlanFleetCliTest, TotalsAddUpForASmallMoeFleet) {
  const std::string links = (std::filesystem::temp_directory_path() / "rc_plan_fleet_links.txt").string();
  {
    std::ofstream f(links);
    f << "# two GPUs per node, one 100 Gb/s link on trainer nodes\ngpus_per_node 2\ntrainer 1x100\nengine 2x200\n";
  }
  Output o = RunPlanFleet("--model tiny-moe --trainer fsdp:4 --engines 3xtp:2+ep:2@bf16 --links " + links + " --json");
  ASSERT_EQ(o.code, 0) << o.out;
  auto j = ParseJson(o.out);
  ASSERT_TRUE(j.ok()) << o.out;
  const Json& r = *j;
  EXPECT_EQ(r["receivers"], 6);
  EXPECT_EQ(r["distinct_plans"], 2) << "fsdp: one plan per engine rank, shared by the 3 replicas";
  const uint64_t total = r["total_bytes"].get<uint64_t>();
  EXPECT_EQ(Sum(r["receiver_bytes"]), total);
  EXPECT_EQ(Sum(r["source_bytes"]), total);
  EXPECT_EQ(Sum(r["receiver_descriptors"]), r["total_descriptors"].get<uint64_t>());
  // Each replica's ranks together pull at least the whole model (replicated parameters more).
  EXPECT_GE(total, 3 * r["model_bytes"].get<uint64_t>());
  // Receivers of the same engine rank in different replicas pull the same bytes.
  const Json& rb = r["receiver_bytes"];
  EXPECT_EQ(rb[0], rb[2]);
  EXPECT_EQ(rb[1], rb[5]);
  // Links: 4 trainer ranks on 2 nodes with one link each; 6 receivers on 3 nodes with 2 links.
  uint64_t trainer_links = 0, engine_links = 0;
  double worst = 0;
  for (const Json& l : r["link_loads"]) {
    (l["side"] == "trainer" ? trainer_links : engine_links) += l["bytes"].get<uint64_t>();
    worst = std::max(worst, l["seconds"].get<double>());
  }
  EXPECT_EQ(trainer_links, total);
  EXPECT_EQ(engine_links, total);
  EXPECT_EQ(r["link_loads"].size(), 2u + 6u);
  EXPECT_DOUBLE_EQ(r["lower_bound_s"].get<double>(), worst);
  EXPECT_EQ(r["bottleneck"]["side"], "trainer") << "one 100 Gb/s link per trainer node is the slowest";

  Output text = RunPlanFleet("--model tiny-moe --trainer fsdp:4 --engines 3xtp:2+ep:2@bf16");
  ASSERT_EQ(text.code, 0) << text.out;
  EXPECT_NE(text.out.find("lower bound"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("6 receiver ranks"), std::string::npos) << text.out;

  Output bad = RunPlanFleet("--model tiny-moe --trainer fsdp:4 --engines 3xtp:3");
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.out.find("not divisible by tp 3"), std::string::npos) << bad.out;
  std::filesystem::remove(links);
}

}  // namespace
}  // namespace rc
