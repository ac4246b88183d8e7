// The checks of a proxied rollout in the controller service (rollout_admission.h): its completion
// against the binding and the verified identity, and for policy modes its version spans, mapped
// from what the engine reported per choice to the versions this controller installed, and the
// identity checks of a rollout that an in-flight update touched (docs/lifecycle.md, "Policy modes").
#include <algorithm>
#include <set>

#include <fmt/format.h>

#include "controller/rollout_admission.h"
#include "rolloutcore/base/mutex.h"

namespace rc::controller {

namespace {

void Why(std::string* why, const std::string& text) {
  if (why == nullptr) return;
  *why += (why->empty() ? "" : "; ") + text;
}

}  // namespace

Json RolloutAdmission::VersionSpans(EngineSlot* slot, const lifecycle::RolloutBinding& binding, const Json& choice,
                                     int64_t output_tokens, const lifecycle::InFlightRecord* inflight,
                                     std::string* why) const {
  Json out = Json::array();
  const Json reported = choice.value("version_spans", Json());
  if (!reported.is_array() || reported.empty()) {
    // An engine that reports no spans (vLLM): the binding is the only version, which holds in the
    // modes such an engine is allowed (strict, abort).
    out.push_back(Json{{"from_token", 0},
                       {"to_token", output_tokens},
                       {"label", binding.version.label},
                       {"generation", binding.version.generation},
                       {"content_digest", binding.identity.content_digest},
                       {"kv", "fresh"},
                       {"reported_by_engine", false}});
    return out;
  }
  const std::vector<lifecycle::UpdateRecord> updates = slot->controller->Updates();
  int64_t expect_from = 0;
  for (size_t i = 0; i < reported.size(); ++i) {
    const Json& s = reported[i];
    const std::string at = "version span " + std::to_string(i);
    if (!s.is_object()) {
      Why(why, at + " is not an object");
      continue;
    }
    const int64_t from = s.value("from_token", int64_t{-1});
    const int64_t to = s.value("to_token", int64_t{-1});
    const std::string label = s.value("label", "");
    if (s.contains("error")) Why(why, at + ": the engine's spans are malformed: " + s["error"].dump());
    if (from != expect_from || to < from) {
      Why(why, at + " covers [" + std::to_string(from) + ", " + std::to_string(to) + "), expected it to start at " +
                   std::to_string(expect_from));
    }
    expect_from = to;
    // An empty span attributes no token (the engine opened it at a swap the rollout produced
    // nothing after: e.g. a tainted update's install, after which its taint aborted it).
    if (from == to && from >= 0 && reported.size() > 1) continue;
    Json span{{"from_token", from},
              {"to_token", to},
              {"label", label},
              {"kv", s.value("kv", "")},
              {"install_generation", s.value("install_generation", int64_t{-1})},
              {"reported_by_engine", true}};
    if (s.contains("swap_index_reported")) {
      // The engine's worker counted this request's output tokens when the update paused it: the
      // weights changed exactly there, or the spans are not what happened.
      span["swap_index_reported"] = s["swap_index_reported"];
      if (!s["swap_index_reported"].is_number_integer() || s["swap_index_reported"].get<int64_t>() != from) {
        std::string msg = at + " starts at token " + std::to_string(from) + ", but the engine's worker reported ";
        msg += s["swap_index_reported"].is_number_integer()
                   ? std::to_string(s["swap_index_reported"].get<int64_t>()) + " output tokens"
                   : std::string("no count for this request");
        msg.append(" when the update to '").append(label).append("' paused it");
        Why(why, msg);
      }
    }
    if (label != binding.version.label && (inflight == nullptr || inflight->spanned.empty())) {
      // No in-flight update touched this rollout (strict, or it was admitted after the last one):
      // every token must be the binding's.
      std::string msg = at + " was generated under label '";
      msg.append(label).append("', the binding is '").append(binding.version.label);
      msg += "' and no in-flight update touched this rollout";
      Why(why, msg);
    }
    if (label == binding.version.label) {
      span["generation"] = binding.version.generation;
      span["content_digest"] = binding.identity.content_digest;
      if (span["kv"] == "") span["kv"] = "fresh";
    } else {
      // A version an update of this controller installed while the rollout ran: the newest update
      // to that label (committed, or the one still in progress when the rollout answered).
      const lifecycle::UpdateRecord* found = nullptr;
      for (const auto& u : updates) {
        if (u.recovery || u.target.label != label) continue;
        if (u.outcome != lifecycle::UpdateOutcome::kCommitted && u.outcome != lifecycle::UpdateOutcome::kInProgress) {
          continue;
        }
        if (found == nullptr || u.ordinal > found->ordinal) found = &u;
      }
      if (found == nullptr) {
        Why(why, std::string(at).append(" was generated under label '").append(label).append(
                     "', which no update of this controller installed"));
        span["generation"] = nullptr;
        span["content_digest"] = nullptr;
      } else {
        span["generation"] = found->from_version.generation + 1;
        span["content_digest"] = found->target.identity.content_digest;
        span["update"] = found->ordinal;
        span["update_mode"] = lifecycle::PolicyModeName(found->target.mode);
        if (span["kv"] == "") {
          span["kv"] = found->target.mode == lifecycle::PolicyMode::kRecompute ? "recomputed" : "stale";
        }
      }
    }
    out.push_back(span);
  }
  if (expect_from != output_tokens) {
    Why(why, "the version spans end at token " + std::to_string(expect_from) + ", the output has " +
                 std::to_string(output_tokens) + " tokens");
  }
  return out;
}

Json RolloutAdmission::InFlightAdjusted(EngineSlot* slot, const Json& resp, int64_t admitted_install_generation,
                                         const lifecycle::RolloutBinding& binding,
                                         const lifecycle::InFlightRecord& inflight, std::string* why) const {
  Json out = resp;
  // The labels the engine may report when it answers: the binding's, every update the rollout
  // lived through or that ended it (a tainted update's install may have changed the engine's
  // label before its taint aborted the rollout), and the update in progress now (the answer may
  // be built after the next pause began).
  std::set<std::string> allowed;
  if (auto p = slot->controller->pending_target()) allowed.insert(p->label);
  allowed.insert(slot->controller->version().label);
  allowed.insert(binding.version.label);
  if (inflight.aborted_at_update.is_object()) allowed.insert(inflight.aborted_at_update.value("target", ""));
  if (!inflight.spanned.empty()) {
    for (const auto& u : slot->controller->Updates()) {
      if (std::find(inflight.spanned.begin(), inflight.spanned.end(), u.ordinal) != inflight.spanned.end()) {
        allowed.insert(u.target.label);
      }
    }
  }
  if (out.contains("choices") && out["choices"].is_array()) {
    for (size_t i = 0; i < out["choices"].size(); ++i) {
      Json& c = out["choices"][i];
      if (!c.is_object()) continue;
      if (c.contains("version_spans") && c["version_spans"].is_array()) {
        for (const auto& s : c["version_spans"]) {
          if (s.is_object()) allowed.insert(s.value("label", ""));
        }
      }
      if (c.contains("install_generation") && c["install_generation"].is_number_integer()) {
        const int64_t g = c["install_generation"].get<int64_t>();
        if (admitted_install_generation >= 0 && g != admitted_install_generation) {
          Why(why, "choice " + std::to_string(i) + " was admitted at install generation " + std::to_string(g) +
                       ", the one verified at its admission is " + std::to_string(admitted_install_generation));
        }
        c["rolloutcore_inflight_install_generation"] = g;
        c.erase("install_generation");
      }
    }
  }
  if (out.contains("rolloutcore") && out["rolloutcore"].is_object()) {
    Json& r = out["rolloutcore"];
    if (r.contains("label") && r["label"].is_string()) {
      const std::string label = r["label"].get<std::string>();
      if (!allowed.count(label)) {
        std::string list;
        for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
        Why(why, "the engine reported label '" + label + "' when it answered; a rollout that spanned in-flight "
                 "updates may end only on one of: " + list);
      }
      r.erase("label");
    }
    // The install generation at answer time moves with the in-flight updates; the post-update
    // identity check verifies it.
    r.erase("install_generation");
  }
  return out;
}

void RolloutAdmission::CountSpanTokens(const Json& spans) {
  rc::MutexLock lock(core_->mu);
  for (const auto& s : spans) {
    if (!s.is_object()) continue;
    const int64_t n = s.value("to_token", int64_t{0}) - s.value("from_token", int64_t{0});
    if (n > 0) tokens_by_kv_[s.value("kv", std::string("fresh"))] += n;
  }
}

std::string RolloutAdmission::CompletionMismatch(EngineSlot* slot, const lifecycle::RolloutBinding& binding,
                                                  const Json& resp) const {
  VerifiedIdentity v;
  {
    rc::MutexLock lock(slot->id_mu);
    v = slot->id;
  }
  const bool compare_generation = v.verified && v.generation_settled && v.install_generation >= 0;
  const std::string& bound = binding.version.label;
  std::vector<std::string> why;
  if (resp.contains("choices") && resp["choices"].is_array()) {
    for (size_t i = 0; i < resp["choices"].size(); ++i) {
      const Json& c = resp["choices"][i];
      if (!c.is_object()) continue;
      const std::string at = "choice " + std::to_string(i);
      if (c.contains("weight_version") && c["weight_version"].is_string() && c["weight_version"] != bound) {
        why.push_back(fmt::format("{} was generated under label '{}', the binding is '{}'", at,
                                  c["weight_version"].get<std::string>(), bound));
      }
      if (compare_generation && c.contains("install_generation") && c["install_generation"].is_number_integer() &&
          c["install_generation"].get<int64_t>() != v.install_generation) {
        why.push_back(at + " was admitted at install generation " +
                      std::to_string(c["install_generation"].get<int64_t>()) + ", the verified one is " +
                      std::to_string(v.install_generation));
      }
    }
  }
  if (resp.contains("rolloutcore") && resp["rolloutcore"].is_object()) {
    const Json& r = resp["rolloutcore"];
    if (v.verified && !v.boot_id.empty() && r.contains("boot_id") && r["boot_id"].is_string() &&
        r["boot_id"] != v.boot_id) {
      why.push_back("the engine's boot id is " + r["boot_id"].get<std::string>() + ", the verified one is " +
                    v.boot_id + " (it restarted)");
    }
    if (r.contains("label") && r["label"].is_string() && r["label"] != bound) {
      why.push_back("the engine reported label '" + r["label"].get<std::string>() + "' when it answered, the binding is '" +
                    bound + "'");
    }
    if (compare_generation && r.contains("install_generation") && r["install_generation"].is_number_integer() &&
        r["install_generation"].get<int64_t>() != v.install_generation) {
      why.push_back("the engine was at install generation " + std::to_string(r["install_generation"].get<int64_t>()) +
                    " when it answered, the verified one is " + std::to_string(v.install_generation));
    }
  }
  return Join(why);
}

}  // namespace rc::controller
