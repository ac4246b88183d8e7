// Planning speed for real model shapes: qwen3-8b fsdp:8 -> tp:2 and qwen3-30b-a3b fsdp:16 -> tp:4+ep:4
// (engine rank 0). Counters report the plan's descriptors, full pulls and bytes; the second argument
// is the descriptor budget (64 = default, 1<<30 = never pull whole rows).
#include <benchmark/benchmark.h>

#include "rolloutcore/refit/layouts.h"
#include "rolloutcore/refit/planner.h"

namespace rc::refit {
namespace {

struct Case {
  const char* model;
  const char* source;
  const char* target;
};

constexpr Case kCases[] = {
    {"qwen3-8b", "fsdp:8", "tp:2"},
    {"qwen3-30b-a3b", "fsdp:16", "tp:4+ep:4"},
};

void SetCounters(benchmark::State& state, const TransferPlan& p) {
  state.counters["descriptors"] = static_cast<double>(p.stats.descriptors);
  state.counters["copies"] = static_cast<double>(p.stats.selected_copies);
  state.counters["full_pulls"] = static_cast<double>(p.stats.full_pulls);
  state.counters["GB_needed"] = static_cast<double>(p.stats.bytes_needed) / 1e9;
  state.counters["GB_planned"] = static_cast<double>(p.stats.bytes_planned) / 1e9;
  state.counters["planned_eq_needed"] = p.stats.bytes_planned == p.stats.bytes_needed ? 1 : 0;
}

// Plans engine rank 0 of case state.range(0) in every iteration; with `capture` the loader's
// capture is part of the timed work (what `rolloutcore plan` reports), else it is done once.
void RunPlans(benchmark::State& state, bool capture, int64_t budget) {
  const Case& c = kCases[state.range(0)];
  const ModelConfig config = *ModelPreset(c.model);
  const Manifest manifest = *MakeTrainerManifest(config, *ParseTrainerLayout(c.source));
  const EngineLayout layout = *ParseEngineLayout(c.target);
  const Capture once = *CaptureEngineRank(config, layout, 0);
  PlanOptions o;
  o.descriptor_budget = budget;
  TransferPlan last;
  for (auto _ : state) {
    Result<TransferPlan> p = capture ? BuildPlan(*CaptureEngineRank(config, layout, 0), manifest, o)
                                     : BuildPlan(once, manifest, o);
    if (!p.ok()) {
      state.SkipWithError(p.status().ToString().c_str());
      return;
    }
    last = std::move(p).value();
    benchmark::DoNotOptimize(last);
  }
  state.SetLabel(std::string(c.model) + " " + c.source + " -> " + c.target);
  SetCounters(state, last);
}

void BM_Plan(benchmark::State& state) { RunPlans(state, false, state.range(1)); }
void BM_CaptureAndPlan(benchmark::State& state) { RunPlans(state, true, 64); }

BENCHMARK(BM_Plan)->ArgsProduct({{0, 1}, {64, 1 << 30}})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CaptureAndPlan)->DenseRange(0, 1)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace rc::refit

BENCHMARK_MAIN();
