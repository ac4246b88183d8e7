// Probe records: what a trainer attaches to a published version so that an engine can prove, by
// replaying them, that it computes with the weights as the trainer does (docs/lifecycle.md,
// "Replay validation").
//
// A probe is a prompt (token ids) plus the trainer's own greedy continuation of `steps` tokens
// on the weights it published: per step the chosen token, its log-probability and the top_k
// alternatives (token id, log-probability; best first). The content digest proves that the bytes
// in the live parameters are the published bytes *through the captured mapping*; a replay proves
// that the mapping itself is right (a fused qkv split in the wrong order, a transposed shard, a
// missed derived tensor all leave the digest intact and change these numbers).
//
// Sizes are bounded (the records travel with every version in the directory): at most
// kMaxProbes probes, prompts of 1..kMaxProbePromptTokens tokens, 1..kMaxProbeSteps steps,
// top_k 0..kMaxProbeTopK. ValidateProbes checks them and names the bad field
// ("probes[1].steps[3].top[0].logprob: must be finite and <= 0, got nan").
//
// Thread safety: values and pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "rolloutcore/base/json.h"
#include "rolloutcore/base/status.h"

namespace rc::refit {

inline constexpr size_t kMaxProbes = 16;
inline constexpr size_t kMaxProbePromptTokens = 512;
inline constexpr size_t kMaxProbeSteps = 64;
inline constexpr int32_t kMaxProbeTopK = 20;
inline constexpr size_t kMaxProbeNameLength = 64;

struct ProbeStep {
  int32_t token = 0;                           // the greedy (argmax) token
  float logprob = 0.f;                         // its raw log-softmax value
  std::vector<std::pair<int32_t, float>> top;  // top_k alternatives, best first
};

struct Probe {
  std::string name;              // 1..kMaxProbeNameLength of [A-Za-z0-9._-]
  std::vector<int32_t> prompt;   // token ids
  int32_t top_k = 0;             // entries in every step's `top`
  std::vector<ProbeStep> steps;  // the greedy continuation, one entry per generated token
  // "" (computed on the published weights as they are), or the quantization the trainer computed
  // it under: an engine's --quantization value (e.g. fp8_per_block), the published bf16 weights
  // quantized and dequantized by docs/fp8.md's rule. A replay compares a probe only with an engine
  // serving the same quantization. 0..kMaxProbeQuantizationLength of [a-z0-9_].
  std::string quantization = {};
};
inline constexpr size_t kMaxProbeQuantizationLength = 32;

// Checks the bounds above, unique names, non-negative token ids, finite log-probabilities
// <= kMaxProbeLogprob, `top` of exactly top_k entries in non-increasing order.
[[nodiscard]] Status ValidateProbes(const std::vector<Probe>& probes);
inline constexpr float kMaxProbeLogprob = 1e-3f;  // log-softmax is <= 0; slack for rounding

// {"name", "prompt": [...], "top_k", "steps": [{"token", "logprob", "top": [[id, lp], ...]}]}.
Json ProbeToJson(const Probe& probe);
Json ProbesToJson(const std::vector<Probe>& probes);
// Parses and validates; errors name the field under `path` (e.g. "probes").
[[nodiscard]] Result<std::vector<Probe>> ProbesFromJson(const Json& j, std::string_view path = "probes");

}  // namespace rc::refit
