// Every (state, event) pair: legal ones move as specified, illegal ones are refused and change
// nothing — checked through the real Controller, against a table written out independently here.
#include "rolloutcore/lifecycle/state.h"

#include <gtest/gtest.h>

#include <map>
#include <memory>

#include "rolloutcore/base/clock.h"
#include "rolloutcore/lifecycle/controller.h"
#include "rolloutcore/lifecycle/journal.h"

namespace rc::lifecycle {
namespace {

using S = State;
using E = Event;

// The specification, spelled out by hand (DESIGN.md, "The lifecycle contract").
const std::map<std::pair<S, E>, S>& Spec() {
  static const std::map<std::pair<S, E>, S> spec = {
      {{S::kUninitialized, E::kInitialize}, S::kReady},
      {{S::kReady, E::kRequestUpdate}, S::kDraining},
      {{S::kDraining, E::kDrainComplete}, S::kQuiesced},
      {{S::kQuiesced, E::kBeginInstall}, S::kUpdating},
      {{S::kUpdating, E::kInstallComplete}, S::kInvalidating},
      {{S::kInvalidating, E::kCachesReset}, S::kValidating},
      {{S::kValidating, E::kValidated}, S::kResuming},
      {{S::kResuming, E::kResumed}, S::kReady},
      {{S::kDraining, E::kRejectBeforeMutation}, S::kReady},
      {{S::kQuiesced, E::kRejectBeforeMutation}, S::kReady},
      {{S::kUpdating, E::kRejectBeforeMutation}, S::kReady},
      {{S::kReady, E::kTaint}, S::kTainted},  // identity check failed (engine restarted, ...)
      {{S::kUpdating, E::kTaint}, S::kTainted},
      {{S::kInvalidating, E::kTaint}, S::kTainted},
      {{S::kValidating, E::kTaint}, S::kTainted},
      {{S::kResuming, E::kTaint}, S::kTainted},
      {{S::kRecovering, E::kTaint}, S::kTainted},
      {{S::kTainted, E::kBeginRecovery}, S::kRecovering},
      {{S::kRecovering, E::kRecovered}, S::kReady},
  };
  return spec;
}

UpdateTarget Target(const std::string& label, const std::string& digest) {
  UpdateTarget t;
  t.label = label;
  t.identity.content_digest = digest;
  return t;
}

// A controller over a fresh journal, driven along legal edges with valid evidence.
struct Fixture {
  ManualClock clock;
  MemoryJournal journal;
  std::unique_ptr<Controller> c;

  Fixture() { c = std::move(Controller::Open(&clock, &journal)).value(); }

  // Applies `event` with evidence that satisfies its postcondition.
  Status Apply(E event) {
    clock.AdvanceMs(1);
    switch (event) {
      case E::kInitialize: return c->Initialize({"rc-0", 0}, {"d0", "", "", 0});
      case E::kRequestUpdate: return c->RequestUpdate(Target("rc-1", "d1")).status();
      case E::kDrainComplete: return c->DrainComplete(DrainStatus{0, 0});
      case E::kBeginInstall: return c->BeginInstall(PauseEvidence{true, 0});
      case E::kInstallComplete: return c->InstallComplete(InstallEvidence{Pending(), 10, Json::object()});
      case E::kCachesReset:
        return c->CachesReset({CacheResetResult{CacheKind::kPrefix, true, 3, 0, true}}, {CacheKind::kPrefix});
      case E::kValidated: return c->Validated(LabelEvidence{Pending()}, DigestEvidence{PendingDigest()}, true);
      case E::kResumed: return c->Resumed(ResumeEvidence{false});
      case E::kRejectBeforeMutation: return c->RejectBeforeMutation("test", true);
      case E::kTaint: return c->Taint("test");
      case E::kBeginRecovery: return c->BeginRecovery(Target("rc-0", "d0")).status();
      case E::kRecovered:
        return c->Recovered(InstallEvidence{Pending(), 10, Json::object()}, LabelEvidence{Pending()},
                            DigestEvidence{PendingDigest()});
    }
    return Internal("unknown event");
  }
  std::string Pending() const {
    auto p = c->pending_target();
    return p ? p->label : "none";
  }
  std::string PendingDigest() const {
    auto p = c->pending_target();
    return p ? p->identity.content_digest : "none";
  }

  void DriveTo(S target) {
    static const std::map<S, std::vector<E>> kPaths = {
        {S::kUninitialized, {}},
        {S::kReady, {E::kInitialize}},
        {S::kDraining, {E::kInitialize, E::kRequestUpdate}},
        {S::kQuiesced, {E::kInitialize, E::kRequestUpdate, E::kDrainComplete}},
        {S::kUpdating, {E::kInitialize, E::kRequestUpdate, E::kDrainComplete, E::kBeginInstall}},
        {S::kInvalidating,
         {E::kInitialize, E::kRequestUpdate, E::kDrainComplete, E::kBeginInstall, E::kInstallComplete}},
        {S::kValidating,
         {E::kInitialize, E::kRequestUpdate, E::kDrainComplete, E::kBeginInstall, E::kInstallComplete,
          E::kCachesReset}},
        {S::kResuming,
         {E::kInitialize, E::kRequestUpdate, E::kDrainComplete, E::kBeginInstall, E::kInstallComplete,
          E::kCachesReset, E::kValidated}},
        {S::kTainted, {E::kInitialize, E::kRequestUpdate, E::kDrainComplete, E::kBeginInstall, E::kTaint}},
        {S::kRecovering,
         {E::kInitialize, E::kRequestUpdate, E::kDrainComplete, E::kBeginInstall, E::kTaint, E::kBeginRecovery}},
    };
    for (E e : kPaths.at(target)) ASSERT_TRUE(Apply(e).ok()) << EventName(e);
    ASSERT_EQ(c->state(), target);
  }
};

TEST(StateTableTest, TableEqualsSpecification) {
  for (int s = 0; s < kNumStates; ++s) {
    for (int e = 0; e < kNumEvents; ++e) {
      auto key = std::make_pair(static_cast<S>(s), static_cast<E>(e));
      auto it = Spec().find(key);
      auto next = NextState(key.first, key.second);
      if (it == Spec().end()) {
        EXPECT_FALSE(next.has_value()) << StateName(key.first) << " + " << EventName(key.second);
      } else {
        ASSERT_TRUE(next.has_value()) << StateName(key.first) << " + " << EventName(key.second);
        EXPECT_EQ(*next, it->second);
      }
    }
  }
}

TEST(StateTableTest, EveryStateEventPairThroughTheController) {
  int legal = 0, illegal = 0;
  for (int s = 0; s < kNumStates; ++s) {
    for (int e = 0; e < kNumEvents; ++e) {
      S state = static_cast<S>(s);
      E event = static_cast<E>(e);
      SCOPED_TRACE(std::string(StateName(state)) + " + " + std::string(EventName(event)));
      Fixture f;
      f.DriveTo(state);
      size_t records_before = f.journal.size();
      auto version_before = f.c->version();
      Status st = f.Apply(event);
      auto it = Spec().find({state, event});
      if (it != Spec().end()) {
        ++legal;
        ASSERT_TRUE(st.ok()) << st.ToString();
        EXPECT_EQ(f.c->state(), it->second);
        EXPECT_EQ(f.journal.size(), records_before + 1) << "every transition is journaled";
      } else {
        ++illegal;
        EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.ToString();
        EXPECT_NE(st.message().find("illegal transition"), std::string::npos) << st.message();
        EXPECT_EQ(f.c->state(), state) << "an illegal event changes nothing";
        EXPECT_EQ(f.journal.size(), records_before) << "an illegal event writes nothing";
        EXPECT_EQ(f.c->version(), version_before);
      }
    }
  }
  EXPECT_EQ(legal, static_cast<int>(Spec().size()));
  EXPECT_EQ(legal + illegal, kNumStates * kNumEvents);
}

TEST(StateTableTest, AdmissionOnlyInReadyAndFinishEverywhere) {
  for (int s = 0; s < kNumStates; ++s) {
    S state = static_cast<S>(s);
    SCOPED_TRACE(StateName(state));
    Fixture f;
    f.DriveTo(state);
    size_t before = f.journal.size();
    auto b = f.c->Admit("x");
    if (state == S::kReady) {
      ASSERT_TRUE(b.ok());
      EXPECT_EQ(f.c->active_count(), 1);
      EXPECT_TRUE(f.c->Finish("x").ok());
      EXPECT_EQ(f.c->active_count(), 0);
    } else {
      ASSERT_FALSE(b.ok());
      EXPECT_EQ(b.status().code(), StatusCode::kUnavailable);
      EXPECT_EQ(f.journal.size(), before);
      EXPECT_EQ(f.c->state(), state);
      EXPECT_EQ(f.c->Finish("x").code(), StatusCode::kNotFound);
    }
  }
}

TEST(StateTableTest, NamesRoundTrip) {
  for (int s = 0; s < kNumStates; ++s) {
    auto st = static_cast<S>(s);
    EXPECT_EQ(StateFromName(StateName(st)), st);
  }
  EXPECT_FALSE(StateFromName("NOPE").has_value());
}

}  // namespace
}  // namespace rc::lifecycle
