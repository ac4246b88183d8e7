// The conformance suite (store_conformance.h) against MemoryStore, SqliteStore (two instances on
// one file for cross-instance atomicity) and EtcdStore against a real etcd on loopback, plus
// store-specific tests.
#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>

#include "directory/store_conformance.h"
#include "rolloutcore/base/clock.h"
#include "rolloutcore/directory/etcd_store.h"
#include "rolloutcore/directory/memory_store.h"
#include "rolloutcore/directory/sqlite_store.h"

namespace rc::directory::testing {
namespace {

class MemoryEnv final : public StoreEnv {
 public:
  MemoryEnv() : store_(NewMemoryStore(&clock_)) {}
  DirectoryStore& store() override { return *store_; }
  void PassLeaseTime(int64_t ms) override { clock_.AdvanceMs(ms); }

 private:
  ManualClock clock_{int64_t{1'000'000'000}};
  std::unique_ptr<DirectoryStore> store_;
};

class SqliteEnv final : public StoreEnv {
 public:
  static std::unique_ptr<StoreEnv> Make(std::string* skip) {
    auto env = std::unique_ptr<SqliteEnv>(new SqliteEnv());
    env->dir_ = MakeTempDir("rc-dir-sqlite");
    auto a = OpenSqliteStore(env->dir_ + "/dir.db", &env->clock_);
    auto b = OpenSqliteStore(env->dir_ + "/dir.db", &env->clock_);
    if (!a.ok() || !b.ok()) {
      *skip = "cannot open sqlite store: " + (a.ok() ? b.status() : a.status()).ToString();
      return nullptr;
    }
    env->a_ = std::move(*a);
    env->b_ = std::move(*b);
    return env;
  }
  ~SqliteEnv() override {
    a_.reset();
    b_.reset();
    RemoveTree(dir_);
  }
  DirectoryStore& store() override { return *a_; }
  DirectoryStore* second() override { return b_.get(); }
  void PassLeaseTime(int64_t ms) override { clock_.AdvanceMs(ms); }

 private:
  SqliteEnv() = default;
  ManualClock clock_{int64_t{1'000'000'000}};
  std::string dir_;
  std::unique_ptr<DirectoryStore> a_, b_;
};

// One etcd for the whole binary; each test gets its own key prefix.
EtcdProcess* SharedEtcd(std::string* error) {
  static std::unique_ptr<EtcdProcess> etcd;
  static std::string start_error;
  static bool tried = false;
  if (!tried) {
    tried = true;
    auto started = EtcdProcess::Start();
    if (started.ok()) {
      etcd = std::move(*started);
    } else {
      start_error = started.status().message();
    }
  }
  *error = start_error;
  return etcd.get();
}

class EtcdEnv final : public StoreEnv {
 public:
  static std::unique_ptr<StoreEnv> Make(std::string* skip) {
    std::string error;
    EtcdProcess* etcd = SharedEtcd(&error);
    if (etcd == nullptr) {
      *skip = error;
      return nullptr;
    }
    static std::atomic<int> counter{0};
    EtcdStoreOptions options;
    options.endpoint = etcd->endpoint();
    options.prefix = "/rctest-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
    options.poll_interval_ms = 20;
    auto a = OpenEtcdStore(options);
    auto b = OpenEtcdStore(options);
    if (!a.ok() || !b.ok()) {
      *skip = "cannot open etcd store: " + (a.ok() ? b.status() : a.status()).ToString();
      return nullptr;
    }
    auto env = std::unique_ptr<EtcdEnv>(new EtcdEnv());
    env->a_ = std::move(*a);
    env->b_ = std::move(*b);
    return env;
  }
  DirectoryStore& store() override { return *a_; }
  DirectoryStore* second() override { return b_.get(); }
  // etcd times its own leases: let real time pass.
  void PassLeaseTime(int64_t ms) override { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

 private:
  EtcdEnv() = default;
  std::unique_ptr<DirectoryStore> a_, b_;
};

INSTANTIATE_TEST_SUITE_P(
    Stores, StoreConformanceTest,
    ::testing::Values(StoreParam{"memory", [](std::string*) -> std::unique_ptr<StoreEnv> {
                                   return std::make_unique<MemoryEnv>();
                                 }},
                      StoreParam{"sqlite", &SqliteEnv::Make}, StoreParam{"etcd", &EtcdEnv::Make}),
    ParamName);

TEST(SqliteStoreTest, CommittedVersionsSurviveReopening) {
  const std::string dir = MakeTempDir("rc-dir-reopen");
  ManualClock clock;
  uint64_t digest = 0;
  {
    auto store = OpenSqliteStore(dir + "/dir.db", &clock);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    ASSERT_TRUE((*store)->Publish(MakePublish("m", "v1", 0, 2)).ok());
    auto r = (*store)->Publish(MakePublish("m", "v1", 1, 2));
    ASSERT_TRUE(r.ok());
    digest = r->content_digest;
    ASSERT_TRUE((*store)->Publish(MakePublish("m", "v2", 0, 2)).ok());
  }
  auto store = OpenSqliteStore(dir + "/dir.db", &clock);
  ASSERT_TRUE(store.ok());
  auto m = (*store)->Get("m", "v1");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->content_digest, digest);
  auto staged = (*store)->GetInfo("m", "v2");
  ASSERT_TRUE(staged.ok());
  EXPECT_EQ(staged->state, VersionState::kStaging);
  auto r = (*store)->Publish(MakePublish("m", "v2", 1, 2));  // staging survives too, and completes
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->commit_seq, 2u);
  store->reset();
  RemoveTree(dir);
}

TEST(SqliteStoreTest, UnopenablePathIsUnavailableNamingIt) {
  ManualClock clock;
  auto store = OpenSqliteStore("/nonexistent-dir/sub/dir.db", &clock);
  EXPECT_EQ(store.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(store.status().message().find("/nonexistent-dir/sub/dir.db"), std::string::npos);
}

TEST(OpenDirectoryStoreTest, ParsesSpecs) {
  ManualClock clock;
  EXPECT_TRUE(OpenDirectoryStore("memory", &clock).ok());
  EXPECT_EQ(OpenDirectoryStore("redis:x", &clock).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenDirectoryStore("sqlite:", &clock).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenDirectoryStore("etcd:ftp://x", &clock).status().code(), StatusCode::kInvalidArgument);
  const int port = FreeLoopbackPort();
  auto down = OpenDirectoryStore("etcd:http://127.0.0.1:" + std::to_string(port), &clock);
  EXPECT_EQ(down.status().code(), StatusCode::kUnavailable);
  const std::string dir = MakeTempDir("rc-dir-spec");
  EXPECT_TRUE(OpenDirectoryStore("sqlite:" + dir + "/x.db", &clock).ok());
  RemoveTree(dir);
}

TEST(EtcdStoreTest, KeysLiveUnderThePrefixAndCommitIsOneTxn) {
  std::string error;
  EtcdProcess* etcd = SharedEtcd(&error);
  if (etcd == nullptr) GTEST_SKIP() << error;
  auto store = OpenDirectoryStore(etcd->endpoint() + "/team-a");
  // The prefix comes from the URL path.
  ASSERT_TRUE(OpenDirectoryStore("etcd:" + etcd->endpoint() + "/team-a").ok());
  ASSERT_FALSE(store.ok());  // a bare URL is not a spec
  auto a = OpenDirectoryStore("etcd:" + etcd->endpoint() + "/team-a");
  auto b = OpenDirectoryStore("etcd:" + etcd->endpoint() + "/team-b");
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE((*a)->Publish(MakePublish("m", "v1", 0, 1)).ok());
  EXPECT_TRUE((*a)->Get("m", "v1").ok());
  EXPECT_EQ((*b)->Get("m", "v1").status().code(), StatusCode::kNotFound);  // prefixes isolate
}

}  // namespace
}  // namespace rc::directory::testing
