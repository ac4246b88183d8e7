// Engine::PreReplay on a qwen3-0.6b-shaped engine (dummy bf16 weights, all threads), the work a
// refit's stage does after the wire when the version carries probes (not run by ctest). The
// image is a copy of the live weights in other weight buffers (as a staged image is), the probes'
// forced tokens are the engine's own greedy tokens (recorded once, first), so every run is one
// teacher-forced forward over probes x (prompt + steps - 1) positions with steps logits rows per
// probe. Arguments: probes, steps. Prints ms per pre-replay and the forward's GFLOPS (2 x the
// multiply-adds of every projection and of lm_head's rows).
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstring>
#include <vector>

#include "rolloutcore/engine/engine.h"
#include "rolloutcore/engine/loader.h"

namespace rc::engine {
namespace {

constexpr int64_t kPromptTokens = 7;

struct Fixture {
  std::unique_ptr<Engine> engine;
  std::vector<std::shared_ptr<WeightBuffer>> copies;  // as the receiver's staging buffers are
  WeightImage image;
  double flops_per_position = 0;  // the layers' projections
  double flops_per_logits_row = 0;

  Fixture() {
    EngineOptions o;
    auto e = CreateEngine({"qwen3-0.6b-like", "dummy", 11}, o);
    if (!e.ok()) return;
    engine = std::move(e).value();
    image.resize(static_cast<size_t>(engine->tensor_parallel_size()));
    for (int r = 0; r < engine->tensor_parallel_size(); ++r) {
      for (const auto& [name, p] : engine->Parameters(r).all()) {
        // Every matrix but the embedding is a projection of each position, but lm_head (tied: an
        // alias of the embedding, not copied) of each logits row only.
        const double flops = p.shape.size() == 2 ? 2 * static_cast<double>(p.numel) : 0;
        if (name.find("lm_head") != std::string::npos) {
          flops_per_logits_row += flops;
        } else if (name.find("embed_tokens") == std::string::npos) {
          flops_per_position += flops;
        }
        if (!p.alias_of.empty()) continue;
        auto buf = WeightBuffer::Allocate(p.nbytes());
        if (!buf.ok()) {
          engine.reset();  // no whole image: the benchmark skips
          return;
        }
        std::memcpy((*buf)->data(), p.bytes(), p.nbytes());
        image[static_cast<size_t>(r)].emplace(name, std::span<const std::byte>((*buf)->data(), p.nbytes()));
        copies.push_back(std::move(buf).value());
      }
    }
  }
};

Fixture& Shared() {
  static Fixture f;
  return f;
}

std::vector<ReplayProbeRequest> Probes(Engine& e, int64_t n, int64_t steps) {
  std::vector<ReplayProbeRequest> out;
  if (!e.Pause(PauseMode::kAbort).ok()) return out;
  for (int64_t i = 0; i < n; ++i) {
    ReplayProbeRequest r;
    for (int64_t t = 0; t < kPromptTokens; ++t) r.prompt.push_back(static_cast<int32_t>(1 + 37 * i + 101 * t));
    r.steps = steps;
    r.top_k = 5;
    auto rep = e.Replay(r.prompt, steps, 5, /*allow_precomputed=*/false);
    if (!rep.ok()) return {};
    for (const auto& st : rep->steps) r.forced.push_back(st.token);
    out.push_back(std::move(r));
  }
  (void)e.Resume();
  return out;
}

void BM_PreReplay(benchmark::State& state) {
  Fixture& f = Shared();
  if (f.engine == nullptr) {
    state.SkipWithError("cannot create the qwen3-0.6b-like engine and a copy of its weights");
    return;
  }
  const int64_t n = state.range(0), steps = state.range(1);
  const std::vector<ReplayProbeRequest> probes = Probes(*f.engine, n, steps);
  if (static_cast<int64_t>(probes.size()) != n) {
    state.SkipWithError("recording the probes' greedy tokens failed");
    return;
  }
  uint64_t id = 0;
  PreReplayReport last;
  for (auto _ : state) {
    last = f.engine->PreReplay(f.image, ++id, probes, std::chrono::steady_clock::now() + std::chrono::minutes(5));
    if (!last.ran || last.forwards != 1) {
      state.SkipWithError(("the pre-replay did not run as one forward: " + last.why).c_str());
      return;
    }
  }
  f.engine->DropPreReplay();
  const double positions = static_cast<double>(n * (kPromptTokens + steps - 1));
  const double flops = positions * f.flops_per_position + static_cast<double>(n * steps) * f.flops_per_logits_row;
  state.counters["positions"] = positions;
  state.counters["GFLOP"] = flops / 1e9;
  state.counters["GFLOPS"] = benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_PreReplay)->Args({2, 8})->Args({1, 8})->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace rc::engine

BENCHMARK_MAIN();
