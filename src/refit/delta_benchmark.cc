// The trainer's host-side delta encoding (EncodeShardDelta, delta.h): one bf16 shard of 64 M
// elements (128 MiB, the size of a large projection's rank shard) against its previous bytes, with a
// fraction of the elements changed in their lowest bit (range(0), per ten thousand: 100 = 1 %, the
// RL fine-tuning regime), spread uniformly. bytes_per_second counts the new shard's bytes. Wall
// time (the shared machine steals CPU time).
//   build/release/src/refit/refit_benchmark --benchmark_filter=EncodeShardDelta
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "rolloutcore/refit/delta.h"

namespace rc::refit {
namespace {

constexpr int64_t kElements = int64_t{64} << 20;

void BM_EncodeShardDelta(benchmark::State& state) {
  const int64_t per_10k = state.range(0);
  std::vector<uint16_t> before(static_cast<size_t>(kElements));
  uint32_t x = 12345;
  for (auto& v : before) {
    x = x * 1664525u + 1013904223u;
    v = static_cast<uint16_t>(x >> 16);
  }
  std::vector<uint16_t> after = before;
  int64_t changed = 0;
  for (int64_t i = 0; i < kElements; ++i) {
    x = x * 1664525u + 1013904223u;
    if ((x >> 8) % 10000 < static_cast<uint32_t>(per_10k)) {
      after[static_cast<size_t>(i)] ^= 1u;
      ++changed;
    }
  }
  const Shape shape{8192, kElements / 8192};
  for (auto _ : state) {
    EncodedDelta d = EncodeShardDelta(DType::kBF16, shape, before.data(), after.data());
    if (d.changed != changed) state.SkipWithError("wrong number of changed elements");
    benchmark::DoNotOptimize(d.bytes.data());
  }
  state.counters["changed"] = static_cast<double>(changed);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kElements * 2);
}
BENCHMARK(BM_EncodeShardDelta)->Arg(0)->Arg(100)->Arg(500)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace rc::refit
