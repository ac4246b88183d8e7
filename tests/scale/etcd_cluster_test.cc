// The directory on a 3-member etcd cluster (issue 19): `directory serve --store
// etcd:URL,URL,URL/PREFIX` over a real cluster started here (etcd_cluster.h). The leader is
// killed with SIGKILL while a version is half published and while its committing publish is in
// flight; one member is frozen (a minority partition). Committed versions are never lost, a
// half-published version is never visible, the commit feed stays gapless, and watchers — a commit
// feed long-poll, `controller serve --auto-update`, and the engine's receiver staging from the
// directory — continue across the kills.
#include "scale/etcd_cluster.h"

#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <set>

#include "directory/test_util.h"
#include "rolloutcore/directory/client.h"
#include "system/system_fixture.h"

namespace rc::scale_test {
namespace {

using apps::ChildProcess;
using directory::DirectoryClient;
using directory::VersionState;
using directory::testing::MakePublish;
using system_test::NowMs;
using system_test::Reply;
using system_test::Stack;
using system_test::SystemTest;

class EtcdClusterTest : public SystemTest {
 protected:
  // `directory serve` over the cluster; returns its port.
  int StartClusterDirectory(const std::string& name = "directory") {
    int port = apps::FreePort().value();
    ChildProcess* d = Start(name, {"directory", "serve", "--store", "etcd:" + etcd_.Endpoints() + "/scale-test",
                                   "--port", std::to_string(port)});
    EXPECT_TRUE(WaitHealthy(d, port, "/health"));
    return port;
  }
  EtcdCluster etcd_;
};

// Versions whose commit the test saw confirmed, with the digest the publish returned.
struct Confirmed {
  std::map<std::string, uint64_t> digest;
  std::map<std::string, uint64_t> seq;
};

void ExpectCommittedWhole(DirectoryClient& dir, const std::string& version, uint64_t digest) {
  auto m = dir.Get("m", version);
  ASSERT_TRUE(m.ok()) << version << ": " << m.status().ToString();
  EXPECT_EQ(m->content_digest, digest) << version;
  EXPECT_EQ(m->tables.size(), 2u) << version << ": a committed version holds every rank's tables";
}

TEST_F(EtcdClusterTest, LeaderKilledDuringPublishAndCommitLosesNothingAndShowsNothingPartial) {
  if (!EtcdCluster::Installed()) GTEST_SKIP() << "/usr/bin/etcd is not installed (Debian package etcd-server)";
  ASSERT_TRUE(etcd_.Start(dir_ + "/etcd"));
  const int port = StartClusterDirectory();
  DirectoryClient dir(Url(port));
  Confirmed confirmed;

  // A watcher on the commit feed through the directory, for the whole test.
  std::atomic<bool> stop{false};
  std::vector<std::string> watched;
  std::vector<uint64_t> watched_seqs;
  std::thread watcher([&] {
    DirectoryClient w(Url(port));
    uint64_t after = 0;
    while (!stop) {
      auto events = w.WaitForCommits("m", after, 300);
      if (!events.ok()) continue;  // the directory answers even while etcd elects; retry anyway
      for (const auto& e : *events) {
        watched.push_back(e.version);
        watched_seqs.push_back(e.seq);
        after = std::max(after, e.seq);
      }
    }
  });

  auto commit_both = [&](const std::string& v) {
    auto r0 = dir.Publish(MakePublish("m", v, 0, 2));
    ASSERT_TRUE(r0.ok()) << v << " rank 0: " << r0.status().ToString();
    auto r1 = dir.Publish(MakePublish("m", v, 1, 2));
    ASSERT_TRUE(r1.ok()) << v << " rank 1: " << r1.status().ToString();
    ASSERT_EQ(r1->state, VersionState::kCommitted);
    confirmed.digest[v] = r1->content_digest;
    confirmed.seq[v] = r1->commit_seq;
  };
  commit_both("v1");

  // 1. Leader killed during a publish: rank 0 of v2 is published (STAGING), the leader dies, then
  //    rank 1 publishes. v2 is invisible until the commit, then whole.
  int leader = etcd_.Leader();
  ASSERT_GE(leader, 0);
  auto r0 = dir.Publish(MakePublish("m", "v2", 0, 2));
  ASSERT_TRUE(r0.ok()) << r0.status().ToString();
  EXPECT_EQ(r0->state, VersionState::kStaging);
  etcd_.Kill(leader);
  const int64_t t_kill1 = NowMs();
  auto half = dir.Get("m", "v2");
  EXPECT_FALSE(half.ok()) << "a half-published version must not be visible";
  auto r1 = dir.Publish(MakePublish("m", "v2", 1, 2));
  ASSERT_TRUE(r1.ok()) << r1.status().ToString();
  EXPECT_EQ(r1->state, VersionState::kCommitted);
  Figure("commit_after_leader_kill_ms", NowMs() - t_kill1);
  confirmed.digest["v2"] = r1->content_digest;
  confirmed.seq["v2"] = r1->commit_seq;
  ExpectCommittedWhole(dir, "v1", confirmed.digest["v1"]);
  ExpectCommittedWhole(dir, "v2", confirmed.digest["v2"]);
  ASSERT_TRUE(etcd_.Restart(leader));  // it rejoins over its data dir

  // 2. Leader killed during the commit: the leader is frozen so the committing publish of v3
  //    stays in flight inside etcd, then killed; the publish ends committed (the client retried
  //    on another member; the txn's compares make a second application impossible) or says it
  //    does not know — and then the version is either whole or not visible, never partial.
  leader = etcd_.Leader();
  ASSERT_GE(leader, 0);
  auto s0 = dir.Publish(MakePublish("m", "v3", 0, 2));
  ASSERT_TRUE(s0.ok()) << s0.status().ToString();
  ASSERT_TRUE(etcd_.Freeze(leader));
  auto pending = std::async(std::launch::async, [&] {
    DirectoryClient c(Url(port));
    return c.Publish(MakePublish("m", "v3", 1, 2));
  });
  EXPECT_EQ(pending.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout)
      << "the commit should be waiting on the frozen leader";
  etcd_.Kill(leader);
  const int64_t t_kill2 = NowMs();
  auto s1 = pending.get();
  Figure("commit_in_flight_at_leader_kill_ms", NowMs() - t_kill2);
  if (s1.ok()) {
    EXPECT_EQ(s1->state, VersionState::kCommitted);
    confirmed.digest["v3"] = s1->content_digest;
    confirmed.seq["v3"] = s1->commit_seq;
  } else {
    ADD_FAILURE() << "the commit in flight at the leader's death did not end committed: " << s1.status().ToString();
  }
  auto info3 = dir.GetInfo("m", "v3");
  ASSERT_TRUE(info3.ok()) << info3.status().ToString();
  if (info3->state == VersionState::kCommitted) {
    ExpectCommittedWhole(dir, "v3", info3->content_digest);
  } else {
    EXPECT_FALSE(dir.Get("m", "v3").ok()) << "not committed, so not visible";
  }
  ASSERT_TRUE(etcd_.Restart(leader));

  // 3. A minority partition: one member frozen (it answers neither its peers nor clients), each
  //    member in turn — so once the leader, once the member the directory was talking to.
  int64_t worst_ms = 0;
  for (int i = 0; i < etcd_.size(); ++i) {
    SCOPED_TRACE("member " + std::to_string(i) + " frozen");
    ASSERT_TRUE(etcd_.Freeze(i));
    const int64_t t_freeze = NowMs();
    const std::string v = "v" + std::to_string(4 + i);
    commit_both(v);
    worst_ms = std::max(worst_ms, NowMs() - t_freeze);
    ExpectCommittedWhole(dir, v, confirmed.digest[v]);
    etcd_.Thaw(i);
    ASSERT_TRUE(etcd_.WaitAllHealthy(30000));
  }
  Figure("commit_with_a_member_frozen_worst_ms", worst_ms);
  EXPECT_LT(worst_ms, 20000) << "a minority down must not stop the directory";
  commit_both("v7");

  // Nothing confirmed is lost; every committed version is whole; the feed is gapless and in order.
  for (const auto& [v, d] : confirmed.digest) ExpectCommittedWhole(dir, v, d);
  auto listed = dir.List("m");
  ASSERT_TRUE(listed.ok()) << listed.status().ToString();
  std::set<uint64_t> seqs;
  for (const auto& info : *listed) {
    EXPECT_EQ(info.published_ranks.size(), 2u) << info.version;
    seqs.insert(info.commit_seq);
  }
  EXPECT_EQ(listed->size(), confirmed.digest.size());
  const int64_t deadline = NowMs() + 10000;
  while (watched.size() < confirmed.digest.size() && NowMs() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  stop = true;
  watcher.join();
  ASSERT_EQ(watched.size(), confirmed.digest.size()) << "the watcher saw every commit exactly once";
  for (size_t i = 0; i < watched_seqs.size(); ++i) {
    EXPECT_EQ(watched_seqs[i], i + 1) << "commit sequence numbers are consecutive from 1";
    EXPECT_EQ(confirmed.seq[watched[i]], watched_seqs[i]) << watched[i];
  }
  EXPECT_EQ(seqs.size(), listed->size()) << "no two versions share a sequence number";
}

// The whole stack over the cluster: trainer publishes, `controller serve --auto-update` follows
// the commit feed, the engine's receiver stages from the directory. The leader is killed twice
// (once right as the trainer starts a step); every version still reaches the engine.
TEST_F(EtcdClusterTest, AutoUpdatingControllerAndReceiverContinueAcrossLeaderKills) {
  if (!EtcdCluster::Installed()) GTEST_SKIP() << "/usr/bin/etcd is not installed (Debian package etcd-server)";
  ASSERT_TRUE(etcd_.Start(dir_ + "/etcd"));
  Stack s;
  s.state_dir = dir_ + "/controller";
  s.v0_dir = dir_ + "/v0";
  s.controller_args = {"--auto-update", "--verify-interval-ms", "0"};
  s.dir = StartClusterDirectory();
  Export("v0", s.v0_dir);
  s.engine = StartEngine("engine", s.v0_dir, "v0", false, &s.engine_proc);
  s.trainer = StartTrainer(s.dir, "shm", &s.trainer_proc);
  WaitCommitted(s.dir, "v0");
  StartController(s);

  auto wait_label = [&](const std::string& label) {
    const int64_t end = NowMs() + 60000;
    while (NowMs() < end) {
      Json e = EngineStatus(s.ctl);
      if (e.value("state", std::string()) == "READY" && e.value("label", std::string()) == label) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  };
  Json v1 = Step(s, "v1");
  ASSERT_TRUE(wait_label("v1")) << EngineStatus(s.ctl).dump();

  // Kill the leader, then step: the publish and the commit happen on the new leader.
  int leader = etcd_.Leader();
  ASSERT_GE(leader, 0);
  etcd_.Kill(leader);
  Json v2 = Step(s, "v2");
  ASSERT_TRUE(wait_label("v2")) << "auto-update continued after the leader's death: " << EngineStatus(s.ctl).dump();
  ASSERT_TRUE(etcd_.Restart(leader));

  // Kill the new leader the moment the trainer starts publishing v3.
  leader = etcd_.Leader();
  ASSERT_GE(leader, 0);
  auto step = std::async(std::launch::async, [&] { return Http(s.trainer, "POST", "/step"); });
  etcd_.Kill(leader);
  Reply stepped = step.get();
  EXPECT_EQ(stepped.status, 200) << stepped.text;
  Json v3 = WaitCommitted(s.dir, "v3");
  ASSERT_TRUE(wait_label("v3")) << EngineStatus(s.ctl).dump();

  // The engine's live weights are exactly the committed v3 (the receiver staged it whole).
  EXPECT_EQ(LiveDigest(s.engine), v3.value("content_digest", std::string("none")));
  Json done = Call(s.ctl, "GET", "/v1/status");
  EXPECT_EQ(done["engines"][0].value("state", std::string()), "READY");
}

}  // namespace
}  // namespace rc::scale_test
