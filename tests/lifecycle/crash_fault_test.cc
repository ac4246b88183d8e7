// Crash-safety: the controller is "killed" between every pair of journal records of an update
// (with a live rollout, a drain, the install, resets, validation and the commit), restarted from
// the journal prefix, and must land in a state the journal justifies, with no admitted rollout
// lost. Then the restarted controller must be able to move on (commit a new update, or recover).
// Also: real-time fault injection through FaultInjectingAdapter.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <set>
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
  {
    auto j = std::move(SqliteJournal::Open(path)).value();
    RestoreSummary s;
    auto c = std::move(Controller::Open(&clock, j.get(), &s)).value();
    EXPECT_EQ(s.state_at_crash, State::kUpdating);
    EXPECT_EQ(c->state(), State::kTainted);
  }
  // Closed first, then every file SQLite made (WAL mode leaves -wal and -shm beside the database).
  std::remove(path.c_str());
  std::remove((path + "-wal").c_str());
  std::remove((path + "-shm").c_str());
}

// ---- Group commit (issue 15) ------------------------------------------------------------------

// Forwards to a ScriptedEngine and, at each call, looks at what the journal holds: the effect a
// record authorizes must find that record already synced.
class JournalWatchingAdapter final : public EngineAdapter {
 public:
  struct Seen {
    std::vector<JournalRecord> records;  // the journal when the call was issued
    int64_t syncs = 0;
    int64_t t_ms = 0;  // the clock when the call was issued
  };
  JournalWatchingAdapter(ScriptedEngine* inner, MemoryJournal* journal, const Clock* clock)
      : inner_(inner), journal_(journal), clock_(clock) {}
  Result<EngineDescription> Describe() override { return inner_->Describe(); }
  Pending<DrainStatus> GetDrainStatus() override {
    Look("drain_status");
    return inner_->GetDrainStatus();
  }
  Pending<PauseEvidence> Pause(PauseMode m) override {
    Look("pause");
    if (crash_at_pause) journal_->FailAfter(0);  // the controller dies before its next sync
    return inner_->Pause(m);
  }
  Pending<AbortEvidence> AbortRequests(const std::vector<std::string>& ids) override { return inner_->AbortRequests(ids); }
  Pending<StageEvidence> Stage(const UpdateTarget& t) override {
    Look("stage");
    return inner_->Stage(t);
  }
  Pending<InstallEvidence> Install(const UpdateTarget& t, bool full) override {
    Look("install");
    return inner_->Install(t, full);
  }
  Pending<CacheResetResult> ResetCache(CacheKind k) override {
    Look("reset");
    return inner_->ResetCache(k);
  }
  Pending<LabelEvidence> ReadLabel() override {
    Look("read_label");
    return inner_->ReadLabel();
  }
  Pending<DigestEvidence> ReadContentDigest() override {
    Look("read_digest");
    return inner_->ReadContentDigest();
  }
  Pending<ResumeEvidence> Resume() override {
    Look("resume");
    return inner_->Resume();
  }
  Pending<IdentityEvidence> ProbeIdentity() override { return inner_->ProbeIdentity(); }

  bool crash_at_pause = false;
  std::map<std::string, std::vector<Seen>> seen;  // by call, in the order issued

 private:
  void Look(const std::string& call) {
    seen[call].push_back(Seen{journal_->ReadAll().value(), journal_->syncs(), clock_->NowMs()});
  }
  ScriptedEngine* inner_;
  MemoryJournal* journal_;
  const Clock* clock_;
};

ScriptedEngineConfig StageAndPauseEngine() {
  ScriptedEngineConfig cfg;
  cfg.label = "rc-0";
  cfg.digest = "d0";
  cfg.ops["stage"] = {OpScript{5, "ok", 0}};
  cfg.ops["pause"] = {OpScript{2, "ok", 0}};
  return cfg;
}

std::vector<std::string> Events(const std::vector<JournalRecord>& records) {
  std::vector<std::string> out;
  out.reserve(records.size());
  for (const auto& r : records) out.push_back(r.event);
  return out;
}

// One controller at rc-0 (digest d0) over a MemoryJournal, driving a ScriptedEngine through the
// watching adapter in virtual time (1 ms a poll).
struct WatchedUpdate {
  explicit WatchedUpdate(ScriptedEngineConfig cfg, RunnerOptions options = {})
      : engine(&clock, std::move(cfg)),
        adapter(&engine, &journal, &clock),
        c(std::move(Controller::Open(&clock, &journal)).value()),
        runner(c.get(), &adapter, &clock, options) {
    EXPECT_TRUE(c->Initialize({"rc-0", 0}, {"d0", "", "", 0}).ok());
  }
  // One millisecond: the clock moves and the engine answers what is due.
  void Tick() {
    clock.AdvanceMs(1);
    engine.Tick();
  }
  // Polls until the operation ends (or max_ms passed); every state the controller was in at a
  // poll goes into `states` when given.
  void Run(int max_ms = 100000, std::set<State>* states = nullptr) {
    for (int ms = 0; ms < max_ms && runner.Poll(); ++ms) {
      if (states != nullptr) states->insert(c->state());
      Tick();
    }
  }
  ManualClock clock;
  MemoryJournal journal;
  ScriptedEngine engine;
  JournalWatchingAdapter adapter;
  std::unique_ptr<Controller> c;
  Runner runner;
};

// Issue 15's group commits, seen from the engine: every call that changes something finds the
// record that authorizes it synced, and the records between those effects share one sync each.
//   stage (prefetch, changes nothing): issued before request_update is synced;
//   pause: request_update (DRAINING) synced; the drain's last step, nothing more is recorded yet;
//   install: staged, drain_complete, begin_install synced in ONE sync after the pause answered;
//   reset (part of the mutation begin_install authorized): issued with the install's answer, no
//     sync between;
//   label/digest reads (change nothing): issued with the install's answer too;
//   resume: install_complete, caches_reset, validated synced in ONE sync.
TEST(CrashFaultTest, EveryEffectFindsItsRecordSyncedAndTheStatesBetweenShareOneSync) {
  WatchedUpdate w(StageAndPauseEngine());
  auto& [clock, journal, engine, adapter, c, runner] = w;
  ASSERT_TRUE(runner.StartUpdate(Target("rc-1", "d1")).ok());
  w.Run();
  ASSERT_EQ(c->state(), State::kReady);
  EXPECT_EQ(c->version().label, "rc-1");
  for (const char* call : {"stage", "pause", "install", "read_label", "read_digest", "resume"}) {
    ASSERT_EQ(adapter.seen[call].size(), 1u) << call;
  }
  ASSERT_EQ(adapter.seen["reset"].size(), 3u) << "prefix, encoder and multimodal caches";
  for (const auto& r : adapter.seen["reset"]) EXPECT_EQ(r.syncs, adapter.seen["reset"][0].syncs);
  const auto& stage = adapter.seen["stage"][0];
  const auto& pause = adapter.seen["pause"][0];
  const auto& install = adapter.seen["install"][0];
  const auto& reset = adapter.seen["reset"][0];
  const auto& label = adapter.seen["read_label"][0];
  const auto& resume = adapter.seen["resume"][0];

  EXPECT_EQ(Events(stage.records), (std::vector<std::string>{"initialize"}));
  // The drain status seen idle while the stage ran ends the drain: the pause goes out in the poll
  // that takes the stage's answer (5 ms after it was issued), with no drain status asked after it.
  EXPECT_LE(pause.t_ms, stage.t_ms + 6);
  ASSERT_FALSE(adapter.seen["drain_status"].empty());
  EXPECT_LT(adapter.seen["drain_status"].back().t_ms, stage.t_ms + 5);
  EXPECT_EQ(Events(pause.records), (std::vector<std::string>{"initialize", "request_update"}));
  EXPECT_EQ(pause.syncs, stage.syncs + 1);
  EXPECT_EQ(Events(install.records), (std::vector<std::string>{"initialize", "request_update", "staged",
                                                                "drain_complete", "begin_install"}));
  EXPECT_EQ(install.syncs, pause.syncs + 1) << "staged, drain_complete and begin_install: one sync";
  EXPECT_EQ(Events(label.records), Events(install.records)) << "the reads go out before install_complete's sync";
  EXPECT_EQ(adapter.seen["read_digest"][0].syncs, install.syncs);
  EXPECT_EQ(Events(reset.records), Events(install.records)) << "begin_install authorizes the resets";
  EXPECT_EQ(reset.syncs, install.syncs) << "no sync between the install's answer and the resets";
  const auto resumed_at = Events(resume.records);
  ASSERT_EQ(resumed_at.size(), reset.records.size() + 3);
  EXPECT_EQ(resumed_at[resumed_at.size() - 3], "install_complete");
  EXPECT_EQ(resumed_at[resumed_at.size() - 2], "caches_reset");
  EXPECT_EQ(resumed_at.back(), "validated");
  EXPECT_EQ(resume.syncs, reset.syncs + 1) << "install_complete, caches_reset and validated: one sync";

  // The records are true about when: drain_complete is timed at the pause (QUIESCED and the pause
  // window begin there), caches_reset when the last reset answered.
  const auto all = journal.ReadAll().value();
  auto find = [&](const std::string& e) {
    for (const auto& r : all) {
      if (r.event == e) return r;
    }
    ADD_FAILURE() << "no " << e;
    return JournalRecord{};
  };
  const JournalRecord drained = find("drain_complete"), begin = find("begin_install");
  EXPECT_LT(drained.t_ms, begin.t_ms) << "the pause took 2 ms between them";
  EXPECT_LE(find("staged").t_ms, drained.t_ms);
  EXPECT_LE(find("install_complete").t_ms, find("caches_reset").t_ms);
  EXPECT_LE(find("caches_reset").t_ms, find("validated").t_ms);
  auto u = c->Update(1);
  ASSERT_TRUE(u);
  EXPECT_GE(u->phases_ms["QUIESCED"], 2) << "the pause is in the pause window";
  ASSERT_TRUE(u->evidence.contains("staged"));
  EXPECT_EQ(u->evidence["staged"]["label"], "rc-1");
  ASSERT_TRUE(u->evidence.contains("drain_complete"));
  ASSERT_TRUE(u->evidence.contains("begin_install"));
  EXPECT_TRUE(u->evidence["begin_install"]["paused"].get<bool>());
  ASSERT_TRUE(u->evidence.contains("caches_reset"));
  ASSERT_TRUE(u->evidence.contains("validated"));

  // A crash after the first batch's sync (at the install call, or at a reset) restarts TAINTED:
  // mutation may have begun; a crash at the pause (only request_update synced) restarts READY on
  // the old version with the engine to be resumed.
  for (const auto* at : {&pause, &install, &reset}) {
    MemoryJournal at_crash;
    for (JournalRecord r : at->records) ASSERT_TRUE(at_crash.Append(r).ok());
    RestoreSummary summary;
    auto restarted = std::move(Controller::Open(&clock, &at_crash, &summary)).value();
    EXPECT_TRUE(summary.engine_may_be_paused);
    EXPECT_EQ(restarted->version().label, "rc-0");
    EXPECT_EQ(restarted->state(), at == &pause ? State::kReady : State::kTainted);
  }
}

// Work that outlasts the group-commit window gets its state journaled on its own, so /v1/status
// and a restart see it: a 20 ms pause shows QUIESCED while it runs, a 20 ms digest read shows
// VALIDATING; each is still synced before the next effect (install; resume).
TEST(CrashFaultTest, SlowPauseAndSlowValidationAreJournaledOnTheirOwnOnceTheWindowPasses) {
  ScriptedEngineConfig cfg = StageAndPauseEngine();
  cfg.ops["pause"] = {OpScript{20, "ok", 0}};
  cfg.ops["content_digest"] = {OpScript{20, "ok", 0}};
  ASSERT_EQ(RunnerOptions{}.group_commit_window_ms, 5);
  WatchedUpdate w(cfg);
  auto& [clock, journal, engine, adapter, c, runner] = w;
  ASSERT_TRUE(runner.StartUpdate(Target("rc-1", "d1")).ok());
  std::set<State> seen;
  w.Run(100000, &seen);
  ASSERT_EQ(c->state(), State::kReady);
  EXPECT_TRUE(seen.count(State::kQuiesced)) << "QUIESCED shows while the slow pause runs";
  EXPECT_TRUE(seen.count(State::kInvalidating)) << "INVALIDATING shows once the window passed";
  EXPECT_TRUE(seen.count(State::kValidating)) << "VALIDATING shows while the slow digest read runs";
  ASSERT_EQ(adapter.seen["install"].size(), 1u);
  ASSERT_EQ(adapter.seen["resume"].size(), 1u);
  const auto at_install = Events(adapter.seen["install"][0].records);
  EXPECT_EQ(at_install.back(), "begin_install");
  const auto at_resume = Events(adapter.seen["resume"][0].records);
  EXPECT_EQ(at_resume.back(), "validated");
  // Separate syncs: drain_complete (with the held stage evidence) at the window, begin_install at
  // the pause's answer; install_complete and caches_reset each at its window, validated at the
  // digest's answer.
  const int64_t pause_syncs = adapter.seen["pause"][0].syncs;
  EXPECT_EQ(adapter.seen["install"][0].syncs, pause_syncs + 2);
  EXPECT_EQ(adapter.seen["reset"][0].syncs, adapter.seen["install"][0].syncs);
  EXPECT_EQ(adapter.seen["resume"][0].syncs, adapter.seen["reset"][0].syncs + 3);
  const auto all = journal.ReadAll().value();
  int64_t drained_t = -1, begin_t = -1;
  for (const auto& r : all) {
    if (r.event == "drain_complete") drained_t = r.t_ms;
    if (r.event == "begin_install") begin_t = r.t_ms;
  }
  EXPECT_GE(begin_t - drained_t, 20) << "drain_complete is timed at the pause, begin_install at its answer";
  EXPECT_GE(c->Update(1)->phases_ms["QUIESCED"], 20);
  EXPECT_GE(c->Update(1)->phases_ms["VALIDATING"], 15);
}

// The requester's own record of the request (the service's update_requested) is synced while the
// update starts: the Runner holds the pause until it is durable, and a failed sync rejects the
// update before anything is paused (the stage ran; it changed nothing served).
TEST(CrashFaultTest, TheRequestersRecordGatesThePauseAndItsFailureRejectsWithNothingPaused) {
  for (const bool fails : {false, true}) {
    SCOPED_TRACE(fails ? "the requester's sync fails" : "the requester's sync is slow");
    WatchedUpdate w(StageAndPauseEngine());
    auto& [clock, journal, engine, adapter, c, runner] = w;
    UpdateTarget t = Target("rc-1", "d1");
    Pending<bool> journaled;
    t.request_journaled = journaled;
    ASSERT_TRUE(runner.StartUpdate(t).ok());
    for (int ms = 0; ms < 30; ++ms) {  // the stage (5 ms) is long done; the request is not durable
      ASSERT_TRUE(runner.Poll());
      w.Tick();
    }
    EXPECT_EQ(adapter.seen["stage"].size(), 1u);
    EXPECT_EQ(adapter.seen["pause"].size(), 0u) << "no pause before the request is durable";
    EXPECT_EQ(c->state(), State::kDraining);
    journaled.Fulfill(fails ? Result<bool>(Unavailable("update journal: disk I/O error")) : Result<bool>(true));
    w.Run();
    EXPECT_EQ(c->state(), State::kReady);
    EXPECT_EQ(c->version().label, fails ? "rc-0" : "rc-1");
    EXPECT_EQ(adapter.seen["pause"].size(), fails ? 0u : 1u);
    EXPECT_FALSE(engine.paused());
    if (fails) {
      EXPECT_EQ(c->Update(1)->outcome, UpdateOutcome::kRejected);
      EXPECT_NE(c->Update(1)->reason.find("was not journaled"), std::string::npos) << c->Update(1)->reason;
    }
  }
}

// A crash between the pause and the batch that records its end: nothing but request_update is in
// the journal, the install the batch would authorize is never issued, the engine is resumed, and
// the restart comes back READY on the old version knowing the engine may be paused.
TEST(CrashFaultTest, CrashBeforeTheQuiesceBatchIssuesNoInstallAndRestartsReadyToResume) {
  WatchedUpdate w(StageAndPauseEngine());
  auto& [clock, journal, engine, adapter, c, runner] = w;
  adapter.crash_at_pause = true;
  ASSERT_TRUE(runner.StartUpdate(Target("rc-1", "d1")).ok());
  w.Run(2000);
  EXPECT_EQ(adapter.seen["pause"].size(), 1u);
  EXPECT_EQ(adapter.seen["install"].size(), 0u);
  EXPECT_EQ(adapter.seen["resume"].size(), 1u) << "the best-effort resume after the refused batch";
  for (int ms = 0; ms < 50; ++ms) w.Tick();
  EXPECT_FALSE(engine.paused());
  EXPECT_EQ(c->state(), State::kDraining) << "the dead journal refused the reject too";
  auto u = c->Update(1);
  ASSERT_TRUE(u);
  EXPECT_FALSE(u->evidence.contains("staged")) << "evidence shows only once it is durable";
  EXPECT_EQ(Events(journal.ReadAll().value()), (std::vector<std::string>{"initialize", "request_update"}));
  journal.FailAfter(-1);  // the restarted controller's journal works again
  RestoreSummary summary;
  auto restarted = std::move(Controller::Open(&clock, &journal, &summary)).value();
  EXPECT_EQ(summary.state_at_crash, State::kDraining);
  EXPECT_TRUE(summary.engine_may_be_paused);
  EXPECT_EQ(restarted->state(), State::kReady);
  EXPECT_EQ(restarted->version().label, "rc-0");
}

// A validation that fails after the resets: caches_reset is journaled on its own (what happened),
// then the taint, and the resume is never issued.
TEST(CrashFaultTest, AFailedValidationRecordsTheResetThenTaintsAndNeverResumes) {
  ScriptedEngineConfig cfg = StageAndPauseEngine();
  cfg.ops["content_digest"] = {OpScript{1, "wrong", 0}};
  WatchedUpdate w(cfg);
  auto& [clock, journal, engine, adapter, c, runner] = w;
  ASSERT_TRUE(runner.StartUpdate(Target("rc-1", "d1")).ok());
  w.Run();
  EXPECT_EQ(c->state(), State::kTainted);
  EXPECT_EQ(adapter.seen["resume"].size(), 0u);
  const auto events = Events(journal.ReadAll().value());
  ASSERT_GE(events.size(), 3u);
  EXPECT_EQ(events[events.size() - 3], "install_complete");
  EXPECT_EQ(events[events.size() - 2], "caches_reset");
  EXPECT_EQ(events.back(), "taint");
  const auto taint = journal.ReadAll().value().back();
  EXPECT_EQ(taint.from, "VALIDATING");
  EXPECT_NE(taint.detail.value("reason", "").find("digest"), std::string::npos) << taint.detail.dump();
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
