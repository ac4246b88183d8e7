// Delta refit compute speed without the wire (delta_apply.h): a qwen3-0.6b-sized embedding
// [151936, 1024] bf16 published as two fsdp shards, installed whole into one f32 parameter, with a
// change fraction of 1 % or 10 % (argument: per mille). Reports ns per changed element of the
// stage pass (decode + map + non-finite check + old/new digest terms), the install and the
// post-install digest. Argument 2: threads.
#include <benchmark/benchmark.h>

#include <cstring>
#include <random>

#include "receiver/delta_apply.h"
#include "receiver/device_delta.h"
#include "rolloutcore/refit/delta.h"
#include "rolloutcore/refit/digest.h"

namespace rc::receiver::internal {
namespace {

struct Setup {
  refit::Manifest manifest;
  std::vector<refit::Capture> caps{1};
  std::vector<std::vector<refit::DigestRegion>> regions;
  std::vector<ParameterStore> params{1};
  std::vector<refit::DestinationBuffers> live{1};
  DeltaStaged staged;
  int64_t changed = 0;

  explicit Setup(double fraction) {
    const refit::Shape shape{151936, 1024};
    const int64_t half = shape[0] / 2;
    refit::ShardTable t{"embed", refit::DType::kBF16, shape, {}};
    for (int r = 0; r < 2; ++r) {
      refit::ShardInfo s;
      s.rank = r;
      s.offset = {r * half, 0};
      s.shape = {r == 0 ? half : shape[0] - half, 1024};
      t.shards.push_back(s);
    }
    manifest.tables.push_back(t);
    caps[0].params = {{"embed", refit::DType::kF32, shape}};
    refit::CapturedCopy c;
    c.source = "embed";
    c.source_dtype = refit::DType::kBF16;
    c.source_shape = shape;
    c.box = refit::FullBox(shape);
    c.view_to_source = {0, 1};
    c.dest_shape = shape;
    c.dest_strides = {1024, 1};
    c.convert = true;
    caps[0].copies.push_back(c);
    std::vector<const refit::Capture*> ptrs{&caps[0]};
    regions = refit::AssignDigestOwnership(ptrs);
    (void)params[0].Add("embed", shape);
    const Parameter* param = params[0].Find("embed");
    const Parameter* p = param;
    live[0].emplace("embed", std::span<std::byte>(p->bytes(), p->nbytes()));
    std::mt19937_64 rng(1);
    std::vector<std::vector<uint64_t>> tile_at;
    for (int r = 0; r < 2; ++r) {
      const refit::Shape& local = t.shards[static_cast<size_t>(r)].shape;
      const int64_t n = refit::NumElements(local);
      std::vector<uint16_t> a(static_cast<size_t>(n)), b;
      for (auto& v : a) v = static_cast<uint16_t>(0x3c00 + rng() % 0x400);
      b = a;
      std::bernoulli_distribution pick(fraction);
      for (auto& v : b) {
        if (pick(rng)) v ^= 1;
      }
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t f = static_cast<uint32_t>(a[static_cast<size_t>(i)]) << 16;
        std::memcpy(p->f32() + r * half * 1024 + i, &f, 4);
      }
      refit::EncodedDelta enc = refit::EncodeShardDelta(refit::DType::kBF16, local, a.data(), b.data());
      changed += enc.changed;
      DeltaShard& sh = staged.shards.emplace_back();
      sh.table = 0;
      sh.shard = static_cast<uint32_t>(r);
      sh.tiling = refit::TilingFor(local);
      sh.entries = *refit::ParseDeltaTable(refit::DType::kBF16, local, enc.bytes, enc.bytes.size());
      sh.bodies = std::move(enc.bytes);
      std::vector<uint64_t> at;
      for (const refit::DeltaTile& e : sh.entries) at.push_back(e.offset);
      tile_at.push_back(std::move(at));
    }
    (void)PlanDeltaRank(manifest, 0, caps[0], regions[0], live, 0, tile_at, &staged);
    staged.base_digests["embed"] = 0;
  }
};

Setup& Get(int per_mille) {
  static std::map<int, std::unique_ptr<Setup>> setups;
  auto& s = setups[per_mille];
  if (!s) s = std::make_unique<Setup>(per_mille / 1000.0);
  return *s;
}

void BM_DeltaStagePass(benchmark::State& state) {
  Setup& s = Get(static_cast<int>(state.range(0)));
  for (auto _ : state) benchmark::DoNotOptimize(PredictDelta(s.manifest, s.caps, s.live, state.range(1), &s.staged));
  state.counters["ns_per_change"] =
      benchmark::Counter(static_cast<double>(s.changed) * 1e-9, benchmark::Counter::kIsIterationInvariantRate |
                                                                   benchmark::Counter::kInvert);
}

void BM_DeltaInstall(benchmark::State& state) {
  Setup& s = Get(static_cast<int>(state.range(0)));
  (void)PredictDelta(s.manifest, s.caps, s.live, 1, &s.staged);
  for (auto _ : state) benchmark::DoNotOptimize(ApplyDelta(s.staged, 0, s.caps[0], s.params[0], state.range(1)));
  state.counters["ns_per_change"] =
      benchmark::Counter(static_cast<double>(s.changed) * 1e-9, benchmark::Counter::kIsIterationInvariantRate |
                                                                   benchmark::Counter::kInvert);
}

void BM_DeltaVerify(benchmark::State& state) {
  Setup& s = Get(static_cast<int>(state.range(0)));
  (void)PredictDelta(s.manifest, s.caps, s.live, 1, &s.staged);
  for (auto _ : state) benchmark::DoNotOptimize(DigestAfterDelta(s.staged, s.caps, s.live, state.range(1)));
  state.counters["ns_per_change"] =
      benchmark::Counter(static_cast<double>(s.changed) * 1e-9, benchmark::Counter::kIsIterationInvariantRate |
                                                                   benchmark::Counter::kInvert);
}

// The stage pass that also applies the delta (the staging path): old value read, new stored and
// read back, both digest terms; here on the live buffer itself (the values it stores are the same
// every iteration, the work is not).
void BM_DeltaStagingApply(benchmark::State& state) {
  Setup& s = Get(static_cast<int>(state.range(0)));
  for (auto _ : state) {
    benchmark::DoNotOptimize(PredictDelta(s.manifest, s.caps, s.live, state.range(1), &s.staged, /*apply=*/true));
  }
  state.counters["ns_per_change"] =
      benchmark::Counter(static_cast<double>(s.changed) * 1e-9, benchmark::Counter::kIsIterationInvariantRate |
                                                                   benchmark::Counter::kInvert);
}

// Stage pass, install and post-install digest back to back, as a refit runs them.
void BM_DeltaSequence(benchmark::State& state) {
  Setup& s = Get(static_cast<int>(state.range(0)));
  const int threads = static_cast<int>(state.range(1));
  for (auto _ : state) {
    benchmark::DoNotOptimize(PredictDelta(s.manifest, s.caps, s.live, threads, &s.staged));
    benchmark::DoNotOptimize(ApplyDelta(s.staged, 0, s.caps[0], s.params[0], threads));
    benchmark::DoNotOptimize(DigestAfterDelta(s.staged, s.caps, s.live, threads));
  }
  state.counters["ns_per_change"] =
      benchmark::Counter(static_cast<double>(s.changed) * 1e-9, benchmark::Counter::kIsIterationInvariantRate |
                                                                   benchmark::Counter::kInvert);
}

// The host side of a GPU delta stage (device_delta.h): the task table and the one bodies buffer
// the kernel reads, built from the planned delta; ms per build (the table the receiver uploads).
void BM_BuildDeviceDeltaTable(benchmark::State& state) {
  Setup& s = Get(static_cast<int>(state.range(0)));
  for (auto _ : state) {
    auto t = BuildDeviceDeltaTable(s.staged, s.manifest, 0, s.caps[0], s.live[0]);
    if (!t.ok()) state.SkipWithError(t.status().ToString().c_str());
    benchmark::DoNotOptimize(t);
  }
}

BENCHMARK(BM_BuildDeviceDeltaTable)->Arg(10)->Arg(100)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_DeltaSequence)->Args({10, 1})->Args({100, 1})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_DeltaStagePass)->Args({10, 1})->Args({10, 2})->Args({100, 1})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_DeltaStagingApply)->Args({10, 1})->Args({10, 2})->Args({100, 1})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_DeltaInstall)->Args({10, 1})->Args({10, 2})->Args({100, 1})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_DeltaVerify)->Args({10, 1})->Args({10, 2})->Args({100, 1})->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace rc::receiver::internal

BENCHMARK_MAIN();
