// Layouts: how a model's tensors are split across trainer ranks (sources) and engine ranks
// (destinations), and the engine's weight loader written against the capture API.
//
// Source (HF) tensors of Llama / Qwen2 / Qwen3 / Qwen3-MoE are listed by ListSourceTensors.
//
// Trainer layouts (ParseTrainerLayout):
//   fsdp:N        every tensor dim-0 sharded over N ranks like FSDP2 / DTensor Shard(0):
//                 torch.chunk pieces of ceil(d0 / N) rows, so the last shards may be short or
//                 absent (a rank with no rows publishes no shard for that tensor).
//   tp:N          Megatron tensor parallel: column-parallel tensors (q/k/v weights and biases,
//                 gate/up, expert gate/up, embed_tokens, lm_head) split on dim 0; row-parallel
//                 ones (o_proj, down_proj, expert down) split on dim 1; the rest (norms, router)
//                 replicated on all N ranks. Splits must be even.
//   replicated[:N] every one of N (default 1) ranks holds every tensor whole.
//
// Engine layouts (ParseEngineLayout): "tp:N", "ep:M" or "tp:N+ep:M" (M == N), with an
// optional "@dtype" for the parameter dtype (default f32, the engine's compute dtype; the loader
// declares the bf16/f16 -> f32 conversion). Per rank r of N (names and row order are the engine
// contract):
//   replicated: model.embed_tokens.weight, layer norms, q_norm / k_norm, model.norm.weight,
//               lm_head.weight (from embed_tokens when tied), MoE mlp.gate.weight;
//   self_attn.qkv_proj.weight [(Hq/N + 2*KvL)*D, H] = [q heads r*Hq/N..; this rank's k heads;
//               this rank's v heads] where KvL = Hkv/N heads from r*Hkv/N when Hkv >= N, else
//               KvL = 1 head r / (N/Hkv) (replicated); qkv_proj.bias likewise (Qwen2);
//   self_attn.o_proj.weight [H, Hq/N*D] = columns r*Hq/N*D.. of o_proj;
//   mlp.gate_up_proj.weight [2*I/N, H] = [gate rows r*I/N..; up rows r*I/N..];
//   mlp.down_proj.weight [H, I/N] = columns r*I/N.. of down_proj;
//   MoE layers at ep:M, rank r owning experts r*E/M..: mlp.experts.w13_weight [E/M, 2*Im, H]
//               (per local expert [gate; up]) and mlp.experts.w2_weight [E/M, H, Im].
// Requires Hq % N == 0, I % N == 0, Hkv % N == 0 or N % Hkv == 0, E % M == 0.
//
// Thread safety: pure functions. LoadEngineRank calls only the context it is given.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/status.h"
#include "rolloutcore/refit/capture.h"
#include "rolloutcore/refit/manifest.h"
#include "rolloutcore/refit/model_config.h"
#include "rolloutcore/refit/tensor.h"

namespace rc::refit {

struct TrainerLayout {
  enum class Kind : uint8_t { kFsdp, kTp, kReplicated };
  Kind kind = Kind::kReplicated;
  int32_t ranks = 1;
  std::string ToString() const;
};
[[nodiscard]] Result<TrainerLayout> ParseTrainerLayout(std::string_view text);

struct EngineLayout {
  int32_t tp = 1;
  int32_t ep = 1;  // expert-parallel size; 1 = every rank holds every expert
  DType param_dtype = DType::kF32;
  int32_t world_size() const { return tp > ep ? tp : ep; }
  std::string ToString() const;
};
[[nodiscard]] Result<EngineLayout> ParseEngineLayout(std::string_view text);

// The HF tensors of the model (name, checkpoint dtype, shape) in a fixed order.
[[nodiscard]] Result<std::vector<TensorSpec>> ListSourceTensors(const ModelConfig& config);

// The shard tables a trainer in `layout` would publish (handles empty, digests zero).
[[nodiscard]] Result<Manifest> MakeTrainerManifest(const ModelConfig& config, const TrainerLayout& layout,
                                                   std::string version = "");

// InvalidArgument naming the model, layout and the sizes that do not divide.
[[nodiscard]] Status CheckEngineLayout(const ModelConfig& config, const EngineLayout& layout);

// The parameters engine rank `rank` allocates (name, param dtype, local shape).
[[nodiscard]] Result<std::vector<TensorSpec>> ListEngineParams(const ModelConfig& config,
                                                               const EngineLayout& layout, int32_t rank);

// The engine's weight loader: fills every parameter of `rank` from HF source tensors through
// `ctx`. The same code captures (CaptureContext) and loads for real (MaterializeContext).
[[nodiscard]] Status LoadEngineRank(const ModelConfig& config, const EngineLayout& layout, int32_t rank,
                                    LoadContext& ctx);

// Runs the loader for `rank` in a CaptureContext over the model's source tensors.
[[nodiscard]] Result<Capture> CaptureEngineRank(const ModelConfig& config, const EngineLayout& layout,
                                                int32_t rank);

}  // namespace rc::refit
