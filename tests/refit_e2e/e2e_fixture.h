// E2eProcessFixture: what the cross-process refit tests (refit_e2e_test.cc, fanout_e2e_test.cc)
// share: a fresh temp directory per test, `rolloutcore` subcommands started as ChildProcesses with
// their logs in it, a health wait that reports a dead child's log, and a JSON call helper.
//
// TearDown stops every child (and every other ChildProcess of this process); the directory is
// kept when the test failed, for the logs.
//
// Thread safety: test-only; the fixture's methods run on the test thread.
#pragma once

#include <gtest/gtest.h>
#include <httplib.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "apps/child_process.h"
#include "rolloutcore/base/json.h"

#ifndef ROLLOUTCORE_BIN
#error "ROLLOUTCORE_BIN must name the rolloutcore binary"
#endif

namespace rc::testing {

class E2eProcessFixture : public ::testing::Test {
 protected:
  // `prefix` names the temp directories ("rc_refit_e2e_" → /tmp/rc_refit_e2e_<pid>_<test>).
  explicit E2eProcessFixture(std::string prefix) : prefix_(std::move(prefix)) {}

  void SetUp() override {
    namespace fs = std::filesystem;
    dir_ = (fs::temp_directory_path() / (prefix_ + std::to_string(::getpid()) + "_" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name()))
               .string();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    children_.clear();
    apps::StopAllChildren();
    if (!HasFailure()) std::filesystem::remove_all(dir_);
  }
  // Starts `exe ARGS...` as child `name`, logging to <dir>/<name>.log; null (and a test failure)
  // when it cannot start.
  apps::ChildProcess* Start(const std::string& name, const std::vector<std::string>& args,
                            const std::string& exe = ROLLOUTCORE_BIN) {
    auto c = apps::ChildProcess::Spawn(name, args, dir_ + "/" + name + ".log", exe);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    if (!c.ok()) return nullptr;
    children_.push_back(std::move(c).value());
    return children_.back().get();
  }
  // Waits (up to 30 s) until GET `path` on `port` answers 200; fails with the child's log tail
  // when it dies or never gets there.
  void WaitHealthy(apps::ChildProcess* c, int port, const std::string& path) {
    httplib::Client cli("127.0.0.1", port);
    for (int i = 0; i < 600; ++i) {
      ASSERT_TRUE(c->Alive()) << c->name() << " died:\n" << c->LogTail();
      auto r = cli.Get(path.c_str());
      if (r && r->status == 200) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    FAIL() << c->name() << " not healthy:\n" << c->LogTail();
  }
  // GET or POST `body` to 127.0.0.1:port; expects HTTP `expect` and returns the JSON answer (the
  // body as a JSON string when it is not JSON).
  Json Call(int port, const std::string& method, const std::string& path, const Json& body = Json::object(),
            int expect = 200) {
    httplib::Client cli("127.0.0.1", port);
    cli.set_read_timeout(60, 0);
    auto r = method == "GET" ? cli.Get(path.c_str()) : cli.Post(path.c_str(), body.dump(), "application/json");
    EXPECT_TRUE(r) << method << " " << path;
    if (!r) return Json();
    EXPECT_EQ(r->status, expect) << method << " " << path << ": " << r->body;
    auto j = ParseJson(r->body);
    return j.ok() ? *j : Json(r->body);
  }
  static std::string Url(int port) { return "http://127.0.0.1:" + std::to_string(port); }

  std::string dir_;
  std::vector<std::unique_ptr<apps::ChildProcess>> children_;

 private:
  std::string prefix_;
};

}  // namespace rc::testing
