// CompareReplay's rules (replay.h) and the Runner's replay step: a matching replay commits with
// the worst difference as evidence, a differing one taints naming probe and step, and a version
// without probes (or an engine without a replay path) validates as before with "skipped".
#include "rolloutcore/lifecycle/replay.h"

#include <gtest/gtest.h>

#include "rolloutcore/lifecycle/runner.h"
#include "rolloutcore/lifecycle/scripted_engine.h"

namespace rc::lifecycle {
namespace {

ReplayProbe Probe() {
  ReplayProbe p;
  p.name = "p0";
  p.prompt = {1, 2, 3};
  p.top_k = 2;
  p.expected = {ReplayStep{7, -0.5f, {{7, -0.5f}, {9, -1.5f}}}, ReplayStep{4, -0.25f, {{4, -0.25f}, {8, -2.0f}}}};
  return p;
}
ReplayEvidence Same() {
  ReplayEvidence e;
  e.steps = Probe().expected;
  return e;
}

TEST(CompareReplayTest, IdenticalNumbersMatchWithZeroDifference) {
  ReplayComparison c = CompareReplay(Probe(), Same(), 1e-4);
  EXPECT_TRUE(c.match) << c.mismatch;
  EXPECT_EQ(c.worst_logprob_diff, 0);
}

TEST(CompareReplayTest, DifferenceWithinToleranceIsTheWorstDifference) {
  ReplayEvidence e = Same();
  e.steps[1].logprob = -0.25f + 5e-5f;
  e.steps[1].top[0].second = e.steps[1].logprob;
  ReplayComparison c = CompareReplay(Probe(), e, 1e-4);
  EXPECT_TRUE(c.match) << c.mismatch;
  EXPECT_NEAR(c.worst_logprob_diff, 5e-5, 1e-6);
  EXPECT_EQ(c.worst_step, 1);
}

TEST(CompareReplayTest, LogprobBeyondToleranceNamesProbeAndStep) {
  ReplayEvidence e = Same();
  e.steps[1].top[1].second = -2.01f;
  ReplayComparison c = CompareReplay(Probe(), e, 1e-4);
  EXPECT_FALSE(c.match);
  EXPECT_EQ(c.mismatch_step, 1);
  EXPECT_NE(c.mismatch.find("probe p0 step 1"), std::string::npos) << c.mismatch;
  EXPECT_NE(c.mismatch.find("token 8"), std::string::npos) << c.mismatch;
}

TEST(CompareReplayTest, AnotherTokenIsAMismatchAtThatStep) {
  ReplayEvidence e = Same();
  e.steps[0].token = 9;
  ReplayComparison c = CompareReplay(Probe(), e, 1.0);
  EXPECT_FALSE(c.match);
  EXPECT_EQ(c.mismatch_step, 0);
  EXPECT_NE(c.mismatch.find("engine token 9"), std::string::npos) << c.mismatch;
  EXPECT_NE(c.mismatch.find("trainer token 7"), std::string::npos) << c.mismatch;
}

// vLLM's bf16 kernels against an f32 reference: a tie for first place may break the other way.
// Accepted only when the engine asks for it, and only when it is a tie on both sides.
TEST(CompareReplayTest, ATieForFirstPlaceEndsTheProbeOnlyWhenTheEngineAcceptsTies) {
  ReplayProbe p = Probe();
  p.expected[0] = ReplayStep{7, -0.70f, {{7, -0.70f}, {9, -0.71f}}};
  ReplayEvidence e = Same();
  e.steps[0] = ReplayStep{9, -0.705f, {{9, -0.705f}, {7, -0.707f}}};
  e.steps[1] = ReplayStep{3, -0.1f, {{3, -0.1f}, {5, -3.0f}}};  // another prefix: never compared
  ReplayComparison strict = CompareReplay(p, e, 0.02);
  EXPECT_FALSE(strict.match) << "exact engines accept no tie";
  EXPECT_EQ(strict.mismatch_step, 0);
  ReplayComparison tie = CompareReplay(p, e, 0.02, /*accept_ties=*/true);
  EXPECT_TRUE(tie.match) << tie.mismatch;
  EXPECT_EQ(tie.diverged_on_tie_step, 0);
  // Not a tie: the engine gives the trainer's token far less than its own choice.
  ReplayEvidence clear = e;
  clear.steps[0].top[1].second = -0.9f;
  ReplayComparison no = CompareReplay(p, clear, 0.02, true);
  EXPECT_FALSE(no.match);
  EXPECT_EQ(no.diverged_on_tie_step, -1);
  EXPECT_NE(no.mismatch.find("engine token 9"), std::string::npos) << no.mismatch;
  // Not a tie either: the trainer's own top-k does not hold the engine's token within tolerance.
  ReplayProbe far = p;
  far.expected[0].top[1] = {9, -0.9f};
  EXPECT_FALSE(CompareReplay(far, e, 0.02, true).match);
}

TEST(CompareReplayTest, MissingStepsAndTopKTokensAreMismatches) {
  ReplayEvidence shorter = Same();
  shorter.steps.pop_back();
  EXPECT_FALSE(CompareReplay(Probe(), shorter, 1e-4).match);
  ReplayEvidence other = Same();
  other.steps[0].top[1] = {11, -1.0f};  // the trainer's 9 (-1.5) is not there and not a boundary tie
  ReplayComparison c = CompareReplay(Probe(), other, 1e-4);
  EXPECT_FALSE(c.match);
  EXPECT_NE(c.mismatch.find("top-k token 9"), std::string::npos) << c.mismatch;
  // A tie at the boundary: the engine's k-th is another token with the same logprob.
  ReplayEvidence tie = Same();
  tie.steps[0].top[1] = {12, -1.5f};
  EXPECT_TRUE(CompareReplay(Probe(), tie, 1e-4).match);
}

TEST(CompareReplayTest, NanIsNeverWithinTolerance) {
  ReplayEvidence e = Same();
  e.steps[0].logprob = std::nanf("");
  EXPECT_FALSE(CompareReplay(Probe(), e, 1e-4).match);
}

TEST(ReplayJsonTest, EvidenceRoundTripsAndBadBodiesNameTheField) {
  auto back = ReplayEvidenceFromJson(ToJson(Same()), "replay");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_TRUE(CompareReplay(Probe(), *back, 0).match);
  auto bad = ReplayEvidenceFromJson(Json{{"steps", Json::array({Json{{"token", 1}}})}}, "replay");
  EXPECT_NE(bad.status().message().find("replay.steps[0]"), std::string::npos) << bad.status().ToString();
  auto req = ReplayRequestFromJson(Json{{"prompt", {1}}, {"steps", 0}}, 64, 20);
  EXPECT_NE(req.status().message().find("steps"), std::string::npos);
}

// Where the numbers were computed travels with the evidence; an engine that does not say computed
// them live; a wrongly typed field is refused by name.
TEST(ReplayJsonTest, PrecomputedAndWhereRoundTrip) {
  ReplayEvidence e = Same();
  e.precomputed = true;
  e.computed_on = "staged_image";
  e.staged_ms = 12.5;
  auto back = ReplayEvidenceFromJson(ToJson(e), "replay");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_TRUE(back->precomputed);
  EXPECT_EQ(back->computed_on, "staged_image");
  EXPECT_EQ(back->staged_ms, 12.5);
  Json old = ToJson(Same());
  old.erase("precomputed");
  old.erase("computed_on");
  old.erase("staged_ms");
  auto live = ReplayEvidenceFromJson(old, "replay");
  ASSERT_TRUE(live.ok()) << live.status().ToString();
  EXPECT_FALSE(live->precomputed);
  EXPECT_EQ(live->computed_on, "live");
  Json bad = ToJson(e);
  bad["precomputed"] = "yes";
  EXPECT_NE(ReplayEvidenceFromJson(bad, "replay").status().message().find("replay.precomputed"), std::string::npos);
}

// A ScriptedEngine with a replay path whose answers the test sets (delegates everything else).
class ReplayingEngine final : public EngineAdapter {
 public:
  ReplayingEngine(const Clock* clock, ScriptedEngineConfig cfg) : inner_(clock, std::move(cfg)) {}
  Result<EngineDescription> Describe() override {
    RC_ASSIGN_OR_RETURN(EngineDescription d, inner_.Describe());
    d.offers_replay = offers;
    return d;
  }
  Pending<DrainStatus> GetDrainStatus() override { return inner_.GetDrainStatus(); }
  Pending<PauseEvidence> Pause(PauseMode m) override { return inner_.Pause(m); }
  Pending<AbortEvidence> AbortRequests(const std::vector<std::string>& ids) override {
    return inner_.AbortRequests(ids);
  }
  Pending<StageEvidence> Stage(const UpdateTarget& t) override { return inner_.Stage(t); }
  Pending<InstallEvidence> Install(const UpdateTarget& t, bool full) override { return inner_.Install(t, full); }
  Pending<CacheResetResult> ResetCache(CacheKind k) override { return inner_.ResetCache(k); }
  Pending<LabelEvidence> ReadLabel() override { return inner_.ReadLabel(); }
  Pending<DigestEvidence> ReadContentDigest() override { return inner_.ReadContentDigest(); }
  Pending<ResumeEvidence> Resume() override { return inner_.Resume(); }
  Pending<IdentityEvidence> ProbeIdentity() override { return inner_.ProbeIdentity(); }
  Pending<ReplayEvidence> Replay(const ReplayRequest& r) override {
    ++calls;
    EXPECT_TRUE(inner_.paused()) << "replay must run while paused";
    EXPECT_EQ(r.steps, 2);
    return Pending<ReplayEvidence>::Completed(answer);
  }
  std::vector<std::string> Tick() { return inner_.Tick(); }
  bool paused() const { return inner_.paused(); }
  bool offers = true;
  int calls = 0;
  ReplayEvidence answer = Same();

 private:
  ScriptedEngine inner_;
};

class RunnerReplayTest : public ::testing::Test {
 protected:
  void Build(bool offers) {
    ScriptedEngineConfig cfg;
    cfg.label = "rc-0";
    cfg.digest = "d0";
    engine_ = std::make_unique<ReplayingEngine>(&clock_, cfg);
    engine_->offers = offers;
    c_ = std::move(Controller::Open(&clock_, &journal_)).value();
    ASSERT_TRUE(c_->Initialize({"rc-0", 0}, {"d0", "", "", 0}).ok());
    runner_ = std::make_unique<Runner>(c_.get(), engine_.get(), &clock_, RunnerOptions{});
  }
  UpdateRecord Update(bool with_probes) {
    UpdateTarget t;
    t.label = "rc-1";
    t.identity.content_digest = "d1";
    if (with_probes) {
      t.probes = {Probe(), Probe()};
      t.probes[1].name = "p1";
    }
    EXPECT_TRUE(runner_->StartUpdate(t).ok());
    for (int i = 0; i < 100000 && runner_->Poll(); ++i) {
      clock_.AdvanceMs(1);
      (void)engine_->Tick();
    }
    return *c_->Update(1);
  }
  ManualClock clock_;
  MemoryJournal journal_;
  std::unique_ptr<ReplayingEngine> engine_;
  std::unique_ptr<Controller> c_;
  std::unique_ptr<Runner> runner_;
};

TEST_F(RunnerReplayTest, MatchingReplayCommitsWithItsEvidence) {
  Build(true);
  engine_->answer.steps[1].logprob += 2e-5f;
  UpdateRecord u = Update(true);
  ASSERT_EQ(u.outcome, UpdateOutcome::kCommitted) << u.reason;
  EXPECT_EQ(engine_->calls, 2);
  const Json& r = u.evidence["validated"]["replay"];
  EXPECT_FALSE(r["skipped"].get<bool>());
  EXPECT_TRUE(r["match"].get<bool>());
  EXPECT_EQ(r["probes"], 2);
  EXPECT_EQ(r["tokens"], 4);
  EXPECT_NEAR(r["worst_logprob_diff"].get<double>(), 2e-5, 1e-6);
  EXPECT_EQ(r["worst_step"], 1);
  EXPECT_EQ(r["precomputed"], 0);
  EXPECT_EQ(r["computed_on"], "live");
}

// Probes the engine answered from its pre-replay are counted, and the record says where.
TEST_F(RunnerReplayTest, PrecomputedAnswersAreCountedInTheEvidence) {
  Build(true);
  engine_->answer.precomputed = true;
  engine_->answer.computed_on = "staged_image";
  engine_->answer.staged_ms = 7.0;
  UpdateRecord u = Update(true);
  ASSERT_EQ(u.outcome, UpdateOutcome::kCommitted) << u.reason;
  const Json& r = u.evidence["validated"]["replay"];
  EXPECT_EQ(r["precomputed"], 2);
  EXPECT_EQ(r["computed_on"], "staged_image");
  EXPECT_EQ(r["staged_ms"].get<double>(), 7.0);
}

TEST_F(RunnerReplayTest, DifferingReplayTaintsNamingProbeAndStep) {
  Build(true);
  engine_->answer.steps[1].token = 5;
  UpdateRecord u = Update(true);
  ASSERT_EQ(u.outcome, UpdateOutcome::kTainted);
  EXPECT_EQ(c_->state(), State::kTainted);
  EXPECT_NE(u.reason.find("replay: probe p0 step 1"), std::string::npos) << u.reason;
  EXPECT_TRUE(engine_->paused()) << "a tainted engine is not resumed";
}

TEST_F(RunnerReplayTest, ToleranceOptionOverridesTheEngineBound) {
  ScriptedEngineConfig cfg;
  cfg.label = "rc-0";
  cfg.digest = "d0";
  engine_ = std::make_unique<ReplayingEngine>(&clock_, cfg);
  c_ = std::move(Controller::Open(&clock_, &journal_)).value();
  ASSERT_TRUE(c_->Initialize({"rc-0", 0}, {"d0", "", "", 0}).ok());
  RunnerOptions o;
  o.replay_tolerance = 1e-6;
  runner_ = std::make_unique<Runner>(c_.get(), engine_.get(), &clock_, o);
  engine_->answer.steps[1].logprob += 2e-5f;  // within the engine's 1e-4, not within 1e-6
  UpdateRecord u = Update(true);
  EXPECT_EQ(u.outcome, UpdateOutcome::kTainted) << u.reason;
}

TEST_F(RunnerReplayTest, VersionWithoutProbesIsSkipped) {
  Build(true);
  UpdateRecord u = Update(false);
  ASSERT_EQ(u.outcome, UpdateOutcome::kCommitted) << u.reason;
  EXPECT_EQ(engine_->calls, 0);
  EXPECT_TRUE(u.evidence["validated"]["replay"]["skipped"].get<bool>());
  EXPECT_EQ(u.evidence["validated"]["replay"]["reason"], "version rc-1 has no probes");
}

TEST_F(RunnerReplayTest, EngineWithoutReplayPathIsSkipped) {
  Build(false);
  UpdateRecord v = Update(true);
  ASSERT_EQ(v.outcome, UpdateOutcome::kCommitted) << v.reason;
  EXPECT_EQ(engine_->calls, 0);
  EXPECT_NE(v.evidence["validated"]["replay"]["reason"].get<std::string>().find("offers no replay path"),
            std::string::npos);
}

}  // namespace
}  // namespace rc::lifecycle
