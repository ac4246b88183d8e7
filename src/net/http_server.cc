// HttpServer: the shared server policy of rc::net (http.h).
#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <fstream>
#include <mutex>
#include <regex>
#include <type_traits>

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

// ---- One connection ----------------------------------------------------------------------------
//
// cpp-httplib's own connection loop (Server::process_and_close_socket, private but virtual) is
// replaced by ServeConnection below, the same keep-alive loop over our ConnectionStream, so that
// the bytes of each request's header block can be counted before cpp-httplib's parser sees them
// (its 0.11 parser, compiled into Debian's shared library, takes any number of 8 KiB lines), and
// so that a handler can ask whether its client is still there (ClientGone).

// The socket of the connection this worker thread is serving, -1 outside one (ClientGone).
thread_local int t_connection_fd = -1;

int ClampMs(int64_t ms) { return static_cast<int>(std::clamp<int64_t>(ms, 0, INT_MAX)); }

// True when `fd` is ready for `events` (or hung up / failed, which the next call reports) within
// timeout_ms; false on timeout or a poll error.
bool PollFd(int fd, short events, int64_t timeout_ms) {
  pollfd p{fd, events, 0};
  for (;;) {
    const int n = ::poll(&p, 1, ClampMs(timeout_ms));
    if (n >= 0) return n > 0;
    if (errno != EINTR) return false;
  }
}

void SetSocketTimeout(int fd, int option, int64_t ms) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(ms / 1000);
  tv.tv_usec = static_cast<suseconds_t>((ms % 1000) * 1000);
  ::setsockopt(fd, SOL_SOCKET, option, &tv, sizeof(tv));
}

void IpAndPort(int fd, bool peer, std::string& ip, int& port) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  const int rc = peer ? ::getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len)
                      : ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  if (rc != 0) return;
  char host[NI_MAXHOST] = {0};
  char serv[NI_MAXSERV] = {0};
  if (::getnameinfo(reinterpret_cast<sockaddr*>(&addr), len, host, sizeof(host), serv, sizeof(serv),
                    NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return;
  }
  ip = host;
  port = std::atoi(serv);
}

// The stream cpp-httplib reads requests from and writes answers to: a socket, or a TLS session
// over it, behind a read buffer (the parser takes header bytes one at a time). While a request's
// header block is read it hands over at most the block's budget of bytes and lines; past either
// it fails the read (the parser gives up: "header_limit_hit") and swallows the parser's own 400,
// and the connection's loop answers 431 and closes.
class ConnectionStream final : public httplib::Stream {
 public:
  ConnectionStream(int fd, SSL* ssl, int64_t read_timeout_ms, int64_t write_timeout_ms)
      : fd_(fd), ssl_(ssl), read_ms_(read_timeout_ms), write_ms_(write_timeout_ms) {}

  // A new request starts: its request line and headers get max_bytes bytes and, besides the
  // request line, max_headers lines.
  void BeginRequest(size_t max_bytes, int max_headers) {
    in_header_ = true;
    header_left_ = max_bytes;
    lines_left_ = static_cast<int64_t>(std::max(max_headers, 0)) + 1;
    prev_ = prev2_ = 0;
  }
  // Empty, or why the header block was cut off ("64 KiB", "100 lines").
  const std::string& header_limit_hit() const { return limit_hit_; }
  // Bytes received and not yet handed over: the next request is already here.
  bool HasBuffered() const { return pos_ < len_ || (ssl_ != nullptr && SSL_pending(ssl_) > 0); }

  bool is_readable() const override { return HasBuffered() || PollFd(fd_, POLLIN, read_ms_); }
  bool is_writable() const override { return PollFd(fd_, POLLOUT, write_ms_); }

  ssize_t read(char* ptr, size_t size) override {
    if (size == 0) return 0;
    if (!in_header_) {
      if (pos_ < len_ || size < sizeof(buf_)) return ReadBuffered(ptr, size);
      return ReadSome(ptr, size);  // a large body read goes straight to the caller
    }
    if (!limit_hit_.empty()) return -1;
    if (header_left_ == 0) return HitLimit("bytes");
    const ssize_t n = ReadBuffered(ptr, std::min(size, header_left_));
    if (n <= 0) return n;
    for (ssize_t i = 0; i < n; ++i) {
      const char c = ptr[i];
      if (c == '\n') {
        if (prev_ == '\r' && prev2_ == '\n') {
          // "\n\r\n": a line of CRLF alone after a line ends cpp-httplib's header block; what
          // follows is the body (or the next request) and is not counted.
          pos_ -= static_cast<size_t>(n - i - 1);
          header_left_ -= static_cast<size_t>(i + 1);
          in_header_ = false;
          return i + 1;
        }
        if (--lines_left_ < 0) return HitLimit("lines");
      }
      prev2_ = prev_;
      prev_ = c;
    }
    header_left_ -= static_cast<size_t>(n);
    return n;
  }

  ssize_t write(const char* ptr, size_t size) override {
    // cpp-httplib answers a header block it could not read with 400; ours (431) replaces it.
    if (!limit_hit_.empty()) return static_cast<ssize_t>(size);
    return Send(ptr, size);
  }

  // Writes all of `data` (the 431 answer); false when the client is gone or too slow.
  bool SendAll(std::string_view data) {
    while (!data.empty()) {
      const ssize_t n = Send(data.data(), data.size());
      if (n <= 0) return false;
      data.remove_prefix(static_cast<size_t>(n));
    }
    return true;
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override { IpAndPort(fd_, true, ip, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { IpAndPort(fd_, false, ip, port); }
  socket_t socket() const override { return fd_; }

 private:
  ssize_t HitLimit(const char* what) {
    limit_hit_ = what;
    return -1;
  }

  ssize_t ReadBuffered(char* ptr, size_t size) {
    if (pos_ == len_) {
      const ssize_t n = ReadSome(buf_, sizeof(buf_));
      if (n <= 0) return n;
      pos_ = 0;
      len_ = static_cast<size_t>(n);
    }
    const size_t k = std::min(size, len_ - pos_);
    std::memcpy(ptr, buf_ + pos_, k);
    pos_ += k;
    return static_cast<ssize_t>(k);
  }

  // One read from the socket or the TLS session, waiting at most the read timeout for data.
  ssize_t ReadSome(char* ptr, size_t size) {
    if (ssl_ == nullptr) {
      if (!PollFd(fd_, POLLIN, read_ms_)) return -1;
      ssize_t n;
      do {
        n = ::recv(fd_, ptr, size, 0);
      } while (n < 0 && errno == EINTR);
      return n;
    }
    const int want = static_cast<int>(std::min<size_t>(size, INT_MAX));
    for (;;) {
      if (SSL_pending(ssl_) <= 0 && !PollFd(fd_, POLLIN, read_ms_)) return -1;
      ERR_clear_error();  // SSL_get_error reads this thread's error queue
      const int n = SSL_read(ssl_, ptr, want);
      if (n > 0) return n;
      const int err = SSL_get_error(ssl_, n);
      if (err == SSL_ERROR_ZERO_RETURN) return 0;
      if (err != SSL_ERROR_WANT_READ) return -1;  // WANT_READ: a record that carried no data
    }
  }

  ssize_t Send(const char* ptr, size_t size) {
    if (!PollFd(fd_, POLLOUT, write_ms_)) return -1;
    if (ssl_ == nullptr) {
      ssize_t n;
      do {
        n = ::send(fd_, ptr, size, MSG_NOSIGNAL);
      } while (n < 0 && errno == EINTR);
      return n;
    }
    ERR_clear_error();
    const int n = SSL_write(ssl_, ptr, static_cast<int>(std::min<size_t>(size, INT_MAX)));
    return n > 0 ? n : -1;
  }

  const int fd_;
  SSL* const ssl_;
  const int64_t read_ms_;
  const int64_t write_ms_;
  char buf_[4096];
  size_t pos_ = 0;
  size_t len_ = 0;
  bool in_header_ = false;
  size_t header_left_ = 0;
  int64_t lines_left_ = 0;
  char prev_ = 0;
  char prev2_ = 0;
  std::string limit_hit_;
};

// The TLS handshake on an accepted socket, within timeout_ms in all; nullptr when it fails.
SSL* AcceptTls(SSL_CTX* ctx, int fd, int64_t timeout_ms) {
  SSL* ssl = SSL_new(ctx);
  if (ssl == nullptr) return nullptr;
  SSL_set_fd(ssl, fd);  // the socket BIO does not close fd
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  bool ok = false;
  for (;;) {
    ERR_clear_error();
    const int rc = SSL_accept(ssl);
    if (rc == 1) {
      ok = true;
      break;
    }
    const int err = SSL_get_error(ssl, rc);
    const auto events = static_cast<short>(err == SSL_ERROR_WANT_READ    ? POLLIN
                                           : err == SSL_ERROR_WANT_WRITE ? POLLOUT
                                                                         : 0);
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (events == 0 || left <= 0 || !PollFd(fd, events, left)) break;
  }
  ::fcntl(fd, F_SETFL, flags);
  if (!ok) {
    SSL_free(ssl);
    return nullptr;
  }
  SSL_clear_mode(ssl, SSL_MODE_AUTO_RETRY);
  return ssl;
}

// Closes an accepted socket. Bytes the client sent that were never read (a body refused before it
// was read, the rest of a header block over its bound) would make close() send a reset, which may
// reach the client before it read the answer (431, 413, 401) and destroy it; so when such bytes
// are waiting they are read and dropped first, until the client's end of stream or for 1 s at most.
void CloseAfterDraining(int sock) {
  ::shutdown(sock, SHUT_WR);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  int64_t wait_ms = 0;  // nothing waiting now: close at once (an idle client is not waited for)
  char sink[16384];
  while (PollFd(sock, POLLIN, wait_ms)) {
    ssize_t n;
    do {
      n = ::recv(sock, sink, sizeof(sink), 0);
    } while (n < 0 && errno == EINTR);
    if (n <= 0) break;
    wait_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (wait_ms <= 0) break;
  }
  ::shutdown(sock, SHUT_RDWR);
  ::close(sock);
}

// What the connection loop enforces besides cpp-httplib's own settings.
struct ConnectionPolicy {
  size_t max_header_bytes = 0;
  int max_header_count = 0;
  std::function<std::string(const std::string& why)> header_too_large_body;  // the 431 body
};

// httplib::Server or httplib::SSLServer with ServeConnection as its connection loop.
template <typename Base>
class PolicedServer final : public Base {
 public:
  template <typename... Args>
  explicit PolicedServer(ConnectionPolicy policy, Args&&... args)
      : Base(std::forward<Args>(args)...), policy_(std::move(policy)) {}

 private:
  static constexpr bool kTls = std::is_base_of_v<httplib::SSLServer, Base>;

  bool process_and_close_socket(socket_t sock) override {
    const int64_t read_ms = this->read_timeout_sec_ * 1000 + this->read_timeout_usec_ / 1000;
    const int64_t write_ms = this->write_timeout_sec_ * 1000 + this->write_timeout_usec_ / 1000;
    // A blocking call that waits inside OpenSSL (the rest of a TLS record) is bounded too.
    SetSocketTimeout(sock, SO_RCVTIMEO, read_ms);
    SetSocketTimeout(sock, SO_SNDTIMEO, write_ms);
    SSL* ssl = nullptr;
    bool ret = false;
    if constexpr (kTls) ssl = AcceptTls(this->ssl_context(), sock, read_ms);
    if (!kTls || ssl != nullptr) {
      ret = ServeConnection(sock, ssl, read_ms, write_ms);
      if (ssl != nullptr) {
        if (ret) SSL_shutdown(ssl);  // a close_notify only when the session ended well
        SSL_free(ssl);
      }
    }
    CloseAfterDraining(sock);
    return ret;
  }

  // cpp-httplib's keep-alive loop (process_server_socket_core in 0.11), over ConnectionStream.
  bool ServeConnection(int sock, SSL* ssl, int64_t read_ms, int64_t write_ms) {
    ConnectionStream strm(sock, ssl, read_ms, write_ms);
    struct Current {
      explicit Current(int fd) { t_connection_fd = fd; }
      ~Current() { t_connection_fd = -1; }
    } current(sock);
    std::function<void(httplib::Request&)> setup;
    if (ssl != nullptr) setup = [ssl](httplib::Request& req) { req.ssl = ssl; };
    bool ret = false;
    for (size_t left = this->keep_alive_max_count_; left > 0 && NextRequestArrives(strm, sock); --left) {
      bool connection_closed = false;
      strm.BeginRequest(policy_.max_header_bytes, policy_.max_header_count);
      ret = this->process_request(strm, left == 1, connection_closed, setup);
      if (!strm.header_limit_hit().empty()) {
        const std::string body = policy_.header_too_large_body(strm.header_limit_hit());
        strm.SendAll(
            fmt::format("HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Type: application/json\r\n"
                        "Content-Length: {}\r\nConnection: close\r\n\r\n{}",
                        body.size(), body));
        return false;
      }
      if (!ret || connection_closed) break;
    }
    return ret;
  }

  // Waits (up to the keep-alive timeout) for the first byte of the next request; false when the
  // connection stays idle that long or the server stops (checked every 100 ms, so a stopping
  // server is not held by its idle connections).
  bool NextRequestArrives(const ConnectionStream& strm, int sock) {
    if (strm.HasBuffered()) return this->svr_sock_ != INVALID_SOCKET;
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::seconds(std::max<time_t>(this->keep_alive_timeout_sec_, 0));
    while (this->svr_sock_ != INVALID_SOCKET) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
      if (PollFd(sock, POLLIN, std::clamp<int64_t>(left, 0, 100))) return true;
      if (left <= 100) return false;
    }
    return false;
  }

  const ConnectionPolicy policy_;
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
  if (IsLoopbackHost(host)) return OkStatus();
  {
    // A host that names no address would fail at bind anyway: say so first (not "without an API key").
    addrinfo hints{};
    hints.ai_flags = AI_PASSIVE;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    const std::string h(host);
    const int rc = ::getaddrinfo(h.c_str(), nullptr, &hints, &found);
    if (found != nullptr) ::freeaddrinfo(found);
    if (rc != 0) {
      return InvalidArgument(fmt::format("{}: --host '{}' is not an address to serve on ({})", name, host,
                                         ::gai_strerror(rc)));
    }
  }
  if (!sec.api_key.empty()) return OkStatus();
  if (!sec.insecure_no_auth) {
    return FailedPrecondition(
        fmt::format("{}: refusing to serve on {} (not loopback) without an API key: set --api-key-file or {}, or pass "
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
  ConnectionPolicy policy;
  policy.max_header_bytes = options_.max_header_bytes;
  policy.max_header_count = options_.max_header_count;
  policy.header_too_large_body = [this](const std::string& why) {
    const Status s = InvalidArgument(
        fmt::format("{}: request line and headers over the limit of {} bytes and {} header lines (the {} limit "
                    "was reached); refused without reading further",
                    options_.name, options_.max_header_bytes, options_.max_header_count, why));
    return options_.error_body ? options_.error_body(431, s) : DefaultErrorBody(431, s);
  };
  if (!sec.tls_cert_file.empty() && !sec.tls_key_file.empty()) {
    http_ = std::make_unique<PolicedServer<httplib::SSLServer>>(std::move(policy), sec.tls_cert_file.c_str(),
                                                                sec.tls_key_file.c_str());
  } else {
    http_ = std::make_unique<PolicedServer<httplib::Server>>(std::move(policy));
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
    // A chunked body has no Content-Length for PreRouting to refuse; its size is known only now.
    if (q.body.size() > options_.max_json_body_bytes) return SendBodyTooLarge(r, q.body.size());
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

void HttpServer::SendBodyTooLarge(httplib::Response& res, uint64_t bytes) const {
  SendPolicyError(res, 413,
                  InvalidArgument(fmt::format("{}: request body of {} bytes is over the limit of {} bytes (a JSON "
                                              "body is parsed into a tree several times its size)",
                                              options_.name, bytes, options_.max_json_body_bytes)));
}

httplib::Server::HandlerResponse HttpServer::PreRouting(const httplib::Request& req, httplib::Response& res) const {
  using R = httplib::Server::HandlerResponse;
  // The body has not been read yet: what it announces is refused here, unread (so the connection
  // is closed: its unread bytes cannot be taken for the next request).
  const std::string length_text = req.get_header_value("Content-Length");
  const uint64_t length = length_text.empty() ? 0 : std::strtoull(length_text.c_str(), nullptr, 10);
  if ((req.method == "GET" || req.method == "HEAD") && (length > 0 || req.has_header("Transfer-Encoding"))) {
    res.set_header("Connection", "close");
    SendPolicyError(
        res, 413,
        InvalidArgument(fmt::format("{}: a {} request carries no body here (it announced {})", options_.name,
                                    req.method, length > 0 ? fmt::format("{} bytes", length) : "a chunked body")));
    return R::Handled;
  }
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
                      Unauthenticated(fmt::format(
                          "{}: {} needs the API key: send 'Authorization: Bearer <key>' with "
                          "the key the server was started with (--api-key-file, {} or --api-key){}",
                          options_.name, req.method, kApiKeyEnv, auth.empty() ? "" : "; the key sent is not it")));
      return R::Handled;
    }
  }
  if (length > options_.max_json_body_bytes) {
    res.set_header("Connection", "close");
    SendBodyTooLarge(res, length);
    return R::Handled;
  }
  // Every body here is JSON. `curl -d` labels it application/x-www-form-urlencoded, which
  // cpp-httplib would parse into query parameters, and refuse over 8 KiB with an empty 413, before
  // any handler runs: the label is set to what the body is. (The request object is not const;
  // only the hook's view of it is, and the body is read after this hook.)
  if (req.get_header_value("Content-Type").rfind("application/x-www-form-urlencoded", 0) == 0) {
    auto& headers = const_cast<httplib::Request&>(req).headers;
    headers.erase("Content-Type");
    headers.emplace("Content-Type", "application/json");
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
  stopping_.store(false);
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
  // Not cpp-httplib's default options: they set SO_REUSEPORT as well, with which a second server
  // of the same user binds a port that is in use, and the kernel splits the connections between
  // the two. SO_REUSEADDR alone still rebinds a port whose old connections are in TIME_WAIT.
  http_->set_socket_options([listen_fd](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
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

HttpServer::LongPollSlot::~LongPollSlot() {
  if (count_ != nullptr) count_->fetch_sub(1);
}

int HttpServer::max_long_polls() const {
  return options_.max_long_polls > 0 ? options_.max_long_polls : std::max(1, options_.max_threads / 4);
}

HttpServer::LongPollSlot HttpServer::TryLongPoll() {
  const int max = max_long_polls();
  int n = long_polls_.load();
  while (n < max) {
    if (long_polls_.compare_exchange_weak(n, n + 1)) return LongPollSlot(&long_polls_);
  }
  return LongPollSlot();
}

bool HttpServer::ClientGone() {
  const int fd = t_connection_fd;
  if (fd < 0) return false;
  // Readable data alone (a pipelined request, a TLS record) is not a departure; the peer's FIN
  // (POLLRDHUP) or a reset (POLLERR / POLLHUP) is.
  pollfd p{fd, POLLRDHUP, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

void HttpServer::Stop() {
  stopping_.store(true);
  if (!thread_.joinable()) return;
  http_->stop();
  thread_.join();
}

void HttpServer::Wait() {
  if (thread_.joinable()) thread_.join();
}

}  // namespace rc::net
