// The one HTTP client every HTTP engine kind uses (rolloutcore's engine, vLLM): kept-alive
// connections to the engine (net::ClientPool, with the process's API key and TLS CA), one timeout,
// errors that name the URL. Rollouts go on their own connection (PostCompletion): they may take
// minutes and must not hold a pooled connection the lifecycle calls need.
//
// Internal to the adapters module; include only from its .cc files.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "rolloutcore/base/json.h"
#include "rolloutcore/base/status.h"
#include "rolloutcore/lifecycle/types.h"

namespace rc::net {
class ClientPool;
}

namespace rc::adapters::internal {

struct HttpReply {
  int status = 0;
  std::string body;
};
// One HTTP request ("GET"/"POST", path with query, JSON body or empty). A transport failure is
// Unavailable naming the URL.
using HttpCall =
    std::function<Result<HttpReply>(const std::string& method, const std::string& path, const std::string& body)>;

class EngineHttp {
 public:
  EngineHttp(std::string base_url, int64_t timeout_ms);
  ~EngineHttp();
  EngineHttp(const EngineHttp&) = delete;
  EngineHttp& operator=(const EngineHttp&) = delete;

  const std::string& base_url() const { return base_url_; }
  std::string Where(const std::string& path) const { return base_url_ + path; }

  Result<HttpReply> Call(const std::string& method, const std::string& path, const std::string& body = "") const;
  // A 2xx answer as JSON (an empty body is null). Otherwise an error naming the call and the
  // answer: 400/409 → FailedPrecondition, 404 → NotFound, others → Unavailable.
  Result<Json> CallJson(const std::string& method, const std::string& path, const std::string& body = "") const;

 private:
  const std::string base_url_;
  const int64_t timeout_ms_;
  std::unique_ptr<net::ClientPool> pool_;
};

// One request on a connection of its own (a peer other than the engine, e.g. the native sender).
Result<HttpReply> EngineHttpOnce(const std::string& base_url, int64_t timeout_ms, const std::string& method,
                                 const std::string& path, const std::string& body);

// POSTs body to base_url/v1/completions on a connection of its own and returns the answer's JSON;
// non-2xx answers become errors carrying the engine's message (400 → InvalidArgument,
// 503 → Unavailable, others → Internal).
Result<Json> PostCompletion(const std::string& base_url, const Json& body, int64_t timeout_ms);

// What every HTTP engine kind that stages and proves weights is: a content digest of live weights,
// staging, and the prefix, encoder and multimodal caches to reset. The kind adds the rest.
lifecycle::EngineDescription StagingEngineDescription(const std::string& name, const std::string& kind);

// An engine's identity as one JSON object reports it: boot_id, the label under `label_key`, the
// install generation under `generation_key`, and content_digest (null or absent: none cached).
// Errors name `where` and the missing or mistyped field.
Result<lifecycle::IdentityEvidence> IdentityFromJson(const Json& j, const char* label_key, const char* generation_key,
                                                     const std::string& where);

// The "fp8" object of an engine's digest reply (docs/fp8.md): quantization, expected_digest,
// live_digest (null when the image has no consistent digest) and the first mismatch. The embedded
// engine's GET /rc/weights/digest and the vLLM extension's rc_digest / rc_install answer the same
// shape. Errors name `where` and the field.
Result<lifecycle::QuantizedDigestEvidence> QuantizedFromJson(const Json& f, const std::string& where);

// vLLM's (and FastAPI's) error bodies: {"error": {"message": ...}}, {"error": "..."} or
// {"detail": ...}; anything else is returned as is.
std::string ErrorMessage(const std::string& body);

}  // namespace rc::adapters::internal
