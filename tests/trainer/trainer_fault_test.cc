// Fault tests of the trainer: a version that one rank never publishes is never committed (and is
// abandoned once the trainer dies), and a trainer killed with SIGKILL leaves nothing that stops a
// new trainer from publishing and committing the next version.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "rolloutcore/base/clock.h"
#include "rolloutcore/directory/client.h"
#include "rolloutcore/directory/memory_store.h"
#include "rolloutcore/directory/server.h"
#include "rolloutcore/refit/layouts.h"
#include "rolloutcore/trainer/synthetic_trainer.h"
#include "trainer/read_shards.h"
#include "trainer/trainer_process.h"

namespace rc::trainer {
namespace {

using namespace std::chrono_literals;

class TrainerFaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = directory::NewMemoryStore(SystemClock::Default());
    server_ = std::make_unique<directory::DirectoryServer>(store_.get(), directory::ServerOptions{});
    ASSERT_TRUE(server_->Start().ok());
    client_ = std::make_unique<directory::DirectoryClient>(server_->url());
  }
  void TearDown() override { server_->Stop(); }

  std::vector<std::string> Args(std::vector<std::string> extra) {
    std::vector<std::string> a = {"--model", "tiny", "--layout", "fsdp:2", "--transport", "shm", "--directory",
                                  server_->url(), "--seed", "3", "--lease-ttl-ms", "600"};  // default --lr
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  }

  // Polls GetInfo until `state` or the timeout.
  Result<directory::VersionInfo> WaitForState(const std::string& version, directory::VersionState state,
                                              std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      auto info = client_->GetInfo("tiny", version);
      if (info.ok() && info->state == state) return info;
      if (std::chrono::steady_clock::now() > deadline) {
        return DeadlineExceeded(version + " did not reach " + std::string(directory::VersionStateName(state)) +
                                (info.ok() ? " (is " + std::string(directory::VersionStateName(info->state)) + ")"
                                           : " (" + info.status().ToString() + ")"));
      }
      std::this_thread::sleep_for(20ms);
    }
  }

  std::unique_ptr<directory::DirectoryStore> store_;
  std::unique_ptr<directory::DirectoryServer> server_;
  std::unique_ptr<directory::DirectoryClient> client_;
};

TEST_F(TrainerFaultTest, MissingRankNeverCommitsAndAKilledTrainerIsAbandoned) {
  auto failing = testing::TrainerProcess::Spawn(Args({"--fail-rank", "1"}));
  ASSERT_TRUE(failing.ok()) << failing.status().ToString();
  ASSERT_TRUE((*failing)->WaitForLine("published v0", 30s));
  // Several lease lifetimes later the version is still STAGING with rank 0 only: the keeper keeps
  // rank 0's lease alive and nobody commits a version with a rank missing.
  std::this_thread::sleep_for(1500ms);
  auto info = client_->GetInfo("tiny", "v0");
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->state, directory::VersionState::kStaging);
  EXPECT_EQ(info->published_ranks, std::vector<int32_t>{0});
  EXPECT_EQ(client_->Get("tiny", "v0").status().code(), StatusCode::kFailedPrecondition);

  // SIGKILL: no cleanup runs; the lease runs out and the version is abandoned.
  ASSERT_NE((*failing)->SignalAndWait(SIGKILL, 5s), -1);
  auto abandoned = WaitForState("v0", directory::VersionState::kAbandoned, 10s);
  ASSERT_TRUE(abandoned.ok()) << abandoned.status().ToString();
  EXPECT_NE(abandoned->reason.find("lease"), std::string::npos) << abandoned->reason;

  // A new trainer continues with the next label and commits.
  auto fresh = testing::TrainerProcess::Spawn(Args({"--first-step", "auto"}));
  ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
  auto v1 = directory::WaitForVersion(*client_, "tiny", "v1", 30'000);
  ASSERT_TRUE(v1.ok()) << v1.status().ToString();
  auto m = client_->Get("tiny", "v1");
  ASSERT_TRUE(m.ok());
  auto reader = CreateTrainerTransport("shm");
  ASSERT_TRUE(reader.ok());
  const auto published = testing::ReadManifest(**reader, *m);
  for (const refit::ShardTable& t : m->tables) {
    EXPECT_EQ(published.at(t.name), ComputeBf16({3, 1e-3f}, t.spec(), refit::FullBox(t.shape), 1)) << t.name;
  }
}

TEST_F(TrainerFaultTest, SigkillAfterCommitLeavesNoStuckStateAndDeadHandlesFailCleanly) {
  auto first = testing::TrainerProcess::Spawn(Args({}));
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  auto v0 = directory::WaitForVersion(*client_, "tiny", "v0", 30'000);
  ASSERT_TRUE(v0.ok()) << v0.status().ToString();
  auto m0 = client_->Get("tiny", "v0");
  ASSERT_TRUE(m0.ok());
  ASSERT_NE((*first)->SignalAndWait(SIGKILL, 5s), -1);

  // The committed v0 still names the dead trainer's memory: importing it fails, it never hangs.
  auto reader = CreateTrainerTransport("shm");
  ASSERT_TRUE(reader.ok());
  auto remote = (*reader)->Import(m0->tables[0].shards[0].handle);
  ASSERT_FALSE(remote.ok());
  EXPECT_EQ(remote.status().code(), StatusCode::kUnavailable) << remote.status().ToString();

  // Without --first-step auto the new trainer refuses the used label, naming it.
  // (and must leave the dead trainer's committed v0 alone).
  auto clash = testing::TrainerProcess::RunUntilExit(Args({}), 15s);
  ASSERT_TRUE(clash.ok()) << clash.status().ToString();
  EXPECT_TRUE(WIFEXITED(*clash));
  EXPECT_NE(WEXITSTATUS(*clash), 0);
  EXPECT_TRUE(client_->GetInfo("tiny", "v0").ok());

  auto second = testing::TrainerProcess::Spawn(Args({"--first-step", "auto"}));
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  auto v1 = directory::WaitForVersion(*client_, "tiny", "v1", 30'000);
  ASSERT_TRUE(v1.ok()) << v1.status().ToString();
  EXPECT_EQ(v1->seq, 2u);
  auto m1 = client_->Get("tiny", "v1");
  ASSERT_TRUE(m1.ok());
  const auto published = testing::ReadManifest(**reader, *m1);
  for (const refit::ShardTable& t : m1->tables) {
    EXPECT_EQ(published.at(t.name), ComputeBf16({3, 1e-3f}, t.spec(), refit::FullBox(t.shape), 1)) << t.name;
  }
  const int exit_status = (*second)->SignalAndWait(SIGTERM, 10s);
  ASSERT_NE(exit_status, -1);
  EXPECT_EQ(WEXITSTATUS(exit_status), 0);
}

}  // namespace
}  // namespace rc::trainer
