// MatMulNT's kernels side by side (not run by ctest): the AVX2 kernel and the AVX-512 kernel
// (kernels_avx512.cc) over the same x and bf16 weights, split over the same threads the
// way MatMulNT splits them, for the qwen3-0.6b-shaped projections at the pre-replay's M = 30 (two
// probes of 7 prompt + 8 forced tokens) and a 128-token prefill. Arguments: kernel, M, K, N,
// threads. Prints GFLOPS per kernel; compare the rows of one shape, measured in the same run. The
// AVX-512 rows skip on a CPU without AVX-512 (F, BW, DQ, VL). BM_LayerSweep: the same projections
// layer after layer, from the caches or streamed from memory.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "engine/kernels.h"
#include "engine/thread_pool.h"

namespace rc::engine {
namespace {

struct Operands {
  int64_t M, K, N;
  std::vector<float> x, xp, y;
  std::vector<uint16_t> w;
  Operands(int64_t m, int64_t k, int64_t n) : M(m), K(k), N(n), x(m * k), y(m * n), w(n * k) {
    std::mt19937 rng(7);
    std::normal_distribution<float> d;
    for (float& v : x) v = d(rng);
    for (uint16_t& v : w) {
      const float f = d(rng) * 0.02f;
      uint32_t u;
      std::memcpy(&u, &f, 4);
      v = static_cast<uint16_t>(u >> 16);
    }
    xp.resize(static_cast<size_t>(m * internal::PackedRowStride(k)));
  }
};

// Column groups of 16 split over the pool, as MatMulNT does.
template <typename Fn>
void Split(ThreadPool& pool, int64_t N, Fn&& fn) {
  const int64_t groups = (N + 15) / 16;
  pool.ParallelForRange(groups, [&](int64_t gb, int64_t ge) { fn(gb * 16, ge * 16 < N ? ge * 16 : N); });
}

// Argument 0: the kernel (0: AVX2, 1: AVX-512); then M, K, N, threads.
void BM_MatMul(benchmark::State& state) {
  const bool avx512 = state.range(0) == 1;
  if (avx512 ? !KernelsUseAvx512() : !KernelsUseAvx2()) {
    state.SkipWithError(avx512 ? "no AVX-512 (F, BW, DQ, VL) on this CPU" : "no AVX2 on this CPU");
    return;
  }
  Operands o(state.range(1), state.range(2), state.range(3));
  ThreadPool pool(static_cast<int>(state.range(4)));
  for (auto _ : state) {
    internal::PackEvenOdd(o.x.data(), o.M, o.K, o.xp.data());  // MatMulNT packs once per call
    Split(pool, o.N, [&](int64_t n0, int64_t n1) {
      if (avx512) {
        internal::MatMulColumnsAvx512(o.xp.data(), o.x.data(), o.M, o.K, o.w.data(), n0, n1, o.y.data(), o.N);
      } else {
        internal::MatMulColumnsAvx2(o.xp.data(), o.x.data(), o.M, o.K, o.w.data(), n0, n1, o.y.data(), o.N);
      }
    });
    benchmark::DoNotOptimize(o.y.data());
  }
  state.SetLabel(avx512 ? "avx512" : "avx2");
  state.counters["GFLOPS"] =
      benchmark::Counter(2.0 * static_cast<double>(o.M * o.N * o.K) / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

// qwen3-0.6b: qkv [4096, 1024], o [1024, 2048], gate_up [6144, 1024], down [1024, 3072], and the
// lm_head's 16 logits rows [151936, 1024]; M = 30 (pre-replay) and 128 (prefill); 2 threads.
// Each shape runs both kernels one after the other.
void Shapes(benchmark::internal::Benchmark* b) {
  std::vector<std::vector<int64_t>> shapes;
  for (int64_t m : {30, 128}) {
    for (auto [k, n] : {std::pair<int64_t, int64_t>{1024, 4096}, {2048, 1024}, {1024, 6144}, {3072, 1024}}) {
      shapes.push_back({m, k, n});
    }
  }
  shapes.push_back({16, 1024, 151936});
  for (const auto& sh : shapes) {
    for (int64_t kernel : {0, 1}) b->Args({kernel, sh[0], sh[1], sh[2], 2});
  }
}
BENCHMARK(BM_MatMul)->Apply(Shapes)->ArgNames({"kernel", "M", "K", "N", "threads"})->Unit(benchmark::kMillisecond);

// The forward's projections as MatMulNT runs them, layer after layer (qkv, o, gate_up, down of
// qwen3-0.6b at M = 30, 2 threads), over `layers` distinct weight sets: 1 reuses one layer's
// 31 MB (it stays in the caches, like BM_MatMul's operands), 28 streams the model's 0.88 GB from
// memory, as a pre-replay does. Compare the GFLOPS of the two rows.
void BM_LayerSweep(benchmark::State& state) {
  const int64_t layers = state.range(0), M = 30;
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1024, 4096}, {2048, 1024}, {1024, 6144}, {3072, 1024}};
  std::vector<std::vector<uint16_t>> w;
  std::mt19937 rng(3);
  for (int64_t l = 0; l < layers; ++l) {
    for (auto [k, n] : shapes) {
      std::vector<uint16_t> m(static_cast<size_t>(k * n));
      for (uint16_t& v : m) v = static_cast<uint16_t>(0x3c00u + (rng() & 0xffu));
      w.push_back(std::move(m));
    }
  }
  std::vector<float> x(static_cast<size_t>(M * 3072), 0.5f), y(static_cast<size_t>(M * 6144));
  ThreadPool pool(2);
  double flops = 0;
  for (auto [k, n] : shapes) flops += 2.0 * static_cast<double>(M * k * n);
  flops *= 28;
  for (auto _ : state) {
    for (int64_t l = 0; l < 28; ++l) {
      for (size_t s = 0; s < shapes.size(); ++s) {
        const auto [k, n] = shapes[s];
        const auto& m = w[static_cast<size_t>(l % layers) * shapes.size() + s];
        MatMulNT(&pool, x.data(), M, k, WeightRef(m.data()), n, y.data());
      }
    }
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["GFLOPS"] = benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_LayerSweep)->ArgNames({"layers"})->Arg(1)->Arg(28)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace rc::engine

BENCHMARK_MAIN();
