// TrainerServer: the HTTP/JSON control API of `rolloutcore trainer serve` (docs/trainer.md):
//   GET  /health            {"ok": true}
//   GET  /status            SyntheticTrainer::StatusJson()
//   POST /step              publishes the next version; 200 with its VersionStatus JSON
//   POST /release           body {"version": "v3"}; 200 {"version": "v3", "released": true}
// Errors answer {"error": {"code": "NotFound", "message": "..."}} with 400 (InvalidArgument),
// 401 (Unauthenticated: no or wrong API key), 404 (NotFound), 405 (wrong method), 409
// (FailedPrecondition / AlreadyExists / Aborted), 501 (Unimplemented), 503 (Unavailable), 504
// (DeadlineExceeded) or 500: the mapping of every rolloutcore server (rolloutcore/net/http_status.h).
//
// Binds 127.0.0.1 unless told otherwise. Server policy (API key on every POST, 405 + Allow, UTF-8
// checks, TLS, timeouts, worker pool) is rc::net's (rolloutcore/net/http.h). Thread safety: Start
// and Stop from one owning thread; requests are served on the server's worker threads and go
// straight to the (thread-safe) trainer. The trainer must outlive the server.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "rolloutcore/base/status.h"
#include "rolloutcore/net/http_status.h"
#include "rolloutcore/net/security.h"
#include "rolloutcore/trainer/synthetic_trainer.h"

namespace rc::trainer {

struct TrainerServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: an ephemeral port
  // API key (POST /step, /release, /fault/* need it when set), TLS, and the non-loopback rule.
  net::ServerSecurity security;
};

class TrainerServer {
 public:
  // on_step (optional) is called after every step made through POST /step, for progress output.
  TrainerServer(SyntheticTrainer* trainer, TrainerServerOptions options,
                std::function<void(const Result<VersionStatus>&)> on_step = {});
  ~TrainerServer();  // Stop()s
  TrainerServer(const TrainerServer&) = delete;
  TrainerServer& operator=(const TrainerServer&) = delete;

  // Unavailable naming host:port when the bind fails; FailedPrecondition for a non-loopback host
  // without an API key.
  [[nodiscard]] Status Start();
  void Stop();  // idempotent
  int port() const { return port_; }
  std::string url() const;

 private:
  struct Impl;
  SyntheticTrainer* const trainer_;
  const TrainerServerOptions options_;
  std::function<void(const Result<VersionStatus>&)> on_step_;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

// HTTP status for a Status code, as documented above (rolloutcore/net/http_status.h).
using net::HttpStatusFor;

}  // namespace rc::trainer
