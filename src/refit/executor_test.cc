#include "rolloutcore/refit/executor.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "refit/test_util.h"

namespace rc::refit {
namespace {

using ::testing::HasSubstr;
using testing::SplitShards;
using testing::World;

Result<TransferPlan> PlanWhole(World& w, const std::string& name, const Shape& shape, DType dt) {
  CaptureContext ctx(w.Sources(), {{"out", dt, shape}});
  RC_ASSIGN_OR_RETURN(SourceView v, ctx.Source(name));
  RC_RETURN_IF_ERROR(ctx.CopyInto(v, DestRegion::Whole("out", shape)));
  return BuildPlan(ctx.capture(), w.manifest());
}

TEST(ExecutorTest, BatchesPerSourceRankAndInstalls) {
  World w;
  w.AddTensor("w", DType::kF32, {8, 4}, SplitShards({8, 4}, 0, 4));
  auto plan = PlanWhole(w, "w", {8, 4}, DType::kF32);
  ASSERT_TRUE(plan.ok());
  std::vector<std::byte> out(8 * 4 * 4);
  DestinationBuffers bufs{{"out", std::span<std::byte>(out)}};
  auto stats = ExecutePlan(*plan, w.transport(), bufs);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_EQ(stats->batches, 4u);
  EXPECT_EQ(stats->bytes_read, 128u);
  EXPECT_EQ(out, w.Full("w"));
}

TEST(ExecutorTest, MissingBufferAndHandleAreRefused) {
  World w;
  w.AddTensor("w", DType::kF32, {8, 4}, SplitShards({8, 4}, 0, 2));
  auto plan = PlanWhole(w, "w", {8, 4}, DType::kF32);
  ASSERT_TRUE(plan.ok());
  std::vector<std::byte> small(16);
  DestinationBuffers bufs{{"out", std::span<std::byte>(small)}};
  auto r = ExecutePlan(*plan, w.transport(), bufs);
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("destination out: no buffer of 128 bytes"));
  TransferPlan no_handle = *plan;
  no_handle.sources[0].handle.clear();
  std::vector<std::byte> out(128);
  DestinationBuffers ok{{"out", std::span<std::byte>(out)}};
  r = ExecutePlan(no_handle, w.transport(), ok);
  EXPECT_THAT(r.status().message(), HasSubstr("tensor w: shard 0 of rank 0 has no memory handle"));
}

TEST(ExecutorTest, UnreachableRegionFailsTheTransfer) {
  World w;
  w.AddTensor("w", DType::kF32, {4, 4}, SplitShards({4, 4}, 0, 1));
  auto plan = PlanWhole(w, "w", {4, 4}, DType::kF32);
  ASSERT_TRUE(plan.ok());
  // Point the shard at a region that is registered but too small for the shard.
  std::vector<std::byte> tiny(8);
  auto reg = w.transport().RegisterMemory({tiny.data(), tiny.size()});
  ASSERT_TRUE(reg.ok());
  TransferPlan bad = *plan;
  bad.sources[0].handle = reg->descriptor;
  std::vector<std::byte> out(64);
  DestinationBuffers bufs{{"out", std::span<std::byte>(out)}};
  auto r = ExecutePlan(bad, w.transport(), bufs);
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("registered 8 bytes but holds 64"));
  ASSERT_TRUE(w.transport().Deregister(reg->id).ok());
  r = ExecutePlan(bad, w.transport(), bufs);
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(r.status().message(), HasSubstr("tensor w"));
}

}  // namespace
}  // namespace rc::refit
