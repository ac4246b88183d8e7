// Issue #6, "Live rollout during an update" and "Identity", over real processes.
//
// Live rollout: a 256-token greedy rollout admitted under v0 is mid-generation when the update
// to v1 is requested. Strict mode: the update drains — the rollout finishes on v0 (journal: its
// finish precedes begin_install), is bound to v0, and its tokens equal a v0-only run of the same
// prompt; rollouts after the commit are bound to v1 and the engine generated them under v1.
//
// Identity: v0 and v1 have the same tensors and shapes but different content digests; every
// trajectory carries the digest of the version it ran under, equal to the directory manifest's
// and to what the engine proved live.
#include <fstream>

#include "system/system_fixture.h"

namespace rc::system_test {
namespace {

double Metric(int engine, const std::string& name) {
  Reply r = SystemTest::Http(engine, "GET", "/metrics");
  std::istringstream in(r.text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(name, 0) == 0 && line.size() > name.size() && (line[name.size()] == '{' || line[name.size()] == ' ')) {
      return std::stod(line.substr(line.rfind(' ') + 1));
    }
  }
  return -1;
}

using LiveRolloutTest = SystemTest;

// The tiny preset generates 256 tokens in well under 100 ms, too little to request an update
// mid-generation reliably on a loaded machine: this test runs WideConfig (system_fixture.h).
TEST_F(LiveRolloutTest, RolloutMidGenerationFinishesOnV0BeforeTheInstall) {
  StackOptions o;
  o.model = WideConfig(dir_ + "/wide");
  Stack s = StartStack(o);
  ASSERT_FALSE(HasFailure());
  const std::vector<int64_t> prompt = Prompt(40, 1);
  constexpr int kTokens = 256;

  // The v0-only run: the same greedy rollout straight on the engine, before anything changes.
  Json reference = Complete(s.engine, prompt, kTokens);
  std::vector<int64_t> v0_tokens = Tokens(reference);
  ASSERT_EQ(v0_tokens.size(), static_cast<size_t>(kTokens));
  Json v1 = Step(s, "v1");

  // The long rollout, through the controller, on its own thread.
  double generated_before = Metric(s.engine, "vllm:generation_tokens_total");
  Reply long_reply;
  std::thread client([&] { long_reply = Rollout(s.ctl, prompt, kTokens, "long-1"); });
  // Mid-generation: the engine runs it and has produced some of its tokens, not all.
  bool mid = false;
  for (int i = 0; i < 20000 && !mid; ++i) {
    double g = Metric(s.engine, "vllm:generation_tokens_total");
    mid = g >= generated_before + 8 && g < generated_before + kTokens / 2;
    if (g >= generated_before + kTokens / 2) break;
    if (!mid) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const int64_t requested_ms = NowMs();
  std::string id = RequestUpdate(s.ctl, "v1");
  double generated_at_request = Metric(s.engine, "vllm:generation_tokens_total") - generated_before;
  client.join();
  ASSERT_TRUE(mid) << "never observed the rollout mid-generation (the engine is too fast or too slow to hold it)";
  Json update = WaitUpdate(s.ctl, id)["engines"][0];
  ASSERT_EQ(update.value("outcome", ""), "committed") << update.dump();

  // The rollout finished on v0 with the v0-only tokens.
  ASSERT_EQ(long_reply.status, 200) << long_reply.text;
  const Json& binding = long_reply.json["binding"];
  EXPECT_EQ(binding["rollout_id"], "long-1");
  EXPECT_EQ(binding["label"], "v0");
  EXPECT_EQ(binding["generation"], 0);
  EXPECT_EQ(long_reply.json["choices"][0]["weight_version"], "v0") << "the engine generated it under v0";
  EXPECT_EQ(Tokens(long_reply.json), v0_tokens) << "tokens equal the v0-only run";

  // The journal: admitted, then the update requested while it ran, then its finish, then (only
  // then) the install began.
  std::vector<Json> j = Journal(s.ctl);
  auto admit = Find(j, "admit", "long-1");
  auto request = Find(j, "request_update");
  auto finish = Find(j, "finish", "long-1");
  auto install = Find(j, "begin_install");
  ASSERT_TRUE(admit && request && finish && install);
  EXPECT_LT((*admit)["seq"], (*request)["seq"]);
  EXPECT_LT((*request)["seq"], (*finish)["seq"]) << "the update was requested while the rollout ran";
  EXPECT_LT((*finish)["seq"], (*install)["seq"]) << "its finish is journaled before the install began";
  EXPECT_EQ((*install)["from"], "QUIESCED");
  EXPECT_EQ((*install)["to"], "UPDATING");

  // Its trajectory is the v0 one, complete.
  bool found = false;
  for (const Json& t : Trajectories(s.ctl, "v0")) {
    if (t["binding"]["rollout_id"] != "long-1") continue;
    found = true;
    EXPECT_EQ(t["output_token_ids"].get<std::vector<int64_t>>(), v0_tokens);
    EXPECT_EQ(t["finish_reason"], "length");
  }
  EXPECT_TRUE(found) << "trajectory of long-1 under v0";

  // After the commit: bound to v1 and generated under v1.
  std::vector<int64_t> v1_tokens;
  for (int k = 0; k < 3; ++k) {
    Reply r = Rollout(s.ctl, prompt, 16, "after-" + std::to_string(k));
    ASSERT_EQ(r.status, 200) << r.text;
    EXPECT_EQ(r.json["binding"]["label"], "v1");
    EXPECT_EQ(r.json["binding"]["generation"], 1);
    EXPECT_EQ(r.json["binding"]["identity"]["content_digest"], v1["content_digest"]);
    EXPECT_EQ(r.json["choices"][0]["weight_version"], "v1");
    v1_tokens = Tokens(r.json);
  }
  EXPECT_NE(v1_tokens, std::vector<int64_t>(v0_tokens.begin(), v0_tokens.begin() + 16)) << "new weights, new output";
  EXPECT_EQ(LiveDigest(s.engine), v1["content_digest"]);

  const Json& ph = update["phases_ms"];
  int64_t pause = 0;
  for (const char* p : {"QUIESCED", "UPDATING", "INVALIDATING", "VALIDATING", "RESUMING"}) pause += ph.value(p, int64_t{0});
  Figure("tokens_generated_when_update_requested", static_cast<int64_t>(generated_at_request), "tokens");
  Figure("drain_ms", ph.value("DRAINING", int64_t{0}));
  Figure("request_to_rollout_end_ms", (*finish)["t_ms"].get<int64_t>() - requested_ms);
  Figure("pause_window_ms", pause);
}

using IdentityTest = SystemTest;

TEST_F(IdentityTest, SameShapesDifferentDigestsAndEachTrajectoryCarriesItsOwn) {
  Stack s = StartStack();
  ASSERT_FALSE(HasFailure());
  Json v0 = WaitCommitted(s.dir, "v0");
  Json v1 = Step(s, "v1");
  const std::string d0 = v0["content_digest"], d1 = v1["content_digest"];

  // Identical shapes (same architecture), different content.
  auto shapes = [](const Json& m) {
    std::map<std::string, Json> out;
    for (const auto& t : m["tensors"]) out[t["name"]] = Json{t["dtype"], t["shape"]};
    return out;
  };
  ASSERT_FALSE(shapes(v0).empty());
  EXPECT_EQ(shapes(v0), shapes(v1)) << "same tensors, dtypes and shapes";
  EXPECT_NE(d0, d1) << "different weights, different content digests";

  // The engine serves v0 (it loaded the export) and the controller's identity says so.
  EXPECT_EQ(LiveDigest(s.engine), d0);
  EXPECT_EQ(EngineStatus(s.ctl)["identity"]["content_digest"], d0);
  for (int k = 0; k < 3; ++k) ASSERT_EQ(Rollout(s.ctl, Prompt(20, k), 8, "a-" + std::to_string(k)).status, 200);
  Json update = UpdateAndWait(s.ctl, "v1");
  ASSERT_EQ(update.value("outcome", ""), "committed") << update.dump();
  EXPECT_EQ(LiveDigest(s.engine), d1);
  EXPECT_EQ(update["evidence"]["validated"]["content_digest"], d1) << "the controller checked the live digest";
  EXPECT_EQ(EngineStatus(s.ctl)["identity"]["content_digest"], d1);
  for (int k = 0; k < 3; ++k) ASSERT_EQ(Rollout(s.ctl, Prompt(20, k), 8, "b-" + std::to_string(k)).status, 200);

  struct Want {
    std::string label, digest, prefix;
    int generation;
  };
  for (const Want& w : {Want{"v0", d0, "a-", 0}, Want{"v1", d1, "b-", 1}}) {
    SCOPED_TRACE(w.label);
    std::vector<Json> rows = Trajectories(s.ctl, w.label);
    ASSERT_EQ(rows.size(), 3u);
    for (const Json& t : rows) {
      const Json& b = t["binding"];
      EXPECT_EQ(b["rollout_id"].get<std::string>().rfind(w.prefix, 0), 0u) << b.dump();
      EXPECT_EQ(b["label"], w.label);
      EXPECT_EQ(b["generation"], w.generation);
      EXPECT_EQ(b["identity"]["content_digest"], w.digest) << "binding identity == manifest digest";
      EXPECT_EQ(t["engine_weight_version"], w.label);
    }
  }
  EXPECT_EQ(Trajectories(s.ctl, "v1")[0]["binding"]["identity"]["checkpoint"], std::string(kModelName) + "@v1");
  EXPECT_EQ(Trajectories(s.ctl, "v1")[0]["binding"]["identity"]["step"], 1);
}

}  // namespace
}  // namespace rc::system_test
