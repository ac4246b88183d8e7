// Rollout admission and the rollout proxy of the controller service (rollout_admission.h).
#include "controller/rollout_admission.h"

#include "rolloutcore/base/clock.h"
#include "rolloutcore/base/log.h"
#include "rolloutcore/base/mutex.h"

namespace rc::controller {

using lifecycle::State;

RolloutAdmission::Counts RolloutAdmission::counts() const {
  return Counts{rollouts_ok_.load(), rollouts_refused_.load(), rollouts_failed_.load(), rollouts_mismatched_.load()};
}

std::map<std::string, int64_t> RolloutAdmission::TokensByKv() const {
  rc::MutexLock lock(core_->mu);
  return tokens_by_kv_;
}

std::string RolloutAdmission::NewRolloutId() {
  return "ro-" + std::to_string(WallTimeMs()) + "-" + std::to_string(next_rollout_++);
}

Result<std::pair<size_t, lifecycle::RolloutBinding>> RolloutAdmission::AdmitSomewhere(const std::string& rollout_id,
                                                                                      bool lease) {
  RC_RETURN_IF_ERROR(ValidateRolloutId(rollout_id));
  size_t n = core_->engines.size();
  size_t start = round_robin_.fetch_add(1) % n;
  std::string reasons;
  for (size_t k = 0; k < n; ++k) {
    auto& slot = core_->engines[(start + k) % n];
    if (slot->controller->state() != State::kReady) {
      reasons += (reasons.empty() ? "" : "; ") + slot->handle.name + " is " +
                 std::string(lifecycle::StateName(slot->controller->state()));
      continue;
    }
    if (!identity_->IdentityVerified(slot.get())) {
      reasons += (reasons.empty() ? "" : "; ") + slot->handle.name + " is READY but its identity is not verified yet";
      continue;
    }
    if (slot->settling.load()) {
      reasons += (reasons.empty() ? "" : "; ") + slot->handle.name + " is finishing an operation (identity re-check)";
      continue;
    }
    auto b = slot->controller->Admit(rollout_id, lease);
    if (b.ok()) return std::make_pair(slot->index, *b);
    if (b.status().code() == StatusCode::kAlreadyExists) return b.status();
    reasons += (reasons.empty() ? "" : "; ") + slot->handle.name + ": " + b.status().message();
  }
  rollouts_refused_.fetch_add(1);
  return Unavailable("no engine is READY (" + reasons + "); retry");
}

Result<Json> RolloutAdmission::RolloutBody(const Json& request, std::string* rollout_id) {
  if (!request.is_object()) return InvalidArgument("body: expected a JSON object");
  RC_ASSIGN_OR_RETURN(*rollout_id, GetString(request, "rollout_id", "", std::string()));
  if (rollout_id->empty()) *rollout_id = NewRolloutId();
  Json body = request;
  body.erase("rollout_id");
  // One rollout is one prompt: a string, or a non-empty list of token ids. Anything else would be
  // passed on and read differently by the engine (a string prompt_token_ids is text to it; a list
  // of prompts gives several choices of which one would be recorded).
  auto token_list = [](const Json& v, const char* field) -> Status {
    if (!v.is_array() || v.empty()) {
      return InvalidArgument(std::string(field) + ": expected a non-empty list of token ids, got " +
                             (v.is_array() ? std::string("an empty list") : JsonTypeName(v)));
    }
    for (size_t i = 0; i < v.size(); ++i) {
      if (!v[i].is_number_integer()) {
        return InvalidArgument(std::string(field) + "[" + std::to_string(i) + "]: expected a token id (integer), got " +
                               JsonTypeName(v[i]));
      }
    }
    return OkStatus();
  };
  if (body.contains("prompt_token_ids")) {
    if (body.contains("prompt")) return InvalidArgument("give either prompt or prompt_token_ids, not both");
    RC_RETURN_IF_ERROR(token_list(body["prompt_token_ids"], "prompt_token_ids"));
    body["prompt"] = body["prompt_token_ids"];
    body.erase("prompt_token_ids");
  }
  if (!body.contains("prompt")) return InvalidArgument("prompt: required field is missing (or prompt_token_ids)");
  if (!body["prompt"].is_string()) RC_RETURN_IF_ERROR(token_list(body["prompt"], "prompt"));
  if (body.contains("stream") && !body["stream"].is_null() && body["stream"] != false) {
    return InvalidArgument("stream: a rollout is returned whole by the controller (stream must be false or absent); "
                           "stream from the engine's /v1/completions directly");
  }
  if (body.contains("n") && body["n"] != 1) return InvalidArgument("n: one rollout is one completion (n must be 1)");
  body["request_id"] = *rollout_id;
  body["return_token_ids"] = true;
  body["stream"] = false;
  return body;
}

Result<Json> RolloutAdmission::Rollout(const Json& request) {
  std::string rollout_id;
  RC_ASSIGN_OR_RETURN(Json body, RolloutBody(request, &rollout_id));

  RC_ASSIGN_OR_RETURN(auto admitted, AdmitSomewhere(rollout_id));
  auto [index, binding] = admitted;
  EngineSlot* slot = core_->engines[index].get();
  int64_t admitted_ms = WallTimeMs();
  int64_t admitted_install_generation = -1;  // what was verified when it was admitted
  {
    rc::MutexLock lock(slot->id_mu);
    if (slot->id.generation_settled) admitted_install_generation = slot->id.install_generation;
  }
  auto result = slot->handle.complete(body);

  Trajectory t;
  t.binding = binding;
  t.engine = slot->handle.name;
  t.admitted_ms = admitted_ms;
  t.finished_ms = WallTimeMs();
  Json finish_detail{{"engine", slot->handle.name}};
  if (!result.ok()) return RecordFailedRollout(slot, rollout_id, result.status(), std::move(t), std::move(finish_detail));
  Json& resp = *result;
  // Policy modes: what in-flight updates did to it, and its version spans (rollout_checks.cc).
  const auto inflight = slot->controller->InFlight(rollout_id);
  std::string span_why, inflight_why;
  const Json first_choice = resp.contains("choices") && resp["choices"].is_array() && !resp["choices"].empty() &&
                                    resp["choices"][0].is_object()
                                ? resp["choices"][0]
                                : Json::object();
  t.version_spans = VersionSpans(slot, binding, first_choice,
                                 static_cast<int64_t>(first_choice.value("token_ids", Json::array()).size()),
                                 inflight ? &*inflight : nullptr, &span_why);
  const Json checked =
      inflight ? InFlightAdjusted(slot, resp, admitted_install_generation, binding, *inflight, &inflight_why) : resp;
  std::string mismatch = CompletionMismatch(slot, binding, checked);
  for (const std::string* w : {&span_why, &inflight_why}) {
    if (!w->empty()) mismatch += (mismatch.empty() ? "" : "; ") + *w;
  }
  if (inflight && !inflight->aborted_at_update.is_null() && first_choice.value("finish_reason", "") == "abort") {
    t.aborted_at_update = inflight->aborted_at_update;
  }
  if (!mismatch.empty()) {
    return RecordMismatchedRollout(slot, rollout_id, resp, mismatch, std::move(t), std::move(finish_detail));
  }
  if (resp.contains("choices") && resp["choices"].is_array() && !resp["choices"].empty()) {
    const Json& c = resp["choices"][0];
    t.finish_reason = c.value("finish_reason", "");
    t.output_token_ids = IntArray(c.value("token_ids", Json::array()));
    t.prompt_token_ids = IntArray(c.value("prompt_token_ids", Json::array()));
    t.engine_weight_version = c.value("weight_version", "");
    if (c.contains("logprobs") && c["logprobs"].is_object() && c["logprobs"].contains("token_logprobs")) {
      for (const auto& x : c["logprobs"]["token_logprobs"]) {
        if (x.is_number()) t.logprobs.push_back(x.get<double>());
      }
    }
  }
  if (resp.contains("usage") && resp["usage"].is_object()) {
    const Json& u = resp["usage"];
    if (u.contains("prompt_tokens_details") && u["prompt_tokens_details"].is_object()) {
      t.cached_tokens = u["prompt_tokens_details"].value("cached_tokens", int64_t{0});
    }
  }
  if (t.prompt_token_ids.empty() && body["prompt"].is_array()) t.prompt_token_ids = IntArray(body["prompt"]);
  return FinishRollout(slot, rollout_id, binding, std::move(resp), t, std::move(finish_detail));
}

Status RolloutAdmission::RecordFailedRollout(EngineSlot* slot, const std::string& rollout_id, const Status& error,
                                             Trajectory t, Json finish_detail) {
  // Row first, then the finish (the invariant in service.h); neither result is dropped: a row
  // that could not be written is named in the finish record, a finish that could not be
  // journaled leaves the rollout admitted (recorded interrupted at the next restart).
  t.finish_reason = "error";
  finish_detail["error"] = error.ToString();
  // An engine that turns requests away while paused (vLLM 0.33 answers 503 in wait/abort
  // pauses): the rollout produced nothing; its record names the update that paused the engine.
  if (auto pending = slot->controller->pending_target()) {
    finish_detail["update_in_progress"] = pending->label;
    t.extra = Json{{"update_in_progress", pending->label},
                   {"engine_state", lifecycle::StateName(slot->controller->state())}};
  }
  Status stored = core_->trajectories->Insert(t);
  if (!stored.ok()) finish_detail["trajectory_error"] = stored.ToString();
  Status finished = slot->controller->Finish(rollout_id, finish_detail);
  if (!stored.ok() || !finished.ok()) {
    RC_LOG_ERROR("rollout {} failed on {} and its record is incomplete: trajectory {}, finish {}", rollout_id,
                 slot->handle.name, stored.ToString(), finished.ToString());
  }
  rollouts_failed_.fetch_add(1);
  return error.WithContext("rollout " + rollout_id + " on " + slot->handle.name);
}

Status RolloutAdmission::RecordMismatchedRollout(EngineSlot* slot, const std::string& rollout_id, const Json& resp,
                                                 const std::string& mismatch, Trajectory t, Json finish_detail) {
  // Not what the binding names: the output is discarded, never stored or returned as bound;
  // the rollout is recorded failed with the reason and the engine is tainted.
  t.finish_reason = "identity_mismatch";
  if (resp.contains("choices") && resp["choices"].is_array() && !resp["choices"].empty() &&
      resp["choices"][0].is_object()) {
    t.engine_weight_version = resp["choices"][0].value("weight_version", "");
  }
  t.extra = Json{{"identity_mismatch", mismatch}, {"engine_reported", resp.value("rolloutcore", Json())}};
  finish_detail["error"] = "identity mismatch";
  finish_detail["identity_mismatch"] = mismatch;
  Status inserted = core_->trajectories->Insert(t);
  Status finished = slot->controller->Finish(rollout_id, finish_detail);
  rollouts_failed_.fetch_add(1);
  rollouts_mismatched_.fetch_add(1);
  {
    rc::MutexLock lock(slot->id_mu);
    ++slot->id.mismatches;
  }
  identity_->TaintForIdentity(slot, "rollout " + rollout_id + ": " + mismatch);
  std::string msg = "rollout " + rollout_id + " on " + slot->handle.name + " is not bound: " + mismatch +
                    "; its output was discarded and the engine is tainted";
  if (!inserted.ok()) msg += " (recording it failed: " + inserted.ToString() + ")";
  if (!finished.ok()) msg += " (journaling it failed: " + finished.ToString() + ")";
  return DataLoss(msg);
}

Result<Json> RolloutAdmission::FinishRollout(EngineSlot* slot, const std::string& rollout_id,
                                             const lifecycle::RolloutBinding& binding, Json resp, const Trajectory& t,
                                             Json finish_detail) {
  finish_detail["finish_reason"] = t.finish_reason;
  finish_detail["completion_tokens"] = t.output_token_ids.size();
  if (t.version_spans.size() > 1 || !t.aborted_at_update.is_null()) {
    // Journal: the spans of a rollout an update touched (tokens per version and kv state).
    finish_detail["version_spans"] = t.version_spans;
    if (!t.aborted_at_update.is_null()) finish_detail["aborted_at_update"] = t.aborted_at_update;
  }
  // The trajectory row is written before the finish is journaled: a crash between the two then
  // leaves an admitted rollout without a finish record, which the restart records interrupted
  // (its row is kept). The other order would leave a rollout finished in the journal whose
  // output exists nowhere — a lost rollout (issue #6, crash safety).
  if (Status stored = core_->trajectories->Insert(t); !stored.ok()) {
    // The output exists only in this answer, which the client will not get: finish the binding
    // (it must not hold a drain forever) with the failure in its journal record.
    finish_detail["trajectory_error"] = stored.ToString();
    Status finished = slot->controller->Finish(rollout_id, finish_detail);
    if (!finished.ok()) {
      RC_LOG_ERROR("rollout {}: {}; and its finish: {}", rollout_id, stored.ToString(), finished.ToString());
    }
    rollouts_failed_.fetch_add(1);
    return stored.WithContext("rollout " + rollout_id + ": the trajectory could not be stored");
  }
  RC_RETURN_IF_ERROR(slot->controller->Finish(rollout_id, finish_detail));
  rollouts_ok_.fetch_add(1);
  CountSpanTokens(t.version_spans);
  resp["version_spans"] = t.version_spans;
  resp["aborted_at_update"] = t.aborted_at_update;
  resp["binding"] = lifecycle::ToJson(binding);
  resp["binding"]["engine"] = slot->handle.name;
  return resp;
}

}  // namespace rc::controller
