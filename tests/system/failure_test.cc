// Issue #6, "Failure": how the controller classifies engine and trainer failures, with the
// engine's test-only fault hooks (`engine serve --enable-fault-injection`, POST /rc/fault;
// docs/engine.md "Fault injection (tests only)").
//
// - The engine killed mid-install (the install has written the weights and its answer is held
//   back by `install_delay_ms`, then SIGKILL): TAINTED well within the install deadline + 100 ms
//   of the install's start; v1 is never reported committed nor served. Recovery from TAINTED
//   against the restarted engine re-installs a committed version and proves its digest.
// - The engine hung mid-install (SIGSTOP: the connection stays open, nothing answers): TAINTED
//   at the install deadline, within + 100 ms — the deadline itself is what gets there.
// - The install refused before mutation (`refuse_install`: 409, which the HTTP adapter maps to
//   FailedPrecondition, the contract for "nothing was touched"): READY on the old version.
// - A trainer that stops answering mid-pull (UCX over TCP, trainer SIGSTOPped): the staging runs
//   before anything live is touched (prefetch, in DRAINING), so the update is rejected at the
//   stage deadline and the engine stays READY on the old version; then SIGKILL.
#include "system/system_fixture.h"

namespace rc::system_test {
namespace {

using FailureTest = SystemTest;

// The journal's last begin_install and taint records.
struct InstallWindow {
  int64_t install_ms = -1, taint_ms = -1;
  std::string reason;
};
InstallWindow WindowOf(const std::vector<Json>& journal) {
  InstallWindow w;
  auto install = SystemTest::FindLast(journal, "begin_install");
  auto taint = SystemTest::FindLast(journal, "taint");
  if (install) w.install_ms = (*install)["t_ms"].get<int64_t>();
  if (taint) {
    w.taint_ms = (*taint)["t_ms"].get<int64_t>();
    w.reason = (*taint)["detail"].value("reason", std::string());
  }
  return w;
}

// v1 must never have been reported committed or served.
void ExpectNeverPublished(int ctl, const std::string& version, const std::string& old_label) {
  Json st = SystemTest::EngineStatus(ctl);
  EXPECT_EQ(st["label"], old_label);
  EXPECT_EQ(st["counters"]["updates_committed"], 0);
  for (const Json& r : SystemTest::Journal(ctl)) {
    std::string ev = r.value("event", std::string());
    EXPECT_FALSE((ev == "resumed" || ev == "recovered")) << "a commit was journaled: " << r.dump();
  }
  EXPECT_TRUE(SystemTest::Trajectories(ctl, version).empty());
  Reply refused = SystemTest::Rollout(ctl, Prompt(10, 9), 4);
  EXPECT_EQ(refused.status, 503) << "TAINTED admits nothing: " << refused.text;
}

TEST_F(FailureTest, EngineKilledMidInstallTaintsWithinTheDeadlineAndRecoveryProvesAVersion) {
  constexpr int64_t kInstallDeadline = 3000;
  StackOptions o;
  o.controller_args = {"--install-deadline-ms", std::to_string(kInstallDeadline)};
  Stack s = StartStack(o);
  ASSERT_FALSE(HasFailure());
  Json v1 = Step(s, "v1");
  SetFaults(s.engine, Json{{"install_delay_ms", 20000}});

  std::string id = RequestUpdate(s.ctl, "v1");
  ASSERT_TRUE(WaitState(s.ctl, "UPDATING", 30000, 1)) << StateOf(s.ctl);
  // The install call is in flight (its answer held back); kill the engine mid-way.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const int64_t kill_ms = NowMs();
  s.engine_proc->Kill();
  auto tainted_seen = WaitState(s.ctl, "TAINTED", kInstallDeadline + 5000, 1);
  ASSERT_TRUE(tainted_seen) << "still " << StateOf(s.ctl);
  Json update = WaitUpdate(s.ctl, id)["engines"][0];
  EXPECT_EQ(update["outcome"], "tainted");
  InstallWindow w = WindowOf(Journal(s.ctl));
  ASSERT_GE(w.install_ms, 0);
  ASSERT_GE(w.taint_ms, 0);
  EXPECT_LE(w.taint_ms - w.install_ms, kInstallDeadline + 100) << "TAINTED within the install deadline + 100 ms";
  EXPECT_LE(*tainted_seen - w.install_ms, kInstallDeadline + 100) << "as observed through /v1/status";
  EXPECT_GE(kill_ms, w.install_ms);
  Figure("engine_kill_to_tainted_ms", *tainted_seen - kill_ms);
  Figure("install_start_to_tainted_ms", w.taint_ms - w.install_ms);
  std::cout << "taint reason: " << w.reason << std::endl;
  ExpectNeverPublished(s.ctl, "v1", "v0");

  // Recovery: the engine restarts (same URL) from its v0 checkpoint; the controller re-installs
  // the committed v1 and proves its digest before anything is admitted again.
  StartEngine("engine-restarted", s.v0_dir, "v0", true, &s.engine_proc, s.engine);
  ASSERT_EQ(LiveDigest(s.engine), WaitCommitted(s.dir, "v0")["content_digest"]);
  Json rec = UpdateAndWait(s.ctl, "v1", /*recovery=*/true);
  ASSERT_EQ(rec.value("outcome", ""), "committed") << rec.dump();
  Json st = EngineStatus(s.ctl);
  EXPECT_EQ(st["state"], "READY");
  EXPECT_EQ(st["label"], "v1");
  EXPECT_EQ(st["generation"], 1);
  EXPECT_EQ(st["identity"]["content_digest"], v1["content_digest"]);
  EXPECT_EQ(LiveDigest(s.engine), v1["content_digest"]) << "the live weights are v1, byte for byte";
  EXPECT_TRUE(Find(Journal(s.ctl), "recovered").has_value());
  Reply r = Rollout(s.ctl, Prompt(10, 9), 4);
  ASSERT_EQ(r.status, 200) << r.text;
  EXPECT_EQ(r.json["binding"]["label"], "v1");
  EXPECT_EQ(r.json["choices"][0]["weight_version"], "v1");
  Figure("recovery_ms", rec["phases_ms"].value("RECOVERING", int64_t{0}));
}

TEST_F(FailureTest, RefusedInstallStaysReadyAndAHungInstallTaintsAtTheDeadline) {
  constexpr int64_t kInstallDeadline = 1500;
  StackOptions o;
  o.controller_args = {"--install-deadline-ms", std::to_string(kInstallDeadline)};
  Stack s = StartStack(o);
  ASSERT_FALSE(HasFailure());
  Json v0 = WaitCommitted(s.dir, "v0");
  Json v1 = Step(s, "v1");

  // Refused before mutation: READY on v0, engine resumed, serving v0.
  SetFaults(s.engine, Json{{"refuse_install", true}});
  Json refused = UpdateAndWait(s.ctl, "v1");
  EXPECT_EQ(refused["outcome"], "rejected") << refused.dump();
  EXPECT_NE(refused.value("reason", "").find("refused before mutation"), std::string::npos) << refused.dump();
  auto reject = FindLast(Journal(s.ctl), "reject_before_mutation");
  ASSERT_TRUE(reject);
  EXPECT_EQ((*reject)["from"], "UPDATING");
  EXPECT_EQ((*reject)["to"], "READY");
  Json st = EngineStatus(s.ctl);
  EXPECT_EQ(st["state"], "READY");
  EXPECT_EQ(st["label"], "v0");
  EXPECT_EQ(st["generation"], 0);
  EXPECT_EQ(LiveDigest(s.engine), v0["content_digest"]);
  Reply ok;
  for (int i = 0; i < 100 && ok.status != 200; ++i) {  // the best-effort resume is asynchronous
    ok = Rollout(s.ctl, Prompt(10, 1), 4);
    if (Call(s.engine, "GET", "/is_paused").value("is_paused", true)) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(ok.status, 200) << ok.text;
  EXPECT_EQ(ok.json["binding"]["label"], "v0");
  EXPECT_EQ(ok.json["choices"][0]["weight_version"], "v0");
  EXPECT_FALSE(Call(s.engine, "GET", "/is_paused").value("is_paused", true));

  // Hung mid-install: the engine stops (SIGSTOP) while the install call is in flight; nothing
  // answers and the connection stays open, so only the deadline can get the controller out.
  SetFaults(s.engine, Json{{"install_delay_ms", 10000}});
  std::string id = RequestUpdate(s.ctl, "v1");
  ASSERT_TRUE(WaitState(s.ctl, "UPDATING", 30000, 1)) << StateOf(s.ctl);
  ASSERT_TRUE(s.engine_proc->Freeze().ok());
  auto tainted_seen = WaitState(s.ctl, "TAINTED", kInstallDeadline + 5000, 1);
  s.engine_proc->Thaw();
  ASSERT_TRUE(tainted_seen) << "still " << StateOf(s.ctl);
  EXPECT_EQ(WaitUpdate(s.ctl, id)["engines"][0]["outcome"], "tainted");
  InstallWindow w = WindowOf(Journal(s.ctl));
  EXPECT_NE(w.reason.find("overran"), std::string::npos) << w.reason;
  EXPECT_GE(w.taint_ms - w.install_ms, kInstallDeadline) << "not before the deadline: nothing failed, it hung";
  EXPECT_LE(w.taint_ms - w.install_ms, kInstallDeadline + 100) << "TAINTED within the install deadline + 100 ms";
  EXPECT_LE(*tainted_seen - w.install_ms, kInstallDeadline + 100) << "as observed through /v1/status";
  Figure("hung_install_start_to_tainted_ms", w.taint_ms - w.install_ms);
  Figure("hung_install_start_to_tainted_observed_ms", *tainted_seen - w.install_ms);
  EXPECT_EQ(EngineStatus(s.ctl)["label"], "v0");
  EXPECT_EQ(EngineStatus(s.ctl)["counters"]["updates_committed"], 0);

  // Recovery to the old committed version, proven by its digest.
  SetFaults(s.engine, Json::object());
  Json rec = UpdateAndWait(s.ctl, "v0", /*recovery=*/true);
  ASSERT_EQ(rec.value("outcome", ""), "committed") << rec.dump();
  st = EngineStatus(s.ctl);
  EXPECT_EQ(st["state"], "READY");
  EXPECT_EQ(st["label"], "v0");
  EXPECT_EQ(st["generation"], 1);
  EXPECT_EQ(LiveDigest(s.engine), v0["content_digest"]);
  Reply r = Rollout(s.ctl, Prompt(10, 2), 4);
  ASSERT_EQ(r.status, 200) << r.text;
  EXPECT_EQ(r.json["choices"][0]["weight_version"], "v0");
}

// Issue 13 defect 9, across processes: the engine's install answer names its install_outcome.
// A real refusal (not paused) is 409 refused_untouched; a FailedPrecondition raised after rank 0
// wrote (fault hook) is failed_after_mutation, and the controller taints — it used to read the
// 409 such an error mapped to as "refused before mutation" and return to READY.
TEST_F(FailureTest, InstallFailingAfterTheFirstRankWroteTaints) {
  Stack s = StartStack();
  ASSERT_FALSE(HasFailure());
  Json v0 = WaitCommitted(s.dir, "v0");
  Step(s, "v1");
  ASSERT_EQ(Http(s.engine, "POST", "/rc/refit/stage",
                 Json{{"model", kModelName}, {"version", "v1"}, {"directory", Url(s.dir)}}).status, 200);
  Reply refused = Http(s.engine, "POST", "/rc/refit/install", Json{{"version", "v1"}});
  EXPECT_EQ(refused.status, 409) << refused.text;
  EXPECT_EQ(refused.json.value("install_outcome", ""), "refused_untouched") << refused.text;
  EXPECT_EQ(LiveDigest(s.engine), v0["content_digest"]);

  SetFaults(s.engine, Json{{"fail_install_after_first_rank", true}});
  Json failed = UpdateAndWait(s.ctl, "v1");
  EXPECT_EQ(failed["outcome"], "tainted") << failed.dump();
  EXPECT_NE(failed.value("reason", "").find("failed_after_mutation"), std::string::npos) << failed.dump();
  EXPECT_EQ(StateOf(s.ctl), "TAINTED");
  EXPECT_EQ(Rollout(s.ctl, Prompt(10, 3), 4).status, 503) << "a tainted engine admits nothing";
  SetFaults(s.engine, Json::object());
}

// Sets an environment variable for the life of the object (children inherit it at spawn).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = ::getenv(name)) old_ = old;
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST_F(FailureTest, TrainerThatStopsAnsweringMidPullLeavesTheEngineReadyOnTheOldVersion) {
  // Over UCX with TCP only, a get needs the owner's worker to make progress (TCP has no true
  // one-sided read), so a stopped trainer stalls the pull rather than failing it: the stage
  // deadline is what ends it. The trainer is stopped before the update is requested, so the
  // stall is deterministic: the engine's pull starts against an owner that never answers.
  ScopedEnv tls("UCX_TLS", "tcp");
  constexpr int64_t kStageDeadline = 2000;
  StackOptions o;
  o.transport = "ucx";
  o.controller_args = {"--stage-deadline-ms", std::to_string(kStageDeadline)};
  Stack s = StartStack(o);
  ASSERT_FALSE(HasFailure());
  Json v0 = WaitCommitted(s.dir, "v0");
  Json v1 = Step(s, "v1");

  // Stopped for certain before the stage (a signalled trainer may still serve reads for a while).
  ASSERT_TRUE(s.trainer_proc->Freeze().ok());
  Json update = UpdateAndWait(s.ctl, "v1");
  EXPECT_EQ(update["outcome"], "rejected") << update.dump();
  EXPECT_NE(update.value("reason", "").find("staging"), std::string::npos) << update.dump();
  std::vector<Json> j = Journal(s.ctl);
  auto request = FindLast(j, "request_update");
  auto reject = FindLast(j, "reject_before_mutation");
  ASSERT_TRUE(request && reject);
  EXPECT_EQ((*reject)["from"], "DRAINING") << "rejected before anything was paused or installed";
  int64_t took = (*reject)["t_ms"].get<int64_t>() - (*request)["t_ms"].get<int64_t>();
  // The stage starts while the directory resolves the request, before request_update is
  // journaled (Runner::Prefetch), and its deadline runs from there: a few ms before the record.
  EXPECT_GE(took, kStageDeadline - 100) << "the pull stalled (it did not fail fast): " << (*reject).dump();
  EXPECT_LE(took, kStageDeadline + 100) << "READY within the stage deadline + 100 ms";
  Figure("stalled_pull_request_to_ready_ms", took);
  EXPECT_FALSE(Find(j, "begin_install").has_value()) << "nothing live was touched";
  Json st = EngineStatus(s.ctl);
  EXPECT_EQ(st["state"], "READY");
  EXPECT_EQ(st["label"], "v0");
  Reply r = Rollout(s.ctl, Prompt(10, 3), 4);
  ASSERT_EQ(r.status, 200) << r.text;
  EXPECT_EQ(r.json["binding"]["label"], "v0");
  EXPECT_EQ(r.json["choices"][0]["weight_version"], "v0");

  // The trainer dies for good: the engine's abandoned pull fails, its live weights are v0.
  s.trainer_proc->Kill();
  EXPECT_EQ(LiveDigest(s.engine), v0["content_digest"]);
  EXPECT_EQ(EngineStatus(s.ctl)["state"], "READY");
}

}  // namespace
}  // namespace rc::system_test
