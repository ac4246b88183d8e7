#include "rolloutcore/engine/loader.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

namespace rc::engine {
namespace {

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
    const std::string dir = ::testing::TempDir() + "/model_" + preset;
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
  const std::string dir = ::testing::TempDir() + "/model_bad";
  std::filesystem::create_directories(dir);
  {
    std::ofstream(dir + "/config.json") << ModelConfigJson(spec);
  }
  // Only the embedding, with a wrong shape.
  std::vector<float> w(10 * 64);
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors",
                               {{"model.embed_tokens.weight", DType::kF32, {10, 64},
                                 {reinterpret_cast<uint8_t*>(w.data()), w.size() * 4}}})
                  .ok());
  auto e = CreateEngine({dir, "auto", 0}, {});
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("model.embed_tokens.weight"), std::string::npos) << e.status().message();
  std::vector<float> w2(256 * 64);
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
  EXPECT_FALSE(CreateEngine({"tiny", "auto", 0}, {}).ok());  // a preset needs --load-format dummy
}

TEST(LoaderTest, TensorParallelLayoutErrors) {
  EngineOptions o;
  o.tensor_parallel_size = 3;
  auto e = CreateEngine({"tiny", "dummy", 0}, o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("tensor-parallel-size 3"), std::string::npos);
}

}  // namespace
}  // namespace rc::engine
