#include "rolloutcore/engine/loader.h"

#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>

#include "rolloutcore/base/json.h"
#include "testing/temp_dir.h"

namespace rc::engine {
namespace {

// This process's model folders (removed at exit).
const rc::testing::TempDir& Scratch() {
  static const rc::testing::TempDir kDir("rc_loader_test_");
  return kDir;
}

std::vector<int32_t> GreedyTokens(Engine* e, std::vector<int32_t> prompt) {
  GenerateRequest r;
  r.prompt = std::move(prompt);
  r.sampling.temperature = 0;
  r.sampling.max_tokens = 10;
  auto s = e->AddRequest(r);
  EXPECT_TRUE(s.ok());
  while (e->Step()) {
  }
  return (*s)->Wait().tokens;
}

TEST(LoaderTest, ModelFolderLoadsExactlyWhatDummyComputes) {
  for (const char* preset : {"tiny", "tiny-qwen2", "tiny-llama", "tiny-tied"}) {
    const std::string dir = Scratch() / (std::string("model_") + preset);
    auto spec = ResolveModel(preset);
    ASSERT_TRUE(spec.ok());
    auto src = MakeDummySource(*spec, 5);
    ASSERT_TRUE(WriteModelFolder(dir, *spec, src.get()).ok());
    auto reread = ResolveModel(dir);
    ASSERT_TRUE(reread.ok()) << reread.status().ToString();
    EXPECT_EQ(reread->arch, spec->arch);
    EXPECT_EQ(reread->tie_word_embeddings, spec->tie_word_embeddings);
    EngineOptions o;
    o.num_threads = 1;
    auto from_dir = CreateEngine({dir, "auto", 0}, o);
    ASSERT_TRUE(from_dir.ok()) << from_dir.status().ToString();
    auto dummy = CreateEngine({preset, "dummy", 5}, o);
    ASSERT_TRUE(dummy.ok());
    EXPECT_EQ(GreedyTokens(from_dir->get(), {1, 2, 3, 4}), GreedyTokens(dummy->get(), {1, 2, 3, 4})) << preset;
  }
}

TEST(LoaderTest, ErrorsNameTheTensor) {
  auto spec = *ResolveModel("tiny");
  const std::string dir = Scratch() / "model_bad";
  std::filesystem::create_directories(dir);
  {
    std::ofstream(dir + "/config.json") << ModelConfigJson(spec);
  }
  // Only the embedding, with a wrong shape.
  std::vector<float> w(size_t{10} * 64);
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors",
                               {{"model.embed_tokens.weight", DType::kF32, {10, 64},
                                 {reinterpret_cast<uint8_t*>(w.data()), w.size() * 4}}})
                  .ok());
  auto e = CreateEngine({dir, "auto", 0}, {});
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("model.embed_tokens.weight"), std::string::npos) << e.status().message();
  std::vector<float> w2(size_t{256} * 64);
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors",
                               {{"model.embed_tokens.weight", DType::kF32, {256, 64},
                                 {reinterpret_cast<uint8_t*>(w2.data()), w2.size() * 4}}})
                  .ok());
  e = CreateEngine({dir, "auto", 0}, {});
  ASSERT_FALSE(e.ok());
  // Every other tensor is missing: the error names one of them.
  EXPECT_NE(e.status().message().find("tensor 'model."), std::string::npos) << e.status().message();
  EXPECT_NE(e.status().message().find("missing"), std::string::npos) << e.status().message();
  EXPECT_FALSE(ResolveModel("no-such-model").ok());
  // safetensors needs a folder; auto runs a preset (no folder) on its seeded random weights.
  auto preset = CreateEngine({"tiny", "safetensors", 0}, {});
  ASSERT_FALSE(preset.ok());
  EXPECT_NE(preset.status().message().find("needs a model folder"), std::string::npos) << preset.status().message();
  EXPECT_TRUE(CreateEngine({"tiny", "auto", 0}, {}).ok());
}

TEST(LoaderTest, TensorParallelLayoutErrors) {
  EngineOptions o;
  o.tensor_parallel_size = 3;
  auto e = CreateEngine({"tiny", "dummy", 0}, o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("tensor-parallel-size 3"), std::string::npos);
}

// A folder's tensors, bytes copied (each span points into its own storage vector, whose buffer
// stays put when the outer vector grows), to be written again, changed.
struct FolderTensors {
  std::vector<std::vector<uint8_t>> storage;
  std::vector<TensorToWrite> tensors;
  void Add(const std::string& name, DType dtype, const std::vector<int64_t>& shape, std::vector<uint8_t> bytes) {
    storage.push_back(std::move(bytes));
    tensors.push_back({name, dtype, shape, std::span<const uint8_t>(storage.back())});
  }
};
FolderTensors ReadFolderTensors(const std::string& dir) {
  FolderTensors out;
  auto folder = SafetensorsFolder::Open(dir).value();
  for (const auto& n : folder->Names()) {
    auto loc = folder->Find(n).value();
    out.Add(n, loc.entry->dtype, loc.entry->shape, std::vector<uint8_t>(loc.bytes.begin(), loc.bytes.end()));
  }
  return out;
}

// A tiny model folder written from dummy weights, with one tensor's element replaced.
std::string WriteTinyFolder(const std::string& name, const std::string& tensor = "", size_t element = 0,
                            float value = 0) {
  std::string dir = Scratch() / name;
  std::filesystem::remove_all(dir);
  auto spec = *ResolveModel("tiny");
  auto src = MakeDummySource(spec, 5);
  EXPECT_TRUE(WriteModelFolder(dir, spec, src.get(), DType::kF32).ok());
  if (tensor.empty()) return dir;
  // Rewrite model.safetensors with the element changed (F32, so any value is representable).
  FolderTensors f = ReadFolderTensors(dir);
  for (size_t i = 0; i < f.tensors.size(); ++i) {
    if (f.tensors[i].name == tensor) std::memcpy(f.storage[i].data() + 4 * element, &value, 4);
  }
  EXPECT_TRUE(WriteSafetensors(dir + "/model.safetensors", f.tensors, {}).ok());
  return dir;
}

// Issue 13 #15: NaN / Inf weights are refused at load, naming the tensor and the element.
TEST(LoaderTest, NonFiniteWeightsAreRefusedNamingTensorAndElement) {
  EngineOptions o;
  o.num_threads = 1;
  ASSERT_TRUE(CreateEngine({WriteTinyFolder("model_finite"), "auto", 0}, o).ok());
  for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {
    const std::string dir = WriteTinyFolder("model_nonfinite", "model.layers.1.mlp.down_proj.weight", 77, bad);
    auto e = CreateEngine({dir, "auto", 0}, o);
    ASSERT_FALSE(e.ok()) << bad;
    EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(e.status().message().find("tensor 'model.layers.1.mlp.down_proj.weight' element 77 is"),
              std::string::npos)
        << e.status().message();
    EXPECT_NE(e.status().message().find(std::isnan(bad) ? "NaN" : bad > 0 ? "+Inf" : "-Inf"), std::string::npos)
        << e.status().message();
  }
}

// Runs f on another thread; fails the test (and runs unblock) when it does not return in 3 s.
template <typename F>
auto WithinSeconds(F f, const std::function<void()>& unblock) {
  auto pending = std::async(std::launch::async, f);
  if (pending.wait_for(std::chrono::seconds(3)) != std::future_status::ready) {
    ADD_FAILURE() << "blocked for 3 s";
    unblock();
  }
  return pending.get();
}

// Issue 13 #13: a model.safetensors or config.json that is a FIFO is refused at once (opening
// one for reading blocks until a writer appears), naming the file.
TEST(LoaderTest, FifoModelFilesAreRefusedWithoutBlocking) {
  for (const char* file : {"model.safetensors", "config.json"}) {
    SCOPED_TRACE(file);
    const std::string dir = WriteTinyFolder(std::string("model_fifo_") + file);
    const std::string path = dir + "/" + file;
    std::filesystem::remove(path);
    ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0) << std::strerror(errno);
    auto unblock = [&] {
      const int w = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);  // a writer: the open returns
      if (w >= 0) ::close(w);
    };
    auto e = WithinSeconds([&] { return CreateEngine({dir, "auto", 0}, {}); }, unblock);
    ASSERT_FALSE(e.ok());
    EXPECT_NE(e.status().message().find("not a regular file"), std::string::npos) << e.status().message();
    EXPECT_NE(e.status().message().find(path), std::string::npos) << e.status().message();
  }
}

// Issue 13 #13: sizes in config.json are bounded by what the files and the machine can hold,
// and the error names the field.
TEST(LoaderTest, ConfigSizesAreBoundedByTheFilesAndTheMachine) {
  const std::string dir = WriteTinyFolder("model_big_config");
  auto edit = [&](const std::string& key, int64_t value) {
    Json cfg = ReadJsonFile(dir + "/config.json").value();
    cfg[key] = value;
    std::ofstream(dir + "/config.json", std::ios::trunc) << cfg.dump(2);
  };
  // Far beyond any model: refused by the config parser before anything is allocated.
  edit("num_hidden_layers", 1'000'000'000);
  auto spec = ResolveModel(dir);
  ASSERT_FALSE(spec.ok());
  EXPECT_NE(spec.status().message().find("num_hidden_layers 1000000000 exceeds the limit"), std::string::npos)
      << spec.status().message();
  EXPECT_NE(spec.status().message().find("config.json"), std::string::npos) << spec.status().message();
  // Plausible for a config, but not for these files: 1000 layers need ~75 MB, the file has ~0.3.
  edit("num_hidden_layers", 1000);
  ASSERT_TRUE(ResolveModel(dir).ok());
  auto e = CreateEngine({dir, "auto", 0}, {});
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("num_hidden_layers 1000"), std::string::npos) << e.status().message();
  EXPECT_NE(e.status().message().find("*.safetensors files hold"), std::string::npos) << e.status().message();
  // Random weights of a valid but huge geometry: bounded by the machine's memory.
  edit("num_hidden_layers", 512);
  edit("hidden_size", 8192);
  edit("intermediate_size", 32768);  // 4e11 parameters: 1.6 TB of f32
  e = CreateEngine({dir, "dummy", 0}, {});
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("this machine has"), std::string::npos) << e.status().message();
}

// The tiny folder's tensors, as written (bytes copied), plus `extra` tensors.
void RewriteWith(const std::string& dir, const std::vector<std::pair<std::string, std::vector<int64_t>>>& extra) {
  FolderTensors f = ReadFolderTensors(dir);
  for (const auto& [name, shape] : extra) {
    size_t n = 1;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    f.Add(name, DType::kF32, shape, std::vector<uint8_t>(n * 4, 0));
  }
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", f.tensors, {}).ok());
}

void EditConfig(const std::string& dir, const std::string& key, const Json& value) {
  Json cfg = ReadJsonFile(dir + "/config.json").value();
  cfg[key] = value;
  std::ofstream(dir + "/config.json", std::ios::trunc) << cfg.dump(2);
}

// A checkpoint with tensors its config.json does not describe would be served as another model
// (fewer layers, q/k norms dropped under model_type llama, a stray tensor): refused, naming them.
TEST(LoaderTest, TensorsTheConfigDoesNotUseAreRefused) {
  EngineOptions o;
  o.num_threads = 1;
  {
    const std::string dir = WriteTinyFolder("model_extra");
    RewriteWith(dir, {{"model.layers.7.mlp.up_proj.weight", {128, 64}}});
    auto e = CreateEngine({dir, "auto", 0}, o);
    ASSERT_FALSE(e.ok());
    EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(e.status().message().find("model.layers.7.mlp.up_proj.weight"), std::string::npos)
        << e.status().message();
  }
  {
    const std::string dir = WriteTinyFolder("model_fewer_layers");
    EditConfig(dir, "num_hidden_layers", 1);
    auto e = CreateEngine({dir, "auto", 0}, o);
    ASSERT_FALSE(e.ok());
    EXPECT_NE(e.status().message().find("model.layers.1."), std::string::npos) << e.status().message();
    EXPECT_NE(e.status().message().find("num_hidden_layers 1"), std::string::npos) << e.status().message();
  }
  {
    const std::string dir = WriteTinyFolder("model_llama_qk_norm");  // tiny is qwen3: q_norm / k_norm
    EditConfig(dir, "model_type", "llama");
    EditConfig(dir, "architectures", Json::array({"LlamaForCausalLM"}));
    auto e = CreateEngine({dir, "auto", 0}, o);
    ASSERT_FALSE(e.ok());
    EXPECT_NE(e.status().message().find("q_norm"), std::string::npos) << e.status().message();
  }
  {
    // RoPE's inverse frequencies, carried by older checkpoints, are recomputed: accepted.
    const std::string dir = WriteTinyFolder("model_inv_freq");
    RewriteWith(dir, {{"model.layers.0.self_attn.rotary_emb.inv_freq", {8}}});
    EXPECT_TRUE(CreateEngine({dir, "auto", 0}, o).ok());
  }
}

// tie_word_embeddings true with an lm_head.weight present: ignored (as vLLM and Transformers do)
// when it has the embedding's shape, refused otherwise.
TEST(LoaderTest, ATiedModelsLmHeadIsIgnoredOnlyWithTheEmbeddingsShape) {
  EngineOptions o;
  o.num_threads = 1;
  const std::string dir = WriteTinyFolder("model_tied_with_lm_head");  // untied: has lm_head.weight
  auto untied = CreateEngine({dir, "auto", 0}, o);
  ASSERT_TRUE(untied.ok());
  const auto untied_tokens = GreedyTokens(untied->get(), {1, 2, 3, 4});
  EditConfig(dir, "tie_word_embeddings", true);
  auto tied = CreateEngine({dir, "auto", 0}, o);
  ASSERT_TRUE(tied.ok()) << tied.status().ToString();
  EXPECT_NE(GreedyTokens(tied->get(), {1, 2, 3, 4}), untied_tokens) << "tied: the logits come from the embedding";

  const std::string bad = WriteTinyFolder("model_tied_lm_head_wrong_shape");
  FolderTensors f = ReadFolderTensors(bad);
  std::erase_if(f.tensors, [](const TensorToWrite& t) { return t.name == "lm_head.weight"; });
  f.Add("lm_head.weight", DType::kF32, {128, 128}, std::vector<uint8_t>(size_t{128} * 128 * 4, 0));
  ASSERT_TRUE(WriteSafetensors(bad + "/model.safetensors", f.tensors, {}).ok());
  EditConfig(bad, "tie_word_embeddings", true);
  auto e = CreateEngine({bad, "auto", 0}, o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("lm_head.weight"), std::string::npos) << e.status().message();
  EXPECT_NE(e.status().message().find("[128, 128]"), std::string::npos) << e.status().message();
}

// --model DIR/config.json is not the checkpoint in DIR: serving it would mean random weights
// under a checkpoint's name. Refused, naming the folder to pass; --load-format dummy asks for it.
TEST(LoaderTest, AConfigFileIsNotAModelFolder) {
  EngineOptions o;
  o.num_threads = 1;
  const std::string dir = WriteTinyFolder("model_config_file");
  auto e = CreateEngine({dir + "/config.json", "auto", 0}, o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("is a file: pass the model folder ('" + dir + "')"), std::string::npos)
      << e.status().message();
  EXPECT_FALSE(CreateEngine({dir + "/config.json", "safetensors", 0}, o).ok());
  EXPECT_TRUE(CreateEngine({dir + "/config.json", "dummy", 0}, o).ok());
}

// A sharded checkpoint: the index names the shards that are read; a missing shard or a tensor
// mapped to the wrong shard is named, and a stray *.safetensors beside the shards is left out.
TEST(LoaderTest, AShardedCheckpointIsReadThroughItsIndex) {
  EngineOptions o;
  o.num_threads = 1;
  const std::string whole = WriteTinyFolder("model_whole");
  auto reference = CreateEngine({whole, "auto", 0}, o);
  ASSERT_TRUE(reference.ok());
  const auto want = GreedyTokens(reference->get(), {1, 2, 3, 4});

  const std::string dir = Scratch() / "model_sharded";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(whole + "/config.json", dir + "/config.json");
  const FolderTensors all = ReadFolderTensors(whole);
  std::vector<TensorToWrite> first, second;
  Json weight_map = Json::object();
  for (const TensorToWrite& t : all.tensors) {
    const bool in_first = t.name.rfind("model.layers.0.", 0) == 0 || t.name == "model.embed_tokens.weight";
    (in_first ? first : second).push_back(t);
    weight_map[t.name] = in_first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  ASSERT_TRUE(WriteSafetensors(dir + "/model-00001-of-00002.safetensors", first, {}).ok());
  ASSERT_TRUE(WriteSafetensors(dir + "/model-00002-of-00002.safetensors", second, {}).ok());
  // A stray file from an older checkpoint, holding a tensor of the same name: not read.
  ASSERT_TRUE(WriteSafetensors(dir + "/old-model.safetensors", {first[0]}, {}).ok());
  auto write_index = [&](const Json& map) {
    std::ofstream(dir + "/model.safetensors.index.json", std::ios::trunc)
        << Json{{"metadata", {{"total_size", 0}}}, {"weight_map", map}}.dump();
  };
  write_index(weight_map);
  auto sharded = CreateEngine({dir, "auto", 0}, o);
  ASSERT_TRUE(sharded.ok()) << sharded.status().ToString();
  EXPECT_EQ(GreedyTokens(sharded->get(), {1, 2, 3, 4}), want);

  Json ghost = weight_map;
  ghost["model.norm.weight"] = "model-00001-of-00002.safetensors";
  write_index(ghost);
  auto e = CreateEngine({dir, "auto", 0}, o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("maps tensor 'model.norm.weight' to 'model-00001-of-00002.safetensors', but it "
                                      "is in 'model-00002-of-00002.safetensors'"),
            std::string::npos)
      << e.status().message();

  write_index(weight_map);
  std::filesystem::remove(dir + "/model-00002-of-00002.safetensors");
  e = CreateEngine({dir, "auto", 0}, o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kNotFound);
  EXPECT_NE(e.status().message().find("names shard 'model-00002-of-00002.safetensors'"), std::string::npos)
      << e.status().message();
}

}  // namespace
}  // namespace rc::engine
