// Pre-replay through the refit receiver, in one process (docs/lifecycle.md "Replay validation"):
// a real directory (MemoryStore behind its HTTP server), a real trainer Publisher over shm and a
// real engine with its RefitReceiver. A stage whose manifest carries probes replays them on the
// staged image while the old version serves; the swap install makes exactly those results
// servable by Engine::Replay (precomputed, "staged_image"), bit for bit what the live weights
// compute; a later stage drops them; a stage whose pre-replay cannot get KV blocks still succeeds.
#include <gtest/gtest.h>

#include <cstring>
#include <map>

#include "rolloutcore/base/clock.h"
#include "rolloutcore/directory/memory_store.h"
#include "rolloutcore/directory/server.h"
#include "rolloutcore/engine/loader.h"
#include "rolloutcore/receiver/receiver.h"
#include "rolloutcore/refit/layouts.h"
#include "rolloutcore/refit/model_config.h"
#include "rolloutcore/trainer/publisher.h"
#include "rolloutcore/trainer/synthetic_trainer.h"
#include "rolloutcore/transport/shm.h"
#include "engine/whole_model_shards.h"

namespace rc::engine {
namespace {

// The refit receiver (module `receiver`) on an embedded engine.
using receiver::InstallMode;
using receiver::InstallOutcome;
using receiver::InstallResult;
using receiver::RefitReceiver;
using receiver::StageRequest;

struct EngineSetup {
  int tp = 1;
  int64_t num_kv_blocks = 0;
  std::string model = "tiny";  // tiny-qwen2: tied lm_head
};

class PreReplayReceiverTest : public ::testing::TestWithParam<int> {
 protected:
  void Start(const EngineSetup& setup) {
    store_ = directory::NewMemoryStore(SystemClock::Default());
    server_ = std::make_unique<directory::DirectoryServer>(store_.get(), directory::ServerOptions{});
    ASSERT_TRUE(server_->Start().ok());
    EngineOptions o;
    o.num_threads = 2;
    o.tensor_parallel_size = setup.tp;
    o.num_kv_blocks = setup.num_kv_blocks;
    if (setup.num_kv_blocks > 0) o.max_model_len = setup.num_kv_blocks * o.block_size;
    model_ = setup.model;
    auto e = CreateEngine({setup.model, "dummy", 3}, o);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    engine_ = std::move(e).value();
    receiver_ = std::make_unique<RefitReceiver>(engine_.get(), 2);
    auto t = trainer::CreateTrainerTransport("shm");
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    transport_ = std::move(t).value();
    publisher_ = std::make_unique<trainer::Publisher>(transport_.get(), store_.get(), "m", 0, 1);
  }
  void TearDown() override {
    publisher_.reset();
    if (server_) server_->Stop();
  }

  // Every tensor of the tiny model, whole, from one rank (bf16 of the synthetic W_step), with
  // `probes` attached. The probes' expected steps are placeholders: only the request (prompt,
  // steps, top_k) matters to the engine.
  void Publish(const std::string& version, int64_t step, const std::vector<refit::Probe>& probes) {
    test_util::AddWholeModelShards(publisher_.get(), model_, version, step, &published_);
    if (::testing::Test::HasFatalFailure()) return;
    if (!probes.empty()) {
      ASSERT_TRUE(publisher_->AttachProbes(version, probes).ok());
    }
    auto r = publisher_->Publish(version);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
  }

  static refit::Probe MakeProbe(const std::string& name, std::vector<int32_t> prompt, int steps, int top_k) {
    refit::Probe p;
    p.name = name;
    p.prompt = std::move(prompt);
    p.top_k = top_k;
    for (int i = 0; i < steps; ++i) {
      refit::ProbeStep st;
      st.token = 0;
      st.logprob = -1.f;
      for (int k = 0; k < top_k; ++k) st.top.emplace_back(k, -1.f - static_cast<float>(k));
      p.steps.push_back(std::move(st));
    }
    return p;
  }
  static std::vector<refit::Probe> TwoProbes() {
    return {MakeProbe("p0", {5, 17, 42, 99, 3, 250, 7, 64, 33, 12, 8, 1, 200, 150, 90, 31, 77}, 8, 5),
            MakeProbe("p1", {3, 1, 4, 1, 5}, 6, 3)};
  }

  StageRequest Stage(const std::string& version) const {
    StageRequest r;
    r.model = "m";
    r.version = version;
    r.directory = server_->url();
    r.timeout_ms = 60'000;
    return r;
  }

  Result<ReplayOutput> Replay(const refit::Probe& p, bool allow_precomputed = true) {
    return engine_->Replay(p.prompt, static_cast<int64_t>(p.steps.size()), p.top_k, allow_precomputed);
  }

  std::string model_ = "tiny";
  std::unique_ptr<directory::DirectoryStore> store_;
  std::unique_ptr<directory::DirectoryServer> server_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<RefitReceiver> receiver_;
  std::unique_ptr<transport::Transport> transport_;
  std::unique_ptr<trainer::Publisher> publisher_;
  std::map<std::string, std::shared_ptr<transport::ShmBuffer>> published_;
};

// Stage -> pre-replay on the shadow -> swap install -> Replay served from the pre-replay, equal
// bit for bit to the live computation; the next stage drops it.
TEST_P(PreReplayReceiverTest, SwapInstallServesThePreReplayBitForBitAndTheNextStageDropsIt) {
  // 1, 2: tiny at tp 1 and 2; 3: tiny-qwen2 (tied lm_head: the image's own lm_head buffer is not
  // what the live weights read) at tp 1.
  Start(GetParam() == 3 ? EngineSetup{1, 0, "tiny-qwen2"} : EngineSetup{GetParam(), 0, "tiny"});
  const auto probes = TwoProbes();
  Publish("v1", 1, probes);
  auto staged = receiver_->Stage(Stage("v1"));
  ASSERT_TRUE(staged.ok()) << staged.status().ToString();
  const Json pre = staged->prereplay.ToJson();
  EXPECT_EQ(pre.value("probes", 0), 2) << pre.dump();
  EXPECT_TRUE(pre.value("ran", false)) << pre.dump();
  EXPECT_GT(pre.value("ms", 0.0), 0.0) << pre.dump();
  EXPECT_FALSE(engine_->IsPaused()) << "the pre-replay ran while the engine served";

  ASSERT_TRUE(engine_->Pause(PauseMode::kWait).ok());
  InstallResult installed = receiver_->Install("v1");
  ASSERT_EQ(installed.outcome, InstallOutcome::kInstalled) << installed.status.ToString();
  EXPECT_EQ(installed.report.install_mode, InstallMode::kSwap);
  EXPECT_TRUE(installed.report.prereplay_adopted.value_or(false)) << installed.report.ToJson().dump();
  for (const refit::Probe& p : probes) {
    auto served = Replay(p);
    ASSERT_TRUE(served.ok()) << served.status().ToString();
    EXPECT_TRUE(served->precomputed) << p.name;
    EXPECT_EQ(served->computed_on, "staged_image");
    auto live = Replay(p, /*allow_precomputed=*/false);
    ASSERT_TRUE(live.ok()) << live.status().ToString();
    EXPECT_FALSE(live->precomputed);
    ASSERT_EQ(served->steps.size(), live->steps.size());
    for (size_t i = 0; i < live->steps.size(); ++i) {
      EXPECT_EQ(served->steps[i].token, live->steps[i].token) << p.name << " step " << i;
      EXPECT_EQ(served->steps[i].logprob, live->steps[i].logprob) << p.name << " step " << i;
      EXPECT_EQ(served->steps[i].top_logprobs, live->steps[i].top_logprobs) << p.name << " step " << i;
    }
  }
  engine_->Resume();

  // A second stage reuses the shadow: whatever was pre-replayed is dropped, even though the live
  // weights did not change (conservative), and a version without probes pre-replays nothing.
  Publish("v2", 2, {});
  auto second = receiver_->Stage(Stage("v2"));
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_FALSE(second->prereplay.report.ran);
  EXPECT_EQ(second->prereplay.report.why, "the version carries no probes");
  ASSERT_TRUE(engine_->Pause(PauseMode::kWait).ok());
  auto after = Replay(probes[0]);
  ASSERT_TRUE(after.ok());
  EXPECT_FALSE(after->precomputed) << "a second stage must drop the pre-replay";
  InstallResult v2 = receiver_->Install("v2");
  ASSERT_EQ(v2.outcome, InstallOutcome::kInstalled) << v2.status.ToString();
  EXPECT_FALSE(v2.report.prereplay_adopted.has_value());
  EXPECT_FALSE(Replay(probes[0])->precomputed);
  engine_->Resume();
}

INSTANTIATE_TEST_SUITE_P(Tp, PreReplayReceiverTest, ::testing::Values(1, 2, 3));

using PreReplayReceiverNoBlocksTest = PreReplayReceiverTest;

// A pre-replay that cannot borrow KV blocks does not fail the stage: ran=false, with the reason,
// and validation would replay in the pause as before.
TEST_F(PreReplayReceiverNoBlocksTest, StageSucceedsWhenThePreReplayGetsNoBlocks) {
  Start({1, /*num_kv_blocks=*/2, "tiny"});  // 32 positions: each probe fits alone, both together do not
  std::vector<refit::Probe> probes = {MakeProbe("a", std::vector<int32_t>(20, 7), 8, 2),
                                      MakeProbe("b", std::vector<int32_t>(20, 9), 8, 2)};
  Publish("v1", 1, probes);
  auto staged = receiver_->Stage(Stage("v1"));
  ASSERT_TRUE(staged.ok()) << staged.status().ToString();
  const Json pre = staged->prereplay.ToJson();
  EXPECT_FALSE(pre.value("ran", true)) << pre.dump();
  EXPECT_NE(pre.value("why", "").find("cannot spare"), std::string::npos) << pre.dump();
  ASSERT_TRUE(engine_->Pause(PauseMode::kWait).ok());
  InstallResult installed = receiver_->Install("v1");
  ASSERT_EQ(installed.outcome, InstallOutcome::kInstalled) << installed.status.ToString();
  EXPECT_FALSE(installed.report.prereplay_adopted.has_value());
  engine_->Resume();
}

}  // namespace
}  // namespace rc::engine
