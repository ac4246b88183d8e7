// DirectoryServer: serves a DirectoryStore over the HTTP/JSON API of docs/directory.md
// (`rolloutcore directory serve`).
//
// Binds 127.0.0.1 unless told otherwise. Server policy (API key on every POST/DELETE, TLS, UTF-8
// checks, timeouts, worker pool) is rc::net's (rolloutcore/net/http.h). Bad input is answered 400
// naming the field, unknown things 404, state conflicts 409; nothing a client sends can crash the
// server (bodies are size- and depth-limited, and every handler catches). Long-polls (GET
// .../commits?timeout_ms=T) each hold one worker thread, so the pool grows for many concurrent
// watchers; Stop() answers them within wait_slice_ms.
//
// Thread safety: Start and Stop from one owning thread; requests are served on the server's own
// worker threads. The store must outlive the server.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "rolloutcore/base/status.h"
#include "rolloutcore/directory/store.h"
#include "rolloutcore/net/security.h"

namespace rc::directory {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: an ephemeral port (see port())
  size_t max_body_bytes = size_t{256} << 20;
  int64_t max_wait_ms = 60'000;  // longest long-poll a client may ask for
  int threads = 256;  // most worker threads (they start on demand; long-polls and slow clients hold one each)
  std::string store_kind = "memory";  // shown by GET /health
  // API key (every POST/DELETE needs it when set), TLS, and the non-loopback rule (rc::net).
  net::ServerSecurity security;
};

class DirectoryServer {
 public:
  DirectoryServer(DirectoryStore* store, ServerOptions options);
  ~DirectoryServer();  // Stop()s
  DirectoryServer(const DirectoryServer&) = delete;
  DirectoryServer& operator=(const DirectoryServer&) = delete;

  // Binds and starts serving on a background thread. Unavailable naming host:port when the bind
  // fails; FailedPrecondition for a non-loopback host without an API key (net::HttpServer::Start).
  [[nodiscard]] Status Start();
  // Stops accepting, answers pending long-polls, joins the server thread. Idempotent.
  void Stop();

  int port() const { return port_; }
  // "http://127.0.0.1:PORT" ("https://..." with TLS).
  std::string url() const;

 private:
  struct Impl;
  DirectoryStore* const store_;
  const ServerOptions options_;
  std::unique_ptr<Impl> impl_;
  std::atomic<bool> stopping_{false};
  bool started_ = false;
  int port_ = 0;
};

}  // namespace rc::directory
