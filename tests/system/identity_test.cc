// Issue 13, defects 1, 2, 7 (restart claim) and 10 (recover on READY): the controller notices an
// engine that is not what it verified, and never records a rollout under a label the engine did
// not generate under (docs/controller.md, "Engine identity"; docs/lifecycle.md, "Engine
// restarts").
//
// - The engine is kill -9'd while READY on v1 and restarted from its v0 checkpoint (same port):
//   the controller reports it TAINTED within 2 s of the engine answering again, with rollouts
//   running all along; no stored rollout with output carries a label the engine did not generate
//   under. A recovery re-installs v1 and accepts the new process; a second restart, with no
//   rollout going on, is caught by the periodic identity check alone.
// - On v1, the controller is kill -9'd, the engine restarted on v0, and the controller restarted:
//   its journal claims v1, the engine serves v0, so it comes back TAINTED and admits nothing.
// - On a READY engine, POST /v1/recover is 409. Then the engine is changed behind the
//   controller's back, directly on the engine (pause, /rc/refit/stage + /rc/refit/install of v1,
//   /update_weight_version back to "v0", resume): the next identity check taints it.
#include <atomic>
#include <mutex>
#include <set>

#include "system/system_fixture.h"

namespace rc::system_test {
namespace {

using EngineIdentityTest = SystemTest;

std::string LastTaintReason(int ctl) {
  auto taint = SystemTest::FindLast(SystemTest::Journal(ctl), "taint");
  return taint ? (*taint)["detail"].value("reason", std::string()) : std::string();
}

// Every stored rollout that carries output was generated under its binding's label.
void ExpectNoRolloutStoredUnderAnotherLabel(int ctl) {
  int with_output = 0, mismatched = 0;
  for (const Json& t : SystemTest::Trajectories(ctl, "")) {
    const std::string bound = t["binding"].value("label", std::string());
    if (t.value("finish_reason", std::string()) == "identity_mismatch") {
      ++mismatched;
      EXPECT_TRUE(t["output_token_ids"].empty()) << "a mismatched rollout keeps no output: " << t.dump();
      EXPECT_FALSE(t["extra"].value("identity_mismatch", std::string()).empty()) << t.dump();
      continue;
    }
    if (t["output_token_ids"].empty()) continue;  // failed (engine down): no output
    ++with_output;
    EXPECT_EQ(t.value("engine_weight_version", std::string()), bound)
        << "stored under " << bound << " but generated under another label: " << t.dump();
  }
  std::cout << "trajectories with output: " << with_output << ", recorded identity_mismatch: " << mismatched
            << std::endl;
}

TEST_F(EngineIdentityTest, EngineKilledWhileReadyAndRestartedOnItsCheckpointIsTaintedWithin2s) {
  Stack s = StartStack();  // default --verify-interval-ms (1000)
  ASSERT_FALSE(HasFailure());
  Json v1 = Step(s, "v1");
  Json up = UpdateAndWait(s.ctl, "v1");
  ASSERT_EQ(up.value("outcome", ""), "committed") << up.dump();
  Reply first = Rollout(s.ctl, Prompt(10, 1), 4);
  ASSERT_EQ(first.status, 200) << first.text;
  ASSERT_EQ(first.json["choices"][0]["weight_version"], "v1");

  // Rollouts keep coming while the engine dies and comes back.
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::vector<Reply> replies;
  std::thread client([&] {
    for (int i = 0; !stop; ++i) {
      Reply r = Rollout(s.ctl, Prompt(10, 100 + i), 4);
      std::lock_guard<std::mutex> l(mu);
      replies.push_back(r);
      if (r.status != 200) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  s.engine_proc->Kill();
  StartEngine("engine-restarted", s.v0_dir, "v0", true, &s.engine_proc, s.engine);
  const int64_t back_ms = NowMs();
  auto tainted = WaitState(s.ctl, "TAINTED", 2000, 2);
  stop = true;
  client.join();
  ASSERT_TRUE(tainted) << "still " << StateOf(s.ctl) << " 2 s after the restarted engine answered";
  Figure("engine_back_to_tainted_ms", *tainted - back_ms);
  std::string why = LastTaintReason(s.ctl);
  std::cout << "taint reason: " << why << std::endl;
  EXPECT_TRUE(why.find("restarted") != std::string::npos || why.find("label 'v0'") != std::string::npos) << why;
  {
    std::lock_guard<std::mutex> l(mu);
    int ok = 0;
    for (const Reply& r : replies) {
      if (r.status != 200) continue;
      ++ok;
      EXPECT_EQ(r.json["binding"]["label"], "v1");
      EXPECT_EQ(r.json["choices"][0]["weight_version"], "v1") << "answered ok but generated under another label";
    }
    std::cout << "rollouts during the restart: " << replies.size() << " (" << ok << " ok)" << std::endl;
  }
  ExpectNoRolloutStoredUnderAnotherLabel(s.ctl);
  Reply refused = Rollout(s.ctl, Prompt(10, 9), 4);
  EXPECT_EQ(refused.status, 503) << "TAINTED admits nothing: " << refused.text;

  // Recovery re-installs v1 on the new process and proves it.
  Json rec = UpdateAndWait(s.ctl, "v1", /*recovery=*/true);
  ASSERT_EQ(rec.value("outcome", ""), "committed") << rec.dump();
  ASSERT_TRUE(WaitState(s.ctl, "READY", 5000));
  Reply ok = Rollout(s.ctl, Prompt(10, 2), 4);
  ASSERT_EQ(ok.status, 200) << ok.text;
  EXPECT_EQ(ok.json["choices"][0]["weight_version"], "v1");
  EXPECT_EQ(LiveDigest(s.engine), v1["content_digest"]);

  // Again with no rollout going on: the periodic check alone notices the new process.
  s.engine_proc->Kill();
  StartEngine("engine-restarted-2", s.v0_dir, "v0", true, &s.engine_proc, s.engine);
  const int64_t back2_ms = NowMs();
  tainted = WaitState(s.ctl, "TAINTED", 2000, 2);
  ASSERT_TRUE(tainted) << "still " << StateOf(s.ctl) << " 2 s after the restarted engine answered (no rollouts)";
  Figure("engine_back_to_tainted_by_the_periodic_check_ms", *tainted - back2_ms);
  why = LastTaintReason(s.ctl);
  EXPECT_NE(why.find("identity check"), std::string::npos) << why;
  EXPECT_NE(why.find("the engine restarted (boot id"), std::string::npos) << why;
  ExpectNoRolloutStoredUnderAnotherLabel(s.ctl);
}

TEST_F(EngineIdentityTest, RestartedControllerWhoseJournalClaimsAnotherLabelIsTaintedAndAdmitsNothing) {
  Stack s = StartStack();
  ASSERT_FALSE(HasFailure());
  Step(s, "v1");
  Json up = UpdateAndWait(s.ctl, "v1");
  ASSERT_EQ(up.value("outcome", ""), "committed") << up.dump();
  ASSERT_EQ(Rollout(s.ctl, Prompt(10, 1), 4).status, 200);

  // The controller dies; the engine restarts on v0 while it is away; the restarted controller's
  // journal claims v1: TAINTED before anything is admitted.
  s.ctl_proc->Kill();
  s.engine_proc->Kill();
  StartEngine("engine-restarted-2", s.v0_dir, "v0", true, &s.engine_proc, s.engine);
  RestartController(s, /*kill_first=*/false);
  EXPECT_EQ(StateOf(s.ctl), "TAINTED") << "the first status after the restart";
  std::string why = LastTaintReason(s.ctl);
  EXPECT_NE(why.find("journal claims label 'v1'"), std::string::npos) << why;
  EXPECT_NE(why.find("the engine reports label 'v0'"), std::string::npos) << why;
  auto restart = FindLast(Journal(s.ctl), "restart");
  ASSERT_TRUE(restart);
  for (const Json& r : Journal(s.ctl)) {
    if (r.value("seq", int64_t{0}) > (*restart)["seq"].get<int64_t>()) {
      EXPECT_NE(r.value("event", std::string()), "admit") << "admitted after the restart: " << r.dump();
    }
  }
  Reply refused = Rollout(s.ctl, Prompt(10, 3), 4);
  EXPECT_EQ(refused.status, 503) << refused.text;
  ExpectNoRolloutStoredUnderAnotherLabel(s.ctl);
}

TEST_F(EngineIdentityTest, RecoverOnReadyIsRefusedAndWeightsChangedBehindTheControllerAreDetected) {
  Stack s = StartStack();  // default --verify-interval-ms (1000)
  ASSERT_FALSE(HasFailure());
  Json v0 = WaitCommitted(s.dir, "v0");
  Json v1 = Step(s, "v1");

  // Defect 10: nothing to recover on a READY engine.
  Reply recover = Http(s.ctl, "POST", "/v1/recover", Json{{"model", kModelName}, {"version", "v0"}});
  EXPECT_EQ(recover.status, 409) << recover.text;
  EXPECT_EQ(Http(s.ctl, "GET", "/v1/updates/u-1").status, 404) << "no recovery was queued";
  EXPECT_EQ(StateOf(s.ctl), "READY");

  Reply before = Rollout(s.ctl, Prompt(10, 1), 4);
  ASSERT_EQ(before.status, 200) << before.text;
  ASSERT_EQ(before.json["choices"][0]["weight_version"], "v0");

  // Behind the controller's back, on the engine directly: v1's weights under the label "v0".
  Call(s.engine, "POST", "/pause?mode=wait");
  Call(s.engine, "POST", "/rc/refit/stage", Json{{"model", kModelName}, {"version", "v1"}, {"directory", Url(s.dir)}});
  Call(s.engine, "POST", "/rc/refit/install", Json{{"version", "v1"}});
  Call(s.engine, "POST", "/update_weight_version", Json{{"new_version", "v0"}});
  Call(s.engine, "POST", "/resume");
  const int64_t mutated_ms = NowMs();
  ASSERT_EQ(LiveDigest(s.engine), v1["content_digest"]);
  ASSERT_EQ(Call(s.engine, "GET", "/weight_info")["weight_version"], "v0") << "the label is faked";

  auto tainted = WaitState(s.ctl, "TAINTED", 2000, 2);
  ASSERT_TRUE(tainted) << "still " << StateOf(s.ctl) << " 2 s after the weights changed behind it";
  Figure("mutation_to_tainted_ms", *tainted - mutated_ms);
  std::string why = LastTaintReason(s.ctl);
  std::cout << "taint reason: " << why << std::endl;
  EXPECT_NE(why.find("install generation"), std::string::npos) << why;
  Reply refused = Rollout(s.ctl, Prompt(10, 2), 4);
  EXPECT_EQ(refused.status, 503) << refused.text;
  ExpectNoRolloutStoredUnderAnotherLabel(s.ctl);
  Json st = EngineStatus(s.ctl);
  EXPECT_EQ(st["label"], "v0");
  EXPECT_EQ(st["identity"]["content_digest"], v0["content_digest"]) << "the committed state is unchanged";
}

}  // namespace
}  // namespace rc::system_test
