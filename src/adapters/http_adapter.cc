#include "rolloutcore/adapters/http_adapter.h"

#include <httplib.h>

#include <atomic>
#include <mutex>
#include <sstream>

#include "rolloutcore/base/json.h"
#include "rolloutcore/net/http.h"

namespace rc::adapters {

using lifecycle::AbortEvidence;
using lifecycle::CacheKind;
using lifecycle::CacheResetResult;
using lifecycle::DigestEvidence;
using lifecycle::DrainStatus;
using lifecycle::EngineDescription;
using lifecycle::InstallEvidence;
using lifecycle::LabelEvidence;
using lifecycle::PauseEvidence;
using lifecycle::PauseMode;
using lifecycle::ResumeEvidence;
using lifecycle::StageEvidence;
using lifecycle::UpdateTarget;

struct HttpEngineAdapter::Shared {
  HttpAdapterOptions options;
  std::atomic<EngineFlavor> flavor{EngineFlavor::kUnknown};

  std::unique_ptr<httplib::Client> Client() const {
    auto c = net::MakeClient(options.base_url);  // the process's API key and TLS CA (rolloutcore/net)
    auto secs = options.http_timeout_ms / 1000;
    auto usecs = (options.http_timeout_ms % 1000) * 1000;
    c->set_connection_timeout(5, 0);
    c->set_read_timeout(secs, usecs);
    c->set_write_timeout(secs, usecs);
    return c;
  }

  std::string Where(const std::string& path) const { return options.base_url + path; }

  // Performs one request; transport failures are Unavailable naming the URL.
  Result<httplib::Response> Do(const std::string& method, const std::string& path, const std::string& body = "") const {
    auto c = Client();
    httplib::Result r = method == "GET" ? c->Get(path.c_str())
                                        : c->Post(path.c_str(), body, body.empty() ? "text/plain" : "application/json");
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
    RC_ASSIGN_OR_RETURN(httplib::Response resp, Do("GET", "/metrics"));
    if (resp.status != 200) return Unavailable("GET " + Where("/metrics") + " answered " + std::to_string(resp.status));
    DrainStatus d;
    RC_ASSIGN_OR_RETURN(double running, PrometheusValue(resp.body, "vllm:num_requests_running"));
    RC_ASSIGN_OR_RETURN(double waiting, PrometheusValue(resp.body, "vllm:num_requests_waiting"));
    d.running = static_cast<int64_t>(running);
    d.waiting = static_cast<int64_t>(waiting);
    return d;
  }

  // Sends the canary and returns the cached prompt tokens vLLM reports for it.
  Result<int64_t> Canary() const {
    Json body{{"prompt", options.canary_prompt}, {"max_tokens", 1}, {"temperature", 0.0}};
    if (!options.model.empty()) body["model"] = options.model;
    RC_ASSIGN_OR_RETURN(Json j, DoJson("POST", "/v1/completions", body.dump()));
    if (!j.contains("usage") || !j["usage"].is_object()) {
      return DataLoss("canary response from " + Where("/v1/completions") + " has no usage");
    }
    const Json& usage = j["usage"];
    if (!usage.contains("prompt_tokens_details") || !usage["prompt_tokens_details"].is_object()) {
      return FailedPrecondition("vLLM at " + options.base_url +
                                " does not report cached tokens: start it with --enable-prompt-tokens-details");
    }
    return GetNonNegativeInt(usage["prompt_tokens_details"], "cached_tokens", "usage.prompt_tokens_details", 0);
  }
};

namespace {

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
      return InvalidArgument("metric " + name + ": unparsable sample '" + line + "'");
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
}

HttpEngineAdapter::~HttpEngineAdapter() = default;

EngineFlavor HttpEngineAdapter::flavor() const { return s_->flavor.load(); }

Result<EngineDescription> HttpEngineAdapter::Describe() {
  EngineDescription d;
  d.name = s_->options.base_url;
  auto state = s_->Do("GET", "/rc/engine/state");
  if (!state.ok()) return state.status();
  if (state->status == 200) {
    s_->flavor = EngineFlavor::kRolloutcore;
    d.kind = "rolloutcore";
    d.offers_content_digest = true;
    d.supports_staging = true;
    d.caches = {CacheKind::kPrefix, CacheKind::kEncoder, CacheKind::kMultimodal};
    return d;
  }
  // Not rolloutcore: is it an OpenAI-compatible server at all?
  RC_ASSIGN_OR_RETURN(httplib::Response health, s_->Do("GET", "/health"));
  if (health.status != 200) {
    return Unavailable("engine at " + s_->options.base_url + " is not healthy (GET /health answered " +
                       std::to_string(health.status) + ")");
  }
  s_->flavor = EngineFlavor::kVllm;
  d.kind = "vllm";
  d.offers_content_digest = false;
  d.supports_staging = false;
  d.caches = {CacheKind::kPrefix};
  return d;
}

Pending<DrainStatus> HttpEngineAdapter::GetDrainStatus() {
  return RunDetached<DrainStatus>([s = s_]() { return s->Drain(); });
}

Pending<PauseEvidence> HttpEngineAdapter::Pause(PauseMode mode) {
  return RunDetached<PauseEvidence>([s = s_, mode]() -> Result<PauseEvidence> {
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
    if (s->flavor.load() == EngineFlavor::kVllm) {
      // No receiver-driven staging on vLLM; warm the canary so the reset can be verified later.
      RC_ASSIGN_OR_RETURN(int64_t cached, s->Canary());
      (void)cached;
      return StageEvidence{target.label, 0, Json{{"canary", "warmed"}}};
    }
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
    if (s->flavor.load() == EngineFlavor::kVllm) {
      // Refused up front, nothing was touched: FailedPrecondition is the contract for that.
      return FailedPrecondition("vLLM at " + s->options.base_url +
                                " receives weights from the trainer (update_weights); receiver-driven install is "
                                "not available");
    }
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
    if (!resp.ok()) return resp.status();  // connection lost mid-install: ambiguous
    if (resp->status == 409) {
      // The engine refused before touching live weights (not paused, nothing staged).
      return FailedPrecondition("install refused by " + s->options.base_url + ": " + resp->body);
    }
    if (resp->status != 200) {
      return Internal("install on " + s->options.base_url + " answered " + std::to_string(resp->status) + ": " +
                      resp->body);
    }
    RC_ASSIGN_OR_RETURN(Json j, ParseJson(resp->body, "install response"));
    InstallEvidence e;
    RC_ASSIGN_OR_RETURN(e.label, GetString(j, "weight_version", "install"));
    e.bytes = j.value("bytes_installed", int64_t{0});
    e.detail = j;
    return e;
  });
}

Pending<CacheResetResult> HttpEngineAdapter::ResetCache(CacheKind kind) {
  return RunDetached<CacheResetResult>([s = s_, kind]() -> Result<CacheResetResult> {
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
      return r;
    }
    if (s->flavor.load() != EngineFlavor::kVllm) {
      return DataLoss("POST " + s->Where(path) + " returned no evidence body");
    }
    // vLLM: an empty 200 is not evidence; the canary check in Resume() is.
    r.success = true;
    r.blocks_in_use = -1;  // unknown; verified by the canary
    return r;
  });
}

Pending<LabelEvidence> HttpEngineAdapter::ReadLabel() {
  return RunDetached<LabelEvidence>([s = s_]() -> Result<LabelEvidence> {
    RC_ASSIGN_OR_RETURN(Json j, s->DoJson("GET", "/weight_info"));
    LabelEvidence e;
    RC_ASSIGN_OR_RETURN(e.label, GetString(j, "weight_version", "weight_info"));
    return e;
  });
}

Pending<DigestEvidence> HttpEngineAdapter::ReadContentDigest() {
  return RunDetached<DigestEvidence>([s = s_]() -> Result<DigestEvidence> {
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
    RC_ASSIGN_OR_RETURN(Json ignored, s->DoJson("POST", "/resume"));
    (void)ignored;
    ResumeEvidence e;
    RC_ASSIGN_OR_RETURN(e.paused_after, s->IsPaused());
    if (s->flavor.load() == EngineFlavor::kVllm && !e.paused_after) {
      RC_ASSIGN_OR_RETURN(int64_t cached, s->Canary());
      if (cached != 0) {
        return DataLoss("stale prefix cache: the canary reported " + std::to_string(cached) +
                        " cached prompt tokens after the reset");
      }
    }
    return e;
  });
}

std::function<Result<Json>(const Json&)> MakeHttpCompleter(std::string base_url, int64_t timeout_ms) {
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

Status HttpEngineAdapter::WarmCanary() { return s_->Canary().status(); }

}  // namespace rc::adapters
