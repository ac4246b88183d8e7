// ControllerHttpServer: the controller's HTTP API (docs/controller.md) over a ControllerService.
//
//   POST /v1/rollouts                 generate under a binding (503 + Retry-After when no engine is READY)
//   POST /v1/rollouts:admit           lease mode: a binding for a client that generates itself
//   POST /v1/rollouts/{id}:finish     lease mode: finish with {token_ids, logprobs, finish_reason, ...}
//   POST /v1/updates {model, version} queue an update of every engine → {"id"}
//   GET  /v1/updates/{id}             phase, per-phase ms, outcome and evidence per engine;
//                                     ?wait_ms=T long-polls up to min(T, max_wait_ms) (issue 36: clamped,
//                                     never overflows; 503 + Retry-After when max_long_polls wait
//                                     already; ends early when the client closes its connection)
//   POST /v1/recover {model, version} recover TAINTED engines to a committed version
//   GET  /v1/status, GET /v1/journal?since=SEQ&engine=I, GET /v1/trajectories?label=L&format=jsonl|json,
//   GET  /metrics, GET /health
//
// Errors are JSON {"error": message, "code": StatusCodeName} with 400 (bad input, naming the
// field), 404, 409 (state conflict), 503 (retryable), 504, 500. Handlers never let an exception
// escape. Binds 127.0.0.1 unless told otherwise. Server policy (API key on every POST, 405 + Allow,
// UTF-8 checks, TLS, timeouts, worker pool) is rc::net's (rolloutcore/net/http.h): with a key, the
// POSTs above answer 401 without it and the GETs stay open.
//
// Thread safety: Start/Stop from the owning thread; handlers run on httplib's worker threads.
#pragma once

#include <memory>
#include <string>

#include "rolloutcore/controller/service.h"
#include "rolloutcore/net/http_status.h"
#include "rolloutcore/net/security.h"

namespace rc::controller {

struct ControllerHttpOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: any free port
  net::ServerSecurity security;  // API key, TLS, the non-loopback rule
  // The longest wait a GET /v1/updates/{id}?wait_ms= may ask for; a larger wait_ms is clamped to
  // it (the answer is then the update's status at that time, done or not, as for any wait).
  // At most a day (a larger value is taken as a day), so no deadline can overflow.
  int64_t max_wait_ms = 120'000;
  // Long-polls waiting at once; 0: rc::net's default (a quarter of the HTTP workers).
  int max_long_polls = 0;
};

class ControllerHttpServer {
 public:
  ControllerHttpServer(ControllerService* service, const ControllerHttpOptions& options);
  ControllerHttpServer(ControllerService* service, std::string host, int port);  // no key, no TLS
  ~ControllerHttpServer();
  // Binds and starts serving on a background thread; Unavailable when the port is taken,
  // FailedPrecondition for a non-loopback host without an API key.
  Status Start();
  int port() const;
  void Stop();
  void Wait();

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

// HTTP status for a Status code (the mapping every rolloutcore server uses).
using net::HttpStatusFor;

}  // namespace rc::controller
