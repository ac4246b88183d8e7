// Single-thread content digest speed (rc-digest-2, digest.h) over bf16 and f32 runs, per ISA, beside
// a single-thread memcpy of the same bytes: bytes_per_second of each is comparable directly. The
// buffer (1 GiB, a refit's order of size) is larger than the last-level cache (480 MB here); one
// run starts at global index 0 (whole 64-element blocks, as a full row does). Wall time (the
// shared machine steals CPU time).
//   build/release/src/refit/refit_benchmark --benchmark_filter=Digest
// BM_DigestInCache: the same loops on an L2-resident run (cycles per element, no memory).
// BM_LandingCopyAllThreads / BM_MemcpyAllThreads: the shm receiver's landing copy on every hardware
// thread against a plain memcpy of the same bytes split the same way.
#include <benchmark/benchmark.h>
#include <x86intrin.h>

#include <algorithm>
#include <cstring>
#include <new>
#include <thread>
#include <vector>

#include "refit/digest_simd.h"

namespace rc::refit::internal {
namespace {

constexpr size_t kBytes = size_t{1} << 30;

std::vector<unsigned char>& Source() {
  static std::vector<unsigned char> v = [] {
    std::vector<unsigned char> b(kBytes);
    uint32_t x = 12345;
    for (auto& c : b) {
      x = x * 1664525u + 1013904223u;
      c = static_cast<unsigned char>(x >> 24);
    }
    return b;
  }();
  return v;
}

void BM_MemcpySameBytes(benchmark::State& state) {
  const auto& src = Source();
  std::vector<unsigned char> dst(kBytes, 1);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), kBytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(kBytes));
}
BENCHMARK(BM_MemcpySameBytes)->Unit(benchmark::kMillisecond)->UseRealTime();

// range(0): DigestIsa; range(1): element size (2 = bf16, 4 = f32); range(2): 1 = copy and digest.
void BM_Digest(benchmark::State& state) {
  const auto isa = static_cast<DigestIsa>(state.range(0));
  const int es = static_cast<int>(state.range(1));
  const bool copy = state.range(2) != 0;
  if (!DigestIsaSupported(isa)) {
    state.SkipWithError("ISA not supported on this CPU");
    return;
  }
  const auto& src = Source();
  std::vector<unsigned char> dst(copy ? kBytes : 0, 1);
  const int64_t n = static_cast<int64_t>(kBytes) / es;
  for (auto _ : state) {
    benchmark::DoNotOptimize(copy ? CopyAndDigestContiguous(isa, es, dst.data(), src.data(), 0, n)
                                  : DigestContiguous(isa, es, src.data(), 0, n));
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(kBytes));
  state.SetLabel(std::string(DigestIsaName(isa)) + (es == 2 ? " bf16" : " f32") + (copy ? " copy+digest" : ""));
}
BENCHMARK(BM_Digest)
    ->ArgsProduct({{static_cast<int>(DigestIsa::kScalar), static_cast<int>(DigestIsa::kAvx2),
                    static_cast<int>(DigestIsa::kAvx512)},
                   {2, 4},
                   {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// The loop's own cost, without memory: a 128 KiB run that stays in L2, digested over and over.
// tsc_cycles_per_element counts time-stamp-counter cycles (the nominal clock) per element.
// range(0): DigestIsa; range(1): element size; range(2): 1 = the bf16 finite check instead.
void BM_DigestInCache(benchmark::State& state) {
  const auto isa = static_cast<DigestIsa>(state.range(0));
  const int es = static_cast<int>(state.range(1));
  const bool finite = state.range(2) != 0;
  if (!DigestIsaSupported(isa)) {
    state.SkipWithError("ISA not supported on this CPU");
    return;
  }
  constexpr size_t kRun = 128 << 10;
  std::vector<unsigned char> src(Source().begin(), Source().begin() + kRun);
  for (size_t i = 1; i < kRun; i += 2) src[i] &= 0x3f;  // finite bf16: the scan reads everything
  const int64_t n = static_cast<int64_t>(kRun) / es;
  uint64_t cycles = 0;
  for (auto _ : state) {
    const uint64_t t0 = __rdtsc();
    if (finite) {
      benchmark::DoNotOptimize(AnyNonFiniteBf16(isa, src.data(), n));
    } else {
      benchmark::DoNotOptimize(DigestContiguous(isa, es, src.data(), 0, n));
    }
    cycles += __rdtsc() - t0;
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(kRun));
  state.counters["tsc_cycles_per_element"] =
      static_cast<double>(cycles) / (static_cast<double>(state.iterations()) * static_cast<double>(n));
  state.SetLabel(std::string(DigestIsaName(isa)) + (es == 2 ? " bf16" : " f32") + (finite ? " finite check" : ""));
}
BENCHMARK(BM_DigestInCache)
    ->ArgsProduct({{static_cast<int>(DigestIsa::kScalar), static_cast<int>(DigestIsa::kAvx2),
                    static_cast<int>(DigestIsa::kAvx512)},
                   {2, 4},
                   {0}})
    ->Args({static_cast<int>(DigestIsa::kAvx2), 2, 1})
    ->Args({static_cast<int>(DigestIsa::kAvx512), 2, 1});

// A 64-byte-aligned destination of kBytes, touched once (the landing copy's streaming stores need
// the alignment; the staged image is page-aligned).
unsigned char* AlignedDestination() {
  static unsigned char* d = [] {
    auto* p = static_cast<unsigned char*>(::operator new(kBytes, std::align_val_t{64}));
    std::memset(p, 1, kBytes);
    return p;
  }();
  return d;
}

int AllThreads() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

// Runs f(begin, end) for every thread's even share of [0, kBytes) on its own thread.
template <typename F>
void OnAllThreads(const F& f) {
  const int threads = AllThreads();
  const size_t share = (kBytes + static_cast<size_t>(threads) - 1) / static_cast<size_t>(threads);
  std::vector<std::thread> ts;
  ts.reserve(static_cast<size_t>(threads));
  for (int t = 0; t < threads; ++t) {
    const size_t begin = std::min(kBytes, share * static_cast<size_t>(t));
    const size_t end = std::min(kBytes, begin + share);
    ts.emplace_back([&f, begin, end] { f(begin, end); });
  }
  for (auto& t : ts) t.join();
}

// The reference of bench refit's ratios (apps/bench_util.h MemcpyPairing): one memcpy per thread.
void BM_MemcpyAllThreads(benchmark::State& state) {
  const unsigned char* src = Source().data();
  unsigned char* dst = AlignedDestination();
  for (auto _ : state) {
    OnAllThreads([&](size_t begin, size_t end) { std::memcpy(dst + begin, src + begin, end - begin); });
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(kBytes));
  state.SetLabel(std::to_string(AllThreads()) + " threads");
}
BENCHMARK(BM_MemcpyAllThreads)->Unit(benchmark::kMillisecond)->UseRealTime();

// The landing copy (CopyDigestAndScan: copy, digest and NaN/Inf check in one pass) as the shm
// copy threads run it: each thread's share in 256 KiB chunks, one global index running through
// the buffer. range(0): DigestIsa; range(1): element size (2 = bf16, 4 = f32).
void BM_LandingCopyAllThreads(benchmark::State& state) {
  const auto isa = static_cast<DigestIsa>(state.range(0));
  const int es = static_cast<int>(state.range(1));
  if (!DigestIsaSupported(isa)) {
    state.SkipWithError("ISA not supported on this CPU");
    return;
  }
  constexpr size_t kChunk = 256 << 10;
  const unsigned char* src = Source().data();
  unsigned char* dst = AlignedDestination();
  for (auto _ : state) {
    OnAllThreads([&](size_t begin, size_t end) {
      uint64_t sum = 0;
      bool nonfinite = false;
      for (size_t at = begin; at < end; at += kChunk) {
        const size_t bytes = std::min(kChunk, end - at);
        sum += CopyDigestAndScan(isa, es, dst + at, src + at, at / static_cast<size_t>(es),
                                 static_cast<int64_t>(bytes) / es, &nonfinite);
      }
      benchmark::DoNotOptimize(sum);
      benchmark::DoNotOptimize(nonfinite);
    });
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(kBytes));
  state.SetLabel(std::string(DigestIsaName(isa)) + (es == 2 ? " bf16 " : " f32 ") + std::to_string(AllThreads()) +
                 " threads");
}
BENCHMARK(BM_LandingCopyAllThreads)
    ->ArgsProduct({{static_cast<int>(DigestIsa::kAvx2), static_cast<int>(DigestIsa::kAvx512)}, {2, 4}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace rc::refit::internal
