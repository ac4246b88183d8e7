#include "rolloutcore/engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "rolloutcore/base/hash.h"

namespace rc::engine {

uint64_t SamplerRng::Next() {
  state_ += 0x9E3779B97F4A7C15ULL;
  uint64_t z = state_;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

double SamplerRng::NextDouble() { return static_cast<double>(Next() >> 11) * (1.0 / 9007199254740992.0); }

std::vector<float> LogSoftmax(std::span<const float> logits) {
  float mx = -INFINITY;
  for (float v : logits) mx = std::max(mx, v);
  double sum = 0;
  for (float v : logits) sum += std::exp(static_cast<double>(v) - mx);
  const double lse = mx + std::log(sum);
  std::vector<float> out(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) out[i] = static_cast<float>(static_cast<double>(logits[i]) - lse);
  return out;
}

SampleResult Sample(std::span<const float> logits, const SamplingParams& params, SamplerRng* rng) {
  SampleResult r;
  const int64_t v = static_cast<int64_t>(logits.size());
  const bool want_lp = params.num_logprobs >= 0;
  std::vector<float> lp;
  if (want_lp) lp = LogSoftmax(logits);

  if (params.temperature < kGreedyBelowTemperature) {
    int64_t best = 0;
    for (int64_t i = 1; i < v; ++i)
      if (logits[i] > logits[best]) best = i;
    r.token = static_cast<int32_t>(best);
  } else {
    std::vector<int32_t> idx(static_cast<size_t>(v));
    std::iota(idx.begin(), idx.end(), 0);
    auto by_logit = [&](int32_t a, int32_t b) { return logits[a] != logits[b] ? logits[a] > logits[b] : a < b; };
    int64_t keep = v;
    if (params.top_k > 0 && params.top_k < v) keep = params.top_k;
    if (keep < v || params.top_p < 1.0) {
      std::sort(idx.begin(), idx.end(), by_logit);
    }
    idx.resize(static_cast<size_t>(keep));
    const double inv_t = 1.0 / params.temperature;
    double mx = -std::numeric_limits<double>::infinity();
    for (int32_t i : idx) mx = std::max(mx, logits[i] * inv_t);
    std::vector<double> p(idx.size());
    double sum = 0;
    for (size_t i = 0; i < idx.size(); ++i) {
      p[i] = std::exp(logits[idx[i]] * inv_t - mx);
      sum += p[i];
    }
    size_t n = idx.size();
    if (params.top_p < 1.0) {
      double cum = 0;
      for (size_t i = 0; i < idx.size(); ++i) {
        cum += p[i] / sum;
        if (cum >= params.top_p) {
          n = i + 1;
          break;
        }
      }
      sum = 0;
      for (size_t i = 0; i < n; ++i) sum += p[i];
    }
    const double u = rng->NextDouble() * sum;
    double cum = 0;
    size_t pick = n - 1;
    for (size_t i = 0; i < n; ++i) {
      cum += p[i];
      if (u < cum) {
        pick = i;
        break;
      }
    }
    r.token = idx[pick];
  }
  if (want_lp) {
    r.logprob = lp[static_cast<size_t>(r.token)];
    const int64_t k = std::min<int64_t>(params.num_logprobs, v);
    std::vector<int32_t> idx(static_cast<size_t>(v));
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                      [&](int32_t a, int32_t b) { return lp[a] != lp[b] ? lp[a] > lp[b] : a < b; });
    for (int64_t i = 0; i < k; ++i) r.top_logprobs.emplace_back(idx[i], lp[idx[i]]);
  }
  return r;
}

}  // namespace rc::engine
