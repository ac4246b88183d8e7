#include "directory/version_record.h"

#include <gtest/gtest.h>

#include "directory/test_util.h"

namespace rc::directory::internal {
namespace {

using testing::MakePublish;
using testing::RowShardTables;

TEST(VersionNameTest, FollowsTheNamingRule) {
  EXPECT_TRUE(ValidateName("Qwen--Qwen3-8B", "model").ok());
  EXPECT_TRUE(ValidateName("rc-7", "version").ok());
  EXPECT_TRUE(ValidateName("step=1200:run@a+b_c.d", "version").ok());
  EXPECT_EQ(ValidateName("", "model").message(), "model: must not be empty");
  EXPECT_NE(ValidateName("a/b", "model").message().find("0x2f"), std::string::npos);
  EXPECT_FALSE(ValidateName("..", "version").ok());
  EXPECT_FALSE(ValidateName("-x", "version").ok());
  EXPECT_FALSE(ValidateName(std::string(129, 'a'), "version").ok());
  EXPECT_FALSE(ValidateName("a b", "version").ok());
}

TEST(CheckPublishTest, FirstPublishCreatesAndCompletesOnlyASingleRankVersion) {
  EXPECT_FALSE(*CheckPublish(nullptr, MakePublish("m", "v", 0, 2)));
  EXPECT_TRUE(*CheckPublish(nullptr, MakePublish("m", "v", 0, 1)));
}

TEST(CheckPublishTest, CompletesWhenTheLastMissingRankPublishes) {
  VersionMeta meta;
  meta.expected_ranks = 3;
  meta.rank_leases = {{0, 1}, {2, 1}};
  EXPECT_TRUE(*CheckPublish(&meta, MakePublish("m", "v", 1, 3)));
  EXPECT_FALSE(*CheckPublish(&meta, MakePublish("m", "v", 0, 3)));  // a replacement
  meta.rank_leases = {{0, 1}};
  EXPECT_FALSE(*CheckPublish(&meta, MakePublish("m", "v", 1, 3)));
}

TEST(CheckPublishTest, RefusalsNameTheStateAndNumbers) {
  VersionMeta meta;
  meta.expected_ranks = 4;
  auto mismatch = CheckPublish(&meta, MakePublish("m", "rc-7", 1, 2));
  EXPECT_EQ(mismatch.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(mismatch.status().message(),
            "version rc-7 of model m expects 4 ranks (set by its first publish), but rank 1 declared expected_ranks 2");
  meta.state = VersionState::kCommitted;
  meta.commit_seq = 9;
  EXPECT_EQ(CheckPublish(&meta, MakePublish("m", "rc-7", 1, 4)).status().message(),
            "version rc-7 of model m is already COMMITTED (commit seq 9); rank 1 cannot publish to it");
  meta.state = VersionState::kAbandoned;
  meta.reason = LeaseExpiredReason(3, 77);
  EXPECT_EQ(CheckPublish(&meta, MakePublish("m", "rc-7", 1, 4)).status().message(),
            "version rc-7 of model m was ABANDONED (the lease 77 of rank 3 expired before every rank had published); "
            "rank 1 cannot publish to it");
  meta.released = true;
  EXPECT_EQ(CheckPublish(&meta, MakePublish("m", "rc-7", 1, 4)).status().code(), StatusCode::kFailedPrecondition);
}

TEST(ValidatePublishRequestTest, ChecksEveryField) {
  EXPECT_TRUE(ValidatePublishRequest(MakePublish("m", "v", 1, 2)).ok());
  auto r = MakePublish("m", "v", 0, 2);
  r.expected_ranks = 0;
  EXPECT_EQ(ValidatePublishRequest(r).message(), "expected_ranks: must be between 1 and 65536, got 0");
  r = MakePublish("m", "v", 0, 2);
  r.rank = -1;
  EXPECT_EQ(ValidatePublishRequest(r).message(), "rank: -1 is out of range for expected_ranks 2 (ranks are 0..1)");
  r = MakePublish("m", "v", 0, 2);
  r.lease_ttl_ms = 0;
  EXPECT_NE(ValidatePublishRequest(r).message().find("lease_ttl_ms"), std::string::npos);
  r.lease_id = 5;  // an existing lease needs no TTL
  EXPECT_TRUE(ValidatePublishRequest(r).ok());
  r = MakePublish("m", "v", 1, 2);
  r.digest_algorithm = "rc-digest-1";  // shard digests from a publisher of another release
  EXPECT_EQ(ValidatePublishRequest(r).message(),
            "digest: rank 1 computed its shard digests with \"rc-digest-1\", but this directory accepts only "
            "\"rc-digest-2\" (publisher and engine must be built from the same rolloutcore release)");
  r.digest_algorithm.clear();
  EXPECT_EQ(ValidatePublishRequest(r).message().rfind("digest: required field is missing", 0), 0u);
  r = MakePublish("m", "v", 0, 2);
  r.tables.push_back(r.tables[0]);
  EXPECT_EQ(ValidatePublishRequest(r).message(), "tensors[2].name: tensor w0 appears twice in the tables of rank 0");
  r = MakePublish("m", "v", 0, 2);
  r.tables[0].shards[0].handle = std::string("\xff\xfe", 2);
  EXPECT_EQ(ValidatePublishRequest(r).message(),
            "tensors[0].shards[0].handle: must be UTF-8 (encode binary transport descriptors, e.g. as base64)");
  r.tables[0].shards[0].handle = "h\xc3\xa9";  // "hé" is fine
  EXPECT_TRUE(ValidatePublishRequest(r).ok());
  r.tables[0].name = std::string("w\xc3", 2);  // truncated sequence
  EXPECT_EQ(ValidatePublishRequest(r).message(), "tensors[0].name: must be UTF-8");
  r = MakePublish("m", "v", 0, 2);
  r.tables[1].shards[0].shape = {9, 4};  // past the end of the tensor
  EXPECT_NE(ValidatePublishRequest(r).message().find("tensors[1]: tensor w1: shard of rank 0"), std::string::npos)
      << ValidatePublishRequest(r).message();
}

TEST(MergeRankTablesTest, MergesInNameAndRankOrder) {
  auto t0 = RowShardTables(0, 2, 3);
  auto t1 = RowShardTables(1, 2, 3);
  std::reverse(t1.begin(), t1.end());
  auto m = MergeRankTables("m", "v", 2, {{1, &t1}, {0, &t0}});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  ASSERT_EQ(m->tables.size(), 3u);
  EXPECT_EQ(m->tables[0].name, "w0");
  EXPECT_EQ(m->tables[2].name, "w2");
  EXPECT_EQ(m->tables[1].shards[0].rank, 0);
  EXPECT_EQ(m->tables[1].shards[1].rank, 1);
  EXPECT_NE(m->content_digest, 0u);
}

// Issue 13 #14: a version with zero tensors must not commit.
TEST(MergeRankTablesTest, VersionWithNoTensorIsRefused) {
  std::vector<refit::ShardTable> none;
  auto m = MergeRankTables("m", "v", 2, {{0, &none}, {1, &none}});
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find("tensors: none of its 2 rank(s) published any tensor"), std::string::npos)
      << m.status().message();
  // One rank owning nothing is fine when another publishes tensors.
  auto t0 = RowShardTables(0, 1, 2);
  for (auto& t : t0) t.shards[0].rank = 1;
  auto ok = MergeRankTables("m", "v", 2, {{0, &none}, {1, &t0}});
  EXPECT_TRUE(ok.ok()) << ok.status().ToString();
}

TEST(MergeRankTablesTest, TensorMissingOnAllButOneRankIsIncomplete) {
  auto t0 = RowShardTables(0, 2, 2);
  auto t1 = RowShardTables(1, 2, 1);  // rank 1 has no w1 rows
  auto m = MergeRankTables("m", "v", 2, {{0, &t0}, {1, &t1}});
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(m.status().message().rfind("version v of model m cannot commit: tensor w1:", 0), 0u)
      << m.status().message();
}

TEST(MergeRankTablesTest, ContentDigestIsIndependentOfRankOrder) {
  auto b0 = RowShardTables(0, 2), b1 = RowShardTables(1, 2);
  auto x = MergeRankTables("m", "v", 2, {{0, &b0}, {1, &b1}});
  auto y = MergeRankTables("m", "v", 2, {{1, &b1}, {0, &b0}});
  ASSERT_TRUE(x.ok() && y.ok());
  EXPECT_EQ(x->content_digest, y->content_digest);
}

TEST(SortVersionInfosTest, CommittedFirstBySeqThenByLabel) {
  std::vector<VersionInfo> v(4);
  v[0].version = "z";
  v[0].state = VersionState::kStaging;
  v[1].version = "b";
  v[1].state = VersionState::kCommitted;
  v[1].commit_seq = 2;
  v[2].version = "a";
  v[2].state = VersionState::kAbandoned;
  v[3].version = "c";
  v[3].state = VersionState::kCommitted;
  v[3].commit_seq = 1;
  SortVersionInfos(&v);
  EXPECT_EQ(v[0].version, "c");
  EXPECT_EQ(v[1].version, "b");
  EXPECT_EQ(v[2].version, "a");
  EXPECT_EQ(v[3].version, "z");
}

}  // namespace
}  // namespace rc::directory::internal
