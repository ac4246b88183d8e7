#include "rolloutcore/trainer/probes.h"

#include <fmt/format.h>

#include <map>
#include <memory>
#include <string>

#include "rolloutcore/engine/engine.h"
#include "rolloutcore/engine/loader.h"
#include "rolloutcore/refit/layouts.h"

namespace rc::trainer {
namespace {

uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// bf16(W_step) of every source tensor, whole, computed on first use.
class SyntheticSource final : public engine::TensorSource {
 public:
  SyntheticSource(const refit::ModelConfig& config, SyntheticWeights weights, int64_t step)
      : weights_(weights), step_(step) {
    auto specs = refit::ListSourceTensors(config);
    if (specs.ok()) {
      for (const auto& s : *specs) specs_.emplace(s.name, s);
    }
  }
  Result<engine::SourceTensor> Get(std::string_view name) override {
    auto it = specs_.find(std::string(name));
    if (it == specs_.end()) return NotFound(fmt::format("tensor {}: not a tensor of the synthetic model", name));
    auto& data = data_[it->first];
    if (data.empty()) {
      const refit::TensorSpec bf16{it->second.name, refit::DType::kBF16, it->second.shape};
      data = ComputeBf16(weights_, bf16, refit::FullBox(it->second.shape), step_);
    }
    engine::SourceTensor t;
    t.dtype = engine::DType::kBF16;
    t.shape = it->second.shape;
    t.bytes = std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(data.data()), data.size() * sizeof(uint16_t));
    return t;
  }

 private:
  SyntheticWeights weights_;
  int64_t step_;
  std::map<std::string, refit::TensorSpec> specs_;
  std::map<std::string, std::vector<uint16_t>> data_;
};

}  // namespace

Status ValidateProbeOptions(const ProbeOptions& o) {
  if (o.count < 0 || static_cast<size_t>(o.count) > refit::kMaxProbes) {
    return InvalidArgument(fmt::format("probes: must be in 0..{}, got {}", refit::kMaxProbes, o.count));
  }
  if (o.tokens < 1 || static_cast<size_t>(o.tokens) > refit::kMaxProbeSteps) {
    return InvalidArgument(fmt::format("probe_tokens: must be in 1..{}, got {}", refit::kMaxProbeSteps, o.tokens));
  }
  if (o.top_k < 0 || o.top_k > refit::kMaxProbeTopK) {
    return InvalidArgument(fmt::format("probe_top_k: must be in 0..{}, got {}", refit::kMaxProbeTopK, o.top_k));
  }
  if (o.prompt_tokens < 1 || static_cast<size_t>(o.prompt_tokens) > refit::kMaxProbePromptTokens) {
    return InvalidArgument(
        fmt::format("probe_prompt_tokens: must be in 1..{}, got {}", refit::kMaxProbePromptTokens, o.prompt_tokens));
  }
  return OkStatus();
}

std::vector<std::vector<int32_t>> ProbePrompts(const refit::ModelConfig& config, uint64_t seed, const ProbeOptions& o) {
  const uint64_t range = static_cast<uint64_t>(std::min<int64_t>(config.vocab_size, 256));
  std::vector<std::vector<int32_t>> out;
  for (int32_t i = 0; i < o.count; ++i) {
    std::vector<int32_t> p;
    p.reserve(static_cast<size_t>(o.prompt_tokens));
    for (int32_t k = 0; k < o.prompt_tokens; ++k) {
      p.push_back(static_cast<int32_t>(
          Mix(Mix(seed ^ 0x70726f6265ULL) + static_cast<uint64_t>(i) * 1000003ULL + static_cast<uint64_t>(k)) % range));
    }
    out.push_back(std::move(p));
  }
  return out;
}

Result<std::vector<refit::Probe>> ComputeSyntheticProbes(const refit::ModelConfig& config,
                                                         const SyntheticWeights& weights, int64_t step,
                                                         const ProbeOptions& o) {
  RC_RETURN_IF_ERROR(ValidateProbeOptions(o));
  if (o.count == 0) return std::vector<refit::Probe>{};
  RC_ASSIGN_OR_RETURN(engine::ModelSpec spec, engine::SpecFromRefitConfig(config));
  engine::EngineOptions eo;
  eo.tensor_parallel_size = 1;
  eo.num_threads = 1;
  eo.max_num_seqs = 1;
  eo.enable_prefix_caching = false;
  eo.max_model_len = std::min<int64_t>(spec.max_position_embeddings, o.prompt_tokens + o.tokens + 16);
  if (!o.quantization.empty()) {
    // The FP8 method an engine serves the published bf16 bytes with: quantized from them as kept.
    eo.weight_dtype = engine::DType::kBF16;
    eo.quantization = o.quantization;
  }
  auto fill = engine::MakeWeightFill(spec, [&]() -> Result<std::unique_ptr<engine::TensorSource>> {
    return std::unique_ptr<engine::TensorSource>(new SyntheticSource(config, weights, step));
  });
  RC_ASSIGN_OR_RETURN(std::unique_ptr<engine::Engine> e, engine::Engine::Create(spec, eo, fill));
  RC_RETURN_IF_ERROR(e->Pause(engine::PauseMode::kAbort));  // Replay runs only while paused
  std::vector<refit::Probe> out;
  const auto prompts = ProbePrompts(config, weights.seed, o);
  for (size_t i = 0; i < prompts.size(); ++i) {
    RC_ASSIGN_OR_RETURN(engine::ReplayOutput r, e->Replay(prompts[i], o.tokens, o.top_k));
    refit::Probe p;
    p.name = fmt::format("p{}", i);  // not "p" + to_string: GCC 12 -O3 reports a false -Wrestrict on it
    p.prompt = prompts[i];
    p.top_k = o.top_k;
    p.quantization = o.quantization;
    for (auto& s : r.steps) p.steps.push_back(refit::ProbeStep{s.token, s.logprob, std::move(s.top_logprobs)});
    out.push_back(std::move(p));
  }
  RC_RETURN_IF_ERROR(refit::ValidateProbes(out));
  return out;
}

}  // namespace rc::trainer
