// Cross-process refit: a directory (SQLite or a real etcd), 2-rank fsdp synthetic trainers
// publishing over shm or UCX, and engines at tp 2 started from the trainer's v0. An engine stages
// v1 while serving, installs it while paused, proves the live content digest equals the
// manifest's, and then generates exactly what a fresh engine loaded from v1 exported to disk
// generates. Faults: a corrupted source byte and a dead trainer are caught before anything live
// changes.
#include <gtest/gtest.h>
#include <httplib.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <iostream>
#include <thread>

#include "apps/child_process.h"
#include "refit_e2e/e2e_fixture.h"
#include "rolloutcore/base/json.h"

namespace rc {
namespace {

namespace fs = std::filesystem;
using apps::ChildProcess;

class RefitE2eTest : public testing::E2eProcessFixture {
 protected:
  RefitE2eTest() : E2eProcessFixture("rc_refit_e2e_") {}
  void Export(const std::string& version, const std::string& out) {
    ChildProcess* c = Start("export-" + version, {"trainer", "export", "--model", "tiny", "--seed", "7", "--version",
                                                  version, "--out", out});
    ASSERT_NE(c, nullptr);
    while (c->Alive()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ASSERT_EQ(c->Stop(), 0) << c->LogTail();
  }
  // A directory over `store` ("sqlite" or "etcd"); returns its port.
  int StartDirectory(const std::string& store) {
    int port = apps::FreePort().value();
    std::string spec = "sqlite:" + dir_ + "/dir.db";
    if (store == "etcd") {
      if (!fs::exists("/usr/bin/etcd")) return -1;
      int client = apps::FreePort().value(), peer = apps::FreePort().value();
      std::string curl = "http://127.0.0.1:" + std::to_string(client);
      ChildProcess* etcd = Start("etcd", {"--data-dir", dir_ + "/etcd", "--listen-client-urls", curl,
                                          "--advertise-client-urls", curl, "--listen-peer-urls",
                                          "http://127.0.0.1:" + std::to_string(peer), "--initial-advertise-peer-urls",
                                          "http://127.0.0.1:" + std::to_string(peer), "--initial-cluster",
                                          "default=http://127.0.0.1:" + std::to_string(peer)},
                                 "/usr/bin/etcd");
      WaitHealthy(etcd, client, "/health");
      spec = "etcd:" + curl;
    }
    ChildProcess* d = Start("directory", {"directory", "serve", "--store", spec, "--port", std::to_string(port)});
    WaitHealthy(d, port, "/health");
    return port;
  }
  int StartTrainer(const std::string& name, const std::string& transport, int dir_port, ChildProcess** out = nullptr) {
    int port = apps::FreePort().value();
    ChildProcess* t = Start("trainer-" + name, {"trainer", "serve", "--model", "tiny", "--name", name, "--layout",
                                                "fsdp:2", "--directory", Url(dir_port), "--transport", transport,
                                                "--seed", "7", "--port", std::to_string(port)});
    WaitHealthy(t, port, "/status");
    if (out) *out = t;
    return port;
  }
  int StartEngine(const std::string& name, const std::string& model_dir, const std::string& label) {
    int port = apps::FreePort().value();
    ChildProcess* e = Start(name, {"engine", "serve", "--model", model_dir, "--tensor-parallel-size", "2", "--port",
                                   std::to_string(port), "--weight-version", label, "--threads", "1"});
    WaitHealthy(e, port, "/health");
    return port;
  }
  Json WaitCommitted(int dir_port, const std::string& model, const std::string& version) {
    httplib::Client cli("127.0.0.1", dir_port);
    for (int i = 0; i < 200; ++i) {
      std::string path = "/v1/models/";
      path += model;
      path += "/versions/";
      path += version;
      auto r = cli.Get(path.c_str());
      if (r && r->status == 200) return Json::parse(r->body)["manifest"];
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ADD_FAILURE() << version << " of " << model << " never committed";
    return Json::object();
  }
  std::vector<int64_t> Greedy(int port) {
    Json body{{"prompt", {5, 17, 42, 99, 3, 8, 250, 11}}, {"max_tokens", 16}, {"temperature", 0.0},
              {"return_token_ids", true}};
    Json r = Call(port, "POST", "/v1/completions", body);
    return r["choices"][0]["token_ids"].get<std::vector<int64_t>>();
  }
  // Stage, pause, install, resume; returns the live digest answer.
  Json Refit(int engine_port, int dir_port, const std::string& model, const std::string& version) {
    Json staged = Call(engine_port, "POST", "/rc/refit/stage",
                       Json{{"model", model}, {"version", version}, {"directory", Url(dir_port)}});
    EXPECT_EQ(staged["coverage"], "ok");
    Call(engine_port, "POST", "/pause?mode=wait");
    Json installed = Call(engine_port, "POST", "/rc/refit/install", Json{{"version", version}});
    EXPECT_EQ(installed["weight_version"], version);
    Call(engine_port, "POST", "/resume");
    return Call(engine_port, "GET", "/rc/weights/digest?fresh=true");
  }
};

TEST_F(RefitE2eTest, StageInstallVerifyAndMatchAFreshEngine) {
  int dir_port = StartDirectory("sqlite");
  Export("v0", dir_ + "/v0");
  int engine_port = StartEngine("engine", dir_ + "/v0", "v0");
  int trainer_port = StartTrainer("m", "shm", dir_port);

  // The engine's starting weights are the trainer's v0, byte for byte (digest).
  Json v0 = WaitCommitted(dir_port, "m", "v0");
  EXPECT_EQ(Call(engine_port, "GET", "/rc/weights/digest?fresh=true")["content_digest"], v0["content_digest"]);
  std::vector<int64_t> before = Greedy(engine_port);

  Call(trainer_port, "POST", "/step");
  Json v1 = WaitCommitted(dir_port, "m", "v1");

  // Stage while serving; install refused until paused; then install and verify.
  Json staged = Call(engine_port, "POST", "/rc/refit/stage", Json{{"model", "m"}, {"version", "v1"}, {"directory", Url(dir_port)}});
  EXPECT_EQ(staged["content_digest"], v1["content_digest"]);
  EXPECT_EQ(staged["coverage"], "ok");
  EXPECT_GT(staged["bytes_pulled"].get<int64_t>(), 0);
  EXPECT_EQ(Call(engine_port, "GET", "/weight_info")["weight_version"], "v0") << "staging touches nothing live";
  Call(engine_port, "POST", "/rc/refit/install", Json{{"version", "v1"}}, 409);
  // Stages refused before they found a version (unknown version, a directory that does not answer)
  // leave v1 staged: a typo of one client does not undo another's stage.
  Call(engine_port, "POST", "/rc/refit/stage", Json{{"model", "m"}, {"version", "v9"}, {"directory", Url(dir_port)}}, 404);
  Call(engine_port, "POST", "/rc/refit/stage",
       Json{{"model", "m"}, {"version", "v1"}, {"directory", "http://127.0.0.1:1"}, {"timeout_ms", 2000}}, 503);
  Call(engine_port, "POST", "/pause?mode=wait");
  Json installed = Call(engine_port, "POST", "/rc/refit/install", Json{{"version", "v1"}});
  EXPECT_EQ(installed["weight_version"], "v1");
  EXPECT_EQ(installed["live_content_digest"], v1["content_digest"]);
  Call(engine_port, "POST", "/resume");
  EXPECT_EQ(Call(engine_port, "GET", "/rc/weights/digest?fresh=true")["content_digest"], v1["content_digest"]);
  EXPECT_EQ(Call(engine_port, "GET", "/weight_info")["weight_version"], "v1");
  std::vector<int64_t> after = Greedy(engine_port);
  EXPECT_NE(before, after) << "new weights, new output";

  // A fresh engine loaded from v1 exported to disk generates exactly the same tokens.
  Export("v1", dir_ + "/v1");
  int fresh_port = StartEngine("fresh", dir_ + "/v1", "v1");
  EXPECT_EQ(Greedy(fresh_port), after);
  EXPECT_EQ(Call(fresh_port, "GET", "/rc/weights/digest?fresh=true")["content_digest"], v1["content_digest"]);

  // A second stage of the next version reuses the plan (same source topology? no: new handles).
  Call(engine_port, "POST", "/rc/refit/stage", Json{{"model", "m"}, {"version", "v9"}, {"directory", Url(dir_port)}}, 404);
}

TEST_F(RefitE2eTest, UcxAndEtcdGiveTheSameLiveWeightsAsShmAndSqlite) {
  int sqlite_dir = StartDirectory("sqlite");
  int etcd_dir = StartDirectory("etcd");
  if (etcd_dir < 0) GTEST_SKIP() << "/usr/bin/etcd is not installed (Debian etcd-server)";
  Export("v0", dir_ + "/v0");
  int shm_trainer = StartTrainer("m", "shm", sqlite_dir);
  int ucx_trainer = StartTrainer("m", "ucx", etcd_dir);
  Call(shm_trainer, "POST", "/step");
  Call(ucx_trainer, "POST", "/step");
  Json a = WaitCommitted(sqlite_dir, "m", "v1");
  Json b = WaitCommitted(etcd_dir, "m", "v1");
  EXPECT_EQ(a["content_digest"], b["content_digest"]) << "same weights, whatever transport and store";
  int engine_a = StartEngine("engine-shm", dir_ + "/v0", "v0");
  int engine_b = StartEngine("engine-ucx", dir_ + "/v0", "v0");
  Json da = Refit(engine_a, sqlite_dir, "m", "v1");
  Json db = Refit(engine_b, etcd_dir, "m", "v1");
  EXPECT_EQ(da["content_digest"], a["content_digest"]);
  EXPECT_EQ(db["content_digest"], a["content_digest"]);
  EXPECT_EQ(da["tensors"], db["tensors"]) << "every tensor's live content is the same over shm and ucx";
  EXPECT_EQ(Greedy(engine_a), Greedy(engine_b));
}

TEST_F(RefitE2eTest, CorruptedSourceByteIsDetectedAndInstallRefused) {
  int dir_port = StartDirectory("sqlite");
  Export("v0", dir_ + "/v0");
  int engine_port = StartEngine("engine", dir_ + "/v0", "v0");
  int trainer_port = StartTrainer("m", "shm", dir_port);
  Json v0 = WaitCommitted(dir_port, "m", "v0");
  Call(trainer_port, "POST", "/step");
  WaitCommitted(dir_port, "m", "v1");
  // One bit of one byte of rank 1's published buffer flips after the publish.
  Call(trainer_port, "POST", "/fault/corrupt", Json{{"version", "v1"}, {"rank", 1}, {"byte", 1000}});
  httplib::Client cli("127.0.0.1", engine_port);
  auto r = cli.Post("/rc/refit/stage", Json{{"model", "m"}, {"version", "v1"}, {"directory", Url(dir_port)}}.dump(),
                    "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 500);
  EXPECT_NE(r->body.find("do not match the published digests"), std::string::npos) << r->body;
  Call(engine_port, "POST", "/pause?mode=wait");
  Call(engine_port, "POST", "/rc/refit/install", Json{{"version", "v1"}}, 409);
  Call(engine_port, "POST", "/resume");
  Json live = Call(engine_port, "GET", "/rc/weights/digest?fresh=true");
  EXPECT_EQ(live["content_digest"], v0["content_digest"]) << "live weights untouched";
  EXPECT_EQ(live["weight_version"], "v0");
}

TEST_F(RefitE2eTest, DeadTrainerFailsTheStageQuicklyAndTouchesNothing) {
  for (std::string transport : {"shm", "ucx"}) {
    SCOPED_TRACE(transport);
    int dir_port = StartDirectory("sqlite");
    if (transport == "shm") Export("v0", dir_ + "/v0");
    int engine_port = StartEngine("engine-" + transport, dir_ + "/v0", "v0");
    ChildProcess* trainer = nullptr;
    int trainer_port = StartTrainer("m-" + transport, transport, dir_port, &trainer);
    Json v0 = WaitCommitted(dir_port, "m-" + transport, "v0");
    Call(trainer_port, "POST", "/step");
    WaitCommitted(dir_port, "m-" + transport, "v1");
    trainer->Kill();  // SIGKILL: no goodbye, its memory and endpoints are gone
    auto t0 = std::chrono::steady_clock::now();
    httplib::Client cli("127.0.0.1", engine_port);
    cli.set_read_timeout(90, 0);
    auto r = cli.Post("/rc/refit/stage",
                      Json{{"model", "m-" + transport}, {"version", "v1"}, {"directory", Url(dir_port)}}.dump(),
                      "application/json");
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 503) << r->body;
    EXPECT_LT(s, 60.0) << "fails within the executor's deadline, never hangs";
    Json live = Call(engine_port, "GET", "/rc/weights/digest?fresh=true");
    EXPECT_EQ(live["content_digest"], v0["content_digest"]);
    children_.clear();
    apps::StopAllChildren();
  }
}

// A trainer that stops answering in the middle of a pull, then dies. UCX over TCP (UCX_TLS=tcp)
// needs the owner's worker to progress every get, so a SIGSTOPped trainer stalls the pull after
// discovery and planning succeeded: the reads are posted and outstanding. First the stage must
// end at its own deadline (DeadlineExceeded, 504); then, with a long deadline, SIGKILL during the
// stalled pull must fail the stage with Unavailable (503) soon after the kill, far inside the
// deadline. Either way the live weights stay v0.
TEST_F(RefitE2eTest, TrainerStoppedOrKilledMidPullFailsWithinTheDeadline) {
  const char* old = std::getenv("UCX_TLS");
  const std::string saved = old ? old : "";
  ::setenv("UCX_TLS", "tcp", 1);  // inherited by the trainer and the engine started below
  struct Restore {
    bool had;
    std::string value;
    ~Restore() {
      if (had) {
        ::setenv("UCX_TLS", value.c_str(), 1);
      } else {
        ::unsetenv("UCX_TLS");
      }
    }
  } restore{old != nullptr, saved};

  int dir_port = StartDirectory("sqlite");
  Export("v0", dir_ + "/v0");
  int engine_port = StartEngine("engine", dir_ + "/v0", "v0");
  ChildProcess* trainer = nullptr;
  int trainer_port = StartTrainer("m", "ucx", dir_port, &trainer);
  ASSERT_NE(trainer, nullptr);
  Json v0 = WaitCommitted(dir_port, "m", "v0");
  Call(trainer_port, "POST", "/step");
  WaitCommitted(dir_port, "m", "v1");
  auto stage = [&](int64_t timeout_ms) {
    httplib::Client cli("127.0.0.1", engine_port);
    cli.set_read_timeout(120, 0);
    auto r = cli.Post("/rc/refit/stage",
                      Json{{"model", "m"}, {"version", "v1"}, {"directory", Url(dir_port)}, {"timeout_ms", timeout_ms}}
                          .dump(),
                      "application/json");
    return r ? std::make_pair(r->status, r->body) : std::make_pair(-1, std::string("no answer"));
  };

  // Stopped for certain (every thread), not just signalled: see ChildProcess::Freeze.
  ASSERT_TRUE(trainer->Freeze().ok());
  // 1. Stopped trainer, 1.5 s deadline: the stage ends at the deadline, not later.
  auto t0 = std::chrono::steady_clock::now();
  auto [status1, body1] = stage(1500);
  double s1 = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(status1, 504) << body1;
  EXPECT_GE(s1, 1.4) << "the stage cannot finish while the trainer is stopped";
  EXPECT_LT(s1, 1.5 + 1.5) << "the stage ends at its deadline, never hangs";
  std::cout << "stopped trainer: stage failed after " << s1 << " s (deadline 1.5 s): " << body1 << "\n";
  EXPECT_EQ(Call(engine_port, "GET", "/rc/weights/digest?fresh=true")["content_digest"], v0["content_digest"]);

  // 2. Stopped trainer, 60 s deadline, killed while the pull waits on it.
  auto pending = std::async(std::launch::async, [&] { return stage(60'000); });
  EXPECT_EQ(pending.wait_for(std::chrono::milliseconds(1500)), std::future_status::timeout)
      << "the stage must still be pulling from the stopped trainer";
  auto t_kill = std::chrono::steady_clock::now();
  trainer->Kill();
  auto [status2, body2] = pending.get();
  double s2 = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_kill).count();
  EXPECT_EQ(status2, 503) << body2;
  EXPECT_LT(s2, 10.0) << "a dead peer is detected long before the 60 s deadline";
  std::cout << "trainer killed mid-pull: stage failed " << s2 << " s after the kill: " << body2 << "\n";
  RecordProperty("stopped_stage_s", std::to_string(s1));
  RecordProperty("killed_detect_s", std::to_string(s2));
  Json live = Call(engine_port, "GET", "/rc/weights/digest?fresh=true");
  EXPECT_EQ(live["content_digest"], v0["content_digest"]) << "live weights untouched";
  EXPECT_EQ(live["weight_version"], "v0");
}

}  // namespace
}  // namespace rc
