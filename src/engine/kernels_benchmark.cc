// MatMulNT's kernels side by side (not run by ctest): the AVX2 kernel and the AVX-512 kernel
// (kernels_avx512.cc) over the same x and the same weights, as bf16 and as fp8 E4M3 (quantized from
// those bf16 weights by formats::QuantizeBf16ToFp8, per tensor or in 128 x 128 blocks, scales
// expanded into MatMulNT's per-row form), split over the same threads the way MatMulNT splits
// them, for the qwen3-0.6b-shaped projections at decode (M = 1), the pre-replay's M = 30 (two
// probes of 7 prompt + 8 forced tokens) and a 128-token prefill. Arguments: kernel, weights, M, K,
// N, threads. Prints GFLOPS per kernel and weight type; compare the rows of one shape, measured in
// the same run. weights 3 (fp8, every code equally often, so 5.5 % of the bytes are subnormal)
// shows what f32 denormal inputs to the widening multiply cost on this CPU against the realistic
// quantized rows. The AVX-512 rows skip on a CPU without AVX-512 (F, BW, DQ, VL). BM_LayerSweep:
// the same projections layer after layer, from the caches or streamed from memory.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/kernels.h"
#include "engine/thread_pool.h"
#include "rolloutcore/formats/fp8.h"

namespace rc::engine {
namespace {

// Weights of BM_MatMul (argument 1).
enum Weights : int64_t { kBf16 = 0, kFp8PerTensor = 1, kFp8Block = 2, kFp8EveryCode = 3 };

struct Operands {
  int64_t M, K, N;
  std::vector<float> x, xp, y;
  std::vector<uint16_t> w;
  // fp8: the bytes and per-row scales (WeightRef's form), scale_cols and scale_block_cols.
  std::vector<uint8_t> q;
  std::vector<float> scales;
  int64_t scale_cols = 1, scale_block_cols = 0;
  Operands(int64_t m, int64_t k, int64_t n, int64_t weights) : M(m), K(k), N(n), x(m * k), y(m * n), w(n * k) {
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
    if (weights == kBf16) return;
    q.resize(w.size());
    if (weights == kFp8EveryCode) {
      for (size_t i = 0; i < q.size(); ++i) {
        q[i] = static_cast<uint8_t>(rng() % 254);  // 0x00..0xFD: no NaN code
        if (q[i] >= 0x7F) ++q[i];
      }
      scales.assign(static_cast<size_t>(n), 1e-4f);
      scale_cols = 1;
      scale_block_cols = k;
      return;
    }
    formats::Fp8Layout layout;
    layout.scheme = weights == kFp8Block ? formats::Fp8Scheme::kBlock : formats::Fp8Scheme::kPerTensor;
    layout.rows = n;
    layout.cols = k;
    std::vector<float> grid(static_cast<size_t>(layout.NumScales()));
    const Status st = formats::QuantizeBf16ToFp8(w, layout, q, grid, "bench", 2);
    if (!st.ok()) std::abort();
    // MatMulNT's per-row form: row r's scale for columns [128 b, 128 b + 128) is the grid's.
    scale_cols = weights == kFp8Block ? (k + 127) / 128 : 1;
    scale_block_cols = weights == kFp8Block ? 128 : k;
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t b = 0; b < scale_cols; ++b) {
        scales.push_back(grid[static_cast<size_t>(layout.GroupOf(r, b * 128))]);
      }
    }
  }
};

// Column groups of 16 split over the pool, as MatMulNT does.
template <typename Fn>
void Split(ThreadPool& pool, int64_t N, Fn&& fn) {
  const int64_t groups = (N + 15) / 16;
  pool.ParallelForRange(groups, [&](int64_t gb, int64_t ge) { fn(gb * 16, ge * 16 < N ? ge * 16 : N); });
}

// Argument 0: the kernel (0: AVX2, 1: AVX-512); 1: the weights (Weights); then M, K, N, threads.
void BM_MatMul(benchmark::State& state) {
  const bool avx512 = state.range(0) == 1;
  if (avx512 ? !KernelsUseAvx512() : !KernelsUseAvx2()) {
    state.SkipWithError(avx512 ? "no AVX-512 (F, BW, DQ, VL) on this CPU" : "no AVX2 on this CPU");
    return;
  }
  const int64_t weights = state.range(1);
  Operands o(state.range(2), state.range(3), state.range(4), weights);
  ThreadPool pool(static_cast<int>(state.range(5)));
  for (auto _ : state) {
    internal::PackEvenOdd(o.x.data(), o.M, o.K, o.xp.data());  // MatMulNT packs once per call
    Split(pool, o.N, [&](int64_t n0, int64_t n1) {
      if (weights == kBf16) {
        if (avx512) {
          internal::MatMulColumnsAvx512(o.xp.data(), o.x.data(), o.M, o.K, o.w.data(), n0, n1, o.y.data(), o.N);
        } else {
          internal::MatMulColumnsAvx2(o.xp.data(), o.x.data(), o.M, o.K, o.w.data(), n0, n1, o.y.data(), o.N);
        }
      } else if (avx512) {
        internal::MatMulColumnsAvx512(o.xp.data(), o.x.data(), o.M, o.K, o.q.data(), o.scales.data(), o.scale_cols,
                                      o.scale_block_cols, n0, n1, o.y.data(), o.N);
      } else {
        internal::MatMulColumnsAvx2(o.xp.data(), o.x.data(), o.M, o.K, o.q.data(), o.scales.data(), o.scale_cols,
                                    o.scale_block_cols, n0, n1, o.y.data(), o.N);
      }
    });
    benchmark::DoNotOptimize(o.y.data());
  }
  static const char* const kWeightNames[] = {"bf16", "fp8 per-tensor", "fp8 block-128", "fp8 every code"};
  state.SetLabel(std::string(avx512 ? "avx512 " : "avx2 ") + kWeightNames[weights]);
  state.counters["GFLOPS"] =
      benchmark::Counter(2.0 * static_cast<double>(o.M * o.N * o.K) / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

// qwen3-0.6b: qkv [4096, 1024], o [1024, 2048], gate_up [6144, 1024], down [1024, 3072], and the
// lm_head [151936, 1024] at M = 1 (decode) and its 16 logits rows; M = 1 (decode), 30
// (pre-replay) and 128 (prefill); 2 threads. Each shape runs both kernels, each over bf16, fp8 per
// tensor and fp8 in blocks one after the other (fp8 every code: the gate_up shape only).
void Shapes(benchmark::internal::Benchmark* b) {
  std::vector<std::vector<int64_t>> shapes;
  for (int64_t m : {1, 30, 128}) {
    for (auto [k, n] : {std::pair<int64_t, int64_t>{1024, 4096}, {2048, 1024}, {1024, 6144}, {3072, 1024}}) {
      shapes.push_back({m, k, n});
    }
  }
  shapes.push_back({1, 1024, 151936});
  shapes.push_back({16, 1024, 151936});
  for (const auto& sh : shapes) {
    for (int64_t kernel : {0, 1}) {
      for (int64_t weights : {kBf16, kFp8PerTensor, kFp8Block}) b->Args({kernel, weights, sh[0], sh[1], sh[2], 2});
      if (sh[1] == 1024 && sh[2] == 6144) b->Args({kernel, kFp8EveryCode, sh[0], sh[1], sh[2], 2});
    }
  }
}
BENCHMARK(BM_MatMul)
    ->Apply(Shapes)
    ->ArgNames({"kernel", "weights", "M", "K", "N", "threads"})
    ->Unit(benchmark::kMillisecond);

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
