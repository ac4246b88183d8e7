// The embedded adapter: an engine in this process, driven by the real ControllerService, with a
// real directory server (memory store) and a synthetic trainer publishing over shm.
#include "rolloutcore/adapters/embedded_adapter.h"

#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <future>
#include <thread>

#include "rolloutcore/base/hash.h"
#include "rolloutcore/controller/directory_versions.h"
#include "rolloutcore/controller/service.h"
#include "rolloutcore/directory/client.h"
#include "rolloutcore/directory/memory_store.h"
#include "rolloutcore/directory/server.h"
#include "rolloutcore/engine/engine.h"
#include "rolloutcore/receiver/receiver.h"
#include "rolloutcore/refit/layouts.h"
#include "rolloutcore/refit/model_config.h"
#include "rolloutcore/trainer/synthetic_trainer.h"
#include "testing/fake_engine.h"

namespace rc::adapters {
namespace {

namespace fs = std::filesystem;

class EmbeddedAdapterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = directory::NewMemoryStore(SystemClock::Default());
    server_ = std::make_unique<directory::DirectoryServer>(store_.get(), directory::ServerOptions{});
    ASSERT_TRUE(server_->Start().ok());
    UseTrainer(trainer::ProbeOptions{});
    UseEngine("");
    state_dir_ = (fs::temp_directory_path() / ("rc_embedded_" + std::to_string(::getpid()))).string();
    fs::remove_all(state_dir_);
  }
  // The synthetic trainer of model "m" (tiny, fsdp:2 over shm, seed 11) attaching `probes` and
  // publishing the FP8 parts of `fp8_parts`, its first version v<first_step>.
  void UseTrainer(const trainer::ProbeOptions& probes, std::vector<std::string> fp8_parts = {},
                  int64_t first_step = 0) {
    trainer_.reset();
    trainer::SyntheticTrainerOptions to;
    to.publisher.fp8_quantizations = std::move(fp8_parts);
    to.first_step = first_step;
    to.config = *refit::ModelPreset("tiny");
    to.layout = *refit::ParseTrainerLayout("fsdp:2");
    to.model_name = "m";
    to.transport = "shm";
    to.weights.seed = 11;
    to.probes = probes;
    auto t = trainer::SyntheticTrainer::Create(to, store_.get());
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    trainer_ = std::move(t).value();
  }
  // The in-process engine (tiny dummy weights, seed 3, tp 2, label "init") serving `quantization`
  // ("" or an FP8 method, docs/fp8.md).
  void UseEngine(const std::string& quantization) {
    engine_.reset();
    EmbeddedEngine::Options eo;
    eo.model = "tiny";
    eo.load_format = "dummy";
    eo.seed = 3;
    eo.tensor_parallel_size = 2;
    eo.threads = 1;
    eo.weight_version = "init";
    eo.quantization = quantization;
    auto e = EmbeddedEngine::Create(eo);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    engine_ = std::move(e).value();
  }
  void TearDown() override {
    service_.reset();
    engine_.reset();
    trainer_.reset();
    server_->Stop();
    fs::remove_all(state_dir_);
  }
  trainer::VersionStatus Step() {
    auto v = trainer_->Step();
    EXPECT_TRUE(v.ok()) << v.status().ToString();
    EXPECT_EQ(v->state, "COMMITTED");
    return *v;
  }
  void StartService(int64_t verify_interval_ms = 1000) {
    versions_ = std::make_unique<controller::DirectoryVersionSource>(store_.get());
    std::vector<controller::EngineHandle> engines;
    controller::EngineHandle h;
    h.name = "embedded";
    h.adapter = engine_->MakeAdapter({server_->url(), "m"});
    h.complete = engine_->MakeCompleter();
    engines.push_back(std::move(h));
    controller::ServiceOptions so;
    so.state_dir = state_dir_;
    so.verify_interval_ms = verify_interval_ms;
    auto s = controller::ControllerService::Create(std::move(engines), versions_.get(), so);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    service_ = std::move(s).value();
  }
  Json Rollout(const std::string& id) {
    Json req{{"prompt_token_ids", {3, 14, 15, 92, 65, 35, 89, 79}}, {"max_tokens", 8}, {"temperature", 0.0},
             {"rollout_id", id}};
    auto r = service_->Rollout(req);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : Json();
  }

  std::unique_ptr<directory::DirectoryStore> store_;
  std::unique_ptr<directory::DirectoryServer> server_;
  std::unique_ptr<trainer::SyntheticTrainer> trainer_;
  std::unique_ptr<EmbeddedEngine> engine_;
  std::unique_ptr<controller::DirectoryVersionSource> versions_;
  std::unique_ptr<controller::ControllerService> service_;
  std::string state_dir_;
};

// Replay validation through the in-process adapter (docs/lifecycle.md "Replay validation"): the
// trainer's probes (its reference forward, tp 1) replayed by the tp-2 engine while paused.
TEST_F(EmbeddedAdapterTest, ProbesAreReplayedInProcessBeforeTheEngineResumes) {
  UseTrainer(trainer::ProbeOptions{.count = 2, .tokens = 4, .top_k = 3});
  Step();  // v0
  Step();  // v1
  auto m = store_->Get("m", "v1");
  ASSERT_TRUE(m.ok());
  ASSERT_EQ(m->probes.size(), 2u);
  StartService();
  auto desc = engine_->MakeAdapter({server_->url(), "m"})->Describe();
  ASSERT_TRUE(desc.ok());
  EXPECT_TRUE(desc->offers_replay);
  auto id = service_->RequestUpdate("m", "v1");
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  auto done = service_->WaitForUpdate(*id, 60000);
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  const Json& e = (*done)["engines"][0];
  ASSERT_EQ(e["outcome"], "committed") << done->dump(2);
  const Json& replay = e["evidence"]["validated"]["replay"];
  EXPECT_FALSE(replay["skipped"].get<bool>()) << replay.dump();
  EXPECT_TRUE(replay["match"].get<bool>()) << replay.dump();
  EXPECT_EQ(replay["tokens"], 8);
  EXPECT_LE(replay["worst_logprob_diff"].get<double>(), 1e-4);
  EXPECT_FALSE(engine_->engine()->IsPaused());
}

TEST_F(EmbeddedAdapterTest, ControllerUpdatesTheInProcessEngineAndProvesTheDigest) {
  Step();                                    // v0
  trainer::VersionStatus v1 = Step();        // v1
  StartService();
  Json before = Rollout("r-before");
  EXPECT_EQ(before["binding"]["label"], "init");
  const int64_t resets_before = engine_->engine()->Metrics().cache_resets;

  auto id = service_->RequestUpdate("m", "v1");
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  auto done = service_->WaitForUpdate(*id, 60000);
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  const Json& e = (*done)["engines"][0];
  EXPECT_EQ(e["outcome"], "committed") << done->dump(2);
  EXPECT_EQ(engine_->engine()->WeightVersion(), "v1");
  auto live = engine_->receiver()->LiveDigest(/*fresh=*/true);
  ASSERT_TRUE(live.ok()) << live.status().ToString();
  EXPECT_EQ(live->content_digest.ToHex(), Hex64(v1.content_digest)) << "live weights are the published v1";
  EXPECT_GT(engine_->engine()->Metrics().cache_resets, resets_before) << "the update reset the prefix cache";

  Json after = Rollout("r-after");
  EXPECT_EQ(after["binding"]["label"], "v1");
  EXPECT_EQ(after["binding"]["identity"]["content_digest"], Hex64(v1.content_digest));
  EXPECT_EQ(after["choices"][0]["weight_version"], "v1");
  EXPECT_NE(after["choices"][0]["token_ids"], before["choices"][0]["token_ids"])
      << "different weights, different greedy tokens (dummy init vs v1)";
}

// FP8 serving (docs/fp8.md): the controller commits an update only when the FP8 image the engine
// computes with is the quantization of the live weights it proved; each of the four negative
// controls (a wrong scale, the previous version's scales, scales re-laid out for another kernel, the
// previous version's whole image) taints, and recovery with a clean install commits again.
TEST_F(EmbeddedAdapterTest, Fp8ImageIsProvedAndEveryNegativeControlTaints) {
  UseEngine("fp8_per_channel");
  for (int i = 0; i < 5; ++i) Step();  // v0 .. v4
  StartService();
  auto first = service_->WaitForUpdate(service_->RequestUpdate("m", "v0").value(), 60000);
  ASSERT_TRUE(first.ok());
  ASSERT_EQ((*first)["outcome"], "committed") << first->dump(2);
  const Json& q = (*first)["engines"][0]["evidence"]["validated"]["quantized"];
  ASSERT_TRUE(q.is_object()) << first->dump(2);
  EXPECT_EQ(q["quantization"], "fp8_per_channel");
  EXPECT_TRUE(q["match"].get<bool>()) << q.dump();
  EXPECT_EQ(q["live"], q["expected"]);

  int version = 1;
  for (engine::Fp8Fault f : {engine::Fp8Fault::kWrongScale, engine::Fp8Fault::kStaleScales,
                             engine::Fp8Fault::kSwizzledScales, engine::Fp8Fault::kStaleImage}) {
    const std::string target = "v" + std::to_string(version++);
    ASSERT_TRUE(engine_->engine()->SetFp8FaultForTesting(f).ok());
    auto failed = service_->WaitForUpdate(service_->RequestUpdate("m", target).value(), 60000);
    ASSERT_TRUE(failed.ok()) << failed.status().ToString();
    EXPECT_EQ((*failed)["engines"][0]["outcome"], "tainted") << engine::Fp8FaultName(f) << "\n" << failed->dump(2);
    EXPECT_NE((*failed)["engines"][0]["reason"].get<std::string>().find("fp8_per_channel image"), std::string::npos)
        << engine::Fp8FaultName(f) << "\n" << failed->dump(2);
    auto rec = service_->WaitForUpdate(service_->RequestRecovery("m", target).value(), 60000);
    ASSERT_TRUE(rec.ok()) << rec.status().ToString();
    ASSERT_EQ((*rec)["outcome"], "committed") << engine::Fp8FaultName(f) << "\n" << rec->dump(2);
  }
  Json after = Rollout("after");
  EXPECT_EQ(after["binding"]["label"], "v4");
}

// The expected image from the trainer (docs/fp8.md): with --fp8-parts the trainer's ranks publish
// their parts of the FP8 image (fsdp:2 splits every per-tensor scale group: the amaxes are exchanged),
// and validation holds the live image to their sum as well as to the engine's own quantization. An
// engine whose quantizer and self-check share a bug (the fault self_consistent_wrong_scale) passes
// its own check; only the trainer's image catches it, and without parts the same fault commits.
TEST_F(EmbeddedAdapterTest, Fp8ImageIsHeldToTheImageTheTrainerPublished) {
  UseTrainer(trainer::ProbeOptions{}, {"fp8_per_tensor", "fp8_per_channel"});
  UseEngine("fp8_per_tensor");
  for (int i = 0; i < 3; ++i) Step();  // v0 .. v2
  auto manifest = store_->Get("m", "v0");
  ASSERT_TRUE(manifest.ok());
  EXPECT_EQ(refit::PublishedFp8Quantizations(*manifest), (std::vector<std::string>{"fp8_per_channel", "fp8_per_tensor"}));
  StartService();
  auto first = service_->WaitForUpdate(service_->RequestUpdate("m", "v0").value(), 60000);
  ASSERT_TRUE(first.ok());
  ASSERT_EQ((*first)["outcome"], "committed") << first->dump(2);
  const Json q = (*first)["engines"][0]["evidence"]["validated"]["quantized"];
  EXPECT_EQ(q["expected_from"], "trainer") << q.dump();
  EXPECT_EQ(q["published"], q["live"]) << q.dump();
  EXPECT_EQ(q["published"], q["expected"]) << q.dump();
  EXPECT_EQ(q["published"], refit::Fp8ImageCombined(*refit::PublishedFp8Image(*manifest, "fp8_per_tensor")).ToHex());

  ASSERT_TRUE(engine_->engine()->SetFp8FaultForTesting(engine::Fp8Fault::kSelfConsistentWrongScale).ok());
  auto failed = service_->WaitForUpdate(service_->RequestUpdate("m", "v1").value(), 60000);
  ASSERT_TRUE(failed.ok()) << failed.status().ToString();
  EXPECT_EQ((*failed)["engines"][0]["outcome"], "tainted") << failed->dump(2);
  EXPECT_NE((*failed)["engines"][0]["reason"].get<std::string>().find("not the image the trainer published"),
            std::string::npos)
      << failed->dump(2);
  // A recovery is held to the trainer's image too: the same fault fails it, a clean one commits.
  ASSERT_TRUE(engine_->engine()->SetFp8FaultForTesting(engine::Fp8Fault::kSelfConsistentWrongScale).ok());
  auto bad_rec = service_->WaitForUpdate(service_->RequestRecovery("m", "v1").value(), 60000);
  ASSERT_TRUE(bad_rec.ok()) << bad_rec.status().ToString();
  EXPECT_NE((*bad_rec)["outcome"], "committed") << bad_rec->dump(2);
  EXPECT_NE(bad_rec->dump().find("not the image the trainer published"), std::string::npos) << bad_rec->dump(2);
  auto rec = service_->WaitForUpdate(service_->RequestRecovery("m", "v1").value(), 60000);
  ASSERT_TRUE(rec.ok()) << rec.status().ToString();
  ASSERT_EQ((*rec)["outcome"], "committed") << rec->dump(2);
  EXPECT_EQ((*rec)["engines"][0]["evidence"]["recovered"]["quantized"]["expected_from"], "trainer") << rec->dump(2);

  // The same fault on a version without parts: the engine's own check is all there is, and passes.
  UseTrainer(trainer::ProbeOptions{}, {}, 10);
  Step();  // v10
  ASSERT_TRUE(engine_->engine()->SetFp8FaultForTesting(engine::Fp8Fault::kSelfConsistentWrongScale).ok());
  auto blind = service_->WaitForUpdate(service_->RequestUpdate("m", "v10").value(), 60000);
  ASSERT_TRUE(blind.ok());
  ASSERT_EQ((*blind)["outcome"], "committed") << blind->dump(2);
  EXPECT_EQ((*blind)["engines"][0]["evidence"]["validated"]["quantized"]["expected_from"], "engine");
}

// Replay with FP8 serving (docs/fp8.md, "Replay validation"): probes the trainer computed under the
// engine's quantization are replayed and match at the f32 tolerance (the FP8 engine computes what
// the probes' FP8 reference computes); probes computed on the bf16 weights are not the FP8 engine's
// numbers to match, and the replay is skipped with that reason (the FP8 image digest still proves
// what it computes with).
class EmbeddedFp8ReplayTest : public EmbeddedAdapterTest {
 protected:
  void Run(const std::string& probe_q) {
    UseTrainer(trainer::ProbeOptions{.count = 3, .tokens = 6, .top_k = 3, .quantization = probe_q});
    UseEngine("fp8_per_channel");
    Step();
    trainer::VersionStatus v1 = Step();
    StartService();
    auto done = service_->WaitForUpdate(service_->RequestUpdate("m", v1.version).value(), 60000);
    ASSERT_TRUE(done.ok());
    const Json& ev = (*done)["engines"][0];
    ASSERT_EQ(ev["outcome"], "committed") << "probes '" << probe_q << "': " << done->dump(2);
    const Json& replay = ev["evidence"]["validated"]["replay"];
    if (!probe_q.empty()) {
      EXPECT_FALSE(replay["skipped"].get<bool>()) << replay.dump();
      EXPECT_TRUE(replay["match"].get<bool>()) << replay.dump();
      EXPECT_EQ(replay["probes"], 3);
      EXPECT_LE(replay["worst_logprob_diff"].get<double>(), 1e-4) << replay.dump();
    } else {
      EXPECT_TRUE(replay["skipped"].get<bool>()) << replay.dump();
      EXPECT_NE(replay.dump().find("none under the engine's 'fp8_per_channel'"), std::string::npos) << replay.dump();
    }
  }
};

TEST_F(EmbeddedFp8ReplayTest, ProbesOfTheEnginesQuantizationAreReplayed) { Run("fp8_per_channel"); }

TEST_F(EmbeddedFp8ReplayTest, Bf16ProbesAreNotAnFp8EnginesToMatch) { Run(""); }

TEST_F(EmbeddedAdapterTest, InstallRefusedBeforeMutationUnlessPausedAndStaged) {
  Step();
  Step();
  auto adapter = engine_->MakeAdapter({server_->url(), "m"});
  lifecycle::UpdateTarget target;
  target.label = "v1";
  target.model = "m";
  auto stage = AwaitPending(adapter->Stage(target), 60000, "stage");
  ASSERT_TRUE(stage.ok()) << stage.status().ToString();
  EXPECT_GT(stage->bytes, 0);
  // Not paused: refused, nothing touched — said as a typed outcome, not an error code.
  auto refused = AwaitPending(adapter->Install(target, false), 60000, "install");
  ASSERT_TRUE(refused.ok()) << refused.status().ToString();
  EXPECT_EQ(refused->outcome, lifecycle::InstallOutcome::kRefusedUntouched);
  EXPECT_NE(refused->error.find("not paused"), std::string::npos) << refused->error;
  EXPECT_EQ(engine_->engine()->WeightVersion(), "init");
  // Paused: installs, and the label comes from the install path.
  auto paused = AwaitPending(adapter->Pause(lifecycle::PauseMode::kWait), 10000, "pause");
  ASSERT_TRUE(paused.ok());
  EXPECT_TRUE(paused->paused);
  auto other = target;
  other.label = "v0";
  auto wrong = AwaitPending(adapter->Install(other, false), 60000, "install");
  ASSERT_TRUE(wrong.ok()) << wrong.status().ToString();
  EXPECT_EQ(wrong->outcome, lifecycle::InstallOutcome::kRefusedUntouched) << "v1 is staged, not v0";
  auto installed = AwaitPending(adapter->Install(target, false), 60000, "install");
  ASSERT_TRUE(installed.ok()) << installed.status().ToString();
  EXPECT_EQ(installed->outcome, lifecycle::InstallOutcome::kInstalled);
  EXPECT_EQ(installed->label, "v1");
  auto label = AwaitPending(adapter->ReadLabel(), 10000, "label");
  EXPECT_EQ(label->label, "v1");
  auto reset = AwaitPending(adapter->ResetCache(lifecycle::CacheKind::kPrefix), 10000, "reset");
  ASSERT_TRUE(reset.ok());
  EXPECT_TRUE(reset->success);
  auto encoder = AwaitPending(adapter->ResetCache(lifecycle::CacheKind::kEncoder), 10000, "reset");
  EXPECT_EQ(encoder.status().code(), StatusCode::kInvalidArgument) << "no encoder cache exists to claim reset";
  auto resumed = AwaitPending(adapter->Resume(), 10000, "resume");
  ASSERT_TRUE(resumed.ok());
  EXPECT_FALSE(resumed->paused_after);
}

// Identity in process: the probe reports the engine's boot id, label, install generation and the
// receiver's cached digest; an install behind the service's back (through the same engine, with
// the label set back) taints the engine at the next check.
TEST_F(EmbeddedAdapterTest, ProbeReportsTheEngineAndAnInstallBehindTheServiceTaints) {
  Step();  // v0
  Step();  // v1
  StartService(/*verify_interval_ms=*/20);
  auto adapter = engine_->MakeAdapter({server_->url(), "m"});
  auto id = AwaitPending(adapter->ProbeIdentity(), 10000, "probe");
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  EXPECT_EQ(id->boot_id, engine_->engine()->boot_id());
  EXPECT_EQ(id->label, "init");
  EXPECT_EQ(id->install_generation, 0);
  EXPECT_FALSE(id->content_digest.empty()) << "the service read (and cached) the digest at start";
  Json r = Rollout("r-ok");
  EXPECT_EQ(r["rolloutcore"]["boot_id"], engine_->engine()->boot_id());

  lifecycle::UpdateTarget target;
  target.label = "v1";
  target.model = "m";
  ASSERT_TRUE(AwaitPending(adapter->Stage(target), 60000, "stage").ok());
  ASSERT_TRUE(AwaitPending(adapter->Pause(lifecycle::PauseMode::kWait), 10000, "pause").ok());
  ASSERT_TRUE(AwaitPending(adapter->Install(target, false), 60000, "install").ok());
  engine_->engine()->SetWeightVersion("init");  // the label is faked back
  ASSERT_TRUE(AwaitPending(adapter->Resume(), 10000, "resume").ok());
  id = AwaitPending(adapter->ProbeIdentity(), 10000, "probe");
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(id->install_generation, 1);
  EXPECT_EQ(id->label, "init");

  auto end = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (std::chrono::steady_clock::now() < end && service_->controller(0)->state() != lifecycle::State::kTainted) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(service_->controller(0)->state(), lifecycle::State::kTainted);
  EXPECT_EQ(service_->Rollout(Json{{"prompt_token_ids", {1, 2}}, {"max_tokens", 2}}).status().code(),
            StatusCode::kUnavailable);
}

// Issue 36 #2: a keep update that fails validation (the live digest read back is wrong) taints
// while the engine is paused with rollouts frozen inside; the taint ends them: their proxies are
// answered in bounded time (aborted_at_update, reason update_tainted, tokens all from the bound
// version), they hold nothing, and a recovery is accepted at once and brings the engine back.
TEST_F(EmbeddedAdapterTest, AKeepUpdateThatFailsValidationEndsItsFrozenRolloutsAndRecovers) {
  Step();  // v0
  Step();  // v1
  auto inner = engine_->MakeAdapter({server_->url(), "m"});
  auto faulty = std::make_unique<rc::testing::FaultInjectingAdapter>(inner.get());
  auto* fault = faulty.get();
  versions_ = std::make_unique<controller::DirectoryVersionSource>(store_.get());
  {
    std::vector<controller::EngineHandle> engines;
    controller::EngineHandle h;
    h.name = "embedded";
    h.adapter = std::move(faulty);
    h.complete = engine_->MakeCompleter();
    engines.push_back(std::move(h));
    controller::ServiceOptions so;
    so.state_dir = state_dir_;
    // The test freezes the engine itself (pause keep) while the controller is READY: the periodic
    // identity check would rightly taint an engine paused behind its back. Off; the post-op check
    // still runs.
    so.verify_interval_ms = 0;
    auto s = controller::ControllerService::Create(std::move(engines), versions_.get(), so);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    service_ = std::move(s).value();
  }
  auto first = service_->WaitForUpdate(service_->RequestUpdate("m", "v0").value(), 60000);
  ASSERT_EQ((*first)["outcome"], "committed") << first->dump(2);

  engine::Engine* eng = engine_->engine();
  std::vector<std::future<Result<Json>>> rollouts;
  // Two long greedy rollouts, frozen (pause keep) once both are generating. The tiny model is
  // fast: a freeze that came too late (one already finished) is retried with new rollouts.
  for (int attempt = 0; attempt < 20; ++attempt) {
    rollouts.clear();
    for (int i = 0; i < 2; ++i) {
      const std::string id = "frozen-" + std::to_string(attempt) + "-" + std::to_string(i);
      rollouts.push_back(std::async(std::launch::async, [this, id, i] {
        return service_->Rollout(Json{{"prompt_token_ids", {3 + i, 14, 15, 92}}, {"max_tokens", 480},
                                      {"temperature", 0.0}, {"ignore_eos", true}, {"rollout_id", id}});
      }));
    }
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (eng->State().num_running < 2 && std::chrono::steady_clock::now() < until) std::this_thread::yield();
    ASSERT_TRUE(eng->Pause(engine::PauseMode::kKeep, engine::InFlightKv::kKeep).ok());
    if (eng->State().num_running == 2) break;
    eng->Resume();
    for (auto& r : rollouts) r.wait();
  }
  ASSERT_EQ(eng->State().num_running, 2) << "two rollouts frozen mid-generation";

  rc::testing::Fault corrupt;
  corrupt.kind = rc::testing::Fault::Kind::kCorruptDigest;
  fault->Set("digest", corrupt);
  auto failed = service_->WaitForUpdate(service_->RequestUpdate("m", "v1", lifecycle::PolicyMode::kKeep).value(), 60000);
  ASSERT_TRUE(failed.ok());
  ASSERT_EQ((*failed)["outcome"], "tainted") << failed->dump(2);
  EXPECT_EQ((*failed)["engines"][0]["reason"].get<std::string>().find("digest") != std::string::npos, true)
      << failed->dump(2);

  // The frozen rollouts are answered now, not at a call timeout.
  for (auto& r : rollouts) {
    ASSERT_EQ(r.wait_for(std::chrono::seconds(20)), std::future_status::ready) << "a frozen rollout was never answered";
  }
  for (auto& f : rollouts) {
    auto r = f.get();
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    const Json& a = (*r)["aborted_at_update"];
    ASSERT_TRUE(a.is_object()) << r->dump();
    EXPECT_EQ(a["reason"], "update_tainted");
    EXPECT_EQ(a["target"], "v1");
    EXPECT_EQ((*r)["choices"][0]["finish_reason"], "abort");
    ASSERT_EQ((*r)["version_spans"].size(), 1u) << (*r)["version_spans"].dump();
    EXPECT_EQ((*r)["version_spans"][0]["label"], "v0") << "every token it kept is the bound version's";
  }
  EXPECT_EQ(service_->controller(0)->active_count(), 0);
  const std::vector<controller::Trajectory> rows = service_->trajectories()->List("v0").value();
  for (const auto& t : rows) {
    if (t.binding.rollout_id.rfind("frozen-", 0) == 0 && t.finish_reason == "abort") {
      EXPECT_EQ(t.aborted_at_update["reason"], "update_tainted");
    }
  }

  // Recovery is accepted at once (nothing holds it) and proves v0 live again.
  fault->Set("digest", rc::testing::Fault{});
  auto rec_id = service_->RequestRecovery("m", "v0");
  ASSERT_TRUE(rec_id.ok()) << rec_id.status().ToString();
  auto rec = service_->WaitForUpdate(*rec_id, 60000);
  ASSERT_TRUE(rec.ok());
  EXPECT_EQ((*rec)["outcome"], "committed") << rec->dump(2);
  EXPECT_FALSE(eng->IsPaused());
  Json after = Rollout("after-recovery");
  EXPECT_EQ(after["binding"]["label"], "v0");
}

// Forwards to the embedded adapter, except that Pause can be made to claim a pause that did not
// happen: the engine then refuses the install for real (it is not paused).
class ClaimedPauseAdapter final : public lifecycle::EngineAdapter {
 public:
  explicit ClaimedPauseAdapter(std::unique_ptr<lifecycle::EngineAdapter> inner) : inner_(std::move(inner)) {}
  std::atomic<bool> claim_pause{false};
  Result<lifecycle::EngineDescription> Describe() override { return inner_->Describe(); }
  Pending<lifecycle::DrainStatus> GetDrainStatus() override { return inner_->GetDrainStatus(); }
  Pending<lifecycle::PauseEvidence> Pause(lifecycle::PauseMode m) override {
    if (claim_pause) return Pending<lifecycle::PauseEvidence>::Completed(lifecycle::PauseEvidence{true, 0});
    return inner_->Pause(m);
  }
  Pending<lifecycle::AbortEvidence> AbortRequests(const std::vector<std::string>& ids) override {
    return inner_->AbortRequests(ids);
  }
  Pending<lifecycle::StageEvidence> Stage(const lifecycle::UpdateTarget& t) override { return inner_->Stage(t); }
  Pending<lifecycle::InstallEvidence> Install(const lifecycle::UpdateTarget& t, bool full) override {
    return inner_->Install(t, full);
  }
  Pending<lifecycle::CacheResetResult> ResetCache(lifecycle::CacheKind k) override { return inner_->ResetCache(k); }
  Pending<lifecycle::LabelEvidence> ReadLabel() override { return inner_->ReadLabel(); }
  Pending<lifecycle::DigestEvidence> ReadContentDigest() override { return inner_->ReadContentDigest(); }
  Pending<lifecycle::IdentityEvidence> ProbeIdentity() override { return inner_->ProbeIdentity(); }
  Pending<lifecycle::ResumeEvidence> Resume() override { return inner_->Resume(); }

 private:
  std::unique_ptr<lifecycle::EngineAdapter> inner_;
};

// Issue 13 defect 9: the install's outcome comes from the receiver, where the first live byte is
// written. A real refusal (the engine is not paused) returns to READY; a FailedPrecondition
// raised after rank 0 wrote its weights (the engine's fault hook) taints — it used to be read
// as "refused before mutation" because of its code.
TEST_F(EmbeddedAdapterTest, InstallOutcomeIsEstablishedWhereTheFirstLiveByteIsWritten) {
  Step();
  Step();
  versions_ = std::make_unique<controller::DirectoryVersionSource>(store_.get());
  auto claimed = std::make_unique<ClaimedPauseAdapter>(engine_->MakeAdapter({server_->url(), "m"}));
  ClaimedPauseAdapter* adapter = claimed.get();
  std::vector<controller::EngineHandle> engines(1);
  engines[0].name = "embedded";
  engines[0].adapter = std::move(claimed);
  engines[0].complete = engine_->MakeCompleter();
  controller::ServiceOptions so;
  so.state_dir = state_dir_;
  service_ = std::move(controller::ControllerService::Create(std::move(engines), versions_.get(), so)).value();
  const std::string init_digest = engine_->receiver()->LiveDigest(true)->content_digest.ToHex();

  adapter->claim_pause = true;
  auto refused = service_->WaitForUpdate(service_->RequestUpdate("m", "v1").value(), 60000);
  ASSERT_TRUE(refused.ok()) << refused.status().ToString();
  EXPECT_EQ((*refused)["engines"][0]["outcome"], "rejected") << refused->dump(2);
  EXPECT_EQ(service_->controller(0)->state(), lifecycle::State::kReady);
  EXPECT_EQ(engine_->receiver()->LiveDigest(true)->content_digest.ToHex(), init_digest) << "nothing was touched";

  adapter->claim_pause = false;
  engine_->receiver()->SetFailAfterFirstRankForTesting(true);
  auto failed = service_->WaitForUpdate(service_->RequestUpdate("m", "v1").value(), 60000);
  ASSERT_TRUE(failed.ok()) << failed.status().ToString();
  EXPECT_EQ((*failed)["engines"][0]["outcome"], "tainted") << failed->dump(2);
  EXPECT_NE((*failed)["engines"][0]["reason"].get<std::string>().find("failed_after_mutation"), std::string::npos)
      << failed->dump(2);
  EXPECT_EQ(service_->controller(0)->state(), lifecycle::State::kTainted);
  EXPECT_NE(engine_->receiver()->LiveDigest(true)->content_digest.ToHex(), init_digest) << "rank 0 did write";
  engine_->receiver()->SetFailAfterFirstRankForTesting(false);
}

TEST_F(EmbeddedAdapterTest, AbortByRolloutIdStopsItsEngineRequests) {
  auto adapter = engine_->MakeAdapter({server_->url(), "m"});
  auto complete = engine_->MakeCompleter();
  std::vector<int> prompt(16, 7);
  // Frozen engine (pause keep): the two samples queue and cannot finish before the abort.
  auto paused = AwaitPending(adapter->Pause(lifecycle::PauseMode::kKeep), 10000, "pause");
  ASSERT_TRUE(paused.ok()) << paused.status().ToString();
  auto long_one = std::async(std::launch::async, [&] {
    return complete(Json{{"prompt", prompt}, {"max_tokens", 490}, {"request_id", "roll-1"}, {"n", 2},
                         {"ignore_eos", true}});
  });
  // Wait until both samples are queued.
  for (int i = 0; i < 400; ++i) {
    const auto st = engine_->engine()->State();
    if (st.num_running + st.num_waiting >= 2) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  auto aborted = AwaitPending(adapter->AbortRequests({"roll-1"}), 10000, "abort");
  ASSERT_TRUE(aborted.ok()) << aborted.status().ToString();
  EXPECT_EQ(aborted->aborted, 2) << "both samples of the completion";
  auto r = long_one.get();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ((*r)["choices"][0]["finish_reason"], "abort");
  EXPECT_EQ((*r)["choices"][1]["finish_reason"], "abort");
  ASSERT_TRUE(AwaitPending(adapter->Resume(), 10000, "resume").ok());
  auto drain = AwaitPending(adapter->GetDrainStatus(), 10000, "drain");
  ASSERT_TRUE(drain.ok());
  EXPECT_TRUE(drain->idle());
}

}  // namespace
}  // namespace rc::adapters

namespace rc::adapters {
namespace {

// Policy mode recompute through the in-process adapter: a rollout frozen mid-generation spans the
// update; its spans put the boundary at the engine's token count at the freeze, and its tokens
// after it equal a from-scratch (salted) prefill of prompt + prefix under v1.
TEST_F(EmbeddedAdapterTest, RecomputeUpdateUnderARunningRolloutThroughTheInProcessAdapter) {
  Step();
  trainer::VersionStatus v1 = Step();
  // The test freezes the engine itself (pause keep) before it asks for the update: a periodic
  // identity check in that window would rightly taint an engine paused behind the controller's
  // back, so it is off (the check after each operation still runs).
  StartService(/*verify_interval_ms=*/0);
  engine::Engine* e = engine_->engine();
  const std::vector<int32_t> prompt = {3, 14, 15, 92, 65, 35, 89, 79};
  constexpr int kTokens = 200;
  // The tiny model generates 200 tokens in a few tens of ms: on a loaded machine the test thread
  // can be descheduled long enough for the rollout to finish before the freeze. Such an attempt
  // proves nothing either way, so it is retried (a fresh rollout id) a few times.
  int64_t k = 0;
  bool held = false;
  std::string id;
  Result<Json> out = Internal("no attempt ran");
  for (int attempt = 0; attempt < 5 && !held; ++attempt) {
    const int64_t base = e->Metrics().generation_tokens;
    std::promise<Result<Json>> reply;
    const std::string rollout_id = "long-" + std::to_string(attempt);
    std::thread client([&] {
      reply.set_value(service_->Rollout(Json{{"prompt_token_ids", prompt}, {"max_tokens", kTokens},
                                             {"temperature", 0.0}, {"ignore_eos", true}, {"rollout_id", rollout_id}}));
    });
    while (e->Metrics().generation_tokens - base < 4) std::this_thread::yield();
    ASSERT_TRUE(e->Pause(engine::PauseMode::kKeep).ok());  // freeze it where it is
    k = e->Metrics().generation_tokens - base;
    held = e->State().num_running == 1;
    if (!held) e->Resume();
    if (held) {
      auto requested = service_->RequestUpdate("m", "v1", lifecycle::PolicyMode::kRecompute);
      ASSERT_TRUE(requested.ok()) << requested.status().ToString();
      id = *requested;
    }
    // Bounded: were the update never to resume the frozen rollout, the test fails here (naming
    // the controller's state) instead of hanging until ctest's timeout.
    auto answered = reply.get_future();
    if (answered.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
      ADD_FAILURE() << "the frozen rollout was not answered within 60 s; controller state "
                    << lifecycle::StateName(service_->controller(0)->state());
      e->Resume();  // let the client thread finish so the test can end
    }
    out = answered.get();
    client.join();
  }
  ASSERT_TRUE(held) << "the rollout finished before it could be frozen, 5 times";
  auto done = service_->WaitForUpdate(id, 60000);
  ASSERT_TRUE(done.ok());
  ASSERT_EQ((*done)["engines"][0]["outcome"], "committed") << done->dump();
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  const Json& spans = (*out)["version_spans"];
  ASSERT_EQ(spans.size(), 2u) << spans.dump();
  EXPECT_EQ(spans[0]["to_token"], k);
  EXPECT_EQ(spans[1]["label"], "v1");
  EXPECT_EQ(spans[1]["kv"], "recomputed");
  EXPECT_EQ(spans[1]["content_digest"], Hex64(v1.content_digest));
  const auto tokens = (*out)["choices"][0]["token_ids"].get<std::vector<int32_t>>();
  ASSERT_EQ(tokens.size(), static_cast<size_t>(kTokens));
  engine::GenerateRequest ref;
  ref.prompt = prompt;
  ref.prompt.insert(ref.prompt.end(), tokens.begin(), tokens.begin() + k);
  ref.sampling.temperature = 0;
  ref.sampling.max_tokens = kTokens - k;
  ref.sampling.ignore_eos = true;
  ref.cache_salt = "from-scratch";
  auto stream = e->AddRequest(ref);
  ASSERT_TRUE(stream.ok());
  auto snap = (*stream)->Wait();
  EXPECT_EQ(snap.cached_tokens, 0);
  EXPECT_EQ(std::vector<int32_t>(tokens.begin() + k, tokens.end()), snap.tokens);
}

}  // namespace
}  // namespace rc::adapters
