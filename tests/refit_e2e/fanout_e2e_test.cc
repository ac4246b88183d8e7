// Engine-to-engine fan-out across real processes: a directory (SQLite), a 2-rank fsdp synthetic
// trainer publishing over shm, and embedded engines (tp 2). The first engine pulls a version from
// the trainer; every engine that holds it relays it (POST /rc/refit/relay: the same shard tables
// and digests, handles into its own memory); later engines stage with use_relays and read from
// the relays only. Checks: the trainer serves the same bytes (one model) for 2 and for 6
// receivers; every receiver's live digest is the published one; reads spread over several
// holders; a holder killed with SIGKILL is failed over to another holder within the deadline,
// before the read (shm) and in the middle of it (ucx over TCP: a stopped holder stalls the posted
// reads, then dies).
#include <gtest/gtest.h>
#include <httplib.h>

#include <cstdlib>
#include <filesystem>
#include <future>
#include <iostream>
#include <set>
#include <thread>

#include "apps/child_process.h"
#include "refit_e2e/e2e_fixture.h"
#include "rolloutcore/base/json.h"

namespace rc {
namespace {

namespace fs = std::filesystem;
using apps::ChildProcess;

class FanoutE2eTest : public testing::E2eProcessFixture {
 protected:
  FanoutE2eTest() : E2eProcessFixture("rc_fanout_e2e_") {}

  // Directory, exported v0, trainer publishing v0 and then v1.
  void StartWorld(const std::string& transport = "shm") {
    dir_port_ = apps::FreePort().value();
    ChildProcess* d = Start("directory", {"directory", "serve", "--store", "sqlite:" + dir_ + "/dir.db", "--port",
                                          std::to_string(dir_port_)});
    WaitHealthy(d, dir_port_, "/health");
    ChildProcess* e = Start(
        "export-v0", {"trainer", "export", "--model", "tiny", "--seed", "7", "--version", "v0", "--out", dir_ + "/v0"});
    ASSERT_NE(e, nullptr);
    while (e->Alive()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ASSERT_EQ(e->Stop(), 0) << e->LogTail();
    trainer_port_ = apps::FreePort().value();
    ChildProcess* t = Start(
        "trainer", {"trainer", "serve", "--model", "tiny", "--name", "m", "--layout", "fsdp:2", "--directory",
                    Url(dir_port_), "--transport", transport, "--seed", "7", "--port", std::to_string(trainer_port_)});
    WaitHealthy(t, trainer_port_, "/status");
    WaitCommitted("v0");
  }
  struct Engine {
    ChildProcess* process = nullptr;
    int port = 0;
    std::string holder;
  };
  Engine StartEngine(const std::string& holder) {
    Engine e;
    e.holder = holder;
    e.port = apps::FreePort().value();
    e.process =
        Start("engine-" + holder, {"engine", "serve", "--model", dir_ + "/v0", "--tensor-parallel-size", "2", "--port",
                                   std::to_string(e.port), "--weight-version", "v0", "--threads", "1"});
    WaitHealthy(e.process, e.port, "/health");
    return e;
  }
  Json WaitCommitted(const std::string& version) {
    httplib::Client cli("127.0.0.1", dir_port_);
    for (int i = 0; i < 200; ++i) {
      auto r = cli.Get(("/v1/models/m/versions/" + version).c_str());
      if (r && r->status == 200) return Json::parse(r->body)["manifest"];
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ADD_FAILURE() << version << " never committed";
    return Json::object();
  }
  Json Stage(const Engine& e, const std::string& version, int receiver_rank, int expect = 200,
             int64_t timeout_ms = 20'000) {
    return Call(e.port, "POST", "/rc/refit/stage",
                Json{{"model", "m"},
                     {"version", version},
                     {"directory", Url(dir_port_)},
                     {"use_relays", true},
                     {"receiver_rank", receiver_rank},
                     {"timeout_ms", timeout_ms}},
                expect);
  }
  // Pause, install, resume; returns the live content digest.
  std::string Install(const Engine& e, const std::string& version) {
    Call(e.port, "POST", "/pause?mode=wait");
    Json installed = Call(e.port, "POST", "/rc/refit/install", Json{{"version", version}});
    EXPECT_EQ(installed["weight_version"], version);
    Call(e.port, "POST", "/resume");
    return Call(e.port, "GET", "/rc/weights/digest?fresh=true")["content_digest"].get<std::string>();
  }
  Json Relay(const Engine& e, const std::string& version) {
    return Call(e.port, "POST", "/rc/refit/relay",
                Json{{"model", "m"}, {"version", version}, {"directory", Url(dir_port_)}, {"holder", e.holder}});
  }
  // Every engine in turn stages `version` (trainer and relays), installs it, verifies the live
  // digest and relays it. Returns the bytes the trainer served, summed over the receivers.
  uint64_t FanOut(const std::vector<Engine>& engines, const std::string& version, std::set<std::string>* holders_used) {
    const Json published = WaitCommitted(version);
    uint64_t origin = 0;
    for (size_t i = 0; i < engines.size(); ++i) {
      SCOPED_TRACE(engines[i].holder);
      Json staged = Stage(engines[i], version, static_cast<int>(i));
      EXPECT_EQ(staged["content_digest"], published["content_digest"]);
      const Json& src = staged["sources"];
      const uint64_t planned = staged["bytes_planned"].get<uint64_t>();
      EXPECT_EQ(src["origin_bytes"].get<uint64_t>() + src["relay_bytes"].get<uint64_t>(), planned);
      if (i == 0) {
        EXPECT_EQ(src["origin_bytes"].get<uint64_t>(), planned) << "nobody relays yet: all from the trainer";
      } else {
        EXPECT_EQ(src["origin_bytes"].get<uint64_t>(), 0u) << "relays hold every box: nothing from the trainer";
        EXPECT_EQ(src["holder_records"].get<size_t>(), i);
        for (const auto& [holder, bytes] : src["by_holder"].items()) {
          EXPECT_GT(bytes.get<uint64_t>(), 0u);
          holders_used->insert(holder);
        }
      }
      origin += src["origin_bytes"].get<uint64_t>();
      EXPECT_EQ(Install(engines[i], version), published["content_digest"]) << "live weights are the published ones";
      Json relayed = Relay(engines[i], version);
      EXPECT_EQ(relayed["from"], "installed");
      EXPECT_EQ(relayed["content_digest"], published["content_digest"]) << "the record carries the same digests";
    }
    return origin;
  }

  int dir_port_ = 0, trainer_port_ = 0;
};

TEST_F(FanoutE2eTest, TrainerBytesAreTheSameForTwoAndSixReceivers) {
  StartWorld();
  std::vector<Engine> engines;
  engines.reserve(6);
  // (Built with append: GCC 12 at -O3 reports a false -Wrestrict for "literal" + std::string, GCC PR 105329.)
  for (int i = 0; i < 6; ++i) engines.push_back(StartEngine(std::string("e").append(std::to_string(i))));

  Call(trainer_port_, "POST", "/step");
  std::set<std::string> used2, used6;
  const uint64_t two = FanOut({engines[0], engines[1]}, "v1", &used2);
  Call(trainer_port_, "POST", "/step");
  const uint64_t six = FanOut(engines, "v2", &used6);
  EXPECT_GT(two, 0u);
  EXPECT_EQ(two, six) << "the trainer's outbound bytes do not grow with the replicas";
  // Round robin by receiver rank: later receivers read from several holders, not all from e0.
  EXPECT_GE(used6.size(), 3u);
  // A relayed version stays invisible to watchers of the trainer's model.
  Json committed = Call(dir_port_, "GET", "/v1/models/m/versions");
  EXPECT_EQ(committed.dump().find('@'), std::string::npos) << committed.dump();
}

TEST_F(FanoutE2eTest, KilledHolderIsFailedOverToAnotherHolderWithinTheDeadline) {
  StartWorld();
  Engine a = StartEngine("ha"), b = StartEngine("hb"), c = StartEngine("hc");
  Call(trainer_port_, "POST", "/step");
  const Json published = WaitCommitted("v1");
  std::set<std::string> used;
  ASSERT_GT(FanOut({a, b}, "v1", &used), 0u);

  a.process->Kill();  // SIGKILL: its memory is gone, its holder record still says COMMITTED
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t timeout_ms = 20'000;
  Json staged = Stage(c, "v1", /*receiver_rank=*/0, 200, timeout_ms);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s * 1000, static_cast<double>(timeout_ms));
  EXPECT_EQ(staged["content_digest"], published["content_digest"]);
  const Json& src = staged["sources"];
  EXPECT_EQ(src["failovers"], 1);
  EXPECT_EQ(src["failed_holders"], Json::array({"ha"}));
  EXPECT_EQ(src["origin_bytes"], 0) << "the other holder has every box: the trainer is not needed";
  EXPECT_EQ(src["by_holder"].size(), 1u);
  EXPECT_EQ(src["by_holder"]["hb"].get<uint64_t>(), staged["bytes_planned"].get<uint64_t>());
  EXPECT_EQ(Install(c, "v1"), published["content_digest"]);
  // The receiver proved the holder dead: its record is no longer served.
  httplib::Client cli("127.0.0.1", dir_port_);
  auto r = cli.Get("/v1/models/m@relay/versions/v1@ha");
  ASSERT_TRUE(r);
  EXPECT_NE(r->status, 200) << r->body;
  // With every holder gone the trainer serves again.
  b.process->Kill();
  Engine d = StartEngine("hd");
  Json from_trainer = Stage(d, "v1", 0);
  EXPECT_EQ(from_trainer["sources"]["origin_bytes"].get<uint64_t>(), from_trainer["bytes_planned"].get<uint64_t>());
  EXPECT_EQ(from_trainer["sources"]["failovers"], 1);
  EXPECT_EQ(Install(d, "v1"), published["content_digest"]);
}

TEST_F(FanoutE2eTest, HolderKilledMidReadOverUcxIsFailedOverWithinTheDeadline) {
  // UCX over TCP needs the owner's worker to progress every get: a frozen holder keeps the posted
  // reads outstanding (the same mechanism as RefitE2eTest.TrainerStoppedOrKilledMidPullFails...).
  const char* old = std::getenv("UCX_TLS");
  const std::string saved = old ? old : "";
  ::setenv("UCX_TLS", "tcp", 1);  // inherited by the processes started below
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
  StartWorld("ucx");
  Engine a = StartEngine("ua"), b = StartEngine("ub"), c = StartEngine("uc");
  Call(trainer_port_, "POST", "/step");
  const Json published = WaitCommitted("v1");
  std::set<std::string> used;
  ASSERT_GT(FanOut({a, b}, "v1", &used), 0u);
  Json staged_b = Stage(b, "v1", 1);  // (b re-stages v1 from the relays: both holders serve over ucx)
  EXPECT_EQ(staged_b["transport"], "ucx");

  ASSERT_TRUE(a.process->Freeze().ok());
  const int64_t timeout_ms = 30'000;
  const auto t0 = std::chrono::steady_clock::now();
  auto pending = std::async(std::launch::async, [&] { return Stage(c, "v1", 0, 200, timeout_ms); });
  ASSERT_EQ(pending.wait_for(std::chrono::milliseconds(1500)), std::future_status::timeout)
      << "the stage must still be reading from the frozen holder";
  a.process->Kill();  // mid-read: its reads are posted and outstanding
  Json staged = pending.get();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s * 1000, static_cast<double>(timeout_ms)) << "completed within the deadline";
  EXPECT_EQ(staged["content_digest"], published["content_digest"]);
  const Json& src = staged["sources"];
  EXPECT_EQ(src["failovers"], 1) << staged.dump();
  EXPECT_EQ(src["failed_holders"], Json::array({"ua"}));
  EXPECT_EQ(src["origin_bytes"], 0);
  EXPECT_EQ(src["by_holder"]["ub"].get<uint64_t>(), staged["bytes_planned"].get<uint64_t>());
  EXPECT_EQ(Install(c, "v1"), published["content_digest"]);
  std::cout << "holder killed mid-read: stage completed from another holder " << s << " s after it began\n";
}

}  // namespace
}  // namespace rc
