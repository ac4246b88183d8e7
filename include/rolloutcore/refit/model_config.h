// ModelConfig: the architecture hyper-parameters of a Llama / Qwen2 / Qwen3 / Qwen3-MoE decoder,
// read from a Hugging Face config.json or taken from a named preset.
//
// Shared by refit (which derives tensor names and shapes from it) and the engine (which builds
// compute from it), so it carries everything both need, including the fields only compute uses
// (rms_norm_eps, rope parameters, max_position_embeddings, MoE routing).
//
// Presets: `tiny` (Qwen3 architecture, hidden 64, 2 layers, 4 q heads, 2 kv heads, head_dim 16,
// intermediate 128, vocab 256: small enough for instant engine tests), `tiny-llama`,
// `tiny-qwen2` (q/k/v biases), `tiny-moe` (Qwen3-MoE, 8 experts), and the real shapes
// `qwen3-0.6b`, `qwen3-8b`, `qwen3-30b-a3b`, `qwen3-235b-a22b`, `llama3-70b`, and
// `kimi-k2-shape` (Kimi-K2's sizes in Qwen3-MoE form, for planning at scale: docs/scale.md).
//
// Thread safety: values and pure functions.
// Invariant: a ModelConfig returned by ParseModelConfigJson / ModelPreset / ResolveModelSpec has
// passed ValidateModelConfig: every size is positive, num_attention_heads % num_key_value_heads
// == 0, and MoE fields are positive exactly when architecture == kQwen3Moe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/json.h"
#include "rolloutcore/base/status.h"
#include "rolloutcore/refit/tensor.h"

namespace rc::refit {

enum class Architecture : uint8_t { kLlama, kQwen2, kQwen3, kQwen3Moe };

// "llama", "qwen2", "qwen3", "qwen3_moe" (the HF model_type spelling).
std::string_view ArchitectureName(Architecture arch);

// Rotary scaling as HF writes it under "rope_scaling" (or inside "rope_parameters").
// type "default" means plain RoPE; "llama3" uses factor / low_freq_factor / high_freq_factor /
// original_max_position_embeddings; "linear" and "dynamic" use factor only.
struct RopeScaling {
  std::string type = "default";
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 0;
};

struct ModelConfig {
  std::string name;  // preset name or the config path it came from
  Architecture architecture = Architecture::kLlama;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // dense MLP width (unused by MoE layers)
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;  // defaults to hidden_size / num_attention_heads
  int64_t vocab_size = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;  // top level, or rope_parameters.rope_theta
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;  // lm_head is embed_tokens (no lm_head.weight tensor)
  int64_t max_position_embeddings = 4096;
  // q/k/v projection biases. Always true for Qwen2 (its HF code hard-codes them); read from
  // "attention_bias" otherwise (only false is supported for llama / qwen3, whose HF code would
  // then also add an o_proj bias).
  bool attention_bias = false;
  // MoE (Qwen3-MoE). Zero for dense models.
  int64_t num_experts = 0;
  int64_t moe_intermediate_size = 0;
  int64_t num_experts_per_tok = 0;
  bool norm_topk_prob = true;            // renormalise the top-k routing weights
  int64_t decoder_sparse_step = 1;       // layer i is MoE when (i + 1) % step == 0 ...
  std::vector<int64_t> mlp_only_layers;  // ... and i is not listed here
  // The checkpoint's element type ("torch_dtype" / "dtype"); bf16 when absent.
  DType dtype = DType::kBF16;

  bool has_qk_norm() const {
    return architecture == Architecture::kQwen3 || architecture == Architecture::kQwen3Moe;
  }
  bool is_moe() const { return architecture == Architecture::kQwen3Moe; }
  bool is_moe_layer(int64_t layer) const;
  int64_t q_size() const { return num_attention_heads * head_dim; }
  int64_t kv_size() const { return num_key_value_heads * head_dim; }
  // Total parameter count of the HF checkpoint (lm_head counted once when tied).
  int64_t num_parameters() const;
};

// Bounds a config read from a file must stay within (ValidateModelConfig): at most
// kMaxModelLayers layers and kMaxModelParameters parameters, and per-field limits far above any
// real model (hidden 2^17, heads and head_dim 1024, vocab 2^24, intermediate 2^20, experts 1024).
inline constexpr int64_t kMaxModelLayers = 1024;
inline constexpr int64_t kMaxModelParameters = int64_t{1} << 41;
[[nodiscard]] Status ValidateModelConfig(const ModelConfig& config);

// Parses a HF config.json object. `what` names the source in messages.
[[nodiscard]] Result<ModelConfig> ParseModelConfigJson(const Json& json, std::string_view what);
// Reads `path`, which is a config.json file or a folder holding one.
[[nodiscard]] Result<ModelConfig> LoadModelConfigFile(const std::string& path);
// A named preset (see the header comment); NotFound listing the presets otherwise.
[[nodiscard]] Result<ModelConfig> ModelPreset(std::string_view name);
std::vector<std::string_view> ModelPresetNames();
// A preset name, or else a path to a config.json / model folder.
[[nodiscard]] Result<ModelConfig> ResolveModelSpec(std::string_view spec);

}  // namespace rc::refit
