// ControllerService with real threads and SQLite state, over FakeEngine adapters and a
// completion function that reports the engine's live label, as the embedded engine does.
#include "rolloutcore/controller/service.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <filesystem>
#include <thread>

#include "controller/service_fixture.h"
#include "rolloutcore/controller/http_server.h"
#include "testing/fake_engine.h"

namespace rc::controller {
namespace {

namespace fs = std::filesystem;

using testing::Engines;  // the shared helpers of controller/service_fixture.h
using testing::Options;
using testing::StaticVersions;
using testing::TempDir;

TEST(ControllerServiceTest, RolloutsAreBoundAndUpdatesCommit) {
  auto dir = TempDir("basic");
  StaticVersions versions;
  Engines e;
  auto svc = std::move(ControllerService::Create(e.Make(1), &versions, Options(dir))).value();
  auto r1 = svc->Rollout(Json{{"prompt_token_ids", {1, 2, 3}}, {"max_tokens", 3}});
  ASSERT_TRUE(r1.ok()) << r1.status().ToString();
  EXPECT_EQ((*r1)["binding"]["label"], "v0");
  EXPECT_EQ((*r1)["binding"]["generation"], 0);
  EXPECT_EQ((*r1)["binding"]["identity"]["content_digest"], "d-v0");

  auto id = svc->RequestUpdate("m", "v1");
  ASSERT_TRUE(id.ok());
  auto done = svc->WaitForUpdate(*id, 10000);
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  EXPECT_EQ((*done)["outcome"], "committed") << done->dump();
  EXPECT_TRUE((*done)["engines"][0]["evidence"].contains("validated"));

  auto r2 = svc->Rollout(Json{{"prompt", {4, 5}}, {"rollout_id", "mine"}});
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ((*r2)["binding"]["label"], "v1");
  EXPECT_EQ((*r2)["binding"]["rollout_id"], "mine");
  EXPECT_EQ((*r2)["binding"]["identity"]["checkpoint"], "m@v1");

  auto v0 = svc->trajectories()->List("v0").value();
  auto v1 = svc->trajectories()->List("v1").value();
  ASSERT_EQ(v0.size(), 1u);
  ASSERT_EQ(v1.size(), 1u);
  EXPECT_EQ(v1[0].output_token_ids, (std::vector<int64_t>{5, 6, 7}));
  EXPECT_EQ(v1[0].engine_weight_version, "v1");
  EXPECT_EQ(v1[0].logprobs.size(), 3u);

  EXPECT_EQ(svc->RequestUpdate("m", "bogus").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(svc->Rollout(Json{{"max_tokens", 3}}).status().code(), StatusCode::kInvalidArgument);
  std::string metrics = svc->Metrics();
  EXPECT_NE(metrics.find("rolloutcore_updates_total{engine=\"fake-0\",outcome=\"committed\"} 1"), std::string::npos);
  fs::remove_all(dir);
}

// An engine name is the operator's text: a quote, a backslash or a newline in it stays inside the
// label value of its samples (escaped), so it cannot end the line and forge a sample.
TEST(ControllerServiceTest, MetricsEscapeEngineNamesInLabelValues) {
  auto dir = TempDir("metrics_escape");
  StaticVersions versions;
  Engines e;
  auto handles = e.Make(1);
  handles[0].name = "gpu\"0\\x\nrolloutcore_forged_total 1";
  auto svc = std::move(ControllerService::Create(std::move(handles), &versions, Options(dir))).value();
  const std::string metrics = svc->Metrics();
  EXPECT_NE(metrics.find("rolloutcore_admissions_total{engine=\"gpu\\\"0\\\\x\\nrolloutcore_forged_total 1\"} 0\n"),
            std::string::npos)
      << metrics;
  EXPECT_EQ(metrics.find("\nrolloutcore_forged_total"), std::string::npos) << metrics;
  fs::remove_all(dir);
}

// Issue 13 #14: inputs the engine would read differently are refused before admission, naming
// the field, and nothing is recorded for them.
TEST(ControllerServiceTest, RolloutInputsTheEngineWouldMisreadAreRefused) {
  auto dir = TempDir("inputs");
  StaticVersions versions;
  Engines e;
  auto svc = std::move(ControllerService::Create(e.Make(1), &versions, Options(dir))).value();
  struct Case {
    Json body;
    std::string field;
  } cases[] = {
      {Json{{"prompt_token_ids", "abc"}}, "prompt_token_ids:"},
      {Json{{"prompt_token_ids", Json::array()}}, "prompt_token_ids:"},
      {Json{{"prompt_token_ids", {1, "x"}}}, "prompt_token_ids[1]"},
      {Json{{"prompt", {{1, 2}, {3}}}}, "prompt[0]"},
      {Json{{"prompt", {1, 2}}, {"stream", true}}, "stream:"},
  };
  for (const auto& c : cases) {
    auto r = svc->Rollout(c.body);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << c.body.dump() << " -> " << r.status().ToString();
    EXPECT_NE(r.status().message().find(c.field), std::string::npos) << c.body.dump() << " -> " << r.status().message();
  }
  EXPECT_TRUE(svc->trajectories()->List("v0").value().empty()) << "nothing admitted, nothing stored";
  auto ok = svc->Rollout(Json{{"prompt", "text"}, {"stream", false}});
  EXPECT_TRUE(ok.ok()) << ok.status().ToString();
  fs::remove_all(dir);
}

TEST(ControllerServiceTest, LeaseModeAndRestartKeepState) {
  auto dir = TempDir("lease");
  StaticVersions versions;
  Engines e;
  {
    auto svc = std::move(ControllerService::Create(e.Make(1), &versions, Options(dir))).value();
    auto b = svc->Admit("lease-1");
    ASSERT_TRUE(b.ok());
    EXPECT_EQ((*b)["label"], "v0");
    ASSERT_TRUE(svc->FinishLease("lease-1", Json{{"token_ids", {9, 9}}, {"finish_reason", "stop"}}).ok());
    EXPECT_EQ(svc->FinishLease("lease-1", Json::object()).code(), StatusCode::kNotFound);
    ASSERT_TRUE(svc->Admit("lease-2").ok());  // still active at the "crash"
    auto id = svc->RequestUpdate("m", "v1");
    ASSERT_TRUE(id.ok());
    // lease-2 holds the drain; finish it so the update can commit.
    ASSERT_TRUE(svc->FinishLease("lease-2", Json{{"token_ids", {1}}}).ok());
    auto done = svc->WaitForUpdate(*id, 10000);
    ASSERT_TRUE(done.ok());
    EXPECT_EQ((*done)["outcome"], "committed");
    ASSERT_TRUE(svc->Admit("lease-3").ok());
  }
  // Restart on the same state dir (the engine kept v1): READY on v1, lease-3 interrupted,
  // trajectories kept.
  auto svc = std::move(ControllerService::Create(e.Make(1, "v1"), &versions, Options(dir))).value();
  auto st = svc->StatusJson();
  EXPECT_EQ(st["engines"][0]["state"], "READY");
  EXPECT_EQ(st["engines"][0]["label"], "v1");
  EXPECT_EQ(st["engines"][0]["counters"]["interrupted"], 1);
  EXPECT_EQ(svc->trajectories()->List("").value().size(), 2u);
  auto journal = svc->Journal(0, 0).value();
  bool interrupted = false;
  for (const auto& r : journal["records"]) interrupted = interrupted || (r["event"] == "interrupted" && r["rollout"] == "lease-3");
  EXPECT_TRUE(interrupted);
  // Its client finishing it now is told why there is no lease (lifecycle.md), not only that.
  const Status late = svc->FinishLease("lease-3", Json{{"token_ids", {1}}});
  EXPECT_EQ(late.code(), StatusCode::kNotFound);
  EXPECT_NE(late.message().find("recorded interrupted at a controller restart"), std::string::npos) << late.ToString();
  fs::remove_all(dir);
}

TEST(ControllerServiceTest, MaxUpdatingKeepsOtherEnginesServing) {
  auto dir = TempDir("multi");
  StaticVersions versions;
  Engines e;
  auto handles = e.Make(2);
  // Slow resumes so each update takes a while.
  for (auto& h : handles) {
    rc::testing::Fault slow;
    slow.kind = rc::testing::Fault::Kind::kDelay;
    slow.delay = std::chrono::milliseconds(150);
    static_cast<rc::testing::FaultInjectingAdapter*>(h.adapter.get())->Set("resume", slow);
  }
  auto svc = std::move(ControllerService::Create(std::move(handles), &versions, Options(dir))).value();
  auto id = svc->RequestUpdate("m", "v1");
  ASSERT_TRUE(id.ok());
  int served = 0, both_down = 0;
  for (int i = 0; i < 100; ++i) {
    auto st = svc->StatusJson();
    bool any_ready = st["engines"][0]["state"] == "READY" || st["engines"][1]["state"] == "READY";
    if (!any_ready) ++both_down;
    if (svc->Rollout(Json{{"prompt", {1}}}).ok()) ++served;
    std::this_thread::sleep_for(std::chrono::milliseconds(3));
  }
  auto done = svc->WaitForUpdate(*id, 10000);
  ASSERT_TRUE(done.ok());
  EXPECT_EQ((*done)["outcome"], "committed");
  EXPECT_EQ(both_down, 0) << "with --max-updating 1 one engine keeps serving";
  EXPECT_EQ(served, 100);
  fs::remove_all(dir);
}

// A requested version is staged while the directory resolves the request (Runner::Prefetch),
// on at most --max-updating idle engines, and the update adopts that stage: every engine stages
// the version once. A request the directory refuses stages ahead and installs nothing.
TEST(ControllerServiceTest, AVersionIsStagedWhileItsRequestResolvesAndOnlyOnce) {
  auto dir = TempDir("ahead");
  StaticVersions versions;
  versions.resolve_delay_ms = 200;  // long enough for the idle drivers to take the stage ahead
  Engines e;
  auto svc = std::move(ControllerService::Create(e.Make(2), &versions, Options(dir))).value();
  auto stages = [&](size_t i) { return e.fakes[i]->shared()->stages.load(); };
  auto done = svc->WaitForUpdate(svc->RequestUpdate("m", "v1").value(), 10000);
  ASSERT_TRUE(done.ok());
  EXPECT_EQ((*done)["outcome"], "committed") << done->dump();
  EXPECT_EQ(stages(0), 1) << "engine 0 staged ahead and its update adopted that stage";
  EXPECT_EQ(stages(1), 1) << "engine 1 (no update place at the request: --max-updating 1) staged at its turn";

  auto refused = svc->RequestUpdate("m", "x-2");
  EXPECT_EQ(refused.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(stages(0) + stages(1), 3) << "one engine (--max-updating 1) staged the refused version ahead";
  auto st = svc->StatusJson();
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(st["engines"][i]["state"], "READY");
    EXPECT_EQ(st["engines"][i]["label"], "v1") << "nothing installed the refused version";
  }
  // The next update stages its own version (the image staged ahead is dropped, not installed).
  done = svc->WaitForUpdate(svc->RequestUpdate("m", "v3").value(), 10000);
  ASSERT_TRUE(done.ok());
  EXPECT_EQ((*done)["outcome"], "committed") << done->dump();
  EXPECT_EQ(svc->StatusJson()["engines"][0]["label"], "v3");
  EXPECT_EQ(stages(0) + stages(1), 5);
  fs::remove_all(dir);
}

TEST(ControllerServiceTest, TaintedEngineRefusesRolloutsUntilRecovered) {
  auto dir = TempDir("taint");
  StaticVersions versions;
  Engines e;
  auto handles = e.Make(1);
  auto* faulty = static_cast<rc::testing::FaultInjectingAdapter*>(handles[0].adapter.get());
  rc::testing::Fault fail;
  fail.kind = rc::testing::Fault::Kind::kFailAfter;
  fail.code = StatusCode::kInternal;
  faulty->Set("install", fail);
  auto svc = std::move(ControllerService::Create(std::move(handles), &versions, Options(dir))).value();
  auto done = svc->WaitForUpdate(svc->RequestUpdate("m", "v1").value(), 10000);
  ASSERT_TRUE(done.ok());
  EXPECT_EQ((*done)["outcome"], "tainted");
  auto refused = svc->Rollout(Json{{"prompt", {1}}});
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable);
  faulty->Set("install", rc::testing::Fault{});
  auto rec = svc->WaitForUpdate(svc->RequestRecovery("m", "v0").value(), 10000);
  ASSERT_TRUE(rec.ok());
  EXPECT_EQ((*rec)["outcome"], "committed") << rec->dump();
  auto ok = svc->Rollout(Json{{"prompt", {1}}});
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ((*ok)["binding"]["label"], "v0");
  EXPECT_EQ((*ok)["binding"]["generation"], 1);
  fs::remove_all(dir);
}

// ---- Engine identity (issue 13, defects 1, 2, 7, 10) -------------------------------------------

bool WaitForState(ControllerService* svc, const std::string& state, int64_t timeout_ms) {
  auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < end) {
    if (svc->StatusJson()["engines"][0]["state"] == state) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return false;
}

std::string LastTaintReason(ControllerService* svc) {
  std::string reason;
  const Json journal = svc->Journal(0, 0).value();
  for (const auto& r : journal["records"]) {
    if (r["event"] == "taint") reason = r["detail"].value("reason", "");
  }
  return reason;
}

// A completion from an engine that restarted behind the controller (new boot id, back on its
// starting weights) is never returned or stored as bound, and the engine is tainted.
TEST(ControllerIdentityTest, CompletionFromARestartedEngineIsRefusedRecordedAndTaints) {
  auto dir = TempDir("id_completion");
  StaticVersions versions;
  Engines e;
  ServiceOptions o = Options(dir);
  o.verify_interval_ms = 0;  // only the completion can notice
  auto svc = std::move(ControllerService::Create(e.Make(1), &versions, o)).value();
  auto done = svc->WaitForUpdate(svc->RequestUpdate("m", "v1").value(), 10000);
  ASSERT_TRUE(done.ok());
  ASSERT_EQ((*done)["outcome"], "committed");
  ASSERT_TRUE(svc->Rollout(Json{{"prompt", {1}}, {"rollout_id", "before"}}).ok());

  e.fakes[0]->Restart();  // kill -9 and restart: v0 again, a new boot id
  auto r = svc->Rollout(Json{{"prompt", {1}}, {"rollout_id", "after"}});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find("label 'v0'"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("boot id"), std::string::npos) << r.status().message();
  EXPECT_EQ(svc->StatusJson()["engines"][0]["state"], "TAINTED");
  EXPECT_NE(LastTaintReason(svc.get()).find("rollout after"), std::string::npos) << LastTaintReason(svc.get());
  // Recorded failed with the reason, never as a bound rollout with output.
  auto rows = svc->trajectories()->List("v1").value();
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[1].binding.rollout_id, "after");
  EXPECT_EQ(rows[1].finish_reason, "identity_mismatch");
  EXPECT_TRUE(rows[1].output_token_ids.empty());
  EXPECT_NE(rows[1].extra.value("identity_mismatch", "").find("label 'v0'"), std::string::npos);
  for (const auto& t : rows) {
    if (!t.output_token_ids.empty()) {
      EXPECT_EQ(t.engine_weight_version, "v1") << t.binding.rollout_id;
    }
  }
  EXPECT_EQ(svc->StatusJson()["rollouts"]["identity_mismatch"], 1);
  EXPECT_NE(svc->Metrics().find("rolloutcore_rollouts_identity_mismatch_total 1"), std::string::npos);
  EXPECT_EQ(svc->Rollout(Json{{"prompt", {1}}}).status().code(), StatusCode::kUnavailable) << "nothing admitted";
  // Recovery re-installs the committed version and accepts the new boot id.
  auto rec = svc->WaitForUpdate(svc->RequestRecovery("m", "v1").value(), 10000);
  ASSERT_TRUE(rec.ok());
  EXPECT_EQ((*rec)["outcome"], "committed") << rec->dump();
  auto ok = svc->Rollout(Json{{"prompt", {1}}});
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ((*ok)["binding"]["label"], "v1");
  fs::remove_all(dir);
}

// The periodic check notices an engine restart with no rollout going on.
TEST(ControllerIdentityTest, PeriodicCheckTaintsARestartedEngine) {
  auto dir = TempDir("id_restart");
  StaticVersions versions;
  Engines e;
  ServiceOptions o = Options(dir);
  o.verify_interval_ms = 20;
  auto svc = std::move(ControllerService::Create(e.Make(1), &versions, o)).value();
  ASSERT_TRUE(svc->WaitForUpdate(svc->RequestUpdate("m", "v1").value(), 10000).ok());
  ASSERT_EQ(svc->StatusJson()["engines"][0]["label"], "v1");
  e.fakes[0]->Restart();
  ASSERT_TRUE(WaitForState(svc.get(), "TAINTED", 2000)) << svc->StatusJson().dump();
  std::string why = LastTaintReason(svc.get());
  EXPECT_NE(why.find("identity check"), std::string::npos) << why;
  EXPECT_NE(why.find("restarted"), std::string::npos) << why;
  EXPECT_NE(why.find("label 'v0'"), std::string::npos) << why;
  fs::remove_all(dir);
}

// Paused behind the controller's back (or by a pause that landed after its update was given up):
// READY would admit rollouts that hang. The periodic check taints it.
TEST(ControllerIdentityTest, PeriodicCheckTaintsAnEnginePausedWhileReady) {
  auto dir = TempDir("id_paused");
  StaticVersions versions;
  Engines e;
  ServiceOptions o = Options(dir);
  o.verify_interval_ms = 20;
  auto svc = std::move(ControllerService::Create(e.Make(1), &versions, o)).value();
  ASSERT_TRUE(svc->WaitForUpdate(svc->RequestUpdate("m", "v1").value(), 10000).ok());
  // Checks of a READY, running engine find nothing.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_EQ(svc->StatusJson()["engines"][0]["state"], "READY") << svc->StatusJson().dump();
  auto paused = e.fakes[0]->Pause(lifecycle::PauseMode::kAbort);  // not through the controller
  ASSERT_TRUE(paused.WaitFor(std::chrono::seconds(5)));
  ASSERT_TRUE(paused.Get().ok());
  ASSERT_TRUE(WaitForState(svc.get(), "TAINTED", 2000)) << svc->StatusJson().dump();
  const std::string why = LastTaintReason(svc.get());
  EXPECT_NE(why.find("paused while READY"), std::string::npos) << why;
  fs::remove_all(dir);
}

// Weights installed behind the controller's back, with the label faked to the committed one:
// the install generation (and the cached digest) give it away at the next check.
TEST(ControllerIdentityTest, InstallBehindTheBackWithAFakedLabelIsDetected) {
  auto dir = TempDir("id_behind");
  StaticVersions versions;
  Engines e;
  ServiceOptions o = Options(dir);
  o.verify_interval_ms = 20;
  auto svc = std::move(ControllerService::Create(e.Make(1), &versions, o)).value();
  ASSERT_TRUE(svc->Rollout(Json{{"prompt", {1}}}).ok());
  e.fakes[0]->InstallBehindTheBack("d-evil", "v0");
  ASSERT_TRUE(WaitForState(svc.get(), "TAINTED", 2000)) << svc->StatusJson().dump();
  std::string why = LastTaintReason(svc.get());
  EXPECT_NE(why.find("install generation moved 0 -> 1"), std::string::npos) << why;
  EXPECT_NE(why.find("d-evil"), std::string::npos) << why;
  EXPECT_EQ(svc->Rollout(Json{{"prompt", {1}}}).status().code(), StatusCode::kUnavailable);
  fs::remove_all(dir);
}

// With the periodic check off, a completion still catches the behind-the-back install.
TEST(ControllerIdentityTest, CompletionCatchesAnInstallBehindTheBack) {
  auto dir = TempDir("id_behind_completion");
  StaticVersions versions;
  Engines e;
  ServiceOptions o = Options(dir);
  o.verify_interval_ms = 0;
  auto svc = std::move(ControllerService::Create(e.Make(1), &versions, o)).value();
  e.fakes[0]->InstallBehindTheBack("d-evil", "v0");
  auto r = svc->Rollout(Json{{"prompt", {1}}});
  ASSERT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status().ToString();
  EXPECT_NE(r.status().message().find("install generation 1"), std::string::npos) << r.status().message();
  EXPECT_EQ(svc->StatusJson()["engines"][0]["state"], "TAINTED");
  fs::remove_all(dir);
}

// A restarted controller whose journal claims v1 while the engine serves v0 admits nothing.
TEST(ControllerIdentityTest, RestartWithAJournalClaimingAnotherLabelIsTaintedBeforeAdmitting) {
  auto dir = TempDir("id_claim");
  StaticVersions versions;
  Engines e;
  {
    auto svc = std::move(ControllerService::Create(e.Make(1), &versions, Options(dir))).value();
    ASSERT_TRUE(svc->WaitForUpdate(svc->RequestUpdate("m", "v1").value(), 10000).ok());
    ASSERT_EQ(svc->StatusJson()["engines"][0]["label"], "v1");
  }
  auto svc = std::move(ControllerService::Create(e.Make(1, "v0"), &versions, Options(dir))).value();
  EXPECT_EQ(svc->StatusJson()["engines"][0]["state"], "TAINTED") << "at once, before any admission";
  EXPECT_EQ(svc->Rollout(Json{{"prompt", {1}}}).status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(svc->StatusJson()["engines"][0]["counters"]["admissions"], 0);
  std::string why = LastTaintReason(svc.get());
  EXPECT_NE(why.find("journal claims label 'v1' (digest d-v1)"), std::string::npos) << why;
  EXPECT_NE(why.find("the engine reports label 'v0'"), std::string::npos) << why;
  EXPECT_NE(why.find("d-v0 != committed digest d-v1"), std::string::npos) << why;
  fs::remove_all(dir);
}

// Same label, other weights: the claim check reads the digest too.
TEST(ControllerIdentityTest, RestartWithTheRightLabelButOtherWeightsIsTainted) {
  auto dir = TempDir("id_claim_digest");
  StaticVersions versions;
  Engines e;
  {
    auto svc = std::move(ControllerService::Create(e.Make(1), &versions, Options(dir))).value();
    ASSERT_TRUE(svc->WaitForUpdate(svc->RequestUpdate("m", "v1").value(), 10000).ok());
  }
  auto handles = e.Make(1, "v1");
  e.fakes.back()->InstallBehindTheBack("d-other", "v1");
  auto svc = std::move(ControllerService::Create(std::move(handles), &versions, Options(dir))).value();
  EXPECT_EQ(svc->StatusJson()["engines"][0]["state"], "TAINTED");
  EXPECT_NE(LastTaintReason(svc.get()).find("d-other != committed digest d-v1"), std::string::npos);
  fs::remove_all(dir);
}

TEST(ControllerIdentityTest, RecoverOnAReadyEngineIsRefused) {
  auto dir = TempDir("id_recover_ready");
  StaticVersions versions;
  Engines e;
  auto svc = std::move(ControllerService::Create(e.Make(1), &versions, Options(dir))).value();
  auto r = svc->RequestRecovery("m", "v0");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("fake-0 is READY"), std::string::npos) << r.status().message();
  ControllerHttpServer server(svc.get(), "127.0.0.1", 0);
  ASSERT_TRUE(server.Start().ok());
  httplib::Client c("127.0.0.1", server.port());
  auto h = c.Post("/v1/recover", R"({"model":"m","version":"v0"})", "application/json");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 409) << h->body;
  EXPECT_EQ(svc->StatusJson()["engines"][0]["state"], "READY");
  server.Stop();
  fs::remove_all(dir);
}

// A request for a version that is live again answers the update that committed it, not an older
// one that failed on it; and a controller with --model refuses another model's versions (its
// engines would stage them as versions of --model).
TEST(ControllerServiceTest, ARepeatedRequestAnswersTheUpdateThatCommittedTheVersion) {
  auto dir = TempDir("repeat_committed");
  StaticVersions versions;
  Engines e;
  ServiceOptions o = Options(dir);
  o.model = "m";
  auto svc = std::move(ControllerService::Create(e.Make(1), &versions, o)).value();
  e.wrappers[0]->Set("install", rc::testing::Fault{rc::testing::Fault::Kind::kFailAfter});
  const std::string failed = svc->RequestUpdate("m", "v1").value();
  auto f = svc->WaitForUpdate(failed, 10000);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_NE((*f)["outcome"], "committed") << f->dump();
  e.wrappers[0]->Set("install", rc::testing::Fault{});
  auto recovery = svc->RequestRecovery("m", "v1");
  ASSERT_TRUE(recovery.ok()) << recovery.status().ToString();
  auto r = svc->WaitForUpdate(*recovery, 10000);
  ASSERT_TRUE(r.ok());
  ASSERT_EQ((*r)["outcome"], "committed") << r->dump();
  auto again = svc->RequestUpdate("m", "v1");
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(*again, *recovery) << "answered " << *again << ", the update that failed was " << failed;
  auto other = svc->RequestUpdate("other", "v1");
  EXPECT_EQ(other.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(other.status().message().find("'m' (--model), not 'other'"), std::string::npos) << other.status().ToString();
  fs::remove_all(dir);
}

// A read that fails in VALIDATING (the engine died or hung while its digest was read) taints the
// engine but says nothing against the version: it is not marked failed, and can be requested again.
TEST(ControllerServiceTest, AFailedDigestReadInValidationDoesNotMarkTheVersionFailed) {
  auto dir = TempDir("validate_call_failed");
  StaticVersions versions;
  Engines e;
  ServiceOptions o = Options(dir);
  o.model = "m";
  auto svc = std::move(ControllerService::Create(e.Make(1), &versions, o)).value();
  e.wrappers[0]->Set("digest", rc::testing::Fault{rc::testing::Fault::Kind::kFailBefore});
  auto f = svc->WaitForUpdate(svc->RequestUpdate("m", "v1").value(), 10000);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_EQ((*f)["outcome"], "tainted") << f->dump();
  EXPECT_EQ((*f)["engines"][0]["phase"], "TAINTED");
  e.wrappers[0]->Set("digest", rc::testing::Fault{});
  auto rec = svc->WaitForUpdate(svc->RequestRecovery("m", "v0").value(), 10000);
  ASSERT_TRUE(rec.ok());
  ASSERT_EQ((*rec)["outcome"], "committed") << rec->dump();
  auto again = svc->RequestUpdate("m", "v1");
  ASSERT_TRUE(again.ok()) << "the version was marked failed for the engine's fault: " << again.status().ToString();
  auto done = svc->WaitForUpdate(*again, 10000);
  ASSERT_TRUE(done.ok());
  EXPECT_EQ((*done)["outcome"], "committed") << done->dump();
  fs::remove_all(dir);
}

// A service with --auto-recover and a 20 ms identity check over `n` engines, updated to v1.
std::unique_ptr<ControllerService> AutoRecoverOnV1(Engines& e, StaticVersions& versions, const std::string& dir,
                                                   int n) {
  ServiceOptions o = Options(dir);
  o.verify_interval_ms = 20;
  o.auto_recover = true;
  o.model = "m";
  auto svc = std::move(ControllerService::Create(e.Make(n), &versions, o)).value();
  auto up = svc->WaitForUpdate(svc->RequestUpdate("m", "v1").value(), 10000);
  EXPECT_TRUE(up.ok() && (*up)["outcome"] == "committed") << (up.ok() ? up->dump() : up.status().ToString());
  return svc;
}

// --auto-recover with a rollout still active on the tainted engine: the recovery is refused while
// it is (a recovery waits for nothing), and asked for again until it is queued.
TEST(ControllerIdentityTest, AutoRecoverIsAskedAgainOnceTheActiveRolloutsEnded) {
  auto dir = TempDir("id_auto_active");
  StaticVersions versions;
  Engines e;
  auto svc = AutoRecoverOnV1(e, versions, dir, 1);
  auto lease = svc->Admit("held");
  ASSERT_TRUE(lease.ok()) << lease.status().ToString();
  e.fakes[0]->Restart();
  ASSERT_TRUE(WaitForState(svc.get(), "TAINTED", 2000)) << svc->StatusJson().dump();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // several refusals meanwhile
  EXPECT_EQ(svc->StatusJson()["engines"][0]["state"], "TAINTED");
  // Tainted while the lease was open: its output is not bound to v1, and is not stored as if it were.
  const Status finished = svc->FinishLease("held", Json{{"token_ids", {1}}, {"finish_reason", "stop"}});
  EXPECT_EQ(finished.code(), StatusCode::kFailedPrecondition) << finished.ToString();
  EXPECT_NE(finished.message().find("was tainted while the lease was open"), std::string::npos) << finished.ToString();
  auto rows = svc->trajectories()->List("v1").value();
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].finish_reason, "identity_mismatch");
  ASSERT_TRUE(WaitForState(svc.get(), "READY", 5000)) << svc->StatusJson().dump();
  EXPECT_EQ(svc->controller(0)->counters().recoveries, 1);
  EXPECT_EQ(svc->StatusJson()["engines"][0]["label"], "v1");
  fs::remove_all(dir);
}

// --auto-recover: an identity taint is followed by a recovery to the committed version.
TEST(ControllerIdentityTest, AutoRecoverReinstallsTheCommittedVersion) {
  auto dir = TempDir("id_auto");
  StaticVersions versions;
  Engines e;
  auto svc = AutoRecoverOnV1(e, versions, dir, 2);
  e.fakes[0]->Restart();  // only engine 0
  auto end = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (std::chrono::steady_clock::now() < end && svc->controller(0)->counters().recoveries == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(svc->controller(0)->counters().recoveries, 1) << svc->StatusJson().dump();
  ASSERT_TRUE(WaitForState(svc.get(), "READY", 2000));
  EXPECT_EQ(svc->StatusJson()["engines"][0]["label"], "v1");
  EXPECT_EQ(svc->StatusJson()["engines"][0]["generation"], 2);
  auto ok = svc->Rollout(Json{{"prompt", {1}}});
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ((*ok)["choices"][0]["weight_version"], "v1");
  // The auto-recovery is engine 0's alone: engine 1 kept serving and is not part of it.
  EXPECT_EQ(svc->StatusJson()["engines"][1]["state"], "READY");
  EXPECT_EQ(svc->controller(1)->counters().recoveries, 0);
  auto rec = svc->UpdateStatus("u-2");
  ASSERT_TRUE(rec.ok()) << rec.status().ToString();
  EXPECT_EQ((*rec)["recovery"], true);
  EXPECT_EQ((*rec)["outcome"], "committed") << rec->dump();
  EXPECT_EQ((*rec)["engines"].size(), 1u);
  fs::remove_all(dir);
}

TEST(ControllerHttpTest, EndpointsAndErrors) {
  auto dir = TempDir("http");
  StaticVersions versions;
  Engines e;
  auto svc = std::move(ControllerService::Create(e.Make(1), &versions, Options(dir))).value();
  ControllerHttpServer server(svc.get(), "127.0.0.1", 0);
  ASSERT_TRUE(server.Start().ok());
  httplib::Client c("127.0.0.1", server.port());
  auto r = c.Post("/v1/rollouts", R"({"prompt_token_ids":[1,2],"max_tokens":2})", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(Json::parse(r->body)["binding"]["label"], "v0");
  r = c.Post("/v1/rollouts", "{not json", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_NE(r->body.find("malformed"), std::string::npos);
  r = c.Post("/v1/updates", R"({"model":"m"})", "application/json");
  EXPECT_EQ(r->status, 400);
  EXPECT_NE(r->body.find("version"), std::string::npos);
  r = c.Post("/v1/updates", R"({"model":"m","version":"v1"})", "application/json");
  ASSERT_EQ(r->status, 202);
  std::string id = Json::parse(r->body)["id"];
  r = c.Get(("/v1/updates/" + id + "?wait_ms=10000").c_str());
  ASSERT_EQ(r->status, 200);
  EXPECT_EQ(Json::parse(r->body)["outcome"], "committed");
  r = c.Post("/v1/rollouts:admit", R"({"rollout_id":"L1"})", "application/json");
  ASSERT_EQ(r->status, 200);
  EXPECT_EQ(Json::parse(r->body)["label"], "v1");
  r = c.Post("/v1/rollouts/L1:finish", R"({"token_ids":[3]})", "application/json");
  EXPECT_EQ(r->status, 200);
  r = c.Get("/v1/trajectories?label=v1&format=jsonl");
  ASSERT_EQ(r->status, 200);
  EXPECT_NE(r->body.find("\"L1\""), std::string::npos);
  r = c.Get("/v1/journal?since=abc");
  EXPECT_EQ(r->status, 400);
  r = c.Get("/v1/updates/u-999");
  EXPECT_EQ(r->status, 404);
  r = c.Get("/metrics");
  EXPECT_NE(r->body.find("rolloutcore_admissions_total"), std::string::npos);
  server.Stop();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace rc::controller
