#include "rolloutcore/refit/model_config.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>

namespace rc::refit {
namespace {

ModelConfig Qwen3Like(std::string name, int64_t hidden, int64_t inter, int64_t layers, int64_t heads,
                      int64_t kv_heads, int64_t head_dim, int64_t vocab, bool tie) {
  ModelConfig c;
  c.name = std::move(name);
  c.architecture = Architecture::kQwen3;
  c.hidden_size = hidden;
  c.intermediate_size = inter;
  c.num_hidden_layers = layers;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv_heads;
  c.head_dim = head_dim;
  c.vocab_size = vocab;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 1000000.0;
  c.tie_word_embeddings = tie;
  c.max_position_embeddings = 40960;
  return c;
}

std::vector<ModelConfig> BuildPresets() {
  std::vector<ModelConfig> p;
  {
    ModelConfig c = Qwen3Like("tiny", 64, 128, 2, 4, 2, 16, 256, false);
    c.max_position_embeddings = 512;
    p.push_back(c);
  }
  {
    ModelConfig c = Qwen3Like("tiny-llama", 64, 128, 2, 4, 2, 16, 256, false);
    c.architecture = Architecture::kLlama;
    c.rms_norm_eps = 1e-5;
    c.rope_theta = 10000.0;
    c.max_position_embeddings = 512;
    p.push_back(c);
  }
  {
    ModelConfig c = Qwen3Like("tiny-qwen2", 64, 128, 2, 4, 2, 16, 256, true);
    c.architecture = Architecture::kQwen2;
    c.attention_bias = true;
    c.max_position_embeddings = 512;
    p.push_back(c);
  }
  {
    ModelConfig c = Qwen3Like("tiny-moe", 64, 128, 2, 4, 2, 16, 256, false);
    c.architecture = Architecture::kQwen3Moe;
    c.num_experts = 8;
    c.moe_intermediate_size = 32;
    c.num_experts_per_tok = 2;
    c.max_position_embeddings = 512;
    p.push_back(c);
  }
  p.push_back(Qwen3Like("qwen3-0.6b", 1024, 3072, 28, 16, 8, 128, 151936, true));
  p.push_back(Qwen3Like("qwen3-8b", 4096, 12288, 36, 32, 8, 128, 151936, false));
  {
    ModelConfig c = Qwen3Like("qwen3-30b-a3b", 2048, 6144, 48, 32, 4, 128, 151936, false);
    c.architecture = Architecture::kQwen3Moe;
    c.num_experts = 128;
    c.moe_intermediate_size = 768;
    c.num_experts_per_tok = 8;
    p.push_back(c);
  }
  {
    // Qwen/Qwen3-235B-A22B config.json: qwen3_moe, hidden 4096, 94 layers, 64 q / 4 kv heads of
    // 128, 128 experts of moe_intermediate 1536 (top 8), vocab 151936, untied, bf16.
    ModelConfig c = Qwen3Like("qwen3-235b-a22b", 4096, 12288, 94, 64, 4, 128, 151936, false);
    c.architecture = Architecture::kQwen3Moe;
    c.num_experts = 128;
    c.moe_intermediate_size = 1536;
    c.num_experts_per_tok = 8;
    p.push_back(c);
  }
  {
    // Kimi-K2 *shape* (moonshotai/Kimi-K2-Instruct config.json, deepseek_v3): hidden 7168, 61
    // layers, layer 0 dense (first_k_dense_replace 1, intermediate 18432), 384 routed experts of
    // moe_intermediate 2048 (top 8), 64 heads, vocab 163840, untied, bf16 training weights.
    // Expressed as Qwen3-MoE, which the planner and layouts know: MLA (q_a/q_b/kv_a/kv_b, 101.1M
    // parameters per layer) becomes 64 q heads + 1 kv head of 128 (119.2M per layer), and the one
    // shared expert per MoE layer (44.0M) is absent. docs/scale.md states the byte difference.
    ModelConfig c = Qwen3Like("kimi-k2-shape", 7168, 18432, 61, 64, 1, 128, 163840, false);
    c.architecture = Architecture::kQwen3Moe;
    c.num_experts = 384;
    c.moe_intermediate_size = 2048;
    c.num_experts_per_tok = 8;
    c.mlp_only_layers = {0};
    c.rope_theta = 50000.0;
    c.max_position_embeddings = 131072;
    p.push_back(c);
  }
  {
    ModelConfig c;
    c.name = "llama3-70b";
    c.architecture = Architecture::kLlama;
    c.hidden_size = 8192;
    c.intermediate_size = 28672;
    c.num_hidden_layers = 80;
    c.num_attention_heads = 64;
    c.num_key_value_heads = 8;
    c.head_dim = 128;
    c.vocab_size = 128256;
    c.rms_norm_eps = 1e-5;
    c.rope_theta = 500000.0;
    c.max_position_embeddings = 8192;
    p.push_back(c);
  }
  return p;
}

const std::vector<ModelConfig>& Presets() {
  static const std::vector<ModelConfig> kPresets = BuildPresets();
  return kPresets;
}

Result<Architecture> ArchitectureFromJson(const Json& j, std::string_view what) {
  std::string type;
  if (auto it = j.find("model_type"); it != j.end() && it->is_string()) type = it->get<std::string>();
  if (type.empty()) {
    if (auto it = j.find("architectures"); it != j.end() && it->is_array() && !it->empty() &&
                                           (*it)[0].is_string()) {
      const std::string a = (*it)[0].get<std::string>();
      if (a == "LlamaForCausalLM" || a == "MistralForCausalLM") type = "llama";
      else if (a == "Qwen2ForCausalLM") type = "qwen2";
      else if (a == "Qwen3ForCausalLM") type = "qwen3";
      else if (a == "Qwen3MoeForCausalLM") type = "qwen3_moe";
      else type = a;
    }
  }
  if (type == "llama" || type == "mistral") return Architecture::kLlama;
  if (type == "qwen2") return Architecture::kQwen2;
  if (type == "qwen3") return Architecture::kQwen3;
  if (type == "qwen3_moe") return Architecture::kQwen3Moe;
  return InvalidArgument(fmt::format("{}: unsupported model_type '{}' (supported: llama, qwen2, qwen3, qwen3_moe)",
                                     what, type));
}

Status ParseRopeScaling(const Json& obj, std::string_view path, RopeScaling* out) {
  RC_ASSIGN_OR_RETURN(std::string type, GetString(obj, "rope_type", path, std::string()));
  if (type.empty()) {
    RC_ASSIGN_OR_RETURN(type, GetString(obj, "type", path, std::string("default")));
  }
  out->type = type;
  RC_ASSIGN_OR_RETURN(out->factor, GetDouble(obj, "factor", path, 1.0));
  RC_ASSIGN_OR_RETURN(out->low_freq_factor, GetDouble(obj, "low_freq_factor", path, 1.0));
  RC_ASSIGN_OR_RETURN(out->high_freq_factor, GetDouble(obj, "high_freq_factor", path, 4.0));
  RC_ASSIGN_OR_RETURN(out->original_max_position_embeddings,
                      GetNonNegativeInt(obj, "original_max_position_embeddings", path, 0));
  return OkStatus();
}

}  // namespace

std::string_view ArchitectureName(Architecture arch) {
  switch (arch) {
    case Architecture::kLlama: return "llama";
    case Architecture::kQwen2: return "qwen2";
    case Architecture::kQwen3: return "qwen3";
    case Architecture::kQwen3Moe: return "qwen3_moe";
  }
  return "unknown";
}

bool ModelConfig::is_moe_layer(int64_t layer) const {
  if (!is_moe() || num_experts <= 0) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end()) return false;
  return decoder_sparse_step > 0 && (layer + 1) % decoder_sparse_step == 0;
}

int64_t ModelConfig::num_parameters() const {
  const int64_t h = hidden_size;
  int64_t n = vocab_size * h * (tie_word_embeddings ? 1 : 2) + h;
  for (int64_t i = 0; i < num_hidden_layers; ++i) {
    n += 2 * h + q_size() * h + 2 * kv_size() * h + h * q_size();
    if (attention_bias) n += q_size() + 2 * kv_size();
    if (has_qk_norm()) n += 2 * head_dim;
    if (is_moe_layer(i)) {
      n += num_experts * h + num_experts * 3 * moe_intermediate_size * h;
    } else {
      n += 3 * intermediate_size * h;
    }
  }
  return n;
}

Status ValidateModelConfig(const ModelConfig& c) {
  const std::string& w = c.name;
  auto positive = [&](int64_t v, std::string_view field) -> Status {
    if (v <= 0 || v > (int64_t{1} << 31)) {
      return InvalidArgument(fmt::format("model {}: {} must be in 1..2^31, got {}", w, field, v));
    }
    return OkStatus();
  };
  RC_RETURN_IF_ERROR(positive(c.hidden_size, "hidden_size"));
  RC_RETURN_IF_ERROR(positive(c.num_hidden_layers, "num_hidden_layers"));
  RC_RETURN_IF_ERROR(positive(c.num_attention_heads, "num_attention_heads"));
  RC_RETURN_IF_ERROR(positive(c.num_key_value_heads, "num_key_value_heads"));
  RC_RETURN_IF_ERROR(positive(c.head_dim, "head_dim"));
  RC_RETURN_IF_ERROR(positive(c.vocab_size, "vocab_size"));
  // Sizes come from a file: everything downstream (tensor lists, captures, parameters) allocates
  // in proportion to them, so each is bounded by what a real model uses (generously) before
  // anything loops over them, and the parameter count below by kMaxModelParameters.
  auto at_most = [&](int64_t v, std::string_view field, int64_t max) -> Status {
    if (v > max) return InvalidArgument(fmt::format("model {}: {} {} exceeds the limit {}", w, field, v, max));
    return OkStatus();
  };
  RC_RETURN_IF_ERROR(at_most(c.num_hidden_layers, "num_hidden_layers", kMaxModelLayers));
  RC_RETURN_IF_ERROR(at_most(c.hidden_size, "hidden_size", int64_t{1} << 17));
  RC_RETURN_IF_ERROR(at_most(c.num_attention_heads, "num_attention_heads", 1024));
  RC_RETURN_IF_ERROR(at_most(c.num_key_value_heads, "num_key_value_heads", 1024));
  RC_RETURN_IF_ERROR(at_most(c.head_dim, "head_dim", 1024));
  RC_RETURN_IF_ERROR(at_most(c.vocab_size, "vocab_size", int64_t{1} << 24));
  RC_RETURN_IF_ERROR(at_most(c.intermediate_size, "intermediate_size", int64_t{1} << 20));
  RC_RETURN_IF_ERROR(at_most(c.moe_intermediate_size, "moe_intermediate_size", int64_t{1} << 20));
  RC_RETURN_IF_ERROR(at_most(c.num_experts, "num_experts", 1024));
  RC_RETURN_IF_ERROR(at_most(c.max_position_embeddings, "max_position_embeddings", int64_t{1} << 30));
  if (c.max_position_embeddings < 2) {
    return InvalidArgument(fmt::format("model {}: max_position_embeddings must be at least 2 (a prompt token and a "
                                       "generated one), got {}",
                                       w, c.max_position_embeddings));
  }
  RC_RETURN_IF_ERROR(at_most(static_cast<int64_t>(c.mlp_only_layers.size()), "mlp_only_layers (count)",
                             kMaxModelLayers));
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return InvalidArgument(fmt::format("model {}: num_attention_heads {} is not a multiple of num_key_value_heads {}",
                                       w, c.num_attention_heads, c.num_key_value_heads));
  }
  bool any_dense = false;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) any_dense = any_dense || !c.is_moe_layer(i);
  if (any_dense) RC_RETURN_IF_ERROR(positive(c.intermediate_size, "intermediate_size"));
  if (c.is_moe()) {
    RC_RETURN_IF_ERROR(positive(c.num_experts, "num_experts"));
    RC_RETURN_IF_ERROR(positive(c.moe_intermediate_size, "moe_intermediate_size"));
    RC_RETURN_IF_ERROR(positive(c.num_experts_per_tok, "num_experts_per_tok"));
    RC_RETURN_IF_ERROR(positive(c.decoder_sparse_step, "decoder_sparse_step"));
    if (c.num_experts_per_tok > c.num_experts) {
      return InvalidArgument(fmt::format("model {}: num_experts_per_tok {} exceeds num_experts {}", w,
                                         c.num_experts_per_tok, c.num_experts));
    }
  } else if (c.num_experts != 0) {
    return InvalidArgument(fmt::format("model {}: num_experts {} given for dense architecture {}", w,
                                       c.num_experts, ArchitectureName(c.architecture)));
  }
  if (c.attention_bias && c.architecture != Architecture::kQwen2) {
    return Unimplemented(fmt::format("model {}: attention_bias=true for {} (adds an o_proj bias) is not supported",
                                     w, ArchitectureName(c.architecture)));
  }
  if (!(c.rms_norm_eps > 0) || !(c.rope_theta > 0)) {
    return InvalidArgument(fmt::format("model {}: rms_norm_eps and rope_theta must be positive", w));
  }
  // Element counts of the largest tensors must fit comfortably.
  if (c.vocab_size * c.hidden_size > kMaxElements ||
      c.num_experts * 2 * c.moe_intermediate_size * c.hidden_size > kMaxElements) {
    return InvalidArgument(fmt::format("model {}: tensors are too large", w));
  }
  // With the bounds above this cannot overflow int64.
  if (const int64_t n = c.num_parameters(); n > kMaxModelParameters) {
    return InvalidArgument(fmt::format("model {}: the sizes describe {} parameters, more than the limit {}", w, n,
                                       kMaxModelParameters));
  }
  return OkStatus();
}

Result<ModelConfig> ParseModelConfigJson(const Json& j, std::string_view what) {
  if (!j.is_object()) return InvalidArgument(fmt::format("{}: expected a JSON object", what));
  ModelConfig c;
  c.name = std::string(what);
  const std::string p;  // field paths are top-level names
  RC_ASSIGN_OR_RETURN(c.architecture, ArchitectureFromJson(j, what));
  auto ctx = [&](const Status& s) { return s.WithContext(what); };
  auto get_int = [&](std::string_view key, std::optional<int64_t> dflt) -> Result<int64_t> {
    auto r = GetNonNegativeInt(j, key, p, dflt);
    if (!r.ok()) return ctx(r.status());
    return r;
  };
  RC_ASSIGN_OR_RETURN(c.hidden_size, get_int("hidden_size", std::nullopt));
  RC_ASSIGN_OR_RETURN(c.num_hidden_layers, get_int("num_hidden_layers", std::nullopt));
  RC_ASSIGN_OR_RETURN(c.num_attention_heads, get_int("num_attention_heads", std::nullopt));
  RC_ASSIGN_OR_RETURN(c.num_key_value_heads, get_int("num_key_value_heads", c.num_attention_heads));
  RC_ASSIGN_OR_RETURN(c.vocab_size, get_int("vocab_size", std::nullopt));
  RC_ASSIGN_OR_RETURN(c.intermediate_size, get_int("intermediate_size", 0));
  if (c.num_attention_heads <= 0) {
    return InvalidArgument(fmt::format("{}: num_attention_heads must be positive", what));
  }
  RC_ASSIGN_OR_RETURN(c.head_dim, get_int("head_dim", c.hidden_size / c.num_attention_heads));
  RC_ASSIGN_OR_RETURN(c.max_position_embeddings, get_int("max_position_embeddings", 4096));
  {
    auto r = GetDouble(j, "rms_norm_eps", p, 1e-6);
    if (!r.ok()) return ctx(r.status());
    c.rms_norm_eps = *r;
  }
  {
    auto r = GetBool(j, "tie_word_embeddings", p, false);
    if (!r.ok()) return ctx(r.status());
    c.tie_word_embeddings = *r;
  }
  // rope_theta lives at the top level in older configs and under rope_parameters in newer ones.
  double theta = 10000.0;
  if (auto it = j.find("rope_parameters"); it != j.end() && it->is_object()) {
    auto r = GetDouble(*it, "rope_theta", "rope_parameters", 10000.0);
    if (!r.ok()) return ctx(r.status());
    theta = *r;
    RC_RETURN_IF_ERROR(ctx(ParseRopeScaling(*it, "rope_parameters", &c.rope_scaling)));
  }
  {
    auto r = GetDouble(j, "rope_theta", p, theta);
    if (!r.ok()) return ctx(r.status());
    c.rope_theta = *r;
  }
  if (auto it = j.find("rope_scaling"); it != j.end() && it->is_object()) {
    RC_RETURN_IF_ERROR(ctx(ParseRopeScaling(*it, "rope_scaling", &c.rope_scaling)));
  }
  {
    auto r = GetBool(j, "attention_bias", p, c.architecture == Architecture::kQwen2);
    if (!r.ok()) return ctx(r.status());
    c.attention_bias = c.architecture == Architecture::kQwen2 ? true : *r;
  }
  // What the engines compute is fixed: SiLU-gated MLPs and full causal attention. A config that
  // asks for another activation, or for a sliding window that is shorter than the context, would
  // be served as a different model, so it is refused, naming the field.
  {
    auto act = GetString(j, "hidden_act", p, std::string("silu"));
    if (!act.ok()) return ctx(act.status());
    if (*act != "silu" && *act != "swish") {
      return Unimplemented(fmt::format("{}: hidden_act '{}' is not supported (silu only)", what, *act));
    }
  }
  {
    // Qwen2/3 apply the window only with use_sliding_window true; Mistral whenever sliding_window is set.
    bool use = c.architecture == Architecture::kLlama;
    if (auto it = j.find("use_sliding_window"); it != j.end() && !it->is_null()) {
      auto r = GetBool(j, "use_sliding_window", p, false);
      if (!r.ok()) return ctx(r.status());
      use = *r;
    }
    if (auto it = j.find("sliding_window"); use && it != j.end() && !it->is_null()) {
      auto w = GetNonNegativeInt(j, "sliding_window", p, std::nullopt);
      if (!w.ok()) return ctx(w.status());
      if (*w < c.max_position_embeddings) {
        return Unimplemented(fmt::format("{}: sliding_window {} (shorter than max_position_embeddings {}) is not "
                                         "supported: the engines attend to the whole context",
                                         what, *w, c.max_position_embeddings));
      }
    }
  }
  std::string dtype_name;
  if (auto it = j.find("torch_dtype"); it != j.end() && it->is_string()) dtype_name = it->get<std::string>();
  if (auto it = j.find("dtype"); dtype_name.empty() && it != j.end() && it->is_string()) {
    dtype_name = it->get<std::string>();
  }
  if (!dtype_name.empty()) {
    auto d = ParseDType(dtype_name);
    if (!d.ok()) return ctx(d.status());
    c.dtype = *d;
  }
  if (c.is_moe()) {
    RC_ASSIGN_OR_RETURN(c.num_experts, get_int("num_experts", std::nullopt));
    RC_ASSIGN_OR_RETURN(c.moe_intermediate_size, get_int("moe_intermediate_size", std::nullopt));
    RC_ASSIGN_OR_RETURN(c.num_experts_per_tok, get_int("num_experts_per_tok", std::nullopt));
    RC_ASSIGN_OR_RETURN(c.decoder_sparse_step, get_int("decoder_sparse_step", 1));
    auto r = GetBool(j, "norm_topk_prob", p, true);
    if (!r.ok()) return ctx(r.status());
    c.norm_topk_prob = *r;
    if (auto it = j.find("mlp_only_layers"); it != j.end() && !it->is_null()) {
      if (!it->is_array()) return InvalidArgument(fmt::format("{}: mlp_only_layers: expected an array", what));
      for (const auto& v : *it) {
        if (!v.is_number_integer()) {
          return InvalidArgument(fmt::format("{}: mlp_only_layers: expected integers", what));
        }
        c.mlp_only_layers.push_back(v.get<int64_t>());
      }
    }
  }
  RC_RETURN_IF_ERROR(ValidateModelConfig(c));
  return c;
}

Result<ModelConfig> LoadModelConfigFile(const std::string& path) {
  std::error_code ec;
  std::string file = path;
  if (std::filesystem::is_directory(path, ec)) file = (std::filesystem::path(path) / "config.json").string();
  RC_ASSIGN_OR_RETURN(Json j, ReadJsonFile(file));
  return ParseModelConfigJson(j, file);
}

Result<ModelConfig> ModelPreset(std::string_view name) {
  for (const auto& c : Presets()) {
    if (c.name == name) return c;
  }
  return NotFound(fmt::format("unknown model preset '{}' (presets: {})", name, fmt::join(ModelPresetNames(), ", ")));
}

std::vector<std::string_view> ModelPresetNames() {
  std::vector<std::string_view> names;
  for (const auto& c : Presets()) names.push_back(c.name);
  return names;
}

Result<ModelConfig> ResolveModelSpec(std::string_view spec) {
  auto preset = ModelPreset(spec);
  if (preset.ok()) return preset;
  std::error_code ec;
  if (std::filesystem::exists(std::string(spec), ec)) return LoadModelConfigFile(std::string(spec));
  return NotFound(fmt::format("model '{}' is neither a preset ({}) nor an existing config.json path", spec,
                              fmt::join(ModelPresetNames(), ", ")));
}

}  // namespace rc::refit
