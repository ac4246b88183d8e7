#include "rolloutcore/trainer/export.h"

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <span>
#include <vector>

#include "rolloutcore/base/cpu_features.h"
#include "rolloutcore/base/hash.h"
#include "rolloutcore/formats/safetensors.h"
#include "rolloutcore/refit/digest.h"
#include "rolloutcore/refit/layouts.h"

namespace rc::trainer {
namespace {

std::string_view ArchitectureClass(refit::Architecture a) {
  switch (a) {
    case refit::Architecture::kLlama: return "LlamaForCausalLM";
    case refit::Architecture::kQwen2: return "Qwen2ForCausalLM";
    case refit::Architecture::kQwen3: return "Qwen3ForCausalLM";
    case refit::Architecture::kQwen3Moe: return "Qwen3MoeForCausalLM";
  }
  return "LlamaForCausalLM";
}

}  // namespace

Json ModelConfigToJson(const refit::ModelConfig& c) {
  Json j;
  j["architectures"] = Json::array({std::string(ArchitectureClass(c.architecture))});
  j["model_type"] = std::string(refit::ArchitectureName(c.architecture));
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  j["vocab_size"] = c.vocab_size;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;
  if (c.rope_scaling.type == "default") {
    j["rope_scaling"] = nullptr;
  } else {
    Json rs{{"rope_type", c.rope_scaling.type}, {"factor", c.rope_scaling.factor}};
    if (c.rope_scaling.type == "llama3") {
      rs["low_freq_factor"] = c.rope_scaling.low_freq_factor;
      rs["high_freq_factor"] = c.rope_scaling.high_freq_factor;
      rs["original_max_position_embeddings"] = c.rope_scaling.original_max_position_embeddings;
    }
    j["rope_scaling"] = rs;
  }
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["attention_bias"] = c.attention_bias;
  j["hidden_act"] = "silu";
  j["torch_dtype"] = "bfloat16";
  if (c.is_moe()) {
    j["num_experts"] = c.num_experts;
    j["moe_intermediate_size"] = c.moe_intermediate_size;
    j["num_experts_per_tok"] = c.num_experts_per_tok;
    j["norm_topk_prob"] = c.norm_topk_prob;
    j["decoder_sparse_step"] = c.decoder_sparse_step;
    j["mlp_only_layers"] = c.mlp_only_layers;
  }
  return j;
}

Result<ExportResult> ExportVersion(const refit::ModelConfig& config, const SyntheticWeights& weights, int64_t step,
                                   const std::string& out_dir) {
  if (step < 0) return InvalidArgument(fmt::format("export: step must be >= 0, got {}", step));
  RC_ASSIGN_OR_RETURN(std::vector<refit::TensorSpec> specs, refit::ListSourceTensors(config));
  // The export holds every tensor (BF16) in memory and writes them to one file: refused before
  // anything is allocated when either does not fit, instead of growing until the kernel kills the
  // process (or another one).
  uint64_t need = 0;
  for (const refit::TensorSpec& s : specs) {
    uint64_t n = 2;
    for (int64_t d : s.shape) n *= static_cast<uint64_t>(d);
    need += n;
  }
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  const double have_memory = PhysicalMemoryBytes();
  if (have_memory > 0 && static_cast<double>(need) > have_memory) {
    return InvalidArgument(fmt::format(
        "export: model {} has {} parameters, {:.1f} GiB as BF16, which the export holds in memory; this machine has "
        "{:.1f} GiB",
        config.name, config.num_parameters(), static_cast<double>(need) / kGiB, have_memory / kGiB));
  }
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) return Unavailable(fmt::format("export: cannot create folder {}: {}", out_dir, ec.message()));
  if (const auto space = std::filesystem::space(out_dir, ec); !ec && space.available < need) {
    return FailedPrecondition(fmt::format("export: {} needs {:.1f} GiB for model.safetensors but its file system has "
                                         "{:.1f} GiB free",
                                         out_dir, static_cast<double>(need) / kGiB,
                                         static_cast<double>(space.available) / kGiB));
  }

  ExportResult result;
  result.config_path = (std::filesystem::path(out_dir) / "config.json").string();
  result.weights_path = (std::filesystem::path(out_dir) / "model.safetensors").string();

  std::vector<std::vector<uint16_t>> data;
  data.reserve(specs.size());
  std::vector<formats::TensorToWrite> tensors;
  for (const refit::TensorSpec& s : specs) {
    const refit::TensorSpec bf16{s.name, refit::DType::kBF16, s.shape};
    const refit::Box full = refit::FullBox(s.shape);
    data.push_back(ComputeBf16(weights, bf16, full, step));
    const std::vector<uint16_t>& d = data.back();
    result.digests[s.name] = refit::DigestBlock(refit::DType::kBF16, s.shape, full, d.data());
    const auto bytes = std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(d.data()), d.size() * sizeof(uint16_t));
    result.bytes += bytes.size();
    tensors.push_back(formats::TensorToWrite{s.name, formats::DType::kBF16, s.shape, bytes});
  }
  result.content_digest = refit::CombineTensorDigests(result.digests);

  const std::map<std::string, std::string> metadata = {
      {"format", "pt"},
      {"rolloutcore.version", VersionLabel(step)},
      {"rolloutcore.seed", std::to_string(weights.seed)},
      {"rolloutcore.lr", fmt::format("{}", weights.lr)},
      {"rolloutcore.content_digest", Hex64(result.content_digest)},
  };
  RC_RETURN_IF_ERROR(formats::WriteSafetensors(result.weights_path, tensors, metadata));

  std::ofstream f(result.config_path, std::ios::trunc);
  f << ModelConfigToJson(config).dump(2) << "\n";
  f.close();
  if (!f) return Unavailable(fmt::format("export: cannot write {}", result.config_path));
  return result;
}

}  // namespace rc::trainer
