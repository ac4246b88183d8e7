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


// PlanRelease: a plan that releases blocks and then takes some gives exactly the blocks (and the
// hits, and the evictions) that releasing first and planning afterwards gives, and Apply leaves
// the same pool; nothing changes before Apply.
TEST(KvCacheTest, PlannedReleaseMatchesReleaseThenPlan) {
  auto build = [](KvCacheManager& kv, std::vector<int32_t>* a_blocks, std::vector<int32_t>* b_blocks,
                  const std::vector<int32_t>& shared) {
    // a: a cached prefix (2 hashed blocks) plus a tail; b shares a's first block; one more
    // hashed, evictable block from a finished request.
    KvGrant a = Admit(kv, 1, shared);
    kv.RegisterFullBlocks(a.new_blocks, Hashes(shared, 4), 0);
    *a_blocks = a.new_blocks;
    KvGrant b = Admit(kv, 2, std::vector<int32_t>(shared.begin(), shared.begin() + 6));
    *b_blocks = b.hit_blocks;
    b_blocks->insert(b_blocks->end(), b.new_blocks.begin(), b.new_blocks.end());
    std::vector<int32_t> other = {90, 91, 92, 93, 94};
    KvGrant c = Admit(kv, 3, other);
    kv.RegisterFullBlocks(c.new_blocks, Hashes(other, 4), 0);
    kv.Release(c.new_blocks);
  };
  const std::vector<int32_t> shared = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  KvDemand again;  // re-admission of a's sequence: hits what the release leaves cached
  again.seq_id = 1;
  again.match_prefix = true;
  again.prefix_tokens = std::span<const int32_t>(shared.data(), shared.size() - 1);
  again.need_tokens = static_cast<int64_t>(shared.size());
  KvDemand big;  // then more than the free list holds: evicts
  big.seq_id = 4;
  big.need_tokens = 20;

  KvCacheManager x(8, 4, true);
  std::vector<int32_t> xa, xb;
  build(x, &xa, &xb, shared);
  KvPlan px;
  x.PlanRelease(xa, &px);
  x.PlanRelease(xb, &px);
  const int64_t in_use = x.BlocksInUse();
  ASSERT_TRUE(x.PlanDemand(again, &px));
  ASSERT_TRUE(x.PlanDemand(big, &px));
  EXPECT_EQ(x.BlocksInUse(), in_use) << "planning must not mutate";
  EXPECT_EQ(px.released.size(), xa.size() + xb.size());
  x.Apply(px);

  KvCacheManager y(8, 4, true);
  std::vector<int32_t> ya, yb;
  build(y, &ya, &yb, shared);
  y.Release(ya);
  y.Release(yb);
  KvPlan py;
  ASSERT_TRUE(y.PlanDemand(again, &py));
  ASSERT_TRUE(y.PlanDemand(big, &py));
  y.Apply(py);

  ASSERT_EQ(px.grants.size(), py.grants.size());
  for (size_t i = 0; i < px.grants.size(); ++i) {
    EXPECT_EQ(px.grants[i].hit_blocks, py.grants[i].hit_blocks) << i;
    EXPECT_EQ(px.grants[i].new_blocks, py.grants[i].new_blocks) << i;
  }
  EXPECT_EQ(px.grants[0].hit_blocks.size(), 2u) << "a's two hashed blocks are revived";
  EXPECT_FALSE(px.evicted.empty()) << "the big demand evicts a released or older cached block";
  EXPECT_EQ(px.evicted, py.evicted);
  EXPECT_EQ(x.BlocksInUse(), y.BlocksInUse());
  EXPECT_EQ(x.NumCachedBlocks(), y.NumCachedBlocks());
}

}  // namespace
}  // namespace rc::engine
