#include "engine/http_requests.h"

#include <cstdint>
#include <optional>

#include "rolloutcore/base/json.h"
#include "rolloutcore/directory/types.h"
#include "rolloutcore/engine/engine.h"
#include "rolloutcore/net/http.h"

namespace rc::engine {
namespace {

bool HasParam(const QueryParams& params, const std::string& name) { return params.find(name) != params.end(); }

// The first value of `name` (as httplib's get_param_value(name) gives it).
std::string ParamValue(const QueryParams& params, const std::string& name) {
  auto range = params.equal_range(name);
  return range.first == range.second ? std::string() : range.first->second;
}

// Optional boolean query parameter; InvalidArgument naming it when it is not true/false.
Result<std::optional<bool>> BoolParam(const QueryParams& params, const std::string& name) {
  if (!HasParam(params, name)) return std::optional<bool>();
  const std::string v = ParamValue(params, name);
  if (v == "true" || v == "True" || v == "1") return std::optional<bool>(true);
  if (v == "false" || v == "False" || v == "0") return std::optional<bool>(false);
  return InvalidArgument(name + ": expected true or false, got '" + v + "'");
}

// The body as a JSON object ("request body: ..." when it does not parse; `object_field` names the
// body in the not-an-object message).
Result<Json> ObjectBody(std::string_view body, std::string_view object_field = "body") {
  RC_ASSIGN_OR_RETURN(Json j, ParseJson(body, "request body"));
  if (!j.is_object()) {
    return InvalidArgument(std::string(object_field) + ": expected a JSON object, got " + JsonTypeName(j));
  }
  return j;
}

}  // namespace

Result<PauseQuery> ParsePauseQuery(const QueryParams& params) {
  PauseQuery out;
  std::string mode = HasParam(params, "mode") ? ParamValue(params, "mode") : "abort";
  RC_ASSIGN_OR_RETURN(std::optional<bool> wait, BoolParam(params, "wait_for_inflight_requests"));
  RC_ASSIGN_OR_RETURN(std::optional<bool> clear, BoolParam(params, "clear_cache"));
  if (!HasParam(params, "mode") && wait.has_value()) mode = *wait ? "wait" : "abort";
  RC_ASSIGN_OR_RETURN(out.mode, PauseModeFromName(mode));
  out.mode_name = mode;
  // rolloutcore extension: what an install before the next resume does with frozen requests'
  // KV (keep it, stale; or recompute it under the new weights, the default).
  RC_ASSIGN_OR_RETURN(out.inflight_kv, InFlightKvFromName(HasParam(params, "inflight_kv")
                                                              ? ParamValue(params, "inflight_kv")
                                                              : "recompute"));
  out.clear_cache = clear.value_or(false);
  return out;
}

Result<SleepQuery> ParseSleepQuery(const QueryParams& params) {
  SleepQuery out;
  if (HasParam(params, "level")) {
    const std::string level = ParamValue(params, "level");
    if (level != "0" && level != "1" && level != "2") {
      return InvalidArgument("level: expected 0, 1 or 2, got '" + level + "'");
    }
    out.level = level[0] - '0';
  }
  if (out.level == 2) {
    return InvalidArgument(
        "level: 2 (discard the weights) is not supported by the embedded engine, which does not reload "
        "them on wake_up; use level 0 (pause) or 1 (pause and drop the prefix cache)");
  }
  RC_ASSIGN_OR_RETURN(out.pause, ParsePauseQuery(params));
  return out;
}

Result<bool> ParseResetPrefixCacheQuery(const QueryParams& params) {
  RC_ASSIGN_OR_RETURN(std::optional<bool> running, BoolParam(params, "reset_running_requests"));
  return running.value_or(false);
}

Result<bool> ParseDigestQuery(const QueryParams& params) {
  RC_ASSIGN_OR_RETURN(std::optional<bool> fresh, BoolParam(params, "fresh"));
  return fresh.value_or(false);
}

Result<AbortRequestsBody> ParseAbortRequestsBody(std::string_view body) {
  AbortRequestsBody out;
  if (body.empty()) return out;
  RC_ASSIGN_OR_RETURN(Json j, ObjectBody(body));
  auto it = j.find("request_ids");
  if (it == j.end() || it->is_null()) return out;
  if (!it->is_array()) return InvalidArgument("request_ids: expected a list of strings, got " + JsonTypeName(*it));
  for (size_t i = 0; i < it->size(); ++i) {
    if (!(*it)[i].is_string()) {
      return InvalidArgument("request_ids[" + std::to_string(i) + "]: expected a string, got " +
                             JsonTypeName((*it)[i]));
    }
    out.request_ids.push_back((*it)[i].get<std::string>());
  }
  return out;
}

Result<UpdateWeightVersionBody> ParseUpdateWeightVersionBody(std::string_view body) {
  RC_ASSIGN_OR_RETURN(Json j, ObjectBody(body));
  UpdateWeightVersionBody out;
  RC_ASSIGN_OR_RETURN(out.new_version, GetString(j, "new_version", ""));
  // The label rollouts are bound to and version spans carry: a version label of the directory's
  // form (an empty, multi-line or 100 KB label could never name a published version).
  RC_RETURN_IF_ERROR(directory::ValidateName(out.new_version, "new_version"));
  return out;
}

Result<receiver::StageRequest> ParseStageBody(std::string_view body) {
  RC_ASSIGN_OR_RETURN(Json j, ObjectBody(body));
  // A misspelt field ("timeout" for timeout_ms) would otherwise be dropped without a word.
  RC_RETURN_IF_ERROR(CheckKnownKeys(j, {"model", "version", "directory", "timeout_ms", "use_relays", "receiver_rank"}, ""));
  receiver::StageRequest req;
  RC_ASSIGN_OR_RETURN(req.model, GetString(j, "model", ""));
  RC_ASSIGN_OR_RETURN(req.version, GetString(j, "version", ""));
  RC_ASSIGN_OR_RETURN(req.directory, GetString(j, "directory", ""));
  for (const auto& [field, value] : {std::pair<const char*, const std::string*>{"model", &req.model},
                                     {"version", &req.version}, {"directory", &req.directory}}) {
    if (value->empty()) return InvalidArgument(std::string(field) + ": must not be empty");
  }
  if (!net::IsHttpUrl(req.directory)) {
    return InvalidArgument("directory: '" + req.directory +
                           "' is not the base URL of a directory (http:// or https://, a host and port, no path)");
  }
  RC_ASSIGN_OR_RETURN(int64_t timeout, GetInt(j, "timeout_ms", "", req.timeout_ms));
  if (timeout < 1 || timeout > receiver::kMaxStageTimeoutMs) {
    return InvalidArgument("timeout_ms: must be in [1, " + std::to_string(receiver::kMaxStageTimeoutMs) + "], got " +
                           std::to_string(timeout));
  }
  req.timeout_ms = timeout;
  RC_ASSIGN_OR_RETURN(req.use_relays, GetBool(j, "use_relays", "", false));
  RC_ASSIGN_OR_RETURN(int64_t receiver_rank, GetInt(j, "receiver_rank", "", 0));
  if (receiver_rank < 0 || receiver_rank > 1'000'000) {
    return InvalidArgument("receiver_rank: must be in [0, 1000000], got " + std::to_string(receiver_rank));
  }
  req.receiver_rank = static_cast<int32_t>(receiver_rank);
  return req;
}

Result<receiver::RelayRequest> ParseRelayBody(std::string_view body, const std::string& default_holder) {
  RC_ASSIGN_OR_RETURN(Json j, ObjectBody(body));
  receiver::RelayRequest req;
  RC_ASSIGN_OR_RETURN(req.model, GetString(j, "model", "", ""));
  RC_ASSIGN_OR_RETURN(req.version, GetString(j, "version", "", ""));
  RC_ASSIGN_OR_RETURN(req.directory, GetString(j, "directory", "", ""));
  RC_ASSIGN_OR_RETURN(req.holder, GetString(j, "holder", "", default_holder));
  return req;
}

Result<InstallBody> ParseInstallBody(std::string_view body) {
  RC_ASSIGN_OR_RETURN(Json j, ParseJson(body, "request body"));
  InstallBody out;
  RC_ASSIGN_OR_RETURN(out.version, GetString(j, "version", ""));
  if (out.version.empty()) return InvalidArgument("version: must not be empty");
  RC_ASSIGN_OR_RETURN(out.skip_cache_reset, GetBool(j, "skip_cache_reset", "", false));
  return out;
}

Result<ReplayBody> ParseReplayBody(std::string_view body) {
  RC_ASSIGN_OR_RETURN(Json j, ObjectBody(body, "request body"));
  RC_RETURN_IF_ERROR(CheckKnownKeys(j, {"probe", "prompt", "steps", "top_k"}, ""));
  ReplayBody out;
  RC_ASSIGN_OR_RETURN(out.probe, GetString(j, "probe", "", std::string()));
  auto pit = j.find("prompt");
  if (pit == j.end() || !pit->is_array()) return InvalidArgument("prompt: expected an array of token ids");
  for (size_t i = 0; i < pit->size(); ++i) {
    const Json& t = (*pit)[i];
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > INT32_MAX) {
      return InvalidArgument("prompt[" + std::to_string(i) + "]: expected a token id, got " + t.dump());
    }
    out.prompt.push_back(static_cast<int32_t>(t.get<int64_t>()));
  }
  RC_ASSIGN_OR_RETURN(out.steps, GetInt(j, "steps", ""));
  RC_ASSIGN_OR_RETURN(out.top_k, GetInt(j, "top_k", "", 0));
  return out;
}

Result<FaultBody> ParseFaultBody(std::string_view body) {
  RC_ASSIGN_OR_RETURN(Json j, ObjectBody(body.empty() ? std::string_view("{}") : body));
  RC_RETURN_IF_ERROR(CheckKnownKeys(j, {"pause_delay_ms", "install_delay_ms", "refuse_install", "reset_delay_ms",
                                        "digest_delay_ms", "resume_delay_ms", "fail_install_after_first_rank",
                                        "corrupt_delta_install", "corrupt_live_weight", "corrupt_previous_delta",
                                        "swap_q_heads", "fp8_install"},
                                    "fault"));
  FaultBody out;
  for (auto [name, dest] : {std::pair<const char*, int64_t*>{"pause_delay_ms", &out.pause_delay_ms},
                            {"install_delay_ms", &out.install_delay_ms},
                            {"reset_delay_ms", &out.reset_delay_ms},
                            {"digest_delay_ms", &out.digest_delay_ms},
                            {"resume_delay_ms", &out.resume_delay_ms}}) {
    RC_ASSIGN_OR_RETURN(int64_t ms, GetNonNegativeInt(j, name, "", 0));
    if (ms > kMaxFaultDelayMs) {
      return InvalidArgument(std::string(name) + ": at most " + std::to_string(kMaxFaultDelayMs) + ", got " +
                             std::to_string(ms));
    }
    *dest = ms;
  }
  for (auto [name, dest] : {std::pair<const char*, bool*>{"refuse_install", &out.refuse_install},
                            {"fail_install_after_first_rank", &out.fail_install_after_first_rank},
                            {"corrupt_delta_install", &out.corrupt_delta_install},
                            {"corrupt_live_weight", &out.corrupt_live_weight},
                            {"corrupt_previous_delta", &out.corrupt_previous_delta},
                            {"swap_q_heads", &out.swap_q_heads}}) {
    RC_ASSIGN_OR_RETURN(*dest, GetBool(j, name, name, false));
  }
  if (j.contains("fp8_install")) {
    if (!j["fp8_install"].is_string()) return InvalidArgument("fp8_install: expected a string");
    out.fp8_install = j["fp8_install"].get<std::string>();
    RC_RETURN_IF_ERROR(Fp8FaultFromName(out.fp8_install).status().WithContext("fp8_install"));
  }
  return out;
}

}  // namespace rc::engine
