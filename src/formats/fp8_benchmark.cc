// The fp8 quantizer's speed (formats/fp8.h) on a 4096 × 4096 bf16 weight (32 MiB in, 16 MiB out):
// the scalar code against the run-time-picked vector loops (AVX-512 or AVX2), per scheme, one
// thread, beside a plain memcpy of the same input bytes. Bytes/s counts the bf16 read.
//   build/<preset>/src/formats/formats_fp8_benchmark
#include <benchmark/benchmark.h>

#include <cstring>
#include <random>
#include <vector>

#include "rolloutcore/formats/fp8.h"
#include "rolloutcore/formats/safetensors.h"

namespace rc::formats {
namespace {

constexpr int64_t kRows = 4096, kCols = 4096;

const std::vector<uint16_t>& Weights() {
  static const std::vector<uint16_t> w = [] {
    std::vector<uint16_t> v(static_cast<size_t>(kRows * kCols));
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0.0f, 0.02f);
    for (auto& b : v) b = F32ToBF16(normal(rng));
    return v;
  }();
  return w;
}

void Run(benchmark::State& state, Fp8Scheme scheme, bool scalar) {
  const auto& w = Weights();
  Fp8Layout l{scheme, kRows, kCols};
  std::vector<uint8_t> q(w.size());
  std::vector<float> s(static_cast<size_t>(l.NumScales()));
  for (auto _ : state) {
    const Status st = scalar ? QuantizeBf16ToFp8Scalar(w, l, q, s, "w") : QuantizeBf16ToFp8(w, l, q, s, "w", 1);
    if (!st.ok()) state.SkipWithError(st.ToString().c_str());
    benchmark::DoNotOptimize(q.data());
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(w.size() * 2));
  state.SetLabel(scalar ? "scalar" : std::string(Fp8QuantizeIsa()));
}

void BM_PerTensorScalar(benchmark::State& s) { Run(s, Fp8Scheme::kPerTensor, true); }
void BM_PerTensorVector(benchmark::State& s) { Run(s, Fp8Scheme::kPerTensor, false); }
void BM_PerChannelScalar(benchmark::State& s) { Run(s, Fp8Scheme::kPerChannel, true); }
void BM_PerChannelVector(benchmark::State& s) { Run(s, Fp8Scheme::kPerChannel, false); }
void BM_BlockScalar(benchmark::State& s) { Run(s, Fp8Scheme::kBlock, true); }
void BM_BlockVector(benchmark::State& s) { Run(s, Fp8Scheme::kBlock, false); }

void BM_MemcpyOfTheInput(benchmark::State& state) {
  const auto& w = Weights();
  std::vector<uint16_t> out(w.size());
  for (auto _ : state) {
    std::memcpy(out.data(), w.data(), w.size() * 2);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(w.size() * 2));
}

BENCHMARK(BM_MemcpyOfTheInput)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PerTensorScalar)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PerTensorVector)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PerChannelScalar)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PerChannelVector)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_BlockScalar)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_BlockVector)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace rc::formats

BENCHMARK_MAIN();
