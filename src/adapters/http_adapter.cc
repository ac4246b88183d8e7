#include "rolloutcore/adapters/http_adapter.h"

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <sstream>

#include "adapters/lifecycle_types.h"
#include "adapters/vllm_flavor.h"
#include "rolloutcore/base/json.h"
#include "rolloutcore/net/http.h"

namespace rc::adapters {

struct HttpEngineAdapter::Shared {
  HttpAdapterOptions options;
  std::atomic<EngineFlavor> flavor{EngineFlavor::kUnknown};
  std::unique_ptr<internal::VllmFlavor> vllm;  // set at construction; used once flavor is kVllm
  bool IsVllm() const { return flavor.load() == EngineFlavor::kVllm; }

  // Kept-alive connections to the engine (net::ClientPool), made once options are set.
  std::unique_ptr<net::ClientPool> pool;

  std::string Where(const std::string& path) const { return options.base_url + path; }

  // Performs one request on a kept-alive connection (the process's API key and TLS CA,
  // rolloutcore/net); transport failures are Unavailable naming the URL.
  Result<httplib::Response> Do(const std::string& method, const std::string& path, const std::string& body = "") const {
    const int64_t ms = options.http_timeout_ms;
    httplib::Result r = pool->Request(method, path, body, body.empty() ? "text/plain" : "application/json",
                                      [ms](httplib::Client& c) { net::SetClientTimeouts(c, 5000, ms); });
    if (!r) {
      return Unavailable(method + " " + Where(path) + ": " + httplib::to_string(r.error()));
    }
    return *r;
  }

  Result<Json> DoJson(const std::string& method, const std::string& path, const std::string& body = "") const {
    RC_ASSIGN_OR_RETURN(httplib::Response resp, Do(method, path, body));
    if (resp.status < 200 || resp.status >= 300) {
      std::string msg = method + " " + Where(path) + " answered " + std::to_string(resp.status) + ": " + resp.body;
      if (resp.status == 409 || resp.status == 400) return FailedPrecondition(msg);
      if (resp.status == 404) return NotFound(msg);
      return Unavailable(msg);
    }
    if (resp.body.empty()) return Json();
    return ParseJson(resp.body, method + " " + Where(path));
  }

  Result<bool> IsPaused() const {
    RC_ASSIGN_OR_RETURN(Json j, DoJson("GET", "/is_paused"));
    RC_ASSIGN_OR_RETURN(bool paused, GetBool(j, "is_paused", "is_paused"));
    return paused;
  }

  Result<DrainStatus> Drain() const {
    if (flavor.load() == EngineFlavor::kRolloutcore) {
      RC_ASSIGN_OR_RETURN(Json j, DoJson("GET", "/rc/engine/state"));
      DrainStatus d;
      RC_ASSIGN_OR_RETURN(d.running, GetNonNegativeInt(j, "num_running", "state"));
      RC_ASSIGN_OR_RETURN(d.waiting, GetNonNegativeInt(j, "num_waiting", "state"));
      return d;
    }
    if (IsVllm()) return vllm->Drain();
    return FailedPrecondition("engine at " + options.base_url + ": drain status before Describe() found its flavour");
  }
};

namespace {

// ---- Identity, vLLM flavour ---------------------------------------------------------------
// rolloutcore's worker extension inside every vLLM worker answers the collective RPC "rc_label"
// with {label, generation (its install counter), boot_id, content_digest (hex or null)}; every
// worker must agree, or the engine is not one identity.
Result<IdentityEvidence> ProbeVllmIdentity(const HttpEngineAdapter::Shared& s) {
  const Json body{{"method", "rc_label"}, {"args", Json::array()}, {"kwargs", Json::object()}};
  auto j = s.DoJson("POST", "/collective_rpc", body.dump());
  if (!j.ok() && j.status().code() == StatusCode::kNotFound) {
    return Unimplemented("vLLM at " + s.options.base_url +
                         " has no /collective_rpc (or no rolloutcore worker extension): it cannot report its identity");
  }
  RC_RETURN_IF_ERROR(j.status());
  const std::string where = "POST " + s.Where("/collective_rpc") + " rc_label";
  if (!j->is_object() || !j->contains("results") || !(*j)["results"].is_array() || (*j)["results"].empty()) {
    return DataLoss(where + ": expected {\"results\": [one object per worker]}, got " + j->dump());
  }
  const Json& results = (*j)["results"];
  IdentityEvidence first;
  for (size_t i = 0; i < results.size(); ++i) {
    const Json& w = results[i];
    const std::string at = where + " results[" + std::to_string(i) + "]";
    if (!w.is_object()) return DataLoss(at + ": expected an object, got " + JsonTypeName(w));
    IdentityEvidence e;
    RC_ASSIGN_OR_RETURN(e.label, GetString(w, "label", at));
    RC_ASSIGN_OR_RETURN(e.install_generation, GetNonNegativeInt(w, "generation", at));
    RC_ASSIGN_OR_RETURN(e.boot_id, GetString(w, "boot_id", at));
    if (w.contains("content_digest") && !w["content_digest"].is_null()) {
      RC_ASSIGN_OR_RETURN(e.content_digest, GetString(w, "content_digest", at));
    }
    if (i == 0) {
      first = e;
    } else if (e.label != first.label || e.install_generation != first.install_generation ||
               e.content_digest != first.content_digest) {
      return DataLoss(where + ": workers disagree: worker 0 reports label '" + first.label + "' generation " +
                      std::to_string(first.install_generation) + " boot " + first.boot_id + " digest '" +
                      first.content_digest + "', worker " + std::to_string(i) + " reports label '" + e.label +
                      "' generation " + std::to_string(e.install_generation) + " boot " + e.boot_id + " digest '" +
                      e.content_digest + "'");
    } else {
      // Each worker is its own process with its own boot id: the engine's is all of them, so a
      // restart of any worker changes it.
      first.boot_id += "," + e.boot_id;
    }
  }
  return first;
}

// ---- Identity, rolloutcore flavour: GET /rc/engine/state ------------------------------------
Result<IdentityEvidence> ProbeRolloutcoreIdentity(const Json& state, const std::string& where) {
  IdentityEvidence e;
  RC_ASSIGN_OR_RETURN(e.boot_id, GetString(state, "boot_id", where));
  RC_ASSIGN_OR_RETURN(e.label, GetString(state, "weight_version", where));
  RC_ASSIGN_OR_RETURN(e.install_generation, GetNonNegativeInt(state, "install_generation", where));
  if (state.contains("content_digest") && !state["content_digest"].is_null()) {
    RC_ASSIGN_OR_RETURN(e.content_digest, GetString(state, "content_digest", where));
  }
  return e;
}

std::string PauseModeQuery(PauseMode m) { return std::string(lifecycle::PauseModeName(m)); }

}  // namespace

Result<double> PrometheusValue(const std::string& text, const std::string& name) {
  std::istringstream in(text);
  std::string line;
  bool found = false;
  double sum = 0;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    if (line.rfind(name, 0) != 0) continue;
    size_t after = name.size();
    if (after < line.size() && line[after] != '{' && line[after] != ' ') continue;  // a longer name
    size_t sp = line.rfind(' ');
    if (sp == std::string::npos) continue;
    try {
      sum += std::stod(line.substr(sp + 1));
      found = true;
    } catch (...) {
      std::string msg = "metric " + name;
      msg += ": unparsable sample '";
      msg += line;
      msg += "'";
      return InvalidArgument(msg);
    }
  }
  if (!found) return NotFound("metric " + name + " not found");
  return sum;
}

HttpEngineAdapter::HttpEngineAdapter(HttpAdapterOptions options) : s_(std::make_shared<Shared>()) {
  if (options.canary_prompt.empty()) {
    for (int i = 0; i < 64; ++i) options.canary_prompt.push_back(100 + (i * 37) % 200);
  }
  s_->options = std::move(options);
  // A flavour the URL names (vllm+http://, rolloutcore+http://) holds from the start, so a call
  // made before Describe goes to the right API; Describe still checks what answers.
  if (s_->options.expected_flavor != EngineFlavor::kUnknown) s_->flavor = s_->options.expected_flavor;
  s_->pool = std::make_unique<net::ClientPool>(s_->options.base_url);
  internal::VllmOptions vo;
  vo.base_url = s_->options.base_url;
  vo.directory_url = s_->options.directory_url;
  vo.model = s_->options.model;
  vo.canary_prompt = s_->options.canary_prompt;
  vo.stage_timeout_ms = s_->options.stage_timeout_ms;
  vo.reset_attempts = s_->options.reset_attempts;
  vo.reset_backoff_ms = s_->options.reset_backoff_ms;
  vo.gauge_probe_after_ms = s_->options.gauge_probe_after_ms;
  vo.pause_via_sleep = s_->options.vllm_pause_via_sleep;
  vo.native_transfer = s_->options.vllm_native_transfer;
  vo.native_trainer_url = s_->options.vllm_native_trainer_url;
  vo.native_init = s_->options.vllm_native_init;
  vo.native_timeout_ms = s_->options.vllm_native_timeout_ms;
  internal::HttpCall trainer_call;
  if (!vo.native_trainer_url.empty()) {
    // Runs on detached threads too (the concurrent halves of the native session), so it owns
    // copies of what it needs and never refers to the adapter.
    trainer_call = [url = vo.native_trainer_url,
                    timeout_ms = std::max(s_->options.http_timeout_ms, vo.native_timeout_ms + 5000)](
                       const std::string& method, const std::string& path,
                       const std::string& body) -> Result<internal::HttpReply> {
      auto c = net::MakeClient(url);
      net::SetClientTimeouts(*c, 5000, timeout_ms);
      httplib::Result r = method == "GET" ? c->Get(path.c_str()) : c->Post(path.c_str(), body, "application/json");
      if (!r) return Unavailable(method + " " + url + path + ": " + httplib::to_string(r.error()));
      return internal::HttpReply{r->status, r->body};
    };
  }
  Shared* raw = s_.get();  // owns the flavour, so outlives it
  s_->vllm = std::make_unique<internal::VllmFlavor>(
      std::move(vo),
      [raw](const std::string& method, const std::string& path,
            const std::string& body) -> Result<internal::HttpReply> {
        RC_ASSIGN_OR_RETURN(httplib::Response r, raw->Do(method, path, body));
        return internal::HttpReply{r.status, r.body};
      },
      std::move(trainer_call));
}

HttpEngineAdapter::~HttpEngineAdapter() = default;

EngineFlavor HttpEngineAdapter::flavor() const { return s_->flavor.load(); }

Result<EngineDescription> HttpEngineAdapter::Describe() {
  EngineDescription d;
  d.name = s_->options.base_url;
  auto state = s_->Do("GET", "/rc/engine/state");
  if (!state.ok()) return state.status();
  const EngineFlavor expected = s_->options.expected_flavor;
  if (state->status == 200) {
    if (expected == EngineFlavor::kVllm) {
      return FailedPrecondition(
          "engine at " + s_->options.base_url +
          " was given as vllm+http:// but answers GET /rc/engine/state: it is a rolloutcore engine");
    }
    s_->flavor = EngineFlavor::kRolloutcore;
    d.kind = "rolloutcore";
    d.offers_content_digest = true;
    d.supports_staging = true;
    d.caches = {CacheKind::kPrefix, CacheKind::kEncoder, CacheKind::kMultimodal};
    d.offers_replay = true;
    d.replay_tolerance = 1e-4;  // f32 compute (docs/lifecycle.md "Replay validation")
    return d;
  }
  // Not rolloutcore: is it an OpenAI-compatible server at all?
  RC_ASSIGN_OR_RETURN(httplib::Response health, s_->Do("GET", "/health"));
  if (health.status != 200) {
    return Unavailable("engine at " + s_->options.base_url + " is not healthy (GET /health answered " +
                       std::to_string(health.status) + ")");
  }
  if (expected == EngineFlavor::kRolloutcore) {
    return FailedPrecondition("engine at " + s_->options.base_url +
                              " was given as rolloutcore+http:// but does not answer GET /rc/engine/state (" +
                              std::to_string(state->status) + ")");
  }
  // vLLM (or another OpenAI-compatible server): only rolloutcore's worker extension makes it
  // drivable; VllmFlavor::Describe says which flags are missing otherwise.
  s_->flavor = EngineFlavor::kVllm;
  return s_->vllm->Describe();
}

Pending<DrainStatus> HttpEngineAdapter::GetDrainStatus() {
  return RunDetached<DrainStatus>([s = s_]() { return s->Drain(); });
}

Pending<PauseEvidence> HttpEngineAdapter::Pause(PauseMode mode) {
  return RunDetached<PauseEvidence>([s = s_, mode]() -> Result<PauseEvidence> {
    if (s->IsVllm()) return s->vllm->Pause(mode);
    RC_ASSIGN_OR_RETURN(Json ignored, s->DoJson("POST", "/pause?mode=" + PauseModeQuery(mode)));
    (void)ignored;
    PauseEvidence e;
    RC_ASSIGN_OR_RETURN(e.paused, s->IsPaused());
    RC_ASSIGN_OR_RETURN(DrainStatus d, s->Drain());
    // A kept (frozen) request still holds its slot but cannot run: only kWait/kAbort promise idle.
    e.running = d.running;
    return e;
  });
}

Status HttpEngineAdapter::SupportsPolicyMode(lifecycle::PolicyMode mode) {
  if (mode == lifecycle::PolicyMode::kStrict) return OkStatus();
  if (s_->IsVllm()) return s_->vllm->SupportsPolicyMode(mode);
  return OkStatus();  // the embedded engine reports each request's version spans
}

Pending<PauseEvidence> HttpEngineAdapter::PauseForUpdate(lifecycle::PolicyMode mode) {
  return RunDetached<PauseEvidence>([s = s_, mode]() -> Result<PauseEvidence> {
    using lifecycle::PolicyMode;
    if (s->IsVllm()) return s->vllm->PauseForUpdate(mode);
    if (mode == PolicyMode::kStrict) return InvalidArgument("PauseForUpdate: strict updates drain (Pause)");
    const std::string query = mode == PolicyMode::kAbort  ? "/pause?mode=abort"
                              : mode == PolicyMode::kKeep ? "/pause?mode=keep&inflight_kv=keep"
                                                          : "/pause?mode=keep&inflight_kv=recompute";
    RC_ASSIGN_OR_RETURN(Json reply, s->DoJson("POST", query));
    PauseEvidence e;
    RC_ASSIGN_OR_RETURN(e.paused, s->IsPaused());
    RC_ASSIGN_OR_RETURN(DrainStatus d, s->Drain());
    e.running = d.running;
    e.detail = Json{{"mode", lifecycle::PolicyModeName(mode)}, {"request", query}, {"reply", reply}};
    return e;
  });
}

Pending<AbortEvidence> HttpEngineAdapter::AbortRequests(const std::vector<std::string>& rollout_ids) {
  return RunDetached<AbortEvidence>([s = s_, rollout_ids]() -> Result<AbortEvidence> {
    RC_ASSIGN_OR_RETURN(Json j, s->DoJson("POST", "/abort_requests", Json{{"request_ids", rollout_ids}}.dump()));
    AbortEvidence e;
    if (j.is_object()) e.aborted = j.value("aborted", int64_t{0});
    return e;
  });
}

Pending<StageEvidence> HttpEngineAdapter::Stage(const UpdateTarget& target) {
  return RunDetached<StageEvidence>([s = s_, target]() -> Result<StageEvidence> {
    if (s->IsVllm()) return s->vllm->Stage(target);
    std::string model = s->options.model.empty() ? target.model : s->options.model;
    Json body{{"model", model}, {"version", target.label}, {"directory", s->options.directory_url}};
    RC_ASSIGN_OR_RETURN(Json j, s->DoJson("POST", "/rc/refit/stage", body.dump()));
    StageEvidence e;
    e.label = target.label;
    e.detail = j;
    if (j.is_object()) e.bytes = j.value("bytes_planned", int64_t{0});
    return e;
  });
}

Pending<InstallEvidence> HttpEngineAdapter::Install(const UpdateTarget& target, bool full) {
  return RunDetached<InstallEvidence>([s = s_, target, full]() -> Result<InstallEvidence> {
    if (s->IsVllm()) return s->vllm->Install(target, full);
    if (full) {
      // Recovery: the Runner stages nothing before a recovery install, and the engine holds a
      // staged copy only if the failed update left one (an engine restarted after a crash holds
      // none, and the engine's install refuses with 409 "nothing is staged"). Stage the target
      // here, inside the install's deadline, so the install rewrites every parameter from the
      // committed version. A failure is not "refused before mutation" in recovery: the engine
      // is TAINTED whatever its weights are, and stays so.
      std::string model = s->options.model.empty() ? target.model : s->options.model;
      Json stage{{"model", model}, {"version", target.label}, {"directory", s->options.directory_url}};
      auto staged = s->DoJson("POST", "/rc/refit/stage", stage.dump());
      if (!staged.ok()) return staged.status().WithContext("recovery: staging " + target.label);
    }
    Json body{{"version", target.label}, {"full", full}};
    auto resp = s->Do("POST", "/rc/refit/install", body.dump());
    if (!resp.ok()) return resp.status();  // connection lost mid-install: outcome unknown
    // The engine names what the install did in install_outcome (docs/engine.md); the status code
    // alone is not evidence. An answer without a known outcome is an error: outcome unknown.
    const std::string where = "install on " + s->options.base_url + " (HTTP " + std::to_string(resp->status) + ")";
    auto parsed = ParseJson(resp->body, "install response");
    if (!parsed.ok() || !parsed->is_object()) {
      return Internal(where + ": the answer is not a JSON object: " + resp->body);
    }
    const Json& j = *parsed;
    std::optional<lifecycle::InstallOutcome> outcome;
    if (j.contains("install_outcome") && j["install_outcome"].is_string()) {
      outcome = lifecycle::InstallOutcomeFromName(j["install_outcome"].get<std::string>());
    }
    if (!outcome) return Internal(where + " did not say whether live weights were touched: " + resp->body);
    InstallEvidence e;
    e.label = target.label;
    e.outcome = *outcome;
    e.detail = j;
    if (*outcome != lifecycle::InstallOutcome::kInstalled) {
      e.error = where + ": " + j.value("error", resp->body);
      return e;
    }
    if (resp->status != 200) return Internal(where + " says installed but is not a 200: " + resp->body);
    RC_ASSIGN_OR_RETURN(e.label, GetString(j, "weight_version", "install"));
    e.bytes = j.value("bytes_installed", int64_t{0});
    return e;
  });
}

Pending<CacheResetResult> HttpEngineAdapter::ResetCache(CacheKind kind) {
  return RunDetached<CacheResetResult>([s = s_, kind]() -> Result<CacheResetResult> {
    if (s->IsVllm()) return s->vllm->ResetCache(kind);
    std::string path = kind == CacheKind::kPrefix    ? "/reset_prefix_cache"
                       : kind == CacheKind::kEncoder ? "/reset_encoder_cache"
                                                     : "/reset_mm_cache";
    // Paused and idle by now: preempting running requests cannot hit anything.
    if (kind == CacheKind::kPrefix) path += "?reset_running_requests=true";
    RC_ASSIGN_OR_RETURN(Json j, s->DoJson("POST", path));
    CacheResetResult r;
    r.kind = kind;
    if (j.is_object() && j.contains("success")) {
      RC_ASSIGN_OR_RETURN(r.success, GetBool(j, "success", path));
      r.freed_blocks = j.value("freed_blocks", int64_t{0});
      r.blocks_in_use = j.value("blocks_in_use", int64_t{0});
      r.verified = true;  // the engine's own evidence body
      return r;
    }
    return DataLoss("POST " + s->Where(path) + " returned no evidence body");
  });
}

Pending<LabelEvidence> HttpEngineAdapter::ReadLabel() {
  return RunDetached<LabelEvidence>([s = s_]() -> Result<LabelEvidence> {
    if (s->IsVllm()) return s->vllm->ReadLabel();
    RC_ASSIGN_OR_RETURN(Json j, s->DoJson("GET", "/weight_info"));
    LabelEvidence e;
    RC_ASSIGN_OR_RETURN(e.label, GetString(j, "weight_version", "weight_info"));
    return e;
  });
}

Pending<DigestEvidence> HttpEngineAdapter::ReadContentDigest() {
  return RunDetached<DigestEvidence>([s = s_]() -> Result<DigestEvidence> {
    if (s->IsVllm()) return s->vllm->ReadContentDigest();
    if (s->flavor.load() != EngineFlavor::kRolloutcore) {
      return Unimplemented("engine at " + s->options.base_url + " offers no content digest");
    }
    RC_ASSIGN_OR_RETURN(Json j, s->DoJson("GET", "/rc/weights/digest"));
    DigestEvidence e;
    RC_ASSIGN_OR_RETURN(e.content_digest, GetString(j, "content_digest", "digest"));
    return e;
  });
}

Pending<ResumeEvidence> HttpEngineAdapter::Resume() {
  return RunDetached<ResumeEvidence>([s = s_]() -> Result<ResumeEvidence> {
    if (s->IsVllm()) return s->vllm->Resume();
    RC_ASSIGN_OR_RETURN(Json ignored, s->DoJson("POST", "/resume"));
    (void)ignored;
    ResumeEvidence e;
    RC_ASSIGN_OR_RETURN(e.paused_after, s->IsPaused());
    return e;
  });
}

Pending<lifecycle::ReplayEvidence> HttpEngineAdapter::Replay(const lifecycle::ReplayRequest& request) {
  return RunDetached<lifecycle::ReplayEvidence>([s = s_, request]() -> Result<lifecycle::ReplayEvidence> {
    if (s->IsVllm()) return s->vllm->Replay(request);
    RC_ASSIGN_OR_RETURN(Json j, s->DoJson("POST", "/rc/validate/replay", lifecycle::ToJson(request).dump()));
    return lifecycle::ReplayEvidenceFromJson(j, "replay");
  });
}

Result<EngineUrl> ParseEngineUrl(const std::string& url) {
  EngineUrl out;
  std::string rest = url;
  for (const auto& [prefix, flavor] :
       {std::pair<std::string, EngineFlavor>{"vllm+", EngineFlavor::kVllm},
        std::pair<std::string, EngineFlavor>{"rolloutcore+", EngineFlavor::kRolloutcore}}) {
    if (rest.rfind(prefix, 0) == 0) {
      out.flavor = flavor;
      rest = rest.substr(prefix.size());
      break;
    }
  }
  const bool http = rest.rfind("http://", 0) == 0, https = rest.rfind("https://", 0) == 0;
  const size_t host_at = http ? 7 : https ? 8 : 0;
  if ((!http && !https) || rest.size() == host_at || rest[host_at] == '/' || rest[host_at] == ':') {
    return InvalidArgument("engine URL '" + url +
                           "': expected http://HOST:PORT, vllm+http://HOST:PORT or rolloutcore+http://HOST:PORT");
  }
  while (rest.size() > host_at && rest.back() == '/') rest.pop_back();
  out.base_url = rest;
  return out;
}

std::function<Result<Json>(const Json&)> MakeHttpCompleter(const std::string& base_url, int64_t timeout_ms) {
  return [base_url, timeout_ms](const Json& body) -> Result<Json> {
    httplib::Client c(base_url);
    net::ApplyClientPolicy(c);
    c.set_connection_timeout(5, 0);
    c.set_read_timeout(timeout_ms / 1000, (timeout_ms % 1000) * 1000);
    auto r = c.Post("/v1/completions", body.dump(), "application/json");
    if (!r) return Unavailable("POST " + base_url + "/v1/completions: " + httplib::to_string(r.error()));
    if (r->status == 400) return InvalidArgument("engine " + base_url + ": " + r->body);
    if (r->status == 503) return Unavailable("engine " + base_url + ": " + r->body);
    if (r->status != 200) return Internal("engine " + base_url + " answered " + std::to_string(r->status) + ": " + r->body);
    return ParseJson(r->body, "completion from " + base_url);
  };
}

Pending<IdentityEvidence> HttpEngineAdapter::ProbeIdentity() {
  return RunDetached<IdentityEvidence>([s = s_]() -> Result<IdentityEvidence> {
    if (s->flavor.load() != EngineFlavor::kVllm) {
      // Also the flavour probe when Describe() was not called yet (a restarted controller).
      RC_ASSIGN_OR_RETURN(httplib::Response resp, s->Do("GET", "/rc/engine/state"));
      if (resp.status == 200) {
        s->flavor = EngineFlavor::kRolloutcore;
        const std::string where = "GET " + s->Where("/rc/engine/state");
        RC_ASSIGN_OR_RETURN(Json j, ParseJson(resp.body, where));
        return ProbeRolloutcoreIdentity(j, where);
      }
      if (s->flavor.load() == EngineFlavor::kRolloutcore) {
        return Unavailable("GET " + s->Where("/rc/engine/state") + " answered " + std::to_string(resp.status));
      }
    }
    return ProbeVllmIdentity(*s);
  });
}

Result<Json> HttpEngineAdapter::WarmCanary() {
  if (!s_->IsVllm())
    return FailedPrecondition("the canary is a vLLM check; engine at " + s_->options.base_url + " is not vLLM");
  return s_->vllm->WarmCanary("manual");
}

}  // namespace rc::adapters
