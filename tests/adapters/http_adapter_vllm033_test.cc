// vLLM 0.33 against FakeVllm (tests/testing/fake_vllm.h with version "0.33.0"), beside 0.26: the
// release read from GET /version, vLLM's own label set while paused and required at VALIDATING,
// weight_versions turned into version spans, keep and recompute, the 503 of a paused 0.33, and
// the engine registry. Each difference between the releases is tested for both.
#include <gtest/gtest.h>

#include <memory>
#include <mutex>

#include "rolloutcore/adapters/http_adapter.h"
#include "rolloutcore/adapters/registry.h"
#include "rolloutcore/base/json.h"
#include "rolloutcore/lifecycle/runner.h"
#include "testing/fake_vllm.h"

namespace rc::adapters {
namespace {

using rc::testing::FakeVllm;
using lifecycle::PolicyMode;

FakeVllm::Config Release(const std::string& version) {
  FakeVllm::Config c;
  c.version = version;
  c.install_reports_digest = true;
  return c;
}

HttpAdapterOptions Options(const std::string& url) {
  HttpAdapterOptions o;
  o.base_url = url;
  o.directory_url = "http://127.0.0.1:8200";
  o.model = "tiny";
  o.expected_flavor = EngineFlavor::kVllm;
  o.vllm.reset_backoff_ms = 1;
  return o;
}

template <typename T>
Result<T> Await(Pending<T> p) {
  if (!p.WaitFor(std::chrono::seconds(10))) return DeadlineExceeded("test wait");
  return p.Get();
}

lifecycle::UpdateTarget Target(const std::string& label = "v8", PolicyMode mode = PolicyMode::kStrict) {
  lifecycle::UpdateTarget t;
  t.label = label;
  t.mode = mode;
  t.identity.content_digest = "0123456789abcdef";
  return t;
}

// A controller on the journal in memory, at v7 generation 3, and its runner over `adapter`.
struct RunnerRig {
  explicit RunnerRig(HttpEngineAdapter* adapter)
      : c(std::move(lifecycle::Controller::Open(SystemClock::Default(), &journal)).value()) {
    EXPECT_TRUE(c->Initialize({"v7", 3}, {"", "", "", 0}).ok());
    lifecycle::RunnerOptions ro;
    ro.deadlines.reset_ms = 2000;
    runner = std::make_unique<lifecycle::Runner>(c.get(), adapter, SystemClock::Default(), ro);
  }
  Result<lifecycle::UpdateRecord> Update(const lifecycle::UpdateTarget& t) {
    RC_RETURN_IF_ERROR(runner->StartUpdate(t));
    return runner->RunToCompletion();
  }
  lifecycle::MemoryJournal journal;
  std::unique_ptr<lifecycle::Controller> c;
  std::unique_ptr<lifecycle::Runner> runner;
};

TEST(VllmReleaseTest, SupportedReleasesAreReadAndOthersRefusedNamingBoth) {
  for (const char* v : {"0.26.0", "0.33.0"}) {
    FakeVllm vllm(Release(v));
    HttpEngineAdapter a(Options(vllm.url()));
    auto d = a.Describe();
    ASSERT_TRUE(d.ok()) << v << ": " << d.status().ToString();
    EXPECT_EQ(d->version, v);
  }
  FakeVllm other(Release("0.30.1"));
  HttpEngineAdapter refused(Options(other.url()));
  auto d = refused.Describe();
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kFailedPrecondition);
  for (const char* want : {"0.30.1", "0.26.x", "0.33.x", "--vllm-allow-untested-version"}) {
    EXPECT_NE(d.status().message().find(want), std::string::npos) << d.status().message();
  }
  {
    std::lock_guard<std::mutex> lock(other.mu_);
    EXPECT_TRUE(other.rpc_calls_.empty()) << "refused before anything is asked of the workers";
  }
  HttpAdapterOptions o = Options(other.url());
  o.vllm.allow_untested_version = true;
  HttpEngineAdapter allowed(o);
  ASSERT_TRUE(allowed.Describe().ok());
  auto label = Await(allowed.ReadLabel());
  ASSERT_TRUE(label.ok()) << label.status().ToString();
  EXPECT_EQ(label->detail["vllm_version"], "0.30.1");
  EXPECT_EQ(label->detail["vllm_version_untested"], true) << "journaled with every validation";
}

TEST(VllmReleaseTest, TheReleaseIsPartOfTheIdentity) {
  FakeVllm a26(Release("0.26.0"));
  HttpEngineAdapter a(Options(a26.url()));
  auto id = Await(a.ProbeIdentity());
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  EXPECT_NE(id->boot_id.find("vllm=0.26.0"), std::string::npos) << id->boot_id;
}

TEST(Vllm033Test, TheLabelIsSetWhilePausedAndCheckedAtValidation) {
  FakeVllm vllm(Release("0.33.0"));
  HttpEngineAdapter a(Options(vllm.url()));
  ASSERT_TRUE(a.Describe().ok());
  {
    std::lock_guard<std::mutex> lock(vllm.mu_);
    EXPECT_EQ(vllm.weight_version_, "v7") << "an unlabelled vLLM ('default') gets the workers' label";
  }
  ASSERT_TRUE(Await(a.Pause(lifecycle::PauseMode::kWait)).ok());
  auto inst = Await(a.Install(Target(), false));
  ASSERT_TRUE(inst.ok()) << inst.status().ToString();
  EXPECT_EQ(inst->detail["vllm_weight_version_set"], "v8");
  auto label = Await(a.ReadLabel());
  ASSERT_TRUE(label.ok()) << label.status().ToString();
  EXPECT_EQ(label->label, "v8");
  EXPECT_EQ(label->detail["vllm_weight_version"], "v8");
  EXPECT_EQ(label->detail["extension_label"], "v8");

  // vLLM that does not take the label: VALIDATING refuses, naming both.
  vllm.Script([&] { vllm.ignore_weight_version_ = true; });
  ASSERT_TRUE(Await(a.Install(Target("v9"), false)).ok());
  auto bad = Await(a.ReadLabel());
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(bad.status().message().find("'v8'"), std::string::npos) << bad.status().message();
  EXPECT_NE(bad.status().message().find("'v9'"), std::string::npos) << bad.status().message();
  // The identity probe names vLLM's label too (the monitor taints on it).
  auto id = Await(a.ProbeIdentity());
  ASSERT_TRUE(id.ok());
  EXPECT_NE(id->label, "v9");
  EXPECT_NE(id->label.find("weight_info"), std::string::npos) << id->label;
}

TEST(Vllm033Test, On026NoLabelRouteIsCalled) {
  FakeVllm vllm(Release("0.26.0"));
  HttpEngineAdapter a(Options(vllm.url()));
  ASSERT_TRUE(a.Describe().ok());
  ASSERT_TRUE(Await(a.Install(Target(), false)).ok());
  auto label = Await(a.ReadLabel());
  ASSERT_TRUE(label.ok()) << label.status().ToString();
  EXPECT_FALSE(label->detail.contains("vllm_weight_version"));
  std::lock_guard<std::mutex> lock(vllm.mu_);
  EXPECT_TRUE(vllm.weight_version_calls_.empty());
}

// A request that reaches a paused vLLM: 0.33 paused by /pause (wait/abort) turns it away with 503
// (a rollout fails, Unavailable, and is never served later under other weights); 0.26 queues it,
// and so does /sleep?level=0 on both (checked on the H200). keep queues on both.
TEST(Vllm033Test, ARequestWhilePausedIs503On033AndQueuedOn026) {
  for (const char* v : {"0.26.0", "0.33.0"}) {
    for (bool via_sleep : {false, true}) {
      FakeVllm vllm(Release(v));
      HttpAdapterOptions o = Options(vllm.url());
      o.vllm.pause_via_sleep = via_sleep;
      HttpEngineAdapter a(o);
      ASSERT_TRUE(a.Describe().ok());
      auto complete = a.Completer();
      ASSERT_TRUE(Await(a.Pause(lifecycle::PauseMode::kWait)).ok()) << v;
      auto r = complete(Json{{"prompt", {1, 2, 3}}, {"max_tokens", 4}, {"request_id", "r1"}});
      if (std::string(v) == "0.33.0" && !via_sleep) {  // /sleep?level=0 queues on 0.33 too
        ASSERT_FALSE(r.ok()) << v;
        EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
        EXPECT_NE(r.status().message().find("503"), std::string::npos) << r.status().message();
      } else {
        EXPECT_TRUE(r.ok()) << v << ": " << r.status().ToString();
      }
      auto resumed = Await(a.Resume());
      ASSERT_TRUE(resumed.ok()) << v << " sleep=" << via_sleep << ": " << resumed.status().ToString();
      EXPECT_FALSE(resumed->paused_after);
      EXPECT_TRUE(complete(Json{{"prompt", {1, 2, 3}}, {"max_tokens", 4}, {"request_id", "r2"}}).ok());
    }
  }
}

TEST(Vllm033Test, RolloutsAskForWeightVersionsAndGetThemAsSpans) {
  FakeVllm vllm(Release("0.33.0"));
  HttpEngineAdapter a(Options(vllm.url()));
  ASSERT_TRUE(a.Describe().ok());
  auto complete = a.Completer();
  auto r = complete(Json{{"prompt", {1, 2, 3}}, {"max_tokens", 5}, {"request_id", "r1"}, {"cache_salt", "u"}});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const Json& spans = (*r)["choices"][0]["version_spans"];
  ASSERT_EQ(spans.size(), 1u) << r->dump();
  EXPECT_EQ(spans[0]["label"], "v7");
  EXPECT_EQ(spans[0]["from_token"], 0);
  EXPECT_EQ(spans[0]["to_token"], 5);
  EXPECT_EQ(spans[0]["reported_by_engine"], true);
  {
    std::lock_guard<std::mutex> lock(vllm.mu_);
    const Json& sent = vllm.completion_bodies_.back();
    EXPECT_EQ(sent["return_weight_versions"], true);
    EXPECT_EQ(sent["cache_salt"], "rc:v7:u") << "prefix blocks keyed by the version it is sent under";
  }
  // vLLM answering without them: the span the controller refuses, never "no spans".
  vllm.Script([&] { vllm.weight_versions_ = Json(); });
  Json stripped;
  {
    // A 0.33 whose answer lacks weight_versions (e.g. a proxy dropped the field).
    FakeVllm bare(Release("0.33.0"));
    HttpEngineAdapter b(Options(bare.url()));
    ASSERT_TRUE(b.Describe().ok());
    bare.Script([&] { bare.weight_versions_ = Json::array(); });
    auto empty = b.Completer()(Json{{"prompt", {1}}, {"max_tokens", 2}, {"request_id", "r2"}});
    ASSERT_TRUE(empty.ok());
    EXPECT_TRUE((*empty)["choices"][0]["version_spans"].empty()) << "an empty list stays empty";
  }
}

// A restarted controller takes update requests and rollouts before its first update describes the
// engine: the release is read on demand, so keep is offered and rollouts carry their spans.
TEST(Vllm033Test, BeforeAnyDescribeTheReleaseIsReadOnDemand) {
  FakeVllm vllm(Release("0.33.0"));
  vllm.Script([&] { vllm.weight_version_ = "v7"; });
  HttpEngineAdapter a(Options(vllm.url()));
  EXPECT_TRUE(a.SupportsPolicyMode(PolicyMode::kKeep).ok());
  auto r = a.Completer()(Json{{"prompt", {1}}, {"max_tokens", 3}, {"request_id", "r1"}});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ((*r)["choices"][0]["version_spans"][0]["label"], "v7");
  std::lock_guard<std::mutex> lock(vllm.mu_);
  EXPECT_EQ(vllm.completion_bodies_.back()["return_weight_versions"], true);
  EXPECT_EQ(vllm.completion_bodies_.back()["cache_salt"], "rc:v7");
}

TEST(Vllm033Test, KeepAndRecomputeRunOn033OnlyWithTheWorkersSwapIndex) {
  {
    FakeVllm old(Release("0.26.0"));
    HttpEngineAdapter a(Options(old.url()));
    ASSERT_TRUE(a.Describe().ok());
    for (auto m : {PolicyMode::kKeep, PolicyMode::kRecompute}) {
      Status s = a.SupportsPolicyMode(m);
      EXPECT_EQ(s.code(), StatusCode::kUnimplemented);
      EXPECT_NE(s.message().find("0.26.0"), std::string::npos) << s.message();
      EXPECT_NE(s.message().find("0.33"), std::string::npos) << s.message();
    }
  }
  for (auto mode : {PolicyMode::kKeep, PolicyMode::kRecompute}) {
    FakeVllm vllm(Release("0.33.0"));
    vllm.Script([&] {
      vllm.frozen_ = Json::array({Json{{"request_id", "cmpl-ro-1-0-1a2b3c4d"}, {"output_tokens", 40}},
                                  Json{{"request_id", "cmpl-other"}, {"output_tokens", 3}}});
      vllm.reset_answers_ = {mode == PolicyMode::kRecompute};  // keep: refused (blocks held)
    });
    vllm.running_ = 2;
    HttpEngineAdapter a(Options(vllm.url()));
    ASSERT_TRUE(a.Describe().ok());
    ASSERT_TRUE(a.SupportsPolicyMode(mode).ok());
    auto p = Await(a.PauseForUpdate(mode));
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    EXPECT_EQ(p->running, 2) << "the frozen requests are reported, not hidden";
    ASSERT_EQ(p->detail["frozen"].size(), 2u) << p->detail.dump();
    EXPECT_EQ(p->detail["frozen"][0]["rollout_id"], "ro-1");
    EXPECT_TRUE(p->detail["frozen"][1]["rollout_id"].is_null());
    ASSERT_TRUE(Await(a.Install(Target("v8", mode), false)).ok());
    auto reset = Await(a.ResetCache(lifecycle::CacheKind::kPrefix));
    ASSERT_TRUE(reset.ok()) << reset.status().ToString();
    {
      std::lock_guard<std::mutex> lock(vllm.mu_);
      EXPECT_EQ(vllm.pause_queries_.back(), "mode=keep&clear_cache=false");
      EXPECT_EQ(vllm.reset_running_requests_, mode == PolicyMode::kRecompute ? "true" : "");
    }
    if (mode == PolicyMode::kRecompute) {
      EXPECT_TRUE(reset->success);
      EXPECT_TRUE(reset->isolation.empty());
    } else {
      EXPECT_FALSE(reset->success) << "recorded as refused, never as cleared";
      EXPECT_EQ(reset->attempts, 1);
      EXPECT_NE(reset->isolation.find("cache_salt"), std::string::npos) << reset->isolation;
      EXPECT_TRUE(reset->done());
    }
    ASSERT_TRUE(Await(a.Resume()).ok());
    // The rollout's answer: vLLM's spans, the swap index the worker reported, the kv of the mode.
    vllm.Script([&] {
      vllm.weight_versions_ = Json::array({Json{{"version", "v7"}, {"start", 0}, {"end", 40}},
                                           Json{{"version", "v8"}, {"start", 40}, {"end", 64}}});
    });
    auto r = a.Completer()(Json{{"prompt", {1, 2}}, {"max_tokens", 64}, {"request_id", "ro-1"}});
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    const Json& spans = (*r)["choices"][0]["version_spans"];
    ASSERT_EQ(spans.size(), 2u);
    EXPECT_EQ(spans[0]["kv"], "fresh");
    EXPECT_EQ(spans[1]["kv"], mode == PolicyMode::kRecompute ? "recomputed" : "stale");
    EXPECT_EQ(spans[1]["swap_index_reported"], 40);
    {
      std::lock_guard<std::mutex> lock(vllm.mu_);
      EXPECT_EQ(vllm.completion_bodies_.back()["cache_salt"], "rc:v8");
    }
    // A rollout the worker did not report as frozen gets no swap index (the controller refuses it).
    auto other = a.Completer()(Json{{"prompt", {1, 2}}, {"max_tokens", 64}, {"request_id", "ro-2"}});
    ASSERT_TRUE(other.ok());
    EXPECT_TRUE((*other)["choices"][0]["version_spans"][1]["swap_index_reported"].is_null());
  }
}

TEST(Vllm033Test, AnUpdateThroughTheRunnerJournalsBothLabelsAndTaintsWhenVllmDoesNotTakeIt) {
  for (bool ignore : {false, true}) {
    FakeVllm vllm(Release("0.33.0"));
    vllm.Script([&] { vllm.ignore_weight_version_ = ignore; });
    HttpEngineAdapter adapter(Options(vllm.url()));
    RunnerRig rig(&adapter);
    auto u = rig.Update(Target());
    ASSERT_TRUE(u.ok()) << u.status().ToString();
    if (!ignore) {
      ASSERT_EQ(u->outcome, lifecycle::UpdateOutcome::kCommitted) << u->evidence.dump();
      EXPECT_EQ(u->evidence["validated"]["label_evidence"]["vllm_weight_version"], "v8") << u->evidence.dump();
      std::lock_guard<std::mutex> lock(vllm.mu_);
      EXPECT_EQ(vllm.weight_version_, "v8");
    } else {
      EXPECT_EQ(rig.c->state(), lifecycle::State::kTainted) << u->evidence.dump();
    }
  }
}

// A vLLM whose engine core rc_install can reach (TP=1), and an adapter that folds into it.
FakeVllm::Config Reachable(const std::string& release) {
  FakeVllm::Config c = Release(release);
  c.engine_side = true;
  return c;
}

HttpAdapterOptions Folding(const std::string& url) {
  HttpAdapterOptions o = Options(url);
  o.vllm.fold_engine_calls = true;
  return o;
}

// --vllm-fold-engine-calls: inside the pause, rc_install(atomic=True) also resets vLLM's caches
// and sets 0.33's label; the adapter then sends no /reset_prefix_cache, /reset_mm_cache,
// /reset_encoder_cache or /update_weight_version, and the lifecycle's evidence says who did.
TEST(VllmFoldTest, AnUpdateFoldsTheResetsAndTheLabelIntoTheInstallCall) {
  for (const char* release : {"0.33.0", "0.26.0"}) {
    FakeVllm vllm(Reachable(release));
    HttpEngineAdapter adapter(Folding(vllm.url()));
    RunnerRig rig(&adapter);
    auto u = rig.Update(Target());
    ASSERT_TRUE(u.ok()) << u.status().ToString();
    ASSERT_EQ(u->outcome, lifecycle::UpdateOutcome::kCommitted) << release << " " << u->evidence.dump();
    const std::string ev = u->evidence.dump();
    EXPECT_NE(ev.find("\"folded\":true"), std::string::npos) << ev;
    std::lock_guard<std::mutex> lock(vllm.mu_);
    EXPECT_EQ(vllm.engine_side_installs_, 1) << release;
    EXPECT_EQ(vllm.prefix_resets_, 0) << release << ": the reset ran inside rc_install";
    EXPECT_TRUE(vllm.other_resets_.empty()) << release;
    bool atomic_sent = false;
    for (const Json& call : vllm.rpc_calls_) {
      if (call.value("method", std::string()) == "rc_install") atomic_sent = call["kwargs"].value("atomic", false);
    }
    EXPECT_TRUE(atomic_sent) << release;
    if (std::string(release) == "0.33.0") {
      // vLLM's label came from the install call, not /update_weight_version, and VALIDATING read it.
      EXPECT_EQ(vllm.weight_version_, "v8");
      // Only Describe's (the fake starts unlabelled, "default": it is given the workers' v7).
      EXPECT_EQ(vllm.weight_version_calls_, std::vector<std::string>{"v7"});
      EXPECT_EQ(u->evidence["validated"]["label_evidence"]["vllm_weight_version"], "v8") << ev;
    }
  }
}

TEST(VllmFoldTest, OutOfReachOrKeepModeMakesTheSeparateCalls) {
  // The engine core out of reach (rc_describe says so): not even asked.
  {
    FakeVllm vllm(Release("0.33.0"));  // engine_side false
    HttpEngineAdapter a(Folding(vllm.url()));
    ASSERT_TRUE(a.Describe().ok());
    ASSERT_TRUE(Await(a.Pause(lifecycle::PauseMode::kWait)).ok());
    auto inst = Await(a.Install(Target(), false));
    ASSERT_TRUE(inst.ok()) << inst.status().ToString();
    EXPECT_EQ(inst->outcome, lifecycle::InstallOutcome::kInstalled);
    EXPECT_FALSE(inst->detail.contains("engine_side")) << inst->detail.dump();
    auto reset = Await(a.ResetCache(lifecycle::CacheKind::kPrefix));
    ASSERT_TRUE(reset.ok() && reset->success);
    EXPECT_EQ(reset->attempts, 1);
    std::lock_guard<std::mutex> lock(vllm.mu_);
    EXPECT_EQ(vllm.prefix_resets_, 1);
    EXPECT_EQ(vllm.engine_side_installs_, 0);
    for (const Json& call : vllm.rpc_calls_) EXPECT_FALSE(call["kwargs"].value("atomic", false)) << call.dump();
  }
  // Reachable at Describe, refused at the install (a request in flight): installed the usual way,
  // the refusal recorded, the separate calls made.
  {
    FakeVllm vllm(Reachable("0.33.0"));
    HttpEngineAdapter a(Folding(vllm.url()));
    ASSERT_TRUE(a.Describe().ok());
    ASSERT_TRUE(Await(a.Pause(lifecycle::PauseMode::kWait)).ok());
    vllm.running_ = 1;
    auto inst = Await(a.Install(Target(), false));
    vllm.running_ = 0;
    ASSERT_TRUE(inst.ok()) << inst.status().ToString();
    EXPECT_EQ(inst->outcome, lifecycle::InstallOutcome::kInstalled);
    EXPECT_EQ(inst->detail["engine_side"]["folded"], false) << inst->detail.dump();
    EXPECT_NE(inst->detail["engine_side"]["why"].get<std::string>().find("not idle"), std::string::npos);
    EXPECT_EQ(inst->detail["vllm_weight_version_set"], "v8");
    auto reset = Await(a.ResetCache(lifecycle::CacheKind::kPrefix));
    ASSERT_TRUE(reset.ok() && reset->success);
    std::lock_guard<std::mutex> lock(vllm.mu_);
    EXPECT_EQ(vllm.prefix_resets_, 1);
    EXPECT_EQ(vllm.engine_side_installs_, 0);
    EXPECT_EQ(vllm.weight_version_calls_.back(), "v8");
  }
  // keep: the frozen requests' reset is the adapter's own (refused, then isolated): not folded.
  {
    FakeVllm vllm(Reachable("0.33.0"));
    HttpEngineAdapter a(Folding(vllm.url()));
    ASSERT_TRUE(a.Describe().ok());
    ASSERT_TRUE(Await(a.PauseForUpdate(PolicyMode::kKeep)).ok());
    auto inst = Await(a.Install(Target("v8", PolicyMode::kKeep), false));
    ASSERT_TRUE(inst.ok()) << inst.status().ToString();
    EXPECT_FALSE(inst->detail.contains("engine_side")) << inst->detail.dump();
    std::lock_guard<std::mutex> lock(vllm.mu_);
    EXPECT_EQ(vllm.engine_side_installs_, 0);
  }
}

TEST(VllmFoldTest, AFoldedResetThatFailsIsAFailureAfterMutation) {
  FakeVllm vllm(Reachable("0.33.0"));
  vllm.Script([&] { vllm.reset_answers_ = {false}; });
  HttpEngineAdapter a(Folding(vllm.url()));
  ASSERT_TRUE(a.Describe().ok());
  ASSERT_TRUE(Await(a.Pause(lifecycle::PauseMode::kWait)).ok());
  auto inst = Await(a.Install(Target(), false));
  // Not "refused": the weights changed and the cache was not reset; the lifecycle taints on it.
  ASSERT_FALSE(inst.ok());
  EXPECT_EQ(inst.status().code(), StatusCode::kInternal) << inst.status().ToString();
  EXPECT_NE(inst.status().message().find("failed_after_mutation"), std::string::npos) << inst.status().message();
}

TEST(VllmRequestIdTest, RolloutIdsAreReadBackFromVllmsInternalIds) {
  // Through the keep path's frozen list (the function itself is internal): see
  // KeepAndRecomputeRunOn033OnlyWithTheWorkersSwapIndex; here the registry.
  EngineSpec spec;
  spec.url = "grpc://127.0.0.1:1";
  auto bad = MakeEngine(spec);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  for (const char* want : {"grpc://127.0.0.1:1", "vllm+http", "rolloutcore+http", "embedded"}) {
    EXPECT_NE(bad.status().message().find(want), std::string::npos) << bad.status().message();
  }
  FakeVllm vllm(Release("0.33.0"));
  spec.url = "vllm+" + vllm.url();
  auto made = MakeEngine(spec);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  EXPECT_EQ(made->name, spec.url);
  auto d = made->adapter->Describe();
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->kind, "vllm");
  auto r = made->complete(Json{{"prompt", {1}}, {"max_tokens", 2}, {"request_id", "x"}});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE((*r)["choices"][0].contains("version_spans")) << "the registry's completer is the engine's";
}

}  // namespace
}  // namespace rc::adapters
