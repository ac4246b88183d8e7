// Crash-safety: the controller is "killed" between every pair of journal records of an update
// (with a live rollout, a drain, the install, resets, validation and the commit), restarted from
// the journal prefix, and must land in a state the journal justifies, with no admitted rollout
// lost. Then the restarted controller must be able to move on (commit a new update, or recover).
// Also: real-time fault injection through FaultInjectingAdapter.
#include <gtest/gtest.h>

#include "rolloutcore/lifecycle/runner.h"
#include "rolloutcore/lifecycle/scripted_engine.h"
#include "testing/fake_engine.h"

namespace rc::lifecycle {
namespace {

UpdateTarget Target(const std::string& label, const std::string& digest) {
  UpdateTarget t;
  t.label = label;
  t.identity.content_digest = digest;
  return t;
}

// Runs one update with rollouts around it; returns the full journal.
std::vector<JournalRecord> RecordFullRun() {
  ManualClock clock;
  MemoryJournal journal;
  ScriptedEngineConfig cfg;
  cfg.label = "rc-0";
  cfg.digest = "d0";
  cfg.ops["install"] = {OpScript{40, "ok", 0}};
  ScriptedEngine engine(&clock, cfg);
  auto c = std::move(Controller::Open(&clock, &journal)).value();
  EXPECT_TRUE(c->Initialize({"rc-0", 0}, {"d0", "", "", 0}).ok());
  Runner runner(c.get(), &engine, &clock, RunnerOptions{});
  EXPECT_TRUE(c->Admit("r1").ok());
  engine.StartRequest("r1", 100);
  EXPECT_TRUE(c->Admit("r2").ok());
  engine.StartRequest("r2", 30);
  EXPECT_TRUE(runner.StartUpdate(Target("rc-1", "d1")).ok());
  while (runner.Poll()) {
    clock.AdvanceMs(1);
    for (const auto& id : engine.Tick()) EXPECT_TRUE(c->Finish(id).ok());
  }
  EXPECT_EQ(c->state(), State::kReady);
  clock.AdvanceMs(5);
  EXPECT_TRUE(c->Admit("r3").ok());
  EXPECT_TRUE(c->Finish("r3").ok());
  return journal.ReadAll().value();
}

TEST(CrashFaultTest, RestartBetweenEveryPairOfRecordsLandsInAJustifiedState) {
  auto full = RecordFullRun();
  ASSERT_GE(full.size(), 12u);
  for (size_t k = 1; k <= full.size(); ++k) {
    SCOPED_TRACE("crash after record " + std::to_string(k) + " (" + full[k - 1].event + ")");
    MemoryJournal journal;
    for (size_t i = 0; i < k; ++i) {
      JournalRecord r = full[i];
      ASSERT_TRUE(journal.Append(r).ok());
    }
    // What the prefix justifies.
    std::string last_state = "UNINITIALIZED";
    bool committed = false;
    std::map<std::string, bool> live;
    for (size_t i = 0; i < k; ++i) {
      const auto& r = full[i];
      if (!r.to.empty()) last_state = r.to;
      if (r.event == "resumed") committed = true;
      if (r.event == "admit") live[r.rollout] = true;
      if (r.event == "finish") live.erase(r.rollout);
    }
    State at = StateFromName(last_state).value();
    State expected = at;
    if (at == State::kDraining || at == State::kQuiesced) expected = State::kReady;
    if (MutationMayHaveBegun(at)) expected = State::kTainted;

    ManualClock clock(1'000'000'000);
    RestoreSummary summary;
    auto c = std::move(Controller::Open(&clock, &journal, &summary)).value();
    EXPECT_EQ(summary.state_at_crash, at);
    EXPECT_EQ(c->state(), expected);
    EXPECT_EQ(c->version().label, committed ? "rc-1" : "rc-0");
    // No admitted rollout lost: each one alive in the prefix is now recorded interrupted.
    std::vector<std::string> want;
    for (auto& [id, alive] : live) want.push_back(id);
    EXPECT_EQ(summary.interrupted, want);
    auto after = journal.ReadAll().value();
    for (const auto& id : want) {
      bool recorded = false;
      for (const auto& r : after) recorded = recorded || (r.event == "interrupted" && r.rollout == id);
      EXPECT_TRUE(recorded) << id;
    }
    EXPECT_EQ(c->active_count(), 0);
    if (expected == State::kTainted) {
      EXPECT_EQ(c->Update(1)->outcome, UpdateOutcome::kTainted);
    }

    // ... and it can move on from there against the engine as it was left.
    ScriptedEngineConfig cfg;
    cfg.label = committed ? "rc-1" : "rc-0";
    cfg.digest = committed ? "d1" : "d0";
    ScriptedEngine engine(&clock, cfg);
    Runner runner(c.get(), &engine, &clock, RunnerOptions{});
    if (c->state() == State::kUninitialized) continue;
    if (c->state() == State::kTainted) {
      ASSERT_TRUE(runner.StartRecovery(Target("rc-0", "d0")).ok());
    } else {
      ASSERT_EQ(c->state(), State::kReady);
      ASSERT_TRUE(runner.StartUpdate(Target("rc-2", "d2")).ok());
    }
    while (runner.Poll()) {
      clock.AdvanceMs(1);
      engine.Tick();
    }
    EXPECT_EQ(c->state(), State::kReady);
  }
}

TEST(CrashFaultTest, SqliteJournalCrashMidInstallComesBackTainted) {
  auto path = ::testing::TempDir() + "rc_crash_" + std::to_string(::getpid()) + ".db";
  std::remove(path.c_str());
  ManualClock clock;
  {
    auto j = std::move(SqliteJournal::Open(path)).value();
    auto c = std::move(Controller::Open(&clock, j.get())).value();
    ASSERT_TRUE(c->Initialize({"rc-0", 0}, {"d0", "", "", 0}).ok());
    ASSERT_TRUE(c->RequestUpdate(Target("rc-1", "d1")).ok());
    ASSERT_TRUE(c->DrainComplete({0, 0}).ok());
    ASSERT_TRUE(c->BeginInstall({true, 0}).ok());
    // Crash: the objects go away without any goodbye.
  }
  auto j = std::move(SqliteJournal::Open(path)).value();
  RestoreSummary s;
  auto c = std::move(Controller::Open(&clock, j.get(), &s)).value();
  EXPECT_EQ(s.state_at_crash, State::kUpdating);
  EXPECT_EQ(c->state(), State::kTainted);
  std::remove(path.c_str());
}

// ---- Real time, real threads -------------------------------------------------------------

class RealTimeFaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    c_ = std::move(Controller::Open(SystemClock::Default(), &journal_)).value();
    ASSERT_TRUE(c_->Initialize({"rc-0", 0}, {"d0", "", "", 0}).ok());
  }
  Result<UpdateRecord> RunUpdate(RunnerOptions opts) {
    Runner runner(c_.get(), &faulty_, SystemClock::Default(), opts);
    RC_RETURN_IF_ERROR(runner.StartUpdate(Target("rc-1", "d1")));
    return runner.RunToCompletion();
  }
  MemoryJournal journal_;
  std::unique_ptr<Controller> c_;
  rc::testing::FakeEngine engine_{"rc-0", "d0"};
  rc::testing::FaultInjectingAdapter faulty_{&engine_};
};

TEST_F(RealTimeFaultTest, HungInstallIsAbandonedAndTaintsWithinDeadlinePlus100ms) {
  rc::testing::Fault hang;
  hang.kind = rc::testing::Fault::Kind::kHang;
  faulty_.Set("install", hang);
  RunnerOptions opts;
  opts.deadlines.install_ms = 200;
  auto u = RunUpdate(opts);
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(u->outcome, UpdateOutcome::kTainted);
  EXPECT_EQ(c_->state(), State::kTainted);
  // Measured by the controller's own clock from entering UPDATING to TAINTED.
  EXPECT_GE(u->phases_ms.at("UPDATING"), 200);
  EXPECT_LE(u->phases_ms.at("UPDATING"), 200 + 100);
}

TEST_F(RealTimeFaultTest, FailAfterMutationTaints) {
  rc::testing::Fault f;
  f.kind = rc::testing::Fault::Kind::kFailAfter;
  f.code = StatusCode::kInternal;
  faulty_.Set("install", f);
  auto u = RunUpdate(RunnerOptions{});
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(u->outcome, UpdateOutcome::kTainted);
  EXPECT_EQ(engine_.shared()->mutations_finished.load(), 1) << "the inner install did happen";
}

// Issue 13 defect 9: a precondition error raised after the install wrote (here: the inner
// install ran, then FailedPrecondition) is not "refused before mutation": only the engine's
// explicit refused_untouched outcome is, and this one taints.
TEST_F(RealTimeFaultTest, PreconditionErrorAfterMutationTaints) {
  rc::testing::Fault f;
  f.kind = rc::testing::Fault::Kind::kFailAfter;
  f.code = StatusCode::kFailedPrecondition;
  faulty_.Set("install", f);
  auto u = RunUpdate(RunnerOptions{});
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(u->outcome, UpdateOutcome::kTainted) << u->reason;
  EXPECT_EQ(c_->state(), State::kTainted);
  EXPECT_EQ(engine_.shared()->mutations_finished.load(), 1) << "the inner install did happen";
}

TEST_F(RealTimeFaultTest, FailBeforeMutationReturnsToOldVersion) {
  rc::testing::Fault f;
  f.kind = rc::testing::Fault::Kind::kFailBefore;
  f.code = StatusCode::kFailedPrecondition;
  faulty_.Set("install", f);
  auto u = RunUpdate(RunnerOptions{});
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(u->outcome, UpdateOutcome::kRejected);
  EXPECT_EQ(c_->state(), State::kReady);
  EXPECT_EQ(engine_.shared()->mutations_started.load(), 0);
}

TEST_F(RealTimeFaultTest, CorruptDigestTaints) {
  rc::testing::Fault f;
  f.kind = rc::testing::Fault::Kind::kCorruptDigest;
  faulty_.Set("digest", f);
  auto u = RunUpdate(RunnerOptions{});
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(u->outcome, UpdateOutcome::kTainted);
  EXPECT_NE(u->reason.find("corrupt-d1"), std::string::npos);
}

TEST_F(RealTimeFaultTest, SlowButInTimeResumeCommits) {
  rc::testing::Fault f;
  f.kind = rc::testing::Fault::Kind::kDelay;
  f.delay = std::chrono::milliseconds(50);
  faulty_.Set("resume", f);
  auto u = RunUpdate(RunnerOptions{});
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(u->outcome, UpdateOutcome::kCommitted);
  EXPECT_GE(u->phases_ms.at("RESUMING"), 50);
}

}  // namespace
}  // namespace rc::lifecycle
