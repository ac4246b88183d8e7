// Replay validation end to end (issue 18, docs/lifecycle.md "Replay validation"): the trainer
// (2 ranks) attaches probes computed with its reference forward (tp 1, weights loaded by name);
// the engine (tp 2) installs through its captured refit plan; in VALIDATING the controller has
// the paused engine replay every probe and compares tokens and log-probabilities.
#include "system_fixture.h"

namespace rc::system_test {
namespace {

using ReplayTest = SystemTest;

StackOptions WithProbes() {
  StackOptions o;
  o.trainer_args = {"--probes", "2", "--probe-tokens", "8", "--probe-top-k", "5"};
  return o;
}

// Updates with probes commit, with the worst difference in the validation evidence.
TEST_F(ReplayTest, UpdatesWithProbesCommitWithTheWorstDifferenceInTheEvidence) {
  Stack s = StartStack(WithProbes());
  Json v1 = Step(s, "v1");
  ASSERT_TRUE(v1.contains("probes")) << "the directory stores the probes with the version";
  ASSERT_EQ(v1["probes"].size(), 2u);
  EXPECT_EQ(v1["probes"][0]["steps"].size(), 8u);
  EXPECT_EQ(v1["probes"][0]["top_k"], 5);

  // The replay path refuses while the engine serves (no user request may interleave).
  Reply serving = Http(s.engine, "POST", "/rc/validate/replay",
                       Json{{"probe", "p0"}, {"prompt", v1["probes"][0]["prompt"]}, {"steps", 2}, {"top_k", 1}});
  EXPECT_EQ(serving.status, 409) << serving.text;

  for (const std::string version : {"v1", "v2"}) {
    if (version == "v2") Step(s, "v2");
    Json update = UpdateAndWait(s.ctl, version);
    ASSERT_EQ(update.value("outcome", ""), "committed") << update.dump();
    const Json& replay = update["evidence"]["validated"]["replay"];
    ASSERT_TRUE(replay.is_object()) << update["evidence"].dump();
    EXPECT_FALSE(replay.value("skipped", true)) << replay.dump();
    EXPECT_TRUE(replay.value("match", false)) << replay.dump();
    EXPECT_EQ(replay.value("probes", 0), 2);
    EXPECT_EQ(replay.value("tokens", 0), 16);
    EXPECT_DOUBLE_EQ(replay.value("tolerance", 0.0), 1e-4);
    ASSERT_TRUE(replay.contains("worst_logprob_diff"));
    EXPECT_LE(replay["worst_logprob_diff"].get<double>(), 1e-4);
    EXPECT_GE(replay["worst_logprob_diff"].get<double>(), 0.0);
    EXPECT_TRUE(update["evidence"]["validated"].value("digest_checked", false));
    // The probes ran on the staged image while the old version served; the swap install made
    // exactly those results the live ones, so VALIDATING served them (and says so).
    const Json prereplay = update["evidence"]["staged"]["engine"].value("prereplay", Json::object());
    EXPECT_TRUE(prereplay.value("ran", false)) << prereplay.dump();
    EXPECT_EQ(replay.value("precomputed", 0), 2) << replay.dump();
    EXPECT_EQ(replay.value("computed_on", ""), "staged_image") << replay.dump();
    Figure("replay_engine_us_" + version, static_cast<int64_t>(replay.value("engine_ms", 0.0) * 1000), "us");
    std::cout << "[ figures ] replay evidence " << version << ": " << replay.dump() << std::endl;
  }
  EXPECT_EQ(StateOf(s.ctl), "READY");
}

// The negative control: a wrong install mapping (layer 0's first two query heads swapped in the
// captured plan of every rank) passes the digest and is caught by the replay: TAINTED, and the
// journal names the probe and the step.
TEST_F(ReplayTest, SwappedHeadsPassTheDigestAndFailTheReplay) {
  Stack s = StartStack(WithProbes());
  Json v1 = Step(s, "v1");
  SetFaults(s.engine, Json{{"swap_q_heads", true}});
  Json update = UpdateAndWait(s.ctl, "v1");
  ASSERT_EQ(update.value("outcome", ""), "tainted") << update.dump();
  EXPECT_EQ(StateOf(s.ctl), "TAINTED");
  // The swapped heads are in the staged image too: its pre-replay, served in VALIDATING, fails.
  const Json prereplay = update["evidence"]["staged"]["engine"].value("prereplay", Json::object());
  EXPECT_TRUE(prereplay.value("ran", false)) << update["evidence"].dump();

  // The digest check passed: the live digest, computed through the same (wrong) mapping, is v1's.
  EXPECT_EQ(LiveDigest(s.engine), v1["content_digest"].get<std::string>());
  auto taint = FindLast(Journal(s.ctl), "taint");
  ASSERT_TRUE(taint.has_value());
  const std::string reason = (*taint)["detail"].value("reason", std::string());
  std::cout << "[ figures ] taint reason: " << reason << std::endl;
  EXPECT_NE(reason.find("replay: probe p"), std::string::npos) << reason;
  EXPECT_NE(reason.find(" step "), std::string::npos) << reason;
  EXPECT_NE(reason.find("matched"), std::string::npos) << "the digest agreed: " << reason;
  EXPECT_EQ(FindLast(Journal(s.ctl), "validated"), std::nullopt) << "never validated";

  // Without the fault the same version installs, replays and commits (recovery re-installs v1
  // through a fresh plan; a further update proves the replay passes again).
  SetFaults(s.engine, Json::object());
  Json rec = UpdateAndWait(s.ctl, "v1", /*recovery=*/true);
  ASSERT_EQ(rec.value("outcome", ""), "committed") << rec.dump();
  Step(s, "v2");
  Json next = UpdateAndWait(s.ctl, "v2");
  ASSERT_EQ(next.value("outcome", ""), "committed") << next.dump();
  EXPECT_TRUE(next["evidence"]["validated"]["replay"].value("match", false));
}

}  // namespace
}  // namespace rc::system_test
