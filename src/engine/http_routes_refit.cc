// The receiver-driven refit routes of the embedded engine (ENGINE_API.md "Weight version and
// transfer"; docs/engine.md, docs/refit.md): stage, relay, install, the live digest, replay
// validation and the engine state a controller checks.
#include <unistd.h>

#include <optional>

#include "engine/http_requests.h"
#include "engine/http_server_impl.h"

namespace rc::engine {

using http::ErrorJson;
using http::HttpStatus;
using http::SendError;
using http::SendJson;

namespace {

// The host of "scheme://host[:port][/path]" ("::1" for "[::1]:p"); empty when there is none.
std::string UrlHost(std::string_view url) {
  auto scheme = url.find("://");
  std::string_view rest = scheme == std::string_view::npos ? url : url.substr(scheme + 3);
  rest = rest.substr(0, rest.find_first_of("/?#"));
  if (auto at = rest.rfind('@'); at != std::string_view::npos) rest = rest.substr(at + 1);
  if (!rest.empty() && rest.front() == '[') return std::string(rest.substr(1, rest.find(']') - 1));
  return std::string(rest.substr(0, rest.find(':')));
}

// POST /rc/refit/stage names the directory to pull from; only the engine's own may be used, or
// (without --directory) one on this host. PermissionDenied names both.
Status CheckStageDirectory(const std::string& configured, const std::string& requested) {
  if (!configured.empty()) {
    if (net::TrimBaseUrl(requested) == net::TrimBaseUrl(configured)) return OkStatus();
    return PermissionDenied("directory: this engine stages only from the directory it was started with (--directory " +
                            configured + "), not '" + requested + "'");
  }
  if (net::IsLoopbackHost(UrlHost(requested))) return OkStatus();
  return PermissionDenied("directory: '" + requested + "' is not on this host; an engine started without "
                          "--directory stages only from a loopback directory (start it with --directory URL)");
}

}  // namespace

void EngineServer::Impl::RefitRoutes() {
  auto& svr = server_;
  // Receiver-driven refit (ENGINE_API.md): stage while serving, install only while paused.
  svr.Post("/rc/refit/stage", Guard([this](const httplib::Request& q, httplib::Response& r) {
    auto req = ParseStageBody(q.body);
    if (!req.ok()) return SendError(r, 400, req.status().message());
    if (Status allowed = CheckStageDirectory(options_.directory_url, req->directory); !allowed.ok()) {
      return SendError(r, 403, allowed.message());
    }
    auto out = receiver_.Stage(*req);
    if (!out.ok()) return SendError(r, HttpStatus(out.status()), out.status().message());
    SendJson(r, 200, out->ToJson());
  }));
  // Fan-out (docs/refit.md): serve a staged or live version as a source of it.
  svr.Post("/rc/refit/relay", Guard([this](const httplib::Request& q, httplib::Response& r) {
    auto req = ParseRelayBody(q.body, "engine-" + std::to_string(::getpid()));
    if (!req.ok()) return SendError(r, 400, req.status().message());
    if (Status allowed = CheckStageDirectory(options_.directory_url, req->directory); !allowed.ok()) {
      return SendError(r, 403, allowed.message());
    }
    auto out = receiver_.Relay(*req);
    if (!out.ok()) return SendError(r, HttpStatus(out.status()), out.status().message());
    SendJson(r, 200, out->ToJson());
  }));
  svr.Post("/rc/refit/install", Guard([this](const httplib::Request& q, httplib::Response& r) {
    auto req = ParseInstallBody(q.body);
    if (!req.ok()) return SendError(r, 400, req.status().message());
    // Every answer names its install_outcome (docs/engine.md): refused_untouched (409) — nothing
    // live was touched; failed_after_mutation (500) — the live weights may be partial;
    // installed (200). The receiver establishes it where the first live byte is written.
    auto error_with_outcome = [&r](int status, receiver::InstallOutcome outcome, const std::string& message) {
      Json body = ErrorJson(status, message);
      body["install_outcome"] = receiver::InstallOutcomeName(outcome);
      SendJson(r, status, body);
    };
    if (faults_.refuse_install.load()) {
      return error_with_outcome(409, receiver::InstallOutcome::kRefusedUntouched,
                                "install of " + req->version + " refused (fault injection): nothing was touched");
    }
    receiver::InstallResult out = receiver_.Install(req->version, req->skip_cache_reset);
    Delay(faults_.install_delay_ms);
    switch (out.outcome) {
      case receiver::InstallOutcome::kInstalled: return SendJson(r, 200, out.report.ToJson());
      case receiver::InstallOutcome::kRefusedUntouched:
        return error_with_outcome(409, out.outcome, out.status.message());
      case receiver::InstallOutcome::kFailedAfterMutation:
        return error_with_outcome(500, out.outcome, out.status.message());
    }
  }));
  svr.Get("/rc/weights/digest", Guard([this](const httplib::Request& q, httplib::Response& r) {
    auto fresh = ParseDigestQuery(q.params);
    if (!fresh.ok()) return SendError(r, 400, fresh.status().message());
    auto out = receiver_.LiveDigest(*fresh);
    Delay(faults_.digest_delay_ms);
    if (!out.ok()) return SendError(r, HttpStatus(out.status()), out.status().message());
    Json j = out->ToJson();
    if (!engine_->quantization().empty()) {
      // FP8 serving: the digest above proves the bf16 weights; this proves what the kernels read
      // is their quantization (docs/fp8.md). Always computed now: it is the validation's evidence.
      auto fp8 = engine_->Fp8Digests();
      if (!fp8.ok()) return SendError(r, HttpStatus(fp8.status()), fp8.status().message());
      j["fp8"] = fp8->ToJson();
    }
    SendJson(r, 200, j);
  }));
  svr.Post("/rc/validate/replay", Guard([this](const httplib::Request& q, httplib::Response& r) { Replay(q, r); }));
  svr.Get("/rc/engine/state", Guard([this](const httplib::Request&, httplib::Response& r) {
    // The digest first: one computed at the install generation read next is still current.
    const std::optional<std::string> digest = receiver_.CachedLiveDigest();
    const EngineState s = engine_->State();
    SendJson(r, 200, {{"paused", s.paused}, {"num_running", s.num_running}, {"num_waiting", s.num_waiting},
                      {"blocks_in_use", s.blocks_in_use}, {"num_kv_blocks", s.num_kv_blocks},
                      {"cached_blocks", s.cached_blocks}, {"weight_version", s.weight_version},
                      {"boot_id", engine_->boot_id()}, {"install_generation", s.install_generation},
                      {"content_digest", digest ? Json(*digest) : Json()},
                      {"quantization", engine_->quantization()}});
  }));
}

void EngineServer::Impl::Replay(const httplib::Request& q, httplib::Response& r) {
  auto req = ParseReplayBody(q.body);
  if (!req.ok()) return SendError(r, 400, req.status().message());
  auto out = engine_->Replay(req->prompt, req->steps, req->top_k);
  if (!out.ok()) return SendError(r, HttpStatus(out.status()), out.status().message());
  Json steps_json = Json::array();
  for (const SampleResult& s : out->steps) {
    Json top = Json::array();
    for (const auto& [t, lp] : s.top_logprobs) top.push_back(Json::array({t, lp}));
    steps_json.push_back(Json{{"token", s.token}, {"logprob", s.logprob}, {"top", top}});
  }
  SendJson(r, 200, Json{{"probe", req->probe}, {"steps", steps_json}, {"engine_ms", out->elapsed_ms},
                        {"precomputed", out->precomputed}, {"computed_on", out->computed_on},
                        {"staged_ms", out->staged_ms},
                        {"weight_version", engine_->WeightVersion()},
                        {"install_generation", engine_->State().install_generation}});
}

}  // namespace rc::engine
