// The directory killed with SIGKILL around a commit (issue 13, defect 5), with real processes: a
// `trainer serve` child publishing over shm, and a directory on an SQLite file that kills itself
// exactly before or after committing v1 (rc_crashing_directory), then the real `directory serve`
// restarted on the same file and port. Whatever the moment, the trainer must end knowing the true
// outcome: v1 is COMMITTED and every byte its manifest names is still served, or it is not
// committed; never a committed version whose buffers the trainer dropped.
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <future>
#include <thread>

#include "directory/test_util.h"
#include "rolloutcore/base/json.h"
#include "rolloutcore/directory/client.h"
#include "rolloutcore/directory/sqlite_store.h"
#include "rolloutcore/refit/layouts.h"
#include "rolloutcore/trainer/synthetic_trainer.h"
#include "trainer/read_shards.h"
#include "trainer/trainer_process.h"

#ifndef RC_CRASHING_DIRECTORY_BIN
#error "RC_CRASHING_DIRECTORY_BIN must name the rc_crashing_directory binary"
#endif
#ifndef RC_DIRECTORY_SERVE_BIN
#error "RC_DIRECTORY_SERVE_BIN must name the rc_directory_serve_for_test binary"
#endif

namespace rc::trainer {
namespace {

using namespace std::chrono_literals;
using directory::testing::ChildProcess;

struct StepAnswer {
  int http_status = 0;  // 0: no answer
  std::string body;
};

class DirectoryCrashTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = directory::testing::MakeTempDir("rc-dir-crash");
    db_ = dir_ + "/directory.db";
    port_ = directory::testing::FreeLoopbackPort();
    url_ = "http://127.0.0.1:" + std::to_string(port_);
  }
  void TearDown() override { directory::testing::RemoveTree(dir_); }

  void StartCrashing(const std::string& mode) {
    ASSERT_TRUE(crashing_.Start({RC_CRASHING_DIRECTORY_BIN, db_, std::to_string(port_), mode, "tiny", "v1"},
                                dir_ + "/crashing.log")
                    .ok());
    auto line = crashing_.ReadLineContaining("directory listening on", 20s);
    ASSERT_TRUE(line.ok()) << line.status().ToString();
  }
  // The real `directory serve` on the same file and port.
  void StartReal() {
    ASSERT_TRUE(real_.Start({RC_DIRECTORY_SERVE_BIN, "directory", "serve", "--store", "sqlite:" + db_, "--port",
                             std::to_string(port_)},
                            dir_ + "/real.log")
                    .ok());
    auto line = real_.ReadLineContaining("directory listening on", 20s);
    ASSERT_TRUE(line.ok()) << line.status().ToString();
  }
  // Waits until the crashing directory has killed itself (SIGKILL) and reaps it.
  void WaitForCrash() {
    const auto deadline = std::chrono::steady_clock::now() + 60s;
    siginfo_t info{};
    for (;;) {
      info = siginfo_t{};
      ASSERT_EQ(::waitid(P_PID, static_cast<id_t>(crashing_.pid()), &info, WEXITED | WNOHANG | WNOWAIT), 0);
      if (info.si_pid == crashing_.pid()) break;
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "the directory did not crash at v1's commit";
      std::this_thread::sleep_for(10ms);
    }
    const int status = crashing_.Kill(SIGKILL);  // reaps
    ASSERT_TRUE(WIFSIGNALED(status));
    EXPECT_EQ(WTERMSIG(status), SIGKILL);
  }
  // What the SQLite file says about v1 while no directory runs.
  directory::VersionState StateOnDisk() {
    auto store = directory::OpenSqliteStore(db_, directory::WallClock());
    EXPECT_TRUE(store.ok()) << store.status().ToString();
    if (!store.ok()) return directory::VersionState::kAbandoned;
    auto info = (*store)->GetInfo("tiny", "v1");
    EXPECT_TRUE(info.ok()) << info.status().ToString();
    return info.ok() ? info->state : directory::VersionState::kAbandoned;
  }

  Result<std::unique_ptr<testing::TrainerProcess>> SpawnTrainer(int64_t outcome_timeout_ms) {
    return testing::TrainerProcess::Spawn({"--model", "tiny", "--layout", "fsdp:2", "--transport", "shm",
                                           "--directory", url_, "--seed", "3", "--lease-ttl-ms", "30000",
                                           "--publish-outcome-timeout-ms", std::to_string(outcome_timeout_ms)});
  }
  static std::future<StepAnswer> PostStep(const std::string& trainer_url) {
    return std::async(std::launch::async, [trainer_url] {
      httplib::Client http(trainer_url);
      http.set_read_timeout(120, 0);
      auto res = http.Post("/step", "", "application/json");
      return res ? StepAnswer{res->status, res->body} : StepAnswer{};
    });
  }
  // v1 is committed in the (restarted) directory and every shard it names reads back exactly.
  void ExpectV1CommittedAndServed() {
    directory::DirectoryClient client(url_);
    auto info = client.GetInfo("tiny", "v1");
    ASSERT_TRUE(info.ok()) << info.status().ToString();
    ASSERT_EQ(info->state, directory::VersionState::kCommitted);
    auto m = client.Get("tiny", "v1");
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    auto reader = CreateTrainerTransport("shm");
    ASSERT_TRUE(reader.ok());
    const auto published = testing::ReadManifest(**reader, *m);
    for (const refit::ShardTable& t : m->tables) {
      EXPECT_EQ(published.at(t.name), ComputeBf16({3, 1e-3f}, t.spec(), refit::FullBox(t.shape), 1)) << t.name;
    }
  }

  std::string dir_, db_, url_;
  int port_ = 0;
  ChildProcess crashing_, real_;
};

// The commit was durable, the answer was lost. The trainer keeps asking; once the directory is
// back it learns of the commit, reports v1 COMMITTED, and still serves its buffers.
TEST_F(DirectoryCrashTest, KilledAfterADurableCommitTheTrainerLearnsTheCommitAndKeepsServing) {
  StartCrashing("after-commit");
  auto trainer = SpawnTrainer(60'000);  // v0 commits normally
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  auto step = PostStep((*trainer)->url());
  WaitForCrash();
  EXPECT_EQ(StateOnDisk(), directory::VersionState::kCommitted);  // acknowledged only once durable
  StartReal();
  ASSERT_EQ(step.wait_for(60s), std::future_status::ready) << "POST /step did not return after the restart";
  const StepAnswer answer = step.get();
  ASSERT_EQ(answer.http_status, 200) << answer.body;
  auto j = ParseJson(answer.body);
  ASSERT_TRUE(j.ok());
  EXPECT_EQ(j->at("version"), "v1");
  EXPECT_EQ(j->at("state"), "COMMITTED");
  ExpectV1CommittedAndServed();
}

// The directory stays away longer than the trainer asks: the step fails "outcome unknown", but the
// buffers stay registered, so the commit that did happen is served once the directory is back;
// the version is tracked, and the trainer's clean exit releases it.
TEST_F(DirectoryCrashTest, KilledAfterCommitAndBackTooLateTheBuffersAreStillServed) {
  StartCrashing("after-commit");
  auto trainer = SpawnTrainer(1'000);
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  auto step = PostStep((*trainer)->url());
  WaitForCrash();
  ASSERT_EQ(step.wait_for(60s), std::future_status::ready);
  const StepAnswer answer = step.get();
  EXPECT_EQ(answer.http_status, 503) << answer.body;
  EXPECT_NE(answer.body.find("outcome unknown"), std::string::npos) << answer.body;
  {
    httplib::Client http((*trainer)->url());
    auto res = http.Get("/status");
    ASSERT_TRUE(res);
    auto status = ParseJson(res->body);
    ASSERT_TRUE(status.ok());
    ASSERT_EQ(status->at("versions").size(), 2u) << res->body;  // v1 is tracked, not forgotten
    EXPECT_EQ(status->at("versions")[1].at("version"), "v1");
    EXPECT_EQ(status->at("versions")[1].at("unresolved"), true) << res->body;
  }
  StartReal();
  ExpectV1CommittedAndServed();
  ASSERT_NE((*trainer)->SignalAndWait(SIGTERM, 20s), -1);
  directory::DirectoryClient client(url_);
  EXPECT_EQ(client.GetInfo("tiny", "v1").status().code(), StatusCode::kNotFound);  // released at exit
}

// Killed before the committing publish was written: on disk v1 is not committed. The trainer's
// inquiry finds it STAGING, publishes the same tables again, and that commit is the one reported.
TEST_F(DirectoryCrashTest, KilledBeforeTheCommitNothingIsCommittedUntilTheTrainerPublishesAgain) {
  StartCrashing("before-commit");
  auto trainer = SpawnTrainer(60'000);
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  auto step = PostStep((*trainer)->url());
  WaitForCrash();
  EXPECT_EQ(StateOnDisk(), directory::VersionState::kStaging);
  StartReal();
  ASSERT_EQ(step.wait_for(60s), std::future_status::ready);
  const StepAnswer answer = step.get();
  ASSERT_EQ(answer.http_status, 200) << answer.body;
  auto j = ParseJson(answer.body);
  ASSERT_TRUE(j.ok());
  EXPECT_EQ(j->at("state"), "COMMITTED");
  ExpectV1CommittedAndServed();
}

}  // namespace
}  // namespace rc::trainer
