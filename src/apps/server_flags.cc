#include "apps/server_flags.h"

#include <cstdlib>

namespace rc::apps {

void AddServerSecurityFlags(CLI::App* serve, net::ServerSecurity* s) {
  serve->add_option("--api-key", s->api_key,
                    std::string("Bearer key every mutating request (POST/DELETE) must carry; GETs stay open. "
                                "Default: $") +
                        net::kApiKeyEnv);
  serve->add_flag("--insecure-no-auth", s->insecure_no_auth,
                  "Allow serving on a non-loopback address without an API key (warns; never in production)");
  serve->add_option("--tls-cert", s->tls_cert_file, "PEM certificate: serve HTTPS (with --tls-key)")
      ->check(CLI::ExistingFile);
  serve->add_option("--tls-key", s->tls_key_file, "PEM private key of --tls-cert")->check(CLI::ExistingFile);
}

void ResolveServerSecurity(net::ServerSecurity* s) {
  if (s->api_key.empty()) {
    if (const char* env = std::getenv(net::kApiKeyEnv)) s->api_key = env;
  }
  net::ClientConfig c = net::ClientConfig::Default();
  if (!s->api_key.empty()) c.api_key = s->api_key;
  net::SetDefaultClientConfig(c);
}

}  // namespace rc::apps
