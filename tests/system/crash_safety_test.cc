// Issue #6, "Crash safety": kill -9 the controller in each phase of an update and restart it over
// the same --state-dir.
//
// Each phase is held deterministically: DRAINING by a long rollout still generating, the others
// by the engine's fault hooks (docs/engine.md), which delay the answer of the call the controller
// makes in that phase after the call took effect — QUIESCED: pause, UPDATING: install,
// INVALIDATING: the prefix-cache reset, VALIDATING: the digest read, RESUMING: resume,
// RECOVERING: the recovery's install. The controller is SIGKILLed as soon as /v1/status shows
// the phase.
//
// After each restart:
// - the state is the one the journal justifies: the restart record's `from` is the state of the
//   last transition before it; DRAINING / QUIESCED come back READY on the old version (nothing
//   was touched), the mutating phases come back TAINTED (live weights unproven); the label is
//   the last committed one in the journal;
// - no rollout is lost: every admitted rollout has a finish record and a trajectory row, or an
//   `interrupted` record (the long rollout of the DRAINING case must be the latter);
// - the restarted controller completes an update (READY) or a recovery (TAINTED) to the target,
//   and the engine's live digest is the target's manifest digest.
#include <set>

#include "system/system_fixture.h"

namespace rc::system_test {
namespace {

class CrashSafetyTest : public SystemTest {
 protected:
  // The transition records' last `to` before seq `before`.
  static std::string LastStateBefore(const std::vector<Json>& journal, int64_t before) {
    std::string state;
    for (const Json& r : journal) {
      if (r["seq"].get<int64_t>() >= before) break;
      if (r["to"].is_string()) state = r["to"];
    }
    return state;
  }
  static std::string LastCommittedLabel(const std::vector<Json>& journal) {
    std::string label;
    for (const Json& r : journal) {
      std::string ev = r.value("event", std::string());
      if ((ev == "initialize" || ev == "resumed" || ev == "recovered") && r["detail"].contains("version")) {
        label = r["detail"]["version"].value("label", label);
      }
    }
    return label;
  }

  // Every admitted rollout is finished with a trajectory row, or recorded interrupted.
  void ExpectNoRolloutLost(int ctl, std::set<std::string>* interrupted_out = nullptr) {
    std::vector<Json> j = Journal(ctl);
    std::set<std::string> admitted, finished, interrupted, with_row;
    for (const Json& r : j) {
      std::string ev = r.value("event", std::string());
      std::string id = r["rollout"].is_string() ? r["rollout"].get<std::string>() : "";
      if (ev == "admit") admitted.insert(id);
      if (ev == "finish") finished.insert(id);
      if (ev == "interrupted") interrupted.insert(id);
    }
    for (const Json& t : Trajectories(ctl, "")) with_row.insert(t["binding"]["rollout_id"].get<std::string>());
    EXPECT_FALSE(admitted.empty());
    for (const std::string& id : admitted) {
      bool ok = (finished.count(id) && with_row.count(id)) || interrupted.count(id);
      EXPECT_TRUE(ok) << "rollout " << id << " is lost: finished=" << finished.count(id)
                      << " trajectory=" << with_row.count(id) << " interrupted=" << interrupted.count(id);
    }
    if (interrupted_out) *interrupted_out = interrupted;
  }

  // Kills the controller in `phase` of the update to `target`, restarts it, checks the restart
  // against the journal, then completes the update or a recovery to `target`.
  void CrashIn(Stack& s, const std::string& phase, const std::string& target, const std::string& old_label,
               const Json& faults, bool recovery_first = false) {
    SCOPED_TRACE("crash in " + phase + " of the update to " + target);
    Json manifest = WaitCommitted(s.dir, target);
    // Two short rollouts that finish before the update (only READY admits).
    for (int k = 0; k < 2 && !recovery_first; ++k) {
      Reply r = Rollout(s.ctl, Prompt(12, k), 4, phase + "-short-" + std::to_string(k));
      ASSERT_EQ(r.status, 200) << r.text;
    }
    SetFaults(s.engine, faults);
    std::thread long_client;
    Reply long_reply;
    const std::string long_id = phase + "-long", lease_id = phase + "-lease";
    if (phase == "DRAINING") {
      // The drain is held by a lease (a rollout the client generates itself: admitted, never
      // finished before the crash), which holds it deterministically however fast the engine
      // is, and by a long proxied rollout generating on the engine (on tiny it may or may not
      // finish before the kill; either way it must not be lost).
      Json lease = Call(s.ctl, "POST", "/v1/rollouts:admit", Json{{"rollout_id", lease_id}});
      EXPECT_EQ(lease["label"], old_label);
      long_client = std::thread([&] { long_reply = Rollout(s.ctl, Prompt(24, 5), 400, long_id); });
      bool running = false;
      for (int i = 0; i < 5000 && !running; ++i) {
        running = Call(s.engine, "GET", "/rc/engine/state").value("num_running", 0) > 0;
        if (!running) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      EXPECT_TRUE(running || long_reply.status == 200);
    }
    RequestUpdate(s.ctl, target, recovery_first);
    auto seen = WaitState(s.ctl, phase, 30000, 1);
    ASSERT_TRUE(seen) << "never saw " << phase << "; state " << StateOf(s.ctl);
    const int64_t kill_ms = NowMs();
    s.ctl_proc->Kill();
    Figure("kill_after_" + phase + "_seen_ms", kill_ms - *seen);
    if (long_client.joinable()) long_client.join();
    SetFaults(s.engine, Json::object());

    RestartController(s, /*kill_first=*/false);
    std::vector<Json> j = Journal(s.ctl);
    auto restart = FindLast(j, "restart");
    ASSERT_TRUE(restart);
    const bool mutated = phase != "DRAINING" && phase != "QUIESCED";
    const std::string expect_state = mutated ? "TAINTED" : "READY";
    EXPECT_EQ((*restart)["from"], phase) << "the journal's last state before the crash";
    EXPECT_EQ(LastStateBefore(j, (*restart)["seq"]), phase);
    EXPECT_EQ((*restart)["to"], expect_state) << (*restart).dump();
    Json st = EngineStatus(s.ctl);
    EXPECT_EQ(st["state"], expect_state);
    EXPECT_EQ(st["label"], old_label);
    EXPECT_EQ(st["label"], LastCommittedLabel(j)) << "the label is the journal's last commit";
    std::set<std::string> interrupted;
    ExpectNoRolloutLost(s.ctl, &interrupted);
    if (phase == "DRAINING") {
      EXPECT_TRUE(interrupted.count(lease_id)) << "the lease alive at the crash is recorded interrupted";
      EXPECT_EQ(Http(s.ctl, "POST", "/v1/rollouts/" + lease_id + ":finish", Json{{"token_ids", {1, 2}}}).status, 404)
          << "an interrupted rollout cannot be finished later";
      std::cout << "long proxied rollout: " << (interrupted.count(long_id) ? "interrupted" : "finished before the crash")
                << std::endl;
    }
    if (mutated) {
      EXPECT_EQ(Rollout(s.ctl, Prompt(8, 1), 2).status, 503) << "TAINTED admits nothing";
    } else {
      // READY on the old version, engine resumed (best effort): rollouts run on the old label.
      Reply r;
      for (int i = 0; i < 200 && r.status != 200; ++i) {
        r = Rollout(s.ctl, Prompt(8, 1), 2, phase + "-after-restart-" + std::to_string(i));
        if (r.status != 200) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      ASSERT_EQ(r.status, 200) << r.text;
      EXPECT_EQ(r.json["binding"]["label"], old_label);
      EXPECT_EQ(r.json["choices"][0]["weight_version"], old_label);
    }

    // The restarted controller finishes the job.
    const int64_t t = NowMs();
    Json done = UpdateAndWait(s.ctl, target, /*recovery=*/mutated);
    ASSERT_EQ(done.value("outcome", ""), "committed") << done.dump();
    Figure((mutated ? "recovery_after_crash_in_" : "update_after_crash_in_") + phase + "_ms", NowMs() - t);
    st = EngineStatus(s.ctl);
    EXPECT_EQ(st["state"], "READY");
    EXPECT_EQ(st["label"], target);
    EXPECT_EQ(st["identity"]["content_digest"], manifest["content_digest"]);
    EXPECT_EQ(LiveDigest(s.engine), manifest["content_digest"]);
    Reply r = Rollout(s.ctl, Prompt(8, 2), 2, phase + "-on-" + target);
    ASSERT_EQ(r.status, 200) << r.text;
    EXPECT_EQ(r.json["binding"]["label"], target);
    EXPECT_EQ(r.json["choices"][0]["weight_version"], target);
    ExpectNoRolloutLost(s.ctl);
  }
};

constexpr int64_t kHoldMs = 3000;  // how long a fault holds a phase (the kill comes first)

TEST_F(CrashSafetyTest, KilledBeforeMutationComesBackReadyOnTheOldVersion) {
  Stack s = StartStack();
  ASSERT_FALSE(HasFailure());
  Step(s, "v1");
  CrashIn(s, "DRAINING", "v1", "v0", Json::object());
  if (HasFatalFailure()) return;
  Step(s, "v2");
  CrashIn(s, "QUIESCED", "v2", "v1", Json{{"pause_delay_ms", kHoldMs}});
}

TEST_F(CrashSafetyTest, KilledWhileMutatingComesBackTaintedAndRecovers) {
  Stack s = StartStack();
  ASSERT_FALSE(HasFailure());
  Step(s, "v1");
  CrashIn(s, "UPDATING", "v1", "v0", Json{{"install_delay_ms", kHoldMs}});
  if (HasFatalFailure()) return;
  Step(s, "v2");
  CrashIn(s, "INVALIDATING", "v2", "v1", Json{{"reset_delay_ms", kHoldMs}});
  if (HasFatalFailure()) return;
  Step(s, "v3");
  CrashIn(s, "VALIDATING", "v3", "v2", Json{{"digest_delay_ms", kHoldMs}});
  if (HasFatalFailure()) return;
  Step(s, "v4");
  CrashIn(s, "RESUMING", "v4", "v3", Json{{"resume_delay_ms", kHoldMs}});
}

TEST_F(CrashSafetyTest, KilledWhileRecoveringComesBackTaintedAndRecovers) {
  Stack s = StartStack();
  ASSERT_FALSE(HasFailure());
  Step(s, "v1");
  for (int k = 0; k < 2; ++k) ASSERT_EQ(Rollout(s.ctl, Prompt(12, k), 4, "pre-" + std::to_string(k)).status, 200);
  // First get TAINTED (a crash in UPDATING), then crash the recovery itself.
  SetFaults(s.engine, Json{{"install_delay_ms", kHoldMs}});
  RequestUpdate(s.ctl, "v1");
  ASSERT_TRUE(WaitState(s.ctl, "UPDATING", 30000, 1));
  RestartController(s);
  ASSERT_EQ(StateOf(s.ctl), "TAINTED");
  CrashIn(s, "RECOVERING", "v1", "v0", Json{{"install_delay_ms", kHoldMs}}, /*recovery_first=*/true);
}

}  // namespace
}  // namespace rc::system_test
