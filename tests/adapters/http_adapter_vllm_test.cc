// The HTTP adapter's vLLM flavour against FakeVllm (tests/testing/fake_vllm.h: vLLM 0.26's
// endpoints plus rolloutcore's worker-extension protocol over /collective_rpc), alone and under
// the real Controller and Runner. The real-vLLM tests run on the GPU machine (label gpu+vllm).
#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <deque>
#include <mutex>
#include <thread>

#include "rolloutcore/adapters/http_adapter.h"
#include "rolloutcore/base/hash.h"
#include "rolloutcore/base/json.h"
#include "rolloutcore/lifecycle/runner.h"
#include "rolloutcore/refit/digest.h"
#include "testing/fake_vllm.h"

namespace rc::adapters {
namespace {

using rc::testing::FakeVllm;

HttpAdapterOptions Options(const std::string& url) {
  HttpAdapterOptions o;
  o.base_url = url;
  o.directory_url = "http://127.0.0.1:8200";
  o.model = "tiny";
  o.vllm.reset_backoff_ms = 1;
  o.vllm.gauge_probe_after_ms = 50;
  return o;
}

template <typename T>
Result<T> Await(Pending<T> p) {
  if (!p.WaitFor(std::chrono::seconds(10))) return DeadlineExceeded("test wait");
  return p.Get();
}

lifecycle::UpdateTarget Target() {
  lifecycle::UpdateTarget t;
  t.label = "v8";
  return t;
}

TEST(HttpAdapterVllmTest, DescribesVllmThroughTheExtensionAndReadsDrainFromMetrics) {
  FakeVllm vllm;
  HttpEngineAdapter a(Options(vllm.url()));
  auto d = a.Describe();
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->kind, "vllm");
  EXPECT_TRUE(d->offers_content_digest);
  EXPECT_TRUE(d->supports_staging);
  EXPECT_EQ(d->caches.size(), 3u) << "prefix, encoder and multimodal are all reset";
  EXPECT_EQ(a.flavor(), EngineFlavor::kVllm);
  {
    std::lock_guard<std::mutex> lock(vllm.mu_);
    ASSERT_EQ(vllm.rpc_calls_.size(), 1u);
    EXPECT_EQ(vllm.rpc_calls_[0]["method"], "rc_describe");
  }
  vllm.running_ = 3;
  auto drain = Await(a.GetDrainStatus());
  ASSERT_TRUE(drain.ok()) << drain.status().ToString();
  EXPECT_EQ(drain->running, 3) << "the _total counter with a longer name is not summed in";
  auto label = Await(a.ReadLabel());
  ASSERT_TRUE(label.ok()) << label.status().ToString();
  EXPECT_EQ(label->label, "v7") << "the label comes from rc_label, set by rc_install";
}

TEST(HttpAdapterVllmTest, ProposesTheMeasuredBf16ReplayBoundAndAcceptsTies) {
  // The bound measured on the H200 (docs/vllm.md "Replay validation": worst 0.060 over 3 versions x
  // 4 probes x 16 steps) times a 2.5 margin; an extension that does not say offers_replay is skipped.
  FakeVllm vllm;
  HttpEngineAdapter a(Options(vllm.url()));
  auto d = a.Describe();
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_DOUBLE_EQ(d->replay_tolerance, 0.15);
  EXPECT_TRUE(d->replay_accepts_ties);
  EXPECT_FALSE(d->offers_replay) << "the fake's rc_describe has no offers_replay";
}

// FP8 serving (docs/fp8.md): the extension's rc_describe says what vLLM computes with, and the
// description carries it (the runner replays only probes computed under the same); workers that
// disagree are refused.
TEST(HttpAdapterVllmTest, DescriptionCarriesTheQuantizationTheWorkersReport) {
  {
    FakeVllm vllm;
    HttpEngineAdapter a(Options(vllm.url()));
    auto d = a.Describe();
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_EQ(d->quantization, "") << "an extension that reports none serves the weights as installed";
  }
  {
    FakeVllm::Config c;
    c.workers = 2;
    c.quantization = {"fp8_per_block", "fp8_per_block"};
    FakeVllm vllm(c);
    HttpEngineAdapter a(Options(vllm.url()));
    auto d = a.Describe();
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_EQ(d->quantization, "fp8_per_block");
    // The bound measured for vLLM's W8A8 FP8 kernels (docs/fp8.md "Replay validation"), not bf16's.
    EXPECT_DOUBLE_EQ(d->replay_tolerance, 1.15);
  }
  {
    FakeVllm::Config c;
    c.workers = 2;
    c.quantization = {"fp8_per_block", ""};
    FakeVllm vllm(c);
    HttpEngineAdapter a(Options(vllm.url()));
    auto d = a.Describe();
    ASSERT_FALSE(d.ok());
    EXPECT_NE(d.status().message().find("worker 1"), std::string::npos) << d.status().ToString();
  }
}

TEST(HttpAdapterVllmTest, GaugesLeftStaleAreRefreshedByOneProbeButNeverWhilePaused) {
  FakeVllm vllm;
  HttpEngineAdapter a(Options(vllm.url()));
  ASSERT_TRUE(a.Describe().ok());
  vllm.stale_gauges_ = true;  // e.g. a request aborted outside a step left the gauge at 2
  vllm.running_ = 2;
  auto drain = Await(a.GetDrainStatus());
  ASSERT_TRUE(drain.ok()) << drain.status().ToString();
  EXPECT_EQ(drain->running, 2) << "a fresh non-zero reading is taken as it is";
  {
    std::lock_guard<std::mutex> lock(vllm.mu_);
    EXPECT_EQ(vllm.completions_, 0);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(80));  // past gauge_probe_after_ms
  drain = Await(a.GetDrainStatus());
  ASSERT_TRUE(drain.ok()) << drain.status().ToString();
  EXPECT_EQ(drain->running, 0) << "the unchanged reading was probed: vLLM stepped and refreshed its gauges";
  {
    std::lock_guard<std::mutex> lock(vllm.mu_);
    EXPECT_EQ(vllm.completions_, 1);
  }
  ASSERT_TRUE(Await(a.Pause(lifecycle::PauseMode::kWait)).ok());
  vllm.running_ = 2;
  ASSERT_EQ(Await(a.GetDrainStatus())->running, 2);
  std::this_thread::sleep_for(std::chrono::milliseconds(80));
  drain = Await(a.GetDrainStatus());
  ASSERT_TRUE(drain.ok()) << drain.status().ToString();
  EXPECT_EQ(drain->running, 2) << "no probe while paused: it would block until the resume";
  std::lock_guard<std::mutex> lock(vllm.mu_);
  EXPECT_EQ(vllm.completions_while_paused_, 0);
}

TEST(HttpAdapterVllmTest, MissingExtensionOrDevModeNamesTheServeFlags) {
  for (bool dev_mode : {true, false}) {
    FakeVllm::Config cfg;
    cfg.extension = false;
    cfg.dev_mode = dev_mode;  // second round: no dev mode at all (every dev route 404s)
    FakeVllm vllm(cfg);
    HttpEngineAdapter a(Options(vllm.url()));
    auto d = a.Describe();
    ASSERT_FALSE(d.ok());
    EXPECT_EQ(d.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(d.status().message().find("--worker-extension-cls rolloutcore.vllm.Extension"), std::string::npos)
        << d.status().message();
    EXPECT_NE(d.status().message().find("VLLM_SERVER_DEV_MODE=1"), std::string::npos) << d.status().message();
    if (dev_mode) {
      EXPECT_NE(d.status().message().find("Method 'rc_describe' is not implemented."), std::string::npos)
          << "vLLM's own message is kept";
    }
  }
}

TEST(HttpAdapterVllmTest, StageWarmsTheCanaryThenStagesOnEveryWorker) {
  FakeVllm::Config cfg;
  cfg.workers = 2;
  FakeVllm vllm(cfg);
  HttpEngineAdapter a(Options(vllm.url()));
  ASSERT_TRUE(a.Describe().ok());
  auto st = Await(a.Stage(Target()));
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  EXPECT_EQ(st->label, "v8");
  EXPECT_EQ(st->bytes, 2001) << "bytes planned summed over the workers";
  EXPECT_EQ(st->detail["bytes_pulled"], 2000);
  ASSERT_EQ(st->detail["workers"].size(), 2u);
  EXPECT_EQ(st->detail["workers"][1]["staged_digest"], "00000000000000aa");
  EXPECT_EQ(st->detail["workers"][1]["stage_ms"]["total"], 12.5);
  const Json& warm = st->detail["canary_warmup"];
  EXPECT_EQ(warm["warmed_in"], "stage");
  EXPECT_EQ(warm["first_cached_tokens"], 0);
  EXPECT_EQ(warm["second_cached_tokens"], 64);
  EXPECT_EQ(warm["verifiable"], true);
  std::lock_guard<std::mutex> lock(vllm.mu_);
  EXPECT_EQ(vllm.completions_, 2);
  EXPECT_EQ(vllm.last_model_, "tiny-qwen3") << "the canary names the served model (GET /v1/models)";
  const Json& call = vllm.rpc_calls_.back();
  EXPECT_EQ(call["method"], "rc_stage");
  EXPECT_EQ(call["kwargs"]["model"], "tiny");
  EXPECT_EQ(call["kwargs"]["version"], "v8");
  EXPECT_EQ(call["kwargs"]["directory"], "http://127.0.0.1:8200");
  EXPECT_EQ(call["kwargs"]["timeout_ms"], 120000);
}

// --vllm-delta-policy: sent as rc_stage's delta_policy when set, not sent otherwise (the worker's
// default decides), and the workers' answers (their mode) are kept in the evidence.
TEST(HttpAdapterVllmTest, StageSendsTheDeltaPolicyOnlyWhenSet) {
  FakeVllm vllm;
  for (const std::string policy : {"", "always"}) {
    HttpAdapterOptions o = Options(vllm.url());
    o.vllm.delta_policy = policy;
    HttpEngineAdapter a(o);
    ASSERT_TRUE(a.Describe().ok());
    auto st = Await(a.Stage(Target()));
    ASSERT_TRUE(st.ok()) << st.status().ToString();
    EXPECT_EQ(st->detail["workers"][0]["mode"], "full");
    std::lock_guard<std::mutex> lock(vllm.mu_);
    const Json& kwargs = vllm.rpc_calls_.back()["kwargs"];
    EXPECT_EQ(kwargs.contains("delta_policy"), !policy.empty()) << kwargs.dump();
    if (!policy.empty()) {
      EXPECT_EQ(kwargs["delta_policy"], policy);
    }
  }
}

TEST(HttpAdapterVllmTest, AWorkersStageFailureKeepsItsCode) {
  FakeVllm vllm;
  vllm.Script([&] {
    vllm.stage_failure_ = Json{{"ok", false}, {"code", "NotFound"}, {"error", "no committed version v8 of tiny"}};
  });
  HttpEngineAdapter a(Options(vllm.url()));
  ASSERT_TRUE(a.Describe().ok());
  auto st = Await(a.Stage(Target()));
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.status().code(), StatusCode::kNotFound);
  EXPECT_NE(st.status().message().find("rank 0: rc_stage: no committed version v8"), std::string::npos)
      << st.status().message();
}

TEST(HttpAdapterVllmTest, PauseWithoutStageWarmsTheCanaryBeforePausingAndRecordsTheDrainRule) {
  FakeVllm vllm;
  vllm.running_ = 2;  // stale gauges: the last step's value, never refreshed while paused
  HttpEngineAdapter a(Options(vllm.url()));
  ASSERT_TRUE(a.Describe().ok());
  auto p = Await(a.Pause(lifecycle::PauseMode::kWait));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_TRUE(p->paused);
  EXPECT_EQ(p->running, 0) << "a 200 from /pause?mode=wait is vLLM's statement that it went idle";
  EXPECT_EQ(p->detail["gauges"]["num_requests_running"], 2) << "the gauges are recorded all the same";
  EXPECT_EQ(p->detail["canary_warmup"]["warmed_in"], "pause");
  EXPECT_EQ(p->detail["canary_warmup"]["verifiable"], true);
  {
    std::lock_guard<std::mutex> lock(vllm.mu_);
    EXPECT_EQ(vllm.completions_, 2);
    EXPECT_EQ(vllm.completions_while_paused_, 0) << "requests sent while paused would block until the resume";
    ASSERT_EQ(vllm.pause_queries_.size(), 1u);
    EXPECT_EQ(vllm.pause_queries_[0], "mode=wait&clear_cache=false");
  }
  // A second pause in the same cycle does not warm again; mode=keep trusts only the gauge.
  auto k = Await(a.Pause(lifecycle::PauseMode::kKeep));
  ASSERT_TRUE(k.ok()) << k.status().ToString();
  EXPECT_EQ(k->running, 2) << "keep freezes requests in place: the running gauge is the evidence";
  EXPECT_FALSE(k->detail.contains("canary_warmup"));
  std::lock_guard<std::mutex> lock(vllm.mu_);
  EXPECT_EQ(vllm.pause_queries_[1], "mode=keep&clear_cache=false");
  EXPECT_EQ(vllm.completions_, 2);
}

TEST(HttpAdapterVllmTest, FullCycleRecordsObservedEvidence) {
  FakeVllm vllm;
  HttpEngineAdapter a(Options(vllm.url()));
  ASSERT_TRUE(a.Describe().ok());
  ASSERT_TRUE(Await(a.Stage(Target())).ok());
  auto pause = Await(a.Pause(lifecycle::PauseMode::kWait));
  ASSERT_TRUE(pause.ok());
  EXPECT_FALSE(pause->detail.contains("canary_warmup")) << "the stage warmed it this cycle";
  auto inst = Await(a.Install(Target(), false));
  ASSERT_TRUE(inst.ok()) << inst.status().ToString();
  EXPECT_EQ(inst->label, "v8");
  EXPECT_EQ(inst->bytes, 500);
  auto reset = Await(a.ResetCache(lifecycle::CacheKind::kPrefix));
  ASSERT_TRUE(reset.ok()) << reset.status().ToString();
  EXPECT_TRUE(reset->success);
  EXPECT_TRUE(reset->verified);
  EXPECT_EQ(reset->attempts, 1);
  EXPECT_EQ(vllm.reset_running_requests_, "") << "never preempt: a refusal must stay visible";
  auto label = Await(a.ReadLabel());
  ASSERT_TRUE(label.ok());
  EXPECT_EQ(label->label, "v8");
  auto digest = Await(a.ReadContentDigest());
  ASSERT_TRUE(digest.ok()) << digest.status().ToString();
  EXPECT_EQ(digest->content_digest, "0123456789abcdef");
  auto resume = Await(a.Resume());
  ASSERT_TRUE(resume.ok()) << resume.status().ToString();
  EXPECT_FALSE(resume->paused_after);
  EXPECT_EQ(resume->detail["canary"]["checked"], true);
  EXPECT_EQ(resume->detail["canary"]["cached_tokens"], 0);
  EXPECT_EQ(resume->detail["canary"]["verified"], true) << resume->detail.dump();
  std::lock_guard<std::mutex> lock(vllm.mu_);
  bool asked = false, fresh = true;
  for (const Json& c : vllm.rpc_calls_) {
    if (c["method"] == "rc_digest") {
      asked = true;
      fresh = c["kwargs"]["fresh"] == true;
    }
  }
  EXPECT_TRUE(asked);
  EXPECT_FALSE(fresh) << "validation reads the digest rc_install computed from the live parameters after its "
                         "copies: no second pass over the weights in the pause window";
}

Json Sum(uint64_t sum, int64_t elements, bool full, std::optional<int64_t> numel = std::nullopt) {
  Json j{{"sum", Hex64(sum)}, {"elements", elements}, {"full", full}};
  if (numel) j["numel"] = *numel;
  return j;
}

int RpcCount(FakeVllm& vllm, const std::string& method) {
  std::lock_guard<std::mutex> lock(vllm.mu_);
  int n = 0;
  for (const Json& c : vllm.rpc_calls_) n += c["method"] == method ? 1 : 0;
  return n;
}

TEST(HttpAdapterVllmTest, InstallReplyServesLabelAndDigestWithoutMoreRoundTrips) {
  FakeVllm::Config cfg;
  cfg.workers = 2;
  cfg.install_reports_digest = true;
  FakeVllm vllm(cfg);
  const uint64_t norm = 0x1111222233334444ull, a0 = 0xfffffffffffffff0ull, a1 = 0x20;
  vllm.Script([&] {
    vllm.digest_results_ = {Json{{"ok", true},
                                 {"content_digest", nullptr},
                                 {"tensor_sums", {{"norm", Sum(norm, 8, true)}, {"proj", Sum(a0, 6, false, 10)}}}},
                            Json{{"ok", true},
                                 {"content_digest", nullptr},
                                 {"tensor_sums", {{"norm", Sum(norm, 8, true)}, {"proj", Sum(a1, 4, false, 10)}}}}};
  });
  HttpEngineAdapter a(Options(vllm.url()));
  ASSERT_TRUE(a.Describe().ok());
  ASSERT_TRUE(Await(a.Stage(Target())).ok());
  ASSERT_TRUE(Await(a.Pause(lifecycle::PauseMode::kWait)).ok());
  ASSERT_TRUE(Await(a.Install(Target(), false)).ok());
  ASSERT_TRUE(Await(a.ResetCache(lifecycle::CacheKind::kPrefix)).ok());
  auto label = Await(a.ReadLabel());
  ASSERT_TRUE(label.ok()) << label.status().ToString();
  EXPECT_EQ(label->label, "v8");
  auto digest = Await(a.ReadContentDigest());
  ASSERT_TRUE(digest.ok()) << digest.status().ToString();
  refit::TensorDigests want{{"norm", norm}, {"proj", a0 + a1}};
  EXPECT_EQ(digest->content_digest, Hex64(refit::CombineTensorDigests(want)));
  EXPECT_EQ(RpcCount(vllm, "rc_label"), 0) << "the label rc_install reported is the label rc_label would read";
  EXPECT_EQ(RpcCount(vllm, "rc_digest"), 0) << "rc_install's reply carries rc_digest(fresh=false)'s fields";
  // Used once: a later read asks the workers again, and sees what they say now.
  vllm.Script([&] { vllm.digest_results_[1]["tensor_sums"]["norm"] = Sum(norm + 1, 8, true); });
  auto again = Await(a.ReadContentDigest());
  EXPECT_EQ(again.status().code(), StatusCode::kDataLoss) << "the ranks now disagree on norm";
  EXPECT_EQ(RpcCount(vllm, "rc_digest"), 1);
  ASSERT_TRUE(Await(a.Resume()).ok());
}

TEST(HttpAdapterVllmTest, AnInstallReplyWithoutTheDigestFieldsFallsBackToRcLabelAndRcDigest) {
  FakeVllm vllm;  // install_reports_digest = false: the older extension's reply
  HttpEngineAdapter a(Options(vllm.url()));
  ASSERT_TRUE(a.Describe().ok());
  ASSERT_TRUE(Await(a.Stage(Target())).ok());
  ASSERT_TRUE(Await(a.Pause(lifecycle::PauseMode::kWait)).ok());
  ASSERT_TRUE(Await(a.Install(Target(), false)).ok());
  ASSERT_TRUE(Await(a.ReadLabel()).ok());
  ASSERT_TRUE(Await(a.ReadContentDigest()).ok());
  EXPECT_EQ(RpcCount(vllm, "rc_label"), 1);
  EXPECT_EQ(RpcCount(vllm, "rc_digest"), 1);
}

TEST(HttpAdapterVllmTest, PauseViaSleepUsesSleepLevelZeroAndWakeUpScheduling) {
  FakeVllm vllm;
  HttpAdapterOptions o = Options(vllm.url());
  o.vllm.pause_via_sleep = true;
  HttpEngineAdapter a(o);
  ASSERT_TRUE(a.Describe().ok());
  ASSERT_TRUE(Await(a.Stage(Target())).ok());
  auto p = Await(a.Pause(lifecycle::PauseMode::kWait));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_TRUE(p->paused);
  EXPECT_EQ(p->running, 0);
  EXPECT_EQ(p->detail["pause"]["request"], "/sleep?level=0&mode=wait");
  ASSERT_TRUE(Await(a.Install(Target(), false)).ok());
  ASSERT_TRUE(Await(a.ResetCache(lifecycle::CacheKind::kPrefix)).ok());
  auto r = Await(a.Resume());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_FALSE(r->paused_after);
  std::lock_guard<std::mutex> lock(vllm.mu_);
  EXPECT_EQ(vllm.pause_queries_, (std::vector<std::string>{"sleep level=0&mode=wait", "wake_up tags=scheduling"}));
}

TEST(HttpAdapterVllmTest, RefusedPrefixResetIsRetriedAndTheAttemptsRecorded) {
  FakeVllm vllm;
  vllm.Script([&] { vllm.reset_answers_ = {false, false, true}; });
  HttpEngineAdapter a(Options(vllm.url()));
  ASSERT_TRUE(a.Describe().ok());
  auto r = Await(a.ResetCache(lifecycle::CacheKind::kPrefix));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->success);
  EXPECT_TRUE(r->verified);
  EXPECT_EQ(r->attempts, 3);
  std::lock_guard<std::mutex> lock(vllm.mu_);
  EXPECT_EQ(vllm.prefix_resets_, 3);
}

TEST(HttpAdapterVllmTest, AlwaysRefusedPrefixResetIsNeverSuccess) {
  FakeVllm vllm;
  vllm.Script([&] { vllm.reset_answers_ = {false}; });
  HttpAdapterOptions o = Options(vllm.url());
  o.vllm.reset_attempts = 4;
  HttpEngineAdapter a(o);
  ASSERT_TRUE(a.Describe().ok());
  auto r = Await(a.ResetCache(lifecycle::CacheKind::kPrefix));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_FALSE(r->success);
  EXPECT_EQ(r->attempts, 4);
  std::lock_guard<std::mutex> lock(vllm.mu_);
  EXPECT_EQ(vllm.prefix_resets_, 4) << "bounded";
}

TEST(HttpAdapterVllmTest, MmAndEncoderResetsAreSentButUnverified) {
  FakeVllm vllm;
  HttpEngineAdapter a(Options(vllm.url()));
  ASSERT_TRUE(a.Describe().ok());
  for (auto kind : {lifecycle::CacheKind::kEncoder, lifecycle::CacheKind::kMultimodal}) {
    auto r = Await(a.ResetCache(kind));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_TRUE(r->success) << "vLLM accepted it";
    EXPECT_FALSE(r->verified) << "an empty 200 proves nothing";
  }
  std::lock_guard<std::mutex> lock(vllm.mu_);
  EXPECT_EQ(vllm.other_resets_["/reset_encoder_cache"], 1);
  EXPECT_EQ(vllm.other_resets_["/reset_mm_cache"], 1);
}

TEST(HttpAdapterVllmTest, CanaryThatNeverHitsIsRecordedUnableToVerify) {
  FakeVllm::Config cfg;
  cfg.prefix_caching = false;  // the second warm-up reports 0 cached tokens
  FakeVllm vllm(cfg);
  HttpEngineAdapter a(Options(vllm.url()));
  ASSERT_TRUE(a.Describe().ok());
  auto st = Await(a.Stage(Target()));
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->detail["canary_warmup"]["verifiable"], false);
  ASSERT_TRUE(Await(a.Pause(lifecycle::PauseMode::kWait)).ok());
  ASSERT_TRUE(Await(a.ResetCache(lifecycle::CacheKind::kPrefix)).ok());
  auto resume = Await(a.Resume());
  ASSERT_TRUE(resume.ok()) << resume.status().ToString();
  EXPECT_EQ(resume->detail["canary"]["cached_tokens"], 0);
  EXPECT_EQ(resume->detail["canary"]["verified"], false) << "0 after a warm-up that never hit proves nothing";
  EXPECT_TRUE(resume->detail["canary"].contains("why_not"));
}

TEST(HttpAdapterVllmTest, CanaryCatchesAResetThatDidNothing) {
  FakeVllm::Config cfg;
  cfg.reset_clears = false;  // answers success but keeps the blocks
  FakeVllm vllm(cfg);
  HttpEngineAdapter a(Options(vllm.url()));
  ASSERT_TRUE(a.Describe().ok());
  ASSERT_TRUE(Await(a.Stage(Target())).ok());
  ASSERT_TRUE(Await(a.Pause(lifecycle::PauseMode::kWait)).ok());
  ASSERT_TRUE(Await(a.ResetCache(lifecycle::CacheKind::kPrefix)).ok());
  auto resume = Await(a.Resume());
  ASSERT_FALSE(resume.ok());
  EXPECT_EQ(resume.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(resume.status().message().find("64 cached prompt tokens"), std::string::npos);
}

TEST(HttpAdapterVllmTest, ResumeWithoutAResetThisCycleSkipsTheCanary) {
  FakeVllm vllm;
  HttpEngineAdapter a(Options(vllm.url()));
  ASSERT_TRUE(a.Describe().ok());
  ASSERT_TRUE(Await(a.Pause(lifecycle::PauseMode::kWait)).ok());  // warms
  auto resume = Await(a.Resume());                                // e.g. the best-effort resume of a rejected update
  ASSERT_TRUE(resume.ok()) << resume.status().ToString();
  EXPECT_EQ(resume->detail["canary"]["checked"], false);
}

TEST(HttpAdapterVllmTest, InstallOutcomesMapToTheContract) {
  struct Case {
    std::vector<std::string> outcomes;
    StatusCode want;
  };
  for (const Case& c : {Case{{"refused_untouched", "refused_untouched"}, StatusCode::kFailedPrecondition},
                        Case{{"installed", "installed"}, StatusCode::kOk},
                        Case{{"installed", "failed_after_mutation"}, StatusCode::kInternal},
                        Case{{"refused_untouched", "installed"}, StatusCode::kInternal},
                        Case{{"installed", "bogus"}, StatusCode::kInternal}}) {
    FakeVllm::Config cfg;
    cfg.workers = 2;
    FakeVllm vllm(cfg);
    vllm.Script([&] { vllm.install_outcomes_ = c.outcomes; });
    HttpEngineAdapter a(Options(vllm.url()));
    ASSERT_TRUE(a.Describe().ok());
    auto inst = Await(a.Install(Target(), false));
    std::string what = c.outcomes[0] + "," + c.outcomes[1];
    if (c.want == StatusCode::kFailedPrecondition) {
      // A refusal is evidence with the typed outcome, not an error (an error taints).
      ASSERT_TRUE(inst.ok()) << what << ": " << inst.status().ToString();
      EXPECT_EQ(inst->outcome, lifecycle::InstallOutcome::kRefusedUntouched) << what;
      EXPECT_NE(inst->error.find("before any live byte was written"), std::string::npos) << inst->error;
      EXPECT_NE(inst->error.find("nothing staged for v8"), std::string::npos) << inst->error;
      continue;
    }
    ASSERT_EQ(inst.status().code(), c.want) << what << ": " << inst.status().ToString();
    if (inst.ok()) {
      EXPECT_EQ(inst->outcome, lifecycle::InstallOutcome::kInstalled);
      EXPECT_EQ(inst->label, "v8");
      EXPECT_EQ(inst->bytes, 1000) << "bytes installed summed over the workers";
      EXPECT_EQ(inst->detail["generation"], 4);
    } else {
      EXPECT_NE(inst.status().message().find("unknown state"), std::string::npos) << inst.status().message();
    }
  }
}

TEST(HttpAdapterVllmTest, InstallTransportLossIsAmbiguous) {
  FakeVllm vllm;
  HttpEngineAdapter a(Options(vllm.url()));
  ASSERT_TRUE(a.Describe().ok());
  ASSERT_TRUE(Await(a.Stage(Target())).ok());
  vllm.Stop();
  auto inst = Await(a.Install(Target(), false));
  ASSERT_FALSE(inst.ok());
  EXPECT_EQ(inst.status().code(), StatusCode::kUnavailable) << "never FailedPrecondition: the runner taints";
}

TEST(HttpAdapterVllmTest, LabelDisagreementAcrossWorkersIsDataLoss) {
  FakeVllm::Config cfg;
  cfg.workers = 2;
  FakeVllm vllm(cfg);
  vllm.Script([&] { vllm.labels_ = {"v8", "v7"}; });
  HttpEngineAdapter a(Options(vllm.url()));
  ASSERT_TRUE(a.Describe().ok());
  auto label = Await(a.ReadLabel());
  ASSERT_FALSE(label.ok());
  EXPECT_EQ(label.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(label.status().message().find("rank 1 'v7'"), std::string::npos) << label.status().message();
}

TEST(HttpAdapterVllmTest, DigestCombinesTwoTensorParallelRanks) {
  FakeVllm::Config cfg;
  cfg.workers = 2;
  FakeVllm vllm(cfg);
  // "norm" is replicated (full on both ranks); "proj" is split 6 + 4 elements of 10, and the
  // partial sums wrap around 2^64.
  const uint64_t norm = 0x1111222233334444ull, a0 = 0xfffffffffffffff0ull, a1 = 0x20;
  vllm.Script([&] {
    vllm.digest_results_ = {Json{{"ok", true},
                                 {"content_digest", nullptr},
                                 {"tensor_sums", {{"norm", Sum(norm, 8, true)}, {"proj", Sum(a0, 6, false, 10)}}}},
                            Json{{"ok", true},
                                 {"content_digest", nullptr},
                                 {"tensor_sums", {{"norm", Sum(norm, 8, true)}, {"proj", Sum(a1, 4, false, 10)}}}}};
  });
  HttpEngineAdapter a(Options(vllm.url()));
  ASSERT_TRUE(a.Describe().ok());
  auto d = Await(a.ReadContentDigest());
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  refit::TensorDigests want{{"norm", norm}, {"proj", a0 + a1}};
  EXPECT_EQ(want["proj"], 0x10u);
  EXPECT_EQ(d->content_digest, Hex64(refit::CombineTensorDigests(want)));

  // A replicated tensor whose ranks disagree, and a split that misses elements, are DataLoss.
  vllm.Script([&] { vllm.digest_results_[1]["tensor_sums"]["norm"] = Sum(norm + 1, 8, true); });
  auto bad = Await(a.ReadContentDigest());
  EXPECT_EQ(bad.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(bad.status().message().find("tensor norm"), std::string::npos) << bad.status().message();
  vllm.Script([&] {
    vllm.digest_results_[1]["tensor_sums"]["norm"] = Sum(norm, 8, true);
    vllm.digest_results_[1]["tensor_sums"]["proj"] = Sum(a1, 3, false, 10);
  });
  bad = Await(a.ReadContentDigest());
  EXPECT_EQ(bad.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(bad.status().message().find("cover 9 elements of 10"), std::string::npos) << bad.status().message();
  // A worker's own failure keeps its code.
  vllm.Script([&] { vllm.digest_results_[1] = Json{{"ok", false}, {"code", "Unavailable"}, {"error", "CUDA busy"}}; });
  bad = Await(a.ReadContentDigest());
  EXPECT_EQ(bad.status().code(), StatusCode::kUnavailable);
}

// vLLM serving FP8 from bf16 (docs/fp8.md): each worker's rc_install / rc_digest reply carries the
// proof of the FP8 image ("fp8": the image digest vLLM computes with and the expected one).
Json Fp8Proof(const std::string& live, const std::string& expected) {
  Json f{{"quantization", "fp8_per_block"}, {"scheme", "block"}, {"expected_digest", expected},
         {"live_digest", live}, {"match", live == expected}, {"ms", 0.4}};
  if (live != expected) f["mismatch"] = "model.layers.0.mlp.down_proj.weight: the scales vLLM computes with are not "
                                        "the block quantization of the proven bf16";
  return f;
}

TEST(HttpAdapterVllmTest, TheFp8ProofOfTheInstallAndOfRcDigestReachesTheEvidence) {
  FakeVllm::Config cfg;
  cfg.install_reports_digest = true;
  FakeVllm vllm(cfg);
  vllm.Script([&] {
    vllm.digest_results_ = {Json{{"ok", true},
                                 {"content_digest", "0123456789abcdef"},
                                 {"fp8", Fp8Proof("00000000000000f8", "00000000000000f8")}}};
  });
  HttpEngineAdapter a(Options(vllm.url()));
  ASSERT_TRUE(a.Describe().ok());
  ASSERT_TRUE(Await(a.Stage(Target())).ok());
  ASSERT_TRUE(Await(a.Pause(lifecycle::PauseMode::kWait)).ok());
  ASSERT_TRUE(Await(a.Install(Target(), false)).ok());
  auto d = Await(a.ReadContentDigest());  // from the install's reply
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  ASSERT_TRUE(d->quantized.has_value());
  EXPECT_EQ(d->quantized->quantization, "fp8_per_block");
  EXPECT_TRUE(d->quantized->Match());
  // rc_digest's proof, now of an image whose scales are wrong.
  vllm.Script([&] { vllm.digest_results_[0]["fp8"] = Fp8Proof("00000000000000f9", "00000000000000f8"); });
  auto bad = Await(a.ReadContentDigest());
  ASSERT_TRUE(bad.ok()) << bad.status().ToString();
  ASSERT_TRUE(bad->quantized.has_value());
  EXPECT_FALSE(bad->quantized->Match());
  EXPECT_EQ(bad->quantized->live, "00000000000000f9");
  EXPECT_NE(bad->quantized->detail.find("down_proj"), std::string::npos) << bad->quantized->detail;
  // A proof without its expected digest is not evidence.
  vllm.Script([&] { vllm.digest_results_[0]["fp8"].erase("expected_digest"); });
  auto malformed = Await(a.ReadContentDigest());
  EXPECT_EQ(malformed.status().code(), StatusCode::kInvalidArgument) << malformed.status().ToString();
  EXPECT_NE(malformed.status().message().find("expected_digest"), std::string::npos) << malformed.status().ToString();
  ASSERT_TRUE(Await(a.Resume()).ok());
}

TEST(HttpAdapterVllmTest, AnFp8ProofFromSeveralTensorParallelRanksIsRefused) {
  FakeVllm::Config cfg;
  cfg.workers = 2;
  FakeVllm vllm(cfg);
  vllm.Script([&] {
    const Json w{{"ok", true}, {"content_digest", "0123456789abcdef"}, {"fp8", Fp8Proof("00000000000000f8", "00000000000000f8")}};
    vllm.digest_results_ = {w, w};
  });
  HttpEngineAdapter a(Options(vllm.url()));
  ASSERT_TRUE(a.Describe().ok());
  auto d = Await(a.ReadContentDigest());
  EXPECT_EQ(d.status().code(), StatusCode::kFailedPrecondition) << d.status().ToString();
  EXPECT_NE(d.status().message().find("tensor-parallel size 1"), std::string::npos) << d.status().ToString();
}

// Through the real Controller and Runner: vLLM's refusals are never a commit.
class VllmRunnerTest : public ::testing::Test {
 protected:
  Result<lifecycle::UpdateRecord> RunUpdate(FakeVllm& vllm, bool prefetch = true, bool stage_ahead = false) {
    adapter_ = std::make_unique<HttpEngineAdapter>(Options(vllm.url()));
    c_ = std::move(lifecycle::Controller::Open(SystemClock::Default(), &journal_)).value();
    RC_RETURN_IF_ERROR(c_->Initialize({"v7", 3}, {"", "", "", 0}));
    lifecycle::RunnerOptions ro;
    ro.deadlines.reset_ms = 2000;
    ro.prefetch = prefetch;
    runner_ = std::make_unique<lifecycle::Runner>(c_.get(), adapter_.get(), SystemClock::Default(), ro);
    lifecycle::UpdateTarget t = Target();
    t.identity.content_digest = "0123456789abcdef";
    if (stage_ahead) {
      // As the controller service stages while a request resolves: label and model only.
      lifecycle::UpdateTarget ahead;
      ahead.label = t.label;
      RC_RETURN_IF_ERROR(runner_->Prefetch(ahead));
    }
    RC_RETURN_IF_ERROR(runner_->StartUpdate(t).status());
    return runner_->RunToCompletion();
  }
  lifecycle::MemoryJournal journal_;
  std::unique_ptr<HttpEngineAdapter> adapter_;
  std::unique_ptr<lifecycle::Controller> c_;
  std::unique_ptr<lifecycle::Runner> runner_;
};

TEST_F(VllmRunnerTest, UpdateCommitsWithEveryPieceOfEvidenceJournaled) {
  FakeVllm vllm;
  auto u = RunUpdate(vllm);
  ASSERT_TRUE(u.ok()) << u.status().ToString();
  EXPECT_EQ(u->outcome, lifecycle::UpdateOutcome::kCommitted) << u->evidence.dump();
  EXPECT_EQ(c_->version().label, "v8");
  EXPECT_EQ(u->evidence["staged"]["engine"]["canary_warmup"]["verifiable"], true) << u->evidence.dump();
  EXPECT_EQ(u->evidence["begin_install"]["detail"]["drain_rule"].get<std::string>().rfind("wait:", 0), 0u);
  bool prefix_verified = false, encoder_unverified = false;
  for (const Json& r : u->evidence["caches_reset"]) {
    if (r["cache"] == "prefix") prefix_verified = r["verified"] == true;
    if (r["cache"] == "encoder") encoder_unverified = r["verified"] == false;
  }
  EXPECT_TRUE(prefix_verified) << u->evidence.dump();
  EXPECT_TRUE(encoder_unverified) << u->evidence.dump();
  EXPECT_EQ(u->evidence["validated"]["digest_checked"], true);
  EXPECT_EQ(u->evidence["resumed"]["detail"]["canary"]["verified"], true) << u->evidence.dump();
}

// The first thing a fresh adapter is asked (a controller restarted just before the request) is
// the stage ahead of the update: it reaches the workers' rc_stage (not the rolloutcore engine's
// /rc/refit/stage, a 404 on vLLM), once, and the update adopts it.
TEST_F(VllmRunnerTest, AStageAheadOnAFreshAdapterStagesOnTheWorkersAndIsAdopted) {
  FakeVllm vllm;
  auto u = RunUpdate(vllm, /*prefetch=*/true, /*stage_ahead=*/true);
  ASSERT_TRUE(u.ok()) << u.status().ToString();
  EXPECT_EQ(u->outcome, lifecycle::UpdateOutcome::kCommitted) << u->reason << " " << u->evidence.dump();
  EXPECT_EQ(u->evidence["staged"]["label"], "v8") << u->evidence.dump();
  std::lock_guard<std::mutex> lock(vllm.mu_);
  int stages = 0;
  for (const Json& c : vllm.rpc_calls_) stages += c["method"] == "rc_stage" ? 1 : 0;
  EXPECT_EQ(stages, 1) << "the update adopted the stage ahead";
}

// A URL that names the flavour sets it before Describe: a stage sent first goes to the workers.
TEST(HttpAdapterVllmTest, AVllmUrlStagesOnTheWorkersBeforeAnyDescribe) {
  FakeVllm vllm;
  HttpAdapterOptions o = Options(vllm.url());
  o.expected_flavor = EngineFlavor::kVllm;
  HttpEngineAdapter a(o);
  auto st = Await(a.Stage(Target()));
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  EXPECT_EQ(st->label, "v8");
  std::lock_guard<std::mutex> lock(vllm.mu_);
  ASSERT_FALSE(vllm.rpc_calls_.empty());
  EXPECT_EQ(vllm.rpc_calls_.back()["method"], "rc_stage");
}

TEST_F(VllmRunnerTest, WithoutPrefetchTheCanaryIsWarmedBeforeThePauseAndTheInstallStages) {
  FakeVllm vllm;
  auto u = RunUpdate(vllm, /*prefetch=*/false);
  ASSERT_TRUE(u.ok()) << u.status().ToString();
  EXPECT_EQ(u->outcome, lifecycle::UpdateOutcome::kCommitted) << u->evidence.dump();
  EXPECT_FALSE(u->evidence.contains("staged"));
  EXPECT_EQ(u->evidence["begin_install"]["detail"]["canary_warmup"]["warmed_in"], "pause") << u->evidence.dump();
  EXPECT_EQ(u->evidence["install_complete"]["detail"]["staged_in_install"]["bytes_planned"], 1000);
  EXPECT_EQ(u->evidence["resumed"]["detail"]["canary"]["verified"], true) << u->evidence.dump();
  std::lock_guard<std::mutex> lock(vllm.mu_);
  EXPECT_EQ(vllm.completions_while_paused_, 0);
}

TEST_F(VllmRunnerTest, AStageThatFailsInsideTheInstallIsARefusalBeforeMutation) {
  FakeVllm vllm;
  vllm.Script([&] { vllm.stage_failure_ = Json{{"ok", false}, {"code", "Unavailable"}, {"error", "source dead"}}; });
  auto u = RunUpdate(vllm, /*prefetch=*/false);
  ASSERT_TRUE(u.ok()) << u.status().ToString();
  EXPECT_EQ(u->outcome, lifecycle::UpdateOutcome::kRejected) << u->evidence.dump();
  EXPECT_EQ(c_->state(), lifecycle::State::kReady);
  EXPECT_EQ(c_->version().label, "v7");
}

// vLLM serving FP8: an install whose FP8 image is not the quantization of the proven bf16 (the
// weights' content digest is right) fails validation and taints; a right one commits, journaled.
void ScriptFp8Proof(FakeVllm& vllm, const std::string& live) {
  vllm.Script([&] {
    vllm.digest_results_ = {
        Json{{"ok", true}, {"content_digest", "0123456789abcdef"}, {"fp8", Fp8Proof(live, "00000000000000f8")}}};
  });
}

TEST_F(VllmRunnerTest, AnFp8ImageThatIsTheQuantizationOfTheInstalledWeightsCommitsJournaled) {
  FakeVllm vllm;
  ScriptFp8Proof(vllm, "00000000000000f8");
  auto u = RunUpdate(vllm);
  ASSERT_TRUE(u.ok()) << u.status().ToString();
  EXPECT_EQ(u->outcome, lifecycle::UpdateOutcome::kCommitted) << u->evidence.dump();
  EXPECT_EQ(u->evidence["validated"]["quantized"]["match"], true) << u->evidence.dump();
  EXPECT_EQ(u->evidence["validated"]["quantized"]["quantization"], "fp8_per_block") << u->evidence.dump();
}

// The weights' content digest is right, the FP8 image the kernels read is not their quantization.
TEST_F(VllmRunnerTest, AnFp8ImageThatIsNotTheQuantizationOfTheInstalledWeightsTaints) {
  FakeVllm vllm;
  ScriptFp8Proof(vllm, "00000000000000f9");
  auto u = RunUpdate(vllm);
  ASSERT_TRUE(u.ok()) << u.status().ToString();
  EXPECT_EQ(u->outcome, lifecycle::UpdateOutcome::kTainted) << u->evidence.dump();
  EXPECT_EQ(c_->state(), lifecycle::State::kTainted);
  EXPECT_NE(u->reason.find("is not the quantization"), std::string::npos) << u->reason;
  EXPECT_NE(u->reason.find("down_proj"), std::string::npos) << u->reason;
}

// A validation failure taints with vLLM still paused. The recovery's pause must not warm the canary
// (a completion sent to a paused vLLM waits for the resume, which only this recovery sends: on the
// H200 the recovery hung there); it proves the re-installed version and commits.
TEST_F(VllmRunnerTest, ARecoveryAfterAValidationTaintSendsNothingIntoThePausedVllmAndCommits) {
  FakeVllm vllm;
  ScriptFp8Proof(vllm, "00000000000000f9");
  auto u = RunUpdate(vllm);
  ASSERT_TRUE(u.ok()) << u.status().ToString();
  ASSERT_EQ(u->outcome, lifecycle::UpdateOutcome::kTainted) << u->evidence.dump();
  {
    std::lock_guard<std::mutex> lock(vllm.mu_);
    ASSERT_TRUE(vllm.paused()) << "the taint left vLLM paused";
    EXPECT_EQ(vllm.completions_while_paused_, 0);
  }
  ScriptFp8Proof(vllm, "00000000000000f8");  // the recovery's install quantizes right
  lifecycle::UpdateTarget t = Target();
  t.identity.content_digest = "0123456789abcdef";
  ASSERT_TRUE(runner_->StartRecovery(t).ok());
  auto rec = runner_->RunToCompletion();
  ASSERT_TRUE(rec.ok()) << rec.status().ToString();
  EXPECT_EQ(rec->outcome, lifecycle::UpdateOutcome::kCommitted) << rec->reason << " " << rec->evidence.dump();
  EXPECT_EQ(c_->state(), lifecycle::State::kReady);
  EXPECT_EQ(rec->evidence["recovered"]["quantized"]["match"], true) << rec->evidence.dump();
  std::lock_guard<std::mutex> lock(vllm.mu_);
  EXPECT_EQ(vllm.completions_while_paused_, 0) << "nothing was sent into the paused vLLM";
  EXPECT_FALSE(vllm.paused()) << "the recovery resumed vLLM";
}

TEST_F(VllmRunnerTest, PrefixResetThatStaysRefusedTaints) {
  FakeVllm vllm;
  vllm.Script([&] { vllm.reset_answers_ = {false}; });
  auto u = RunUpdate(vllm);
  ASSERT_TRUE(u.ok()) << u.status().ToString();
  EXPECT_EQ(u->outcome, lifecycle::UpdateOutcome::kTainted) << u->evidence.dump();
  EXPECT_EQ(c_->state(), lifecycle::State::kTainted);
  std::lock_guard<std::mutex> lock(vllm.mu_);
  EXPECT_GE(vllm.prefix_resets_, 5) << "retried";
}

TEST_F(VllmRunnerTest, InstallRefusedUntouchedLeavesTheOldVersionReady) {
  FakeVllm vllm;
  vllm.Script([&] { vllm.install_outcomes_ = {"refused_untouched"}; });
  auto u = RunUpdate(vllm);
  ASSERT_TRUE(u.ok()) << u.status().ToString();
  EXPECT_EQ(u->outcome, lifecycle::UpdateOutcome::kRejected);
  EXPECT_EQ(c_->state(), lifecycle::State::kReady);
  EXPECT_EQ(c_->version().label, "v7");
}

TEST(EngineUrlTest, ParsesFlavourPrefixes) {
  auto v = ParseEngineUrl("vllm+http://10.0.0.1:8000/");
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ(v->base_url, "http://10.0.0.1:8000");
  EXPECT_EQ(v->flavor, EngineFlavor::kVllm);
  auto r = ParseEngineUrl("rolloutcore+http://h:1");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->flavor, EngineFlavor::kRolloutcore);
  auto p = ParseEngineUrl("http://h:2");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->flavor, EngineFlavor::kUnknown);
  for (const char* bad : {"vllm://h:1", "h:1", "vllm+http://", "sglang+http://h:1"}) {
    auto b = ParseEngineUrl(bad);
    EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(b.status().message().find(bad), std::string::npos);
  }
}

TEST(EngineUrlTest, AVllmUrlThatAnswersAsRolloutcoreIsRefused) {
  httplib::Server svr;
  svr.Get("/rc/engine/state", [](const httplib::Request&, httplib::Response& r) {
    r.set_content(R"({"num_running":0,"num_waiting":0})", "application/json");
  });
  int port = svr.bind_to_any_port("127.0.0.1");
  std::thread t([&] { svr.listen_after_bind(); });
  while (!svr.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  HttpAdapterOptions o;
  o.base_url = "http://127.0.0.1:" + std::to_string(port);
  o.expected_flavor = EngineFlavor::kVllm;
  HttpEngineAdapter a(o);
  auto d = a.Describe();
  svr.stop();
  t.join();
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(d.status().message().find("rolloutcore engine"), std::string::npos) << d.status().message();
}

TEST(HttpAdapterVllmTest, UnreachableEngineIsUnavailableNamingTheUrl) {
  HttpEngineAdapter a(Options("http://127.0.0.1:1"));
  auto d = a.Describe();
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(d.status().message().find("127.0.0.1:1"), std::string::npos);
}

TEST(PrometheusTest, ParsesSamples) {
  std::string text = "# TYPE a gauge\na{x=\"1\"} 2\na{x=\"2\"} 3.5\nab 100\n";
  EXPECT_DOUBLE_EQ(PrometheusValue(text, "a").value(), 5.5);
  EXPECT_DOUBLE_EQ(PrometheusValue(text, "ab").value(), 100);
  EXPECT_EQ(PrometheusValue(text, "zz").status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace rc::adapters

namespace rc::adapters {
namespace {

// Policy modes on vLLM: abort maps to /pause?mode=abort; keep and recompute are refused with an
// error that names the mode and why (vLLM reports no per-request swap index), before any call.
TEST(HttpAdapterVllmTest, PolicyModesMapAbortAndRefuseKeepAndRecompute) {
  FakeVllm vllm;
  HttpEngineAdapter a(Options(vllm.url()));
  ASSERT_TRUE(a.Describe().ok());
  EXPECT_TRUE(a.SupportsPolicyMode(lifecycle::PolicyMode::kStrict).ok());
  EXPECT_TRUE(a.SupportsPolicyMode(lifecycle::PolicyMode::kAbort).ok());
  for (auto m : {lifecycle::PolicyMode::kKeep, lifecycle::PolicyMode::kRecompute}) {
    Status s = a.SupportsPolicyMode(m);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.code(), StatusCode::kUnimplemented);
    EXPECT_NE(s.message().find("'" + std::string(lifecycle::PolicyModeName(m)) + "'"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("vLLM"), std::string::npos);
    auto p = Await(a.PauseForUpdate(m));
    EXPECT_FALSE(p.ok());
  }
  {
    std::lock_guard<std::mutex> lock(vllm.mu_);
    EXPECT_TRUE(vllm.pause_queries_.empty()) << "a refused mode never pauses vLLM";
  }
  auto p = Await(a.PauseForUpdate(lifecycle::PolicyMode::kAbort));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_TRUE(p->paused);
  EXPECT_EQ(p->detail["policy_mode"], "abort");
  std::lock_guard<std::mutex> lock(vllm.mu_);
  ASSERT_EQ(vllm.pause_queries_.size(), 1u);
  EXPECT_EQ(vllm.pause_queries_[0], "mode=abort&clear_cache=false");
}

// ---- vLLM's own transfer (--vllm-transfer native-nccl) --------------------------------------

// The trainer's NativeSender (python/rolloutcore/vllm_native.py) as its HTTP protocol: state,
// update_info, init, send. /send waits (up to 2 s) for vLLM's /update_weights to have arrived,
// as a broadcast waits for its peers; FakeVllm's /update_weights waits for the send likewise, so
// an adapter that ran the two halves one after the other fails.
class FakeSender {
 public:
  explicit FakeSender(FakeVllm* vllm) : vllm_(vllm) {
    svr_.Get("/rc/native/state", [this](const httplib::Request&, httplib::Response& r) {
      r.set_content(Json{{"ok", true},
                         {"joined", joined.load()},
                         {"master_address", "127.0.0.1"},
                         {"master_port", 29555},
                         {"versions", {"v8"}}}
                        .dump(),
                    "application/json");
    });
    svr_.Get(R"(/rc/native/versions/([^/]+)/update_info)", [](const httplib::Request& q, httplib::Response& r) {
      if (q.matches[1] != "v8") {
        r.status = 404;
        r.set_content(R"({"ok":false,"code":"NotFound","error":"version not offered"})", "application/json");
        return;
      }
      r.set_content(Json{{"ok", true},
                         {"version", "v8"},
                         {"bytes", 96},
                         {"update_info",
                          {{"names", {"a.weight", "b.weight"}},
                           {"dtype_names", {"bfloat16", "bfloat16"}},
                           {"shapes", {{4, 8}, {16}}},
                           {"packed", false}}}}
                        .dump(),
                    "application/json");
    });
    // Like the rendezvous, the sender's init waits (up to 5 s) for vLLM's side to join.
    svr_.Post("/rc/native/init", [this](const httplib::Request& q, httplib::Response& r) {
      {
        std::lock_guard<std::mutex> lock(mu);
        init_bodies.push_back(Json::parse(q.body));
      }
      for (int i = 0; i < 5000 && !vllm_->wt_group_; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (!vllm_->wt_group_) {
        r.status = 500;
        r.set_content(R"({"ok":false,"code":"Unavailable","error":"rendezvous: vLLM never joined"})",
                      "application/json");
        return;
      }
      joined = true;
      r.set_content(R"({"ok":true,"init_ms":1})", "application/json");
    });
    svr_.Post("/rc/native/send", [this](const httplib::Request& q, httplib::Response& r) {
      {
        std::lock_guard<std::mutex> lock(mu);
        send_bodies.push_back(Json::parse(q.body));
      }
      for (int i = 0; i < 2000 && !vllm_->update_arrived_; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (!vllm_->update_arrived_ || fail_send) {
        joined = false;
        r.status = 500;
        r.set_content(R"({"ok":false,"code":"Unavailable","error":"broadcast: peer never joined"})",
                      "application/json");
        return;
      }
      vllm_->sender_sent_ = true;
      r.set_content(R"({"ok":true,"version":"v8","tensors":2,"bytes":96,"send_ms":1})", "application/json");
    });
    port_ = svr_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { svr_.listen_after_bind(); });
    while (!svr_.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ~FakeSender() {
    svr_.stop();
    thread_.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }

  std::mutex mu;
  std::vector<Json> init_bodies;  // guarded by mu
  std::vector<Json> send_bodies;  // guarded by mu
  std::atomic<bool> joined{false};
  std::atomic<bool> fail_send{false};

 private:
  FakeVllm* vllm_;
  httplib::Server svr_;
  std::thread thread_;
  int port_ = 0;
};

HttpAdapterOptions NativeOptions(const std::string& url, const std::string& sender) {
  HttpAdapterOptions o = Options(url);
  o.vllm.native_transfer = true;
  o.vllm.native_trainer_url = sender;
  o.vllm.native_timeout_ms = 3000;
  return o;
}

lifecycle::UpdateTarget NativeTarget(const std::string& digest = "0123456789abcdef") {
  lifecycle::UpdateTarget t = Target();
  t.identity.content_digest = digest;
  return t;
}

std::vector<std::string> WtCalls(FakeVllm& vllm) {
  std::lock_guard<std::mutex> lock(vllm.mu_);
  return vllm.wt_calls_;
}

TEST(HttpAdapterVllmNativeTest, RunsInitStartConcurrentSendAndUpdateFinishThenAdoptsByProof) {
  FakeVllm vllm;
  FakeSender sender(&vllm);
  HttpEngineAdapter a(NativeOptions(vllm.url(), sender.url()));
  ASSERT_TRUE(a.Describe().ok());
  auto st = Await(a.Stage(NativeTarget()));
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  EXPECT_EQ(st->bytes, 96);
  EXPECT_EQ(st->detail["transfer"], "vllm_native_nccl");
  EXPECT_EQ(RpcCount(vllm, "rc_stage"), 0) << "nothing to prefetch: the bytes move inside vLLM's session";
  ASSERT_TRUE(Await(a.Pause(lifecycle::PauseMode::kWait)).ok());
  auto inst = Await(a.Install(NativeTarget(), false));
  ASSERT_TRUE(inst.ok()) << inst.status().ToString();
  EXPECT_EQ(inst->outcome, lifecycle::InstallOutcome::kInstalled) << inst->error;
  EXPECT_EQ(inst->label, "v8");
  EXPECT_EQ(WtCalls(vllm), (std::vector<std::string>{"init", "start", "update", "finish", "rc_adopt"}));
  {
    std::lock_guard<std::mutex> lock(vllm.mu_);
    ASSERT_EQ(vllm.init_infos_.size(), 1u);
    EXPECT_EQ(vllm.init_infos_[0]["master_port"], 29555) << "the sender's rendezvous";
    EXPECT_EQ(vllm.init_infos_[0]["rank_offset"], 1) << "the sender is rank 0";
    EXPECT_EQ(vllm.init_infos_[0]["world_size"], 2) << "the sender plus one worker";
    EXPECT_EQ(vllm.update_infos_[0]["names"][1], "b.weight") << "the sender's update_info, passed through";
    const Json& adopt = vllm.rpc_calls_.back();
    EXPECT_EQ(adopt["method"], "rc_adopt");
    EXPECT_EQ(adopt["kwargs"]["content_digest"], "0123456789abcdef") << "the manifest's digest";
    EXPECT_EQ(adopt["kwargs"]["specs"][0], Json::array({"a.weight", "bfloat16", {4, 8}}));
  }
  {
    std::lock_guard<std::mutex> lock(sender.mu);
    ASSERT_EQ(sender.init_bodies.size(), 1u);
    EXPECT_EQ(sender.init_bodies[0]["world_size"], 2);
    ASSERT_EQ(sender.send_bodies.size(), 1u);
    EXPECT_EQ(sender.send_bodies[0]["version"], "v8");
  }
  ASSERT_TRUE(Await(a.ResetCache(lifecycle::CacheKind::kPrefix)).ok());
  auto label = Await(a.ReadLabel());
  ASSERT_TRUE(label.ok()) << label.status().ToString();
  EXPECT_EQ(label->label, "v8") << "set by rc_adopt, only because the digest matched";
  auto digest = Await(a.ReadContentDigest());
  ASSERT_TRUE(digest.ok()) << digest.status().ToString();
  EXPECT_EQ(digest->content_digest, "0123456789abcdef");
  ASSERT_TRUE(Await(a.Resume()).ok());
  // The next update on the same vLLM boot, with the sender still joined: no second init.
  vllm.sender_sent_ = false;
  vllm.update_arrived_ = false;
  ASSERT_TRUE(a.Describe().ok());
  ASSERT_TRUE(Await(a.Pause(lifecycle::PauseMode::kWait)).ok());
  inst = Await(a.Install(NativeTarget(), false));
  ASSERT_TRUE(inst.ok() && inst->outcome == lifecycle::InstallOutcome::kInstalled) << inst->error;
  EXPECT_EQ(WtCalls(vllm), (std::vector<std::string>{"init", "start", "update", "finish", "rc_adopt", "start", "update",
                                                     "finish", "rc_adopt"}));
}

TEST(HttpAdapterVllmNativeTest, AFailureAfterStartIsFailedAfterMutationAndLeavesNoSession) {
  FakeVllm vllm;
  FakeSender sender(&vllm);
  vllm.Script([&] { vllm.update_failure_ = "broadcast of a.weight failed"; });
  HttpEngineAdapter a(NativeOptions(vllm.url(), sender.url()));
  ASSERT_TRUE(a.Describe().ok());
  auto inst = Await(a.Install(NativeTarget(), false));
  ASSERT_TRUE(inst.ok()) << inst.status().ToString();
  EXPECT_EQ(inst->outcome, lifecycle::InstallOutcome::kFailedAfterMutation);
  EXPECT_NE(inst->error.find("broadcast of a.weight failed"), std::string::npos) << inst->error;
  EXPECT_NE(inst->error.find("[sender update_info ok, POST /init_weight_transfer_engine ok, sender init ok, POST "
                             "/start_weight_update ok, POST /update_weights FAILED, sender send ok]"),
            std::string::npos)
      << inst->error;
  // vLLM reset its session: the finish is refused, rc_native_state(restore) finalizes, a fresh
  // digest says what the weights are.
  EXPECT_EQ(WtCalls(vllm), (std::vector<std::string>{"init", "start", "update", "finish", "rc_native_state(restore)"}));
  EXPECT_EQ(inst->detail["cleanup"]["native_state"][0]["after"]["session_active"], false);
  EXPECT_EQ(inst->detail["cleanup"]["live_digest"], "0123456789abcdef");
  std::lock_guard<std::mutex> lock(vllm.mu_);
  EXPECT_FALSE(vllm.wt_session_);
  EXPECT_EQ(vllm.rpc_calls_.back()["method"], "rc_digest");
  EXPECT_EQ(vllm.rpc_calls_.back()["kwargs"]["fresh"], true);
}

TEST(HttpAdapterVllmNativeTest, ADigestThatIsNotTheManifestsIsNeverLabelled) {
  FakeVllm vllm;
  FakeSender sender(&vllm);
  vllm.Script([&] { vllm.live_digest_ = "00000000deadbeef"; });  // what vLLM's transfer really installed
  HttpEngineAdapter a(NativeOptions(vllm.url(), sender.url()));
  ASSERT_TRUE(a.Describe().ok());
  auto inst = Await(a.Install(NativeTarget("0123456789abcdef"), false));
  ASSERT_TRUE(inst.ok()) << inst.status().ToString();
  EXPECT_EQ(inst->outcome, lifecycle::InstallOutcome::kFailedAfterMutation);
  EXPECT_NE(inst->error.find("rc_adopt"), std::string::npos) << inst->error;
  EXPECT_NE(inst->error.find("00000000deadbeef"), std::string::npos) << inst->error;
  EXPECT_NE(inst->label, "v8");
  auto label = Await(a.ReadLabel());
  ASSERT_TRUE(label.ok());
  EXPECT_EQ(label->label, "v7") << "rc_adopt refused: the label is not the target's";
  std::lock_guard<std::mutex> lock(vllm.mu_);
  EXPECT_FALSE(vllm.wt_session_) << "the session was finished before the proof";
}

TEST(HttpAdapterVllmNativeTest, FailuresBeforeStartAreRefusalsWithNothingTouched) {
  {  // the sender is unreachable
    FakeVllm vllm;
    HttpEngineAdapter a(NativeOptions(vllm.url(), "http://127.0.0.1:1"));
    ASSERT_TRUE(a.Describe().ok());
    auto inst = Await(a.Install(NativeTarget(), false));
    ASSERT_TRUE(inst.ok()) << inst.status().ToString();
    EXPECT_EQ(inst->outcome, lifecycle::InstallOutcome::kRefusedUntouched);
    EXPECT_NE(inst->error.find("refused before start_weight_update"), std::string::npos) << inst->error;
    EXPECT_NE(inst->error.find("http://127.0.0.1:1/rc/native/state"), std::string::npos) << inst->error;
    EXPECT_TRUE(WtCalls(vllm).empty());
    // In a recovery a refusal is an error (the Runner taints).
    EXPECT_FALSE(Await(a.Install(NativeTarget(), true)).ok());
  }
  {  // the sender does not offer the version
    FakeVllm vllm;
    FakeSender sender(&vllm);
    HttpEngineAdapter a(NativeOptions(vllm.url(), sender.url()));
    ASSERT_TRUE(a.Describe().ok());
    lifecycle::UpdateTarget t = NativeTarget();
    t.label = "v9";
    auto inst = Await(a.Install(t, false));
    ASSERT_TRUE(inst.ok()) << inst.status().ToString();
    EXPECT_EQ(inst->outcome, lifecycle::InstallOutcome::kRefusedUntouched);
    EXPECT_NE(inst->error.find("version not offered"), std::string::npos) << inst->error;
    EXPECT_TRUE(WtCalls(vllm).empty());
    // No manifest digest: nothing could prove the weights, so nothing starts.
    inst = Await(a.Install(NativeTarget(""), false));
    ASSERT_TRUE(inst.ok());
    EXPECT_EQ(inst->outcome, lifecycle::InstallOutcome::kRefusedUntouched);
    EXPECT_TRUE(WtCalls(vllm).empty());
  }
  {  // vLLM without --weight-transfer-config: init refuses, nothing starts
    FakeVllm::Config cfg;
    cfg.weight_transfer = false;
    FakeVllm vllm(cfg);
    FakeSender sender(&vllm);
    HttpAdapterOptions o = NativeOptions(vllm.url(), sender.url());
    o.vllm.native_timeout_ms = 10000;
    HttpEngineAdapter a(o);
    ASSERT_TRUE(a.Describe().ok());
    const auto t0 = std::chrono::steady_clock::now();
    auto inst = Await(a.Install(NativeTarget(), false));
    ASSERT_TRUE(inst.ok()) << inst.status().ToString();
    EXPECT_EQ(inst->outcome, lifecycle::InstallOutcome::kRefusedUntouched) << inst->error;
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(4000))
        << "vLLM refused its half: the sender's rendezvous (waiting 5 s here) gets a short grace, not the join "
           "deadline, so the refusal lands inside the install deadline";
    EXPECT_NE(inst->error.find("--weight-transfer-config"), std::string::npos) << inst->error;
    EXPECT_EQ(WtCalls(vllm), (std::vector<std::string>{"init"}));
  }
  {  // the group formed outside the controller (--vllm-native-init external) on a vLLM without the config
    FakeVllm::Config cfg;
    cfg.weight_transfer = false;
    FakeVllm vllm(cfg);
    FakeSender sender(&vllm);
    HttpAdapterOptions o = NativeOptions(vllm.url(), sender.url());
    o.vllm.native_init = false;
    HttpEngineAdapter a(o);
    ASSERT_TRUE(a.Describe().ok());
    auto inst = Await(a.Install(NativeTarget(), false));
    ASSERT_TRUE(inst.ok()) << inst.status().ToString();
    EXPECT_EQ(inst->outcome, lifecycle::InstallOutcome::kRefusedUntouched) << inst->error;
    EXPECT_NE(inst->error.find("Weight transfer not configured"), std::string::npos) << inst->error;
    EXPECT_EQ(WtCalls(vllm), (std::vector<std::string>{"start"}));
  }
}

TEST(HttpAdapterVllmNativeTest, ASenderThatFailsMidSendTaintsAndTheNextUpdateFormsTheGroupAgain) {
  FakeVllm vllm;
  FakeSender sender(&vllm);
  HttpEngineAdapter a(NativeOptions(vllm.url(), sender.url()));
  ASSERT_TRUE(a.Describe().ok());
  sender.fail_send = true;  // e.g. a NCCL error on the trainer's side: it leaves the group
  auto inst = Await(a.Install(NativeTarget(), false));
  ASSERT_TRUE(inst.ok()) << inst.status().ToString();
  EXPECT_EQ(inst->outcome, lifecycle::InstallOutcome::kFailedAfterMutation) << inst->error;
  EXPECT_NE(inst->error.find("peer never joined"), std::string::npos) << inst->error;
  sender.fail_send = false;
  vllm.update_arrived_ = false;
  vllm.sender_sent_ = false;
  ASSERT_TRUE(a.Describe().ok());
  inst = Await(a.Install(NativeTarget(), true));  // the recovery re-installs through the same session
  ASSERT_TRUE(inst.ok()) << inst.status().ToString();
  EXPECT_EQ(inst->outcome, lifecycle::InstallOutcome::kInstalled) << inst->error;
  std::lock_guard<std::mutex> lock(sender.mu);
  EXPECT_EQ(sender.init_bodies.size(), 2u) << "the sender left the group: it is formed again";
}

// Through the real Controller and Runner: the native session commits only by rc_adopt's proof.
class VllmNativeRunnerTest : public ::testing::Test {
 protected:
  Result<lifecycle::UpdateRecord> RunNative(FakeVllm& vllm, const std::string& sender_url) {
    adapter_ = std::make_unique<HttpEngineAdapter>(NativeOptions(vllm.url(), sender_url));
    c_ = std::move(lifecycle::Controller::Open(SystemClock::Default(), &journal_)).value();
    RC_RETURN_IF_ERROR(c_->Initialize({"v7", 3}, {"", "", "", 0}));
    lifecycle::RunnerOptions ro;
    ro.deadlines.reset_ms = 2000;
    runner_ = std::make_unique<lifecycle::Runner>(c_.get(), adapter_.get(), SystemClock::Default(), ro);
    RC_RETURN_IF_ERROR(runner_->StartUpdate(NativeTarget()).status());
    return runner_->RunToCompletion();
  }
  lifecycle::MemoryJournal journal_;
  std::unique_ptr<HttpEngineAdapter> adapter_;
  std::unique_ptr<lifecycle::Controller> c_;
  std::unique_ptr<lifecycle::Runner> runner_;
};

TEST_F(VllmNativeRunnerTest, AnUpdateCommitsWithTheLabelRcAdoptProved) {
  FakeVllm vllm;
  FakeSender sender(&vllm);
  auto u = RunNative(vllm, sender.url());
  ASSERT_TRUE(u.ok()) << u.status().ToString();
  EXPECT_EQ(u->outcome, lifecycle::UpdateOutcome::kCommitted) << u->evidence.dump();
  EXPECT_EQ(c_->version().label, "v8");
  const Json& inst = u->evidence["install_complete"]["detail"];
  EXPECT_EQ(inst["transfer"], "vllm_native_nccl") << inst.dump();
  EXPECT_EQ(inst["adopt"][0]["outcome"], "installed");
  EXPECT_EQ(u->evidence["staged"]["engine"]["transfer"], "vllm_native_nccl");
  EXPECT_EQ(u->evidence["validated"]["digest_checked"], true);
  EXPECT_EQ(WtCalls(vllm), (std::vector<std::string>{"init", "start", "update", "finish", "rc_adopt"}));
  std::lock_guard<std::mutex> lock(vllm.mu_);
  EXPECT_EQ(vllm.prefix_resets_, 1) << "the cache boundary as on the rolloutcore path";
}

TEST_F(VllmNativeRunnerTest, AnUnprovenTransferTaints) {
  {
    FakeVllm vllm;
    FakeSender sender(&vllm);
    vllm.Script([&] { vllm.live_digest_ = "00000000deadbeef"; });
    auto u = RunNative(vllm, sender.url());
    ASSERT_TRUE(u.ok()) << u.status().ToString();
    EXPECT_EQ(u->outcome, lifecycle::UpdateOutcome::kTainted) << u->evidence.dump();
    EXPECT_EQ(c_->state(), lifecycle::State::kTainted);
    EXPECT_NE(u->reason.find("rc_adopt"), std::string::npos) << u->reason;
  }
}

TEST_F(VllmNativeRunnerTest, AnUnreachableSenderIsRejectedWithNothingTouched) {
  {
    FakeVllm vllm;
    auto u = RunNative(vllm, "http://127.0.0.1:1");
    ASSERT_TRUE(u.ok()) << u.status().ToString();
    EXPECT_EQ(u->outcome, lifecycle::UpdateOutcome::kRejected) << u->evidence.dump();
    EXPECT_EQ(c_->state(), lifecycle::State::kReady);
    EXPECT_EQ(c_->version().label, "v7");
    EXPECT_TRUE(WtCalls(vllm).empty());
  }
}

}  // namespace
}  // namespace rc::adapters
