// Fault tests of the engine's refit receiver (issue 13 #6 and #15), in one process: a real
// directory (MemoryStore behind its HTTP server), a real trainer Publisher over the shm transport
// and a real engine with its RefitReceiver. The faults are what a trainer or a crafted directory
// entry can hand a receiver: a NaN the trainer itself published (its digest is valid), a shard
// handle naming a FIFO (opening it for reading blocks until a writer appears), and a directory
// that accepts the connection and never answers.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <future>
#include <map>
#include <span>

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
using receiver::RefitReceiver;
using receiver::StageRequest;

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

class ReceiverFaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = directory::NewMemoryStore(SystemClock::Default());
    server_ = std::make_unique<directory::DirectoryServer>(store_.get(), directory::ServerOptions{});
    ASSERT_TRUE(server_->Start().ok());
    EngineOptions o;
    o.num_threads = 2;
    auto e = CreateEngine({"tiny", "dummy", 3}, o);
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
    server_->Stop();
  }

  // Publishes every tensor of the tiny model, whole, from one rank: bf16 of the synthetic W_step,
  // with element `element` of `bad_tensor` (if any) replaced by the bf16 bits `bad_bits`.
  void Publish(const std::string& version, int64_t step, const std::string& bad_tensor = "", size_t element = 0,
               uint16_t bad_bits = 0) {
    test_util::AddWholeModelShards(publisher_.get(), "tiny", version, step, &published_,
                                 [&](const std::string& tensor, std::vector<uint16_t>* bits) {
                                   if (tensor == bad_tensor) (*bits)[element] = bad_bits;
                                 });
    if (::testing::Test::HasFatalFailure()) return;
    auto r = publisher_->Publish(version);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_EQ(r->result.state, directory::VersionState::kCommitted);
  }

  StageRequest Stage(const std::string& version, int64_t timeout_ms = 20'000) const {
    StageRequest r;
    r.model = "m";
    r.version = version;
    r.directory = server_->url();
    r.timeout_ms = timeout_ms;
    return r;
  }

  std::string LiveDigest() { return receiver_->LiveDigest(true).value().content_digest.ToHex(); }

  void StageAndInstall(const std::string& version) {
    auto staged = receiver_->Stage(Stage(version));
    ASSERT_TRUE(staged.ok()) << staged.status().ToString();
    ASSERT_TRUE(engine_->Pause(PauseMode::kWait).ok());
    auto installed = receiver_->Install(version);
    engine_->Resume();
    ASSERT_EQ(installed.outcome, InstallOutcome::kInstalled) << installed.status.ToString();
    EXPECT_EQ(engine_->WeightVersion(), version);
  }

  std::unique_ptr<directory::DirectoryStore> store_;
  std::unique_ptr<directory::DirectoryServer> server_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<RefitReceiver> receiver_;
  std::unique_ptr<transport::Transport> transport_;
  std::unique_ptr<trainer::Publisher> publisher_;
  std::map<std::string, std::shared_ptr<transport::ShmBuffer>> published_;  // "version/tensor"
};

// #15: a NaN (or Inf) the trainer published has a valid digest; the stage refuses it, naming the
// source tensor and element, nothing is staged and nothing live changes. A clean version after
// it stages and installs.
TEST_F(ReceiverFaultTest, NonFiniteWeightsFailTheStageNamingTensorAndElement) {
  const std::string before = LiveDigest();
  struct Case {
    std::string version;
    uint16_t bits;
    std::string kind;
  } cases[] = {{"v1", 0x7fc0, "NaN"}, {"v2", 0x7f80, "+Inf"}, {"v3", 0xff80, "-Inf"}};
  for (const auto& c : cases) {
    Publish(c.version, 1, "model.layers.1.mlp.down_proj.weight", 77, c.bits);
    auto r = receiver_->Stage(Stage(c.version));
    ASSERT_FALSE(r.ok()) << c.version;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
    EXPECT_NE(r.status().message().find("tensor model.layers.1.mlp.down_proj.weight element 77 (index [0, 77]) is " +
                                        c.kind),
              std::string::npos)
        << r.status().message();
    EXPECT_EQ(receiver_->staged_version(), "");
  }
  ASSERT_TRUE(engine_->Pause(PauseMode::kWait).ok());
  auto refused = receiver_->Install("v1");
  EXPECT_EQ(refused.status.code(), StatusCode::kFailedPrecondition) << "nothing is staged";
  EXPECT_EQ(refused.outcome, InstallOutcome::kRefusedUntouched);
  engine_->Resume();
  EXPECT_EQ(engine_->WeightVersion(), "default");
  EXPECT_EQ(LiveDigest(), before) << "live weights untouched";
  Publish("v4", 2);
  StageAndInstall("v4");
  EXPECT_NE(LiveDigest(), before);
}

// The bf16 staging finite check runs 4 elements per 64-bit word inside the digest pass: a NaN in
// every lane position, in a tensor's last element and in a 1-D norm weight is refused too.
TEST_F(ReceiverFaultTest, Bf16FiniteCheckSeesEveryLanePosition) {
  auto config = refit::ModelPreset("tiny").value();
  int64_t norm_len = 0;
  auto specs = refit::ListSourceTensors(config);
  ASSERT_TRUE(specs.ok()) << specs.status().ToString();
  for (const auto& spec : *specs) {
    if (spec.name == "model.norm.weight") norm_len = spec.numel();
  }
  ASSERT_GT(norm_len, 4);
  struct Case {
    std::string tensor;
    size_t element;
  };
  std::vector<Case> cases;
  for (size_t e = 0; e < 4; ++e) cases.push_back({"model.layers.0.self_attn.k_proj.weight", e});
  cases.push_back({"model.norm.weight", static_cast<size_t>(norm_len - 1)});
  int v = 10;
  for (const Case& c : cases) {
    const std::string version = "v" + std::to_string(v++);
    Publish(version, 1, c.tensor, c.element, 0xffc1);
    auto r = receiver_->Stage(Stage(version));
    ASSERT_FALSE(r.ok()) << c.tensor << " element " << c.element;
    EXPECT_NE(r.status().message().find("tensor " + c.tensor + " element " + std::to_string(c.element)),
              std::string::npos)
        << r.status().message();
  }
}

// Issue 15: over shm at tp 1 every parameter's staged digest is computed while its bytes land
// (refit/landing_digest.h), from the staged bytes; a source byte that changed after the publish
// (a single low mantissa bit, so still finite) is refused at stage, in a plain tensor and in one
// that shares a fused parameter (gate_up_proj), and nothing live changes.
TEST_F(ReceiverFaultTest, LandingDigestRefusesASourceByteChangedAfterThePublish) {
  const std::string before = LiveDigest();
  Publish("v1", 1);
  auto ok = receiver_->Stage(Stage("v1"));
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  const size_t params = engine_->Parameters(0).all().size();
  EXPECT_EQ(ok->ToJson()["params_digested_while_landing"].get<size_t>(), params) << ok->ToJson().dump();
  int v = 2;
  for (const std::string tensor : {"model.layers.1.mlp.down_proj.weight", "model.layers.0.mlp.up_proj.weight"}) {
    const std::string version = "v" + std::to_string(v++);
    Publish(version, v);
    std::string key = version;
    key += "/";
    key += tensor;
    auto& buf = published_.at(key);
    ASSERT_GT(buf->size(), 1000u);
    buf->data()[1000] ^= std::byte{0x01};
    auto r = receiver_->Stage(Stage(version));
    ASSERT_FALSE(r.ok()) << tensor;
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status().ToString();
    EXPECT_NE(r.status().message().find("do not match the published digests"), std::string::npos)
        << r.status().message();
    EXPECT_NE(r.status().message().find(tensor), std::string::npos) << r.status().message();
    EXPECT_EQ(receiver_->staged_version(), "");
  }
  EXPECT_EQ(LiveDigest(), before) << "live weights untouched";
  StageAndInstall("v1");
  EXPECT_NE(LiveDigest(), before);
}

// #6: a committed entry whose shard handle names a FIFO (here one of this process's fds: a FIFO
// opened for reading, with no writer) fails the stage at once with a clear error; the next,
// legitimate stage succeeds.
TEST_F(ReceiverFaultTest, ShardHandleNamingAFifoFailsFastAndTheNextStageSucceeds) {
  Publish("v1", 1);
  const std::string fifo = ::testing::TempDir() + "/rc_receiver_fifo_" + std::to_string(::getpid());
  std::filesystem::remove(fifo);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  const int fifo_fd = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  ASSERT_GE(fifo_fd, 0);
  // The crafted entry: v1's tables with the first shard's data fd replaced by the FIFO's.
  refit::Manifest m = store_->Get("m", "v1").value();
  directory::PublishRequest evil;
  evil.model = "m";
  evil.version = "evil";
  evil.rank = 0;
  evil.expected_ranks = 1;
  evil.lease_ttl_ms = 60'000;
  evil.tables = m.tables;
  std::string& handle = evil.tables[0].shards[0].handle;
  {
    // ":fd=<digits>:" -> ":fd=<the FIFO's fd>:" (plain string ops: GCC 12 warns falsely inside
    // std::regex under the sanitizer builds).
    const size_t at = handle.find(":fd=");
    ASSERT_NE(at, std::string::npos) << handle;
    const size_t end = handle.find(':', at + 4);
    ASSERT_NE(end, std::string::npos) << handle;
    handle = handle.substr(0, at) + ":fd=" + std::to_string(fifo_fd) + handle.substr(end);
  }
  ASSERT_NE(handle.find(":fd=" + std::to_string(fifo_fd) + ":"), std::string::npos) << handle;
  ASSERT_TRUE(store_->Publish(evil).ok());

  auto t0 = Clock::now();
  auto pending = std::async(std::launch::async, [&] { return receiver_->Stage(Stage("evil", 60'000)); });
  if (pending.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
    ADD_FAILURE() << "the stage of a FIFO handle blocked for 5 s";
    const int w = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);  // unblock the stuck open
    if (w >= 0) ::close(w);
  }
  auto r = pending.get();
  const double s = SecondsSince(t0);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("is a FIFO or pipe, not a memfd"), std::string::npos) << r.status().message();
  EXPECT_LT(s, 5.0);
  StageAndInstall("v1");
  ::close(fifo_fd);
  std::filesystem::remove(fifo);
}

// #6: one stuck stage does not hold the others without bound. A stage whose directory accepts
// the connection and never answers ends at its own deadline (not the client's 30 s); a stage
// asked for meanwhile fails within its own (shorter) deadline naming the stage in progress, and
// a stage after both succeeds.
TEST_F(ReceiverFaultTest, AStuckStageEndsAtItsDeadlineAndDoesNotHoldOthers) {
  Publish("v1", 1);
  const int hole = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(hole, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(hole, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(hole, 16), 0);  // the kernel completes connections; nobody ever reads them
  socklen_t len = sizeof addr;
  ASSERT_EQ(::getsockname(hole, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  StageRequest stuck = Stage("v1", 2'500);
  stuck.directory = "http://127.0.0.1:" + std::to_string(ntohs(addr.sin_port));

  auto t0 = Clock::now();
  auto first = std::async(std::launch::async, [&] { return receiver_->Stage(stuck); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the first stage holds the receiver
  auto t1 = Clock::now();
  auto second = receiver_->Stage(Stage("v1", 700));
  const double s2 = SecondsSince(t1);
  EXPECT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kUnavailable) << second.status().ToString();
  EXPECT_NE(second.status().message().find("the stage of v1 has been running for"), std::string::npos)
      << second.status().message();
  EXPECT_LT(s2, 2.0) << "the second stage waits at most its own deadline";
  if (first.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    ADD_FAILURE() << "the stuck stage did not end within 10 s of a 2.5 s deadline";
  }
  auto r1 = first.get();
  const double s1 = SecondsSince(t0);
  EXPECT_FALSE(r1.ok());
  EXPECT_LT(s1, 2.5 + 2.0) << "discovery runs under the stage's deadline: " << r1.status().ToString();
  ::close(hole);
  StageAndInstall("v1");
}

}  // namespace
}  // namespace rc::engine

namespace rc::engine {
namespace {

// Issue 15: nothing rebuilt per refit. The transport and the imported descriptors are reused
// while the source topology is unchanged, rebuilt when it changes (new handles), and dropped when
// a stage fails; every reuse still installs bytes that match the published digests.
TEST_F(ReceiverFaultTest, TransportAndImportsAreReusedWhileTheSourceTopologyIsUnchanged) {
  Publish("v1", 1);
  auto first = receiver_->Stage(Stage("v1"));
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(first->ToJson()["transport_cached"], false);
  auto again = receiver_->Stage(Stage("v1"));
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->ToJson()["transport_cached"], true);
  EXPECT_EQ(again->ToJson()["transports_built"], 1);
  ASSERT_TRUE(engine_->Pause(PauseMode::kWait).ok());
  auto installed = receiver_->Install("v1");
  engine_->Resume();
  ASSERT_EQ(installed.outcome, InstallOutcome::kInstalled) << installed.status.ToString();
  EXPECT_EQ(installed.report.live_content_digest.ToHex(), again->content_digest.ToHex());
  EXPECT_EQ(LiveDigest(), again->content_digest.ToHex());

  Publish("v2", 2);  // new shm segments: new handles, a new topology
  auto v2 = receiver_->Stage(Stage("v2"));
  ASSERT_TRUE(v2.ok()) << v2.status().ToString();
  EXPECT_EQ(v2->ToJson()["transport_cached"], false);
  EXPECT_EQ(v2->ToJson()["transports_built"], 2);

  Publish("v3", 3, "model.norm.weight", 5, 0x7fc0);  // a NaN: the stage fails after the pull
  ASSERT_FALSE(receiver_->Stage(Stage("v3")).ok());
  auto retry = receiver_->Stage(Stage("v3"));
  ASSERT_FALSE(retry.ok());
  auto v2_again = receiver_->Stage(Stage("v2"));
  ASSERT_TRUE(v2_again.ok()) << v2_again.status().ToString();
  EXPECT_EQ(v2_again->ToJson()["transport_cached"], false) << "a failed stage must drop the cached imports";
  StageAndInstall("v2");
  EXPECT_EQ(LiveDigest(), v2->content_digest.ToHex());
}


// Install by swap (docs/refit.md): a full bf16 refit into the bf16 engine lands as bytes (no
// transform), the staged image becomes the live storage (no live byte copied) and the retired live
// storage is the next stage's staging (no reallocation). The live digest recomputed from live
// memory equals the manifest's, the staged and the live memory are read-only (a write faults), and
// a fault after rank 0 swapped is reported as a failure after mutation.
TEST_F(ReceiverFaultTest, FullInstallSwapsTheStagedImageInAndProvesItsDigest) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  ASSERT_EQ(engine_->weight_dtype(), DType::kBF16);
  Publish("v1", 1);
  auto staged = receiver_->Stage(Stage("v1"));
  ASSERT_TRUE(staged.ok()) << staged.status().ToString();
  EXPECT_EQ(staged->ToJson()["shadow_allocated"], true);
  std::span<std::byte> norm = receiver_->StagedBytesForTesting(0, "model.norm.weight");
  ASSERT_FALSE(norm.empty());
  // Between the staged digest and the install, nothing can change the staged bytes.
  EXPECT_DEATH({ norm[0] ^= std::byte{1}; }, "");
  const std::byte* staged_at = norm.data();
  ASSERT_TRUE(engine_->Pause(PauseMode::kWait).ok());
  auto installed = receiver_->Install("v1");
  engine_->Resume();
  ASSERT_EQ(installed.outcome, InstallOutcome::kInstalled) << installed.status.ToString();
  EXPECT_EQ(installed.report.install_mode, InstallMode::kSwap);
  const Parameter* live = engine_->Parameters(0).Find("model.norm.weight");
  EXPECT_EQ(live->bytes(), staged_at) << "the staged storage itself became the live storage";
  EXPECT_TRUE(live->storage->read_only());
  EXPECT_DEATH({ live->bytes()[0] ^= std::byte{1}; }, "");
  EXPECT_EQ(installed.report.live_content_digest.ToHex(), staged->content_digest.ToHex());
  EXPECT_EQ(LiveDigest(), staged->content_digest.ToHex()) << "fresh digest of live memory";

  // The next stage re-uses the retired live storage as its staging: nothing is allocated.
  Publish("v2", 2);
  auto v2 = receiver_->Stage(Stage("v2"));
  ASSERT_TRUE(v2.ok()) << v2.status().ToString();
  EXPECT_EQ(v2->ToJson()["shadow_allocated"], false);
  EXPECT_NE(v2->content_digest.ToHex(), staged->content_digest.ToHex());
  EXPECT_EQ(LiveDigest(), staged->content_digest.ToHex()) << "staging v2 does not touch the live v1";
  ASSERT_TRUE(engine_->Pause(PauseMode::kWait).ok());
  auto v2_installed = receiver_->Install("v2");
  engine_->Resume();
  ASSERT_EQ(v2_installed.outcome, InstallOutcome::kInstalled) << v2_installed.status.ToString();
  EXPECT_EQ(v2_installed.report.install_mode, InstallMode::kSwap);
  EXPECT_EQ(LiveDigest(), v2->content_digest.ToHex());
  // The swap fault: rank 0 swapped, then the install fails: after mutation, never "untouched".
  Publish("v3", 3);
  ASSERT_TRUE(receiver_->Stage(Stage("v3")).ok());
  receiver_->SetFailAfterFirstRankForTesting(true);
  ASSERT_TRUE(engine_->Pause(PauseMode::kWait).ok());
  auto failed = receiver_->Install("v3");
  engine_->Resume();
  receiver_->SetFailAfterFirstRankForTesting(false);
  EXPECT_EQ(failed.outcome, InstallOutcome::kFailedAfterMutation) << failed.status.ToString();
}

// An f32 engine fed bf16 weights: the transform (bf16 -> f32 widening) stays, the install still
// swaps (the staging is f32 like the live weights), and the live digest maps back to the bf16 bits.
TEST_F(ReceiverFaultTest, F32EngineWidensAtStageAndStillSwaps) {
  EngineOptions o;
  o.num_threads = 2;
  auto e = CreateEngine({"tiny", "dummy", 3, "f32"}, o);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  receiver_.reset();
  engine_ = std::move(e).value();
  receiver_ = std::make_unique<RefitReceiver>(engine_.get(), 2);
  ASSERT_EQ(engine_->weight_dtype(), DType::kF32);
  Publish("v1", 1);
  auto staged = receiver_->Stage(Stage("v1"));
  ASSERT_TRUE(staged.ok()) << staged.status().ToString();
  ASSERT_TRUE(engine_->Pause(PauseMode::kWait).ok());
  auto installed = receiver_->Install("v1");
  engine_->Resume();
  ASSERT_EQ(installed.outcome, InstallOutcome::kInstalled) << installed.status.ToString();
  EXPECT_EQ(installed.report.install_mode, InstallMode::kSwap);
  EXPECT_EQ(installed.report.bytes_installed, 2 * staged->bytes_pulled);
  EXPECT_EQ(LiveDigest(), staged->content_digest.ToHex());
}

// A version with a tensor the engine's model does not have (another architecture, more layers, a
// stray name) is refused before anything moves, naming the tensor (before: every byte was pulled,
// then a 500 "staged bytes do not match the published digests"); and a refused stage leaves what
// was staged installable.
TEST_F(ReceiverFaultTest, AVersionWithATensorTheModelLacksIsRefusedBeforeThePullAndKeepsTheStaged) {
  Publish("v1", 1);
  auto staged = receiver_->Stage(Stage("v1"));
  ASSERT_TRUE(staged.ok()) << staged.status().ToString();

  test_util::AddWholeModelShards(publisher_.get(), "tiny", "v2", 2, &published_);
  std::vector<uint16_t> extra(64, 0x3f80);
  auto buf = std::make_shared<transport::ShmBuffer>(transport::ShmBuffer::Create(extra.size() * 2).value());
  std::memcpy(buf->data(), extra.data(), extra.size() * 2);
  trainer::ShardSource s;
  s.name = "model.layers.7.mlp.up_proj.weight";
  s.dtype = refit::DType::kBF16;
  s.global_shape = {64};
  s.offset = {0};
  s.local_shape = {64};
  s.data = buf->data();
  s.keep_alive = buf;
  ASSERT_TRUE(publisher_->AddShard("v2", std::move(s)).ok());
  auto r = publisher_->Publish("v2");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  auto refused = receiver_->Stage(Stage("v2"));
  ASSERT_FALSE(refused.ok());
  // InvalidArgument from the check before the pull (after it, a digest mismatch is DataLoss).
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument) << refused.status().ToString();
  EXPECT_NE(refused.status().message().find("publishes tensor model.layers.7.mlp.up_proj.weight"), std::string::npos)
      << refused.status().message();
  // Unknown version: refused too. v1 is still what an install takes.
  EXPECT_EQ(receiver_->Stage(Stage("v9")).status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(engine_->Pause(PauseMode::kWait).ok());
  auto installed = receiver_->Install("v1");
  engine_->Resume();
  ASSERT_EQ(installed.outcome, InstallOutcome::kInstalled) << installed.status.ToString();
  EXPECT_EQ(LiveDigest(), staged->content_digest.ToHex());
}

}  // namespace
}  // namespace rc::engine
