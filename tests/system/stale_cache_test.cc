// Issue #6, "Stale cache: negative control, then the real thing".
//
// A prompt spanning several KV blocks is repeated so the prefix cache hits. Negative control: an
// engine updated to v1 outside the controller with the cache reset skipped
// (`/rc/refit/install {"skip_cache_reset": true}`) serves the repeated prompt from KV computed
// under v0 — stale hits — and its greedy output differs from a fresh engine loaded from v1; the
// same engine, once its cache is reset, agrees with the fresh one (so the difference is the stale
// KV, nothing else). The real thing: through the controller, the first request after the update
// has no cached tokens and the fresh engine's output; a second request hits again (caching on).
#include "system/system_fixture.h"

namespace rc::system_test {
namespace {

using StaleCacheTest = SystemTest;

TEST_F(StaleCacheTest, NegativeControlShowsStaleHitsAndTheControllerNeverServesThem) {
  Stack s = StartStack();
  ASSERT_FALSE(HasFailure());
  // 100 prompt tokens = 6 full blocks of 16: a hit reuses 96 tokens of KV.
  const std::vector<int64_t> prompt = Prompt(100, 3);
  constexpr int kTokens = 24;
  int control = StartEngine("engine-control", s.v0_dir, "v0", false);

  // Before the update: hits on the repeated prompt, on both engines (same weights, same output).
  Reply first = Rollout(s.ctl, prompt, kTokens, "pre-0");
  Reply second = Rollout(s.ctl, prompt, kTokens, "pre-1");
  ASSERT_EQ(first.status, 200) << first.text;
  ASSERT_EQ(second.status, 200) << second.text;
  EXPECT_EQ(Cached(first.json), 0);
  EXPECT_GE(Cached(second.json), 64) << "the repeated prompt hits several blocks";
  EXPECT_EQ(Tokens(first.json), Tokens(second.json));
  std::vector<int64_t> v0_tokens = Tokens(first.json);
  Json c0 = Complete(control, prompt, kTokens);
  Json c1 = Complete(control, prompt, kTokens);
  EXPECT_GE(Cached(c1), 64);
  EXPECT_EQ(Tokens(c0), v0_tokens);

  // v1, and a fresh engine loaded from v1 exported to disk: the reference output.
  Json v1 = Step(s, "v1");
  Export("v1", dir_ + "/v1");
  int fresh = StartEngine("engine-fresh", dir_ + "/v1", "v1", false);
  ASSERT_EQ(LiveDigest(fresh), v1["content_digest"]);
  Json fresh_out = Complete(fresh, prompt, kTokens);
  EXPECT_EQ(Cached(fresh_out), 0);
  const std::vector<int64_t> v1_tokens = Tokens(fresh_out);
  ASSERT_EQ(v1_tokens.size(), static_cast<size_t>(kTokens));
  ASSERT_NE(v1_tokens, v0_tokens) << "v1 must generate differently from v0 for this experiment to mean anything";

  // Negative control: the update outside the controller, skipping the cache reset.
  Json staged = Call(control, "POST", "/rc/refit/stage",
                     Json{{"model", kModelName}, {"version", "v1"}, {"directory", Url(s.dir)}});
  EXPECT_EQ(staged["coverage"], "ok");
  Call(control, "POST", "/pause?mode=wait");
  Json installed = Call(control, "POST", "/rc/refit/install", Json{{"version", "v1"}, {"skip_cache_reset", true}});
  EXPECT_EQ(installed["cache_reset"], false);
  Call(control, "POST", "/resume");
  EXPECT_EQ(LiveDigest(control), v1["content_digest"]) << "the weights are v1; only the cache is stale";
  Json stale = Complete(control, prompt, kTokens);
  EXPECT_GE(Cached(stale), 64) << "stale hits: KV computed under v0 reused under v1";
  EXPECT_NE(Tokens(stale), v1_tokens) << "stale KV changes the greedy output";
  // The same engine with its cache reset agrees with the fresh engine: the stale KV was the cause.
  Json reset = Call(control, "POST", "/reset_prefix_cache");
  EXPECT_EQ(reset["success"], true);
  Json after_reset = Complete(control, prompt, kTokens);
  EXPECT_EQ(Cached(after_reset), 0);
  EXPECT_EQ(Tokens(after_reset), v1_tokens);

  // The real thing, through the controller.
  Json update = UpdateAndWait(s.ctl, "v1");
  ASSERT_EQ(update.value("outcome", ""), "committed") << update.dump();
  Reply post1 = Rollout(s.ctl, prompt, kTokens, "post-0");
  Reply post2 = Rollout(s.ctl, prompt, kTokens, "post-1");
  ASSERT_EQ(post1.status, 200) << post1.text;
  ASSERT_EQ(post2.status, 200) << post2.text;
  EXPECT_EQ(post1.json["binding"]["label"], "v1");
  EXPECT_EQ(Cached(post1.json), 0) << "no hit on blocks computed under v0";
  EXPECT_EQ(Tokens(post1.json), v1_tokens) << "identical to a fresh engine on v1";
  EXPECT_GE(Cached(post2.json), 64) << "caching is still on: the second request hits (v1 blocks)";
  EXPECT_EQ(Tokens(post2.json), v1_tokens);
  // The trajectories record the same.
  for (const Json& t : Trajectories(s.ctl, "v1")) {
    if (t["binding"]["rollout_id"] == "post-0") {
      EXPECT_EQ(t["cached_tokens"], 0);
    }
    if (t["binding"]["rollout_id"] == "post-1") {
      EXPECT_GE(t["cached_tokens"].get<int64_t>(), 64);
    }
  }
  // The controller's reset evidence: the prefix cache was reset while the engine was paused.
  bool prefix_reset = false;
  for (const Json& r : update["evidence"]["caches_reset"]) {
    if (r.value("cache", r.value("kind", std::string())) == "prefix") prefix_reset = r.value("success", false);
  }
  EXPECT_TRUE(prefix_reset) << update["evidence"].dump();
  Figure("stale_cached_tokens", Cached(stale), "tokens");
  Figure("post_update_second_request_cached_tokens", Cached(post2.json), "tokens");
}

}  // namespace
}  // namespace rc::system_test
