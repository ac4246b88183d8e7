// Crash-safety: the controller is "killed" between every pair of journal records of an update
// (with a live rollout, a drain, the install, resets, validation and the commit), restarted from
// the journal prefix, and must land in a state the journal justifies, with no admitted rollout
// lost. Then the restarted controller must be able to move on (commit a new update, or recover).
// Also: real-time fault injection through FaultInjectingAdapter.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <thread>

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
    want.reserve(live.size());
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

// ---- Group commit (issue 15) ------------------------------------------------------------------

// Forwards to a ScriptedEngine and, at each Stage and Pause call, looks at what the journal holds:
// the effect a record authorizes must find that record already synced.
class JournalWatchingAdapter final : public EngineAdapter {
 public:
  JournalWatchingAdapter(ScriptedEngine* inner, MemoryJournal* journal) : inner_(inner), journal_(journal) {}
  Result<EngineDescription> Describe() override { return inner_->Describe(); }
  Pending<DrainStatus> GetDrainStatus() override { return inner_->GetDrainStatus(); }
  Pending<PauseEvidence> Pause(PauseMode m) override {
    ++pauses;
    records_at_pause = journal_->ReadAll().value();
    syncs_at_pause = journal_->syncs();
    return inner_->Pause(m);
  }
  Pending<AbortEvidence> AbortRequests(const std::vector<std::string>& ids) override { return inner_->AbortRequests(ids); }
  Pending<StageEvidence> Stage(const UpdateTarget& t) override {
    records_at_stage = journal_->size();
    syncs_at_stage = journal_->syncs();
    if (crash_at_stage) journal_->FailAfter(0);  // the controller dies before its next sync
    return inner_->Stage(t);
  }
  Pending<InstallEvidence> Install(const UpdateTarget& t, bool full) override { return inner_->Install(t, full); }
  Pending<CacheResetResult> ResetCache(CacheKind k) override { return inner_->ResetCache(k); }
  Pending<LabelEvidence> ReadLabel() override { return inner_->ReadLabel(); }
  Pending<DigestEvidence> ReadContentDigest() override { return inner_->ReadContentDigest(); }
  Pending<ResumeEvidence> Resume() override { return inner_->Resume(); }
  Pending<IdentityEvidence> ProbeIdentity() override { return inner_->ProbeIdentity(); }

  bool crash_at_stage = false;
  int pauses = 0;
  size_t records_at_stage = 0;
  int64_t syncs_at_stage = 0;
  std::vector<JournalRecord> records_at_pause;
  int64_t syncs_at_pause = 0;

 private:
  ScriptedEngine* inner_;
  MemoryJournal* journal_;
};

ScriptedEngineConfig StageAndPauseEngine() {
  ScriptedEngineConfig cfg;
  cfg.label = "rc-0";
  cfg.digest = "d0";
  cfg.ops["stage"] = {OpScript{5, "ok", 0}};
  return cfg;
}

// The stage evidence authorizes no engine call, so it is not synced alone: it goes into one batch
// with drain_complete, and that batch is synced before the pause it authorizes is issued.
TEST(CrashFaultTest, StageEvidenceIsGroupCommittedWithDrainCompleteBeforeThePause) {
  ManualClock clock;
  MemoryJournal journal;
  ScriptedEngine engine(&clock, StageAndPauseEngine());
  JournalWatchingAdapter adapter(&engine, &journal);
  auto c = std::move(Controller::Open(&clock, &journal)).value();
  ASSERT_TRUE(c->Initialize({"rc-0", 0}, {"d0", "", "", 0}).ok());
  Runner runner(c.get(), &adapter, &clock, RunnerOptions{});
  ASSERT_TRUE(runner.StartUpdate(Target("rc-1", "d1")).ok());
  while (runner.Poll()) {
    clock.AdvanceMs(1);
    engine.Tick();
  }
  ASSERT_EQ(c->state(), State::kReady);
  EXPECT_EQ(c->version().label, "rc-1");
  ASSERT_EQ(adapter.pauses, 1);
  // At the pause: exactly two more records than at the stage call (staged, drain_complete), in
  // that order, written by one sync.
  const auto& at_pause = adapter.records_at_pause;
  ASSERT_EQ(at_pause.size(), adapter.records_at_stage + 2);
  EXPECT_EQ(at_pause[at_pause.size() - 2].event, "staged");
  EXPECT_EQ(at_pause.back().event, "drain_complete");
  EXPECT_EQ(adapter.syncs_at_pause, adapter.syncs_at_stage + 1);
  EXPECT_LT(at_pause[at_pause.size() - 2].seq, at_pause.back().seq);
  // The evidence is in the update record, and a restart from the journal at the pause (the crash
  // after the group's sync, before its effect completed) comes back READY on the old version
  // with the engine possibly paused (to be resumed), the staging evidence restored with it.
  auto u = c->Update(1);
  ASSERT_TRUE(u);
  ASSERT_TRUE(u->evidence.contains("staged"));
  EXPECT_EQ(u->evidence["staged"]["label"], "rc-1");
  MemoryJournal at_crash;
  for (JournalRecord r : at_pause) ASSERT_TRUE(at_crash.Append(r).ok());
  RestoreSummary summary;
  auto restarted = std::move(Controller::Open(&clock, &at_crash, &summary)).value();
  EXPECT_EQ(summary.state_at_crash, State::kQuiesced);
  EXPECT_TRUE(summary.engine_may_be_paused);
  EXPECT_EQ(restarted->state(), State::kReady);
  EXPECT_EQ(restarted->version().label, "rc-0");
  ASSERT_TRUE(restarted->Update(1));
  EXPECT_TRUE(restarted->Update(1)->evidence.contains("staged"));
}

// A crash before the batch's sync: neither the stage evidence nor drain_complete is in the
// journal, the pause they would authorize is never issued, and the restart comes back READY on
// the old version with nothing to resume.
TEST(CrashFaultTest, CrashBeforeTheGroupCommitLeavesNeitherRecordAndIssuesNoPause) {
  ManualClock clock;
  MemoryJournal journal;
  ScriptedEngine engine(&clock, StageAndPauseEngine());
  JournalWatchingAdapter adapter(&engine, &journal);
  adapter.crash_at_stage = true;
  auto c = std::move(Controller::Open(&clock, &journal)).value();
  ASSERT_TRUE(c->Initialize({"rc-0", 0}, {"d0", "", "", 0}).ok());
  Runner runner(c.get(), &adapter, &clock, RunnerOptions{});
  ASSERT_TRUE(runner.StartUpdate(Target("rc-1", "d1")).ok());
  for (int ms = 0; ms < 2000 && runner.Poll(); ++ms) {
    clock.AdvanceMs(1);
    engine.Tick();
  }
  EXPECT_EQ(adapter.pauses, 0);
  EXPECT_FALSE(engine.paused());
  EXPECT_EQ(c->state(), State::kDraining);
  auto u = c->Update(1);
  ASSERT_TRUE(u);
  EXPECT_FALSE(u->evidence.contains("staged")) << "evidence shows only once it is durable";
  const auto records = journal.ReadAll().value();
  ASSERT_EQ(records.size(), adapter.records_at_stage);
  for (const auto& r : records) {
    EXPECT_NE(r.event, "staged");
    EXPECT_NE(r.event, "drain_complete");
  }
  journal.FailAfter(-1);  // the restarted controller's journal works again
  RestoreSummary summary;
  auto restarted = std::move(Controller::Open(&clock, &journal, &summary)).value();
  EXPECT_EQ(summary.state_at_crash, State::kDraining);
  EXPECT_FALSE(summary.engine_may_be_paused);
  EXPECT_EQ(restarted->state(), State::kReady);
  EXPECT_EQ(restarted->version().label, "rc-0");
}

// SqliteJournal's batch is one transaction: one commit for all its records, the chain verified
// across it at the next open.
TEST(CrashFaultTest, SqliteJournalBatchIsOneCommitAndKeepsTheChain) {
  auto path = ::testing::TempDir() + "rc_batch_" + std::to_string(::getpid()) + ".db";
  std::remove(path.c_str());
  {
    auto j = std::move(SqliteJournal::Open(path)).value();
    JournalRecord a, b, c;
    a.event = "first";
    b.event = "second";
    c.event = "third";
    ASSERT_TRUE(j->Append(a).ok());
    const auto before = j->append_stats();
    ASSERT_TRUE(j->AppendBatch({&b, &c}).ok());
    const auto after = j->append_stats();
    EXPECT_EQ(after.syncs - before.syncs, 1);
    EXPECT_EQ(after.appends - before.appends, 2);
    EXPECT_EQ(b.seq, 2);
    EXPECT_EQ(c.seq, 3);
  }
  auto j = std::move(SqliteJournal::Open(path, /*must_exist=*/true)).value();
  auto all = j->ReadAll().value();
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[1].event, "second");
  EXPECT_EQ(all[2].event, "third");
  std::remove(path.c_str());
  std::remove((path + "-wal").c_str());
  std::remove((path + "-shm").c_str());
}

// Appends overwrite the WAL reserved at open instead of growing the file (issue 15: an
// fdatasync that also has a file size to commit costs about three times as much here).
TEST(CrashFaultTest, SqliteJournalAppendsOverwriteTheReservedWal) {
  auto path = ::testing::TempDir() + "rc_wal_" + std::to_string(::getpid()) + ".db";
  for (const char* ext : {"", "-wal", "-shm"}) std::remove((path + ext).c_str());
  {
    auto j = std::move(SqliteJournal::Open(path)).value();
    JournalRecord first;
    first.event = "first";
    ASSERT_TRUE(j->Append(first).ok());
    const auto reserved = std::filesystem::file_size(path + "-wal");
    EXPECT_GE(reserved, 1u << 20) << "the WAL's first MiB is reserved at open";
    for (int i = 0; i < 200; ++i) {
      JournalRecord r;
      // (Built with append: GCC 12 at -O3 reports a false -Wrestrict for "literal" + std::string, GCC PR 105329.)
      r.event = std::string("e").append(std::to_string(i));
      r.detail = Json{{"evidence", std::string(1500, 'x')}};
      ASSERT_TRUE(j->Append(r).ok());
    }
    EXPECT_EQ(std::filesystem::file_size(path + "-wal"), reserved) << "200 appends grew the WAL";
    EXPECT_EQ(j->ReadAll().value().size(), 201u);
  }
  auto j = std::move(SqliteJournal::Open(path, /*must_exist=*/true)).value();
  EXPECT_EQ(j->ReadAll().value().size(), 201u);
  for (const char* ext : {"", "-wal", "-shm"}) std::remove((path + ext).c_str());
}

// Runner::WaitForProgress blocks on the call in flight until it answers (the service's driver
// notices an answer when it comes, not at the next fixed poll), and returns at once when nothing
// is in flight.
TEST(CrashFaultTest, WaitForProgressReturnsWhenTheCallInFlightAnswers) {
  ManualClock clock;
  MemoryJournal journal;
  ScriptedEngineConfig cfg = StageAndPauseEngine();
  ScriptedEngine engine(&clock, cfg);
  struct SlowStage final : EngineAdapter {
    explicit SlowStage(ScriptedEngine* e) : inner(e) {}
    Result<EngineDescription> Describe() override { return inner->Describe(); }
    Pending<DrainStatus> GetDrainStatus() override { return inner->GetDrainStatus(); }
    Pending<PauseEvidence> Pause(PauseMode m) override { return inner->Pause(m); }
    Pending<AbortEvidence> AbortRequests(const std::vector<std::string>& ids) override { return inner->AbortRequests(ids); }
    Pending<StageEvidence> Stage(const UpdateTarget& t) override {
      Pending<StageEvidence> p;
      StageEvidence e;
      e.label = t.label;
      answerer = std::thread([p, e] {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        p.Fulfill(e);
      });
      return p;
    }
    Pending<InstallEvidence> Install(const UpdateTarget& t, bool full) override { return inner->Install(t, full); }
    Pending<CacheResetResult> ResetCache(CacheKind k) override { return inner->ResetCache(k); }
    Pending<LabelEvidence> ReadLabel() override { return inner->ReadLabel(); }
    Pending<DigestEvidence> ReadContentDigest() override { return inner->ReadContentDigest(); }
    Pending<ResumeEvidence> Resume() override { return inner->Resume(); }
    Pending<IdentityEvidence> ProbeIdentity() override { return inner->ProbeIdentity(); }
    ScriptedEngine* inner;
    std::thread answerer;
  } adapter(&engine);
  auto c = std::move(Controller::Open(&clock, &journal)).value();
  ASSERT_TRUE(c->Initialize({"rc-0", 0}, {"d0", "", "", 0}).ok());
  Runner runner(c.get(), &adapter, &clock, RunnerOptions{});
  EXPECT_FALSE(runner.WaitForProgress(std::chrono::seconds(5))) << "idle: nothing to wait for";
  ASSERT_TRUE(runner.StartUpdate(Target("rc-1", "d1")).ok());
  engine.Tick();   // the drain status answers at once (virtual time)
  runner.Poll();   // consumes it; the stage is still in flight
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(runner.WaitForProgress(std::chrono::seconds(5)));
  const auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_LT(waited, std::chrono::seconds(4)) << "returned by the answer, not by the 5 s bound";
  adapter.answerer.join();
  runner.Poll();
  auto u = c->Update(1);
  ASSERT_TRUE(u);
  EXPECT_TRUE(runner.busy());
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
