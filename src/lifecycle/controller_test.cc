#include "rolloutcore/lifecycle/controller.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>

namespace rc::lifecycle {
namespace {

UpdateTarget Target(const std::string& label, const std::string& digest, int64_t step = 1) {
  UpdateTarget t;
  t.label = label;
  t.identity.content_digest = digest;
  t.identity.step = step;
  t.identity.run = "run-a";
  return t;
}

class ControllerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    c_ = std::move(Controller::Open(&clock_, &journal_)).value();
    ASSERT_TRUE(c_->Initialize({"rc-0", 0}, {"d0", "ckpt-0", "run-a", 0}).ok());
  }
  void ToQuiesced() {
    ASSERT_TRUE(c_->RequestUpdate(Target("rc-1", "d1")).ok());
    ASSERT_TRUE(c_->DrainComplete({0, 0}).ok());
  }
  void ToValidating() {
    ToQuiesced();
    ASSERT_TRUE(c_->BeginInstall({true, 0}).ok());
    ASSERT_TRUE(c_->InstallComplete({"rc-1", 100, Json::object()}).ok());
    ASSERT_TRUE(c_->CachesReset({{CacheKind::kPrefix, true, 1, 0, true}}, {CacheKind::kPrefix}).ok());
  }
  ManualClock clock_;
  MemoryJournal journal_;
  std::unique_ptr<Controller> c_;
};

TEST_F(ControllerTest, AdmissionBindsVersionAndIdentity) {
  clock_.AdvanceMs(7);
  auto b = c_->Admit("r1");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->rollout_id, "r1");
  EXPECT_EQ(b->version.label, "rc-0");
  EXPECT_EQ(b->version.generation, 0);
  EXPECT_EQ(b->identity.content_digest, "d0");
  EXPECT_EQ(b->identity.checkpoint, "ckpt-0");
  EXPECT_EQ(b->admitted_at_ms, 7);
  EXPECT_EQ(c_->Admit("r1").status().code(), StatusCode::kAlreadyExists);
  auto generated = c_->Admit("");
  ASSERT_TRUE(generated.ok());
  EXPECT_EQ(generated->rollout_id, "r-1");
  EXPECT_EQ(c_->active_count(), 2);
  EXPECT_EQ(c_->counters().admissions, 2);
}

TEST_F(ControllerTest, DrainNeedsEngineIdleAndNoActiveBinding) {
  ASSERT_TRUE(c_->Admit("r1").ok());
  ASSERT_TRUE(c_->RequestUpdate(Target("rc-1", "d1")).ok());
  auto refused = c_->Admit("r2");
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(refused.status().message().find("retry"), std::string::npos);
  EXPECT_EQ(c_->counters().refusals, 1);

  // Engine idle, but a binding is active: not enough.
  Status s = c_->DrainComplete({0, 0});
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("r1"), std::string::npos);
  EXPECT_EQ(c_->state(), State::kDraining);
  ASSERT_TRUE(c_->Finish("r1").ok());
  // No binding, but the engine is busy (a client talking to it directly): not enough either.
  s = c_->DrainComplete({1, 0});
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("1 running"), std::string::npos);
  s = c_->DrainComplete({0, 2});
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(c_->state(), State::kDraining);
  EXPECT_TRUE(c_->DrainComplete({0, 0}).ok());
  EXPECT_EQ(c_->state(), State::kQuiesced);
}

TEST_F(ControllerTest, InstallNeedsConfirmedPause) {
  ToQuiesced();
  EXPECT_EQ(c_->BeginInstall({false, 0}).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(c_->BeginInstall({true, 2}).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(c_->state(), State::kQuiesced);
  EXPECT_TRUE(c_->BeginInstall({true, 0}).ok());
  // Install evidence for another label is not evidence for the target.
  Status s = c_->InstallComplete({"rc-9", 1, Json::object()});
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(c_->state(), State::kUpdating);
}

// The held install goes in the resume's batch: install_complete, caches_reset and validated in
// one sync, each timed when it happened; evidence that fails (another label, a reset refused)
// appends nothing and leaves the state where it was; a failed validation still records the
// install and the reset (the caller taints from VALIDATING).
TEST_F(ControllerTest, ResetAndValidatedCarriesTheHeldInstallInOneSync) {
  ToQuiesced();
  ASSERT_TRUE(c_->BeginInstall({true, 0}).ok());
  const std::vector<CacheResetResult> resets = {{CacheKind::kPrefix, true, 1, 0, true}};
  const std::vector<CacheKind> required = {CacheKind::kPrefix};
  const size_t before = journal_.size();
  const int64_t syncs = journal_.syncs();
  Status s = c_->ResetAndValidated(InstallEvidence{"rc-9", 1, Json::object()}, 3, resets, required, 4,
                                   LabelEvidence{"rc-1"}, DigestEvidence{"d1"}, true);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("rc-9"), std::string::npos) << s.message();
  s = c_->ResetAndValidated(InstallEvidence{"rc-1", 1, Json::object()}, 3,
                            {{CacheKind::kPrefix, false, 0, 2, true}}, required, 4, LabelEvidence{"rc-1"},
                            DigestEvidence{"d1"}, true);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(journal_.size(), before) << "refused evidence appends nothing";
  EXPECT_EQ(c_->state(), State::kUpdating);

  clock_.AdvanceMs(10);
  ASSERT_TRUE(c_->ResetAndValidated(InstallEvidence{"rc-1", 100, Json::object()}, 3, resets, required, 4,
                                    LabelEvidence{"rc-1"}, DigestEvidence{"d1"}, true)
                  .ok());
  EXPECT_EQ(c_->state(), State::kResuming);
  EXPECT_EQ(journal_.syncs(), syncs + 1) << "one sync for the three records";
  const auto records = journal_.ReadAll().value();
  ASSERT_EQ(records.size(), before + 3);
  EXPECT_EQ(records[before].event, "install_complete");
  EXPECT_EQ(records[before].t_ms, 3) << "timed when the install answered";
  EXPECT_EQ(records[before + 1].event, "caches_reset");
  EXPECT_EQ(records[before + 1].t_ms, 4);
  EXPECT_EQ(records[before + 2].event, "validated");
  EXPECT_EQ(records[before + 2].t_ms, 10);
  auto u = c_->Update(1);
  ASSERT_TRUE(u);
  EXPECT_EQ(u->evidence["install_complete"]["bytes"], 100);
}

TEST_F(ControllerTest, AFailedValidationStillRecordsTheHeldInstallAndTheReset) {
  ToQuiesced();
  ASSERT_TRUE(c_->BeginInstall({true, 0}).ok());
  Status s = c_->ResetAndValidated(InstallEvidence{"rc-1", 100, Json::object()}, -1,
                                   {{CacheKind::kPrefix, true, 1, 0, true}}, {CacheKind::kPrefix}, -1,
                                   LabelEvidence{"rc-1"}, DigestEvidence{"not-d1"}, true);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("not-d1"), std::string::npos) << s.message();
  EXPECT_EQ(c_->state(), State::kValidating);
  const auto records = journal_.ReadAll().value();
  ASSERT_GE(records.size(), 2u);
  EXPECT_EQ(records[records.size() - 2].event, "install_complete");
  EXPECT_EQ(records.back().event, "caches_reset");
}

TEST_F(ControllerTest, EveryCacheMustConfirmItsReset) {
  ToQuiesced();
  ASSERT_TRUE(c_->BeginInstall({true, 0}).ok());
  ASSERT_TRUE(c_->InstallComplete({"rc-1", 100, Json::object()}).ok());
  std::vector<CacheKind> required = {CacheKind::kPrefix, CacheKind::kEncoder};
  Status s = c_->CachesReset({{CacheKind::kPrefix, true, 3, 0, true}}, required);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("encoder"), std::string::npos);
  s = c_->CachesReset({{CacheKind::kPrefix, false, 0, 4, true}, {CacheKind::kEncoder, true, 0, 0, true}}, required);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("4 blocks in use"), std::string::npos);
  EXPECT_EQ(c_->state(), State::kInvalidating);
  EXPECT_TRUE(
      c_->CachesReset({{CacheKind::kPrefix, true, 3, 0, true}, {CacheKind::kEncoder, true, 0, 0, true}}, required)
          .ok());
}

// An empty-200 reset (vLLM's mm/encoder caches) passes unverified and the journal says so; the
// prefix cache must be verified.
TEST_F(ControllerTest, UnverifiedResetsAreNeverRecordedAsProven) {
  ToQuiesced();
  ASSERT_TRUE(c_->BeginInstall({true, 0}).ok());
  ASSERT_TRUE(c_->InstallComplete({"rc-1", 100, Json::object()}).ok());
  std::vector<CacheKind> required = {CacheKind::kPrefix, CacheKind::kEncoder};
  Status s =
      c_->CachesReset({{CacheKind::kPrefix, true, 0, 0, false}, {CacheKind::kEncoder, true, 0, 0, true}}, required);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("prefix cache reset is unverified"), std::string::npos) << s.message();
  EXPECT_EQ(c_->state(), State::kInvalidating);
  ASSERT_TRUE(
      c_->CachesReset({{CacheKind::kPrefix, true, 2, 0, true, 3}, {CacheKind::kEncoder, true, 0, 0, false}}, required)
          .ok());
  auto records = journal_.ReadAll();
  ASSERT_TRUE(records.ok());
  const JournalRecord& last = records->back();
  ASSERT_EQ(last.event, "caches_reset");
  EXPECT_EQ(last.detail["unverified"], Json::array({"encoder"})) << last.detail.dump();
  EXPECT_EQ(last.detail["evidence"][0]["verified"], true);
  EXPECT_EQ(last.detail["evidence"][0]["attempts"], 3);
  EXPECT_EQ(last.detail["evidence"][1]["verified"], false);
}

TEST_F(ControllerTest, ValidationChecksLabelAndDigest) {
  ToValidating();
  EXPECT_EQ(c_->Validated({"rc-0"}, DigestEvidence{"d1"}, true).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(c_->Validated({"rc-1"}, DigestEvidence{"dX"}, true).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(c_->Validated({"rc-1"}, std::nullopt, true).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(c_->state(), State::kValidating);
  EXPECT_TRUE(c_->Validated({"rc-1"}, DigestEvidence{"d1"}, true).ok());
  EXPECT_EQ(c_->Resumed({true}).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(c_->state(), State::kResuming);
  ASSERT_TRUE(c_->Resumed({false}).ok());
  EXPECT_EQ(c_->state(), State::kReady);
  EXPECT_EQ(c_->version(), (WeightVersion{"rc-1", 1}));
  EXPECT_EQ(c_->identity().content_digest, "d1");
  auto u = c_->Update(1);
  ASSERT_TRUE(u.has_value());
  EXPECT_EQ(u->outcome, UpdateOutcome::kCommitted);
  EXPECT_EQ(c_->counters().updates_committed, 1);
  // A binding after the commit carries the new version and identity.
  auto b = c_->Admit("r9");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->version.generation, 1);
  EXPECT_EQ(b->identity.content_digest, "d1");
}

TEST_F(ControllerTest, RejectFromUpdatingNeedsProofOfNoMutation) {
  ToQuiesced();
  ASSERT_TRUE(c_->BeginInstall({true, 0}).ok());
  EXPECT_EQ(c_->RejectBeforeMutation("timeout", false).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(c_->state(), State::kUpdating);
  EXPECT_TRUE(c_->RejectBeforeMutation("engine refused", true).ok());
  EXPECT_EQ(c_->state(), State::kReady);
  EXPECT_EQ(c_->version().label, "rc-0");
  EXPECT_EQ(c_->Update(1)->outcome, UpdateOutcome::kRejected);
}

TEST_F(ControllerTest, RecoveryNeedsDigestOfAllLiveWeights) {
  ToQuiesced();
  ASSERT_TRUE(c_->BeginInstall({true, 0}).ok());
  ASSERT_TRUE(c_->Taint("install failed").ok());
  EXPECT_EQ(c_->Admit("r1").status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(c_->BeginRecovery(Target("rc-0", "")).status().code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(c_->BeginRecovery(Target("rc-0", "d0")).ok());
  EXPECT_EQ(c_->Recovered({"rc-0", 1, {}}, {"rc-0"}, {"dX"}).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(c_->Recovered({"rc-0", 1, {}}, {"rc-1"}, {"d0"}).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(c_->state(), State::kRecovering);
  ASSERT_TRUE(c_->Recovered({"rc-0", 1, {}}, {"rc-0"}, {"d0"}).ok());
  EXPECT_EQ(c_->state(), State::kReady);
  EXPECT_EQ(c_->version(), (WeightVersion{"rc-0", 1}));
  EXPECT_EQ(c_->counters().recoveries, 1);
}

TEST_F(ControllerTest, JournalFailureChangesNothing) {
  ASSERT_TRUE(c_->Admit("r1").ok());
  journal_.FailAfter(0);
  EXPECT_FALSE(c_->Admit("r2").ok());
  EXPECT_FALSE(c_->Finish("r1").ok());
  EXPECT_FALSE(c_->RequestUpdate(Target("rc-1", "d1")).ok());
  EXPECT_EQ(c_->state(), State::kReady);
  EXPECT_EQ(c_->active_count(), 1);
  EXPECT_FALSE(c_->Binding("r2").has_value());
  journal_.FailAfter(-1);
  EXPECT_TRUE(c_->Finish("r1").ok());
}

TEST_F(ControllerTest, RestoreMidUpdateIsTaintedAndRolloutsInterrupted) {
  ASSERT_TRUE(c_->Admit("r1").ok());
  ASSERT_TRUE(c_->Finish("r1").ok());
  ToQuiesced();
  ASSERT_TRUE(c_->BeginInstall({true, 0}).ok());
  c_.reset();  // crash

  RestoreSummary summary;
  auto c2 = std::move(Controller::Open(&clock_, &journal_, &summary)).value();
  EXPECT_TRUE(summary.restored);
  EXPECT_EQ(summary.state_at_crash, State::kUpdating);
  EXPECT_EQ(summary.state_now, State::kTainted);
  EXPECT_EQ(c2->state(), State::kTainted);
  EXPECT_EQ(c2->version().label, "rc-0");
  EXPECT_EQ(c2->Update(1)->outcome, UpdateOutcome::kTainted);
  EXPECT_EQ(c2->counters().admissions, 1);
}

TEST_F(ControllerTest, RestoreWhileDrainingIsReadyOnOldVersion) {
  ASSERT_TRUE(c_->Admit("r1").ok());
  ASSERT_TRUE(c_->Admit("r2").ok());
  ASSERT_TRUE(c_->Finish("r2").ok());
  ASSERT_TRUE(c_->RequestUpdate(Target("rc-1", "d1")).ok());
  c_.reset();

  RestoreSummary summary;
  auto c2 = std::move(Controller::Open(&clock_, &journal_, &summary)).value();
  EXPECT_EQ(summary.state_at_crash, State::kDraining);
  EXPECT_EQ(c2->state(), State::kReady);
  EXPECT_EQ(c2->version().label, "rc-0");
  ASSERT_EQ(summary.interrupted, std::vector<std::string>{"r1"});
  EXPECT_EQ(c2->active_count(), 0);
  Status fin = c2->Finish("r1");
  EXPECT_EQ(fin.code(), StatusCode::kNotFound);
  EXPECT_NE(fin.message().find("interrupted"), std::string::npos);
  // The journal says so too, and the next update gets the next ordinal.
  auto records = journal_.ReadAll().value();
  EXPECT_EQ(records.back().event, "interrupted");
  EXPECT_EQ(records.back().rollout, "r1");
  auto t = c2->RequestUpdate(Target("rc-1", "d1"));
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->ordinal, 2);
  // A generated id after restart does not collide with one from before.
  ASSERT_TRUE(c2->RejectBeforeMutation("test", false).ok());
  auto g = c2->Admit("");
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->rollout_id, "r-1");
}

// Journal records are parsed to their kind once: every name the controller writes round-trips,
// and a name it does not know is a journal it cannot justify: Open fails with DataLoss naming the
// record and the name (before, an unknown name was applied as if it were a transition).
TEST(ControllerRecordTest, RecordEventNamesRoundTripAndUnknownOnesAreRefused) {
  for (int i = 0; i < kNumEvents; ++i) {
    const Event e = static_cast<Event>(i);
    auto t = ParseRecordEvent(EventName(e));
    ASSERT_TRUE(t.ok()) << EventName(e);
    EXPECT_EQ(t->kind, RecordKind::kTransition);
    EXPECT_EQ(t->event, e);
    EXPECT_EQ(RecordEventName(*t), EventName(e));
  }
  for (RecordKind k : {RecordKind::kRestart, RecordKind::kAdmit, RecordKind::kFinish, RecordKind::kAbortedByDrain,
                       RecordKind::kInterrupted, RecordKind::kStaged}) {
    const std::string_view name = RecordEventName(RecordEvent{k, Event::kInitialize});
    auto t = ParseRecordEvent(name);
    ASSERT_TRUE(t.ok()) << name;
    EXPECT_EQ(t->kind, k) << name;
  }
  EXPECT_EQ(RecordEventName(RecordEvent{RecordKind::kAdmit, Event::kInitialize}), "admit");
  auto bad = ParseRecordEvent("begin_instal");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("'begin_instal'"), std::string::npos) << bad.status().message();

  ManualClock clock;
  MemoryJournal journal;
  {
    auto c = std::move(Controller::Open(&clock, &journal)).value();
    ASSERT_TRUE(c->Initialize({"rc-0", 0}, {"d0", "ckpt-0", "run-a", 0}).ok());
    ASSERT_TRUE(c->Admit("r1").ok());
  }
  JournalRecord odd;
  odd.event = "teleport";
  odd.from = "READY";
  odd.to = "RESUMING";
  ASSERT_TRUE(journal.Append(odd).ok());
  RestoreSummary summary;
  auto reopened = Controller::Open(&clock, &journal, &summary);
  ASSERT_FALSE(reopened.ok()) << "an unknown record must not be applied as a transition to RESUMING";
  EXPECT_EQ(reopened.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(reopened.status().message().find("journal record 3"), std::string::npos) << reopened.status().message();
  EXPECT_NE(reopened.status().message().find("'teleport'"), std::string::npos) << reopened.status().message();
}

TEST(SqliteJournalTest, SurvivesReopenAndRestoresController) {
  auto path = (std::filesystem::temp_directory_path() / ("rc_journal_test_" + std::to_string(::getpid()) + ".db")).string();
  std::filesystem::remove(path);
  ManualClock clock;
  {
    auto j = std::move(SqliteJournal::Open(path)).value();
    auto c = std::move(Controller::Open(&clock, j.get())).value();
    ASSERT_TRUE(c->Initialize({"rc-0", 0}, {"d0", "", "", 0}).ok());
    ASSERT_TRUE(c->Admit("r1").ok());
    ASSERT_TRUE(c->RequestUpdate(Target("rc-1", "d1")).ok());
  }
  {
    auto j = std::move(SqliteJournal::Open(path)).value();
    auto records = j->ReadAll().value();
    ASSERT_EQ(records.size(), 3u);
    EXPECT_EQ(records[0].event, "initialize");
    EXPECT_EQ(records[1].rollout, "r1");
    EXPECT_EQ(records[2].detail["target"]["label"], "rc-1");
    RestoreSummary summary;
    auto c = std::move(Controller::Open(&clock, j.get(), &summary)).value();
    EXPECT_EQ(c->state(), State::kReady);
    EXPECT_EQ(summary.interrupted, std::vector<std::string>{"r1"});
    EXPECT_EQ(j->ReadSince(3).value().size(), 2u);  // restart + interrupted
  }
  std::filesystem::remove(path);
  std::filesystem::remove(path + "-wal");
  std::filesystem::remove(path + "-shm");
}

}  // namespace
}  // namespace rc::lifecycle

namespace rc::lifecycle {
namespace {

UpdateTarget InFlightTarget(const std::string& label, PolicyMode mode) {
  UpdateTarget t = Target(label, "d-" + label);
  t.mode = mode;
  return t;
}

// Drives QUIESCED → READY for the update in progress (an in-flight one: frozen requests running).
void CommitInFlight(Controller* c, const std::string& label, int64_t running) {
  ASSERT_TRUE(c->BeginInstall({true, running}).ok());
  ASSERT_TRUE(c->InstallComplete({label, 100, Json::object()}).ok());
  ASSERT_TRUE(c->CachesReset({{CacheKind::kPrefix, true, 1, running, true}}, {CacheKind::kPrefix}).ok());
  ASSERT_TRUE(c->Validated({label}, DigestEvidence{"d-" + label}, true).ok());
  ASSERT_TRUE(c->Resumed({false}).ok());
}

TEST_F(ControllerTest, InFlightUpdateKeepsRolloutsRecordsWhatTheySpannedAndEnforcesMaxStaleness) {
  ASSERT_TRUE(c_->Admit("r1").ok());
  // A strict update still drains: it cannot quiesce in flight, and DrainComplete refuses.
  ASSERT_TRUE(c_->RequestUpdate(Target("rc-1", "d1")).ok());
  EXPECT_EQ(c_->QuiesceInFlight({1, 0}, -1).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_FALSE(c_->DrainComplete({0, 0}).ok());
  ASSERT_TRUE(c_->RejectBeforeMutation("test", false).ok());

  ASSERT_TRUE(c_->RequestUpdate(InFlightTarget("v1", PolicyMode::kKeep)).ok());
  auto ends = c_->QuiesceInFlight({1, 0}, /*max_staleness=*/1);
  ASSERT_TRUE(ends.ok()) << ends.status().ToString();
  EXPECT_TRUE(ends->empty());
  EXPECT_EQ(c_->state(), State::kQuiesced);
  ASSERT_TRUE(c_->InFlight("r1"));
  EXPECT_EQ(c_->InFlight("r1")->spanned, std::vector<int64_t>{2});
  EXPECT_TRUE(c_->InFlight("r1")->aborted_at_update.is_null());
  CommitInFlight(c_.get(), "v1", 1);
  EXPECT_EQ(c_->version(), (WeightVersion{"v1", 1}));
  EXPECT_EQ(c_->counters().updates_by_mode.at("keep"), 1);
  EXPECT_EQ(c_->active_count(), 1) << "the rollout lives on across the update";

  // A second one would make r1 span two updates: with max staleness 1 this update ends it.
  ASSERT_TRUE(c_->Admit("r2").ok());
  ASSERT_TRUE(c_->RequestUpdate(InFlightTarget("v2", PolicyMode::kRecompute)).ok());
  ends = c_->QuiesceInFlight({2, 0}, 1);
  ASSERT_TRUE(ends.ok());
  EXPECT_EQ(*ends, std::vector<std::string>{"r1"});
  const Json why = c_->InFlight("r1")->aborted_at_update;
  EXPECT_EQ(why["reason"], "max_staleness");
  EXPECT_EQ(why["target"], "v2");
  EXPECT_EQ(why["update"], 3);
  EXPECT_EQ(c_->InFlight("r2")->spanned, std::vector<int64_t>{3});
  EXPECT_EQ(c_->counters().aborted_at_update, 0) << "an intent, not an outcome: r1 has not finished (issue 36 #6)";

  // The journal alone rebuilds the same records.
  // A controller restarted from a copy of the journal so far.
  std::vector<std::shared_ptr<MemoryJournal>> copies;  // outlive the controllers opened on them
  auto reopen = [&]() -> std::unique_ptr<Controller> {
    auto copy = std::make_shared<MemoryJournal>();
    copies.push_back(copy);
    const std::vector<JournalRecord> records = journal_.ReadAll().value();
    for (const JournalRecord& r : records) {
      JournalRecord c = r;
      EXPECT_TRUE(copy->Append(c).ok());
    }
    return Controller::Open(&clock_, copy.get()).value();
  };
  {
    auto again = reopen();
    // (A restart mid-update records the active rollouts interrupted; the counters replay.)
    EXPECT_EQ(again->counters().inflight_spans, 0) << "no rollout finished yet";
    EXPECT_EQ(again->counters().aborted_at_update, 0);
    EXPECT_EQ(again->counters().updates_by_mode.at("keep"), 1);
  }
  // Outcomes come from the finish records (written after the trajectory rows): r1 ended by the
  // update with two spans, r2 finished normally with one.
  const Json spans = Json::array({Json{{"from_token", 0}, {"to_token", 3}}, Json{{"from_token", 3}, {"to_token", 5}}});
  ASSERT_TRUE(c_->Finish("r1", Json{{"aborted_at_update", why}, {"version_spans", spans}}).ok());
  EXPECT_FALSE(c_->InFlight("r1")) << "a finished rollout's record goes with it";
  // r2's row could not be written: a finish with no row to agree with is not counted.
  ASSERT_TRUE(c_->Finish("r2", Json{{"aborted_at_update", why}, {"version_spans", spans}, {"trajectory_error", "disk full"}})
                  .ok());
  EXPECT_EQ(c_->counters().aborted_at_update, 1);
  EXPECT_EQ(c_->counters().inflight_spans, 1);
  {
    auto again = reopen();
    EXPECT_EQ(again->counters().aborted_at_update, 1) << "the journal rebuilds the outcomes";
    EXPECT_EQ(again->counters().inflight_spans, 1);
  }
}

TEST_F(ControllerTest, AbortModeInstallNeedsTheEngineIdle) {
  ASSERT_TRUE(c_->Admit("r1").ok());
  ASSERT_TRUE(c_->RequestUpdate(InFlightTarget("v1", PolicyMode::kAbort)).ok());
  auto ends = c_->QuiesceInFlight({1, 0}, -1);
  ASSERT_TRUE(ends.ok());
  EXPECT_EQ(*ends, std::vector<std::string>{"r1"});
  EXPECT_EQ(c_->InFlight("r1")->aborted_at_update["reason"], "mode_abort");
  EXPECT_EQ(c_->BeginInstall({true, 1}).code(), StatusCode::kFailedPrecondition) << "abort mode: nothing may run";
  EXPECT_TRUE(c_->BeginInstall({true, 0}).ok()) << "the binding may still be finishing on its proxy thread";
}

TEST(PolicyModeTest, NamesRoundTripAndStrictTargetsJournalAsBefore) {
  for (PolicyMode m : kAllPolicyModes) EXPECT_EQ(*PolicyModeFromName(PolicyModeName(m)), m);
  auto bad = PolicyModeFromName("lazy");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("'lazy'"), std::string::npos);
  UpdateTarget t = Target("v1", "d1");
  EXPECT_FALSE(ToJson(t).contains("mode")) << "strict records are unchanged";
  t.mode = PolicyMode::kRecompute;
  auto back = UpdateTargetFromJson(ToJson(t), "target");
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->mode, PolicyMode::kRecompute);
}

}  // namespace
}  // namespace rc::lifecycle
