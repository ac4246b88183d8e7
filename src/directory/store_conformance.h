// The DirectoryStore conformance suite: one set of tests that every implementation must pass.
// store_test.cc instantiates it for MemoryStore, SqliteStore and EtcdStore (real etcd);
// tests/directory/http_e2e_test.cc for DirectoryClient against a DirectoryServer on loopback.
//
// A StoreEnv supplies the store, optionally a second independent handle on the same backend (for
// cross-instance atomicity), and a way to let lease time pass (a ManualClock, or real sleep).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "directory/test_util.h"
#include "rolloutcore/directory/store.h"
#include "rolloutcore/refit/digest.h"

namespace rc::directory::testing {

class StoreEnv {
 public:
  virtual ~StoreEnv() = default;
  virtual DirectoryStore& store() = 0;
  // Another handle on the same data (a second SqliteStore on the file, a second EtcdStore, a
  // second client), or nullptr.
  virtual DirectoryStore* second() { return nullptr; }
  // Lets ms of lease time pass.
  virtual void PassLeaseTime(int64_t ms) = 0;
  // The TTL expiry tests use: exact with a ManualClock; etcd's leases have whole seconds.
  virtual int64_t short_ttl_ms() const { return 1000; }
};

struct StoreParam {
  std::string name;
  // Returns the env, or nullptr with *skip set to why it cannot run here.
  std::function<std::unique_ptr<StoreEnv>(std::string* skip)> make;
};

inline void PrintTo(const StoreParam& param, std::ostream* os) { *os << param.name; }

inline std::string ParamName(const ::testing::TestParamInfo<StoreParam>& info) { return info.param.name; }

class StoreConformanceTest : public ::testing::TestWithParam<StoreParam> {
 protected:
  void SetUp() override {
    std::string skip;
    env_ = GetParam().make(&skip);
    if (!env_) GTEST_SKIP() << skip;
  }
  DirectoryStore& store() { return env_->store(); }

  Result<PublishResult> PublishRank(const std::string& version, int32_t rank, int32_t ranks, int64_t ttl_ms = 60'000,
                                    const std::string& model = "m") {
    return store().Publish(MakePublish(model, version, rank, ranks, ttl_ms));
  }
  void CommitVersion(const std::string& version, int32_t ranks = 2, const std::string& model = "m") {
    for (int32_t r = 0; r < ranks; ++r) ASSERT_TRUE(PublishRank(version, r, ranks, 60'000, model).ok());
  }
  // Asserts that `got` (a List or a commit feed) answered exactly one entry, of `version`. Call
  // under ASSERT_NO_FATAL_FAILURE so that a failed ASSERT ends the test as it would inline.
  template <typename Entry>
  static void ExpectOneVersion(const Result<std::vector<Entry>>& got, const std::string& version) {
    ASSERT_TRUE(got.ok());
    ASSERT_EQ(got->size(), 1u);
    EXPECT_EQ((*got)[0].version, version);
  }
  // Waits (real time, up to 15 s) until the version reaches `state`; with a ManualClock the first
  // look already sees it.
  VersionState WaitForState(const std::string& version, VersionState state) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(15);
    VersionState last = VersionState::kStaging;
    while (std::chrono::steady_clock::now() < deadline) {
      auto info = store().GetInfo("m", version);
      if (info.ok()) {
        last = info->state;
        if (last == state) return last;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return last;
  }

  std::unique_ptr<StoreEnv> env_;
};

inline bool Contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST_P(StoreConformanceTest, CommitsWhenEveryRankPublishedAndMergesTables) {
  auto r0 = PublishRank("v1", 0, 3);
  ASSERT_TRUE(r0.ok()) << r0.status().ToString();
  EXPECT_EQ(r0->state, VersionState::kStaging);
  EXPECT_EQ(r0->ranks_published, 1);
  EXPECT_NE(r0->lease_id, 0);
  EXPECT_GE(r0->lease_ttl_ms, 60'000);
  auto r2 = PublishRank("v1", 2, 3);
  ASSERT_TRUE(r2.ok()) << r2.status().ToString();
  EXPECT_EQ(r2->state, VersionState::kStaging);
  EXPECT_EQ(r2->ranks_published, 2);

  auto info = store().GetInfo("m", "v1");
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->state, VersionState::kStaging);
  EXPECT_EQ(info->expected_ranks, 3);
  EXPECT_EQ(info->published_ranks, (std::vector<int32_t>{0, 2}));
  auto staged = store().Get("m", "v1");
  EXPECT_EQ(staged.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(staged.status().message(), "STAGING (2 of 3 ranks published)")) << staged.status().message();
  auto listed = store().List("m", StateFilter::kCommitted);
  ASSERT_TRUE(listed.ok());
  EXPECT_TRUE(listed->empty());

  auto r1 = PublishRank("v1", 1, 3);
  ASSERT_TRUE(r1.ok()) << r1.status().ToString();
  EXPECT_EQ(r1->state, VersionState::kCommitted);
  EXPECT_EQ(r1->commit_seq, 1u);
  EXPECT_EQ(r1->ranks_published, 3);

  auto m = store().Get("m", "v1");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->model, "m");
  EXPECT_EQ(m->version, "v1");
  EXPECT_EQ(m->expected_ranks, 3);
  ASSERT_EQ(m->tables.size(), 2u);
  EXPECT_EQ(m->tables[0].name, "w0");
  EXPECT_EQ(m->tables[1].name, "w1");
  for (const auto& t : m->tables) {
    ASSERT_EQ(t.shards.size(), 3u) << t.name;
    for (int r = 0; r < 3; ++r) EXPECT_EQ(t.shards[static_cast<size_t>(r)].rank, r);
    EXPECT_TRUE(refit::ValidateShardTable(t, true).ok());
  }
  auto digests = refit::TensorDigestsFromShards(*m);
  ASSERT_TRUE(digests.ok());
  EXPECT_EQ(m->content_digest, refit::CombineTensorDigests(*digests));
  EXPECT_EQ(r1->content_digest, m->content_digest);

  auto info2 = store().GetInfo("m", "v1");
  ASSERT_TRUE(info2.ok());
  EXPECT_EQ(info2->state, VersionState::kCommitted);
  EXPECT_EQ(info2->commit_seq, 1u);
  EXPECT_EQ(info2->content_digest, m->content_digest);
  EXPECT_EQ(info2->published_ranks, (std::vector<int32_t>{0, 1, 2}));
}

TEST_P(StoreConformanceTest, SingleRankVersionCommitsOnFirstPublish) {
  auto r = PublishRank("solo", 0, 1);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->state, VersionState::kCommitted);
  EXPECT_TRUE(store().Get("m", "solo").ok());
}

TEST_P(StoreConformanceTest, NMinusOneRanksNeverCommit) {
  constexpr int32_t kRanks = 4;
  for (int round = 0; round < 3; ++round) {
    for (int32_t r = 0; r < kRanks - 1; ++r) {
      auto res = PublishRank("v1", r, kRanks);
      ASSERT_TRUE(res.ok()) << res.status().ToString();
      EXPECT_EQ(res->state, VersionState::kStaging);
      EXPECT_EQ(res->ranks_published, round == 0 ? r + 1 : kRanks - 1);
    }
  }
  auto info = store().GetInfo("m", "v1");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->state, VersionState::kStaging);
  EXPECT_EQ(info->published_ranks, (std::vector<int32_t>{0, 1, 2}));
  auto committed = store().List("m", StateFilter::kCommitted);
  ASSERT_TRUE(committed.ok());
  EXPECT_TRUE(committed->empty());
  auto events = store().WaitForCommits("m", 0, 0);
  ASSERT_TRUE(events.ok());
  EXPECT_TRUE(events->empty());
}

TEST_P(StoreConformanceTest, ExpectedRanksMismatchIsRefusedNamingBothNumbers) {
  ASSERT_TRUE(PublishRank("v1", 0, 3).ok());
  auto bad = PublishRank("v1", 1, 4);
  EXPECT_EQ(bad.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(bad.status().message(), "expects 3 ranks")) << bad.status().message();
  EXPECT_TRUE(Contains(bad.status().message(), "expected_ranks 4")) << bad.status().message();
  auto info = store().GetInfo("m", "v1");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->published_ranks, (std::vector<int32_t>{0}));
}

TEST_P(StoreConformanceTest, RepublishReplacesTablesWhileStaging) {
  PublishRequest first = MakePublish("m", "v1", 0, 2);
  for (auto& t : first.tables) t.shards[0].handle = "old-handle";
  ASSERT_TRUE(store().Publish(first).ok());
  PublishRequest second = MakePublish("m", "v1", 0, 2);
  for (auto& t : second.tables) t.shards[0].handle = "new-handle";
  auto res = store().Publish(second);
  ASSERT_TRUE(res.ok()) << res.status().ToString();
  EXPECT_EQ(res->ranks_published, 1);
  ASSERT_TRUE(PublishRank("v1", 1, 2).ok());
  auto m = store().Get("m", "v1");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  for (const auto& t : m->tables) EXPECT_EQ(t.shards[0].handle, "new-handle");
}

TEST_P(StoreConformanceTest, PublishAfterCommitIsFailedPrecondition) {
  CommitVersion("v1", 2);
  auto again = PublishRank("v1", 0, 2);
  EXPECT_EQ(again.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(again.status().message(), "already COMMITTED (commit seq 1)")) << again.status().message();
}

TEST_P(StoreConformanceTest, IncompleteMergedShardsAreRefusedNamingTheTensorAndCanBeFixed) {
  ASSERT_TRUE(PublishRank("v1", 0, 2).ok());  // rows 0..4 of w0 and w1
  PublishRequest partial = MakePublish("m", "v1", 1, 2);
  partial.tables[1].shards[0].shape = {2, 4};  // w1 rows 4..6 only: 6..8 missing
  auto refused = store().Publish(partial);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(refused.status().message(), "version v1 of model m cannot commit")) << refused.status().message();
  EXPECT_TRUE(Contains(refused.status().message(), "tensor w1")) << refused.status().message();
  EXPECT_TRUE(Contains(refused.status().message(), "missing")) << refused.status().message();
  auto info = store().GetInfo("m", "v1");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->state, VersionState::kStaging);
  EXPECT_EQ(info->published_ranks, (std::vector<int32_t>{0}));  // the refused publish was not stored
  auto fixed = PublishRank("v1", 1, 2);
  ASSERT_TRUE(fixed.ok()) << fixed.status().ToString();
  EXPECT_EQ(fixed->state, VersionState::kCommitted);
}

TEST_P(StoreConformanceTest, OverlappingShardsAreRefusedNamingTheTensor) {
  ASSERT_TRUE(PublishRank("v1", 0, 2).ok());
  PublishRequest overlap = MakePublish("m", "v1", 1, 2);
  overlap.tables[0].shards[0].offset = {2, 0};  // rows 2..6 overlap rank 0's 0..4
  auto refused = store().Publish(overlap);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(refused.status().message(), "tensor w0")) << refused.status().message();
  EXPECT_TRUE(Contains(refused.status().message(), "overlap")) << refused.status().message();
  auto info = store().GetInfo("m", "v1");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->state, VersionState::kStaging);
}

TEST_P(StoreConformanceTest, ReplicasAreAllowedAndMustAgreeOnDigests) {
  PublishRequest a = MakePublish("m", "dp", 0, 2);
  a.tables = ReplicaTables(0);
  PublishRequest b = MakePublish("m", "dp", 1, 2);
  b.tables = ReplicaTables(1);
  ASSERT_TRUE(store().Publish(a).ok());
  auto res = store().Publish(b);
  ASSERT_TRUE(res.ok()) << res.status().ToString();
  EXPECT_EQ(res->state, VersionState::kCommitted);
  auto m = store().Get("m", "dp");
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->tables[0].shards.size(), 2u);

  PublishRequest c = MakePublish("m", "dp-bad", 0, 2);
  c.tables = ReplicaTables(0);
  PublishRequest d = MakePublish("m", "dp-bad", 1, 2);
  d.tables = ReplicaTables(1);
  d.tables[0].shards[0].digest ^= 1;
  ASSERT_TRUE(store().Publish(c).ok());
  auto refused = store().Publish(d);
  EXPECT_EQ(refused.status().code(), StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(refused.status().message(), "tensor w0")) << refused.status().message();
}

TEST_P(StoreConformanceTest, DisagreeingTensorShapesAcrossRanksAreRefused) {
  ASSERT_TRUE(PublishRank("v1", 0, 2).ok());
  PublishRequest other = MakePublish("m", "v1", 1, 2);
  other.tables[0].dtype = refit::DType::kF32;
  auto refused = store().Publish(other);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(refused.status().message(), "tensor w0: rank 0 publishes bf16 [8, 4] but rank 1 publishes f32"))
      << refused.status().message();
}

TEST_P(StoreConformanceTest, InvalidPublishRequestsAreRefusedNamingTheField) {
  PublishRequest r = MakePublish("m", "v1", 0, 2);
  r.model = "bad/model";
  EXPECT_TRUE(Contains(store().Publish(r).status().message(), "model"));
  r = MakePublish("m", "v1", 1, 2);
  r.rank = 2;
  auto out_of_range = store().Publish(r);
  EXPECT_EQ(out_of_range.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(out_of_range.status().message(), "rank: 2 is out of range for expected_ranks 2"))
      << out_of_range.status().message();
  r = MakePublish("m", "v1", 0, 2, /*lease_ttl_ms=*/0);
  EXPECT_TRUE(Contains(store().Publish(r).status().message(), "lease_ttl_ms"));
  r = MakePublish("m", "v1", 1, 2);
  r.tables[0].shards[0].rank = 0;
  auto wrong_rank = store().Publish(r);
  EXPECT_EQ(wrong_rank.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(wrong_rank.status().message(), "tensors[0].shards[0].rank")) << wrong_rank.status().message();
  EXPECT_EQ(store().GetInfo("m", "v1").status().code(), StatusCode::kNotFound);  // nothing was stored
}

TEST_P(StoreConformanceTest, LeaseExpiryBeforeCommitAbandonsTheVersionForever) {
  const int64_t ttl = env_->short_ttl_ms();
  auto r0 = PublishRank("v1", 0, 2, ttl);
  ASSERT_TRUE(r0.ok()) << r0.status().ToString();
  env_->PassLeaseTime(ttl + 1);
  EXPECT_EQ(WaitForState("v1", VersionState::kAbandoned), VersionState::kAbandoned);
  auto info = store().GetInfo("m", "v1");
  ASSERT_TRUE(info.ok());
  EXPECT_TRUE(Contains(info->reason, "rank 0 expired")) << info->reason;
  auto late = PublishRank("v1", 1, 2);
  EXPECT_EQ(late.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(late.status().message(), "ABANDONED")) << late.status().message();
  auto again = PublishRank("v1", 0, 2);
  EXPECT_EQ(again.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(store().Get("m", "v1").status().code(), StatusCode::kFailedPrecondition);
  ASSERT_NO_FATAL_FAILURE(ExpectOneVersion(store().List("m", StateFilter::kAbandoned), "v1"));
  EXPECT_EQ(store().KeepAlive(r0->lease_id).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(WaitForVersion(store(), "m", "v1", 100).status().code(), StatusCode::kFailedPrecondition);
}

TEST_P(StoreConformanceTest, KeepAliveHoldsAStagingVersionOpen) {
  const int64_t ttl = env_->short_ttl_ms();
  auto r0 = PublishRank("v1", 0, 2, ttl);
  ASSERT_TRUE(r0.ok());
  for (int i = 0; i < 6; ++i) {
    env_->PassLeaseTime(ttl * 2 / 5);
    auto lease = store().KeepAlive(r0->lease_id);
    ASSERT_TRUE(lease.ok()) << "renewal " << i << ": " << lease.status().ToString();
    EXPECT_EQ(lease->lease_id, r0->lease_id);
    EXPECT_GE(lease->ttl_ms, ttl);
  }
  auto r1 = PublishRank("v1", 1, 2);
  ASSERT_TRUE(r1.ok()) << r1.status().ToString();
  EXPECT_EQ(r1->state, VersionState::kCommitted);
}

TEST_P(StoreConformanceTest, LeasesDoNotMatterAfterCommit) {
  const int64_t ttl = env_->short_ttl_ms();
  ASSERT_TRUE(PublishRank("v1", 0, 2, ttl).ok());
  ASSERT_TRUE(PublishRank("v1", 1, 2, ttl).ok());
  env_->PassLeaseTime(ttl + 1);
  auto info = store().GetInfo("m", "v1");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->state, VersionState::kCommitted);
  EXPECT_TRUE(store().Get("m", "v1").ok());
}

TEST_P(StoreConformanceTest, UnknownLeaseKeepAliveIsNotFound) {
  EXPECT_EQ(store().KeepAlive(123456789).status().code(), StatusCode::kNotFound);
}

TEST_P(StoreConformanceTest, OneLeaseCanCarryPublishesOfSeveralVersions) {
  auto first = PublishRank("v1", 0, 2);
  ASSERT_TRUE(first.ok());
  PublishRequest next = MakePublish("m", "v2", 0, 2, /*lease_ttl_ms=*/0);
  next.lease_id = first->lease_id;
  auto second = store().Publish(next);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_EQ(second->lease_id, first->lease_id);
  PublishRequest unknown = MakePublish("m", "v3", 0, 2, 0);
  unknown.lease_id = 987654321;
  EXPECT_EQ(store().Publish(unknown).status().code(), StatusCode::kNotFound);
}

TEST_P(StoreConformanceTest, CommitSequenceIsPerModelAndFeedsWatchers) {
  CommitVersion("a", 2);
  CommitVersion("b", 1);
  CommitVersion("x", 1, "other-model");
  CommitVersion("c", 2);
  auto all = store().WaitForCommits("m", 0, 0);
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  ASSERT_EQ(all->size(), 3u);
  EXPECT_EQ((*all)[0].version, "a");
  EXPECT_EQ((*all)[0].seq, 1u);
  EXPECT_EQ((*all)[1].version, "b");
  EXPECT_EQ((*all)[1].seq, 2u);
  EXPECT_EQ((*all)[2].version, "c");
  EXPECT_EQ((*all)[2].seq, 3u);
  EXPECT_EQ((*all)[2].model, "m");
  auto other = store().WaitForCommits("other-model", 0, 0);
  ASSERT_TRUE(other.ok());
  ASSERT_EQ(other->size(), 1u);
  EXPECT_EQ((*other)[0].seq, 1u);
  ASSERT_NO_FATAL_FAILURE(ExpectOneVersion(store().WaitForCommits("m", 2, 0), "c"));

  const auto start = std::chrono::steady_clock::now();
  auto none = store().WaitForCommits("m", 3, 150);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(140));

  auto listed = store().List("m", StateFilter::kCommitted);
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 3u);
  EXPECT_EQ((*listed)[0].version, "a");
  EXPECT_EQ((*listed)[2].version, "c");
}

TEST_P(StoreConformanceTest, WaitForCommitsWakesWhenAVersionCommits) {
  CommitVersion("a", 1);
  std::atomic<bool> done{false};
  Result<std::vector<CommitEvent>> woke = std::vector<CommitEvent>{};
  std::thread watcher([&] {
    woke = store().WaitForCommits("m", 1, 10'000);
    done = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(done.load());
  const auto start = std::chrono::steady_clock::now();
  CommitVersion("b", 2);
  watcher.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  ASSERT_TRUE(woke.ok()) << woke.status().ToString();
  ASSERT_EQ(woke->size(), 1u);
  EXPECT_EQ((*woke)[0].version, "b");
  EXPECT_EQ((*woke)[0].seq, 2u);

  std::thread later([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    CommitVersion("c", 2);
  });
  auto event = WaitForVersion(store(), "m", "c", 10'000);
  later.join();
  ASSERT_TRUE(event.ok()) << event.status().ToString();
  EXPECT_EQ(event->seq, 3u);
}

TEST_P(StoreConformanceTest, ReleasedVersionsDisappearAndTheirLabelIsNotReused) {
  CommitVersion("a", 2);
  CommitVersion("b", 2);
  ASSERT_TRUE(PublishRank("s", 0, 2).ok());
  ASSERT_TRUE(store().Release("m", "a").ok());
  ASSERT_TRUE(store().Release("m", "s").ok());
  EXPECT_EQ(store().Get("m", "a").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(store().GetInfo("m", "a").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(store().GetInfo("m", "s").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(store().Release("m", "a").code(), StatusCode::kNotFound);
  EXPECT_EQ(store().Release("m", "never").code(), StatusCode::kNotFound);
  ASSERT_NO_FATAL_FAILURE(ExpectOneVersion(store().List("m", StateFilter::kAll), "b"));
  ASSERT_NO_FATAL_FAILURE(ExpectOneVersion(store().WaitForCommits("m", 0, 0), "b"));
  auto reuse = PublishRank("a", 0, 2);
  EXPECT_EQ(reuse.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(reuse.status().message(), "released")) << reuse.status().message();
  CommitVersion("c", 2);
  auto c = store().GetInfo("m", "c");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->commit_seq, 3u);  // sequence numbers are never reused
}

// A committed version whose sources are gone: UNAVAILABLE keeps its seq and digest, is refused by
// Get naming the reason, leaves the feed and the `committed` list, and never commits again.
TEST_P(StoreConformanceTest, MarkUnavailableTakesACommittedVersionOutOfServiceForGood) {
  CommitVersion("a", 2);
  CommitVersion("b", 2);
  auto before = store().GetInfo("m", "a");
  ASSERT_TRUE(before.ok());
  ASSERT_TRUE(store().MarkUnavailable("m", "a", "rank 1 of model m released its buffers of version a").ok());

  auto info = store().GetInfo("m", "a");
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->state, VersionState::kUnavailable);
  EXPECT_EQ(info->commit_seq, before->commit_seq);
  EXPECT_EQ(info->content_digest, before->content_digest);
  EXPECT_EQ(info->published_ranks, (std::vector<int32_t>{0, 1}));
  EXPECT_TRUE(Contains(info->reason, "rank 1")) << info->reason;
  auto get = store().Get("m", "a");
  EXPECT_EQ(get.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(get.status().message(), "UNAVAILABLE")) << get.status().message();
  EXPECT_TRUE(Contains(get.status().message(), "released its buffers")) << get.status().message();
  EXPECT_EQ(WaitForVersion(store(), "m", "a", 0).status().code(), StatusCode::kFailedPrecondition);

  ASSERT_NO_FATAL_FAILURE(ExpectOneVersion(store().List("m"), "b"));
  ASSERT_NO_FATAL_FAILURE(ExpectOneVersion(store().List("m", StateFilter::kUnavailable), "a"));
  ASSERT_NO_FATAL_FAILURE(ExpectOneVersion(store().WaitForCommits("m", 0, 0), "b"));

  auto republish = PublishRank("a", 0, 2);
  EXPECT_EQ(republish.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(republish.status().message(), "UNAVAILABLE")) << republish.status().message();
  // Every rank may report: a second mark changes nothing (the first reason stays).
  ASSERT_TRUE(store().MarkUnavailable("m", "a", "a reader found pid 7 gone").ok());
  EXPECT_TRUE(Contains(store().GetInfo("m", "a")->reason, "rank 1")) << store().GetInfo("m", "a")->reason;
  // Release still works, and the sequence number is not reused.
  ASSERT_TRUE(store().Release("m", "a").ok());
  EXPECT_EQ(store().GetInfo("m", "a").status().code(), StatusCode::kNotFound);
  CommitVersion("c", 2);
  EXPECT_EQ(store().GetInfo("m", "c")->commit_seq, 3u);
}

TEST_P(StoreConformanceTest, MarkUnavailableAbandonsAStagingVersionAndRefusesBadInput) {
  ASSERT_TRUE(PublishRank("s", 0, 2).ok());
  ASSERT_TRUE(store().MarkUnavailable("m", "s", "rank 0 released its buffers").ok());
  auto info = store().GetInfo("m", "s");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->state, VersionState::kAbandoned);
  EXPECT_EQ(info->reason, "rank 0 released its buffers");
  // It can never commit with the dead handles.
  auto last = PublishRank("s", 1, 2);
  EXPECT_EQ(last.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(store().GetInfo("m", "s")->state, VersionState::kAbandoned);

  EXPECT_EQ(store().MarkUnavailable("m", "never", "x").code(), StatusCode::kNotFound);
  CommitVersion("c", 2);
  auto empty = store().MarkUnavailable("m", "c", "");
  EXPECT_EQ(empty.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(empty.message(), "reason")) << empty.message();
  EXPECT_EQ(store().MarkUnavailable("m", "c", std::string(kMaxReasonLength + 1, 'x')).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(store().MarkUnavailable("m", "c", std::string("bad \xff byte")).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(store().GetInfo("m", "c")->state, VersionState::kCommitted);  // refusals change nothing
  ASSERT_TRUE(store().Release("m", "c").ok());
  EXPECT_EQ(store().MarkUnavailable("m", "c", "gone").code(), StatusCode::kNotFound);
}

TEST_P(StoreConformanceTest, ListFiltersByState) {
  CommitVersion("c1", 2);
  ASSERT_TRUE(PublishRank("s1", 0, 2).ok());
  auto all = store().List("m", StateFilter::kAll);
  ASSERT_TRUE(all.ok());
  ASSERT_EQ(all->size(), 2u);
  EXPECT_EQ((*all)[0].version, "c1");  // committed first
  EXPECT_EQ((*all)[1].version, "s1");
  auto staging = store().List("m", StateFilter::kStaging);
  ASSERT_TRUE(staging.ok());
  ASSERT_EQ(staging->size(), 1u);
  EXPECT_EQ((*staging)[0].state, VersionState::kStaging);
  auto unknown = store().List("nobody", StateFilter::kAll);
  ASSERT_TRUE(unknown.ok());
  EXPECT_TRUE(unknown->empty());
}

// Many ranks of many versions publish at once, through two store handles when the backend has
// them: each version commits exactly once, only with all ranks, and commit seqs are 1..K.
TEST_P(StoreConformanceTest, ConcurrentPublishersCommitEachVersionExactlyOnce) {
  constexpr int32_t kRanks = 6;
  constexpr int kVersions = 8;
  DirectoryStore* stores[2] = {&store(), env_->second() ? env_->second() : &store()};
  std::atomic<int> commits{0}, failures{0};
  std::vector<std::thread> threads;
  std::mutex mu;
  std::map<std::string, uint64_t> seq_of;
  for (int32_t rank = 0; rank < kRanks; ++rank) {
    threads.emplace_back([&, rank] {
      std::vector<int> order(kVersions);
      for (int i = 0; i < kVersions; ++i) order[static_cast<size_t>(i)] = i;
      std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<unsigned>(rank)));
      for (int v : order) {
        const std::string version = "cv" + std::to_string(v);
        auto res = stores[rank % 2]->Publish(MakePublish("m", version, rank, kRanks));
        if (!res.ok()) {
          ++failures;
          ADD_FAILURE() << "rank " << rank << " " << version << ": " << res.status().ToString();
          continue;
        }
        if (res->state == VersionState::kCommitted) {
          ++commits;
          std::lock_guard<std::mutex> lock(mu);
          EXPECT_TRUE(seq_of.emplace(version, res->commit_seq).second) << version << " committed twice";
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(commits.load(), kVersions);
  std::set<uint64_t> seqs;
  for (const auto& [version, seq] : seq_of) seqs.insert(seq);
  EXPECT_EQ(seqs.size(), static_cast<size_t>(kVersions));
  if (!seqs.empty()) {
    EXPECT_EQ(*seqs.begin(), 1u);
    EXPECT_EQ(*seqs.rbegin(), static_cast<uint64_t>(kVersions));
  }
  for (int v = 0; v < kVersions; ++v) {
    auto m = store().Get("m", "cv" + std::to_string(v));
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    for (const auto& t : m->tables) EXPECT_EQ(t.shards.size(), static_cast<size_t>(kRanks));
    auto info = store().GetInfo("m", "cv" + std::to_string(v));
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->commit_seq, seq_of["cv" + std::to_string(v)]);
  }
  auto feed = store().WaitForCommits("m", 0, 0);
  ASSERT_TRUE(feed.ok());
  EXPECT_EQ(feed->size(), static_cast<size_t>(kVersions));
}

// The last two ranks race for the commit: exactly one of them sees COMMITTED.
TEST_P(StoreConformanceTest, RacingLastPublishersCommitOnce) {
  constexpr int kRounds = 10;
  DirectoryStore* stores[2] = {&store(), env_->second() ? env_->second() : &store()};
  for (int round = 0; round < kRounds; ++round) {
    const std::string version = "race" + std::to_string(round);
    ASSERT_TRUE(PublishRank(version, 0, 3).ok());
    std::atomic<int> committed{0};
    std::thread a([&] {
      auto r = stores[0]->Publish(MakePublish("m", version, 1, 3));
      EXPECT_TRUE(r.ok()) << r.status().ToString();
      if (r.ok() && r->state == VersionState::kCommitted) ++committed;
    });
    std::thread b([&] {
      auto r = stores[1]->Publish(MakePublish("m", version, 2, 3));
      EXPECT_TRUE(r.ok()) << r.status().ToString();
      if (r.ok() && r->state == VersionState::kCommitted) ++committed;
    });
    a.join();
    b.join();
    EXPECT_EQ(committed.load(), 1) << version;
    auto info = store().GetInfo("m", version);
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->state, VersionState::kCommitted);
    EXPECT_EQ(info->commit_seq, static_cast<uint64_t>(round + 1));
  }
}

// Replay probes (refit/probes.h) travel with rank 0's publish and come back with the committed
// manifest, whichever rank's publish completes the version; other ranks may not attach any.
TEST_P(StoreConformanceTest, RankZeroProbesAreCommittedWithTheVersion) {
  refit::Probe p;
  p.name = "p0";
  p.prompt = {3, 1, 4};
  p.top_k = 1;
  p.steps = {refit::ProbeStep{5, -0.25f, {{5, -0.25f}}}, refit::ProbeStep{9, -1.0f, {{9, -1.0f}}}};
  for (const bool rank0_first : {true, false}) {
    const std::string version = rank0_first ? "probes-a" : "probes-b";
    PublishRequest r0 = MakePublish("m", version, 0, 2);
    r0.probes = {p};
    PublishRequest r1 = MakePublish("m", version, 1, 2);
    auto first = store().Publish(rank0_first ? r0 : r1);
    ASSERT_TRUE(first.ok()) << first.status().ToString();
    auto second = store().Publish(rank0_first ? r1 : r0);
    ASSERT_TRUE(second.ok()) << second.status().ToString();
    ASSERT_EQ(second->state, VersionState::kCommitted);
    auto m = store().Get("m", version);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    ASSERT_EQ(m->probes.size(), 1u) << version;
    EXPECT_EQ(m->probes[0].name, "p0");
    EXPECT_EQ(m->probes[0].prompt, p.prompt);
    ASSERT_EQ(m->probes[0].steps.size(), 2u);
    EXPECT_EQ(m->probes[0].steps[1].token, 9);
    EXPECT_EQ(m->probes[0].steps[1].top, p.steps[1].top);
  }
  auto plain = PublishRank("no-probes", 0, 1);
  ASSERT_TRUE(plain.ok());
  EXPECT_TRUE(store().Get("m", "no-probes")->probes.empty());
  PublishRequest bad = MakePublish("m", "probes-c", 1, 2);
  bad.probes = {p};
  auto refused = store().Publish(bad);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("probes: only rank 0"), std::string::npos) << refused.status().ToString();
  PublishRequest nan = MakePublish("m", "probes-d", 0, 1);
  nan.probes = {p};
  nan.probes[0].steps[0].logprob = 1.0f;
  refused = store().Publish(nan);
  EXPECT_NE(refused.status().message().find("probes[0].steps[0].logprob"), std::string::npos)
      << refused.status().ToString();
}

// FP8 parts (refit::ShardInfo::fp8) are stored with each rank's tables and committed on the shards,
// adding up per parameter; a part on a tensor served in bf16 is refused at publish, and a rank whose
// projection shard lacks the part the other rank sent refuses the commit by name.
TEST_P(StoreConformanceTest, Fp8PartsAreCommittedOnTheShardsAndMustAddUp) {
  auto publish = [&](const std::string& version, int32_t rank, bool with_part) {
    PublishRequest r = MakePublish("m", version, rank, 2);
    r.tables[0].name = "model.layers.0.mlp.down_proj.weight";
    if (with_part) r.tables[0].shards[0].fp8["fp8_per_block"] = refit::Fp8ImageDigest{10u + rank, 100u * rank};
    return store().Publish(r);
  };
  ASSERT_TRUE(publish("fp8-a", 0, true).ok());
  auto done = publish("fp8-a", 1, true);
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  ASSERT_EQ(done->state, VersionState::kCommitted);
  auto m = store().Get("m", "fp8-a");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  auto image = refit::PublishedFp8Image(*m, "fp8_per_block");
  ASSERT_TRUE(image.ok()) << image.status().ToString();
  EXPECT_EQ(image->at("model.layers.0.mlp.down_proj.weight"), (refit::Fp8ImageDigest{21, 100}));

  ASSERT_TRUE(publish("fp8-b", 0, true).ok());
  auto missing = publish("fp8-b", 1, false);
  EXPECT_FALSE(missing.ok() && missing->state == VersionState::kCommitted);
  EXPECT_NE(missing.status().message().find("carries no fp8_per_block part"), std::string::npos)
      << missing.status().ToString();

  PublishRequest bf16 = MakePublish("m", "fp8-c", 0, 1);
  bf16.tables[0].shards[0].fp8["fp8_per_block"] = refit::Fp8ImageDigest{1, 1};
  auto refused = store().Publish(bf16);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("served in bf16"), std::string::npos) << refused.status().ToString();
}

}  // namespace rc::directory::testing
