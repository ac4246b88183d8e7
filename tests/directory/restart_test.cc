// `directory serve` as a real process: publish and commit, kill -9 the server, start it again on
// the same store, and the committed version is still discoverable (SQLite; and etcd when installed).
#include <gtest/gtest.h>

#include <signal.h>

#include "directory/test_util.h"
#include "rolloutcore/directory/client.h"

namespace rc::directory::testing {
namespace {

// Starts the server binary on `store` and returns its URL.
Result<std::string> StartServer(ChildProcess* child, const std::string& store, const std::string& log) {
  RC_RETURN_IF_ERROR(child->Start({RC_DIRECTORY_SERVE_BIN, "directory", "serve", "--store", store, "--port", "0"}, log));
  RC_ASSIGN_OR_RETURN(std::string line, child->ReadLineContaining("directory listening on", std::chrono::seconds(20)));
  const size_t at = line.find("http://");
  const size_t end = line.find(' ', at);
  if (at == std::string::npos) return Internal("no URL in: " + line);
  return line.substr(at, end - at);
}

void PublishAndCommit(DirectoryClient& client, const std::string& version, uint64_t expected_seq) {
  auto r0 = client.Publish(MakePublish("m", version, 0, 2));
  ASSERT_TRUE(r0.ok()) << r0.status().ToString();
  auto r1 = client.Publish(MakePublish("m", version, 1, 2));
  ASSERT_TRUE(r1.ok()) << r1.status().ToString();
  ASSERT_EQ(r1->state, VersionState::kCommitted);
  ASSERT_EQ(r1->commit_seq, expected_seq);
}

void RestartKeepsCommittedVersions(const std::string& store, const std::string& dir) {
  ChildProcess server;
  auto url = StartServer(&server, store, dir + "/server.log");
  ASSERT_TRUE(url.ok()) << url.status().ToString();
  uint64_t digest = 0;
  {
    DirectoryClient client(*url);
    PublishAndCommit(client, "v1", 1);
    auto staged = client.Publish(MakePublish("m", "v2", 0, 2));
    ASSERT_TRUE(staged.ok());
    auto m = client.Get("m", "v1");
    ASSERT_TRUE(m.ok());
    digest = m->content_digest;
  }
  const int status = server.Kill(SIGKILL);
  ASSERT_TRUE(WIFSIGNALED(status));

  ChildProcess again;
  auto url2 = StartServer(&again, store, dir + "/server.log");
  ASSERT_TRUE(url2.ok()) << url2.status().ToString();
  DirectoryClient client(*url2);
  auto m = client.Get("m", "v1");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->content_digest, digest);
  EXPECT_EQ(m->tables.size(), 2u);
  auto listed = client.List("m");
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].version, "v1");
  auto feed = client.WaitForCommits("m", 0, 0);
  ASSERT_TRUE(feed.ok());
  ASSERT_EQ(feed->size(), 1u);
  // The staging version survived too; its last rank completes it with the next sequence number.
  auto r1 = client.Publish(MakePublish("m", "v2", 1, 2));
  ASSERT_TRUE(r1.ok()) << r1.status().ToString();
  EXPECT_EQ(r1->state, VersionState::kCommitted);
  EXPECT_EQ(r1->commit_seq, 2u);
  EXPECT_EQ(again.Kill(SIGTERM) & 0x7f, 0);  // SIGTERM: a clean exit
}

TEST(DirectoryRestartTest, SqliteKeepsCommittedVersionsAcrossAKill) {
  const std::string dir = MakeTempDir("rc-dir-restart");
  RestartKeepsCommittedVersions("sqlite:" + dir + "/directory.db", dir);
  RemoveTree(dir);
}

TEST(DirectoryRestartTest, EtcdKeepsCommittedVersionsAcrossAKill) {
  auto etcd = EtcdProcess::Start();
  if (!etcd.ok()) GTEST_SKIP() << etcd.status().message();
  const std::string dir = MakeTempDir("rc-dir-restart-etcd");
  RestartKeepsCommittedVersions("etcd:" + (*etcd)->endpoint() + "/restart-test", dir);
  RemoveTree(dir);
}

TEST(DirectoryRestartTest, MemoryStoreForgetsAndBadStoreSpecFails) {
  ChildProcess bad;
  ASSERT_TRUE(bad.Start({RC_DIRECTORY_SERVE_BIN, "directory", "serve", "--store", "bogus:x", "--port", "0"}).ok());
  auto line = bad.ReadLineContaining("listening", std::chrono::seconds(5));
  EXPECT_FALSE(line.ok());  // it exits without serving
  ChildProcess server;
  auto url = StartServer(&server, "memory", "");
  ASSERT_TRUE(url.ok()) << url.status().ToString();
  EXPECT_EQ(url->rfind("http://127.0.0.1:", 0), 0u) << *url;  // loopback by default
  DirectoryClient client(*url);
  PublishAndCommit(client, "v1", 1);
  server.Kill(SIGKILL);
  ChildProcess again;
  auto url2 = StartServer(&again, "memory", "");
  ASSERT_TRUE(url2.ok());
  DirectoryClient client2(*url2);
  EXPECT_EQ(client2.Get("m", "v1").status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace rc::directory::testing
