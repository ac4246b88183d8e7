// The choice between a full and a delta stage (refit_choice.h): the policies, the first choices
// before anything is measured, the measured rule (cheaper estimate wins, scaled by the version's
// own work), transports kept apart, the weighted mean, and the evidence it leaves.
#include "rolloutcore/receiver/refit_choice.h"

#include <gtest/gtest.h>

#include <string>

namespace rc::receiver {
namespace {

// A 16 MB model at 1 % changed bf16 elements: ~2 % of the bytes as a delta.
constexpr RefitWork kWork{.full_bytes = 16'000'000, .delta_bytes = 320'000, .changed = 80'000};

TEST(RefitChoiceTest, PoliciesParseAndNameThemselves) {
  for (const char* name : {"auto", "always", "never"}) {
    auto p = ParseDeltaPolicy(name);
    ASSERT_TRUE(p.ok()) << name;
    EXPECT_EQ(DeltaPolicyName(*p), name);
  }
  auto bad = ParseDeltaPolicy("sometimes");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().ToString().find("'sometimes'"), std::string::npos) << bad.status().ToString();
  EXPECT_NE(bad.status().ToString().find("auto, always or never"), std::string::npos);
}

TEST(RefitChoiceTest, NeverAndAlwaysIgnoreTheMeasurements) {
  RefitCostModel m;
  m.RecordFull("shm", kWork, 1.0);     // full very cheap
  m.RecordDelta("shm", kWork, 100.0);  // delta very dear
  const DeltaChoice always = m.Choose(DeltaPolicy::kAlways, "shm", kWork);
  EXPECT_TRUE(always.delta);
  EXPECT_EQ(always.reason, "delta policy always");
  const DeltaChoice never = m.Choose(DeltaPolicy::kNever, "shm", kWork);
  EXPECT_FALSE(never.delta);
  EXPECT_NE(never.reason.find("never"), std::string::npos);
  // The estimates are still reported.
  EXPECT_DOUBLE_EQ(never.full_ms, 1.0);
  EXPECT_DOUBLE_EQ(never.delta_ms, 100.0);
}

TEST(RefitChoiceTest, UnmeasuredSideGetsTheModeThatMovesFewerBytes) {
  RefitCostModel m;
  DeltaChoice c = m.Choose(DeltaPolicy::kAuto, "ucx", kWork);
  EXPECT_TRUE(c.delta) << c.reason;
  EXPECT_NE(c.reason.find("neither mode not measured"), std::string::npos) << c.reason;
  EXPECT_LT(c.full_ms, 0);
  EXPECT_LT(c.delta_ms, 0);
  // Full measured, delta not: the delta is tried (and so measured) the first time it is eligible.
  m.RecordFull("ucx", kWork, 0.5);
  c = m.Choose(DeltaPolicy::kAuto, "ucx", kWork);
  EXPECT_TRUE(c.delta) << c.reason;
  EXPECT_NE(c.reason.find("the delta stage not measured yet"), std::string::npos) << c.reason;
  EXPECT_DOUBLE_EQ(c.full_ms, 0.5);
  // A "delta" payload larger than the full bytes (nearly everything changed): full.
  RefitWork dense = kWork;
  dense.delta_bytes = dense.full_bytes + 1;
  EXPECT_FALSE(m.Choose(DeltaPolicy::kAuto, "ucx", dense).delta);
}

TEST(RefitChoiceTest, MeasuredCostsPickTheCheaperAndScaleWithTheVersion) {
  RefitCostModel m;
  // Wire-bound: full pulls 16 MB in 40 ms, the delta's 80k changes cost 6 ms -> delta.
  m.RecordFull("ucx", kWork, 40.0);
  m.RecordDelta("ucx", kWork, 6.0);
  DeltaChoice c = m.Choose(DeltaPolicy::kAuto, "ucx", kWork);
  EXPECT_TRUE(c.delta) << c.reason;
  EXPECT_DOUBLE_EQ(c.full_ms, 40.0);
  EXPECT_DOUBLE_EQ(c.delta_ms, 6.0);
  EXPECT_EQ(c.full_samples, 1);
  EXPECT_EQ(c.delta_samples, 1);
  EXPECT_NE(c.reason.find("delta estimated 6.000 ms against full 40.000 ms"), std::string::npos) << c.reason;
  // Ten times the changes: the delta estimate scales to 60 ms and full wins.
  RefitWork busy = kWork;
  busy.changed *= 10;
  busy.delta_bytes *= 10;
  c = m.Choose(DeltaPolicy::kAuto, "ucx", busy);
  EXPECT_FALSE(c.delta) << c.reason;
  EXPECT_DOUBLE_EQ(c.delta_ms, 60.0);
  EXPECT_NE(c.reason.find("full estimated 40.000 ms against delta 60.000 ms"), std::string::npos) << c.reason;
  // Same-device copy (cuda_ipc-like: the wire costs nothing): full is cheaper than decoding.
  m.RecordFull("fast", kWork, 2.0);
  m.RecordDelta("fast", kWork, 5.0);
  EXPECT_FALSE(m.Choose(DeltaPolicy::kAuto, "fast", kWork).delta);
  // Equal estimates: delta (fewer bytes moved, nothing lost).
  m.RecordFull("tie", kWork, 3.0);
  m.RecordDelta("tie", kWork, 3.0);
  EXPECT_TRUE(m.Choose(DeltaPolicy::kAuto, "tie", kWork).delta);
}

TEST(RefitChoiceTest, TransportsAreMeasuredApart) {
  RefitCostModel m;
  m.RecordFull("shm", kWork, 2.0);
  m.RecordDelta("shm", kWork, 5.0);
  EXPECT_FALSE(m.Choose(DeltaPolicy::kAuto, "shm", kWork).delta);
  // Nothing measured on ucx: the shm figures do not leak into its choice.
  const DeltaChoice ucx = m.Choose(DeltaPolicy::kAuto, "ucx", kWork);
  EXPECT_TRUE(ucx.delta);
  EXPECT_EQ(ucx.full_samples, 0);
  EXPECT_EQ(ucx.delta_samples, 0);
}

TEST(RefitChoiceTest, NewerStagesWeighMoreAndEmptyVersionsTeachNothing) {
  RefitCostModel m;
  m.RecordFull("shm", kWork, 10.0);
  m.RecordFull("shm", kWork, 20.0);  // weight 0.5: 15
  m.RecordDelta("shm", kWork, 12.0);
  DeltaChoice c = m.Choose(DeltaPolicy::kAuto, "shm", kWork);
  EXPECT_DOUBLE_EQ(c.full_ms, 15.0);
  EXPECT_EQ(c.full_samples, 2);
  EXPECT_TRUE(c.delta);
  m.RecordDelta("shm", kWork, 24.0);  // 18 > 15: full now
  c = m.Choose(DeltaPolicy::kAuto, "shm", kWork);
  EXPECT_DOUBLE_EQ(c.delta_ms, 18.0);
  EXPECT_FALSE(c.delta);
  // A version without changes or bytes says nothing about the rates.
  m.RecordDelta("shm", RefitWork{}, 1000.0);
  m.RecordFull("shm", RefitWork{}, 1000.0);
  c = m.Choose(DeltaPolicy::kAuto, "shm", kWork);
  EXPECT_DOUBLE_EQ(c.delta_ms, 18.0);
  EXPECT_DOUBLE_EQ(c.full_ms, 15.0);
  EXPECT_EQ(c.delta_samples, 2);
}

TEST(RefitChoiceTest, TheEvidenceNamesPolicyModeEstimatesAndSamples) {
  RefitCostModel m;
  Json j = m.Choose(DeltaPolicy::kAuto, "shm", kWork).ToJson();
  EXPECT_EQ(j["policy"], "auto");
  EXPECT_EQ(j["mode"], "delta");
  EXPECT_TRUE(j["estimated_full_ms"].is_null());
  EXPECT_TRUE(j["estimated_delta_ms"].is_null());
  EXPECT_EQ(j["full_samples"], 0);
  m.RecordFull("shm", kWork, 2.0);
  m.RecordDelta("shm", kWork, 5.0);
  j = m.Choose(DeltaPolicy::kAuto, "shm", kWork).ToJson();
  EXPECT_EQ(j["mode"], "full");
  EXPECT_DOUBLE_EQ(j["estimated_full_ms"].get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(j["estimated_delta_ms"].get<double>(), 5.0);
  EXPECT_EQ(j["delta_samples"], 1);
  EXPECT_FALSE(j["reason"].get<std::string>().empty());
}

TEST(RefitChoiceTest, WorkOfSumsTheManifestsShards) {
  refit::Manifest m;
  refit::ShardTable t;
  t.name = "w";
  t.dtype = refit::DType::kBF16;
  t.shape = {4, 8};
  refit::ShardInfo a;
  a.offset = {0, 0};
  a.shape = {2, 8};
  a.delta = refit::ShardDelta{};
  a.delta->bytes = 40;
  a.delta->changed = 3;
  refit::ShardInfo b = a;
  b.offset = {2, 0};
  b.delta->bytes = 24;
  b.delta->changed = 2;
  t.shards = {a, b};
  m.tables.push_back(t);
  const RefitWork w = WorkOf(m);
  EXPECT_EQ(w.full_bytes, 4u * 8u * 2u);
  EXPECT_EQ(w.delta_bytes, 64u);
  EXPECT_EQ(w.changed, 5);
}

}  // namespace
}  // namespace rc::receiver
