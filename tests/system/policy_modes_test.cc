// Issue 20, policy modes beyond strict, over real processes (directory, trainer, engine and
// controller of the rolloutcore binary; see system_fixture.h).
//
// A 256-token greedy rollout admitted under v0 is held mid-generation, deterministically: once the
// engine reports it generated some tokens, the test freezes the engine itself with
// /pause?mode=keep (no sleep guesses the timing), reads the engine's generated-token counter — the
// rollout's exact output length at the swap, since nothing else runs — and requests the update in
// the mode under test. The controller's own pause, install, resets and resume follow; the resume
// lets the rollout continue. Checked: the spans' boundary equals the engine's count (and the
// engine's own per-choice spans), tokens before it equal a v0-only run, in recompute the tokens
// after it equal a from-scratch v1 prefill of prompt + prefix (a salted request: no cache hit),
// no new request hits a stale block, and the spans are stored with the trajectory. Abort mode
// returns the partial rollout with its spans; --max-staleness 1 aborts one that would span two.
#include <fstream>

#include "system/system_fixture.h"

namespace rc::system_test {
namespace {

using PolicyModesTest = SystemTest;

constexpr int kTokens = 256;

double Metric(int port, const std::string& name) {
  Reply r = SystemTest::Http(port, "GET", "/metrics");
  std::istringstream in(r.text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(name, 0) == 0 && line.size() > name.size() && (line[name.size()] == '{' || line[name.size()] == ' ')) {
      return std::stod(line.substr(line.rfind(' ') + 1));
    }
  }
  return -1;
}

// Waits until the engine generated at least `at_least` tokens since `base`, then freezes it
// (pause keep). Returns the rollout's output length at the freeze, or -1 if it finished first.
int64_t HoldMidGeneration(int engine, double base, int64_t at_least) {
  for (int i = 0; i < 60000; ++i) {
    const double g = Metric(engine, "vllm:generation_tokens_total") - base;
    if (g >= kTokens) return -1;
    if (g >= static_cast<double>(at_least)) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  Reply p = SystemTest::Http(engine, "POST", "/pause?mode=keep");
  EXPECT_EQ(p.status, 200) << p.text;
  Json st = SystemTest::Http(engine, "GET", "/rc/engine/state").json;
  if (st.value("num_running", 0) != 1) return -1;  // it finished before the freeze
  return static_cast<int64_t>(Metric(engine, "vllm:generation_tokens_total") - base);
}

Json CompleteSalted(SystemTest* t, int engine, const std::vector<int64_t>& prompt, int max_tokens,
                    const std::string& salt) {
  Json body{{"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0.0}, {"ignore_eos", true},
            {"return_token_ids", true}, {"logprobs", 0}};
  if (!salt.empty()) body["cache_salt"] = salt;
  return t->Call(engine, "POST", "/v1/completions", body);
}

template <typename T>
std::vector<T> Slice(const std::vector<T>& v, size_t from, size_t to) {
  return std::vector<T>(v.begin() + static_cast<long>(from), v.begin() + static_cast<long>(to));
}

std::vector<double> Logprobs(const Json& completion) {
  return completion["choices"][0]["logprobs"]["token_logprobs"].get<std::vector<double>>();
}

std::string RequestUpdateIn(SystemTest* t, int ctl, const std::string& version, const std::string& mode) {
  Json r = t->Call(ctl, "POST", "/v1/updates", Json{{"model", kModelName}, {"version", version}, {"mode", mode}}, 202);
  return r.value("id", std::string());
}

// The stack of a test that freezes the engine itself (HoldMidGeneration's pause keep) before it asks
// for the update: a periodic identity check in that window would rightly taint an engine paused
// behind the controller's back, so it is off (the check after each operation still runs).
StackOptions FrozenByTheTest(const std::string& dir, std::vector<std::string> controller_args = {}) {
  StackOptions o;
  o.model = WideConfig(dir + "/wide");
  o.controller_args = std::move(controller_args);
  o.controller_args.insert(o.controller_args.end(), {"--verify-interval-ms", "0"});
  return o;
}

void SpansAcrossUpdate(PolicyModesTest* t, const std::string& mode) {
  StackOptions o = FrozenByTheTest(t->dir_);
  Stack s = t->StartStack(o);
  ASSERT_FALSE(t->HasFailure());
  const std::vector<int64_t> prompt = Prompt(40, 3);
  const Json v0_run = CompleteSalted(t, s.engine, prompt, kTokens, "");
  const std::vector<int64_t> v0_tokens = SystemTest::Tokens(v0_run);
  ASSERT_EQ(v0_tokens.size(), static_cast<size_t>(kTokens));
  Json v1 = t->Step(s, "v1");

  const double base = Metric(s.engine, "vllm:generation_tokens_total");
  Reply reply;
  std::thread client([&] {
    reply = SystemTest::Http(s.ctl, "POST", "/v1/rollouts",
                             Json{{"prompt_token_ids", prompt}, {"max_tokens", kTokens}, {"temperature", 0.0},
                                  {"ignore_eos", true}, {"logprobs", 0}, {"rollout_id", "long-" + mode}},
                             120);
  });
  const int64_t k = HoldMidGeneration(s.engine, base, 8);
  std::string id = k > 0 ? RequestUpdateIn(t, s.ctl, "v1", mode) : "";
  if (k <= 0) SystemTest::Http(s.engine, "POST", "/resume");
  client.join();
  ASSERT_GT(k, 0) << "the rollout finished before it could be held mid-generation";
  ASSERT_LT(k, kTokens);
  Json update = t->WaitUpdate(s.ctl, id)["engines"][0];
  ASSERT_EQ(update.value("outcome", ""), "committed") << update.dump();

  ASSERT_EQ(reply.status, 200) << reply.text;
  const std::vector<int64_t> tokens = SystemTest::Tokens(reply.json);
  ASSERT_EQ(tokens.size(), static_cast<size_t>(kTokens));
  EXPECT_EQ(reply.json["binding"]["label"], "v0");
  // The spans: the boundary is the engine's count at the swap, and the engine said so per choice.
  const Json& spans = reply.json["version_spans"];
  ASSERT_EQ(spans.size(), 2u) << spans.dump();
  EXPECT_EQ(spans[0]["from_token"], 0);
  EXPECT_EQ(spans[0]["to_token"], k) << "swap index == the engine's generated tokens when it was frozen";
  EXPECT_EQ(spans[0]["label"], "v0");
  EXPECT_EQ(spans[0]["generation"], 0);
  EXPECT_EQ(spans[0]["kv"], "fresh");
  EXPECT_EQ(spans[1]["from_token"], k);
  EXPECT_EQ(spans[1]["to_token"], kTokens);
  EXPECT_EQ(spans[1]["label"], "v1");
  EXPECT_EQ(spans[1]["generation"], 1);
  EXPECT_EQ(spans[1]["content_digest"], v1["content_digest"]);
  EXPECT_EQ(spans[1]["kv"], mode == "keep" ? "stale" : "recomputed");
  const Json& engine_spans = reply.json["choices"][0]["version_spans"];
  ASSERT_EQ(engine_spans.size(), 2u);
  EXPECT_EQ(engine_spans[1]["from_token"], k) << "the engine's own boundary";

  // Tokens before the swap: the v0-only run.
  EXPECT_EQ(Slice(tokens, 0, static_cast<size_t>(k)), Slice(v0_tokens, 0, static_cast<size_t>(k)));
  // Per-token logprobs are the behaviour policy's: before the swap, the v0 run's.
  const std::vector<double> logprobs = Logprobs(reply.json);
  ASSERT_EQ(logprobs.size(), static_cast<size_t>(kTokens));
  EXPECT_EQ(Slice(logprobs, 0, static_cast<size_t>(k)), Slice(Logprobs(v0_run), 0, static_cast<size_t>(k)));
  // After: a from-scratch v1 prefill of prompt + prefix (salted: no cache hit at all).
  std::vector<int64_t> prefixed = prompt;
  prefixed.insert(prefixed.end(), tokens.begin(), tokens.begin() + k);
  Json fresh = CompleteSalted(t, s.engine, prefixed, kTokens - static_cast<int>(k), "fresh-" + mode);
  EXPECT_EQ(SystemTest::Cached(fresh), 0);
  const std::vector<int64_t> v1_after = SystemTest::Tokens(fresh);
  if (mode == "recompute") {
    EXPECT_EQ(Slice(tokens, static_cast<size_t>(k), kTokens), v1_after) << "recompute == re-prefill under v1";
    EXPECT_EQ(Slice(logprobs, static_cast<size_t>(k), kTokens), Logprobs(fresh)) << "and its logprobs are v1's";
  } else {
    EXPECT_NE(Slice(tokens, static_cast<size_t>(k), kTokens), v1_after) << "keep continued on stale v0 KV";
  }
  // No new request hits a stale block: the same prefix unsalted gives the fresh v1 tokens, and in
  // keep mode hits nothing at all (the kept request's blocks were unhashed at the swap).
  Json again = CompleteSalted(t, s.engine, prefixed, 8, "");
  EXPECT_EQ(SystemTest::Tokens(again), Slice(v1_after, 0, 8));
  if (mode == "keep") {
    EXPECT_EQ(SystemTest::Cached(again), 0);
  }

  // Stored with the trajectory, journaled with the finish, counted in the metrics.
  bool found = false;
  for (const Json& row : t->Trajectories(s.ctl, "v0")) {
    if (row["binding"]["rollout_id"] != "long-" + mode) continue;
    found = true;
    EXPECT_EQ(row["version_spans"], spans);
    EXPECT_EQ(row["output_token_ids"].get<std::vector<int64_t>>(), tokens);
    EXPECT_EQ(row["logprobs"].get<std::vector<double>>(), logprobs);
  }
  EXPECT_TRUE(found);
  auto finish = SystemTest::Find(SystemTest::Journal(s.ctl), "finish", "long-" + mode);
  ASSERT_TRUE(finish);
  EXPECT_EQ((*finish)["detail"]["version_spans"], spans);
  EXPECT_EQ(Metric(s.ctl, "rolloutcore_updates_by_mode_total{engine=\"" + SystemTest::Url(s.engine) + "\",mode=\"" +
                              mode + "\"}"),
            1);
  t->Figure("swap_index_" + mode, k, "tokens");
}

TEST_F(PolicyModesTest, KeepSpansAreExactAndNoNewRequestHitsStaleKv) { SpansAcrossUpdate(this, "keep"); }
TEST_F(PolicyModesTest, RecomputeEqualsAReprefillUnderTheNewWeights) { SpansAcrossUpdate(this, "recompute"); }

TEST_F(PolicyModesTest, AbortReturnsThePartialRolloutWithItsSpans) {
  StackOptions o = FrozenByTheTest(dir_);
  Stack s = StartStack(o);
  ASSERT_FALSE(HasFailure());
  const std::vector<int64_t> prompt = Prompt(40, 4);
  const std::vector<int64_t> v0_tokens = Tokens(Complete(s.engine, prompt, kTokens));
  Step(s, "v1");
  const double base = Metric(s.engine, "vllm:generation_tokens_total");
  Reply reply;
  std::thread client([&] { reply = Rollout(s.ctl, prompt, kTokens, "cut"); });
  const int64_t k = HoldMidGeneration(s.engine, base, 8);
  std::string id = k > 0 ? RequestUpdateIn(this, s.ctl, "v1", "abort") : "";
  if (k <= 0) Http(s.engine, "POST", "/resume");
  client.join();
  ASSERT_GT(k, 0);
  ASSERT_EQ(WaitUpdate(s.ctl, id)["engines"][0].value("outcome", ""), "committed");
  ASSERT_EQ(reply.status, 200) << reply.text;
  EXPECT_EQ(reply.json["choices"][0]["finish_reason"], "abort");
  const std::vector<int64_t> tokens = Tokens(reply.json);
  EXPECT_EQ(static_cast<int64_t>(tokens.size()), k) << "partial: what was generated before the pause";
  EXPECT_EQ(tokens, Slice(v0_tokens, 0, static_cast<size_t>(k)));
  const Json& a = reply.json["aborted_at_update"];
  ASSERT_TRUE(a.is_object()) << reply.text;
  EXPECT_EQ(a["reason"], "mode_abort");
  EXPECT_EQ(a["target"], "v1");
  ASSERT_EQ(reply.json["version_spans"].size(), 1u);
  EXPECT_EQ(reply.json["version_spans"][0]["to_token"], k);
  EXPECT_EQ(reply.json["version_spans"][0]["label"], "v0");
  bool found = false;
  for (const Json& row : Trajectories(s.ctl, "v0")) {
    if (row["binding"]["rollout_id"] != "cut") continue;
    found = true;
    EXPECT_EQ(row["finish_reason"], "abort");
    EXPECT_EQ(row["aborted_at_update"], a);
    EXPECT_EQ(row["version_spans"], reply.json["version_spans"]);
  }
  EXPECT_TRUE(found);
}

TEST_F(PolicyModesTest, MaxStalenessOneAbortsARolloutThatWouldSpanTwoUpdates) {
  StackOptions o = FrozenByTheTest(dir_, {"--max-staleness", "1", "--update-mode", "keep"});
  Stack s = StartStack(o);
  ASSERT_FALSE(HasFailure());
  const std::vector<int64_t> prompt = Prompt(40, 5);
  Step(s, "v1");
  Step(s, "v2");
  const double base = Metric(s.engine, "vllm:generation_tokens_total");
  Reply reply;
  std::thread client([&] { reply = Rollout(s.ctl, prompt, kTokens, "stale"); });
  // First update (the deployment default mode, keep): the rollout lives through it.
  const int64_t k1 = HoldMidGeneration(s.engine, base, 8);
  std::string first = k1 > 0 ? RequestUpdate(s.ctl, "v1") : "";
  Json u1 = k1 > 0 ? WaitUpdate(s.ctl, first)["engines"][0] : Json::object();
  // Second update while it still runs: it would span two, so this one ends it.
  const int64_t k2 = k1 > 0 ? HoldMidGeneration(s.engine, base, k1 + 4) : -1;
  std::string second = k2 > 0 ? RequestUpdate(s.ctl, "v2") : "";
  if (k2 <= 0) Http(s.engine, "POST", "/resume");
  client.join();
  ASSERT_GT(k1, 0);
  ASSERT_EQ(u1.value("outcome", ""), "committed") << u1.dump();
  ASSERT_GT(k2, k1) << "the rollout finished before the second update could reach it";
  ASSERT_EQ(WaitUpdate(s.ctl, second)["engines"][0].value("outcome", ""), "committed");
  ASSERT_EQ(reply.status, 200) << reply.text;
  EXPECT_EQ(reply.json["choices"][0]["finish_reason"], "abort");
  EXPECT_EQ(static_cast<int64_t>(Tokens(reply.json).size()), k2) << "ended before any v2 token";
  const Json& a = reply.json["aborted_at_update"];
  ASSERT_TRUE(a.is_object()) << reply.text;
  EXPECT_EQ(a["reason"], "max_staleness");
  EXPECT_EQ(a["max_staleness"], 1);
  const Json status = Call(s.ctl, "GET", "/v1/status");
  EXPECT_EQ(status["update_mode"], "keep");
  EXPECT_EQ(status["max_staleness"], 1);
  EXPECT_EQ(a["target"], "v2");
  const Json& spans = reply.json["version_spans"];
  ASSERT_EQ(spans.size(), 2u) << spans.dump();
  EXPECT_EQ(spans[0]["to_token"], k1);
  EXPECT_EQ(spans[1]["label"], "v1");
  EXPECT_EQ(spans[1]["kv"], "stale");
  EXPECT_EQ(spans[1]["to_token"], k2);
}

TEST_F(PolicyModesTest, BadModeIsRefusedNamingIt) {
  Stack s = StartStack();
  ASSERT_FALSE(HasFailure());
  Step(s, "v1");
  Reply r = Http(s.ctl, "POST", "/v1/updates", Json{{"model", kModelName}, {"version", "v1"}, {"mode", "lazy"}});
  EXPECT_EQ(r.status, 400) << r.text;
  EXPECT_NE(r.text.find("'lazy'"), std::string::npos) << r.text;
  Reply typed = Http(s.ctl, "POST", "/v1/updates", Json{{"model", kModelName}, {"version", "v1"}, {"mode", 3}});
  EXPECT_EQ(typed.status, 400) << typed.text;
  EXPECT_NE(typed.text.find("mode"), std::string::npos) << typed.text;
  EXPECT_EQ(StateOf(s.ctl), "READY") << "nothing started";
  EXPECT_EQ(Call(s.ctl, "GET", "/v1/status")["update_mode"], "strict") << "the default";
}

}  // namespace
}  // namespace rc::system_test
