// Adapter from the engine to the refit module's model configs and capture-aware loader:
// ResolveModel reads presets / config.json through rc::refit::ResolveModelSpec, and LoadRank
// runs rc::refit::LoadEngineRank in a MaterializeContext over a TensorSource, then proves with
// CheckCoverage that every parameter byte was written exactly once. The same loader code is
// what refit captures for planning, so loading and refit geometry cannot drift apart.
//
// Engine-side additions (not in rc::refit::ModelConfig): eos / bos token ids, read from the
// folder's config.json (and generation_config.json when present); the preset aliases
// "qwen3-0.6b-like" (= qwen3-0.6b) and "tiny-tied" (tiny with tied embeddings).
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <utility>

#include "engine/model.h"
#include "rolloutcore/base/json.h"
#include "rolloutcore/engine/loader.h"
#include "rolloutcore/refit/capture.h"
#include "rolloutcore/refit/layouts.h"
#include "rolloutcore/refit/model_config.h"

namespace rc::engine {
namespace {

Result<refit::DType> ToRefit(DType d) {
  switch (d) {
    case DType::kF32: return refit::DType::kF32;
    case DType::kBF16: return refit::DType::kBF16;
    case DType::kF16: return refit::DType::kF16;
    case DType::kI8: return refit::DType::kI8;
    case DType::kU8: return refit::DType::kU8;
    case DType::kI32: return refit::DType::kI32;
    case DType::kI64: return refit::DType::kI64;
    default: return InvalidArgument("dtype " + std::string(DTypeName(d)) + " has no refit equivalent");
  }
}

// The architectures both sides know, each pair once.
constexpr std::pair<Architecture, refit::Architecture> kArchitectures[] = {
    {Architecture::kLlama, refit::Architecture::kLlama},
    {Architecture::kQwen2, refit::Architecture::kQwen2},
    {Architecture::kQwen3, refit::Architecture::kQwen3}};

// copy(a, b) for each consecutive pair of arguments.
template <typename Copy>
void Pairwise(Copy&) {}
template <typename Copy, typename A, typename B, typename... Rest>
void Pairwise(Copy& copy, A& a, B& b, Rest&... rest) {
  copy(a, b);
  Pairwise(copy, rest...);
}

// The geometry fields ModelSpec and refit::ModelConfig share, each pair once: copy(spec field,
// config field) for every one. SpecFromConfig and ConfigFromSpec both go through it, so the two
// directions cannot disagree on which fields correspond.
template <typename Spec, typename Config, typename Copy>
void ForEachSharedField(Spec& s, Config& c, Copy copy) {
  Pairwise(copy, s.vocab_size, c.vocab_size, s.hidden_size, c.hidden_size, s.intermediate_size, c.intermediate_size,
           s.num_layers, c.num_hidden_layers, s.num_heads, c.num_attention_heads, s.num_kv_heads,
           c.num_key_value_heads, s.head_dim, c.head_dim, s.rms_norm_eps, c.rms_norm_eps, s.rope_theta, c.rope_theta,
           s.max_position_embeddings, c.max_position_embeddings, s.tie_word_embeddings, c.tie_word_embeddings,
           s.qkv_bias, c.attention_bias);
}

template <typename To, typename From>
void Assign(To& to, const From& from) {
  to = static_cast<To>(from);
}

Result<ModelSpec> SpecFromConfig(const refit::ModelConfig& c) {
  if (c.is_moe()) {
    return InvalidArgument("model '" + c.name + "': Qwen3-MoE is not supported by the embedded engine");
  }
  ModelSpec s;
  const auto* arch = std::find_if(std::begin(kArchitectures), std::end(kArchitectures),
                                  [&](const auto& a) { return a.second == c.architecture; });
  if (arch == std::end(kArchitectures)) return InvalidArgument("model '" + c.name + "': unsupported architecture");
  s.arch = arch->first;
  ForEachSharedField(s, c, [](auto& spec, const auto& config) { Assign(spec, config); });
  s.qk_norm = c.has_qk_norm();
  s.rope_type = c.rope_scaling.type;
  s.rope_factor = c.rope_scaling.factor;
  s.rope_low_freq_factor = c.rope_scaling.low_freq_factor;
  s.rope_high_freq_factor = c.rope_scaling.high_freq_factor;
  s.rope_original_max_positions = c.rope_scaling.original_max_position_embeddings;
  if (s.rope_type != "default" && s.rope_type != "linear" && s.rope_type != "llama3") {
    return InvalidArgument("model '" + c.name + "': rope scaling '" + s.rope_type +
                           "' is not supported (default, linear, llama3)");
  }
  RC_RETURN_IF_ERROR(s.Validate());
  return s;
}

refit::ModelConfig ConfigFromSpec(const ModelSpec& s) {
  refit::ModelConfig c;
  c.name = "engine";
  for (const auto& [engine_arch, refit_arch] : kArchitectures) {
    if (engine_arch == s.arch) c.architecture = refit_arch;
  }
  ForEachSharedField(s, c, [](const auto& spec, auto& config) { Assign(config, spec); });
  return c;
}

Result<std::vector<int32_t>> TokenIds(const Json& j, std::string_view key) {
  std::vector<int32_t> out;
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return out;
  if (it->is_number_integer()) {
    out.push_back(it->get<int32_t>());
  } else if (it->is_array()) {
    for (const auto& v : *it) {
      if (!v.is_number_integer()) return InvalidArgument(std::string(key) + ": expected integers");
      out.push_back(v.get<int32_t>());
    }
  } else {
    return InvalidArgument(std::string(key) + ": expected an integer or a list of integers");
  }
  return out;
}

Status ReadSpecialTokens(const std::string& dir, ModelSpec* s) {
  for (const char* file : {"config.json", "generation_config.json"}) {
    const std::string path = dir + "/" + file;
    std::error_code ec;
    if (!std::filesystem::exists(path, ec)) continue;
    RC_ASSIGN_OR_RETURN(Json j, ReadJsonFile(path));
    if (!j.is_object()) continue;
    auto eos = TokenIds(j, "eos_token_id");
    if (!eos.ok()) return eos.status().WithContext(path);
    for (int32_t t : *eos)
      if (std::find(s->eos_token_ids.begin(), s->eos_token_ids.end(), t) == s->eos_token_ids.end())
        s->eos_token_ids.push_back(t);
    auto bos = TokenIds(j, "bos_token_id");
    if (!bos.ok()) return bos.status().WithContext(path);
    if (!bos->empty()) s->bos_token_id = (*bos)[0];
  }
  return OkStatus();
}

// NaN / Inf weights would load and serve silently (null logprobs); refuse them, naming the
// tensor and the first bad element's row-major index.
Status CheckFinite(const std::string& name, const SourceTensor& t) {
  const uint8_t* b = t.bytes.data();
  const size_t esize = DTypeSize(t.dtype);
  const size_t n = t.bytes.size() / esize;
  for (size_t i = 0; i < n; ++i) {
    bool bad = false, nan = false, negative = false;
    if (t.dtype == DType::kF32) {
      uint32_t u;
      std::memcpy(&u, b + 4 * i, 4);
      bad = (u & 0x7f800000u) == 0x7f800000u;
      nan = (u & 0x007fffffu) != 0;
      negative = (u >> 31) != 0;
    } else {
      uint16_t h;
      std::memcpy(&h, b + 2 * i, 2);
      const uint16_t exp = t.dtype == DType::kBF16 ? 0x7f80u : 0x7c00u;
      bad = (h & exp) == exp;
      nan = (h & static_cast<uint16_t>(~exp & 0x7fffu)) != 0;
      negative = (h >> 15) != 0;
    }
    if (bad) {
      return InvalidArgument("tensor '" + name + "' element " + std::to_string(i) + " is " +
                             (nan ? "NaN" : negative ? "-Inf" : "+Inf") + " (" + std::string(DTypeName(t.dtype)) +
                             "); non-finite weights are refused");
    }
  }
  return OkStatus();
}

}  // namespace

std::vector<std::string> EnginePresetNames() {
  return {"tiny", "tiny-llama", "tiny-qwen2", "tiny-tied", "qwen3-0.6b-like"};
}

Result<ModelSpec> ResolveModel(std::string_view preset_or_path) {
  std::string name(preset_or_path);
  if (name == "qwen3-0.6b-like") name = "qwen3-0.6b";
  const bool tied_alias = name == "tiny-tied";
  if (tied_alias) name = "tiny";
  auto preset = refit::ModelPreset(name);
  if (preset.ok()) {
    RC_ASSIGN_OR_RETURN(ModelSpec s, SpecFromConfig(*preset));
    if (tied_alias) s.tie_word_embeddings = true;
    if (name == "qwen3-0.6b") {
      s.eos_token_ids = {151645, 151643};
      s.bos_token_id = 151643;
    }
    return s;
  }
  std::error_code ec;
  if (!std::filesystem::exists(name, ec)) {
    std::string names;
    for (const auto& n : EnginePresetNames()) names += (names.empty() ? "" : ", ") + n;
    return NotFound("model '" + name + "' is neither a preset (" + names + ") nor a folder with config.json");
  }
  RC_ASSIGN_OR_RETURN(refit::ModelConfig c, refit::LoadModelConfigFile(name));
  RC_ASSIGN_OR_RETURN(ModelSpec s, SpecFromConfig(c));
  const std::string dir = std::filesystem::is_directory(name, ec)
                              ? name
                              : std::filesystem::path(name).parent_path().string();
  RC_RETURN_IF_ERROR(ReadSpecialTokens(dir.empty() ? "." : dir, &s));
  return s;
}

refit::ModelConfig RefitConfigFromSpec(const ModelSpec& spec) { return ConfigFromSpec(spec); }

Result<refit::DType> RefitDType(DType dtype) { return ToRefit(dtype); }

Result<ModelSpec> SpecFromRefitConfig(const refit::ModelConfig& config) { return SpecFromConfig(config); }

Status LoadRank(const ModelSpec& spec, const RankLayout& l, TensorSource* source, ParameterStore* params) {
  const refit::ModelConfig config = ConfigFromSpec(spec);
  refit::EngineLayout layout;
  layout.tp = l.tp;
  // Every parameter has the engine's one weight dtype (parameters.h); the loader writes that dtype.
  const DType weight_dtype = params->all().empty() ? DType::kF32 : params->all().begin()->second.dtype;
  RC_ASSIGN_OR_RETURN(layout.param_dtype, ToRefit(weight_dtype));
  RC_ASSIGN_OR_RETURN(std::vector<refit::TensorSpec> decls, refit::ListEngineParams(config, layout, l.rank));
  // The engine allocated its parameters from EngineParameterDecls; they must be the loader's.
  refit::DestinationBuffers buffers;
  for (const auto& d : decls) {
    const Parameter* p = params->Find(d.name);
    if (p == nullptr) return Internal("refit loader lists parameter '" + d.name + "' the engine does not have");
    if (p->shape != d.shape || d.dtype != layout.param_dtype || p->dtype != weight_dtype) {
      return Internal("engine parameter '" + d.name + "' is " + ShapeString(p->shape) + " " +
                      std::string(DTypeName(p->dtype)) + ", the refit loader wants " + refit::ShapeToString(d.shape) +
                      " " + std::string(refit::DTypeName(d.dtype)));
    }
    buffers.emplace(d.name, std::span<std::byte>(p->bytes(), p->nbytes()));
  }
  if (decls.size() != params->all().size()) {
    return Internal("engine has " + std::to_string(params->all().size()) + " parameters, the refit loader lists " +
                    std::to_string(decls.size()));
  }
  auto lookup = [source](std::string_view name) -> Result<refit::HostTensor> {
    RC_ASSIGN_OR_RETURN(SourceTensor t, source->Get(name));
    refit::HostTensor h;
    RC_ASSIGN_OR_RETURN(h.dtype, ToRefit(t.dtype));
    h.shape = t.shape;
    h.data = std::span<const std::byte>(reinterpret_cast<const std::byte*>(t.bytes.data()), t.bytes.size());
    return h;
  };
  // Check names and shapes of every HF tensor first, so errors name the tensor plainly.
  RC_ASSIGN_OR_RETURN(std::vector<refit::TensorSpec> sources, refit::ListSourceTensors(config));
  for (const auto& s : sources) {
    RC_ASSIGN_OR_RETURN(SourceTensor t, source->Get(s.name));
    if (t.shape != s.shape) {
      return InvalidArgument("tensor '" + s.name + "' has shape " + ShapeString(t.shape) + ", the model config needs " +
                             ShapeString(s.shape));
    }
    if (t.dtype != DType::kF32 && t.dtype != DType::kBF16 && t.dtype != DType::kF16) {
      return InvalidArgument("tensor '" + s.name + "' has dtype " + std::string(DTypeName(t.dtype)) +
                             "; supported: F32, BF16, F16");
    }
    RC_RETURN_IF_ERROR(CheckFinite(s.name, t));
  }
  refit::MaterializeContext ctx(lookup, decls, std::move(buffers));
  RC_RETURN_IF_ERROR(refit::LoadEngineRank(config, layout, l.rank, ctx));
  return ctx.CheckCoverage();
}

}  // namespace rc::engine
