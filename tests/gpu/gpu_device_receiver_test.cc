// receiver::DeviceReceiver driving a receiver::DeviceLiveWeights that is not vLLM (label gpu;
// skipped without a CUDA device): device buffers this test allocates, answered by the live-weights
// interface the vLLM extension's binding also implements. What it pins down: the live digest and
// the fused install go through the buffers the live weights answer at that moment (an install
// refuses, writing nothing, when they moved since it was prepared), the install writes exactly the
// staged values and digests them as the CPU does, and a live weights that cannot answer is named.
// The full stage (directory, pull) runs in the vLLM suite (tests/vllm), against a real trainer; the
// delta stage (issue 39, "Delta on the GPU") runs here against a real directory and a trainer
// Publisher over shm (a cross-process copy): only the changed elements' tiles cross, the kernel
// applies them to the GPU staging image, and the prediction, the staged bytes and the installed
// live digest all equal a full stage's. The install by exchange runs here too, on slabs this test
// allocates, with versions staged from the directory.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "rolloutcore/base/clock.h"
#include "rolloutcore/directory/memory_store.h"
#include "rolloutcore/directory/server.h"
#include "rolloutcore/trainer/publisher.h"
#include "rolloutcore/trainer/synthetic_trainer.h"
#include "rolloutcore/cuda/gpu_refit.h"
#include "rolloutcore/receiver/device_receiver.h"
#include "rolloutcore/receiver/live_weights.h"
#include "rolloutcore/refit/capture.h"
#include "rolloutcore/refit/digest.h"
#include "rolloutcore/refit/layouts.h"
#include "rolloutcore/refit/model_config.h"
#include "rolloutcore/transport/shm.h"

namespace rc::receiver {
namespace {

using cuda::DeviceBuffer;

// Device memory for every parameter of both captures, with host mirrors; the live weights answer
// with whatever `live` and `staging` hold now, or fail when told to.
class BufferWeights final : public DeviceLiveWeights {
 public:
  Result<refit::DestinationBuffers> StagingBuffers() override {
    ++staging_calls;
    if (!staging_error.empty()) return Unavailable(staging_error);
    return Views(staging);
  }
  Result<refit::DestinationBuffers> LiveBuffers() override {
    ++live_calls;
    if (!live_error.empty()) return Unavailable(live_error);
    return Views(live);
  }

  // Allocates `p` in `into` and fills it (device and host mirror) with random bytes.
  void Fill(const refit::TensorSpec& p, std::map<std::string, DeviceBuffer>* into, std::mt19937_64* rng) {
    auto& h = host[p.name];
    h.resize(p.bytes());
    for (auto& b : h) b = static_cast<std::byte>((*rng)());
    (*into)[p.name] = DeviceBuffer::Allocate(0, p.bytes()).value();
    ASSERT_TRUE(cuda::CopyToDevice((*into)[p.name].data(), h.data(), h.size(), 0).ok());
  }
  std::vector<std::byte> Read(const std::string& name, const std::map<std::string, DeviceBuffer>& from) const {
    const DeviceBuffer& b = from.at(name);
    std::vector<std::byte> out(b.size());
    EXPECT_TRUE(cuda::CopyToHost(out.data(), b.data(), out.size(), 0).ok());
    return out;
  }

  std::map<std::string, DeviceBuffer> staging, live;
  std::map<std::string, std::vector<std::byte>> host;
  std::string staging_error, live_error;
  int staging_calls = 0, live_calls = 0;

 private:
  static refit::DestinationBuffers Views(const std::map<std::string, DeviceBuffer>& m) {
    refit::DestinationBuffers out;
    for (const auto& [name, b] : m) out.emplace(name, std::span<std::byte>(b.data(), b.size()));
    return out;
  }
};

// The CPU digest of the live parameters' host images (refit::DigestInstalled, the rule the GPU
// kernels are held to).
refit::TensorDigests CpuLiveDigest(const refit::Capture& live, const std::map<std::string, std::vector<std::byte>>& host) {
  refit::DestinationBuffers views;
  for (const refit::TensorSpec& p : live.params) {
    auto& h = const_cast<std::vector<std::byte>&>(host.at(p.name));
    views.emplace(p.name, std::span<std::byte>(h));
  }
  const refit::Capture* ranks[] = {&live};
  auto d = refit::DigestInstalled(live, views, refit::AssignDigestOwnership(ranks)[0]);
  EXPECT_TRUE(d.ok()) << d.status().ToString();
  return d.ok() ? *d : refit::TensorDigests{};
}

TEST(DeviceReceiverTest, NeedsLiveWeights) {
  auto r = DeviceReceiver::Create(0, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().ToString().find("no live weights"), std::string::npos) << r.status().ToString();
}

TEST(DeviceReceiverTest, DigestsAndInstallsThroughTheBuffersTheLiveWeightsAnswer) {
  RC_SKIP_WITHOUT_GPUS(1);
  auto live_cap = refit::CaptureEngineRank(refit::ModelPreset("tiny").value(),
                                           refit::ParseEngineLayout("tp:1@bf16").value(), 0);
  ASSERT_TRUE(live_cap.ok()) << live_cap.status().ToString();
  const refit::Capture staging_cap = cuda::testing::StagingFor(*live_cap);

  BufferWeights w;
  std::mt19937_64 rng(11);
  for (const refit::TensorSpec& p : live_cap->params) w.Fill(p, &w.live, &rng);
  for (const refit::TensorSpec& p : staging_cap.params) w.Fill(p, &w.staging, &rng);

  auto created = DeviceReceiver::Create(0, &w);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  DeviceReceiver& r = **created;

  // Before the captures nothing is asked of the live weights.
  EXPECT_EQ(r.LiveDigest().status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.Stage(DeviceStageRequest{"http://127.0.0.1:1", "m", "v1"}).status().code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(w.live_calls + w.staging_calls, 0);
  ASSERT_TRUE(r.SetCaptures(staging_cap, *live_cap).ok());

  // The live digest reads the buffers the live weights answer, and equals the CPU's; the device
  // table is kept while they are unchanged.
  auto d1 = r.LiveDigest();
  ASSERT_TRUE(d1.ok()) << d1.status().ToString();
  EXPECT_EQ(d1->tensors, CpuLiveDigest(*live_cap, w.host));
  EXPECT_FALSE(d1->table_cached);
  auto d2 = r.LiveDigest();
  ASSERT_TRUE(d2.ok());
  EXPECT_TRUE(d2->table_cached);
  EXPECT_EQ(d2->content_digest, d1->content_digest);
  EXPECT_EQ(w.live_calls, 2);

  // Prepared while serving, installed while paused: the live bytes become the staged values and
  // the install's digest is the CPU's digest of them.
  auto prepared = r.PrepareInstall();
  ASSERT_TRUE(prepared.ok()) << prepared.status().ToString();
  ASSERT_TRUE(prepared->ok) << prepared->reason;
  auto installed = r.Install();
  ASSERT_TRUE(installed.ok()) << installed.status().ToString();
  ASSERT_TRUE(installed->ok) << installed->reason;
  std::map<std::string, std::vector<std::byte>> now;
  for (const refit::TensorSpec& p : live_cap->params) now[p.name] = w.Read(p.name, w.live);
  // Every staged copy went to its live destination, and nothing else of the live bytes changed.
  std::map<std::string, std::vector<std::byte>> want = w.host;
  cuda::testing::InstallStagedOnHost(*live_cap, staging_cap, &want);
  for (const refit::TensorSpec& p : live_cap->params) EXPECT_EQ(now[p.name], want[p.name]) << p.name;
  EXPECT_EQ(installed->digest.tensors, CpuLiveDigest(*live_cap, now));
  auto reread = r.LiveDigest();
  ASSERT_TRUE(reread.ok());
  EXPECT_EQ(reread->content_digest, installed->digest.content_digest);

  // The engine moved a live parameter (same bytes, new address) after the install was prepared:
  // the install is refused and writes nothing, new staged values included.
  ASSERT_TRUE(r.PrepareInstall().ok());
  for (auto& [name, b] : w.staging) {
    std::vector<std::byte> fresh(b.size());
    for (auto& x : fresh) x = static_cast<std::byte>(rng());
    ASSERT_TRUE(cuda::CopyToDevice(b.data(), fresh.data(), fresh.size(), 0).ok());
  }
  const std::string moved = live_cap->params[0].name;
  DeviceBuffer replacement = DeviceBuffer::Allocate(0, w.live[moved].size()).value();
  ASSERT_TRUE(cuda::CopyToDevice(replacement.data(), now[moved].data(), now[moved].size(), 0).ok());
  w.live[moved] = std::move(replacement);
  auto refused = r.Install();
  ASSERT_TRUE(refused.ok()) << refused.status().ToString();
  EXPECT_FALSE(refused->ok);
  EXPECT_NE(refused->reason.find("changed"), std::string::npos) << refused->reason;
  for (const refit::TensorSpec& p : live_cap->params) EXPECT_EQ(w.Read(p.name, w.live), now[p.name]) << p.name;
  // The live digest follows the move (a new table), and the bytes are the same.
  auto after_move = r.LiveDigest();
  ASSERT_TRUE(after_move.ok());
  EXPECT_FALSE(after_move->table_cached);
  EXPECT_EQ(after_move->content_digest, installed->digest.content_digest);

  // Live weights that cannot answer are named, and nothing runs.
  w.live_error = "parameters are on the meta device";
  auto no_live = r.LiveDigest();
  ASSERT_FALSE(no_live.ok());
  EXPECT_NE(no_live.status().ToString().find("live buffers"), std::string::npos) << no_live.status().ToString();
  EXPECT_NE(no_live.status().ToString().find("meta device"), std::string::npos) << no_live.status().ToString();
  w.live_error.clear();
  w.staging_error = "staging was freed";
  auto no_staging = r.PrepareInstall();
  ASSERT_FALSE(no_staging.ok());
  EXPECT_NE(no_staging.status().ToString().find("staging buffers"), std::string::npos)
      << no_staging.status().ToString();
  auto no_stage = r.Stage(DeviceStageRequest{"http://127.0.0.1:1", "m", "v1"});
  ASSERT_FALSE(no_stage.ok());
  EXPECT_NE(no_stage.status().ToString().find("staging was freed"), std::string::npos) << no_stage.status().ToString();
}

// A real directory (memory store, loopback) and a trainer Publisher over shm (a cross-process copy).
struct ShmPublishing {
  explicit ShmPublishing(bool delta)
      : store(directory::NewMemoryStore(SystemClock::Default())), server(store.get(), directory::ServerOptions{}) {
    EXPECT_TRUE(server.Start().ok());
    auto t = trainer::CreateTrainerTransport("shm");
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    transport = std::move(*t);
    trainer::PublisherOptions po;
    po.delta = delta;
    pub = std::make_unique<trainer::Publisher>(transport.get(), store.get(), "m", 0, 1, po);
  }
  ~ShmPublishing() { server.Stop(); }
  // A whole bf16 tensor `name` of `shape` holding `bits`, in shm memory (the shm transport shares
  // memfd memory: a shard's bytes must live in a ShmBuffer, which the source keeps alive).
  static trainer::ShardSource Source(const std::string& name, const refit::Shape& shape,
                                     const std::vector<uint16_t>& bits) {
    trainer::ShardSource src;
    auto created = transport::ShmBuffer::Create(bits.size() * 2);
    EXPECT_TRUE(created.ok()) << created.status().ToString();
    if (!created.ok()) return src;
    auto buf = std::make_shared<transport::ShmBuffer>(std::move(created).value());
    std::memcpy(buf->data(), bits.data(), bits.size() * 2);
    src.name = name;
    src.dtype = refit::DType::kBF16;
    src.global_shape = shape;
    src.offset = refit::Shape(shape.size(), 0);
    src.local_shape = shape;
    src.data = buf->data();
    src.keep_alive = buf;
    return src;
  }
  // A stage request of "v<k>" of model "m" from this directory.
  DeviceStageRequest Request(int k, DeltaPolicy policy) const {
    DeviceStageRequest q{server.url(), std::string("m"), fmt::format("v{}", k)};
    q.timeout_ms = 30'000;
    q.delta_policy = policy;
    return q;
  }

  std::unique_ptr<directory::DirectoryStore> store;
  directory::DirectoryServer server;
  std::unique_ptr<transport::Transport> transport;
  std::unique_ptr<trainer::Publisher> pub;
};

// A delta stage onto the GPU staging image. Two bf16 tensors published whole over shm by a
// Publisher(delta) into a real directory; the engine's capture stages "a" [300, 200] into a bf16
// parameter transposed and "b" [3000] into an f32 parameter (the kernel's bf16 -> f32 widening).
TEST(DeviceReceiverTest, StagesADeltaOnTheGpuStagingImage) {
  RC_SKIP_WITHOUT_GPUS(1);
  ShmPublishing shm(/*delta=*/true);
  trainer::Publisher& pub = *shm.pub;

  const refit::Shape sa{300, 200}, sb{3000};
  std::mt19937_64 rng(5);
  std::map<std::string, std::vector<std::vector<uint16_t>>> versions;  // tensor -> per version
  auto next = [&](const std::vector<uint16_t>& prev, double fraction) {
    std::vector<uint16_t> v = prev;
    std::bernoulli_distribution pick(fraction);
    for (auto& x : v) {
      if (prev.empty() || pick(rng)) x = static_cast<uint16_t>(0x3c00 + rng() % 0x0400);  // finite bf16
    }
    return v;
  };
  versions["a"].push_back(next(std::vector<uint16_t>(size_t{300} * 200), 1.0));
  versions["b"].push_back(next(std::vector<uint16_t>(3000), 1.0));
  auto publish = [&](int k) {
    for (const auto& [name, shape] : {std::pair{std::string("a"), sa}, std::pair{std::string("b"), sb}}) {
      const std::vector<uint16_t>& bits = versions[name][static_cast<size_t>(k)];
      ASSERT_TRUE(pub.AddShard(fmt::format("v{}", k), ShmPublishing::Source(name, shape, bits)).ok());
    }
    auto r = pub.Publish(fmt::format("v{}", k));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
  };
  for (int k = 1; k <= 4; ++k) {
    versions["a"].push_back(next(versions["a"].back(), 0.02));
    versions["b"].push_back(next(versions["b"].back(), 0.02));
  }

  // The captures: a transposed into "pa" [200, 300] bf16, b into "pb" [3000] f32.
  auto copy = [](const std::string& src, const refit::Shape& shape, uint32_t param, std::vector<int32_t> v2s,
                 refit::Shape dest_shape, refit::Shape dest_strides, refit::DType dest) {
    refit::CapturedCopy c;
    c.source = src;
    c.source_dtype = refit::DType::kBF16;
    c.source_shape = shape;
    c.box = refit::FullBox(shape);
    c.view_to_source = std::move(v2s);
    c.param = param;
    c.dest_shape = std::move(dest_shape);
    c.dest_strides = std::move(dest_strides);
    c.convert = dest != refit::DType::kBF16;
    return c;
  };
  refit::Capture live_cap;
  live_cap.params = {{"pa", refit::DType::kBF16, {200, 300}}, {"pb", refit::DType::kF32, {3000}}};
  live_cap.copies = {copy("a", sa, 0, {1, 0}, {200, 300}, {300, 1}, refit::DType::kBF16),
                     copy("b", sb, 1, {0}, {3000}, {1}, refit::DType::kF32)};
  refit::Capture staging_cap = live_cap;
  staging_cap.params = {{"sa", refit::DType::kBF16, {200, 300}}, {"sb", refit::DType::kF32, {3000}}};

  BufferWeights w;
  for (const refit::TensorSpec& p : live_cap.params) w.Fill(p, &w.live, &rng);
  for (const refit::TensorSpec& p : staging_cap.params) w.Fill(p, &w.staging, &rng);
  auto created = DeviceReceiver::Create(0, &w);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  DeviceReceiver& r = **created;
  ASSERT_TRUE(r.SetCaptures(staging_cap, live_cap).ok());
  auto request = [&](int k, DeltaPolicy policy) { return shm.Request(k, policy); };
  // The staging image version k must hold: a transposed (bf16 bits), b widened to f32.
  auto expect_staging = [&](int k) {
    const auto& a = versions["a"][static_cast<size_t>(k)];
    const auto& b = versions["b"][static_cast<size_t>(k)];
    const std::vector<std::byte> ga = w.Read("sa", w.staging), gb = w.Read("sb", w.staging);
    int bad = 0;
    for (int64_t i = 0; i < 300; ++i) {
      for (int64_t j = 0; j < 200; ++j) {
        uint16_t h;
        std::memcpy(&h, ga.data() + (j * 300 + i) * 2, 2);
        bad += h != a[static_cast<size_t>(i * 200 + j)];
      }
    }
    for (size_t i = 0; i < b.size(); ++i) {
      uint32_t u;
      std::memcpy(&u, gb.data() + i * 4, 4);
      bad += u != (static_cast<uint32_t>(b[i]) << 16);
    }
    EXPECT_EQ(bad, 0) << "v" << k;
  };

  // v0 full (it carries no delta); v1 as a delta.
  publish(0);
  auto s0 = r.Stage(request(0, DeltaPolicy::kAlways));
  ASSERT_TRUE(s0.ok()) << s0.status().ToString();
  EXPECT_EQ(s0->mode, "full");
  EXPECT_FALSE(s0->digest_table_cached) << "the first stage builds the staging digest's table";
  expect_staging(0);
  publish(1);
  auto s1 = r.Stage(request(1, DeltaPolicy::kAlways));
  ASSERT_TRUE(s1.ok()) << s1.status().ToString();
  EXPECT_EQ(s1->mode, "delta") << s1->delta_ineligible;
  EXPECT_EQ(s1->staged_digest, s1->manifest_digest);
  expect_staging(1);
  EXPECT_GT(s1->changed, 0);
  EXPECT_EQ(s1->delta_writes, static_cast<uint64_t>(s1->changed)) << "every changed element lands once";
  EXPECT_LT(s1->bytes_pulled, s0->bytes_pulled / 5) << "2 % changed: the tiles, not the tensors";
  for (const char* k : {"wire", "table", "upload", "kernel"}) EXPECT_EQ(s1->stage_ms.count(k), 1u) << k;

  // Installed like a full refit: the live digest is the manifest's.
  auto prepared = r.PrepareInstall();
  ASSERT_TRUE(prepared.ok() && prepared->ok);
  auto installed = r.Install();
  ASSERT_TRUE(installed.ok() && installed->ok);
  EXPECT_EQ(installed->digest.content_digest, s1->manifest_digest);

  // never: v2 staged full although it carries a delta; then v3 as a delta on it.
  publish(2);
  auto s2 = r.Stage(request(2, DeltaPolicy::kNever));
  ASSERT_TRUE(s2.ok()) << s2.status().ToString();
  EXPECT_EQ(s2->mode, "full");
  ASSERT_TRUE(s2->delta_choice.has_value());
  EXPECT_FALSE(s2->delta_choice->delta);
  EXPECT_TRUE(s2->digest_table_cached) << "the same staging buffers: the table is kept";
  expect_staging(2);

  // A wrong delta value: the prediction refuses it (DataLoss), the staging image is unproven, and
  // the next stage of the same version is full and succeeds (the full shards are right).
  publish(3);
  auto corrupted = pub.CorruptDeltaForTesting("v3", "value");
  ASSERT_TRUE(corrupted.ok()) << corrupted.status().ToString();
  auto bad = r.Stage(request(3, DeltaPolicy::kAlways));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kDataLoss) << bad.status().ToString();
  EXPECT_NE(bad.status().ToString().find("no longer proven"), std::string::npos) << bad.status().ToString();
  auto again = r.Stage(request(3, DeltaPolicy::kAlways));
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->mode, "full");
  EXPECT_NE(again->delta_ineligible.find("no proven version"), std::string::npos) << again->delta_ineligible;
  expect_staging(3);

  // auto: both modes have been measured on shm (v1 delta; v2 and v3 full — v0 allocated the host
  // mirrors, a one-time cost not learned from): the cheaper estimate wins (ties: delta), and either
  // way the staged image is v4.
  publish(4);
  auto s4 = r.Stage(request(4, DeltaPolicy::kAuto));
  ASSERT_TRUE(s4.ok()) << s4.status().ToString();
  ASSERT_TRUE(s4->delta_choice.has_value());
  const DeltaChoice& c = *s4->delta_choice;
  EXPECT_EQ(c.delta_samples, 1);
  EXPECT_EQ(c.full_samples, 2);
  ASSERT_GE(c.full_ms, 0);
  ASSERT_GE(c.delta_ms, 0);
  EXPECT_EQ(s4->mode, c.delta_ms <= c.full_ms ? "delta" : "full") << c.ToJson().dump();
  EXPECT_EQ(s4->staged_digest, s4->manifest_digest);
  expect_staging(4);
}


// Install by exchange (receiver/exchange.h): the staging buffers are views inside slabs shaped like
// the live parameters; PrepareExchange checks from the addresses that pointing the live parameters
// at the slabs makes them the staged bytes, CompleteExchange proves them (re-read, or the stage's
// own digests), and refuses when the live parameters are not the prepared slabs.
class SlabWeights final : public DeviceLiveWeights {
 public:
  Result<refit::DestinationBuffers> StagingBuffers() override {
    refit::DestinationBuffers out;
    std::byte* ab = slab["ab"].data();
    constexpr size_t kA = size_t{40} * 64 * 2, kB = size_t{24} * 64 * 2;  // bytes of a and of b
    out.emplace("rc.staging.0", std::span<std::byte>(ab, kA));
    out.emplace("rc.staging.1", std::span<std::byte>(ab + kA, kB));
    out.emplace("rc.staging.2", std::span<std::byte>(slab["n"].data(), slab["n"].size()));
    return out;
  }
  Result<refit::DestinationBuffers> LiveBuffers() override { return Spans(live); }
  refit::DestinationBuffers SlabSpans() { return Spans(slab); }
  void Exchange() { std::swap(live, slab); }

  std::map<std::string, DeviceBuffer> live, slab;

 private:
  static refit::DestinationBuffers Spans(std::map<std::string, DeviceBuffer>& m) {
    refit::DestinationBuffers out;
    for (auto& [name, b] : m) out.emplace(name, std::span<std::byte>(b.data(), b.size()));
    return out;
  }
};

TEST(DeviceReceiverTest, ExchangesTheStagedSlabsForTheLiveParameters) {
  RC_SKIP_WITHOUT_GPUS(1);
  ShmPublishing shm(/*delta=*/false);
  trainer::Publisher& pub = *shm.pub;
  std::mt19937_64 rng(9);
  // a [40, 64] and b [24, 64] fused into "ab" [64, 64] (as q/k/v into qkv_proj), n [64] into "n".
  const std::map<std::string, refit::Shape> shapes{{"a", {40, 64}}, {"b", {24, 64}}, {"n", {64}}};
  std::map<int, std::map<std::string, std::vector<uint16_t>>> versions;
  auto publish = [&](int k) {
    for (const auto& [name, shape] : shapes) {
      auto& v = versions[k][name];
      size_t numel = 1;
      for (int64_t x : shape) numel *= static_cast<size_t>(x);
      v.resize(numel);
      for (auto& x : v) x = static_cast<uint16_t>(0x3c00 + rng() % 0x0400);
      ASSERT_TRUE(pub.AddShard(fmt::format("v{}", k), ShmPublishing::Source(name, shape, v)).ok());
    }
    auto r = pub.Publish(fmt::format("v{}", k));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
  };
  auto copy = [](const std::string& src, const refit::Shape& shape, uint32_t param, int64_t offset) {
    refit::CapturedCopy c;
    c.source = src;
    c.source_dtype = refit::DType::kBF16;
    c.source_shape = shape;
    c.box = refit::FullBox(shape);
    for (size_t k = 0; k < shape.size(); ++k) c.view_to_source.push_back(static_cast<int32_t>(k));
    c.param = param;
    c.dest_offset = offset;
    c.dest_shape = shape;
    c.dest_strides = refit::RowMajorStrides(shape);
    return c;
  };
  refit::Capture live_cap;
  live_cap.params = {{"ab", refit::DType::kBF16, {64, 64}}, {"n", refit::DType::kBF16, {64}}};
  live_cap.copies = {copy("a", {40, 64}, 0, 0), copy("b", {24, 64}, 0, int64_t{40} * 64), copy("n", {64}, 1, 0)};
  const refit::Capture staging_cap = refit::DenseStagingCapture(live_cap);

  SlabWeights w;
  for (const refit::TensorSpec& p : live_cap.params) {
    w.live[p.name] = DeviceBuffer::Allocate(0, p.bytes()).value();
    w.slab[p.name] = DeviceBuffer::Allocate(0, p.bytes()).value();
  }
  auto created = DeviceReceiver::Create(0, &w);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  DeviceReceiver& r = **created;
  ASSERT_TRUE(r.SetCaptures(staging_cap, live_cap).ok());
  auto stage = [&](int k) { return r.Stage(shm.Request(k, DeltaPolicy::kNever)); };
  // The live parameters must hold version k: "ab" = a then b, "n" = n.
  auto expect_live = [&](int k) {
    std::vector<uint16_t> ab(size_t{64} * 64), n(64);
    ASSERT_TRUE(cuda::CopyToHost(ab.data(), w.live["ab"].data(), ab.size() * 2, 0).ok());
    ASSERT_TRUE(cuda::CopyToHost(n.data(), w.live["n"].data(), n.size() * 2, 0).ok());
    std::vector<uint16_t> want = versions[k]["a"];
    want.insert(want.end(), versions[k]["b"].begin(), versions[k]["b"].end());
    EXPECT_EQ(ab, want) << "v" << k;
    EXPECT_EQ(n, versions[k]["n"]) << "v" << k;
  };

  // Nothing staged: nothing to exchange.
  auto early = r.PrepareExchange(w.SlabSpans());
  ASSERT_TRUE(early.ok()) << early.status().ToString();
  EXPECT_FALSE(early->ok);
  EXPECT_NE(early->reason.find("no version proven"), std::string::npos) << early->reason;

  publish(1);
  auto s1 = stage(1);
  ASSERT_TRUE(s1.ok()) << s1.status().ToString();
  // Slabs that are not where the staging buffers lie are refused, named.
  refit::DestinationBuffers off = w.SlabSpans();
  off["ab"] = std::span<std::byte>(w.live["ab"].data(), w.live["ab"].size());
  auto wrong = r.PrepareExchange(off);
  ASSERT_TRUE(wrong.ok());
  EXPECT_FALSE(wrong->ok);
  EXPECT_NE(wrong->reason.find("rc.staging.0"), std::string::npos) << wrong->reason;
  // Prepared, but the engine did not exchange: refused.
  auto prepared = r.PrepareExchange(w.SlabSpans());
  ASSERT_TRUE(prepared.ok() && prepared->ok) << (prepared.ok() ? prepared->reason : prepared.status().ToString());
  EXPECT_EQ(prepared->bytes, uint64_t{64 * 64 * 2 + 64 * 2});
  auto not_swapped = r.CompleteExchange(true);
  ASSERT_FALSE(not_swapped.ok());
  EXPECT_NE(not_swapped.status().ToString().find("not the prepared slabs"), std::string::npos);
  // Exchanged: the live parameters are v1, proven by a re-read.
  w.Exchange();
  auto done = r.CompleteExchange(true);
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  EXPECT_FALSE(done->staged);
  EXPECT_TRUE(done->table_cached) << "the table was built by PrepareExchange, while serving";
  EXPECT_EQ(done->content_digest, s1->manifest_digest);
  expect_live(1);
  EXPECT_EQ(r.CompleteExchange(true).status().code(), StatusCode::kFailedPrecondition) << "one exchange per prepare";

  // v2 stages into the storages v0 lived in (v1 keeps serving), exchanges back, proven by the
  // stage's own digests; a re-read agrees.
  publish(2);
  auto s2 = stage(2);
  ASSERT_TRUE(s2.ok()) << s2.status().ToString();
  EXPECT_FALSE(s2->digest_table_cached) << "other storages than v1's stage: another table";
  expect_live(1);
  ASSERT_TRUE(r.PrepareExchange(w.SlabSpans()).value().ok);
  w.Exchange();
  auto done2 = r.CompleteExchange(false);
  ASSERT_TRUE(done2.ok()) << done2.status().ToString();
  EXPECT_TRUE(done2->staged);
  EXPECT_EQ(done2->content_digest, s2->manifest_digest);
  expect_live(2);
  auto reread = r.LiveDigest();
  ASSERT_TRUE(reread.ok());
  EXPECT_TRUE(reread->table_cached);
  EXPECT_EQ(reread->content_digest, s2->manifest_digest);
  // v3 stages into v1's storages again: both staging tables are kept, and the digest still holds
  // the staged bytes to the manifest.
  publish(3);
  auto s3 = stage(3);
  ASSERT_TRUE(s3.ok()) << s3.status().ToString();
  EXPECT_TRUE(s3->digest_table_cached);
  EXPECT_EQ(s3->staged_digest, s3->manifest_digest);
  expect_live(2);
}

}  // namespace
}  // namespace rc::receiver
