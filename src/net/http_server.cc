// HttpServer: the shared server policy of rc::net (http.h).
#include <arpa/inet.h>
#include <fmt/format.h>
#include <sys/socket.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <fstream>
#include <mutex>
#include <regex>

#include "rolloutcore/base/log.h"
#include "rolloutcore/base/mutex.h"
#include "rolloutcore/net/http.h"

namespace rc::net {
namespace {

// A worker pool that starts a thread whenever a connection arrives and every worker is busy, up
// to max_threads; then connections wait in order. cpp-httplib's ThreadPool has a fixed size
// (max(8, cores - 1) by default), so a handful of idle or trickling sockets, each holding a
// worker, starve everyone else. Workers are kept once started (an idle one costs a stack).
class ElasticPool final : public httplib::TaskQueue {
 public:
  explicit ElasticPool(size_t max_threads) : max_threads_(std::max<size_t>(max_threads, 1)) {}
  ~ElasticPool() override = default;

  void enqueue(std::function<void()> fn) override {
    rc::MutexLock lock(mu_);
    jobs_.push_back(std::move(fn));
    if (jobs_.size() > idle_ && threads_.size() < max_threads_) {
      threads_.emplace_back([this] { Work(); });
    } else {
      cv_.notify_one();
    }
  }

  void shutdown() override {
    std::vector<std::thread> threads;
    {
      rc::MutexLock lock(mu_);
      shutdown_ = true;
      threads.swap(threads_);
    }
    cv_.notify_all();
    for (auto& t : threads) t.join();
  }

 private:
  void Work() {
    rc::MutexLock lock(mu_);
    for (;;) {
      ++idle_;
      cv_.wait(lock, [this]() REQUIRES(mu_) { return !jobs_.empty() || shutdown_; });
      --idle_;
      if (jobs_.empty()) return;  // shutting down and nothing left
      std::function<void()> fn = std::move(jobs_.front());
      jobs_.pop_front();
      lock.unlock();
      fn();
      lock.lock();
    }
  }

  const size_t max_threads_;
  rc::Mutex mu_;
  rc::CondVar cv_;
  std::deque<std::function<void()>> jobs_ GUARDED_BY(mu_);  // guarded by mu_
  std::vector<std::thread> threads_ GUARDED_BY(mu_);        // guarded by mu_
  size_t idle_ GUARDED_BY(mu_) = 0;                         // guarded by mu_
  bool shutdown_ GUARDED_BY(mu_) = false;                   // guarded by mu_
};

std::string DefaultErrorBody(int, const Status& s) {
  return DumpJson(Json{{"error", Json{{"code", std::string(StatusCodeName(s.code()))}, {"message", s.message()}}}});
}

bool Readable(const std::string& path) {
  std::ifstream f(path);
  return f.good();
}

void SetTimeout(httplib::Server& http, int64_t ms, bool read) {
  const auto sec = static_cast<time_t>(ms / 1000);
  const auto usec = static_cast<time_t>((ms % 1000) * 1000);
  if (read) {
    http.set_read_timeout(sec, usec);
  } else {
    http.set_write_timeout(sec, usec);
  }
}

}  // namespace

bool IsLoopbackHost(std::string_view host) {
  if (host == "localhost") return true;
  std::string h(host);
  if (h.size() > 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  in_addr v4{};
  if (inet_pton(AF_INET, h.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (inet_pton(AF_INET6, h.c_str(), &v6) == 1) return IN6_IS_ADDR_LOOPBACK(&v6);
  return false;
}

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  // Every byte of the longer string is looked at whatever the contents; only the lengths leak.
  const size_t n = std::max(a.size(), b.size());
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const auto x = static_cast<unsigned char>(i < a.size() ? a[i] : 0);
    const auto y = static_cast<unsigned char>(i < b.size() ? b[i] : 0);
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

Status CheckBindSecurity(std::string_view name, std::string_view host, const ServerSecurity& sec) {
  if (IsLoopbackHost(host) || !sec.api_key.empty()) return OkStatus();
  if (!sec.insecure_no_auth) {
    return FailedPrecondition(
        fmt::format("{}: refusing to serve on {} (not loopback) without an API key: set --api-key or {}, or pass "
                    "--insecure-no-auth to serve without authentication",
                    name, host, kApiKeyEnv));
  }
  RC_LOG_WARN(
      "{}: serving on {} WITHOUT authentication (--insecure-no-auth): anyone who can reach it can change "
      "its state",
      name, host);
  return OkStatus();
}

HttpServer::HttpServer(HttpServerOptions options) : options_(std::move(options)) {
  const ServerSecurity& sec = options_.security;
  if (!sec.tls_cert_file.empty() && !sec.tls_key_file.empty()) {
    http_ = std::make_unique<httplib::SSLServer>(sec.tls_cert_file.c_str(), sec.tls_key_file.c_str());
  } else {
    http_ = std::make_unique<httplib::Server>();
  }
  const auto threads = static_cast<size_t>(std::max(options_.max_threads, 1));
  http_->new_task_queue = [threads] { return new ElasticPool(threads); };
  http_->set_payload_max_length(options_.max_body_bytes);
  SetTimeout(*http_, options_.read_timeout_ms, true);
  SetTimeout(*http_, options_.write_timeout_ms, false);
  // Kept-alive connections (net::ClientPool) carry many requests: an answer written in pieces must
  // not wait for the client's delayed ACK behind Nagle's algorithm.
  http_->set_tcp_nodelay(true);
  // cpp-httplib closes a kept connection after 5 requests by default: a client pool would then
  // reconnect every fifth call. The keep-alive timeout below still frees idle ones.
  http_->set_keep_alive_max_count(10000);
  http_->set_keep_alive_timeout(std::max<time_t>(1, static_cast<time_t>(options_.keep_alive_timeout_ms / 1000)));
  http_->set_pre_routing_handler([this](const httplib::Request& q, httplib::Response& r) { return PreRouting(q, r); });
  http_->set_error_handler(httplib::Server::HandlerWithResponse(
      [this](const httplib::Request& q, httplib::Response& r) { return OnError(q, r); }));
  http_->set_exception_handler([this](const httplib::Request&, httplib::Response& r, const std::exception_ptr&) {
    SendPolicyError(r, 500, Internal(options_.name + ": unexpected error while answering"));
  });
}

HttpServer::~HttpServer() { Stop(); }

bool HttpServer::tls() const {
  return !options_.security.tls_cert_file.empty() && !options_.security.tls_key_file.empty();
}

std::string HttpServer::url() const {
  const bool v6 = options_.host.find(':') != std::string::npos;
  return fmt::format("{}://{}{}{}:{}", tls() ? "https" : "http", v6 ? "[" : "", options_.host, v6 ? "]" : "", port_);
}

HttpServer& HttpServer::Add(const std::string& method, const std::string& pattern, Handler handler) {
  routes_.push_back(Route{method, pattern});
  // The body is read after pre-routing, so its UTF-8 check runs here, before the handler.
  handler = [this, h = std::move(handler)](const httplib::Request& q, httplib::Response& r) {
    if (!q.body.empty()) {
      if (Status s = CheckJsonUtf8(q.body, "request body"); !s.ok()) return SendPolicyError(r, 400, s);
    }
    h(q, r);
  };
  if (method == "GET") {
    http_->Get(pattern, std::move(handler));
  } else if (method == "POST") {
    http_->Post(pattern, std::move(handler));
  } else if (method == "PUT") {
    http_->Put(pattern, std::move(handler));
  } else if (method == "PATCH") {
    http_->Patch(pattern, std::move(handler));
  } else if (method == "DELETE") {
    http_->Delete(pattern, std::move(handler));
  }
  return *this;
}
HttpServer& HttpServer::Get(const std::string& p, Handler h) { return Add("GET", p, std::move(h)); }
HttpServer& HttpServer::Post(const std::string& p, Handler h) { return Add("POST", p, std::move(h)); }
HttpServer& HttpServer::Put(const std::string& p, Handler h) { return Add("PUT", p, std::move(h)); }
HttpServer& HttpServer::Patch(const std::string& p, Handler h) { return Add("PATCH", p, std::move(h)); }
HttpServer& HttpServer::Delete(const std::string& p, Handler h) { return Add("DELETE", p, std::move(h)); }

HttpServer& HttpServer::set_exception_handler(httplib::Server::ExceptionHandler handler) {
  http_->set_exception_handler(std::move(handler));
  return *this;
}

void HttpServer::SendPolicyError(httplib::Response& res, int http_status, const Status& status) const {
  res.status = http_status;
  res.set_content(
      options_.error_body ? options_.error_body(http_status, status) : DefaultErrorBody(http_status, status),
      "application/json");
}

httplib::Server::HandlerResponse HttpServer::PreRouting(const httplib::Request& req, httplib::Response& res) const {
  using R = httplib::Server::HandlerResponse;
  const std::string& key = options_.security.api_key;
  if (!key.empty() && req.method != "GET" && req.method != "HEAD") {
    const std::string auth = req.get_header_value("Authorization");
    constexpr std::string_view kBearer = "Bearer ";
    const bool ok = auth.size() > kBearer.size() && std::string_view(auth).substr(0, kBearer.size()) == kBearer &&
                    ConstantTimeEquals(std::string_view(auth).substr(kBearer.size()), key);
    if (!ok) {
      res.set_header("WWW-Authenticate", "Bearer");
      res.set_header("Connection", "close");  // the body (if any) was not read
      // The path is not echoed: it may be the very bytes that are not UTF-8.
      SendPolicyError(res, 401,
                      Unauthenticated(fmt::format("{}: {} needs the API key: send 'Authorization: Bearer <key>' with "
                                                  "the key the server was started with (--api-key or {}){}",
                                                  options_.name, req.method, kApiKeyEnv,
                                                  auth.empty() ? "" : "; the key sent is not it")));
      return R::Handled;
    }
  }
  Status s = CheckUtf8(req.path, "path");
  for (auto it = req.params.begin(); s.ok() && it != req.params.end(); ++it) {
    s = CheckUtf8(it->first, "query parameter name");
    if (s.ok()) s = CheckUtf8(it->second, fmt::format("query parameter '{}'", it->first));
  }
  if (!s.ok()) {
    SendPolicyError(res, 400, s);
    return R::Handled;
  }
  return R::Unhandled;
}

httplib::Server::HandlerResponse HttpServer::OnError(const httplib::Request& req, httplib::Response& res) const {
  using R = httplib::Server::HandlerResponse;
  if (res.status != 404 || !res.body.empty()) return R::Unhandled;  // a handler's own answer
  std::string allow;
  for (const Route& r : routes_) {
    if (r.method == req.method || allow.find(r.method) != std::string::npos) continue;
    if (std::regex_match(req.path, std::regex(r.pattern))) allow += (allow.empty() ? "" : ", ") + r.method;
  }
  if (!allow.empty()) {
    res.set_header("Allow", allow);
    SendPolicyError(res, 405,
                    Status(StatusCode::kInvalidArgument,
                           fmt::format("method {} is not allowed here; allowed: {}", req.method, allow)));
    return R::Handled;
  }
  SendPolicyError(res, 404, NotFound(fmt::format("{}: no route for {} {}", options_.name, req.method, req.path)));
  return R::Handled;
}

Status HttpServer::Start() {
  if (thread_.joinable()) return FailedPrecondition(options_.name + ": server already started");
  const ServerSecurity& sec = options_.security;
  RC_RETURN_IF_ERROR(CheckBindSecurity(options_.name, options_.host, sec));
  if (sec.tls_cert_file.empty() != sec.tls_key_file.empty()) {
    return InvalidArgument(fmt::format("{}: TLS needs both --tls-cert and --tls-key (got only {})", options_.name,
                                       sec.tls_cert_file.empty() ? "--tls-key" : "--tls-cert"));
  }
  if (tls()) {
    for (const std::string& f : {sec.tls_cert_file, sec.tls_key_file}) {
      if (!Readable(f)) return InvalidArgument(fmt::format("{}: TLS file '{}' cannot be read", options_.name, f));
    }
    if (!http_->is_valid()) {
      return InvalidArgument(fmt::format("{}: TLS certificate '{}' and key '{}' do not load (PEM? matching pair?)",
                                         options_.name, sec.tls_cert_file, sec.tls_key_file));
    }
  }
  // cpp-httplib listens with its compiled-in backlog (5); the listening socket is taken here and
  // listen() called again with ours (Linux applies a new backlog to a listening socket).
  auto listen_fd = std::make_shared<std::atomic<int>>(-1);
  http_->set_socket_options([listen_fd](socket_t sock) {
    httplib::default_socket_options(sock);
    listen_fd->store(sock);
  });
  if (options_.port == 0) {
    port_ = http_->bind_to_any_port(options_.host);
    if (port_ <= 0) return Unavailable(fmt::format("{}: cannot bind {}:<any port>", options_.name, options_.host));
  } else {
    if (!http_->bind_to_port(options_.host, options_.port)) {
      return Unavailable(fmt::format("{}: cannot bind {}:{} (in use?)", options_.name, options_.host, options_.port));
    }
    port_ = options_.port;
  }
  if (int fd = listen_fd->load(); fd >= 0 && ::listen(fd, std::max(options_.listen_backlog, 1)) != 0) {
    RC_LOG_WARN("{}: could not raise the listen backlog to {}", options_.name, options_.listen_backlog);
  }
  auto ended = std::make_shared<std::atomic<bool>>(false);
  thread_ = std::thread([this, ended] {
    if (!http_->listen_after_bind()) RC_LOG_DEBUG("{}: HTTP server loop ended", options_.name);
    ended->store(true);
  });
  // stop() before the loop runs would be lost, so Start returns only once it runs.
  while (!http_->is_running() && !ended->load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (ended->load()) {
    thread_.join();
    return Unavailable(
        fmt::format("{}: the HTTP server on {}:{} stopped at once", options_.name, options_.host, port_));
  }
  return OkStatus();
}

void HttpServer::Stop() {
  if (!thread_.joinable()) return;
  http_->stop();
  thread_.join();
}

void HttpServer::Wait() {
  if (thread_.joinable()) thread_.join();
}

}  // namespace rc::net
