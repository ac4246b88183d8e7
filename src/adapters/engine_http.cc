#include "adapters/engine_http.h"

#include <httplib.h>

#include "rolloutcore/net/http.h"

namespace rc::adapters::internal {

EngineHttp::EngineHttp(std::string base_url, int64_t timeout_ms)
    : base_url_(std::move(base_url)), timeout_ms_(timeout_ms), pool_(std::make_unique<net::ClientPool>(base_url_)) {}

EngineHttp::~EngineHttp() = default;

Result<HttpReply> EngineHttp::Call(const std::string& method, const std::string& path, const std::string& body) const {
  const int64_t ms = timeout_ms_;
  httplib::Result r = pool_->Request(method, path, body, body.empty() ? "text/plain" : "application/json",
                                     [ms](httplib::Client& c) { net::SetClientTimeouts(c, 5000, ms); });
  if (!r) return Unavailable(method + " " + Where(path) + ": " + httplib::to_string(r.error()));
  return HttpReply{r->status, r->body};
}

Result<Json> EngineHttp::CallJson(const std::string& method, const std::string& path, const std::string& body) const {
  RC_ASSIGN_OR_RETURN(HttpReply r, Call(method, path, body));
  if (r.status < 200 || r.status >= 300) {
    std::string msg = method + " " + Where(path) + " answered " + std::to_string(r.status) + ": " + ErrorMessage(r.body);
    if (r.status == 409 || r.status == 400) return FailedPrecondition(msg);
    if (r.status == 404) return NotFound(msg);
    return Unavailable(msg);
  }
  if (r.body.empty()) return Json();
  return ParseJson(r.body, method + " " + Where(path));
}

Result<HttpReply> EngineHttpOnce(const std::string& base_url, int64_t timeout_ms, const std::string& method,
                                 const std::string& path, const std::string& body) {
  auto c = net::MakeClient(base_url);
  net::SetClientTimeouts(*c, 5000, timeout_ms);
  httplib::Result r = method == "GET" ? c->Get(path.c_str()) : c->Post(path.c_str(), body, "application/json");
  if (!r) return Unavailable(method + " " + base_url + path + ": " + httplib::to_string(r.error()));
  return HttpReply{r->status, r->body};
}

Result<Json> PostCompletion(const std::string& base_url, const Json& body, int64_t timeout_ms) {
  httplib::Client c(base_url);
  net::ApplyClientPolicy(c);
  net::SetClientTimeouts(c, 5000, timeout_ms);
  auto r = c.Post("/v1/completions", body.dump(), "application/json");
  if (!r) return Unavailable("POST " + base_url + "/v1/completions: " + httplib::to_string(r.error()));
  if (r->status == 400) return InvalidArgument("engine " + base_url + ": " + r->body);
  if (r->status == 503) return Unavailable("engine " + base_url + ": " + r->body);
  if (r->status != 200) return Internal("engine " + base_url + " answered " + std::to_string(r->status) + ": " + r->body);
  return ParseJson(r->body, "completion from " + base_url);
}

lifecycle::EngineDescription StagingEngineDescription(const std::string& name, const std::string& kind) {
  lifecycle::EngineDescription d;
  d.name = name;
  d.kind = kind;
  d.offers_content_digest = true;
  d.supports_staging = true;
  d.caches = {lifecycle::CacheKind::kPrefix, lifecycle::CacheKind::kEncoder, lifecycle::CacheKind::kMultimodal};
  return d;
}

Result<lifecycle::IdentityEvidence> IdentityFromJson(const Json& j, const char* label_key, const char* generation_key,
                                                     const std::string& where) {
  lifecycle::IdentityEvidence e;
  RC_ASSIGN_OR_RETURN(e.boot_id, GetString(j, "boot_id", where));
  RC_ASSIGN_OR_RETURN(e.label, GetString(j, label_key, where));
  RC_ASSIGN_OR_RETURN(e.install_generation, GetNonNegativeInt(j, generation_key, where));
  if (j.contains("content_digest") && !j["content_digest"].is_null()) {
    RC_ASSIGN_OR_RETURN(e.content_digest, GetString(j, "content_digest", where));
  }
  if (j.contains("paused") && j["paused"].is_boolean()) e.paused = j["paused"].get<bool>();
  return e;
}

Result<lifecycle::QuantizedDigestEvidence> QuantizedFromJson(const Json& f, const std::string& where) {
  if (!f.is_object()) return DataLoss(where + ": fp8 is not an object but " + JsonTypeName(f));
  lifecycle::QuantizedDigestEvidence q;
  RC_ASSIGN_OR_RETURN(q.quantization, GetString(f, "quantization", where + " fp8"));
  RC_ASSIGN_OR_RETURN(q.expected, GetString(f, "expected_digest", where + " fp8"));
  if (f.contains("live_digest") && !f["live_digest"].is_null()) {
    RC_ASSIGN_OR_RETURN(q.live, GetString(f, "live_digest", where + " fp8"));
  }
  if (f.contains("mismatch") && f["mismatch"].is_string()) {
    q.detail = f["mismatch"].get<std::string>();
  } else if (f.contains("live_error") && f["live_error"].is_string()) {
    q.detail = f["live_error"].get<std::string>();
  }
  return q;
}

std::string ErrorMessage(const std::string& body) {
  auto j = ParseJson(body, "error body");
  if (j.ok() && j->is_object()) {
    for (const char* key : {"error", "detail"}) {
      if (!j->contains(key)) continue;
      const Json& e = (*j)[key];
      if (e.is_string()) return e.get<std::string>();
      if (e.is_object() && e.contains("message") && e["message"].is_string()) return e["message"].get<std::string>();
    }
  }
  return body;
}

}  // namespace rc::adapters::internal
