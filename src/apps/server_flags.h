// The security flags every `... serve` command shares (README "Security"): --api-key-file,
// --api-key, --insecure-no-auth, --tls-cert, --tls-key.
//
// The key's documented ways in are --api-key-file PATH and the ROLLOUTCORE_API_KEY environment
// variable: a command line is readable by every local user (`ps`, /proc/PID/cmdline), so
// --api-key KEY still works but warns.
//
// ResolveServerSecurity runs in the command's callback, before any thread starts: it reads the
// key file (or takes the key from ROLLOUTCORE_API_KEY when no flag gave one) and makes the
// server's key the process's client key too (rc::net::SetDefaultClientConfig), so what the server
// calls (directory, engines) gets it. It refuses (InvalidArgument, naming the path) a key file
// that cannot be read, is not a regular file, is empty, holds more than one line or more than
// 64 KiB, and --api-key together with --api-key-file.
#pragma once

#include <CLI/CLI.hpp>

#include "rolloutcore/base/status.h"
#include "rolloutcore/net/security.h"

namespace rc::apps {

void AddServerSecurityFlags(CLI::App* serve, net::ServerSecurity* security);
[[nodiscard]] Status ResolveServerSecurity(net::ServerSecurity* security);

// The key in `path`: its one line, without the line ending.
Result<std::string> ReadApiKeyFile(const std::string& path);

}  // namespace rc::apps
