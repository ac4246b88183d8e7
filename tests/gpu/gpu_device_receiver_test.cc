// receiver::DeviceReceiver driving a receiver::DeviceLiveWeights that is not vLLM (label gpu;
// skipped without a CUDA device): device buffers this test allocates, answered by the live-weights
// interface the vLLM extension's binding also implements. What it pins down: the live digest and
// the fused install go through the buffers the live weights answer at that moment (an install
// refuses, writing nothing, when they moved since it was prepared), the install writes exactly the
// staged values and digests them as the CPU does, and a live weights that cannot answer is named.
// The stage (directory, pull) runs in the vLLM suite (tests/vllm), against a real trainer.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <string>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "rolloutcore/cuda/gpu_refit.h"
#include "rolloutcore/receiver/device_receiver.h"
#include "rolloutcore/receiver/live_weights.h"
#include "rolloutcore/refit/capture.h"
#include "rolloutcore/refit/digest.h"
#include "rolloutcore/refit/layouts.h"
#include "rolloutcore/refit/model_config.h"

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

}  // namespace
}  // namespace rc::receiver
