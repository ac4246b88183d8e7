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
  std::vector<std::byte> out(size_t{8} * 4 * 4);
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


// Instruments the real host memory: what the wave loop asks of a PlanMemory, in order.
class RecordingMemory final : public PlanMemory {
 public:
  std::string_view buffer_noun() const override { return host_.buffer_noun(); }
  uint64_t staging_alignment() const override { return host_.staging_alignment(); }
  Result<std::byte*> AllocateStaging(uint64_t bytes) override {
    staging_requests.push_back(bytes);
    return host_.AllocateStaging(bytes);
  }
  Status Install(const TransferPlan& plan, size_t begin, size_t end, std::span<std::byte* const> ptr) override {
    installs.emplace_back(begin, end);
    return host_.Install(plan, begin, end, ptr);
  }
  Status CopyToHost(void* dst, const std::byte* src, uint64_t n) override { return host_.CopyToHost(dst, src, n); }
  Result<TensorDigests> Digest(const Capture& c, const DestinationBuffers& b,
                               std::span<const DigestRegion> r) override {
    return host_.Digest(c, b, r);
  }
  std::vector<uint64_t> staging_requests;
  std::vector<std::pair<size_t, size_t>> installs;

 private:
  HostPlanMemory host_;
};

// bf16 shards installed as f32 parameters: every read goes through staging and an install step.
TEST(ExecutorTest, OneWaveLoopServesAnyMemoryAndHonoursTheStagingBudget) {
  World w;
  std::vector<TensorSpec> params;
  // (Names built with std::string::append: GCC 12 at -O3 reports a false -Wrestrict for
  // "literal" + std::to_string(i) here.)
  auto named = [](const char* prefix, int i) { return std::string(prefix).append(std::to_string(i)); };
  for (int i = 0; i < 3; ++i) {
    w.AddTensor(named("w", i), DType::kBF16, {64, 32}, SplitShards({64, 32}, 0, 4));
    params.push_back({named("out", i), DType::kF32, {64, 32}});
  }
  CaptureContext ctx(w.Sources(), params);
  for (int i = 0; i < 3; ++i) {
    auto v = ctx.Source(named("w", i));
    ASSERT_TRUE(v.ok());
    ASSERT_TRUE(ctx.CopyInto(*v, DestRegion::Whole(named("out", i), {64, 32}, /*convert=*/true)).ok());
  }
  auto plan = BuildPlan(ctx.capture(), w.manifest());
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  ASSERT_GE(plan->installs.size(), 3u);

  // The reference: ExecutePlan, one wave.
  std::vector<std::byte> one(size_t{3} * 64 * 32 * 4);
  auto views = [](std::vector<std::byte>& all) {
    DestinationBuffers b;
    for (size_t i = 0; i < 3; ++i) {
      b.emplace("out" + std::to_string(i), std::span<std::byte>(all).subspan(i * 8192, 8192));
    }
    return b;
  };
  DestinationBuffers one_bufs = views(one);
  auto one_stats = ExecutePlan(*plan, w.transport(), one_bufs);
  ASSERT_TRUE(one_stats.ok()) << one_stats.status().ToString();
  EXPECT_EQ(one_stats->waves, 1u);

  // The same loop over an instrumented memory with a budget of one step's staging per wave.
  ImportCache imports(w.transport());
  auto remotes = ImportPlanSources(*plan, imports);
  ASSERT_TRUE(remotes.ok()) << remotes.status().ToString();
  std::vector<std::byte> waved(one.size());
  DestinationBuffers waved_bufs = views(waved);
  RecordingMemory memory;
  auto stats = ExecuteWaves(*plan, w.transport(), *remotes, waved_bufs, memory, INT64_MAX, 1);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_EQ(waved, one);
  EXPECT_EQ(stats->waves, plan->installs.size());
  EXPECT_EQ(stats->installs, plan->installs.size());
  EXPECT_EQ(stats->bytes_read, one_stats->bytes_read);
  ASSERT_EQ(memory.installs.size(), plan->installs.size());
  ASSERT_EQ(memory.staging_requests.size(), plan->installs.size());
  for (size_t i = 0; i < memory.installs.size(); ++i) {
    EXPECT_EQ(memory.installs[i], std::make_pair(i, i + 1));
    const uint64_t b = plan->buffers[plan->installs[i].staging].bytes;
    EXPECT_EQ(memory.staging_requests[i], (b + 63) / 64 * 64);
  }
  // The memory's digest is the CPU digest of what was installed.
  const std::vector<const Capture*> ranks = {&ctx.capture()};
  const std::vector<DigestRegion> regions = AssignDigestOwnership(ranks)[0];
  auto via_memory = memory.Digest(ctx.capture(), waved_bufs, regions);
  auto direct = DigestInstalled(ctx.capture(), waved_bufs, regions);
  ASSERT_TRUE(via_memory.ok() && direct.ok());
  EXPECT_EQ(*via_memory, *direct);
  // Remotes that do not match the plan are refused before anything moves.
  std::vector<transport::RemoteMemory> short_remotes(remotes->begin(), remotes->end() - 1);
  auto bad = ExecuteWaves(*plan, w.transport(), short_remotes, waved_bufs, memory, INT64_MAX, 1);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rc::refit
