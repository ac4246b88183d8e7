// End-to-end: a directory (in this process, over HTTP) and `trainer serve` with 2 fsdp ranks over
// shm in a child process. The test waits for v0 and v1 (made by POST /step) to commit, imports
// every shard descriptor with the shm transport, and checks the bytes against the deterministic
// reference and the digests against the manifest; SIGTERM stops the trainer cleanly.
#include <gtest/gtest.h>
#include <httplib.h>

#include <chrono>

#include "rolloutcore/base/clock.h"
#include "rolloutcore/base/json.h"
#include "rolloutcore/directory/client.h"
#include "rolloutcore/directory/memory_store.h"
#include "rolloutcore/directory/server.h"
#include "rolloutcore/refit/layouts.h"
#include "rolloutcore/refit/manifest.h"
#include "rolloutcore/trainer/fp8_parts.h"
#include "rolloutcore/trainer/synthetic_trainer.h"
#include "trainer/read_shards.h"
#include "trainer/trainer_process.h"

namespace rc::trainer {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kSeed = 5;
constexpr float kLr = 2e-3f;

class TrainerE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = directory::NewMemoryStore(SystemClock::Default());
    server_ = std::make_unique<directory::DirectoryServer>(store_.get(), directory::ServerOptions{});
    ASSERT_TRUE(server_->Start().ok());
    client_ = std::make_unique<directory::DirectoryClient>(server_->url());
  }
  void TearDown() override { server_->Stop(); }

  // Checks every shard of `version` against bf16(W_k) and its digest.
  void CheckVersion(transport::Transport& reader, const std::string& version) {
    auto m = client_->Get("tiny", version);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    EXPECT_EQ(m->expected_ranks, 2);
    const auto config = *refit::ModelPreset("tiny");
    const auto specs = *refit::ListSourceTensors(config);
    ASSERT_EQ(m->tables.size(), specs.size());
    for (const refit::ShardTable& t : m->tables) {
      for (const refit::ShardInfo& s : t.shards) EXPECT_EQ(s.handle.rfind("shm:v1:", 0), 0u) << s.handle;
    }
    const auto published = testing::ReadManifest(reader, *m);
    const int64_t step = *ParseVersionLabel(version);
    for (const refit::TensorSpec& s : specs) {
      const auto want = ComputeBf16({kSeed, kLr}, refit::TensorSpec{s.name, refit::DType::kBF16, s.shape},
                                    refit::FullBox(s.shape), step);
      EXPECT_EQ(published.at(s.name), want) << version << " " << s.name;
    }
  }

  std::unique_ptr<directory::DirectoryStore> store_;
  std::unique_ptr<directory::DirectoryServer> server_;
  std::unique_ptr<directory::DirectoryClient> client_;
};

TEST_F(TrainerE2eTest, TwoShmRanksPublishV0AndV1ThatReadBackExactly) {
  auto trainer = testing::TrainerProcess::Spawn({"--model", "tiny", "--layout", "fsdp:2", "--transport", "shm",
                                                 "--directory", server_->url(), "--seed", std::to_string(kSeed),
                                                 "--lr", "0.002"});
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  auto v0 = directory::WaitForVersion(*client_, "tiny", "v0", 30'000);
  ASSERT_TRUE(v0.ok()) << v0.status().ToString();
  EXPECT_EQ(v0->seq, 1u);

  // POST /step makes v1.
  const std::string url = (*trainer)->url();
  httplib::Client http(url);
  auto res = http.Post("/step", "", "application/json");
  ASSERT_TRUE(res) << "POST /step to " << url;
  ASSERT_EQ(res->status, 200) << res->body;
  auto step = ParseJson(res->body);
  ASSERT_TRUE(step.ok());
  EXPECT_EQ(step->at("version"), "v1");
  EXPECT_EQ(step->at("state"), "COMMITTED");
  auto v1 = directory::WaitForVersion(*client_, "tiny", "v1", 30'000);
  ASSERT_TRUE(v1.ok()) << v1.status().ToString();
  EXPECT_NE(v1->content_digest, v0->content_digest);

  auto reader = CreateTrainerTransport("shm");
  ASSERT_TRUE(reader.ok());
  CheckVersion(**reader, "v0");
  CheckVersion(**reader, "v1");

  // GET /status reports both versions; bad requests get typed errors.
  res = http.Get("/status");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200);
  auto status = ParseJson(res->body);
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->at("ranks"), 2);
  ASSERT_EQ(status->at("versions").size(), 2u);
  EXPECT_EQ(status->at("versions")[1].at("committed"), true);
  EXPECT_EQ(http.Post("/release", "{\"version\": \"v7\"}", "application/json")->status, 404);
  EXPECT_EQ(http.Post("/release", "{bad json", "application/json")->status, 400);

  // POST /release v0: gone from the directory, and its memory is deregistered.
  res = http.Post("/release", "{\"version\": \"v0\"}", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200) << res->body;
  EXPECT_EQ(client_->Get("tiny", "v0").status().code(), StatusCode::kNotFound);

  // SIGTERM: a clean exit that releases the remaining versions.
  const int exit_status = (*trainer)->SignalAndWait(SIGTERM, 10s);
  ASSERT_NE(exit_status, -1) << "trainer did not exit after SIGTERM";
  EXPECT_TRUE(WIFEXITED(exit_status));
  EXPECT_EQ(WEXITSTATUS(exit_status), 0);
  EXPECT_EQ(client_->Get("tiny", "v1").status().code(), StatusCode::kNotFound);
}

TEST_F(TrainerE2eTest, TimedStepsAndKeepReleaseOldVersions) {
  auto trainer = testing::TrainerProcess::Spawn({"--model", "tiny", "--layout", "fsdp:2", "--directory",
                                                 server_->url(), "--seed", std::to_string(kSeed), "--lr", "0.002",
                                                 "--steps", "3", "--interval-ms", "50", "--keep", "2"});
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  ASSERT_TRUE((*trainer)->WaitForLine("published v3", 30s));
  auto committed = client_->List("tiny");
  ASSERT_TRUE(committed.ok());
  std::vector<std::string> labels;
  for (const auto& v : *committed) labels.push_back(v.version);
  EXPECT_EQ(labels, (std::vector<std::string>{"v2", "v3"}));
  auto reader = CreateTrainerTransport("shm");
  ASSERT_TRUE(reader.ok());
  CheckVersion(**reader, "v3");
  const int exit_status = (*trainer)->SignalAndWait(SIGINT, 10s);
  ASSERT_NE(exit_status, -1);
  EXPECT_EQ(WEXITSTATUS(exit_status), 0);
}

}  // namespace
}  // namespace rc::trainer

namespace rc::trainer {
namespace {

// `trainer serve --fp8-parts` (docs/trainer.md "FP8 parts"): an fsdp:40 trainer, whose row splits
// cut through the tiny model's scale groups and leave some ranks without a row of k_proj (32 rows),
// publishes parts that add up to the image of each fused parameter quantized whole from bf16(W_0);
// a bad quantization name is refused at the command line.
TEST_F(TrainerE2eTest, Fp8PartsAddUpToTheImageOfTheWholeWeights) {
  auto trainer = testing::TrainerProcess::Spawn({"--model", "tiny", "--layout", "fsdp:40", "--transport", "shm",
                                                 "--directory", server_->url(), "--seed", std::to_string(kSeed),
                                                 "--lr", "0.002", "--fp8-parts", "fp8_per_tensor,fp8_per_block"});
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  ASSERT_TRUE(directory::WaitForVersion(*client_, "tiny", "v0", 30'000).ok());
  auto m = client_->Get("tiny", "v0");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(refit::PublishedFp8Quantizations(*m), (std::vector<std::string>{"fp8_per_block", "fp8_per_tensor"}));
  const auto specs = *refit::ListSourceTensors(*refit::ModelPreset("tiny"));
  std::vector<std::vector<uint16_t>> whole;
  std::vector<Fp8ShardInput> inputs;
  whole.reserve(specs.size());
  inputs.reserve(specs.size());
  for (const refit::TensorSpec& s : specs) {
    whole.push_back(ComputeBf16({kSeed, kLr}, refit::TensorSpec{s.name, refit::DType::kBF16, s.shape},
                                refit::FullBox(s.shape), 0));
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    inputs.push_back({specs[i].name, refit::DType::kBF16, specs[i].shape, refit::FullBox(specs[i].shape),
                      whole[i].data()});
  }
  for (const char* q : {"fp8_per_tensor", "fp8_per_block"}) {
    auto image = refit::PublishedFp8Image(*m, q);
    ASSERT_TRUE(image.ok()) << image.status().ToString();
    auto parts = Fp8ShardParts(inputs, q);
    ASSERT_TRUE(parts.ok()) << parts.status().ToString();
    refit::Fp8Image want;
    for (size_t i = 0; i < specs.size(); ++i) {
      if ((*parts)[i]) want[refit::Fp8ParameterOf(specs[i].name)->param] += *(*parts)[i];
    }
    ASSERT_EQ(image->size(), want.size()) << q;
    EXPECT_EQ(*image, want) << q;
  }
  const int exit_status = (*trainer)->SignalAndWait(SIGTERM, 10s);
  EXPECT_TRUE(WIFEXITED(exit_status));

  auto bad = testing::TrainerProcess::Spawn({"--model", "tiny", "--directory", server_->url(), "--fp8-parts", "int8"});
  EXPECT_FALSE(bad.ok());
}

}  // namespace
}  // namespace rc::trainer
