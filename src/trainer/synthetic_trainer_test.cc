#include "rolloutcore/trainer/synthetic_trainer.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <vector>

#include "rolloutcore/base/clock.h"
#include "rolloutcore/directory/memory_store.h"
#include "rolloutcore/formats/safetensors.h"
#include "rolloutcore/refit/digest.h"
#include "rolloutcore/refit/layouts.h"
#include "rolloutcore/trainer/export.h"
#include "rolloutcore/transport/shm.h"
#include "testing/temp_dir.h"
#include "trainer/read_shards.h"

namespace rc::trainer {
namespace {

using refit::Box;
using refit::TensorSpec;

TensorSpec Spec(std::string name, refit::Shape shape) { return TensorSpec{std::move(name), refit::DType::kBF16, std::move(shape)}; }

TEST(SyntheticWeightsTest, AdvancingStepByStepEqualsComputingFromScratch) {
  const SyntheticWeights w{7, 1e-2f};
  const TensorSpec spec = Spec("model.layers.0.mlp.up_proj.weight", {6, 10});
  const Box box{{1, 2}, {4, 7}};
  std::vector<float> incremental(28);
  ComputeMaster(w, spec, box, 0, incremental.data());
  for (int64_t k = 0; k < 5; ++k) AdvanceMaster(w, spec, box, k, incremental.data());
  std::vector<float> scratch(28);
  ComputeMaster(w, spec, box, 5, scratch.data());
  for (size_t i = 0; i < 28; ++i) {  // the same bits, not merely equal values
    EXPECT_EQ(std::bit_cast<uint32_t>(incremental[i]), std::bit_cast<uint32_t>(scratch[i])) << i;
  }

  // A sub-box holds exactly the elements of the full tensor at the same global positions.
  std::vector<float> full(60);
  ComputeMaster(w, spec, refit::FullBox(spec.shape), 5, full.data());
  for (int64_t r = 0; r < 4; ++r) {
    for (int64_t c = 0; c < 7; ++c) {
      EXPECT_EQ(scratch[static_cast<size_t>(r * 7 + c)], full[static_cast<size_t>((r + 1) * 10 + c + 2)]);
    }
  }
  // The step changes the weights, by about lr.
  std::vector<float> w4(28);
  ComputeMaster(w, spec, box, 4, w4.data());
  double max_delta = 0;
  for (size_t i = 0; i < 28; ++i) max_delta = std::max(max_delta, std::fabs(double(scratch[i]) - w4[i]));
  EXPECT_GT(max_delta, 1e-3);
  EXPECT_LT(max_delta, 4e-2);
}

TEST(SyntheticWeightsTest, InitialisationStatisticsAndSeeds) {
  const TensorSpec dense = Spec("model.embed_tokens.weight", {256, 64});
  const TensorSpec norm = Spec("model.layers.1.input_layernorm.weight", {64});
  std::vector<float> d(size_t{256} * 64), n(64), other(size_t{256} * 64);
  ComputeMaster({1, 1e-3f}, dense, refit::FullBox(dense.shape), 0, d.data());
  ComputeMaster({1, 1e-3f}, norm, refit::FullBox(norm.shape), 0, n.data());
  ComputeMaster({2, 1e-3f}, dense, refit::FullBox(dense.shape), 0, other.data());
  double sum = 0, sq = 0;
  for (float v : d) {
    sum += v;
    sq += double(v) * v;
  }
  const double mean = sum / double(d.size());
  const double stdev = std::sqrt(sq / double(d.size()) - mean * mean);
  EXPECT_NEAR(mean, 0.0, 1e-3);
  EXPECT_NEAR(stdev, kInitStd, 2e-3);
  for (float v : n) EXPECT_NEAR(v, 1.0f, 0.08f);
  EXPECT_NE(std::memcmp(d.data(), other.data(), d.size() * sizeof(float)), 0);

  const std::vector<uint16_t> bf = ComputeBf16({1, 1e-3f}, dense, Box{{3, 0}, {1, 64}}, 0);
  for (size_t i = 0; i < 64; ++i) EXPECT_EQ(bf[i], refit::F32ToBf16Bits(d[size_t{3} * 64 + i]));
}

TEST(SyntheticWeightsTest, VersionLabels) {
  EXPECT_EQ(VersionLabel(12), "v12");
  EXPECT_EQ(*ParseVersionLabel("v0"), 0);
  EXPECT_EQ(*ParseVersionLabel("v42"), 42);
  for (const char* bad : {"", "v", "42", "v-1", "v1x", "V1"}) {
    EXPECT_EQ(ParseVersionLabel(bad).status().code(), StatusCode::kInvalidArgument) << bad;
  }
}

using testing::ReadManifest;

class SyntheticTrainerTest : public ::testing::Test {
 protected:
  void SetUp() override { store_ = directory::NewMemoryStore(&clock_); }

  SyntheticTrainerOptions Options(std::string_view layout, std::string name) {
    SyntheticTrainerOptions o;
    o.config = *refit::ModelPreset("tiny");
    o.layout = *refit::ParseTrainerLayout(layout);
    o.model_name = std::move(name);
    o.transport = "shm";
    o.weights = {11, 5e-3f};
    return o;
  }

  ManualClock clock_;
  std::unique_ptr<directory::DirectoryStore> store_;
};

TEST_F(SyntheticTrainerTest, PublishedVersionsMatchTheReferenceAndTheExport) {
  auto t = SyntheticTrainer::Create(Options("fsdp:2", "tiny"), store_.get());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  for (int k = 0; k < 3; ++k) {
    auto v = (*t)->Step();
    ASSERT_TRUE(v.ok()) << v.status().ToString();
    EXPECT_EQ(v->version, VersionLabel(k));
    EXPECT_EQ(v->state, "COMMITTED");
    EXPECT_EQ(v->ranks_published, 2);
    EXPECT_EQ(v->commit_seq, static_cast<uint64_t>(k + 1));
  }
  auto reader = CreateTrainerTransport("shm");
  ASSERT_TRUE(reader.ok());
  const auto config = *refit::ModelPreset("tiny");
  const auto specs = *refit::ListSourceTensors(config);
  auto m = store_->Get("tiny", "v2");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  ASSERT_EQ(m->tables.size(), specs.size());
  const auto published = ReadManifest(**reader, *m);

  // Against the from-scratch reference.
  for (const TensorSpec& s : specs) {
    const auto want = ComputeBf16({11, 5e-3f}, Spec(s.name, s.shape), refit::FullBox(s.shape), 2);
    ASSERT_EQ(published.at(s.name), want) << s.name;
  }

  // Against the export: bytes identical, digests identical.
  const rc::testing::TempDir scratch("rc_trainer_export_");
  const std::string dir = scratch / "v2";
  auto ex = ExportVersion(config, {11, 5e-3f}, 2, dir);
  ASSERT_TRUE(ex.ok()) << ex.status().ToString();
  auto file = formats::SafetensorsFile::Open(ex->weights_path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  ASSERT_EQ((*file)->header().tensors.size(), specs.size());
  for (const TensorSpec& s : specs) {
    const formats::TensorEntry* e = (*file)->header().Find(s.name);
    ASSERT_NE(e, nullptr) << s.name;
    EXPECT_EQ(e->dtype, formats::DType::kBF16);
    EXPECT_EQ(e->shape, s.shape);
    auto bytes = (*file)->Bytes(*e);
    const auto& want = published.at(s.name);
    ASSERT_EQ(bytes.size(), want.size() * 2) << s.name;
    EXPECT_EQ(std::memcmp(bytes.data(), want.data(), bytes.size()), 0) << s.name;
  }
  auto digests = refit::TensorDigestsFromShards(*m);
  ASSERT_TRUE(digests.ok());
  EXPECT_EQ(ex->digests, *digests);
  EXPECT_EQ(ex->content_digest, m->content_digest);
  EXPECT_EQ((*file)->header().metadata.at("rolloutcore.version"), "v2");

  // config.json reads back as the same architecture.
  auto back = refit::LoadModelConfigFile(ex->config_path);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->architecture, config.architecture);
  EXPECT_EQ(back->hidden_size, config.hidden_size);
  EXPECT_EQ(back->intermediate_size, config.intermediate_size);
  EXPECT_EQ(back->num_hidden_layers, config.num_hidden_layers);
  EXPECT_EQ(back->num_attention_heads, config.num_attention_heads);
  EXPECT_EQ(back->num_key_value_heads, config.num_key_value_heads);
  EXPECT_EQ(back->head_dim, config.head_dim);
  EXPECT_EQ(back->vocab_size, config.vocab_size);
  EXPECT_EQ(back->tie_word_embeddings, config.tie_word_embeddings);
  EXPECT_EQ(back->rope_theta, config.rope_theta);
  EXPECT_EQ(back->dtype, refit::DType::kBF16);
  EXPECT_EQ(*refit::ListSourceTensors(*back), specs);
  std::filesystem::remove_all(dir);
}

TEST_F(SyntheticTrainerTest, ConfigJsonRoundTripsForEveryPreset) {
  for (std::string_view name : {"tiny", "tiny-llama", "tiny-qwen2", "tiny-moe", "qwen3-8b"}) {
    auto c = refit::ModelPreset(name);
    ASSERT_TRUE(c.ok()) << name;
    const Json j = ModelConfigToJson(*c);
    EXPECT_EQ(j.at("torch_dtype"), "bfloat16");
    EXPECT_TRUE(j.at("architectures").is_array());
    auto back = refit::ParseModelConfigJson(j, name);
    ASSERT_TRUE(back.ok()) << name << ": " << back.status().ToString();
    EXPECT_EQ(*refit::ListSourceTensors(*back), *refit::ListSourceTensors(*c)) << name;
    EXPECT_EQ(back->is_moe(), c->is_moe()) << name;
    EXPECT_EQ(back->attention_bias, c->attention_bias) << name;
    EXPECT_EQ(back->rope_scaling.type, c->rope_scaling.type) << name;
  }
}

TEST_F(SyntheticTrainerTest, EveryLayoutPublishesTheSameContent) {
  uint64_t digest = 0;
  for (auto [layout, name] : {std::pair{"fsdp:3", "a"}, {"tp:2", "b"}, {"replicated:2", "c"}, {"fsdp:1", "d"}}) {
    auto o = Options(layout, name);
    o.first_step = 1;  // the first version is v1, computed from scratch
    auto t = SyntheticTrainer::Create(o, store_.get());
    ASSERT_TRUE(t.ok()) << layout << ": " << t.status().ToString();
    auto v = (*t)->Step();
    ASSERT_TRUE(v.ok()) << layout << ": " << v.status().ToString();
    EXPECT_EQ(v->version, "v1");
    EXPECT_EQ(v->state, "COMMITTED") << layout;
    if (digest == 0) digest = v->content_digest;
    EXPECT_EQ(v->content_digest, digest) << layout;
  }
}

TEST_F(SyntheticTrainerTest, KeepReleasesOldVersionsAndFailRankNeverCommits) {
  auto o = Options("fsdp:2", "keep");
  o.keep = 2;
  auto t = SyntheticTrainer::Create(o, store_.get());
  ASSERT_TRUE(t.ok());
  for (int k = 0; k < 4; ++k) ASSERT_TRUE((*t)->Step().ok());
  EXPECT_EQ(store_->Get("keep", "v0").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(store_->Get("keep", "v1").status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(store_->Get("keep", "v2").ok());
  EXPECT_TRUE(store_->Get("keep", "v3").ok());
  const Json status = (*t)->StatusJson();
  ASSERT_EQ(status.at("versions").size(), 4u);
  EXPECT_EQ(status.at("versions")[0].at("state"), "RELEASED");
  EXPECT_EQ(status.at("versions")[3].at("state"), "COMMITTED");
  EXPECT_EQ((*t)->Release("v0").code(), StatusCode::kNotFound);
  ASSERT_TRUE((*t)->Release("v2").ok());
  EXPECT_EQ(store_->Get("keep", "v2").status().code(), StatusCode::kNotFound);
  ASSERT_TRUE((*t)->Shutdown(/*release_in_directory=*/true).ok());
  EXPECT_EQ(store_->Get("keep", "v3").status().code(), StatusCode::kNotFound);
  EXPECT_EQ((*t)->Step().status().code(), StatusCode::kFailedPrecondition);

  auto f = Options("fsdp:2", "failing");
  f.fail_rank = 1;
  auto ft = SyntheticTrainer::Create(f, store_.get());
  ASSERT_TRUE(ft.ok());
  auto v = (*ft)->Step();
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ(v->state, "STAGING");
  EXPECT_EQ(v->ranks_published, 1);
  EXPECT_EQ(store_->Get("failing", "v0").status().code(), StatusCode::kFailedPrecondition);
  auto info = store_->GetInfo("failing", "v0");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->published_ranks, std::vector<int32_t>{0});
}

// The memfds this process holds (each ShmBuffer is one).
int OpenMemfds() {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const auto target = std::filesystem::read_symlink(e.path(), ec);
    if (!ec && target.string().rfind("/memfd:", 0) == 0) ++n;
  }
  return n;
}

// --keep frees the memory of what it releases: the trainer's buffers stay at `keep` versions'
// worth however many steps run (a map of every version's buffer, kept for fault injection, once
// held them all), and a released version's bytes can no longer be corrupted (they are gone).
TEST_F(SyntheticTrainerTest, KeepFreesTheBuffersOfReleasedVersions) {
  auto o = Options("fsdp:2", "keepmem");
  o.keep = 2;
  auto t = SyntheticTrainer::Create(o, store_.get());
  ASSERT_TRUE(t.ok());
  for (int k = 0; k < 2; ++k) ASSERT_TRUE((*t)->Step().ok());
  const int steady = OpenMemfds();
  for (int k = 2; k < 7; ++k) {
    ASSERT_TRUE((*t)->Step().ok());
    EXPECT_EQ(OpenMemfds(), steady) << "after v" << k;
  }
  EXPECT_EQ((*t)->CorruptByte("v0", 0, 0).code(), StatusCode::kNotFound);
  EXPECT_TRUE((*t)->CorruptByte("v6", 0, 0).ok());
  ASSERT_TRUE((*t)->Release("v6").ok());
  EXPECT_EQ(OpenMemfds(), steady - 2);  // one buffer per rank
  EXPECT_EQ((*t)->CorruptByte("v6", 1, 0).code(), StatusCode::kNotFound);
}

TEST_F(SyntheticTrainerTest, BadOptionsAreRefused) {
  auto o = Options("fsdp:2", "bad name/with slash");
  EXPECT_EQ(SyntheticTrainer::Create(o, store_.get()).status().code(), StatusCode::kInvalidArgument);
  o = Options("fsdp:2", "m");
  o.fail_rank = 2;
  EXPECT_EQ(SyntheticTrainer::Create(o, store_.get()).status().code(), StatusCode::kInvalidArgument);
  o = Options("fsdp:2", "m");
  o.transport = "carrier-pigeon";
  EXPECT_EQ(SyntheticTrainer::Create(o, store_.get()).status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace rc::trainer

#ifdef RC_TRAINER_TEST_WITH_UCX
namespace rc::trainer {
namespace {

TEST(SyntheticTrainerUcxTest, UcxRanksPublishBytesThatReadBackExactly) {
  ManualClock clock;
  auto store = directory::NewMemoryStore(&clock);
  SyntheticTrainerOptions o;
  o.config = *refit::ModelPreset("tiny");
  o.layout = *refit::ParseTrainerLayout("fsdp:2");
  o.transport = "ucx";
  o.weights = {4, 1e-3f};
  auto t = SyntheticTrainer::Create(o, store.get());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  auto v = (*t)->Step();
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  ASSERT_EQ(v->state, "COMMITTED");
  auto m = store->Get("tiny", "v0");
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->tables[0].shards[0].handle.rfind("ucx:v1:", 0), 0u);
  auto reader = CreateTrainerTransport("ucx");
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  const auto published = testing::ReadManifest(**reader, *m);
  for (const refit::ShardTable& table : m->tables) {
    EXPECT_EQ(published.at(table.name), ComputeBf16(o.weights, table.spec(), refit::FullBox(table.shape), 0))
        << table.name;
  }
}

}  // namespace
}  // namespace rc::trainer
#endif
