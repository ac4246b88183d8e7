#include "rolloutcore/lifecycle/replay.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <sstream>

#include "rolloutcore/lifecycle/engine_adapter.h"

namespace rc::lifecycle {
namespace {

std::string Num(double v) {
  std::ostringstream o;
  o.precision(6);
  o << v;
  return o.str();
}

Json TopJson(const std::vector<std::pair<int32_t, float>>& top) {
  Json a = Json::array();
  for (const auto& [t, lp] : top) a.push_back(Json::array({t, lp}));
  return a;
}

}  // namespace

Json ToJson(const ReplayRequest& r) {
  return Json{{"probe", r.probe}, {"prompt", r.prompt}, {"steps", r.steps}, {"top_k", r.top_k}};
}

Result<ReplayRequest> ReplayRequestFromJson(const Json& j, int64_t max_steps, int64_t max_top_k) {
  if (!j.is_object()) return InvalidArgument("request body: expected a JSON object, got " + JsonTypeName(j));
  RC_RETURN_IF_ERROR(CheckKnownKeys(j, {"probe", "prompt", "steps", "top_k"}, ""));
  ReplayRequest r;
  RC_ASSIGN_OR_RETURN(r.probe, GetString(j, "probe", "", std::string()));
  auto p = j.find("prompt");
  if (p == j.end() || !p->is_array() || p->empty()) {
    return InvalidArgument("prompt: expected a non-empty array of token ids");
  }
  for (size_t i = 0; i < p->size(); ++i) {
    const Json& t = (*p)[i];
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      return InvalidArgument("prompt[" + std::to_string(i) + "]: expected a token id >= 0, got " + t.dump());
    }
    r.prompt.push_back(static_cast<int32_t>(t.get<int64_t>()));
  }
  RC_ASSIGN_OR_RETURN(int64_t steps, GetInt(j, "steps", ""));
  if (steps < 1 || steps > max_steps) {
    return InvalidArgument("steps: must be in 1.." + std::to_string(max_steps) + ", got " + std::to_string(steps));
  }
  r.steps = static_cast<int32_t>(steps);
  RC_ASSIGN_OR_RETURN(int64_t top_k, GetInt(j, "top_k", "", 0));
  if (top_k < 0 || top_k > max_top_k) {
    return InvalidArgument("top_k: must be in 0.." + std::to_string(max_top_k) + ", got " + std::to_string(top_k));
  }
  r.top_k = static_cast<int32_t>(top_k);
  return r;
}

Json ToJson(const ReplayEvidence& e) {
  Json steps = Json::array();
  for (const auto& s : e.steps)
    steps.push_back(Json{{"token", s.token}, {"logprob", s.logprob}, {"top", TopJson(s.top)}});
  return Json{{"steps", steps},
              {"engine_ms", e.engine_ms},
              {"precomputed", e.precomputed},
              {"computed_on", e.computed_on},
              {"staged_ms", e.staged_ms}};
}

Result<ReplayEvidence> ReplayEvidenceFromJson(const Json& j, std::string_view where) {
  const std::string path(where);
  if (!j.is_object()) return InvalidArgument(path + ": expected an object, got " + JsonTypeName(j));
  ReplayEvidence e;
  RC_ASSIGN_OR_RETURN(e.engine_ms, GetDouble(j, "engine_ms", path, 0.0));
  RC_ASSIGN_OR_RETURN(e.staged_ms, GetDouble(j, "staged_ms", path, 0.0));
  if (auto p = j.find("precomputed"); p != j.end()) {
    if (!p->is_boolean()) return InvalidArgument(path + ".precomputed: expected a boolean, got " + JsonTypeName(*p));
    e.precomputed = p->get<bool>();
  }
  if (auto c = j.find("computed_on"); c != j.end()) {
    if (!c->is_string()) return InvalidArgument(path + ".computed_on: expected a string, got " + JsonTypeName(*c));
    e.computed_on = c->get<std::string>();
  } else {
    e.computed_on = e.precomputed ? "staged_image" : "live";
  }
  auto steps = j.find("steps");
  if (steps == j.end() || !steps->is_array()) return InvalidArgument(path + ".steps: expected an array");
  for (size_t i = 0; i < steps->size(); ++i) {
    const Json& s = (*steps)[i];
    const std::string sp = path + ".steps[" + std::to_string(i) + "]";
    if (!s.is_object()) return InvalidArgument(sp + ": expected an object");
    ReplayStep st;
    RC_ASSIGN_OR_RETURN(int64_t tok, GetInt(s, "token", sp));
    st.token = static_cast<int32_t>(tok);
    RC_ASSIGN_OR_RETURN(double lp, GetDouble(s, "logprob", sp));
    st.logprob = static_cast<float>(lp);
    if (auto t = s.find("top"); t != s.end()) {
      if (!t->is_array()) return InvalidArgument(sp + ".top: expected an array");
      for (size_t k = 0; k < t->size(); ++k) {
        const Json& e2 = (*t)[k];
        if (!e2.is_array() || e2.size() != 2 || !e2[0].is_number_integer() || !e2[1].is_number()) {
          return InvalidArgument(sp + ".top[" + std::to_string(k) + "]: expected a [token, logprob] pair");
        }
        st.top.emplace_back(e2[0].get<int32_t>(), e2[1].get<float>());
      }
    }
    e.steps.push_back(std::move(st));
  }
  return e;
}

ReplayRequest ReplayProbe::Request() const {
  ReplayRequest r;
  r.probe = name;
  r.prompt = prompt;
  r.steps = static_cast<int32_t>(expected.size());
  r.top_k = top_k;
  return r;
}

ReplayComparison CompareReplay(const ReplayProbe& probe, const ReplayEvidence& engine, double tol, bool accept_ties) {
  ReplayComparison c;
  const std::string who = "probe " + probe.name;
  auto note = [&](double d, int64_t step) {
    // NaN compares false everywhere: treat it as infinitely wrong.
    if (std::isnan(d)) d = std::numeric_limits<double>::infinity();
    if (d > c.worst_logprob_diff || c.worst_step < 0) {
      c.worst_logprob_diff = std::max(c.worst_logprob_diff, d);
      c.worst_step = step;
    }
    return d;
  };
  auto fail = [&](int64_t step, const std::string& what) {
    if (!c.match) return;
    c.match = false;
    c.mismatch_step = step;
    c.mismatch = who + " step " + std::to_string(step) + ": " + what;
  };
  if (engine.steps.size() != probe.expected.size()) {
    fail(static_cast<int64_t>(std::min(engine.steps.size(), probe.expected.size())),
         "the engine replayed " + std::to_string(engine.steps.size()) + " steps, the trainer recorded " +
             std::to_string(probe.expected.size()));
  }
  const size_t n = std::min(engine.steps.size(), probe.expected.size());
  for (size_t s = 0; s < n; ++s) {
    const auto step = static_cast<int64_t>(s);
    const ReplayStep& want = probe.expected[s];
    const ReplayStep& got = engine.steps[s];
    if (got.token != want.token) {
      // A tie for first place may break either way under different rounding (bf16 kernels against
      // an f32 reference): accepted only when each side gives the other's token a logprob within
      // the tolerance of its own choice, and both chosen logprobs agree within it. The probe ends
      // there either way: later steps continue another prefix.
      auto lp_of = [](const ReplayStep& st, int32_t tok) -> std::optional<float> {
        for (const auto& [t, lp] : st.top) {
          if (t == tok) return lp;
        }
        return std::nullopt;
      };
      const auto engine_lp_of_trainer_token = lp_of(got, want.token);
      const auto trainer_lp_of_engine_token = lp_of(want, got.token);
      const bool tie = accept_ties && engine_lp_of_trainer_token && trainer_lp_of_engine_token &&
                       std::fabs(static_cast<double>(got.logprob) - *engine_lp_of_trainer_token) <= tol &&
                       std::fabs(static_cast<double>(want.logprob) - *trainer_lp_of_engine_token) <= tol &&
                       note(std::fabs(static_cast<double>(got.logprob) - want.logprob), step) <= tol;
      if (tie) {
        c.diverged_on_tie_step = step;
        break;
      }
      fail(step, "engine token " + std::to_string(got.token) + " (logprob " + Num(got.logprob) + "), trainer token " +
                     std::to_string(want.token) + " (logprob " + Num(want.logprob) + ")");
      break;  // later steps continue another prefix
    }
    const double d = note(std::fabs(static_cast<double>(got.logprob) - want.logprob), step);
    if (!(d <= tol)) {
      fail(step, "token " + std::to_string(want.token) + " logprob " + Num(got.logprob) + ", trainer " +
                     Num(want.logprob) + " (|diff| " + Num(d) + " > tolerance " + Num(tol) + ")");
    }
    const float kth = got.top.empty() ? -std::numeric_limits<float>::infinity() : got.top.back().second;
    for (const auto& [tok, lp] : want.top) {
      auto it = std::find_if(got.top.begin(), got.top.end(), [tok = tok](const auto& e) { return e.first == tok; });
      if (it == got.top.end()) {
        // A tie at the top-k boundary may order differently; anything else is a difference.
        if (static_cast<int64_t>(got.top.size()) >= probe.top_k && std::fabs(static_cast<double>(lp) - kth) <= tol)
          continue;
        fail(step, "trainer top-k token " + std::to_string(tok) + " (logprob " + Num(lp) +
                       ") is not in the engine's top-" + std::to_string(probe.top_k) + " (its k-th logprob " +
                       Num(kth) + ")");
        continue;
      }
      const double dt = note(std::fabs(static_cast<double>(it->second) - lp), step);
      if (!(dt <= tol)) {
        fail(step, "top-k token " + std::to_string(tok) + " logprob " + Num(it->second) + ", trainer " + Num(lp) +
                       " (|diff| " + Num(dt) + " > tolerance " + Num(tol) + ")");
      }
    }
  }
  return c;
}

Json ToJson(const ReplayOutcome& o) {
  Json j{{"skipped", o.skipped}};
  if (o.skipped) {
    j["reason"] = o.skip_reason;
    return j;
  }
  j["match"] = o.match;
  if (!o.match) j["mismatch"] = o.mismatch;
  j["tolerance"] = o.tolerance;
  j["worst_logprob_diff"] = o.worst_logprob_diff;
  j["worst_probe"] = o.worst_probe;
  j["worst_step"] = o.worst_step;
  j["probes"] = o.probes;
  j["tokens"] = o.tokens;
  j["ties"] = o.ties;
  j["engine_ms"] = o.engine_ms;
  j["precomputed"] = o.precomputed;
  j["computed_on"] = o.precomputed == 0 ? "live" : o.precomputed == o.probes ? "staged_image" : "mixed";
  j["staged_ms"] = o.staged_ms;
  j["wall_ms"] = o.wall_ms;
  return j;
}

}  // namespace rc::lifecycle

namespace rc::lifecycle {

// The default of engines without a replay path (engine_adapter.h).
Pending<ReplayEvidence> EngineAdapter::Replay(const ReplayRequest& request) {
  return Pending<ReplayEvidence>::Completed(
      Unimplemented("this engine adapter has no replay path (probe " + request.probe + ")"));
}

}  // namespace rc::lifecycle
