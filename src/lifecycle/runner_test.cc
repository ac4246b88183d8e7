// Runner in virtual time against the ScriptedEngine: each failure class lands where the
// contract says, within deadline + one poll.
#include "rolloutcore/lifecycle/runner.h"

#include <gtest/gtest.h>

#include "rolloutcore/lifecycle/scripted_engine.h"

namespace rc::lifecycle {
namespace {

class RunnerTest : public ::testing::Test {
 protected:
  void Build(ScriptedEngineConfig cfg, RunnerOptions opts = {}) {
    cfg.label = "rc-0";
    cfg.digest = "d0";
    engine_ = std::make_unique<ScriptedEngine>(&clock_, cfg);
    c_ = std::move(Controller::Open(&clock_, &journal_)).value();
    ASSERT_TRUE(c_->Initialize({"rc-0", 0}, {"d0", "", "", 0}).ok());
    runner_ = std::make_unique<Runner>(c_.get(), engine_.get(), &clock_, opts);
  }
  // Steps virtual time 1 ms at a time until the runner is idle; returns elapsed ms.
  int64_t Run(int64_t max_ms = 100000) {
    int64_t start = clock_.NowMs();
    while (runner_->Poll()) {
      clock_.AdvanceMs(1);
      for (const auto& id : engine_->Tick()) (void)c_->Finish(id);
      if (clock_.NowMs() - start > max_ms) break;
    }
    return clock_.NowMs() - start;
  }
  // An update whose install fails after mutation: the controller is TAINTED. Returns the target of
  // the recovery back to the version it started from.
  UpdateTarget TaintThenTargetBack() {
    EXPECT_TRUE(runner_->StartUpdate(Target()).ok());
    Run();
    EXPECT_EQ(c_->state(), State::kTainted);
    UpdateTarget back;
    back.label = "rc-0";
    back.identity.content_digest = "d0";
    return back;
  }
  static UpdateTarget Target() {
    UpdateTarget t;
    t.label = "rc-1";
    t.identity.content_digest = "d1";
    return t;
  }
  static ScriptedEngineConfig With(const std::string& op, const std::string& behavior, int64_t latency = 0) {
    ScriptedEngineConfig c;
    c.ops[op] = {OpScript{latency, behavior, 0}};
    return c;
  }

  ManualClock clock_;
  MemoryJournal journal_;
  std::unique_ptr<ScriptedEngine> engine_;
  std::unique_ptr<Controller> c_;
  std::unique_ptr<Runner> runner_;
};

TEST_F(RunnerTest, HappyPathCommitsAndResumes) {
  Build({});
  ASSERT_TRUE(runner_->StartUpdate(Target()).ok());
  Run();
  EXPECT_EQ(c_->state(), State::kReady);
  EXPECT_EQ(c_->version(), (WeightVersion{"rc-1", 1}));
  EXPECT_FALSE(engine_->paused());
  EXPECT_EQ(engine_->label(), "rc-1");
  auto u = c_->Update(1);
  ASSERT_TRUE(u);
  EXPECT_EQ(u->outcome, UpdateOutcome::kCommitted);
  // Evidence of every step was accepted and recorded.
  for (const char* ev : {"drain_complete", "begin_install", "install_complete", "caches_reset", "validated", "resumed"}) {
    EXPECT_TRUE(u->evidence.contains(ev)) << ev;
  }
  EXPECT_EQ(u->evidence["caches_reset"].size(), 3u);
  ASSERT_TRUE(u->evidence.contains("staged")) << "prefetch evidence is journaled too";
  EXPECT_EQ(u->evidence["staged"]["label"], "rc-1");
}

// A stage issued ahead of the request (Runner::Prefetch, while the directory resolves it) is the
// update's stage when the update is for the same label, model and ordinal: staged once, and the
// staged evidence is that call's. An update for another label drops it and stages its own; a
// prefetch while an update runs is refused.
TEST_F(RunnerTest, APrefetchedStageIsAdoptedByItsUpdateAndDroppedByAnother) {
  Build({});
  UpdateTarget ahead;
  ahead.label = "rc-1";
  ASSERT_TRUE(runner_->Prefetch(ahead).ok());
  EXPECT_FALSE(runner_->busy()) << "a prefetch is no operation: nothing is paused or journaled";
  EXPECT_EQ(c_->state(), State::kReady);
  clock_.AdvanceMs(3);
  engine_->Tick();  // the stage answers before the update starts: its answer is adopted too
  ASSERT_TRUE(runner_->StartUpdate(Target()).ok());
  Run();
  EXPECT_EQ(engine_->stage_calls(), (std::vector<std::string>{"rc-1"}));
  auto u = c_->Update(1);
  ASSERT_TRUE(u);
  EXPECT_EQ(u->outcome, UpdateOutcome::kCommitted);
  EXPECT_EQ(u->evidence["staged"]["label"], "rc-1");

  UpdateTarget other;
  other.label = "rc-9";
  ASSERT_TRUE(runner_->Prefetch(other).ok());
  UpdateTarget next = Target();
  next.label = "rc-2";
  next.identity.content_digest = "d2";
  ASSERT_TRUE(runner_->StartUpdate(next).ok());
  EXPECT_EQ(runner_->Prefetch(other).code(), StatusCode::kFailedPrecondition) << "an update is running";
  Run();
  EXPECT_EQ(engine_->stage_calls(), (std::vector<std::string>{"rc-1", "rc-9", "rc-2"}));
  u = c_->Update(2);
  ASSERT_TRUE(u);
  EXPECT_EQ(u->outcome, UpdateOutcome::kCommitted);
  EXPECT_EQ(u->evidence["staged"]["label"], "rc-2");
  EXPECT_EQ(engine_->label(), "rc-2");
}

// Probes resolved in the background (UpdateTarget::facts_fetch, issue 15): the drain does not
// complete before they are in, and the update uses them.
TEST_F(RunnerTest, ProbesFetchedInTheBackgroundAreTakenBeforeTheDrainCompletes) {
  Build({});
  UpdateTarget t = Target();
  Pending<VersionFacts> fetch;
  t.facts_fetch = fetch;
  ASSERT_TRUE(runner_->StartUpdate(t).ok());
  for (int i = 0; i < 50; ++i) {
    runner_->Poll();
    clock_.AdvanceMs(1);
    engine_->Tick();
  }
  EXPECT_EQ(c_->state(), State::kDraining) << "the drain waits for the probes";
  EXPECT_FALSE(engine_->paused());
  ReplayProbe p;
  p.name = "p0";
  p.prompt = {1, 2, 3};
  fetch.Fulfill(VersionFacts{{p}, {}});
  Run();
  EXPECT_EQ(c_->state(), State::kReady);
  EXPECT_EQ(c_->version().label, "rc-1");
  auto u = c_->Update(1);
  ASSERT_TRUE(u);
  // The scripted engine has no replay path: the probes are there, their replay is skipped for it.
  const std::string why = u->evidence["validated"]["replay"].value("reason", "");
  EXPECT_NE(why.find("offers no replay path"), std::string::npos) << u->evidence["validated"].dump();
}

// A probe fetch that failed rejects the update before the drain completes: nothing paused.
TEST_F(RunnerTest, FailedProbeFetchRejectsBeforeThePause) {
  Build({});
  UpdateTarget t = Target();
  t.facts_fetch = Pending<VersionFacts>::Completed(Unavailable("directory at http://d did not answer"));
  ASSERT_TRUE(runner_->StartUpdate(t).ok());
  Run();
  EXPECT_EQ(c_->state(), State::kReady);
  EXPECT_EQ(c_->version().label, "rc-0");
  EXPECT_FALSE(engine_->paused());
  auto u = c_->Update(1);
  ASSERT_TRUE(u);
  EXPECT_EQ(u->outcome, UpdateOutcome::kRejected);
  EXPECT_NE(u->reason.find("fetching the replay probes and FP8 images of rc-1 failed"), std::string::npos) << u->reason;
  EXPECT_FALSE(u->evidence.contains("begin_install"));
}

TEST_F(RunnerTest, HungInstallTaintsWithinDeadlinePlus100) {
  RunnerOptions o;
  o.deadlines.install_ms = 1000;
  Build(With("install", "hang"), o);
  ASSERT_TRUE(runner_->StartUpdate(Target()).ok());
  Run();
  EXPECT_EQ(c_->state(), State::kTainted);
  auto u = c_->Update(1);
  EXPECT_EQ(u->outcome, UpdateOutcome::kTainted);
  EXPECT_LE(u->phases_ms.at("UPDATING"), 1000 + 100);
  EXPECT_GE(u->phases_ms.at("UPDATING"), 1000);
  EXPECT_NE(u->reason.find("mutation may have begun"), std::string::npos);
}

// The journal refuses the taint (disk full, read-only): the state does not move (nothing is
// admitted), and the taint is written again until the journal takes it, not dropped.
TEST_F(RunnerTest, ATaintTheJournalRefusesIsWrittenAgainUntilItIsRecorded) {
  RunnerOptions o;
  o.deadlines.install_ms = 200;
  Build(With("install", "hang"), o);
  ASSERT_TRUE(runner_->StartUpdate(Target()).ok());
  Run(100);  // UPDATING, the install hanging
  ASSERT_EQ(c_->state(), State::kUpdating);
  journal_.FailAfter(0);  // every append fails from here
  Run(1000);
  EXPECT_EQ(c_->state(), State::kUpdating) << "the state moved without its record";
  EXPECT_TRUE(runner_->busy()) << "the taint was dropped";
  journal_.FailAfter(-1);  // writable again
  Run();
  EXPECT_EQ(c_->state(), State::kTainted);
  EXPECT_FALSE(runner_->busy());
  EXPECT_EQ(c_->Update(1)->outcome, UpdateOutcome::kTainted);
  bool retried = false;
  for (const auto& n : runner_->notes()) retried = retried || n.find("recorded after") != std::string::npos;
  EXPECT_TRUE(retried);
}

TEST_F(RunnerTest, InstallRefusedBeforeMutationReturnsToOldVersion) {
  Build(With("install", "fail_before_mutation", 10));
  ASSERT_TRUE(runner_->StartUpdate(Target()).ok());
  Run();
  for (int i = 0; i < 5; ++i) {  // let the best-effort resume land
    clock_.AdvanceMs(1);
    engine_->Tick();
    runner_->Poll();
  }
  EXPECT_EQ(c_->state(), State::kReady);
  EXPECT_EQ(c_->version().label, "rc-0");
  EXPECT_EQ(c_->Update(1)->outcome, UpdateOutcome::kRejected);
  EXPECT_FALSE(engine_->paused());
  EXPECT_TRUE(engine_->mutation_windows().empty());
}

TEST_F(RunnerTest, HungPauseIsRejectedNotTainted) {
  RunnerOptions o;
  o.deadlines.pause_ms = 300;
  Build(With("pause", "hang"), o);
  ASSERT_TRUE(runner_->StartUpdate(Target()).ok());
  int64_t elapsed = Run();
  EXPECT_EQ(c_->state(), State::kReady);
  EXPECT_EQ(c_->Update(1)->outcome, UpdateOutcome::kRejected);
  // The pause deadline, then one more for the hung pause to land (resumed again if it does).
  EXPECT_LE(elapsed, 2 * 300 + 100);
  EXPECT_TRUE(engine_->mutation_windows().empty());
  EXPECT_FALSE(engine_->paused());
}

// Given up after the pause: READY only once a resume answered that the engine runs again. A
// resume that fails leaves it paused, which READY would hide (every rollout admitted would hang):
// READY (the weights were never touched), then TAINTED naming why.
TEST_F(RunnerTest, AGivenUpUpdateIsReadyOnlyAfterTheResumeAnswered) {
  Build(With("install", "fail_before_mutation", 10));
  ASSERT_TRUE(runner_->StartUpdate(Target()).ok());
  Run();
  EXPECT_EQ(c_->state(), State::kReady);
  EXPECT_EQ(c_->Update(1)->outcome, UpdateOutcome::kRejected);
  EXPECT_FALSE(engine_->paused()) << "READY on a paused engine";
}

TEST_F(RunnerTest, AGivenUpUpdateWhoseResumeFailsIsTaintedNotLeftReadyAndPaused) {
  ScriptedEngineConfig c = With("install", "fail_before_mutation", 10);
  c.ops["resume"] = {OpScript{5, "fail", 0}};
  Build(c);
  ASSERT_TRUE(runner_->StartUpdate(Target()).ok());
  Run();
  EXPECT_EQ(c_->state(), State::kTainted);
  EXPECT_EQ(c_->Update(1)->outcome, UpdateOutcome::kRejected);
  EXPECT_TRUE(engine_->paused());
  bool named = false;
  for (const auto& n : runner_->notes()) named = named || n.find("tainted: the resume failed") != std::string::npos;
  EXPECT_TRUE(named) << "the taint names the failed resume";
}

// A pause that lands after its deadline (and after the resume that followed it) would leave the
// engine paused while READY: the runner waits one more pause deadline for it and resumes again.
TEST_F(RunnerTest, APauseThatLandsAfterItsDeadlineIsResumedAgainBeforeReady) {
  RunnerOptions o;
  o.deadlines.pause_ms = 200;
  Build(With("pause", "ok", 250), o);
  ASSERT_TRUE(runner_->StartUpdate(Target()).ok());
  Run();
  EXPECT_EQ(c_->state(), State::kReady);
  EXPECT_EQ(c_->Update(1)->outcome, UpdateOutcome::kRejected);
  EXPECT_FALSE(engine_->paused()) << "READY on an engine the late pause paused";
  bool again = false;
  for (const auto& n : runner_->notes()) again = again || n.find("resuming again after it") != std::string::npos;
  EXPECT_TRUE(again);
}

TEST_F(RunnerTest, StagingFailureRejectsWhileServing) {
  Build(With("stage", "fail", 5));
  ASSERT_TRUE(runner_->StartUpdate(Target()).ok());
  Run();
  EXPECT_EQ(c_->state(), State::kReady);
  EXPECT_EQ(c_->Update(1)->outcome, UpdateOutcome::kRejected);
  EXPECT_NE(c_->Update(1)->reason.find("staging rc-1 failed"), std::string::npos);
  EXPECT_FALSE(engine_->paused());
}

TEST_F(RunnerTest, RefusedResetIsRetriedThenTaints) {
  // Refuses on every attempt: tainted after max attempts.
  Build(With("reset_encoder_cache", "refuse", 2));
  ASSERT_TRUE(runner_->StartUpdate(Target()).ok());
  Run();
  EXPECT_EQ(c_->state(), State::kTainted);
  EXPECT_NE(c_->Update(1)->reason.find("encoder cache reset was refused 3 times"), std::string::npos);
  EXPECT_TRUE(engine_->paused()) << "never resumed on an unverified version";
}

TEST_F(RunnerTest, WrongDigestAndStaleLabelTaint) {
  Build(With("content_digest", "wrong"));
  ASSERT_TRUE(runner_->StartUpdate(Target()).ok());
  Run();
  EXPECT_EQ(c_->state(), State::kTainted);
  EXPECT_NE(c_->Update(1)->reason.find("content digest"), std::string::npos);
}

TEST_F(RunnerTest, DrainWaitsForRolloutThenInstalls) {
  Build({});
  ASSERT_TRUE(c_->Admit("r1").ok());
  engine_->StartRequest("r1", 250);
  ASSERT_TRUE(runner_->StartUpdate(Target()).ok());
  Run();
  EXPECT_EQ(c_->state(), State::kReady);
  ASSERT_EQ(engine_->mutation_windows().size(), 1u);
  EXPECT_GE(engine_->mutation_windows()[0].first, 250);
}

TEST_F(RunnerTest, DrainPolicyCancelGivesUp) {
  RunnerOptions o;
  o.drain_policy = DrainPolicy::kCancel;
  o.deadlines.drain_ms = 100;
  Build({}, o);
  ASSERT_TRUE(c_->Admit("r1").ok());
  engine_->StartRequest("r1", 1000);
  ASSERT_TRUE(runner_->StartUpdate(Target()).ok());
  int64_t elapsed = Run();
  EXPECT_LE(elapsed, 110);
  EXPECT_EQ(c_->state(), State::kReady);
  EXPECT_EQ(c_->Update(1)->outcome, UpdateOutcome::kRejected);
  EXPECT_TRUE(c_->Binding("r1").has_value()) << "the rollout is untouched";
}

TEST_F(RunnerTest, RecoveryWithoutDigestCapabilityStaysTainted) {
  ScriptedEngineConfig cfg = With("install", "fail_after_mutation");
  cfg.offers_content_digest = false;
  Build(cfg);
  ASSERT_TRUE(runner_->StartUpdate(Target()).ok());
  Run();
  ASSERT_EQ(c_->state(), State::kTainted);
  UpdateTarget back;
  back.label = "rc-0";
  back.identity.content_digest = "d0";
  ASSERT_TRUE(runner_->StartRecovery(back).ok());
  Run();
  EXPECT_EQ(c_->state(), State::kTainted);
  EXPECT_NE(c_->Update(2)->reason.find("offers no content digest"), std::string::npos);
}

TEST_F(RunnerTest, RecoveryReinstallsAndVerifies) {
  Build(With("install", "fail_after_mutation"));
  ASSERT_TRUE(runner_->StartUpdate(Target()).ok());
  Run();
  ASSERT_EQ(c_->state(), State::kTainted);
  UpdateTarget back;
  back.label = "rc-0";
  back.identity.content_digest = "d0";
  ASSERT_TRUE(runner_->StartRecovery(back).ok());
  Run();
  EXPECT_EQ(c_->state(), State::kReady);
  EXPECT_EQ(c_->version(), (WeightVersion{"rc-0", 1}));
  EXPECT_EQ(engine_->digest(), "d0");
  EXPECT_FALSE(engine_->paused());
}

// A recovery target resolved through the directory carries the manifest's facts (for the trainer's
// FP8 image, docs/fp8.md): the recovery waits for them at most the stage deadline, and a fetch
// that failed or never answered leaves the engine's own checks, with a note that says why.
TEST_F(RunnerTest, RecoveryWaitsForTheManifestAtMostTheStageDeadline) {
  RunnerOptions o;
  o.deadlines.stage_ms = 400;
  Build(With("install", "fail_after_mutation"), o);
  UpdateTarget back = TaintThenTargetBack();
  ASSERT_EQ(c_->state(), State::kTainted);
  back.facts_fetch = Pending<VersionFacts>();  // never answers
  const int64_t t0 = clock_.NowMs();
  ASSERT_TRUE(runner_->StartRecovery(back).ok());
  Run();
  EXPECT_EQ(c_->state(), State::kReady);
  EXPECT_GE(clock_.NowMs() - t0, 400) << "it waited for the manifest up to the stage deadline";
  std::string notes;
  for (const auto& n : runner_->notes()) notes += n + "\n";
  EXPECT_NE(notes.find("was not read within the 400 ms stage deadline"), std::string::npos) << notes;

  back = TaintThenTargetBack();
  ASSERT_EQ(c_->state(), State::kTainted);
  back.facts_fetch = Pending<VersionFacts>::Completed(Unavailable("directory at http://d did not answer"));
  const int64_t t1 = clock_.NowMs();
  ASSERT_TRUE(runner_->StartRecovery(back).ok());
  Run();
  EXPECT_EQ(c_->state(), State::kReady);
  EXPECT_LT(clock_.NowMs() - t1, 400) << "a failed read does not wait";
  notes.clear();
  for (const auto& n : runner_->notes()) notes += n + "\n";
  EXPECT_NE(notes.find("could not be read"), std::string::npos) << notes;
}

TEST_F(RunnerTest, SecondUpdateWhileBusyIsRefused) {
  Build(With("install", "ok", 50));
  ASSERT_TRUE(runner_->StartUpdate(Target()).ok());
  auto again = runner_->StartUpdate(Target());
  EXPECT_EQ(again.status().code(), StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace rc::lifecycle

namespace rc::lifecycle {
namespace {

// An engine that cannot give a mode exact spans (the default SupportsPolicyMode) is refused
// before anything changes: no DRAINING, no journal record, READY on the old version.
TEST_F(RunnerTest, ModeTheEngineCannotDoIsRefusedBeforeAnythingChanges) {
  Build({});
  const size_t records = journal_.size();
  for (PolicyMode m : {PolicyMode::kKeep, PolicyMode::kRecompute, PolicyMode::kAbort}) {
    UpdateTarget t = Target();
    t.mode = m;
    auto started = runner_->StartUpdate(t);
    ASSERT_FALSE(started.ok()) << PolicyModeName(m);
    EXPECT_EQ(started.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(started.status().message().find(std::string(PolicyModeName(m))), std::string::npos);
  }
  EXPECT_EQ(journal_.size(), records);
  EXPECT_EQ(c_->state(), State::kReady);
  ASSERT_TRUE(runner_->StartUpdate(Target()).ok()) << "strict still runs";
  Run();
  EXPECT_EQ(c_->version(), (WeightVersion{"rc-1", 1}));
}

}  // namespace
}  // namespace rc::lifecycle
