// Policy modes in the embedded engine (docs/lifecycle.md, "Policy modes"): an install under a
// request frozen by a keep pause either recomputes its KV under the new weights (recompute) or
// keeps it (keep); either way the request's version spans put the boundary at the exact output
// index where the weights changed, and no new request hits a block computed under the old weights.
// Driven by Step() from the test thread, so every token index is deterministic.
#include <gtest/gtest.h>

#include "rolloutcore/engine/engine.h"
#include "rolloutcore/engine/loader.h"

namespace rc::engine {
namespace {

std::unique_ptr<Engine> MakeEngine(uint64_t seed) {
  EngineOptions o;
  o.num_threads = 2;
  auto e = CreateEngine({"tiny", "dummy", seed}, o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return std::move(e).value();
}

std::vector<int32_t> Prompt(int n) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back((i * 37 + 5) % 256);
  return p;
}

GenerateRequest Greedy(std::vector<int32_t> prompt, int64_t max_tokens) {
  GenerateRequest r;
  r.prompt = std::move(prompt);
  r.sampling.temperature = 0;
  r.sampling.max_tokens = max_tokens;
  r.sampling.num_logprobs = 0;
  return r;
}

RequestStream::Snapshot RunOne(Engine* e, GenerateRequest r) {
  auto s = e->AddRequest(std::move(r));
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  while (e->Step()) {
  }
  return (*s)->Wait();
}

std::vector<int32_t> Slice(const std::vector<int32_t>& v, size_t from, size_t to) {
  return std::vector<int32_t>(v.begin() + static_cast<long>(from), v.begin() + static_cast<long>(to));
}

constexpr int kPrompt = 20, kTokens = 40, kSwapAt = 10;

// Runs a request to kSwapAt output tokens, pauses (keep, with `kv`), installs the seed-99 weights
// as "v1", queues `late` (if any) while paused, resumes and runs everything to the end.
struct SwapRun {
  RequestStream::Snapshot rollout, late, after_end;
  EngineMetrics metrics;
  int64_t cached_blocks_after_install = -1;
};
SwapRun RunAcrossSwap(InFlightKv kv, std::optional<std::vector<int32_t>> late_prompt) {
  SwapRun out;
  auto e = MakeEngine(1);
  auto s = *e->AddRequest(Greedy(Prompt(kPrompt), kTokens));
  while (s->WaitFrom(SIZE_MAX, std::chrono::milliseconds(0)).tokens.size() < kSwapAt) EXPECT_TRUE(e->Step());
  EXPECT_TRUE(e->Pause(PauseMode::kKeep, kv).ok());
  const ModelSpec spec = e->spec();
  WeightFill fill = MakeWeightFill(spec, [spec]() -> Result<std::unique_ptr<TensorSource>> {
    return MakeDummySource(spec, 99);
  });
  Status st = e->InstallWeights(fill, "v1", 5);
  EXPECT_TRUE(st.ok()) << st.ToString();
  out.cached_blocks_after_install = e->State().cached_blocks;
  std::shared_ptr<RequestStream> late;
  if (late_prompt) late = *e->AddRequest(Greedy(*late_prompt, 8));
  e->Resume();
  while (e->Step()) {
  }
  out.rollout = s->Wait();
  if (late) out.late = late->Wait();
  out.metrics = e->Metrics();
  // After it ended: a request over its whole sequence (prompt + output but the last token).
  std::vector<int32_t> whole = Prompt(kPrompt);
  whole.insert(whole.end(), out.rollout.tokens.begin(), out.rollout.tokens.end() - 1);
  out.after_end = RunOne(e.get(), Greedy(whole, 4));
  return out;
}

void ExpectSpans(const RequestStream::Snapshot& s, SpanKv after) {
  ASSERT_EQ(s.spans.size(), 2u);
  EXPECT_EQ(s.spans[0].from_token, 0);
  EXPECT_EQ(s.spans[0].to_token, kSwapAt) << "the swap index is the output length at the install";
  EXPECT_EQ(s.spans[0].label, "default");
  EXPECT_EQ(s.spans[0].install_generation, 0);
  EXPECT_EQ(s.spans[0].kv, SpanKv::kFresh);
  EXPECT_EQ(s.spans[1].from_token, kSwapAt);
  EXPECT_EQ(s.spans[1].to_token, kTokens);
  EXPECT_EQ(s.spans[1].label, "v1");
  EXPECT_EQ(s.spans[1].install_generation, 5);
  EXPECT_EQ(s.spans[1].kv, after);
}

TEST(PolicyModesTest, RecomputeReprefillsUnderTheNewWeightsAtTheExactIndex) {
  const auto v0 = RunOne(MakeEngine(1).get(), Greedy(Prompt(kPrompt), kTokens));
  SwapRun r = RunAcrossSwap(InFlightKv::kRecompute, std::nullopt);
  ASSERT_EQ(r.rollout.tokens.size(), static_cast<size_t>(kTokens));
  ExpectSpans(r.rollout, SpanKv::kRecomputed);
  EXPECT_EQ(Slice(r.rollout.tokens, 0, kSwapAt), Slice(v0.tokens, 0, kSwapAt)) << "before the swap: the v0-only run";
  for (int i = 0; i < kSwapAt; ++i) EXPECT_EQ(r.rollout.logprobs[i], v0.logprobs[i]) << "behaviour logprob " << i;
  // After the swap: what a fresh v1 engine generates from prompt + the pre-swap tokens.
  std::vector<int32_t> prefix = Prompt(kPrompt);
  for (int i = 0; i < kSwapAt; ++i) prefix.push_back(r.rollout.tokens[i]);
  const auto v1 = RunOne(MakeEngine(99).get(), Greedy(prefix, kTokens - kSwapAt));
  EXPECT_EQ(Slice(r.rollout.tokens, kSwapAt, kTokens), v1.tokens);
  EXPECT_EQ(r.cached_blocks_after_install, 0);
  EXPECT_EQ(r.metrics.inflight_recomputed, 1);
  EXPECT_EQ(r.metrics.generation_tokens_by_kv["recomputed"], kTokens - kSwapAt);
  EXPECT_EQ(r.metrics.generation_tokens_by_kv["fresh"], kSwapAt);
}

TEST(PolicyModesTest, KeepContinuesOnStaleKvAndNoNewRequestHitsIt) {
  const auto v0 = RunOne(MakeEngine(1).get(), Greedy(Prompt(kPrompt), kTokens));
  // A request queued while paused whose prompt is exactly what the kept request holds KV for:
  // with any stale hash left it would hit those blocks.
  std::vector<int32_t> held = Prompt(kPrompt);
  for (int i = 0; i < kSwapAt; ++i) held.push_back(v0.tokens[i]);
  SwapRun r = RunAcrossSwap(InFlightKv::kKeep, held);
  ASSERT_EQ(r.rollout.tokens.size(), static_cast<size_t>(kTokens));
  ExpectSpans(r.rollout, SpanKv::kStale);
  EXPECT_EQ(Slice(r.rollout.tokens, 0, kSwapAt), Slice(v0.tokens, 0, kSwapAt));
  EXPECT_EQ(r.cached_blocks_after_install, 0) << "no hash survives the swap";
  EXPECT_EQ(r.late.cached_tokens, 0) << "the new request hit no block computed under the old weights";
  EXPECT_EQ(r.late.tokens, RunOne(MakeEngine(99).get(), Greedy(held, 8)).tokens) << "it ran on fresh v1 KV";
  // Stale KV: the continuation is not what fresh v1 KV gives.
  const auto v1 = RunOne(MakeEngine(99).get(), Greedy(held, kTokens - kSwapAt));
  EXPECT_NE(Slice(r.rollout.tokens, kSwapAt, kTokens), v1.tokens);
  // The late request registered fresh v1 blocks for the shared prefix; a request over the kept
  // request's whole sequence reaches past them only through blocks the kept request computed on
  // stale KV, which it never registered: its output is what fresh v1 weights give.
  std::vector<int32_t> whole = Prompt(kPrompt);
  whole.insert(whole.end(), r.rollout.tokens.begin(), r.rollout.tokens.end() - 1);
  EXPECT_EQ(r.after_end.tokens, RunOne(MakeEngine(99).get(), Greedy(whole, 4)).tokens);
  EXPECT_LE(r.after_end.cached_tokens, 16) << "at most the late request's one fresh full block";
  EXPECT_EQ(r.metrics.inflight_kept, 1);
  EXPECT_EQ(r.metrics.generation_tokens_by_kv["stale"], kTokens - kSwapAt);
}

TEST(PolicyModesTest, KeptBlocksAreNeverHitAfterTheRequestEnds) {
  // Keep: the request's blocks were unhashed at the swap and it registered none after it (its KV
  // is stale), so nothing it computed can be hit once it released them.
  SwapRun keep = RunAcrossSwap(InFlightKv::kKeep, std::nullopt);
  EXPECT_EQ(keep.after_end.cached_tokens, 0);
  // Recompute: its blocks were recomputed under v1, so they are fresh and may be hit.
  SwapRun recompute = RunAcrossSwap(InFlightKv::kRecompute, std::nullopt);
  EXPECT_GT(recompute.after_end.cached_tokens, 0);
}

TEST(PolicyModesTest, PauseAbortMarksRequestsAbortedByThePause) {
  auto e = MakeEngine(1);
  auto s = *e->AddRequest(Greedy(Prompt(kPrompt), kTokens));
  while (s->WaitFrom(SIZE_MAX, std::chrono::milliseconds(0)).tokens.size() < 3) ASSERT_TRUE(e->Step());
  ASSERT_TRUE(e->Pause(PauseMode::kAbort).ok());
  auto snap = s->Wait();
  EXPECT_EQ(snap.finish, FinishReason::kAbort);
  EXPECT_TRUE(snap.aborted_by_pause);
  ASSERT_EQ(snap.spans.size(), 1u);
  EXPECT_EQ(snap.spans[0].to_token, 3);
  auto t = *e->AddRequest(Greedy(Prompt(kPrompt), kTokens));
  e->Resume();
  EXPECT_EQ(e->Abort({}), 1);
  EXPECT_FALSE(t->Wait().aborted_by_pause) << "an abort by id is not an abort by a pause";
}

TEST(PolicyModesTest, InFlightKvNames) {
  EXPECT_EQ(*InFlightKvFromName("keep"), InFlightKv::kKeep);
  EXPECT_EQ(*InFlightKvFromName("recompute"), InFlightKv::kRecompute);
  auto bad = InFlightKvFromName("stale");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'stale'"), std::string::npos);
}

}  // namespace
}  // namespace rc::engine
