#include "rolloutcore/engine/kv_cache.h"

#include <gtest/gtest.h>

#include <numeric>

namespace rc::engine {
namespace {

KvGrant Admit(KvCacheManager& kv, int64_t id, const std::vector<int32_t>& tokens, std::string_view salt = "") {
  KvPlan plan;
  KvDemand d;
  d.seq_id = id;
  d.match_prefix = true;
  d.prefix_tokens = std::span<const int32_t>(tokens.data(), tokens.size() - 1);
  d.cache_salt = salt;
  d.need_tokens = static_cast<int64_t>(tokens.size());
  EXPECT_TRUE(kv.PlanDemand(d, &plan));
  kv.Apply(plan);
  return plan.grants[0];
}

std::vector<uint64_t> Hashes(const std::vector<int32_t>& tokens, int64_t bs, std::string_view salt = "") {
  std::vector<uint64_t> h;
  for (size_t b = 0; (b + 1) * bs <= tokens.size(); ++b) {
    h.push_back(KvBlockHash(h.empty() ? 0 : h.back(),
                            std::span<const int32_t>(tokens.data() + b * bs, static_cast<size_t>(bs)), salt));
  }
  return h;
}

TEST(KvCacheTest, PlanDoesNotMutateAndApplyAllocates) {
  KvCacheManager kv(8, 4, true);
  KvPlan plan;
  KvDemand d;
  d.need_tokens = 9;
  ASSERT_TRUE(kv.PlanDemand(d, &plan));
  EXPECT_EQ(kv.BlocksInUse(), 0);
  EXPECT_EQ(plan.grants[0].new_blocks.size(), 3u);
  KvDemand big;
  big.need_tokens = 4 * 6;  // 6 more blocks: only 5 left in this plan
  EXPECT_FALSE(kv.PlanDemand(big, &plan));
  EXPECT_EQ(plan.grants.size(), 1u);
  kv.Apply(plan);
  EXPECT_EQ(kv.BlocksInUse(), 3);
}

TEST(KvCacheTest, PrefixHitsRespectSaltAndRefCounts) {
  KvCacheManager kv(16, 4, true);
  std::vector<int32_t> t(10);
  std::iota(t.begin(), t.end(), 1);
  KvGrant a = Admit(kv, 1, t);
  EXPECT_TRUE(a.hit_blocks.empty());
  std::vector<int32_t> blocks = a.new_blocks;
  auto h = Hashes(t, 4);
  kv.RegisterFullBlocks(blocks, h, 0);
  EXPECT_EQ(kv.NumCachedBlocks(), 2);
  // Same prompt: both full blocks hit (and are shared while a still holds them).
  KvGrant b = Admit(kv, 2, t);
  EXPECT_EQ(b.hit_blocks, std::vector<int32_t>(blocks.begin(), blocks.begin() + 2));
  // Different salt: no hit.
  KvGrant c = Admit(kv, 3, t, "salt");
  EXPECT_TRUE(c.hit_blocks.empty());
  // Reset refuses while blocks are in use, and changes nothing.
  auto ev = kv.ResetPrefixCache();
  EXPECT_FALSE(ev.success);
  EXPECT_EQ(ev.freed_blocks, 0);
  EXPECT_GT(ev.blocks_in_use, 0);
  EXPECT_EQ(kv.NumCachedBlocks(), 2);
  kv.Release(blocks);
  std::vector<int32_t> bb = b.hit_blocks;
  bb.insert(bb.end(), b.new_blocks.begin(), b.new_blocks.end());
  kv.Release(bb);
  kv.Release(c.new_blocks);
  EXPECT_EQ(kv.BlocksInUse(), 0);
  // Freed cached blocks are revived by a later hit.
  KvGrant d = Admit(kv, 4, t);
  EXPECT_EQ(d.hit_blocks.size(), 2u);
  kv.Release(d.hit_blocks);
  kv.Release(d.new_blocks);
  ev = kv.ResetPrefixCache();
  EXPECT_TRUE(ev.success);
  EXPECT_EQ(ev.freed_blocks, 2);
  EXPECT_EQ(kv.NumCachedBlocks(), 0);
  EXPECT_TRUE(Admit(kv, 5, t).hit_blocks.empty());
}

TEST(KvCacheTest, EvictsLeastRecentlyReleasedCachedBlocks) {
  KvCacheManager kv(4, 2, true);
  std::vector<int32_t> p1 = {1, 2, 3}, p2 = {4, 5, 6};
  KvGrant a = Admit(kv, 1, p1);
  kv.RegisterFullBlocks(a.new_blocks, Hashes(p1, 2), 0);
  kv.Release(a.new_blocks);
  KvGrant b = Admit(kv, 2, p2);
  kv.RegisterFullBlocks(b.new_blocks, Hashes(p2, 2), 0);
  kv.Release(b.new_blocks);
  EXPECT_EQ(kv.NumCachedBlocks(), 2);
  // Needs 4 blocks: 2 free + evicts both cached ones.
  KvPlan plan;
  KvDemand d;
  d.need_tokens = 8;
  ASSERT_TRUE(kv.PlanDemand(d, &plan));
  kv.Apply(plan);
  EXPECT_EQ(kv.NumCachedBlocks(), 0);
  EXPECT_EQ(kv.BlocksInUse(), 4);
  kv.Release(plan.grants[0].new_blocks);
  // One cached block, then a 3-block demand evicts it only when needed.
  KvGrant c = Admit(kv, 3, p1);
  kv.RegisterFullBlocks(c.new_blocks, Hashes(p1, 2), 0);
  kv.Release(c.new_blocks);
  KvPlan plan2;
  KvDemand e;
  e.need_tokens = 6;
  ASSERT_TRUE(kv.PlanDemand(e, &plan2));
  EXPECT_EQ(plan2.evicted.size(), 0u);
  KvDemand f;
  f.need_tokens = 2;
  ASSERT_TRUE(kv.PlanDemand(f, &plan2));
  EXPECT_EQ(plan2.evicted.size(), 1u);
}

}  // namespace
}  // namespace rc::engine
