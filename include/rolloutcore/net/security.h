// The security settings of rolloutcore's HTTP servers and clients, without cpp-httplib (so module
// headers can carry them); the policy that applies them is rolloutcore/net/http.h, and the
// operator's view is the "Security" section of README.md / docs/controller.md.
//
// Thread safety: plain values. ClientConfig::Default may be called from any thread;
// SetDefaultClientConfig is meant for start-up, before threads that make requests.
#pragma once

#include <string>

namespace rc::net {

inline constexpr const char* kApiKeyEnv = "ROLLOUTCORE_API_KEY";
inline constexpr const char* kTlsCaFileEnv = "ROLLOUTCORE_TLS_CA_FILE";

// What a server demands of its callers. Set from `--api-key-file` (or ROLLOUTCORE_API_KEY, or
// `--api-key`, which other local users can read in `ps`), `--insecure-no-auth`, `--tls-cert`,
// `--tls-key`.
struct ServerSecurity {
  std::string api_key;            // empty: no authentication (loopback only, unless insecure_no_auth)
  std::string api_key_file;       // --api-key-file: read into api_key by the command (servers ignore it)
  bool insecure_no_auth = false;  // allow a non-loopback bind without a key (warns)
  std::string tls_cert_file;      // PEM; with tls_key_file: HTTPS
  std::string tls_key_file;
};

// What a client sends: the bearer key, and the CA file that verifies https servers.
struct ClientConfig {
  std::string api_key;      // empty: no Authorization header
  std::string tls_ca_file;  // empty: the system's CA store
  // The process default: what SetDefaultClientConfig set, else ROLLOUTCORE_API_KEY and
  // ROLLOUTCORE_TLS_CA_FILE from the environment.
  static ClientConfig Default();
};
void SetDefaultClientConfig(ClientConfig config);

}  // namespace rc::net
