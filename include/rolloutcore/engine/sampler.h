// Sampler: turns one row of logits into a token and its log-probabilities.
//
// Greedy (temperature below kGreedyBelowTemperature, 0 included) is argmax with the lowest token id winning ties. Otherwise the logits
// are divided by the temperature, restricted by top-k then top-p (nucleus), and a token is
// drawn with the request's own random stream (SplitMix64-based, seeded by the request's seed or
// by the engine), so a seeded request is reproducible independent of batching. Reported
// logprobs are the model's raw log-softmax (before temperature / top-k / top-p), as vLLM's
// default "raw_logprobs" mode reports them.
//
// Thread safety: SamplerRng is a value owned by one request; the functions are pure.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

namespace rc::engine {

// Temperatures below this sample greedily, as vLLM's (its _SAMPLING_EPS): dividing the logits by
// a smaller one overflows (1 / 5e-324 is infinite) and would pick a token at random.
inline constexpr double kGreedyBelowTemperature = 1e-5;

struct SamplingParams {
  double temperature = 1.0;
  double top_p = 1.0;
  int64_t top_k = -1;  // <= 0: disabled
  int64_t num_logprobs = -1;  // < 0: none; k >= 0: the top-k alternatives
  int64_t max_tokens = 16;
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids;
  std::optional<uint64_t> seed;
};

class SamplerRng {
 public:
  explicit SamplerRng(uint64_t seed = 0) : state_(seed) {}
  uint64_t Next();
  double NextDouble();  // uniform in [0, 1)

 private:
  uint64_t state_;
};

struct SampleResult {
  int32_t token = 0;
  float logprob = 0.f;                                  // raw logprob of the chosen token
  std::vector<std::pair<int32_t, float>> top_logprobs;  // top num_logprobs, best first
};

SampleResult Sample(std::span<const float> logits, const SamplingParams& params, SamplerRng* rng);
// Raw log-softmax of a row (double accumulation).
std::vector<float> LogSoftmax(std::span<const float> logits);

}  // namespace rc::engine
