#include "rolloutcore/refit/probes.h"

#include <algorithm>
#include <fmt/format.h>

#include <cmath>
#include <set>

namespace rc::refit {
namespace {

bool NameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
}

Status CheckLogprob(float lp, const std::string& path) {
  if (!std::isfinite(lp) || lp > kMaxProbeLogprob) {
    return InvalidArgument(fmt::format("{}: must be finite and <= 0, got {}", path, lp));
  }
  return OkStatus();
}

Status CheckToken(int64_t t, const std::string& path) {
  if (t < 0 || t > INT32_MAX) return InvalidArgument(fmt::format("{}: token id must be in [0, 2^31), got {}", path, t));
  return OkStatus();
}

Result<float> LogprobFromJson(const Json& j, const std::string& path) {
  if (!j.is_number()) return InvalidArgument(fmt::format("{}: expected a number, got {}", path, JsonTypeName(j)));
  const float lp = j.get<float>();
  RC_RETURN_IF_ERROR(CheckLogprob(lp, path));
  return lp;
}

Result<int32_t> TokenFromJson(const Json& j, const std::string& path) {
  if (!j.is_number_integer())
    return InvalidArgument(fmt::format("{}: expected an integer, got {}", path, JsonTypeName(j)));
  const int64_t t = j.get<int64_t>();
  RC_RETURN_IF_ERROR(CheckToken(t, path));
  return static_cast<int32_t>(t);
}

}  // namespace

Status ValidateProbes(const std::vector<Probe>& probes) {
  if (probes.size() > kMaxProbes) {
    return InvalidArgument(fmt::format("probes: {} probes, at most {} allowed", probes.size(), kMaxProbes));
  }
  std::set<std::string> names;
  for (size_t i = 0; i < probes.size(); ++i) {
    const Probe& p = probes[i];
    const std::string path = fmt::format("probes[{}]", i);
    if (p.name.empty() || p.name.size() > kMaxProbeNameLength) {
      return InvalidArgument(
          fmt::format("{}.name: must be 1..{} characters, got {}", path, kMaxProbeNameLength, p.name.size()));
    }
    for (char c : p.name) {
      if (!NameChar(c))
        return InvalidArgument(fmt::format("{}.name: '{}' has a character outside [A-Za-z0-9._-]", path, p.name));
    }
    if (!names.insert(p.name).second) return InvalidArgument(fmt::format("{}.name: '{}' appears twice", path, p.name));
    if (p.quantization.size() > kMaxProbeQuantizationLength ||
        !std::all_of(p.quantization.begin(), p.quantization.end(),
                     [](char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_'; })) {
      return InvalidArgument(fmt::format("{}.quantization: '{}' must be 0..{} characters of [a-z0-9_]", path,
                                         p.quantization, kMaxProbeQuantizationLength));
    }
    if (p.prompt.empty() || p.prompt.size() > kMaxProbePromptTokens) {
      return InvalidArgument(
          fmt::format("{}.prompt: must have 1..{} tokens, got {}", path, kMaxProbePromptTokens, p.prompt.size()));
    }
    for (size_t k = 0; k < p.prompt.size(); ++k) {
      RC_RETURN_IF_ERROR(CheckToken(p.prompt[k], fmt::format("{}.prompt[{}]", path, k)));
    }
    if (p.top_k < 0 || p.top_k > kMaxProbeTopK) {
      return InvalidArgument(fmt::format("{}.top_k: must be in 0..{}, got {}", path, kMaxProbeTopK, p.top_k));
    }
    if (p.steps.empty() || p.steps.size() > kMaxProbeSteps) {
      return InvalidArgument(
          fmt::format("{}.steps: must have 1..{} entries, got {}", path, kMaxProbeSteps, p.steps.size()));
    }
    for (size_t s = 0; s < p.steps.size(); ++s) {
      const ProbeStep& st = p.steps[s];
      const std::string sp = fmt::format("{}.steps[{}]", path, s);
      RC_RETURN_IF_ERROR(CheckToken(st.token, sp + ".token"));
      RC_RETURN_IF_ERROR(CheckLogprob(st.logprob, sp + ".logprob"));
      if (st.top.size() != static_cast<size_t>(p.top_k)) {
        return InvalidArgument(fmt::format("{}.top: {} entries, top_k is {}", sp, st.top.size(), p.top_k));
      }
      for (size_t k = 0; k < st.top.size(); ++k) {
        const std::string tp = fmt::format("{}.top[{}]", sp, k);
        RC_RETURN_IF_ERROR(CheckToken(st.top[k].first, tp + ".token"));
        RC_RETURN_IF_ERROR(CheckLogprob(st.top[k].second, tp + ".logprob"));
        if (k > 0 && st.top[k].second > st.top[k - 1].second) {
          return InvalidArgument(fmt::format("{}.logprob: {} is above the previous entry's {} (top must be best first)",
                                             tp, st.top[k].second, st.top[k - 1].second));
        }
      }
    }
  }
  return OkStatus();
}

Json ProbeToJson(const Probe& p) {
  Json steps = Json::array();
  for (const ProbeStep& s : p.steps) {
    Json top = Json::array();
    for (const auto& [t, lp] : s.top) top.push_back(Json::array({t, lp}));
    steps.push_back(Json{{"token", s.token}, {"logprob", s.logprob}, {"top", top}});
  }
  Json j{{"name", p.name}, {"prompt", p.prompt}, {"top_k", p.top_k}, {"steps", steps}};
  if (!p.quantization.empty()) j["quantization"] = p.quantization;
  return j;
}

Json ProbesToJson(const std::vector<Probe>& probes) {
  Json out = Json::array();
  for (const Probe& p : probes) out.push_back(ProbeToJson(p));
  return out;
}

Result<std::vector<Probe>> ProbesFromJson(const Json& j, std::string_view where) {
  const std::string base(where);
  if (!j.is_array()) return InvalidArgument(fmt::format("{}: expected an array, got {}", base, JsonTypeName(j)));
  if (j.size() > kMaxProbes) {
    return InvalidArgument(fmt::format("{}: {} probes, at most {} allowed", base, j.size(), kMaxProbes));
  }
  std::vector<Probe> out;
  for (size_t i = 0; i < j.size(); ++i) {
    const Json& pj = j[i];
    const std::string path = fmt::format("{}[{}]", base, i);
    if (!pj.is_object()) return InvalidArgument(fmt::format("{}: expected an object, got {}", path, JsonTypeName(pj)));
    RC_RETURN_IF_ERROR(CheckKnownKeys(pj, {"name", "prompt", "top_k", "steps", "quantization"}, path));
    Probe p;
    RC_ASSIGN_OR_RETURN(p.name, GetString(pj, "name", path));
    if (pj.contains("quantization")) {
      RC_ASSIGN_OR_RETURN(p.quantization, GetString(pj, "quantization", path));
    }
    RC_ASSIGN_OR_RETURN(int64_t top_k, GetNonNegativeInt(pj, "top_k", path, 0));
    if (top_k > kMaxProbeTopK) {
      return InvalidArgument(fmt::format("{}.top_k: must be in 0..{}, got {}", path, kMaxProbeTopK, top_k));
    }
    p.top_k = static_cast<int32_t>(top_k);
    auto prompt = pj.find("prompt");
    if (prompt == pj.end() || !prompt->is_array())
      return InvalidArgument(path + ".prompt: expected an array of token ids");
    if (prompt->size() > kMaxProbePromptTokens) {
      return InvalidArgument(
          fmt::format("{}.prompt: must have 1..{} tokens, got {}", path, kMaxProbePromptTokens, prompt->size()));
    }
    for (size_t k = 0; k < prompt->size(); ++k) {
      RC_ASSIGN_OR_RETURN(int32_t t, TokenFromJson((*prompt)[k], fmt::format("{}.prompt[{}]", path, k)));
      p.prompt.push_back(t);
    }
    auto steps = pj.find("steps");
    if (steps == pj.end() || !steps->is_array()) return InvalidArgument(path + ".steps: expected an array");
    if (steps->size() > kMaxProbeSteps) {
      return InvalidArgument(
          fmt::format("{}.steps: must have 1..{} entries, got {}", path, kMaxProbeSteps, steps->size()));
    }
    for (size_t s = 0; s < steps->size(); ++s) {
      const Json& sj = (*steps)[s];
      const std::string sp = fmt::format("{}.steps[{}]", path, s);
      if (!sj.is_object()) return InvalidArgument(fmt::format("{}: expected an object, got {}", sp, JsonTypeName(sj)));
      RC_RETURN_IF_ERROR(CheckKnownKeys(sj, {"token", "logprob", "top"}, sp));
      ProbeStep st;
      auto tok = sj.find("token");
      if (tok == sj.end()) return InvalidArgument(sp + ".token: missing");
      RC_ASSIGN_OR_RETURN(st.token, TokenFromJson(*tok, sp + ".token"));
      auto lp = sj.find("logprob");
      if (lp == sj.end()) return InvalidArgument(sp + ".logprob: missing");
      RC_ASSIGN_OR_RETURN(st.logprob, LogprobFromJson(*lp, sp + ".logprob"));
      auto top = sj.find("top");
      if (top != sj.end()) {
        if (!top->is_array() || top->size() > static_cast<size_t>(kMaxProbeTopK)) {
          return InvalidArgument(
              fmt::format("{}.top: expected an array of at most {} [token, logprob] pairs", sp, kMaxProbeTopK));
        }
        for (size_t k = 0; k < top->size(); ++k) {
          const Json& e = (*top)[k];
          const std::string tp = fmt::format("{}.top[{}]", sp, k);
          if (!e.is_array() || e.size() != 2) return InvalidArgument(tp + ": expected a [token, logprob] pair");
          RC_ASSIGN_OR_RETURN(int32_t t, TokenFromJson(e[0], tp + ".token"));
          RC_ASSIGN_OR_RETURN(float l, LogprobFromJson(e[1], tp + ".logprob"));
          st.top.emplace_back(t, l);
        }
      }
      p.steps.push_back(std::move(st));
    }
    out.push_back(std::move(p));
  }
  Status s = ValidateProbes(out);
  if (!s.ok()) {
    if (base == "probes") return s;
    return InvalidArgument(base + ": " + s.message());
  }
  return out;
}

}  // namespace rc::refit
