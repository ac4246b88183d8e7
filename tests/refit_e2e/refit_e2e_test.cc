// Cross-process refit: a directory (SQLite), a 2-rank fsdp synthetic trainer publishing over shm,
// and an engine at tp 2 started from the trainer's v0. The engine stages v1 while serving,
// installs it while paused, proves the live content digest equals the manifest's, and then
// generates exactly what a fresh engine loaded from v1 exported to disk generates.
#include <gtest/gtest.h>
#include <httplib.h>

#include <filesystem>
#include <thread>

#include "apps/child_process.h"
#include "rolloutcore/base/json.h"

namespace rc {
namespace {

namespace fs = std::filesystem;
using apps::ChildProcess;

class RefitE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() / ("rc_refit_e2e_" + std::to_string(::getpid()))).string();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    apps::StopAllChildren();
    if (!HasFailure()) fs::remove_all(dir_);
  }
  std::unique_ptr<ChildProcess> Start(const std::string& name, const std::vector<std::string>& args) {
    auto c = ChildProcess::Spawn(name, args, dir_ + "/" + name + ".log", ROLLOUTCORE_BIN);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(c).value() : nullptr;
  }
  void WaitHealthy(ChildProcess* c, int port, const std::string& path) {
    httplib::Client cli("127.0.0.1", port);
    for (int i = 0; i < 600; ++i) {
      ASSERT_TRUE(c->Alive()) << c->name() << " died:\n" << c->LogTail();
      auto r = cli.Get(path.c_str());
      if (r && r->status == 200) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    FAIL() << c->name() << " not healthy:\n" << c->LogTail();
  }
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
  void Export(const std::string& version, const std::string& out) {
    auto c = Start("export-" + version, {"trainer", "export", "--model", "tiny", "--seed", "7", "--version", version,
                                         "--out", out});
    ASSERT_NE(c, nullptr);
    while (c->Alive()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ASSERT_EQ(c->Stop(), 0) << c->LogTail();
  }
  std::vector<int64_t> Greedy(int port) {
    Json body{{"prompt", {5, 17, 42, 99, 3, 8, 250, 11}}, {"max_tokens", 16}, {"temperature", 0.0},
              {"return_token_ids", true}};
    Json r = Call(port, "POST", "/v1/completions", body);
    return r["choices"][0]["token_ids"].get<std::vector<int64_t>>();
  }
  std::string dir_;
};

TEST_F(RefitE2eTest, StageInstallVerifyAndMatchAFreshEngine) {
  int dir_port = apps::FreePort().value(), trainer_port = apps::FreePort().value();
  int engine_port = apps::FreePort().value(), fresh_port = apps::FreePort().value();
  std::string dir_url = "http://127.0.0.1:" + std::to_string(dir_port);
  auto directory = Start("directory", {"directory", "serve", "--store", "sqlite:" + dir_ + "/dir.db", "--port",
                                       std::to_string(dir_port)});
  WaitHealthy(directory.get(), dir_port, "/health");
  Export("v0", dir_ + "/v0");
  auto engine = Start("engine", {"engine", "serve", "--model", dir_ + "/v0", "--tensor-parallel-size", "2", "--port",
                                 std::to_string(engine_port), "--weight-version", "v0", "--threads", "1"});
  WaitHealthy(engine.get(), engine_port, "/health");
  auto trainer = Start("trainer", {"trainer", "serve", "--model", "tiny", "--name", "m", "--layout", "fsdp:2",
                                   "--directory", dir_url, "--transport", "shm", "--seed", "7", "--port",
                                   std::to_string(trainer_port)});
  WaitHealthy(trainer.get(), trainer_port, "/status");

  // The engine's starting weights are the trainer's v0, byte for byte (digest).
  Json v0 = Call(dir_port, "GET", "/v1/models/m/versions/v0");
  EXPECT_EQ(Call(engine_port, "GET", "/rc/weights/digest")["content_digest"], v0["manifest"]["content_digest"]);
  std::vector<int64_t> before = Greedy(engine_port);

  Call(trainer_port, "POST", "/step");
  Json v1;
  for (int i = 0; i < 200; ++i) {
    httplib::Client cli("127.0.0.1", dir_port);
    auto r = cli.Get("/v1/models/m/versions/v1");
    if (r && r->status == 200) {
      v1 = Json::parse(r->body);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(v1.contains("manifest")) << "v1 never committed";

  // Stage while serving; install refused until paused; then install and verify.
  Json staged = Call(engine_port, "POST", "/rc/refit/stage", Json{{"model", "m"}, {"version", "v1"}, {"directory", dir_url}});
  EXPECT_EQ(staged["content_digest"], v1["manifest"]["content_digest"]);
  EXPECT_EQ(staged["coverage"], "ok");
  EXPECT_GT(staged["bytes_pulled"].get<int64_t>(), 0);
  EXPECT_EQ(Call(engine_port, "GET", "/weight_info")["weight_version"], "v0") << "staging touches nothing live";
  Call(engine_port, "POST", "/rc/refit/install", Json{{"version", "v1"}}, 409);
  Call(engine_port, "POST", "/pause?mode=wait", Json::object());
  Json installed = Call(engine_port, "POST", "/rc/refit/install", Json{{"version", "v1"}});
  EXPECT_EQ(installed["weight_version"], "v1");
  EXPECT_EQ(installed["live_content_digest"], v1["manifest"]["content_digest"]);
  Call(engine_port, "POST", "/resume", Json::object());
  EXPECT_EQ(Call(engine_port, "GET", "/rc/weights/digest")["content_digest"], v1["manifest"]["content_digest"]);
  EXPECT_EQ(Call(engine_port, "GET", "/weight_info")["weight_version"], "v1");
  std::vector<int64_t> after = Greedy(engine_port);
  EXPECT_NE(before, after) << "new weights, new output";

  // A fresh engine loaded from v1 exported to disk generates exactly the same tokens.
  Export("v1", dir_ + "/v1");
  auto fresh = Start("fresh", {"engine", "serve", "--model", dir_ + "/v1", "--tensor-parallel-size", "2", "--port",
                               std::to_string(fresh_port), "--weight-version", "v1", "--threads", "1"});
  WaitHealthy(fresh.get(), fresh_port, "/health");
  EXPECT_EQ(Greedy(fresh_port), after);
  EXPECT_EQ(Call(fresh_port, "GET", "/rc/weights/digest")["content_digest"], v1["manifest"]["content_digest"]);

  // Staging a version that does not exist is a clear 404, nothing touched.
  Call(engine_port, "POST", "/rc/refit/stage", Json{{"model", "m"}, {"version", "v9"}, {"directory", dir_url}}, 404);
}

}  // namespace
}  // namespace rc
