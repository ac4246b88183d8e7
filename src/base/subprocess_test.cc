#include "rolloutcore/base/subprocess.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <string>

namespace rc {
namespace {

using std::chrono::milliseconds;

std::unique_ptr<Subprocess> Sh(const std::string& script, SubprocessOptions o = {}) {
  o.argv = {"/bin/sh", "-c", script};
  auto p = Subprocess::Spawn(o);
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  return p.ok() ? std::move(p).value() : nullptr;
}

bool PidExists(pid_t pid) { return ::kill(pid, 0) == 0 || errno != ESRCH; }

// True while `pid` runs (or sleeps, or is stopped): false once it is gone or a zombie.
bool PidRuns(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(in, stat)) return false;
  const size_t paren = stat.rfind(')');
  return paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] != 'Z' && stat[paren + 2] != 'X';
}

TEST(SubprocessTest, WaitReturnsTheExitCode) {
  auto p = Sh("exit 3");
  ASSERT_NE(p, nullptr);
  auto code = p->Wait(milliseconds(10000));
  ASSERT_TRUE(code.ok()) << code.status().ToString();
  EXPECT_EQ(*code, 3);
  EXPECT_FALSE(p->Alive());
  EXPECT_TRUE(p->reaped());
  EXPECT_TRUE(WIFEXITED(p->wait_status()));
  EXPECT_EQ(WEXITSTATUS(p->wait_status()), 3);
}

TEST(SubprocessTest, WaitTimesOutWhileTheChildRunsAndKillEndsIt) {
  auto p = Sh("exec sleep 30");
  ASSERT_NE(p, nullptr);
  auto code = p->Wait(milliseconds(100));
  EXPECT_EQ(code.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(p->Alive());
  EXPECT_EQ(p->Kill(), -SIGKILL);
  EXPECT_FALSE(p->Alive());
  EXPECT_FALSE(PidExists(p->pid())) << "reaped: the pid is gone";
}

TEST(SubprocessTest, TerminateSendsTermThenKillsAChildThatIgnoresIt) {
  auto polite = Sh("exec sleep 30");
  ASSERT_NE(polite, nullptr);
  EXPECT_EQ(polite->Terminate(milliseconds(5000)), -SIGTERM);

  // A child that ignores SIGTERM is SIGKILLed after the grace period.
  auto stubborn = Sh("trap '' TERM; echo ready; while :; do sleep 0.05; done", {.stdout_io = ChildIo::kPipe});
  ASSERT_NE(stubborn, nullptr);
  ASSERT_EQ(stubborn->ReadLine(milliseconds(10000)).value_or(""), "ready");
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(stubborn->Terminate(milliseconds(200)), -SIGKILL);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, milliseconds(200));
}

TEST(SubprocessTest, PipesCarryLinesBothWaysAndEofEndsTheChild) {
  auto p = Sh("echo hello; while read line; do echo \"got $line\"; done; echo bye",
              {.stdin_io = ChildIo::kPipe, .stdout_io = ChildIo::kPipe});
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->ReadLine(milliseconds(10000)).value_or("?"), "hello");
  ASSERT_TRUE(p->Write("one\ntwo\n").ok());
  EXPECT_EQ(p->ReadLine(milliseconds(10000)).value_or("?"), "got one");
  EXPECT_EQ(p->ReadLine(milliseconds(10000)).value_or("?"), "got two");
  EXPECT_EQ(p->ReadLine(milliseconds(50)).status().code(), StatusCode::kDeadlineExceeded);
  p->CloseStdin();
  EXPECT_EQ(p->ReadLine(milliseconds(10000)).value_or("?"), "bye");
  EXPECT_EQ(p->ReadLine(milliseconds(10000)).status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(p->Wait(milliseconds(10000)).value_or(-1), 0);
  EXPECT_EQ(p->Write("late\n").code(), StatusCode::kFailedPrecondition);
}

TEST(SubprocessTest, EnvironmentIsAddedToAndFilesAreAppendedTo) {
  const std::string log = std::filesystem::temp_directory_path() / ("rc_subprocess_" + std::to_string(::getpid()));
  std::filesystem::remove(log);
  ::setenv("RC_SUBPROCESS_TEST_KEEP", "kept", 1);
  ::setenv("RC_SUBPROCESS_TEST_OVER", "old", 1);
  for (int i = 0; i < 2; ++i) {
    auto p = Sh("echo \"$RC_SUBPROCESS_TEST_KEEP $RC_SUBPROCESS_TEST_OVER $RC_SUBPROCESS_TEST_NEW\"; echo err >&2",
                {.env = {"RC_SUBPROCESS_TEST_OVER=new", "RC_SUBPROCESS_TEST_NEW=added"},
                 .stdin_io = ChildIo::kNull,
                 .stdout_io = ChildIo::kFile,
                 .stderr_io = ChildIo::kFile,
                 .stdout_path = log,
                 .stderr_path = log});
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(p->Wait(milliseconds(10000)).value_or(-1), 0);
  }
  std::ifstream in(log);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(text.str(), "kept new added\nerr\nkept new added\nerr\n");
  std::filesystem::remove(log);
}

TEST(SubprocessTest, SpawnNamesWhatCannotBeStarted) {
  auto missing = Subprocess::Spawn({.argv = {"/nonexistent/rc_binary"}});
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("/nonexistent/rc_binary"), std::string::npos)
      << missing.status().message();
  auto bad_log = Subprocess::Spawn(
      {.argv = {"/bin/true"}, .stdout_io = ChildIo::kFile, .stdout_path = "/nonexistent/dir/log"});
  ASSERT_FALSE(bad_log.ok());
  EXPECT_NE(bad_log.status().message().find("/nonexistent/dir/log"), std::string::npos)
      << bad_log.status().message();
  EXPECT_EQ(Subprocess::Spawn({}).status().code(), StatusCode::kInvalidArgument);
}

TEST(SubprocessTest, AProcessGroupIsSignalledWhole) {
  // The shell starts a grandchild and prints its pid; killing the group ends both.
  auto p = Sh("sleep 30 & echo $!; wait", {.stdout_io = ChildIo::kPipe, .own_process_group = true});
  ASSERT_NE(p, nullptr);
  auto line = p->ReadLine(milliseconds(10000));
  ASSERT_TRUE(line.ok()) << line.status().ToString();
  const pid_t grandchild = static_cast<pid_t>(std::stol(*line));
  EXPECT_EQ(::getpgid(grandchild), p->pid());
  EXPECT_TRUE(PidRuns(grandchild));
  EXPECT_EQ(p->Terminate(milliseconds(5000)), -SIGTERM);
  // The grandchild is not ours to reap: wait until it is dead (gone, or a zombie of its new parent).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (PidRuns(grandchild) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  EXPECT_FALSE(PidRuns(grandchild)) << "the grandchild outlived its group's SIGTERM";
}

TEST(SubprocessTest, FreezeWaitsUntilStoppedAndThawResumes) {
  auto p = Sh("while read line; do echo \"$line\"; done", {.stdin_io = ChildIo::kPipe, .stdout_io = ChildIo::kPipe});
  ASSERT_NE(p, nullptr);
  ASSERT_TRUE(p->Freeze(milliseconds(10000)).ok());
  ASSERT_TRUE(p->Write("ping\n").ok());
  EXPECT_EQ(p->ReadLine(milliseconds(200)).status().code(), StatusCode::kDeadlineExceeded) << "stopped: no answer";
  p->Thaw();
  EXPECT_EQ(p->ReadLine(milliseconds(10000)).value_or("?"), "ping");
  p->CloseStdin();
  EXPECT_EQ(p->Wait(milliseconds(10000)).value_or(-1), 0);
  EXPECT_EQ(p->Freeze(milliseconds(100)).code(), StatusCode::kFailedPrecondition);
}

TEST(SubprocessTest, KillAndWaitUnreapedLeavesAZombie) {
  auto p = Sh("exec sleep 30");
  ASSERT_NE(p, nullptr);
  ASSERT_TRUE(p->KillAndWaitUnreaped());
  EXPECT_TRUE(PidExists(p->pid())) << "a zombie keeps its pid";
  EXPECT_EQ(p->Wait(milliseconds(1000)).value_or(0), -SIGKILL);
  EXPECT_FALSE(PidExists(p->pid()));
}

TEST(SubprocessTest, DestructorKillsAndReapsAChildStillRunning) {
  pid_t pid;
  {
    auto p = Sh("exec sleep 30");
    ASSERT_NE(p, nullptr);
    pid = p->pid();
    EXPECT_TRUE(PidExists(pid));
  }
  EXPECT_FALSE(PidExists(pid));
}

}  // namespace
}  // namespace rc
