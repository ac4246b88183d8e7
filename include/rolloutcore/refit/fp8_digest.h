#pragma once
// The content digest of an FP8 image (docs/fp8.md): a parameter's E4M3 bytes and its scale grid,
// each digested with the sharding-invariant block digest of digest.h, then combined. Holders of
// parts add their parts, and the sums agree however the image is split: the TP ranks of an engine
// digest the boxes of the bytes they hold and the scale groups they own, and the total equals the
// digest of the whole image computed anywhere else (for example from the published bf16 by
// formats/fp8.h's quantizer). A wrong, stale or re-laid-out scale, or another version's bytes,
// changes it.
//
// Thread safety: pure functions.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/content_digest.h"
#include "rolloutcore/base/status.h"
#include "rolloutcore/refit/tensor.h"

namespace rc::refit {

struct Fp8ImageDigest {
  uint64_t bytes = 0;   // D (digest.h) of the E4M3 bytes as an F8_E4M3 tensor of the parameter's shape
  uint64_t scales = 0;  // D of the scales as an F32 tensor of the scale grid's shape

  Fp8ImageDigest& operator+=(const Fp8ImageDigest& o) {
    bytes += o.bytes;
    scales += o.scales;
    return *this;
  }
  friend bool operator==(const Fp8ImageDigest&, const Fp8ImageDigest&) = default;
  // Both sums in one value: xxh3-64 of the tag "rc-fp8-image-1" and the two sums.
  ContentDigest Combined() const;
};

// The part of a holder of `q_box` of the bytes (row-major E4M3 bytes of the box, 2-D: rows of the
// parameter × columns) and of `s_box` of the scale grid (row-major f32 of the box; per tensor the
// grid is {1, 1}, per channel {rows, 1}, block {ceil(rows / 128), ceil(cols / 128)}). A box with no
// elements contributes nothing: a scale every rank holds (per tensor) is owned by one of them.
Fp8ImageDigest Fp8ImagePart(const Shape& param, const Box& q_box, const uint8_t* q, const Shape& grid,
                            const Box& s_box, const float* s);

// The digest of a whole image: CombineTensorDigests (digest.h) over each parameter's Combined(),
// keyed by parameter name. What engines report as their FP8 image digest, and what a trainer's
// published parts add up to (manifest.h, PublishedFp8Image).
using Fp8Image = std::map<std::string, Fp8ImageDigest, std::less<>>;
ContentDigest Fp8ImageCombined(const Fp8Image& image);

// ---- Which parameters are served in FP8 --------------------------------------------------------
// vLLM's online FP8 methods (and the embedded engine's --quantization) quantize the projections of
// every layer, each vLLM parameter as one matrix: q, k and v fused into qkv_proj and gate and up into
// gate_up_proj (rows one part after the other, in that order), o_proj and down_proj alone.
// Embeddings, lm_head and norms stay bf16.

// The quantization names a manifest's FP8 parts are keyed by (vLLM 0.33's --quantization).
inline constexpr std::string_view kFp8Quantizations[] = {"fp8_per_tensor", "fp8_per_channel", "fp8_per_block"};
bool IsFp8Quantization(std::string_view quantization);

// The vLLM parameter a checkpoint tensor is a part of ("model.layers.0.self_attn.k_proj.weight" ->
// "model.layers.0.self_attn.qkv_proj.weight", part "k"); nullopt for a tensor served in bf16.
struct Fp8PartOf {
  std::string param;
  std::string part;  // q, k, v, o, gate, up, down
};
std::optional<Fp8PartOf> Fp8ParameterOf(std::string_view tensor);
// vLLM's order of the parts inside their fused parameters (q, k, v in qkv_proj; gate, up in gate_up_proj).
inline constexpr std::string_view kFp8PartOrder[] = {"q", "k", "v", "o", "gate", "up", "down"};

// One FP8 parameter: its fused [rows, cols] shape and its parts with the first row of each.
struct Fp8Param {
  std::string name;
  Shape shape;
  struct Part {
    std::string tensor;
    int64_t row0 = 0;
    Shape shape;
  };
  std::vector<Part> parts;  // vLLM's order
  const Part* Find(std::string_view tensor) const;
};

// The FP8 parameters of a set of tensors (every projection among `tensors`; the others are left
// out). InvalidArgument naming the tensor when a projection is not 2-D BF16, when the parts of one
// parameter differ in columns, or when a fused parameter lacks a part (k_proj without v_proj).
[[nodiscard]] Result<std::map<std::string, Fp8Param, std::less<>>> Fp8Parameters(const std::vector<TensorSpec>& tensors);

}  // namespace rc::refit
