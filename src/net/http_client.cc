// Client policy of rc::net (http.h): the bearer key and TLS verification.
#include <cstdlib>
#include <mutex>

#include "rolloutcore/base/mutex.h"
#include "rolloutcore/net/http.h"

namespace rc::net {
namespace {

rc::Mutex g_mu;
std::optional<ClientConfig> g_config GUARDED_BY(g_mu);  // guarded by g_mu

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string() : std::string(v);
}

}  // namespace

ClientConfig ClientConfig::Default() {
  {
    rc::MutexLock lock(g_mu);
    if (g_config) return *g_config;
  }
  ClientConfig c;
  c.api_key = Env(kApiKeyEnv);
  c.tls_ca_file = Env(kTlsCaFileEnv);
  return c;
}

void SetDefaultClientConfig(ClientConfig config) {
  rc::MutexLock lock(g_mu);
  g_config = std::move(config);
}

void ApplyClientPolicy(httplib::Client& client, const ClientConfig& config) {
  if (!config.api_key.empty()) client.set_bearer_token_auth(config.api_key);
  client.enable_server_certificate_verification(true);
  if (!config.tls_ca_file.empty()) client.set_ca_cert_path(config.tls_ca_file);
}

std::string TrimBaseUrl(std::string_view base_url) {
  while (base_url.size() > 1 && base_url.back() == '/') base_url.remove_suffix(1);
  return std::string(base_url);
}

std::unique_ptr<httplib::Client> MakeClient(const std::string& base_url, const ClientConfig& config) {
  auto c = std::make_unique<httplib::Client>(TrimBaseUrl(base_url));
  ApplyClientPolicy(*c, config);
  return c;
}

void SetClientTimeouts(httplib::Client& client, int64_t connect_ms, int64_t read_write_ms) {
  auto sec = [](int64_t ms) { return static_cast<time_t>(ms / 1000); };
  auto usec = [](int64_t ms) { return static_cast<time_t>((ms % 1000) * 1000); };
  client.set_connection_timeout(sec(connect_ms), usec(connect_ms));
  client.set_read_timeout(sec(read_write_ms), usec(read_write_ms));
  client.set_write_timeout(sec(read_write_ms), usec(read_write_ms));
}

namespace {
// cpp-httplib's Client throws for a scheme it does not speak ("ftp://...").
bool IsValidUrl(const std::string& url) {
  try {
    return httplib::Client(TrimBaseUrl(url)).is_valid();
  } catch (const std::exception&) {
    return false;
  }
}
}  // namespace

ClientPool::ClientPool(std::string base_url, ClientConfig config, int64_t max_idle_ms, size_t max_idle)
    : base_url_(std::move(base_url)),
      config_(std::move(config)),
      max_idle_ms_(max_idle_ms),
      max_idle_(max_idle),
      valid_(IsValidUrl(base_url_)) {}

ClientPool::~ClientPool() = default;

int64_t ClientPool::clients_made() const {
  rc::MutexLock lock(mu_);
  return made_;
}

int64_t ClientPool::reused() const {
  rc::MutexLock lock(mu_);
  return reused_;
}

std::unique_ptr<httplib::Client> ClientPool::Take(bool* reused) {
  {
    rc::MutexLock lock(mu_);
    const auto now = std::chrono::steady_clock::now();
    while (!idle_.empty()) {
      Idle last = std::move(idle_.back());
      idle_.pop_back();
      if (now - last.since <= std::chrono::milliseconds(max_idle_ms_)) {
        ++reused_;
        *reused = true;
        return std::move(last.client);
      }
      // Idle too long: the server may be closing it; dropping it closes the socket.
    }
    ++made_;
  }
  *reused = false;
  auto c = MakeClient(base_url_, config_);
  c->set_keep_alive(true);
  // A kept connection carries request after request: without TCP_NODELAY a request or answer
  // written in two pieces waits for the peer's delayed ACK (40 ms) behind Nagle's algorithm.
  c->set_tcp_nodelay(true);
  return c;
}

void ClientPool::GiveBack(std::unique_ptr<httplib::Client> c) {
  rc::MutexLock lock(mu_);
  if (idle_.size() < max_idle_) idle_.push_back(Idle{std::move(c), std::chrono::steady_clock::now()});
}

httplib::Result ClientPool::Request(const std::string& method, const std::string& path, const std::string& body,
                                    const std::string& content_type,
                                    const std::function<void(httplib::Client&)>& prepare) {
  if (!valid_) return httplib::Result(nullptr, httplib::Error::Connection);
  const bool idempotent = method == "GET" || method == "DELETE" || method == "HEAD";
  for (int attempt = 0;; ++attempt) {
    bool reused = false;
    std::unique_ptr<httplib::Client> c = Take(&reused);
    if (prepare) prepare(*c);
    httplib::Result r = method == "GET"      ? c->Get(path)
                        : method == "HEAD"   ? c->Head(path)
                        : method == "DELETE" ? c->Delete(path)
                        : method == "PUT"    ? c->Put(path, body, content_type)
                                             : c->Post(path, body, content_type);
    if (r) {
      // Kept only after an answer that leaves the connection open: a server may close it after an
      // error (uvicorn closes the transport when the app raised after its 500 went out, as vLLM's
      // collective_rpc does), and a request written into a closing socket fails unanswered.
      if (r->status < 500 && r->get_header_value("Connection") != "close") GiveBack(std::move(c));
      return r;
    }
    // A kept connection the server closed meanwhile: once more on a new one, when sending again
    // cannot run the request twice.
    const bool unsent = r.error() == httplib::Error::Write || r.error() == httplib::Error::Connection;
    if (attempt > 0 || !reused || !(idempotent || unsent)) return r;
  }
}

bool IsHttpUrl(std::string_view url) {
  for (const std::string_view scheme : {std::string_view("http://"), std::string_view("https://")}) {
    if (url.size() > scheme.size() && url.substr(0, scheme.size()) == scheme) {
      // A base URL: a host (and port), no path beyond trailing slashes (requests add their own).
      const std::string_view rest = url.substr(scheme.size());
      const size_t slash = rest.find('/');
      if (slash == 0) return false;
      if (slash != std::string_view::npos && rest.find_first_not_of('/', slash) != std::string_view::npos) return false;
      // host[:port] or [v6][:port]; a port is 1 to 65535.
      std::string_view authority = rest.substr(0, slash);
      if (authority.find_first_of(" \t\r\n?#@") != std::string_view::npos) return false;
      size_t colon = std::string_view::npos;
      if (authority.front() == '[') {
        const size_t close = authority.find(']');
        if (close == std::string_view::npos || close == 1) return false;
        if (close + 1 < authority.size()) {
          if (authority[close + 1] != ':') return false;
          colon = close + 1;
        }
      } else {
        colon = authority.rfind(':');
        if (colon == 0) return false;
      }
      if (colon == std::string_view::npos) return true;
      const std::string_view port = authority.substr(colon + 1);
      if (port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string_view::npos) {
        return false;
      }
      const int n = std::stoi(std::string(port));
      return n >= 1 && n <= 65535;
    }
  }
  return false;
}

}  // namespace rc::net
