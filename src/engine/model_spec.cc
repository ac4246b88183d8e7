#include "rolloutcore/engine/model_spec.h"

#include "rolloutcore/refit/model_config.h"

namespace rc::engine {

std::string_view ArchitectureName(Architecture a) {
  switch (a) {
    case Architecture::kLlama: return "llama";
    case Architecture::kQwen2: return "qwen2";
    case Architecture::kQwen3: return "qwen3";
  }
  return "?";
}

Status ModelSpec::Validate() const {
  auto positive = [](int64_t v, const char* name) -> Status {
    if (v <= 0) return InvalidArgument(std::string("model config ") + name + " must be positive, got " + std::to_string(v));
    return OkStatus();
  };
  RC_RETURN_IF_ERROR(positive(vocab_size, "vocab_size"));
  RC_RETURN_IF_ERROR(positive(hidden_size, "hidden_size"));
  RC_RETURN_IF_ERROR(positive(intermediate_size, "intermediate_size"));
  RC_RETURN_IF_ERROR(positive(num_layers, "num_hidden_layers"));
  RC_RETURN_IF_ERROR(positive(num_heads, "num_attention_heads"));
  RC_RETURN_IF_ERROR(positive(num_kv_heads, "num_key_value_heads"));
  RC_RETURN_IF_ERROR(positive(head_dim, "head_dim"));
  // The same bounds the config parser applies (rolloutcore/refit/model_config.h), so that a spec
  // made by hand cannot overflow NumParameters or make the engine allocate without bound either.
  auto at_most = [](int64_t v, const char* name, int64_t max) -> Status {
    if (v > max) {
      return InvalidArgument(std::string("model config ") + name + " " + std::to_string(v) + " exceeds the limit " +
                             std::to_string(max));
    }
    return OkStatus();
  };
  RC_RETURN_IF_ERROR(at_most(num_layers, "num_hidden_layers", refit::kMaxModelLayers));
  RC_RETURN_IF_ERROR(at_most(hidden_size, "hidden_size", int64_t{1} << 17));
  RC_RETURN_IF_ERROR(at_most(num_heads, "num_attention_heads", 1024));
  RC_RETURN_IF_ERROR(at_most(num_kv_heads, "num_key_value_heads", 1024));
  RC_RETURN_IF_ERROR(at_most(head_dim, "head_dim", 1024));
  RC_RETURN_IF_ERROR(at_most(vocab_size, "vocab_size", int64_t{1} << 24));
  RC_RETURN_IF_ERROR(at_most(intermediate_size, "intermediate_size", int64_t{1} << 20));
  RC_RETURN_IF_ERROR(at_most(max_position_embeddings, "max_position_embeddings", int64_t{1} << 30));
  if (head_dim % 2 != 0) return InvalidArgument("model config head_dim must be even, got " + std::to_string(head_dim));
  if (num_heads % num_kv_heads != 0) {
    return InvalidArgument("model config num_attention_heads " + std::to_string(num_heads) +
                           " is not a multiple of num_key_value_heads " + std::to_string(num_kv_heads));
  }
  if (!(rope_theta > 0)) return InvalidArgument("model config rope_theta must be positive");
  return OkStatus();
}

int64_t ModelSpec::NumParameters() const {
  const int64_t d = head_dim, h = hidden_size;
  int64_t per_layer = (num_heads + 2 * num_kv_heads) * d * h + h * num_heads * d +
                      3 * intermediate_size * h + 2 * h;
  if (qkv_bias) per_layer += (num_heads + 2 * num_kv_heads) * d;
  if (qk_norm) per_layer += 2 * d;
  return vocab_size * h * (tie_word_embeddings ? 1 : 2) + num_layers * per_layer + h;
}

Result<RankLayout> MakeRankLayout(const ModelSpec& spec, int tp, int rank) {
  if (tp <= 0 || rank < 0 || rank >= tp) {
    return InvalidArgument("tensor parallel rank " + std::to_string(rank) + " of " + std::to_string(tp) + " is invalid");
  }
  if (spec.num_heads % tp != 0) {
    return InvalidArgument("tensor-parallel-size " + std::to_string(tp) + " does not divide num_attention_heads " +
                           std::to_string(spec.num_heads));
  }
  if (spec.intermediate_size % tp != 0) {
    return InvalidArgument("tensor-parallel-size " + std::to_string(tp) + " does not divide intermediate_size " +
                           std::to_string(spec.intermediate_size));
  }
  RankLayout l;
  l.tp = tp;
  l.rank = rank;
  l.q_heads = spec.num_heads / tp;
  l.intermediate = spec.intermediate_size / tp;
  if (spec.num_kv_heads >= tp) {
    if (spec.num_kv_heads % tp != 0) {
      return InvalidArgument("tensor-parallel-size " + std::to_string(tp) + " does not divide num_key_value_heads " +
                             std::to_string(spec.num_kv_heads));
    }
    l.kv_heads = spec.num_kv_heads / tp;
    l.first_kv_head = rank * l.kv_heads;
  } else {
    if (tp % spec.num_kv_heads != 0) {
      return InvalidArgument("tensor-parallel-size " + std::to_string(tp) + " is not a multiple of num_key_value_heads " +
                             std::to_string(spec.num_kv_heads));
    }
    l.kv_heads = 1;
    l.first_kv_head = rank / (tp / spec.num_kv_heads);
  }
  return l;
}

}  // namespace rc::engine

#include <cmath>

namespace rc::engine {

std::vector<float> RopeInvFreq(const ModelSpec& spec) {
  const int64_t half = spec.head_dim / 2;
  std::vector<float> inv(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    // Hugging Face: 1 / theta ** (arange(0, dim, 2).float() / dim), in f32.
    const float expo = static_cast<float>(2 * i) / static_cast<float>(spec.head_dim);
    float f = static_cast<float>(1.0 / std::pow(spec.rope_theta, static_cast<double>(expo)));
    if (spec.rope_type == "linear") {
      f = static_cast<float>(f / spec.rope_factor);
    } else if (spec.rope_type == "llama3") {
      const double low_wl = spec.rope_original_max_positions / spec.rope_low_freq_factor;
      const double high_wl = spec.rope_original_max_positions / spec.rope_high_freq_factor;
      const double wl = 2 * M_PI / f;
      if (wl > low_wl) {
        f = static_cast<float>(f / spec.rope_factor);
      } else if (wl >= high_wl) {
        const double smooth = (spec.rope_original_max_positions / wl - spec.rope_low_freq_factor) /
                              (spec.rope_high_freq_factor - spec.rope_low_freq_factor);
        f = static_cast<float>((1 - smooth) * f / spec.rope_factor + smooth * f);
      }
    }
    inv[static_cast<size_t>(i)] = f;
  }
  return inv;
}

}  // namespace rc::engine
