// ModelSpec: the geometry the engine computes with (architecture, sizes, heads, RoPE, norms),
// and RankLayout: what one tensor-parallel rank owns of it.
//
// A ModelSpec is derived from a model's config (see loader.h, which converts the refit
// module's rc::refit::ModelConfig); the engine never reads config.json itself. Engine
// parameters per rank at tensor-parallel size N, rank r (the layout the refit loaders
// produce): replicated embed_tokens [V,H], norms, q_norm/k_norm [D], lm_head [V,H];
// qkv_proj [(Hq/N + 2*KvL)*D, H] = [q heads of r; k heads; v heads], where KvL = Hkv/N when
// Hkv >= N and otherwise 1 replicated kv head r/(N/Hkv); o_proj [H, Hq/N*D] (row parallel);
// gate_up_proj [2*I/N, H] = [gate; up]; down_proj [H, I/N] (row parallel).
//
// Thread safety: plain values.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/status.h"

namespace rc::engine {

enum class Architecture { kLlama, kQwen2, kQwen3 };
std::string_view ArchitectureName(Architecture a);

struct ModelSpec {
  Architecture arch = Architecture::kLlama;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  // Rope scaling: "default", "linear" (factor) or "llama3" (factor, low/high freq factors,
  // original max positions).
  std::string rope_type = "default";
  double rope_factor = 1.0;
  double rope_low_freq_factor = 1.0;
  double rope_high_freq_factor = 4.0;
  int64_t rope_original_max_positions = 0;
  int64_t max_position_embeddings = 2048;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // Qwen2 (and Llama with attention_bias)
  bool qk_norm = false;   // Qwen3
  std::vector<int32_t> eos_token_ids;
  int32_t bos_token_id = -1;

  // Rejects zero sizes, heads not dividing, head_dim odd, ...
  Status Validate() const;
  int64_t NumParameters() const;
};

struct RankLayout {
  int tp = 1;
  int rank = 0;
  int64_t q_heads = 0;        // local query heads
  int64_t kv_heads = 0;       // local kv heads (KvL)
  int64_t first_kv_head = 0;  // global index of the first local kv head
  int64_t intermediate = 0;   // local intermediate size
};

// RoPE inverse frequencies (head_dim / 2 of them), with the spec's scaling applied.
std::vector<float> RopeInvFreq(const ModelSpec& spec);

// InvalidArgument when tp does not divide the heads / intermediate size, or when
// kv heads < tp and tp is not a multiple of them.
Result<RankLayout> MakeRankLayout(const ModelSpec& spec, int tp, int rank);

}  // namespace rc::engine
