#include "rolloutcore/refit/spec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "rolloutcore/refit/planner.h"
#include "rolloutcore/refit/verify.h"

namespace rc::refit {
namespace {

using ::testing::HasSubstr;

constexpr const char* kTransposeSpec = R"({
  "tensors": [{"name": "w", "dtype": "bf16", "shape": [8, 4],
               "shards": [{"rank": 0, "offset": [0, 0], "shape": [4, 4]},
                          {"rank": 1, "offset": [4, 0], "shape": [4, 4]}]}],
  "targets": [{"name": "w_t", "dtype": "f32", "shape": [4, 8], "convert": true,
               "copies": [{"source": "w", "ops": [["narrow", 0, 0, 8], ["permute", [1, 0]]],
                           "dest_offset": 0, "dest_shape": [4, 8], "dest_strides": [8, 1]}]},
              {"name": "rows", "dtype": "bf16", "shape": [2, 1, 4],
               "copies": [{"source": "w", "ops": [["chunk", 4, 0, 3], ["unsqueeze", 1]]}]}]
})";

TEST(SpecTest, ParsesCapturesPlansAndVerifies) {
  auto spec = ParsePlanSpecText(kTransposeSpec);
  ASSERT_TRUE(spec.ok()) << spec.status().ToString();
  ASSERT_EQ(spec->targets.size(), 2u);
  EXPECT_EQ(spec->targets[0].copies[0].ops.size(), 2u);
  auto cap = CaptureSpec(*spec);
  ASSERT_TRUE(cap.ok()) << cap.status().ToString();
  ASSERT_EQ(cap->copies.size(), 2u);
  EXPECT_EQ(cap->copies[1].box, (Box{{6, 0}, {2, 4}}));
  auto plan = BuildPlan(*cap, SpecManifest(*spec));
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->stats.bytes_needed, 8u * 4 * 2 + 2u * 4 * 2);
  auto report = Verify(SpecVerifyProblem(*spec), VerifyOptions{});
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_TRUE(report->verified()) << report->ranks[0].mismatch << report->digest_mismatch;
}

TEST(SpecTest, ParseErrorsNameTheTensorAndField) {
  auto e = ParsePlanSpecText(R"({"tensors": [{"name": "w", "dtype": "bf17", "shape": [2], "shards": []}], "targets": []})");
  EXPECT_THAT(e.status().message(), HasSubstr("tensor w"));
  e = ParsePlanSpecText(R"({"tensors": [], "targets": [{"name": "t", "dtype": "f32", "shape": [2],
      "copies": [{"source": "w", "ops": [["frobnicate", 1]]}]}]})");
  EXPECT_THAT(e.status().message(), HasSubstr("target t copies[0] ops[0]: unknown op 'frobnicate'"));
  e = ParsePlanSpecText(R"({"tensors": [], "targets": [{"name": "t", "dtype": "f32", "shape": [2],
      "copies": [{"source": "w", "ops": [["narrow", 0, 1]]}]}]})");
  EXPECT_THAT(e.status().message(), HasSubstr("'narrow' takes 3 argument(s)"));
  e = ParsePlanSpecText(R"({"tensors": [{"name": "w", "dtype": "f32", "shape": [-2], "shards": []}], "targets": []})");
  EXPECT_THAT(e.status().message(), HasSubstr("tensor w: dim 0 has negative extent"));
  e = ParsePlanSpecText(R"({"tensors": [], "targets": [], "extra": 1})");
  EXPECT_THAT(e.status().message(), HasSubstr("extra: unknown field"));
  e = ParsePlanSpecText("{not json");
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
}

TEST(SpecTest, PlannerRefusalsFromSpecsNameTheTensor) {
  auto spec = ParsePlanSpecText(R"({
    "tensors": [{"name": "w", "dtype": "f32", "shape": [4, 4],
                 "shards": [{"rank": 0, "offset": [0, 0], "shape": [4, 4]}]}],
    "targets": [{"name": "flat", "dtype": "f32", "shape": [16],
                 "copies": [{"source": "w", "ops": [["reshape", [16]]], "dest_shape": [16]}]}]})");
  ASSERT_TRUE(spec.ok());
  auto cap = CaptureSpec(*spec);
  ASSERT_TRUE(cap.ok());
  Status s = BuildPlan(*cap, SpecManifest(*spec)).status();
  EXPECT_THAT(s.message(), HasSubstr("tensor w: unsupported view into flat: reshape [4, 4] -> [16] merges dimensions"));
  auto missing = ParsePlanSpecText(R"({"tensors": [], "targets": [{"name": "t", "dtype": "f32", "shape": [2],
      "copies": [{"source": "nope"}]}]})");
  ASSERT_TRUE(missing.ok());
  EXPECT_THAT(CaptureSpec(*missing).status().message(), HasSubstr("source tensor nope is not known"));
}

}  // namespace
}  // namespace rc::refit
