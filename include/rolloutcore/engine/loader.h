// Model sources and weight loading for the engine.
//
// A model comes from a preset or a Hugging Face folder (config.json + *.safetensors, BF16 /
// F16 / F32). Weights come from a TensorSource: HF tensor name -> (dtype, shape, bytes). The
// folder source reads safetensors; the dummy source makes seeded random HF tensors (rounded to
// bf16, so `model init` writes exactly what `--load-format dummy` computes with). One loader
// shards a source into every rank's engine parameters (fused qkv_proj / gate_up_proj, column /
// row parallel, see model_spec.h), checking every name and shape with an error naming the
// tensor. The same source drives `rolloutcore model init`.
//
// Thread safety: TensorSource implementations are not shared between threads; the rest is pure.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/status.h"
#include "rolloutcore/engine/engine.h"
#include "rolloutcore/engine/model_spec.h"
#include "rolloutcore/engine/safetensors.h"
#include "rolloutcore/refit/model_config.h"

namespace rc::engine {

// Resolves a preset name (tiny, tiny-llama, tiny-qwen2, qwen3-0.6b-like, ...) or a model
// folder / config.json path into a ModelSpec. Unsupported architectures (MoE) and rope scaling
// types other than default / llama3 / linear are InvalidArgument.
Result<ModelSpec> ResolveModel(std::string_view preset_or_path);
std::vector<std::string> EnginePresetNames();

struct SourceTensor {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::span<const uint8_t> bytes;  // valid until the next Get on the same source
};

class TensorSource {
 public:
  virtual ~TensorSource() = default;
  // NotFound naming the tensor when absent.
  virtual Result<SourceTensor> Get(std::string_view name) = 0;
};

// The Hugging Face tensors (name, shape) a model of this spec has.
struct HfTensorDecl {
  std::string name;
  std::vector<int64_t> shape;
};
std::vector<HfTensorDecl> HfTensorDecls(const ModelSpec& spec);

// Safetensors files of a folder.
Result<std::unique_ptr<TensorSource>> OpenFolderSource(const std::string& dir);
// Seeded random weights (bf16-rounded), deterministic in (spec, seed, tensor name).
std::unique_ptr<TensorSource> MakeDummySource(const ModelSpec& spec, uint64_t seed);

// Shards every tensor of `source` into one rank's engine parameters.
Status LoadRank(const ModelSpec& spec, const RankLayout& layout, TensorSource* source, ParameterStore* params);

// A WeightFill for Engine::Create / InstallWeights that opens a fresh source per rank.
WeightFill MakeWeightFill(const ModelSpec& spec, const std::function<Result<std::unique_ptr<TensorSource>>()>& open);

// Writes spec + weights from `source` as a HF folder: config.json and model.safetensors
// (tensors in `dtype`, BF16 by default). Used by `rolloutcore model init`.
Status WriteModelFolder(const std::string& dir, const ModelSpec& spec, TensorSource* source,
                        DType dtype = DType::kBF16);
// The refit module's view of a spec (what the capture-aware loader and the planner use).
refit::ModelConfig RefitConfigFromSpec(const ModelSpec& spec);

// The refit module's name of an engine dtype (InvalidArgument for one it has none for).
Result<refit::DType> RefitDType(DType dtype);

// The dtype an engine keeps the weights of `source` in (parameters.h): BF16 when every tensor
// of the model is BF16, F32 otherwise (F32 checkpoints; F16 or mixed checkpoints are widened to
// F32, as before). Errors of the source (a missing tensor) are returned as they are.
Result<DType> WeightDTypeOf(const ModelSpec& spec, TensorSource* source);

// The engine's spec of a refit model config (what ResolveModel does for presets; no eos / bos).
Result<ModelSpec> SpecFromRefitConfig(const refit::ModelConfig& config);

// config.json text for a spec (HF field names).
std::string ModelConfigJson(const ModelSpec& spec);

// Every tensor of a model folder must be one the spec uses (HfTensorDecls): a checkpoint with
// tensors its config.json does not describe (more layers, q/k norms under model_type llama, a
// stray tensor) would be served as a different model. Allowed besides: *.rotary_emb.inv_freq
// (recomputed), and lm_head.weight of a tied model when its shape is the embedding's (ignored,
// as vLLM and Transformers do; logged). InvalidArgument naming the folder and the first tensors.
Status CheckFolderTensors(const ModelSpec& spec, const SafetensorsFolder& folder);

// Everything `engine serve` / tests need to build an engine from flags.
struct ModelLoadOptions {
  std::string model;          // preset name or folder (a config.json file only with load_format dummy)
  std::string load_format = "auto";  // "auto" (safetensors) or "dummy"
  uint64_t seed = 0;
  // "auto": the weights' own dtype (WeightDTypeOf; dummy weights are BF16); "f32": always widen
  // to F32 (the engine before weights kept their dtype; for comparisons).
  std::string weight_dtype = "auto";
};
Result<std::unique_ptr<Engine>> CreateEngine(const ModelLoadOptions& load, const EngineOptions& options);

}  // namespace rc::engine
