#include "receiver/relay.h"

#include <gtest/gtest.h>

namespace rc::receiver {
namespace {

using refit::ShardInfo;
using refit::ShardTable;

// Two tensors, each in two dim-0 shards on trainer ranks 0 and 1.
refit::Manifest Origin() {
  refit::Manifest m;
  m.model = "m";
  m.version = "v1";
  m.expected_ranks = 2;
  for (const char* name : {"a", "b"}) {
    ShardTable t{name, refit::DType::kBF16, {4, 2}, {}};
    t.shards.push_back(ShardInfo{0, {0, 0}, {2, 2}, std::string("shm:v1:origin-") + name + "0", 11});
    t.shards.push_back(ShardInfo{1, {2, 0}, {2, 2}, std::string("shm:v1:origin-") + name + "1", 22});
    m.tables.push_back(t);
  }
  return m;
}

RelayRecord Holder(const std::string& name, const refit::Manifest& origin) {
  RelayRecord r{name, origin};
  r.manifest.model = "m@relay";
  r.manifest.version = "v1@" + name;
  for (ShardTable& t : r.manifest.tables) {
    for (ShardInfo& s : t.shards) {
      s.rank = 0;
      s.handle = "shm:v1:" + name + "-" + t.name + std::to_string(s.offset[0]);
    }
  }
  return r;
}

TEST(RelayTest, NamesOfHolderRecords) {
  EXPECT_EQ(RelayModelName("m"), "m@relay");
  EXPECT_EQ(RelayLabel("v1", "e0"), "v1@e0");
  EXPECT_EQ(RelayHolderOf("v1@e0", "v1"), "e0");
  EXPECT_EQ(RelayHolderOf("v10@e0", "v1"), "");
  EXPECT_EQ(RelayHolderOf("v1@", "v1"), "");
  EXPECT_EQ(RelayHolderOf("v1", "v1"), "");
}

TEST(RelayTest, HoldersReplaceTheTrainerForEveryBoxTheyHoldWithTheSameDigest) {
  const refit::Manifest origin = Origin();
  RelayRecord h0 = Holder("h0", origin), h1 = Holder("h1", origin);
  h1.manifest.tables[1].shards[1].digest = 99;  // h1's copy of b[2:4] differs: never used
  auto m = MergeRelayHolders(origin, {h1, h0}, {});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->first_relay_rank, 2);
  EXPECT_EQ(m->holders, (std::vector<std::string>{"h0", "h1"}));  // name order
  EXPECT_EQ(m->boxes_relayed, 4u);
  EXPECT_EQ(m->boxes_from_origin, 0u);
  const auto& a = m->manifest.tables[0].shards;
  ASSERT_EQ(a.size(), 4u);  // two holders for each of a's two boxes, no trainer shard
  for (const ShardInfo& s : a) EXPECT_GE(s.rank, 2);
  // Rotated per box: box 0 lists h0 first, box 1 lists h1 first.
  EXPECT_EQ(a[0].handle, "shm:v1:h0-a0");
  EXPECT_EQ(a[2].handle, "shm:v1:h1-a2");
  const auto& b = m->manifest.tables[1].shards;
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[2].handle, "shm:v1:h0-b2") << "only h0 holds b[2:4] with the published digest";
  EXPECT_EQ(b[2].digest, 22u);
  EXPECT_EQ(b[2].rank, 2);
}

TEST(RelayTest, ExcludedHoldersAreSkippedAndTheTrainerServesWhenNoneIsLeft) {
  const refit::Manifest origin = Origin();
  auto one = MergeRelayHolders(origin, {Holder("h0", origin), Holder("h1", origin)}, {"h0"});
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->holders, (std::vector<std::string>{"h1"}));
  for (const ShardTable& t : one->manifest.tables) {
    for (const ShardInfo& s : t.shards) EXPECT_EQ(s.handle.rfind("shm:v1:h1-", 0), 0u) << s.handle;
  }
  RelayRecord other = Holder("h2", origin);
  for (ShardTable& t : other.manifest.tables) {
    for (ShardInfo& sh : t.shards) sh.handle = "ucx:v1:" + sh.handle.substr(7);
  }
  auto mixed = MergeRelayHolders(origin, {other}, {});
  ASSERT_TRUE(mixed.ok());
  EXPECT_TRUE(mixed->holders.empty()) << "a record on another transport is not used";
  EXPECT_EQ(mixed->boxes_from_origin, 4u);
  auto none = MergeRelayHolders(origin, {Holder("h0", origin)}, {"h0"});
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->holders.empty());
  EXPECT_EQ(none->boxes_from_origin, 4u);
  EXPECT_EQ(none->manifest.tables[0].shards[0].handle, "shm:v1:origin-a0");
  EXPECT_EQ(none->manifest.tables[1].shards[1].rank, 1);
}

}  // namespace
}  // namespace rc::receiver
