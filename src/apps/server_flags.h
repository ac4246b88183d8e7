// The security flags every `... serve` command shares (README "Security"): --api-key,
// --insecure-no-auth, --tls-cert, --tls-key.
//
// ResolveServerSecurity runs in the command's callback, before any thread starts: a key not given
// by flag comes from ROLLOUTCORE_API_KEY, and the server's key becomes the process's client key
// too (rc::net::SetDefaultClientConfig), so what the server calls (directory, engines) gets it.
#pragma once

#include <CLI/CLI.hpp>

#include "rolloutcore/net/security.h"

namespace rc::apps {

void AddServerSecurityFlags(CLI::App* serve, net::ServerSecurity* security);
void ResolveServerSecurity(net::ServerSecurity* security);

}  // namespace rc::apps
