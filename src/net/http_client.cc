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

std::unique_ptr<httplib::Client> MakeClient(const std::string& base_url, const ClientConfig& config) {
  auto c = std::make_unique<httplib::Client>(base_url);
  ApplyClientPolicy(*c, config);
  return c;
}

}  // namespace rc::net
