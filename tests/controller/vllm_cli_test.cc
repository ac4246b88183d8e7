// `rolloutcore controller serve --engine vllm+http://...` as a real process against FakeVllm (in
// this test process, on loopback): the controller initializes the engine through rolloutcore's
// worker extension (rc_describe, rc_label, rc_digest), and the flags that cannot work are
// refused with messages that say why.
#include <gtest/gtest.h>
#include <httplib.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include "apps/child_process.h"
#include "testing/fake_vllm.h"

namespace rc {
namespace {

namespace fs = std::filesystem;
using apps::ChildProcess;
using testing::FakeVllm;

class VllmCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() / ("rc-vllm-cli-" + std::to_string(::getpid()) + "-" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name()))
               .string();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    if (ctl_) ctl_->Stop();
    if (!HasFailure()) fs::remove_all(dir_);
  }
  std::unique_ptr<ChildProcess> Start(const std::vector<std::string>& extra, int port) {
    std::vector<std::string> args = {"controller",    "serve",  "--state-dir",
                                     dir_ + "/state", "--port", std::to_string(port)};
    args.insert(args.end(), extra.begin(), extra.end());
    auto c = ChildProcess::Spawn("controller", args, dir_ + "/controller.log", ROLLOUTCORE_BIN);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(c).value() : nullptr;
  }
  // Waits for the process to exit; returns its exit status (or -1 on timeout).
  static int WaitExit(ChildProcess* c, int64_t timeout_ms = 30000) {
    auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (std::chrono::steady_clock::now() < end) {
      if (!c->Alive()) return c->Stop(0);
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }
  std::string dir_;
  std::unique_ptr<ChildProcess> ctl_;
};

TEST_F(VllmCliTest, ServeInitializesAVllmEngineThroughTheExtension) {
  FakeVllm vllm;
  int port = apps::FreePort().value();
  ctl_ = Start({"--engine", "vllm+" + vllm.url(), "--pause-mode", "wait"}, port);
  ASSERT_TRUE(ctl_);
  httplib::Client cli("127.0.0.1", port);
  cli.set_connection_timeout(1, 0);
  Json status;
  auto end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < end) {
    ASSERT_TRUE(ctl_->Alive()) << ctl_->LogTail();
    auto r = cli.Get("/v1/status");
    if (r && r->status == 200) {
      status = Json::parse(r->body);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_FALSE(status.is_null()) << ctl_->LogTail();
  const std::string text = status.dump();
  EXPECT_NE(text.find("\"v7\""), std::string::npos) << "the label rc_label reports: " << text;
  EXPECT_NE(text.find("0123456789abcdef"), std::string::npos) << "the content digest rc_digest reports: " << text;
  std::lock_guard<std::mutex> lock(vllm.mu_);
  std::vector<std::string> methods;
  for (const Json& c : vllm.rpc_calls_) methods.push_back(c["method"]);
  EXPECT_NE(std::find(methods.begin(), methods.end(), "rc_describe"), methods.end());
  EXPECT_NE(std::find(methods.begin(), methods.end(), "rc_label"), methods.end());
  EXPECT_NE(std::find(methods.begin(), methods.end(), "rc_digest"), methods.end());
}

// Polls GET /v1/status until the controller answers (or 60 s).
Json WaitStatus(ChildProcess* ctl, int port) {
  httplib::Client cli("127.0.0.1", port);
  cli.set_connection_timeout(1, 0);
  auto end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < end && ctl->Alive()) {
    auto r = cli.Get("/v1/status");
    if (r && r->status == 200) return Json::parse(r->body);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return Json();
}

TEST_F(VllmCliTest, ServeRefusesAnUnsupportedVllmReleaseNamingBothVersions) {
  FakeVllm::Config cfg;
  cfg.version = "0.31.2";
  FakeVllm vllm(cfg);
  ctl_ = Start({"--engine", "vllm+" + vllm.url()}, apps::FreePort().value());
  ASSERT_TRUE(ctl_);
  EXPECT_EQ(WaitExit(ctl_.get()), 1) << ctl_->LogTail();
  for (const char* want : {"0.31.2", "0.26.x", "0.33.x", "--vllm-allow-untested-version"}) {
    EXPECT_NE(ctl_->LogTail().find(want), std::string::npos) << want << "\n" << ctl_->LogTail();
  }
  int port = apps::FreePort().value();
  ctl_ = Start({"--engine", "vllm+" + vllm.url(), "--vllm-allow-untested-version"}, port);
  ASSERT_TRUE(ctl_);
  EXPECT_FALSE(WaitStatus(ctl_.get(), port).is_null()) << "starts anyway: " << ctl_->LogTail();
}

// On 0.33 every rollout through the controller carries vLLM's own per-token versions: one span of
// the bound label is stored (reported by the engine); a span of another label is an identity
// mismatch (502), the output is not stored as bound and the engine is tainted.
TEST_F(VllmCliTest, On033RolloutSpansComeFromVllmAndADisagreeingSpanTaints) {
  FakeVllm::Config cfg;
  cfg.version = "0.33.0";
  cfg.install_reports_digest = true;
  FakeVllm vllm(cfg);
  int port = apps::FreePort().value();
  ctl_ = Start({"--engine", "vllm+" + vllm.url(), "--verify-interval-ms", "0"}, port);
  ASSERT_TRUE(ctl_);
  ASSERT_FALSE(WaitStatus(ctl_.get(), port).is_null()) << ctl_->LogTail();
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(30, 0);
  auto ok = cli.Post("/v1/rollouts", R"({"rollout_id":"r-1","prompt":[1,2,3],"max_tokens":6})", "application/json");
  ASSERT_TRUE(ok);
  ASSERT_EQ(ok->status, 200) << ok->body << ctl_->LogTail();
  const Json spans = Json::parse(ok->body)["version_spans"];
  ASSERT_EQ(spans.size(), 1u) << ok->body;
  EXPECT_EQ(spans[0]["label"], "v7");
  EXPECT_EQ(spans[0]["to_token"], 6);
  EXPECT_EQ(spans[0]["reported_by_engine"], true) << ok->body;
  auto t = cli.Get("/v1/trajectories?format=json");
  ASSERT_TRUE(t);
  ASSERT_EQ(t->status, 200) << t->body;
  EXPECT_NE(t->body.find("\"reported_by_engine\":true"), std::string::npos) << "stored as reported: " << t->body;
  {
    std::lock_guard<std::mutex> lock(vllm.mu_);
    EXPECT_EQ(vllm.completion_bodies_.back()["return_weight_versions"], true);
    EXPECT_EQ(vllm.weight_version_, "v7") << "vLLM's own label was set from the workers' at start";
  }
  vllm.Script([&] {
    vllm.weight_versions_ = Json::array({Json{{"version", "v7"}, {"start", 0}, {"end", 3}},
                                         Json{{"version", "v-other"}, {"start", 3}, {"end", 6}}});
  });
  auto bad = cli.Post("/v1/rollouts", R"({"rollout_id":"r-2","prompt":[1,2,3],"max_tokens":6})", "application/json");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 502) << bad->body;
  EXPECT_NE(bad->body.find("v-other"), std::string::npos) << bad->body;
  Json status = WaitStatus(ctl_.get(), port);
  EXPECT_NE(status.dump().find("TAINTED"), std::string::npos) << status.dump();
}

// A 0.33 paused behind the controller's back (POST /pause?mode=wait straight to vLLM) turns the
// rollout away with 503: the client gets a 503 naming vLLM's answer, and the rollout is recorded
// (trajectory row finish_reason "error", finish record) with none of its output bound; it is never
// queued and served later under other weights. After /resume the next rollout is served.
TEST_F(VllmCliTest, On033ARolloutThatMeetsAPausedVllmIsRefusedAndRecordedNeverQueued) {
  FakeVllm::Config cfg;
  cfg.version = "0.33.0";
  FakeVllm vllm(cfg);
  int port = apps::FreePort().value();
  ctl_ = Start({"--engine", "vllm+" + vllm.url(), "--verify-interval-ms", "0"}, port);
  ASSERT_TRUE(ctl_);
  ASSERT_FALSE(WaitStatus(ctl_.get(), port).is_null()) << ctl_->LogTail();
  httplib::Client fake("127.0.0.1", std::stoi(vllm.url().substr(vllm.url().rfind(':') + 1)));
  ASSERT_EQ(fake.Post("/pause?mode=wait&clear_cache=false", "", "text/plain")->status, 200);
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(30, 0);
  auto refused = cli.Post("/v1/rollouts", R"({"rollout_id":"p-1","prompt":[1,2,3],"max_tokens":4})", "application/json");
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 503) << refused->body;
  EXPECT_NE(refused->body.find("paused"), std::string::npos) << refused->body;
  auto rows = cli.Get("/v1/trajectories?format=json");
  ASSERT_TRUE(rows);
  Json all = Json::parse(rows->body);
  const Json list = all.is_array() ? all : all.value("trajectories", Json::array());
  bool recorded = false;
  for (const Json& t : list) {
    if (t["binding"]["rollout_id"] != "p-1") continue;
    recorded = true;
    EXPECT_EQ(t["finish_reason"], "error") << t.dump();
    EXPECT_TRUE(t["output_token_ids"].empty()) << t.dump();
  }
  EXPECT_TRUE(recorded) << rows->body;
  {
    std::lock_guard<std::mutex> lock(vllm.mu_);
    EXPECT_EQ(vllm.completions_refused_, 1);
  }
  ASSERT_EQ(fake.Post("/resume", "", "text/plain")->status, 200);
  auto served = cli.Post("/v1/rollouts", R"({"rollout_id":"p-2","prompt":[1,2,3],"max_tokens":4})", "application/json");
  ASSERT_TRUE(served);
  EXPECT_EQ(served->status, 200) << served->body;
}

TEST_F(VllmCliTest, ServeRefusesAVllmWithoutTheExtensionNamingTheFlags) {
  FakeVllm::Config cfg;
  cfg.extension = false;
  FakeVllm vllm(cfg);
  ctl_ = Start({"--engine", "vllm+" + vllm.url()}, apps::FreePort().value());
  ASSERT_TRUE(ctl_);
  EXPECT_EQ(WaitExit(ctl_.get()), 1) << ctl_->LogTail();
  EXPECT_NE(ctl_->LogTail().find("--worker-extension-cls rolloutcore.vllm.Extension"), std::string::npos)
      << ctl_->LogTail();
}

// vLLM serving FP8 it quantized at load (docs/fp8.md): a fresh controller records what the engine
// loaded as generation 0 only when the FP8 image is the quantization of those weights. An image
// that is not is refused at start, naming both digests and the first parameter that differs.
TEST_F(VllmCliTest, ServeRefusesAVllmWhoseFp8ImageIsNotTheQuantizationOfWhatItLoaded) {
  FakeVllm vllm;
  vllm.Script([&] {
    vllm.digest_results_ = {Json{{"ok", true},
                                 {"content_digest", "0123456789abcdef"},
                                 {"fp8",
                                  {{"quantization", "fp8_per_channel"},
                                   {"live_digest", "00000000000000f9"},
                                   {"expected_digest", "00000000000000f8"},
                                   {"match", false},
                                   {"mismatch", "model.layers.1.self_attn.qkv_proj.weight: the scales vLLM computes "
                                                "with are not the per_channel quantization of the proven bf16"}}}}};
  });
  ctl_ = Start({"--engine", "vllm+" + vllm.url()}, apps::FreePort().value());
  ASSERT_TRUE(ctl_);
  EXPECT_NE(WaitExit(ctl_.get()), 0) << ctl_->LogTail();
  const std::string log = ctl_->LogTail(60);
  EXPECT_NE(log.find("fp8_per_channel image (00000000000000f9) is not the quantization of the weights it loaded "
                     "(00000000000000f8)"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("qkv_proj"), std::string::npos) << log;
}

TEST_F(VllmCliTest, NativeNcclTransferWithoutASenderAndBadUrlsAreRefusedUpFront) {
  ctl_ = Start({"--engine", "vllm+http://127.0.0.1:1", "--vllm-transfer", "native-nccl"}, apps::FreePort().value());
  ASSERT_TRUE(ctl_);
  EXPECT_EQ(WaitExit(ctl_.get()), 2) << ctl_->LogTail();
  EXPECT_NE(ctl_->LogTail().find("native-nccl needs --vllm-native-trainer"), std::string::npos) << ctl_->LogTail();
  ctl_ = Start({"--engine", "vllm+http://127.0.0.1:1", "--vllm-native-trainer", "http://127.0.0.1:2"},
               apps::FreePort().value());
  ASSERT_TRUE(ctl_);
  EXPECT_EQ(WaitExit(ctl_.get()), 2) << ctl_->LogTail();
  EXPECT_NE(ctl_->LogTail().find("only used with --vllm-transfer native-nccl"), std::string::npos) << ctl_->LogTail();
  ctl_ = Start({"--engine", "vllm+ftp://127.0.0.1:1"}, apps::FreePort().value());
  ASSERT_TRUE(ctl_);
  EXPECT_EQ(WaitExit(ctl_.get()), 2) << ctl_->LogTail();
  EXPECT_NE(ctl_->LogTail().find("vllm+ftp://127.0.0.1:1"), std::string::npos) << ctl_->LogTail();
}

TEST_F(VllmCliTest, PauseCallDefaultsToSleepLevelZero) {
  // --vllm-pause-call sleep is the default (docs/vllm.md: 29.7 vs 53.6 ms pause window for 16 GB on
  // the H200); /pause stays selectable.
  ctl_ = ChildProcess::Spawn("help", {"controller", "serve", "--help"}, dir_ + "/help.log", ROLLOUTCORE_BIN).value();
  EXPECT_EQ(WaitExit(ctl_.get()), 0) << ctl_->LogTail();
  const std::string out = ctl_->LogTail(400);
  const size_t at = out.find("--vllm-pause-call");
  ASSERT_NE(at, std::string::npos) << out;
  const std::string line = out.substr(at, out.find('\n', at) - at);
  EXPECT_NE(line.find("{pause,sleep}=sleep"), std::string::npos) << "the default is sleep: " << line;
}

TEST_F(VllmCliTest, BenchCycleEngineVllmRunsThePackagesBenchWithTheArguments) {
  // The real Python bench, importable from the source tree; --dry-run prints its configuration
  // (no GPU needed). --cycles is the subcommand's own flag, forwarded; the rest passes through.
  ::setenv("PYTHONPATH", ROLLOUTCORE_PY_SRC, 1);
  ::unsetenv("ROLLOUTCORE_BIN");
  ctl_ = ChildProcess::Spawn("bench", {"bench", "cycle", "--engine", "vllm", "--cycles", "4", "--shape", "8b",
                                       "--pause-call", "sleep", "--dry-run"},
                             dir_ + "/bench.log", ROLLOUTCORE_BIN)
             .value();
  EXPECT_EQ(WaitExit(ctl_.get()), 0) << ctl_->LogTail();
  const std::string out = ctl_->LogTail(40);
  EXPECT_NE(out.find("\"cycles\": 4"), std::string::npos) << out;
  EXPECT_NE(out.find("\"shape\": \"8b\""), std::string::npos) << out;
  EXPECT_NE(out.find("\"pause_call\": \"sleep\""), std::string::npos) << out;
  EXPECT_NE(out.find("\"rolloutcore_bin\": \"/"), std::string::npos) << "the bench's servers use this binary: " << out;
  // FP8 against bf16 in one call (docs/fp8.md); --compare-bf16 alone names what it lacks.
  ctl_ = ChildProcess::Spawn("bench", {"bench", "cycle", "--engine", "vllm", "--shape", "8b", "--quantization",
                                       "fp8_per_block", "--compare-bf16", "--dry-run"},
                             dir_ + "/bench_fp8.log", ROLLOUTCORE_BIN)
             .value();
  EXPECT_EQ(WaitExit(ctl_.get()), 0) << ctl_->LogTail();
  EXPECT_NE(ctl_->LogTail(40).find("\"quantization\": \"fp8_per_block\""), std::string::npos) << ctl_->LogTail();
  EXPECT_NE(ctl_->LogTail(40).find("\"compare_bf16\": true"), std::string::npos) << ctl_->LogTail();
  ctl_ = ChildProcess::Spawn("bench", {"bench", "cycle", "--engine", "vllm", "--compare-bf16", "--dry-run"},
                             dir_ + "/bench_fp8_bad.log", ROLLOUTCORE_BIN)
             .value();
  EXPECT_EQ(WaitExit(ctl_.get()), 2) << ctl_->LogTail();
  EXPECT_NE(ctl_->LogTail().find("--compare-bf16 needs --quantization"), std::string::npos) << ctl_->LogTail();
  // Arguments the embedded bench does not know are refused there, not ignored.
  ctl_ = ChildProcess::Spawn("bench", {"bench", "cycle", "--shape", "8b"}, dir_ + "/bench2.log", ROLLOUTCORE_BIN).value();
  EXPECT_EQ(WaitExit(ctl_.get()), 2) << ctl_->LogTail();
  EXPECT_NE(ctl_->LogTail().find("unknown arguments for --engine embedded: --shape 8b"), std::string::npos)
      << ctl_->LogTail();
}

}  // namespace
}  // namespace rc
