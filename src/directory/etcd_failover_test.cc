// The etcd store with several endpoints: requests move on to the next member when one does not
// answer, and a committing txn whose answer was lost (applied by etcd, answer never delivered) is
// reported committed, not "already COMMITTED". A real etcd (skipped when not installed) behind an
// in-test HTTP proxy that forwards to it and can drop answers; the multi-member cluster itself is
// exercised in tests/scale/etcd_cluster_test.cc.
#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "directory/test_util.h"
#include "rolloutcore/base/json.h"
#include "rolloutcore/directory/etcd_store.h"
#include "rolloutcore/directory/store.h"

namespace rc::directory::testing {
namespace {

// Forwards every POST to `target`; the first txn that deletes a range (the committing publish:
// it deletes the rank keys) is applied by etcd but answered 503 with a non-JSON page, as a member
// that died after forwarding it would leave it.
class LosingProxy {
 public:
  explicit LosingProxy(std::string target) : target_(std::move(target)) {
    server_.Post(".*", [this](const httplib::Request& req, httplib::Response& res) {
      httplib::Client up(target_);
      auto r = up.Post(req.path, req.body, "application/json");
      if (!r) {
        res.status = 502;
        return;
      }
      if (req.path == "/v3/kv/txn" && req.body.find("request_delete_range") != std::string::npos &&
          !lost_.exchange(true)) {
        res.status = 503;
        res.set_content("<html>member went away</html>", "text/html");
        return;
      }
      res.status = r->status;
      res.set_content(r->body, "application/json");
    });
    server_.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
      httplib::Client up(target_);
      auto r = up.Get("/health");
      res.status = r ? r->status : 502;
      if (r) res.set_content(r->body, "application/json");
    });
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    while (!server_.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ~LosingProxy() {
    server_.stop();
    thread_.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  bool lost() const { return lost_; }

 private:
  std::string target_;
  httplib::Server server_;
  std::thread thread_;
  int port_ = 0;
  std::atomic<bool> lost_{false};
};

TEST(EtcdFailoverTest, RequestsMoveOnWhenAMemberDoesNotAnswer) {
  auto etcd = EtcdProcess::Start();
  if (!etcd.ok()) GTEST_SKIP() << etcd.status().message();
  EtcdStoreOptions options;
  // The first endpoint refuses connections (nothing listens there).
  options.endpoint = "http://127.0.0.1:" + std::to_string(FreeLoopbackPort()) + "," + (*etcd)->endpoint();
  options.prefix = "/failover-down";
  auto store = OpenEtcdStore(options);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  ASSERT_TRUE((*store)->Publish(MakePublish("m", "v1", 0, 2)).ok());
  auto r = (*store)->Publish(MakePublish("m", "v1", 1, 2));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->state, VersionState::kCommitted);
  auto m = (*store)->Get("m", "v1");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->content_digest, r->content_digest);

  // No member answers: Unavailable naming both.
  EtcdStoreOptions dead;
  dead.endpoint = "http://127.0.0.1:" + std::to_string(FreeLoopbackPort()) +
                  ",http://127.0.0.1:" + std::to_string(FreeLoopbackPort());
  dead.request_timeout_ms = 300;
  auto none = OpenEtcdStore(dead);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kUnavailable);
}

TEST(EtcdFailoverTest, ACommitAppliedWhoseAnswerWasLostIsReportedCommittedOnce) {
  auto etcd = EtcdProcess::Start();
  if (!etcd.ok()) GTEST_SKIP() << etcd.status().message();
  LosingProxy proxy((*etcd)->endpoint());
  EtcdStoreOptions options;
  options.endpoint = proxy.url() + "," + (*etcd)->endpoint();
  options.prefix = "/failover-lost";
  auto store = OpenEtcdStore(options);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  ASSERT_TRUE((*store)->Publish(MakePublish("m", "v1", 0, 2)).ok());
  auto r = (*store)->Publish(MakePublish("m", "v1", 1, 2));
  EXPECT_TRUE(proxy.lost()) << "the proxy must have dropped the commit's answer";
  ASSERT_TRUE(r.ok()) << "the commit was applied; its publish must say so: " << r.status().ToString();
  EXPECT_EQ(r->state, VersionState::kCommitted);
  EXPECT_EQ(r->commit_seq, 1u);
  auto feed = (*store)->WaitForCommits("m", 0, 0);
  ASSERT_TRUE(feed.ok());
  ASSERT_EQ(feed->size(), 1u) << "applied once";
  EXPECT_EQ((*feed)[0].content_digest, r->content_digest);
}

TEST(EtcdFailoverTest, StoreSpecTakesSeveralUrlsAndThePrefixAfterTheLast) {
  auto misplaced = OpenDirectoryStore("etcd:http://127.0.0.1:1/p,http://127.0.0.1:2");
  ASSERT_FALSE(misplaced.ok());
  EXPECT_EQ(misplaced.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(misplaced.status().message().find("URL 1 of 2"), std::string::npos) << misplaced.status().ToString();
  EXPECT_NE(misplaced.status().message().find("after the last URL"), std::string::npos)
      << misplaced.status().ToString();
  auto not_http = OpenDirectoryStore("etcd:http://127.0.0.1:1,https://127.0.0.1:2");
  ASSERT_FALSE(not_http.ok());
  EXPECT_NE(not_http.status().message().find("URL 2 of 2 must start with http://"), std::string::npos)
      << not_http.status().ToString();
  auto empty = OpenDirectoryStore("etcd:http://127.0.0.1:1,");
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.status().code(), StatusCode::kInvalidArgument);

  auto etcd = EtcdProcess::Start();
  if (!etcd.ok()) GTEST_SKIP() << etcd.status().message();
  // A dead first member, the live one second, and a prefix: the store opens and keeps its keys
  // under the prefix (a second store on the same prefix sees them, one on another does not).
  const std::string dead = "http://127.0.0.1:" + std::to_string(FreeLoopbackPort());
  auto a = OpenDirectoryStore("etcd:" + dead + "," + (*etcd)->endpoint() + "/spec-a");
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE((*a)->Publish(MakePublish("m", "v1", 0, 1)).ok());
  auto same = OpenDirectoryStore("etcd:" + (*etcd)->endpoint() + "/spec-a");
  auto other = OpenDirectoryStore("etcd:" + (*etcd)->endpoint() + "/spec-b");
  ASSERT_TRUE(same.ok() && other.ok());
  EXPECT_TRUE((*same)->Get("m", "v1").ok());
  EXPECT_EQ((*other)->Get("m", "v1").status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace rc::directory::testing
