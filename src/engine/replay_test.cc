// Engine::Replay: refuses unless paused, reproduces exactly what a greedy request with logprobs
// computes on the same weights, and leaves the prefix cache and frozen requests alone.
// Engine::PreReplay: replays probes on another image of the weights while the engine serves,
// bit for bit what Replay computes once that image is live, served only at the generation where
// it became live, without changing what user requests compute or touching the prefix cache.
#include <gtest/gtest.h>

#include <cstring>
#include <thread>
#include <tuple>

#include "rolloutcore/engine/engine.h"
#include "rolloutcore/engine/engine_loop.h"
#include "rolloutcore/engine/loader.h"

namespace rc::engine {
namespace {

std::unique_ptr<Engine> Make(int tp = 1, int64_t num_kv_blocks = 0) {
  EngineOptions o;
  o.num_threads = 1;
  o.tensor_parallel_size = tp;
  o.num_kv_blocks = num_kv_blocks;
  if (num_kv_blocks > 0) o.max_model_len = num_kv_blocks * o.block_size;
  auto e = CreateEngine({"tiny", "dummy", 3}, o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return std::move(e).value();
}

std::vector<int32_t> Prompt() { return {5, 17, 42, 99, 3, 250, 7, 64, 33, 12, 8, 1, 200, 150, 90, 31, 77}; }

TEST(EngineReplayTest, RefusedWhileServingAndBadArgumentsNameTheField) {
  auto e = Make();
  auto r = e->Replay(Prompt(), 4, 3);
  ASSERT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().ToString();
  EXPECT_NE(r.status().message().find("paused"), std::string::npos);
  ASSERT_TRUE(e->Pause(PauseMode::kAbort).ok());
  EXPECT_NE(e->Replay({}, 4, 3).status().message().find("prompt"), std::string::npos);
  EXPECT_NE(e->Replay({1, 999999}, 4, 3).status().message().find("prompt[1]"), std::string::npos);
  EXPECT_NE(e->Replay(Prompt(), 0, 3).status().message().find("steps"), std::string::npos);
  EXPECT_NE(e->Replay(Prompt(), kMaxReplaySteps + 1, 3).status().message().find("steps"), std::string::npos);
  EXPECT_NE(e->Replay(Prompt(), 4, kMaxReplayTopK + 1).status().message().find("top_k"), std::string::npos);
}

TEST(EngineReplayTest, MatchesAGreedyRequestAndTouchesNoCache) {
  auto e = Make();
  EngineLoop loop(e.get());
  loop.Start();
  GenerateRequest g;
  g.prompt = Prompt();
  g.sampling.temperature = 0;
  g.sampling.num_logprobs = 5;
  g.sampling.max_tokens = 8;
  g.sampling.ignore_eos = true;
  auto stream = e->AddRequest(g);
  ASSERT_TRUE(stream.ok());
  RequestStream::Snapshot want = (*stream)->Wait();
  ASSERT_EQ(want.tokens.size(), 8u);

  ASSERT_TRUE(e->Pause(PauseMode::kWait).ok());
  const EngineState before = e->State();
  const EngineMetrics m0 = e->Metrics();
  ASSERT_GT(before.cached_blocks, 0) << "the request left its prompt blocks in the prefix cache";
  auto r = e->Replay(Prompt(), 8, 5);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->steps.size(), 8u);
  for (size_t i = 0; i < 8; ++i) {
    EXPECT_EQ(r->steps[i].token, want.tokens[i]) << "step " << i;
    EXPECT_EQ(r->steps[i].logprob, want.logprobs[i]) << "step " << i << ": same weights, same kernels, same numbers";
    ASSERT_EQ(r->steps[i].top_logprobs.size(), 5u);
    EXPECT_EQ(r->steps[i].top_logprobs, want.top_logprobs[i]) << "step " << i;
  }
  EXPECT_GT(r->elapsed_ms, 0);
  const EngineState after = e->State();
  EXPECT_EQ(after.cached_blocks, before.cached_blocks) << "nothing entered or left the prefix cache";
  EXPECT_EQ(after.blocks_in_use, before.blocks_in_use) << "every borrowed block went back";
  EXPECT_EQ(e->Metrics().prefix_cache_queries, m0.prefix_cache_queries) << "no request was admitted";
  EXPECT_EQ(e->Metrics().generation_tokens, m0.generation_tokens);
  EXPECT_TRUE(e->IsPaused());
  e->Resume();
  loop.Stop();
}

// Issue 36 #3: frozen (pause keep) requests that hold every block of the pool do not make the
// replay fail for lack of KV: it runs on the replay reserve, computes what it computes on an idle
// engine, and the frozen requests keep their blocks and continue after the resume.
TEST(EngineReplayTest, RunsWhenFrozenRequestsHoldTheWholePool) {
  auto idle = Make(1, /*num_kv_blocks=*/4);  // 64 positions, max_model_len 64
  ASSERT_TRUE(idle->Pause(PauseMode::kAbort).ok());
  auto want = idle->Replay(Prompt(), 12, 3);
  ASSERT_TRUE(want.ok()) << want.status().ToString();

  // No loop: the test steps the engine itself, so the request is frozen at a known point.
  auto e = Make(1, /*num_kv_blocks=*/4);
  GenerateRequest g;
  g.prompt = Prompt();
  g.sampling.temperature = 0;
  g.sampling.max_tokens = 64 - static_cast<int64_t>(g.prompt.size());
  g.sampling.ignore_eos = true;
  auto stream = e->AddRequest(g);
  ASSERT_TRUE(stream.ok()) << stream.status().ToString();
  for (int i = 0; i < 200 && e->State().blocks_in_use < 4; ++i) e->Step();
  ASSERT_TRUE(e->Pause(PauseMode::kKeep, InFlightKv::kKeep).ok());
  const EngineState frozen = e->State();
  ASSERT_EQ(frozen.blocks_in_use, 4) << "the frozen request holds every block of the pool";
  ASSERT_EQ(frozen.num_running, 1);

  auto r = e->Replay(Prompt(), 12, 3, /*allow_precomputed=*/false);
  ASSERT_TRUE(r.ok()) << "no KV block is free, yet the replay runs: " << r.status().ToString();
  ASSERT_EQ(r->steps.size(), want->steps.size());
  for (size_t i = 0; i < r->steps.size(); ++i) {
    EXPECT_EQ(r->steps[i].token, want->steps[i].token) << "step " << i;
    EXPECT_EQ(r->steps[i].logprob, want->steps[i].logprob) << "step " << i << ": the reserve's KV is KV like any other";
  }
  EXPECT_EQ(e->State().blocks_in_use, 4) << "the frozen request kept its blocks";
  e->Resume();
  for (int i = 0; i < 200 && !(*stream)->WaitFrom(SIZE_MAX, std::chrono::milliseconds(0)).finished; ++i) e->Step();
  RequestStream::Snapshot done = (*stream)->Wait();
  EXPECT_EQ(done.tokens.size(), 64 - Prompt().size()) << "the frozen request continued to its end";
}

// A copy of the live weights in buffers of their own (what a staged image is to the engine).
struct Image {
  std::vector<std::map<std::string, std::shared_ptr<WeightBuffer>>> buffers;
  WeightImage view() const {
    WeightImage v(buffers.size());
    for (size_t r = 0; r < buffers.size(); ++r) {
      for (const auto& [name, b] : buffers[r]) v[r].emplace(name, std::span<const std::byte>(b->data(), b->size()));
    }
    return v;
  }
};

Image CopyLive(const Engine& e) {
  Image img;
  img.buffers.resize(static_cast<size_t>(e.tensor_parallel_size()));
  for (int r = 0; r < e.tensor_parallel_size(); ++r) {
    for (const auto& [name, p] : e.Parameters(r).all()) {
      if (!p.alias_of.empty()) continue;
      auto b = WeightBuffer::Allocate(p.nbytes()).value();
      std::memcpy(b->data(), p.bytes(), p.nbytes());
      EXPECT_TRUE(b->SetReadOnly(true).ok());
      img.buffers[static_cast<size_t>(r)][name] = b;
    }
  }
  return img;
}

// Installs `img` by exchanging storage (the receiver's swap install); the engine must be paused.
Status SwapIn(Engine* e, Image* img, const std::string& label) {
  auto exchange = [img](int rank, const RankLayout&, ParameterStore* params) -> Status {
    for (auto& [name, b] : img->buffers[static_cast<size_t>(rank)]) RC_RETURN_IF_ERROR(params->ExchangeStorage(name, &b));
    return OkStatus();
  };
  return e->InstallWeights(exchange, label, e->State().install_generation + 1, true, Engine::InstallWrites::kExchange);
}

std::vector<ReplayProbeRequest> Probes() {
  // Different prompt lengths and steps: the batch shrinks after the shorter probe's last step.
  return {ReplayProbeRequest{Prompt(), 8, 5}, ReplayProbeRequest{{3, 1, 4, 1, 5}, 5, 3},
          ReplayProbeRequest{{9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 22, 33, 44, 55, 66, 77, 88, 99, 111}, 12, 0}};
}

void ExpectSame(const ReplayOutput& a, const ReplayOutput& b, const std::string& what) {
  ASSERT_EQ(a.steps.size(), b.steps.size()) << what;
  for (size_t i = 0; i < a.steps.size(); ++i) {
    EXPECT_EQ(a.steps[i].token, b.steps[i].token) << what << " step " << i;
    // Bitwise: EXPECT_EQ on floats is exact.
    EXPECT_EQ(a.steps[i].logprob, b.steps[i].logprob) << what << " step " << i;
    EXPECT_EQ(a.steps[i].top_logprobs, b.steps[i].top_logprobs) << what << " step " << i;
  }
}

Result<ReplayOutput> ReplayOf(Engine* e, const ReplayProbeRequest& p, bool allow_precomputed = true) {
  return e->Replay(p.prompt, p.steps, p.top_k, allow_precomputed);
}

constexpr auto kFar = std::chrono::hours(1);

class PreReplayTest : public ::testing::TestWithParam<int> {};

// The staged image's pre-replay (batched) is bit for bit the live replay (one by one) of the
// same bytes after the swap, at tp 1 and tp 2; it is served once adopted, marked precomputed.
TEST_P(PreReplayTest, StagedImageReplayEqualsLiveReplayAfterTheSwapExactly) {
  auto e = Make(GetParam());
  Image img = CopyLive(*e);
  const auto probes = Probes();
  const PreReplayReport rep = e->PreReplay(img.view(), 11, probes, std::chrono::steady_clock::now() + kFar);
  ASSERT_TRUE(rep.ran) << rep.why;
  EXPECT_TRUE(rep.batched);
  EXPECT_EQ(rep.probes, 3);
  EXPECT_GT(rep.ms, 0);
  EXPECT_EQ(e->State().blocks_in_use, 0) << "every borrowed block went back";

  ASSERT_TRUE(e->Pause(PauseMode::kAbort).ok());
  EXPECT_FALSE(ReplayOf(e.get(), probes[0])->precomputed) << "not adopted: computed on the live weights";
  EXPECT_FALSE(e->AdoptPreReplay(11, e->State().install_generation))
      << "the image is a copy, not the live storage: adoption must be refused";
  // A refused adoption is final; pre-replay again for the swap below.
  ASSERT_TRUE(e->PreReplay(img.view(), 12, probes, std::chrono::steady_clock::now() + kFar).ran);
  ASSERT_TRUE(SwapIn(e.get(), &img, "swapped").ok());
  EXPECT_FALSE(e->AdoptPreReplay(11, e->State().install_generation)) << "another image id";
  ASSERT_TRUE(e->PreReplay(CopyLive(*e).view(), 13, probes, std::chrono::steady_clock::now() + kFar).ran);
  EXPECT_FALSE(e->AdoptPreReplay(13, e->State().install_generation)) << "a copy of the live bytes is not the live storage";

  // The real sequence: pre-replay on the image, swap it in, adopt at the new generation.
  Image img2 = CopyLive(*e);
  ASSERT_TRUE(e->PreReplay(img2.view(), 14, probes, std::chrono::steady_clock::now() + kFar).ran);
  ASSERT_TRUE(SwapIn(e.get(), &img2, "swapped-2").ok());
  EXPECT_FALSE(e->AdoptPreReplay(14, e->State().install_generation - 1)) << "not the current generation";
  ASSERT_TRUE(e->PreReplay(CopyLive(*e).view(), 15, probes, std::chrono::steady_clock::now() + kFar).ran);
  Image img3 = CopyLive(*e);
  ASSERT_TRUE(e->PreReplay(img3.view(), 16, probes, std::chrono::steady_clock::now() + kFar).ran);
  ASSERT_TRUE(SwapIn(e.get(), &img3, "swapped-3").ok());
  ASSERT_TRUE(e->AdoptPreReplay(16, e->State().install_generation));
  for (size_t i = 0; i < probes.size(); ++i) {
    auto pre = ReplayOf(e.get(), probes[i]);
    ASSERT_TRUE(pre.ok()) << pre.status().ToString();
    EXPECT_TRUE(pre->precomputed) << "probe " << i;
    EXPECT_EQ(pre->computed_on, "staged_image");
    EXPECT_GT(pre->staged_ms, 0);
    auto live = ReplayOf(e.get(), probes[i], /*allow_precomputed=*/false);
    ASSERT_TRUE(live.ok()) << live.status().ToString();
    EXPECT_FALSE(live->precomputed);
    EXPECT_EQ(live->computed_on, "live");
    ExpectSame(*pre, *live, std::to_string(GetParam()) + "-way tp, probe " + std::to_string(i));
  }
  // Only the exact request is served: another top_k or step count is computed now.
  EXPECT_FALSE(e->Replay(probes[0].prompt, probes[0].steps, 4)->precomputed);
  EXPECT_FALSE(e->Replay(probes[0].prompt, probes[0].steps - 1, probes[0].top_k)->precomputed);
  EXPECT_TRUE(ReplayOf(e.get(), probes[0])->precomputed);
  e->Resume();
}

INSTANTIATE_TEST_SUITE_P(Tp, PreReplayTest, ::testing::Values(1, 2));

// The greedy continuation of each probe on the live weights (what a trainer that computes the
// same numbers records as the probe's expected tokens).
std::vector<std::vector<int32_t>> LiveTokens(Engine* e, const std::vector<ReplayProbeRequest>& probes) {
  std::vector<std::vector<int32_t>> out;
  EXPECT_TRUE(e->Pause(PauseMode::kAbort).ok());
  for (const auto& p : probes) {
    auto r = ReplayOf(e, p, /*allow_precomputed=*/false);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    std::vector<int32_t> t;
    if (r.ok()) {
      for (const auto& st : r->steps) t.push_back(st.token);
    }
    out.push_back(t);
  }
  e->Resume();
  return out;
}

// Pre-replays `probes` on a copy of the live weights, swaps it in, adopts it, and checks every
// probe's precomputed answer against a live replay bit for bit; returns the report.
PreReplayReport PreReplayAndCompare(Engine* e, uint64_t id, const std::vector<ReplayProbeRequest>& probes,
                                    const std::string& what) {
  Image img = CopyLive(*e);
  PreReplayReport rep = e->PreReplay(img.view(), id, probes, std::chrono::steady_clock::now() + kFar);
  EXPECT_TRUE(rep.ran) << what << ": " << rep.why;
  EXPECT_EQ(e->State().blocks_in_use, 0) << what << ": every borrowed block went back";
  EXPECT_TRUE(e->Pause(PauseMode::kAbort).ok());
  EXPECT_TRUE(SwapIn(e, &img, what).ok());
  EXPECT_TRUE(e->AdoptPreReplay(id, e->State().install_generation)) << what;
  for (size_t i = 0; i < probes.size(); ++i) {
    auto pre = ReplayOf(e, probes[i]);
    auto live = ReplayOf(e, probes[i], /*allow_precomputed=*/false);
    EXPECT_TRUE(pre.ok() && live.ok()) << what;
    if (!pre.ok() || !live.ok()) continue;
    EXPECT_TRUE(pre->precomputed) << what << " probe " << i;
    ExpectSame(*pre, *live, what + ", probe " + std::to_string(i));
  }
  e->Resume();
  return rep;
}

// Teacher forcing (ReplayProbeRequest::forced): with the recorded continuation every step comes
// from one forward and equals the step-by-step decode bit for bit; a hint that diverges at step k
// keeps steps 0..k and decodes the rest, and the answer is still the decode's, bit for bit; a hint
// of the wrong length or with an id outside the vocabulary is not used.
TEST_P(PreReplayTest, TeacherForcedStepsEqualTheDecodeAndADivergenceDecodesOn) {
  auto e = Make(GetParam());
  const std::string tp = std::to_string(GetParam()) + "-way tp";
  std::vector<ReplayProbeRequest> probes = Probes();
  const auto live = LiveTokens(e.get(), probes);
  for (size_t i = 0; i < probes.size(); ++i) probes[i].forced = live[i];

  const PreReplayReport all = PreReplayAndCompare(e.get(), 21, probes, tp + ", the recorded tokens");
  EXPECT_EQ(all.forced, 3);
  EXPECT_EQ(all.diverged, 0);
  EXPECT_EQ(all.forwards, 1) << "3 probes of 64 positions together: one forward scores every step";

  // Probe 2 (12 steps) diverges at step 4: the hint's token there is another one, so the
  // engine's own token 4 continues and steps 5..11 are decoded (7 decode forwards).
  std::vector<ReplayProbeRequest> wrong = probes;
  wrong[2].forced[4] = (wrong[2].forced[4] + 1) % 256;
  const PreReplayReport d = PreReplayAndCompare(e.get(), 22, wrong, tp + ", a hint diverging at step 4");
  EXPECT_EQ(d.forced, 2);
  EXPECT_EQ(d.diverged, 1);
  EXPECT_EQ(d.forwards, 1 + 7);

  // A divergence at the last step changes nothing: no later step reads that token.
  std::vector<ReplayProbeRequest> last = probes;
  last[1].forced.back() = (last[1].forced.back() + 1) % 256;
  const PreReplayReport l = PreReplayAndCompare(e.get(), 23, last, tp + ", a hint differing at its last step");
  EXPECT_EQ(l.forced, 3);
  EXPECT_EQ(l.forwards, 1);

  // Unusable hints: decoded from the prompt as without one.
  std::vector<ReplayProbeRequest> bad = probes;
  bad[0].forced.pop_back();
  bad[1].forced[0] = 1 << 30;
  const PreReplayReport b = PreReplayAndCompare(e.get(), 24, bad, tp + ", unusable hints");
  EXPECT_EQ(b.forced, 1);
  EXPECT_EQ(b.diverged, 0);
  EXPECT_EQ(b.forwards, 1 + 8) << "probe 2 forced; probes 0 (8 steps) and 1 (5 steps) decode together";
}

// Teacher-forced forwards hold at most kPreReplayForcedTokens positions (a bounded stall for the
// requests served beside them): probes are grouped in order.
TEST(EnginePreReplayTest, TeacherForcedForwardsAreBoundedInPositions) {
  auto e = Make();
  std::vector<ReplayProbeRequest> probes;
  for (int p = 0; p < 3; ++p) {
    std::vector<int32_t> prompt;
    prompt.reserve(120);
    for (int k = 0; k < 120; ++k) prompt.push_back((p * 37 + k * 11) % 250 + 1);
    probes.push_back(ReplayProbeRequest{prompt, 8, 2});  // 127 positions each
  }
  const auto live = LiveTokens(e.get(), probes);
  for (size_t i = 0; i < probes.size(); ++i) probes[i].forced = live[i];
  const PreReplayReport rep = PreReplayAndCompare(e.get(), 31, probes, "three 127-position probes");
  EXPECT_EQ(rep.forced, 3);
  EXPECT_EQ(rep.forwards, 2) << "254 positions in the first forward, the third probe alone";
}

// Whatever changes the live weights after the adoption ends it, for good.
TEST(EnginePreReplayTest, ServedOnlyAtTheGenerationItsImageBecameLive) {
  auto e = Make();
  const auto probes = Probes();
  auto adopt = [&](uint64_t id) {
    Image img = CopyLive(*e);
    ASSERT_TRUE(e->PreReplay(img.view(), id, probes, std::chrono::steady_clock::now() + kFar).ran);
    ASSERT_TRUE(e->Pause(PauseMode::kAbort).ok());
    ASSERT_TRUE(SwapIn(e.get(), &img, std::to_string(id)).ok());
    ASSERT_TRUE(e->AdoptPreReplay(id, e->State().install_generation));
    ASSERT_TRUE(ReplayOf(e.get(), probes[1])->precomputed);
  };
  // An in-place install (the copy or in-place delta path), even one that writes nothing.
  adopt(1);
  auto noop = [](int, const RankLayout&, ParameterStore*) { return OkStatus(); };
  ASSERT_TRUE(e->InstallWeights(noop, "in-place", e->State().install_generation + 1).ok());
  EXPECT_FALSE(ReplayOf(e.get(), probes[1])->precomputed) << "an in-place install";
  EXPECT_FALSE(e->AdoptPreReplay(1, e->State().install_generation)) << "an invalidation is final";
  EXPECT_FALSE(ReplayOf(e.get(), probes[1])->precomputed);
  e->Resume();
  // A write into live memory outside an install (the fault routes).
  adopt(2);
  ASSERT_TRUE(e->WriteLiveForTesting(0, [](ParameterStore*) { return OkStatus(); }).ok());
  EXPECT_FALSE(ReplayOf(e.get(), probes[1])->precomputed) << "WriteLiveForTesting";
  EXPECT_FALSE(e->AdoptPreReplay(2, e->State().install_generation));
  e->Resume();
  // Another swap install without a pre-replay of its own.
  adopt(3);
  Image other = CopyLive(*e);
  ASSERT_TRUE(SwapIn(e.get(), &other, "v3b").ok());
  EXPECT_FALSE(ReplayOf(e.get(), probes[1])->precomputed) << "a swap of another image";
  e->Resume();
  // Dropped (a new stage).
  adopt(4);
  e->DropPreReplay();
  EXPECT_FALSE(ReplayOf(e.get(), probes[1])->precomputed) << "dropped";
  e->Resume();
}

// A pre-replay that cannot borrow its blocks from the free list does not run (and fails nothing).
TEST(EnginePreReplayTest, NoFreeBlocksMeansNotRunWithTheReason) {
  auto e = Make(1, /*num_kv_blocks=*/2);  // 32 positions, max_model_len 32
  Image img = CopyLive(*e);
  // Each probe fits the pool alone (2 blocks); both at once do not.
  const PreReplayReport rep = e->PreReplay(img.view(), 1, {ReplayProbeRequest{Prompt(), 10, 3}, ReplayProbeRequest{Prompt(), 10, 3}},
                                           std::chrono::steady_clock::now() + kFar);
  EXPECT_FALSE(rep.ran);
  EXPECT_NE(rep.why.find("cannot spare 4 blocks"), std::string::npos) << rep.why;
  EXPECT_EQ(e->State().blocks_in_use, 0);
  const PreReplayReport late =
      e->PreReplay(img.view(), 2, {ReplayProbeRequest{{1, 2}, 2, 1}}, std::chrono::steady_clock::now() - kFar);
  EXPECT_FALSE(late.ran);
  EXPECT_NE(late.why.find("deadline"), std::string::npos) << late.why;
  EXPECT_EQ(e->State().blocks_in_use, 0);
}

// While requests are served: their greedy outputs are those of an engine without the pre-replay,
// and the prefix cache sees exactly the same lookups and registrations.
TEST(EnginePreReplayTest, WhileServingChangesNoOutputAndNoPrefixCacheEntry) {
  auto run = [](bool prereplay) {
    auto e = Make();
    EngineLoop loop(e.get());
    Image img = CopyLive(*e);
    std::vector<std::shared_ptr<RequestStream>> streams;
    for (int i = 0; i < 6; ++i) {
      GenerateRequest g;
      g.prompt = Prompt();
      g.prompt.push_back(static_cast<int32_t>(i));  // a shared 16-token prefix: cached blocks get hit
      g.sampling.temperature = 0;
      g.sampling.num_logprobs = 2;
      g.sampling.max_tokens = 24;
      g.sampling.ignore_eos = true;
      streams.push_back(e->AddRequest(g).value());
    }
    // Queued before the loop starts: the first step admits all six, in both runs.
    loop.Start();
    PreReplayReport rep;
    if (prereplay) {
      std::vector<ReplayProbeRequest> probes = Probes();
      probes.push_back(ReplayProbeRequest{Prompt(), 32, 5});
      rep = e->PreReplay(img.view(), 1, probes, std::chrono::steady_clock::now() + kFar);
      EXPECT_TRUE(rep.ran) << rep.why;
      EXPECT_FALSE(e->IsPaused());
    }
    std::vector<RequestStream::Snapshot> out;
    out.reserve(streams.size());
    for (auto& s : streams) out.push_back(s->Wait());
    // More requests after it: the prefix cache holds what the first ones registered, no more.
    GenerateRequest g;
    g.prompt = Prompt();
    g.sampling.temperature = 0;
    g.sampling.max_tokens = 4;
    out.push_back(e->AddRequest(g).value()->Wait());
    loop.Stop();
    const EngineMetrics m = e->Metrics();
    return std::make_tuple(out, m.prefix_cache_queries, m.prefix_cache_hits, e->State().cached_blocks,
                           e->State().blocks_in_use);
  };
  const auto [want, q0, h0, c0, u0] = run(false);
  const auto [got, q1, h1, c1, u1] = run(true);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].tokens, want[i].tokens) << "request " << i;
    EXPECT_EQ(got[i].logprobs, want[i].logprobs) << "request " << i;
  }
  EXPECT_EQ(q1, q0) << "the pre-replay looked nothing up";
  EXPECT_EQ(h1, h0);
  EXPECT_EQ(c1, c0) << "the pre-replay registered nothing";
  EXPECT_EQ(u1, 0);
  EXPECT_EQ(u0, 0);
}

}  // namespace
}  // namespace rc::engine
