#include "rolloutcore/refit/model_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace rc::refit {
namespace {

using ::testing::HasSubstr;

TEST(ModelConfigTest, PresetsAreValidAndTinyIsTiny) {
  for (auto name : ModelPresetNames()) {
    auto c = ModelPreset(name);
    ASSERT_TRUE(c.ok()) << name;
    EXPECT_TRUE(ValidateModelConfig(*c).ok()) << name;
  }
  auto tiny = *ModelPreset("tiny");
  EXPECT_EQ(tiny.hidden_size, 64);
  EXPECT_EQ(tiny.num_hidden_layers, 2);
  EXPECT_EQ(tiny.num_attention_heads, 4);
  EXPECT_EQ(tiny.num_key_value_heads, 2);
  EXPECT_EQ(tiny.head_dim, 16);
  EXPECT_LT(tiny.num_parameters(), 200'000);
  // Known parameter counts of the real checkpoints.
  EXPECT_EQ(ModelPreset("qwen3-8b")->num_parameters(), 8'190'735'360);
  EXPECT_EQ(ModelPreset("qwen3-0.6b")->num_parameters(), 596'049'920);
  EXPECT_EQ(ModelPreset("qwen3-30b-a3b")->num_parameters(), 30'532'122'624);
  EXPECT_EQ(ModelPreset("nope").status().code(), StatusCode::kNotFound);
}

TEST(ModelConfigTest, ParsesHfQwen3MoeConfigWithRopeParameters) {
  auto j = ParseJson(R"({
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 4,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
    "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "tie_word_embeddings": false, "max_position_embeddings": 40960, "torch_dtype": "bfloat16",
    "num_experts": 128, "moe_intermediate_size": 768, "num_experts_per_tok": 8,
    "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [0]})");
  ASSERT_TRUE(j.ok());
  auto c = ParseModelConfigJson(*j, "config.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->architecture, Architecture::kQwen3Moe);
  EXPECT_EQ(c->rope_theta, 1000000.0);
  EXPECT_EQ(c->num_experts, 128);
  EXPECT_FALSE(c->is_moe_layer(0));
  EXPECT_TRUE(c->is_moe_layer(1));
  EXPECT_EQ(c->dtype, DType::kBF16);
}

TEST(ModelConfigTest, ParsesLlamaAndQwen2Defaults) {
  auto j = ParseJson(R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "torch_dtype": "bfloat16",
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"}})");
  ASSERT_TRUE(j.ok());
  auto c = ParseModelConfigJson(*j, "llama");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->rope_theta, 500000.0);
  EXPECT_EQ(c->rope_scaling.type, "llama3");
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_FALSE(c->has_qk_norm());
  auto q2 = ParseJson(R"({"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
    "tie_word_embeddings": true})");
  auto c2 = ParseModelConfigJson(*q2, "qwen2");
  ASSERT_TRUE(c2.ok()) << c2.status().ToString();
  EXPECT_TRUE(c2->attention_bias);
  EXPECT_EQ(c2->head_dim, 64);
}

TEST(ModelConfigTest, RejectsBadConfigsNamingTheField) {
  auto j = ParseJson(R"({"model_type": "gpt2", "hidden_size": 8})");
  EXPECT_THAT(ParseModelConfigJson(*j, "cfg").status().message(), HasSubstr("unsupported model_type 'gpt2'"));
  j = ParseJson(R"({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
    "num_key_value_heads": 3, "vocab_size": 10, "intermediate_size": 8})");
  EXPECT_THAT(ParseModelConfigJson(*j, "cfg").status().message(), HasSubstr("not a multiple of num_key_value_heads 3"));
  j = ParseJson(R"({"model_type": "llama", "hidden_size": "big"})");
  EXPECT_THAT(ParseModelConfigJson(*j, "cfg").status().message(), HasSubstr("hidden_size"));
}

// What the engines compute is fixed (SiLU MLPs, full causal attention, at least two positions): a
// config asking for anything else is refused, naming the field, not served as another model.
TEST(ModelConfigTest, RefusesWhatTheEnginesDoNotCompute) {
  auto parse = [](const std::string& extra) {
    auto j = ParseJson(R"({"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512)" +
                       extra + "}");
    EXPECT_TRUE(j.ok());
    return ParseModelConfigJson(*j, "cfg");
  };
  EXPECT_TRUE(parse(R"(, "hidden_act": "silu")").ok());
  EXPECT_THAT(parse(R"(, "hidden_act": "gelu")").status().message(), HasSubstr("hidden_act 'gelu' is not supported"));
  // Qwen: the window applies only with use_sliding_window (their configs carry sliding_window).
  EXPECT_TRUE(parse(R"(, "use_sliding_window": false, "sliding_window": 16)").ok());
  EXPECT_TRUE(parse(R"(, "use_sliding_window": true, "sliding_window": 512)").ok()) << "as long as the context";
  EXPECT_THAT(parse(R"(, "use_sliding_window": true, "sliding_window": 16)").status().message(),
              HasSubstr("sliding_window 16 (shorter than max_position_embeddings 512)"));
  EXPECT_THAT(parse(R"(, "max_position_embeddings": 1)").status().message(),
              HasSubstr("max_position_embeddings must be at least 2"));
  // Mistral (served as llama): the window applies whenever it is set.
  auto m = ParseJson(R"({"model_type": "mistral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 32768,
    "sliding_window": 4096})");
  EXPECT_THAT(ParseModelConfigJson(*m, "mistral").status().message(), HasSubstr("sliding_window 4096"));
  (*m)["sliding_window"] = nullptr;
  EXPECT_TRUE(ParseModelConfigJson(*m, "mistral").ok());
}

}  // namespace
}  // namespace rc::refit
