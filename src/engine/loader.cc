// Sources, HF tensor names, model folders. The rank sharding itself (LoadRank) and config
// resolution live in interim_loader.cc until the refit loaders land.
#include "rolloutcore/engine/loader.h"

#include "rolloutcore/base/log.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "engine/model.h"
#include "rolloutcore/base/hash.h"
#include "rolloutcore/base/json.h"
#include "rolloutcore/base/log.h"
#include "rolloutcore/engine/sampler.h"

namespace rc::engine {

std::vector<HfTensorDecl> HfTensorDecls(const ModelSpec& s) {
  const int64_t h = s.hidden_size, d = s.head_dim;
  std::vector<HfTensorDecl> out;
  out.push_back({"model.embed_tokens.weight", {s.vocab_size, h}});
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    out.push_back({p + "input_layernorm.weight", {h}});
    out.push_back({p + "post_attention_layernorm.weight", {h}});
    out.push_back({p + "self_attn.q_proj.weight", {s.num_heads * d, h}});
    out.push_back({p + "self_attn.k_proj.weight", {s.num_kv_heads * d, h}});
    out.push_back({p + "self_attn.v_proj.weight", {s.num_kv_heads * d, h}});
    if (s.qkv_bias) {
      out.push_back({p + "self_attn.q_proj.bias", {s.num_heads * d}});
      out.push_back({p + "self_attn.k_proj.bias", {s.num_kv_heads * d}});
      out.push_back({p + "self_attn.v_proj.bias", {s.num_kv_heads * d}});
    }
    if (s.qk_norm) {
      out.push_back({p + "self_attn.q_norm.weight", {d}});
      out.push_back({p + "self_attn.k_norm.weight", {d}});
    }
    out.push_back({p + "self_attn.o_proj.weight", {h, s.num_heads * d}});
    out.push_back({p + "mlp.gate_proj.weight", {s.intermediate_size, h}});
    out.push_back({p + "mlp.up_proj.weight", {s.intermediate_size, h}});
    out.push_back({p + "mlp.down_proj.weight", {h, s.intermediate_size}});
  }
  out.push_back({"model.norm.weight", {h}});
  if (!s.tie_word_embeddings) out.push_back({"lm_head.weight", {s.vocab_size, h}});
  return out;
}

namespace {

class FolderSource final : public TensorSource {
 public:
  explicit FolderSource(std::unique_ptr<SafetensorsFolder> f) : folder_(std::move(f)) {}
  Result<SourceTensor> Get(std::string_view name) override {
    RC_ASSIGN_OR_RETURN(auto loc, folder_->Find(name));
    SourceTensor t;
    t.dtype = loc.entry->dtype;
    t.shape = loc.entry->shape;
    t.bytes = loc.bytes;
    return t;
  }

 private:
  std::unique_ptr<SafetensorsFolder> folder_;
};

class DummySource final : public TensorSource {
 public:
  DummySource(const ModelSpec& spec, uint64_t seed) : seed_(seed) {
    for (auto& d : HfTensorDecls(spec)) decls_.emplace(d.name, d.shape);
  }
  Result<SourceTensor> Get(std::string_view name) override {
    auto it = decls_.find(std::string(name));
    if (it == decls_.end()) return NotFound("tensor '" + std::string(name) + "' is not part of this model");
    const auto& shape = it->second;
    if (name != last_name_) {
      Generate(name, shape);
      last_name_ = std::string(name);
    }
    SourceTensor t;
    t.dtype = DType::kBF16;
    t.shape = shape;
    t.bytes = std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(buf_.data()), buf_.size() * 2);
    return t;
  }

 private:
  void Generate(std::string_view name, const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    double std_dev;
    double mean = 0;
    const bool is_norm = name.find("norm") != std::string_view::npos;
    if (is_norm) {
      mean = 1.0;
      std_dev = 0.05;
    } else if (name.find("bias") != std::string_view::npos) {
      std_dev = 0.1;
    } else if (name == "model.embed_tokens.weight") {
      std_dev = 0.5;
    } else {
      std_dev = 1.0 / std::sqrt(static_cast<double>(shape.back()));
    }
    buf_.resize(static_cast<size_t>(n));
    SamplerRng rng(Mix64(seed_ ^ Hash64(name)));
    const double a = std_dev * std::sqrt(3.0);
    for (int64_t i = 0; i < n; ++i) {
      const double u = rng.NextDouble() * 2 - 1;
      buf_[static_cast<size_t>(i)] = F32ToBF16(static_cast<float>(mean + a * u));
    }
  }

  std::string last_name_;
  uint64_t seed_;
  std::map<std::string, std::vector<int64_t>> decls_;
  std::vector<uint16_t> buf_;
};

}  // namespace

Result<std::unique_ptr<TensorSource>> OpenFolderSource(const std::string& dir) {
  RC_ASSIGN_OR_RETURN(auto folder, SafetensorsFolder::Open(dir));
  return std::unique_ptr<TensorSource>(new FolderSource(std::move(folder)));
}

std::unique_ptr<TensorSource> MakeDummySource(const ModelSpec& spec, uint64_t seed) {
  return std::make_unique<DummySource>(spec, seed);
}

WeightFill MakeWeightFill(const ModelSpec& spec, const std::function<Result<std::unique_ptr<TensorSource>>()>& open) {
  return [spec, open](int, const RankLayout& layout, ParameterStore* params) -> Status {
    RC_ASSIGN_OR_RETURN(auto source, open());
    return LoadRank(spec, layout, source.get(), params);
  };
}

std::string ModelConfigJson(const ModelSpec& s) {
  OrderedJson j;
  switch (s.arch) {
    case Architecture::kLlama: j["architectures"] = {"LlamaForCausalLM"}; j["model_type"] = "llama"; break;
    case Architecture::kQwen2: j["architectures"] = {"Qwen2ForCausalLM"}; j["model_type"] = "qwen2"; break;
    case Architecture::kQwen3: j["architectures"] = {"Qwen3ForCausalLM"}; j["model_type"] = "qwen3"; break;
  }
  j["hidden_size"] = s.hidden_size;
  j["intermediate_size"] = s.intermediate_size;
  j["num_hidden_layers"] = s.num_layers;
  j["num_attention_heads"] = s.num_heads;
  j["num_key_value_heads"] = s.num_kv_heads;
  j["head_dim"] = s.head_dim;
  j["vocab_size"] = s.vocab_size;
  j["rms_norm_eps"] = s.rms_norm_eps;
  j["rope_theta"] = s.rope_theta;
  j["max_position_embeddings"] = s.max_position_embeddings;
  j["tie_word_embeddings"] = s.tie_word_embeddings;
  j["hidden_act"] = "silu";
  if (s.arch != Architecture::kQwen2) j["attention_bias"] = s.qkv_bias;
  if (s.rope_type != "default") {
    OrderedJson r;
    r["rope_type"] = s.rope_type;
    r["factor"] = s.rope_factor;
    if (s.rope_type == "llama3") {
      r["low_freq_factor"] = s.rope_low_freq_factor;
      r["high_freq_factor"] = s.rope_high_freq_factor;
      r["original_max_position_embeddings"] = s.rope_original_max_positions;
    }
    j["rope_scaling"] = r;
  }
  if (s.bos_token_id >= 0) j["bos_token_id"] = s.bos_token_id;
  if (s.eos_token_ids.size() == 1) j["eos_token_id"] = s.eos_token_ids[0];
  if (s.eos_token_ids.size() > 1) j["eos_token_id"] = s.eos_token_ids;
  j["torch_dtype"] = "bfloat16";
  return j.dump(2) + "\n";
}

Status WriteModelFolder(const std::string& dir, const ModelSpec& spec, TensorSource* source, DType dtype) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Internal("cannot create folder '" + dir + "': " + ec.message());
  {
    std::ofstream cfg(dir + "/config.json", std::ios::trunc);
    if (!cfg) return Internal("cannot write '" + dir + "/config.json'");
    cfg << ModelConfigJson(spec);
  }
  std::vector<std::vector<uint8_t>> storage;
  std::vector<TensorToWrite> tensors;
  for (const auto& decl : HfTensorDecls(spec)) {
    RC_ASSIGN_OR_RETURN(SourceTensor t, source->Get(decl.name));
    const size_t n = t.bytes.size() / DTypeSize(t.dtype);
    std::vector<float> f(n);
    RC_RETURN_IF_ERROR(ConvertToF32(t.dtype, t.bytes.data(), n, f.data()));
    std::vector<uint8_t> out(n * DTypeSize(dtype));
    for (size_t i = 0; i < n; ++i) {
      if (dtype == DType::kBF16) {
        const uint16_t v = F32ToBF16(f[i]);
        std::memcpy(&out[2 * i], &v, 2);
      } else if (dtype == DType::kF16) {
        const uint16_t v = F32ToF16(f[i]);
        std::memcpy(&out[2 * i], &v, 2);
      } else if (dtype == DType::kF32) {
        std::memcpy(&out[4 * i], &f[i], 4);
      } else {
        return InvalidArgument("model folders are written as BF16, F16 or F32");
      }
    }
    storage.push_back(std::move(out));
    tensors.push_back({decl.name, dtype, decl.shape, std::span<const uint8_t>(storage.back())});
  }
  return WriteSafetensors(dir + "/model.safetensors", tensors, {{"format", "pt"}});
}

Status CheckFolderTensors(const ModelSpec& spec, const SafetensorsFolder& folder) {
  for (const std::string& path : folder.left_out()) {
    RC_LOG_WARN("{}: not named by {}/model.safetensors.index.json; left out", path, folder.dir());
  }
  std::set<std::string> used;
  for (const auto& d : HfTensorDecls(spec)) used.insert(d.name);
  std::vector<std::string> unknown;
  for (const std::string& name : folder.Names()) {
    if (used.count(name)) continue;
    // Older checkpoints carry RoPE's inverse frequencies, which every loader recomputes.
    if (name.ends_with(".rotary_emb.inv_freq")) continue;
    if (name == "lm_head.weight" && spec.tie_word_embeddings) {
      // Tied: vLLM and Transformers skip it; its shape must still be the embedding's.
      RC_ASSIGN_OR_RETURN(auto loc, folder.Find(name));
      const std::vector<int64_t> want = {spec.vocab_size, spec.hidden_size};
      if (loc.entry->shape != want) {
        return InvalidArgument(fmt::format("tensor 'lm_head.weight' in '{}' has shape [{}] but tie_word_embeddings is "
                                           "true and the embedding is [{}]",
                                           folder.dir(), fmt::join(loc.entry->shape, ", "), fmt::join(want, ", ")));
      }
      RC_LOG_WARN("'{}' holds lm_head.weight but config.json ties it to the embedding (tie_word_embeddings true): "
                  "lm_head.weight is ignored, as vLLM and Transformers do",
                  folder.dir());
      continue;
    }
    unknown.push_back(name);
  }
  if (unknown.empty()) return OkStatus();
  const size_t shown = std::min<size_t>(unknown.size(), 5);
  return InvalidArgument(fmt::format(
      "'{}' holds {} tensor(s) that its config.json ({}, num_hidden_layers {}) does not use: {}{}; the config does not "
      "describe this checkpoint",
      folder.dir(), unknown.size(), ArchitectureName(spec.arch), spec.num_layers,
      fmt::join(unknown.begin(), unknown.begin() + static_cast<std::ptrdiff_t>(shown), ", "),
      unknown.size() > shown ? ", ..." : ""));
}

Result<std::unique_ptr<Engine>> CreateEngine(const ModelLoadOptions& load, const EngineOptions& options) {
  std::error_code dir_ec;
  const bool is_folder = std::filesystem::is_directory(load.model, dir_ec);
  const bool is_file = !is_folder && std::filesystem::exists(load.model, dir_ec);
  // A path to a config.json (not its folder): serving it would mean random weights under the
  // name of a checkpoint that has real ones. Only --load-format dummy asks for that.
  if (is_file && load.load_format != "dummy") {
    const std::string parent = std::filesystem::path(load.model).parent_path().string();
    return InvalidArgument("--model '" + load.model + "' is a file: pass the model folder ('" +
                           (parent.empty() ? std::string(".") : parent) +
                           "') to serve its safetensors, or add --load-format dummy to serve seeded random weights "
                           "of this config");
  }
  RC_ASSIGN_OR_RETURN(ModelSpec spec, ResolveModel(load.model));
  WeightFill fill;
  // auto: a folder's safetensors, or a preset's seeded random weights (a preset has no files).
  const bool dummy = load.load_format == "dummy" || (load.load_format == "auto" && !is_folder);
  if (dummy) {
    if (load.load_format == "auto") {
      RC_LOG_WARN("--model '{}' is a preset (no folder of that name): serving seeded random weights (seed {}), as "
                  "--load-format dummy does",
                  load.model, load.seed);
    }
    const uint64_t seed = load.seed;
    fill = MakeWeightFill(spec, [spec, seed]() -> Result<std::unique_ptr<TensorSource>> {
      return MakeDummySource(spec, seed);
    });
  } else if (load.load_format == "auto" || load.load_format == "safetensors") {
    std::error_code ec;
    if (!is_folder) {
      return InvalidArgument("--model '" + load.model +
                             "' is a preset, not a folder: --load-format safetensors needs a model folder (auto or "
                             "dummy run a preset with seeded random weights)");
    }
    const std::string dir = load.model;
    // What the files can hold: every parameter takes at least 2 bytes (BF16 / F16), so a
    // config.json whose sizes describe far more than the safetensors files hold is refused before
    // the engine allocates anything for it. A folder that is only a little short (some tensors
    // missing) is left to the loader, whose error names the missing tensor; what the engine
    // allocates before it finds out is then bounded by a small multiple of the files.
    uint64_t file_bytes = 0;
    for (const auto& de : std::filesystem::directory_iterator(dir, ec)) {
      std::error_code fec;
      if (de.path().extension() == ".safetensors" && de.is_regular_file(fec)) file_bytes += de.file_size(fec);
    }
    const auto need = static_cast<uint64_t>(spec.NumParameters()) * 2;
    if (need > 2 * file_bytes + (uint64_t{1} << 20)) {
      return InvalidArgument(dir + "/config.json: its sizes (num_hidden_layers " + std::to_string(spec.num_layers) +
                             ", hidden_size " + std::to_string(spec.hidden_size) + ", intermediate_size " +
                             std::to_string(spec.intermediate_size) + ", vocab_size " + std::to_string(spec.vocab_size) +
                             ") describe " + std::to_string(spec.NumParameters()) + " parameters, at least " +
                             std::to_string(need) + " bytes of weights, but the folder's *.safetensors files hold " +
                             std::to_string(file_bytes) + " bytes");
    }
    {
      RC_ASSIGN_OR_RETURN(auto folder, SafetensorsFolder::Open(dir));
      RC_RETURN_IF_ERROR(CheckFolderTensors(spec, *folder));
    }
    fill = MakeWeightFill(spec, [dir]() { return OpenFolderSource(dir); });
  } else {
    return InvalidArgument("--load-format: expected auto, safetensors or dummy; got '" + load.load_format + "'");
  }
  EngineOptions o = options;
  if (load.weight_dtype == "f32") {
    o.weight_dtype = DType::kF32;
  } else if (load.weight_dtype == "auto") {
    if (dummy) {
      o.weight_dtype = DType::kBF16;  // the dummy source's tensors are BF16
    } else {
      RC_ASSIGN_OR_RETURN(auto source, OpenFolderSource(load.model));
      RC_ASSIGN_OR_RETURN(o.weight_dtype, WeightDTypeOf(spec, source.get()));
    }
  } else {
    return InvalidArgument("--weight-dtype: expected auto or f32; got '" + load.weight_dtype + "'");
  }
  return Engine::Create(spec, o, fill);
}

Result<DType> WeightDTypeOf(const ModelSpec& spec, TensorSource* source) {
  for (const auto& decl : HfTensorDecls(spec)) {
    RC_ASSIGN_OR_RETURN(SourceTensor t, source->Get(decl.name));
    if (t.dtype != DType::kBF16) return DType::kF32;
  }
  return DType::kBF16;
}

}  // namespace rc::engine
