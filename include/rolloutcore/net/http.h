// rc::net: the one HTTP policy every rolloutcore server and client shares (README "Security").
//
// Server policy (HttpServer, a thin owner of a cpp-httplib server):
//   - Authentication: when an API key is set, every request whose method is not GET or HEAD
//     must carry "Authorization: Bearer <key>" (compared in constant time); otherwise 401 with a
//     JSON error before the body is even read, and nothing runs. GET/HEAD (health, metrics,
//     status, journal reads, long-polls) stay open. A server bound to a non-loopback address
//     refuses to start without a key unless `insecure_no_auth` is set (then it warns).
//   - Input: a path, query parameter or body that is not valid UTF-8 is answered 400 naming the
//     field (for a JSON body, the key path of the string that holds the bad byte) before the
//     route's handler runs; DumpJson replaces invalid bytes, so no error reply throws.
//   - Methods: a path that exists for other methods answers 405 with an `Allow` header.
//   - Slow clients: read/write timeouts, a worker pool that grows on demand up to max_threads
//     (idle or trickling sockets each hold one worker, so many are needed), and a listen backlog
//     of listen_backlog instead of cpp-httplib's compiled-in 5.
//   - Header block (issue 36): the request line and headers of every request (each request of a
//     kept-alive connection) get at most max_header_bytes bytes and max_header_count header lines.
//     The connection's stream stops handing bytes to cpp-httplib's parser at the bound, so no more
//     than that is ever parsed; the answer is 431 and the connection is closed. (cpp-httplib 0.11,
//     Debian's, bounds only each line (8 KiB, compiled into the shared library, so no macro of ours
//     could change it) and parses any number of lines.)
//   - Bodies (issue 36): every route of the four servers parses its body as JSON, which takes
//     8-30x the text in memory, so a body over max_json_body_bytes is answered 413 naming the
//     limit — before it is read when Content-Length says so (then the connection is closed),
//     after it otherwise (chunked; max_body_bytes still bounds what is read). GET and HEAD carry
//     no body: one that announces one is answered 413 unread, so open routes read nothing.
//   - Long-polls (issue 36): a handler that waits (a long-poll) takes one of max_long_polls slots
//     (TryLongPoll; default a quarter of max_threads) and answers 503 + Retry-After when none is
//     free, so open, unauthenticated waits can never hold the workers authenticated writes need.
//     It waits in short slices and returns early when its client closed the connection
//     (ClientGone) or the server is stopping (stopping()).
//   - TLS: with tls_cert_file and tls_key_file the server speaks HTTPS (cpp-httplib's OpenSSL
//     support, which Debian's libcpp-httplib is built with).
// Error bodies are made by HttpServerOptions::error_body, so each server keeps its own shape.
//
// Client policy (ClientConfig in security.h, ApplyClientPolicy, MakeClient): the bearer key and
// the CA file for https URLs. A process has one default config, read from ROLLOUTCORE_API_KEY and
// ROLLOUTCORE_TLS_CA_FILE, or set once by a command from its flags (SetDefaultClientConfig)
// before it starts threads; every client in the project uses it unless given another.
//
// Thread safety: HttpServer's route registration, Start and Stop from one owning thread before /
// after serving; handlers run on the pool's threads, each serving one connection at a time
// (ClientGone is about that connection, so it is called on the handler's thread only);
// TryLongPoll, long_polls and stopping from any thread. ClientConfig::Default may be called from
// any thread; SetDefaultClientConfig is meant for start-up.
#pragma once

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "rolloutcore/base/json.h"
#include "rolloutcore/base/mutex.h"
#include "rolloutcore/base/status.h"
#include "rolloutcore/net/security.h"

namespace rc::net {

struct HttpServerOptions {
  std::string name = "server";  // in messages and logs: "directory", "engine", ...
  std::string host = "127.0.0.1";
  int port = 0;  // 0: an ephemeral port (see port())
  ServerSecurity security;
  int max_threads = 256;  // workers grow on demand up to this many
  int64_t read_timeout_ms = 10'000;
  int64_t write_timeout_ms = 10'000;
  int64_t keep_alive_timeout_ms = 2'000;  // an idle keep-alive connection gives its worker back after this
  int listen_backlog = 1024;
  size_t max_body_bytes = size_t{64} << 20;  // cpp-httplib's bound on what it reads of a body (413)
  // The largest body a handler gets (all routes parse theirs as JSON: 8-30x the text in memory).
  size_t max_json_body_bytes = size_t{8} << 20;
  // Request line plus header block of one request, and the number of header lines in it; 431 beyond.
  size_t max_header_bytes = size_t{64} << 10;
  int max_header_count = 100;
  // Handlers waiting in a long-poll at once (TryLongPoll); 0: max_threads / 4, at least 1.
  int max_long_polls = 0;
  // The body of an error this layer answers (401, 405, 400 for UTF-8, 404 for no route, 413, 431), in the
  // server's own shape; default {"error": {"code": Name, "message": msg}}.
  std::function<std::string(int http_status, const Status& status)> error_body;
};

// True for 127.0.0.0/8, ::1 and "localhost".
bool IsLoopbackHost(std::string_view host);

// OK on a loopback host or with an API key; FailedPrecondition naming the host otherwise, unless
// insecure_no_auth (then it logs a warning). HttpServer::Start calls it; a command may call it
// earlier, before it does anything else.
Status CheckBindSecurity(std::string_view name, std::string_view host, const ServerSecurity& security);

// Compares in time that depends only on the lengths, not on where the strings differ.
bool ConstantTimeEquals(std::string_view a, std::string_view b);

// The offset of the first byte that is not part of well-formed UTF-8 (RFC 3629: no overlongs,
// no surrogates, nothing above U+10FFFF), or nullopt when all of `s` is valid.
std::optional<size_t> FirstInvalidUtf8(std::string_view s);

// OK, or InvalidArgument "<what>: invalid UTF-8 (byte 0xff at offset 3)". For a JSON text `what`
// is refined to the key path of the string that holds the byte ("request body: prompt[1]").
Status CheckUtf8(std::string_view s, std::string_view what);
Status CheckJsonUtf8(std::string_view json_text, std::string_view what);

// j.dump() that never throws: invalid UTF-8 in strings is replaced by U+FFFD.
std::string DumpJson(const Json& j);

class HttpServer {
 public:
  using Handler = httplib::Server::Handler;

  explicit HttpServer(HttpServerOptions options);
  ~HttpServer();  // Stop()s
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Route registration, as cpp-httplib's (pattern is a regex over the path); recorded so that a
  // path served under other methods answers 405 + Allow.
  HttpServer& Get(const std::string& pattern, Handler handler);
  HttpServer& Post(const std::string& pattern, Handler handler);
  HttpServer& Put(const std::string& pattern, Handler handler);
  HttpServer& Patch(const std::string& pattern, Handler handler);
  HttpServer& Delete(const std::string& pattern, Handler handler);
  HttpServer& set_exception_handler(httplib::Server::ExceptionHandler handler);

  // Checks the security options (FailedPrecondition for a non-loopback bind without a key and
  // without insecure_no_auth; InvalidArgument for a half-given or unreadable TLS pair), binds
  // (Unavailable naming host:port when it cannot) and serves on a background thread.
  [[nodiscard]] Status Start();
  // Stops accepting, finishes the requests in flight, joins. Idempotent.
  void Stop();
  // Blocks until the serving thread ends (Stop from another thread, or a fatal listener error).
  void Wait();

  // A claim on one of max_long_polls slots, held by a handler while it waits; given back when
  // destroyed. False when every slot was taken: the handler answers 503 + Retry-After instead.
  class LongPollSlot {
   public:
    LongPollSlot() = default;
    ~LongPollSlot();
    LongPollSlot(LongPollSlot&& o) noexcept : count_(std::exchange(o.count_, nullptr)) {}
    LongPollSlot& operator=(LongPollSlot&&) = delete;
    explicit operator bool() const { return count_ != nullptr; }

   private:
    friend class HttpServer;
    explicit LongPollSlot(std::atomic<int>* count) : count_(count) {}
    std::atomic<int>* count_ = nullptr;
  };
  // Any handler thread.
  LongPollSlot TryLongPoll();
  int long_polls() const { return long_polls_.load(); }  // slots held now
  int max_long_polls() const;

  // From a handler: true when the client of the request this thread is answering has closed (or
  // reset) its connection, so waiting for it is pointless. A client that only shut down its
  // sending side counts as gone too (no HTTP client does that while awaiting an answer).
  static bool ClientGone();
  // True from the start of Stop(): waiting handlers return at their next slice.
  bool stopping() const { return stopping_.load(); }

  int port() const { return port_; }
  bool tls() const;
  // "http://HOST:PORT" or "https://HOST:PORT".
  std::string url() const;
  const HttpServerOptions& options() const { return options_; }

 private:
  struct Route {
    std::string method;
    std::string pattern;
  };
  HttpServer& Add(const std::string& method, const std::string& pattern, Handler handler);
  httplib::Server::HandlerResponse PreRouting(const httplib::Request& req, httplib::Response& res) const;
  httplib::Server::HandlerResponse OnError(const httplib::Request& req, httplib::Response& res) const;
  void SendPolicyError(httplib::Response& res, int http_status, const Status& status) const;
  void SendBodyTooLarge(httplib::Response& res, uint64_t bytes) const;

  const HttpServerOptions options_;
  std::unique_ptr<httplib::Server> http_;
  std::vector<Route> routes_;  // written before Start only
  std::thread thread_;
  int port_ = 0;
  std::atomic<int> long_polls_{0};
  std::atomic<bool> stopping_{false};
};

// Sets the bearer key and, for https, certificate verification against tls_ca_file.
void ApplyClientPolicy(httplib::Client& client, const ClientConfig& config = ClientConfig::Default());
// base_url without its trailing slashes ("http://h:p/" -> "http://h:p"): cpp-httplib takes a
// base URL without a path, and paths are joined on with their own leading '/'.
std::string TrimBaseUrl(std::string_view base_url);
// A client for base_url ("http://h:p" or "https://h:p"; a trailing '/' is dropped) with the policy applied.
std::unique_ptr<httplib::Client> MakeClient(const std::string& base_url,
                                            const ClientConfig& config = ClientConfig::Default());

// Sets the connect timeout and the read and write timeouts of `client`, in milliseconds.
void SetClientTimeouts(httplib::Client& client, int64_t connect_ms, int64_t read_write_ms);

// Keep-alive clients of one base URL, reused across requests (issue 15: no TCP handshake and no
// new server worker per call). Request() takes an idle client (one that answered within
// max_idle_ms, well inside the servers' 2 s keep-alive timeout, so the server has not closed it)
// or makes one, sends, and keeps the client for the next request when the call got an answer below
// 500 without "Connection: close"; a client whose call failed, or got a 5xx (servers may close the
// connection after an error: uvicorn does when the app raised), is dropped. A request on a reused
// connection that failed before an answer is sent again once on a new connection when that is
// safe: always for GET and DELETE, for other methods only when the request could not be written
// (the server never saw it). `prepare` sets per-call options (timeouts) on the client before it
// sends. At most max_idle clients are kept.
// Thread safety: any thread; each client is used by one request at a time.
// True when `url` is a base URL of an HTTP service: http:// or https:// followed by a host (and
// port), with no path beyond trailing slashes.
// (cpp-httplib takes a URL without a scheme as a host name, so a missing scheme would surface only
// as a connection error at the first call.)
bool IsHttpUrl(std::string_view url);

class ClientPool {
 public:
  explicit ClientPool(std::string base_url, ClientConfig config = ClientConfig::Default(), int64_t max_idle_ms = 1000,
                      size_t max_idle = 4);
  ~ClientPool();
  ClientPool(const ClientPool&) = delete;
  ClientPool& operator=(const ClientPool&) = delete;

  // True when base_url parses (cpp-httplib's Client::is_valid); an invalid pool's requests fail
  // with Error::Connection.
  bool valid() const { return valid_; }
  const std::string& base_url() const { return base_url_; }

  httplib::Result Request(const std::string& method, const std::string& path, const std::string& body,
                          const std::string& content_type, const std::function<void(httplib::Client&)>& prepare);

  // Counters (for tests and benchmarks): clients made, requests sent on a reused connection.
  int64_t clients_made() const;
  int64_t reused() const;

 private:
  struct Idle {
    std::unique_ptr<httplib::Client> client;
    std::chrono::steady_clock::time_point since;
  };
  std::unique_ptr<httplib::Client> Take(bool* reused);
  void GiveBack(std::unique_ptr<httplib::Client> c);

  const std::string base_url_;
  const ClientConfig config_;
  const int64_t max_idle_ms_;
  const size_t max_idle_;
  const bool valid_;
  mutable rc::Mutex mu_;
  std::vector<Idle> idle_ GUARDED_BY(mu_);
  int64_t made_ GUARDED_BY(mu_) = 0;
  int64_t reused_ GUARDED_BY(mu_) = 0;
};

}  // namespace rc::net
