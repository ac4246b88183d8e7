#include "apps/server_flags.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "rolloutcore/base/log.h"

namespace rc::apps {

namespace {

constexpr size_t kMaxKeyFileBytes = size_t{64} << 10;

}  // namespace

void AddServerSecurityFlags(CLI::App* serve, net::ServerSecurity* s) {
  serve->add_option("--api-key-file", s->api_key_file,
                    std::string("File holding the bearer key every mutating request (POST/DELETE) must carry (one "
                                "line; the line ending is dropped); GETs stay open. Or set $") +
                        net::kApiKeyEnv);
  serve->add_option("--api-key", s->api_key,
                    std::string("The bearer key itself. Visible to every local user in ps and /proc: prefer "
                                "--api-key-file or $") +
                        net::kApiKeyEnv);
  serve->add_flag("--insecure-no-auth", s->insecure_no_auth,
                  "Allow serving on a non-loopback address without an API key (warns; never in production)");
  serve->add_option("--tls-cert", s->tls_cert_file, "PEM certificate: serve HTTPS (with --tls-key)")
      ->check(CLI::ExistingFile);
  serve->add_option("--tls-key", s->tls_key_file, "PEM private key of --tls-cert")->check(CLI::ExistingFile);
}

Result<std::string> ReadApiKeyFile(const std::string& path) {
  // A FIFO or a device could block the read forever or never end: regular files only.
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (ec || st.type() == std::filesystem::file_type::not_found) {
    return InvalidArgument(
        fmt::format("--api-key-file '{}': cannot read it: {}", path, ec ? ec.message() : std::string("no such file")));
  }
  if (st.type() != std::filesystem::file_type::regular) {
    return InvalidArgument(fmt::format("--api-key-file '{}': not a regular file", path));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return InvalidArgument(fmt::format("--api-key-file '{}': cannot read it: {}", path, std::strerror(errno)));
  std::string key;
  key.resize(kMaxKeyFileBytes + 1);
  in.read(key.data(), static_cast<std::streamsize>(key.size()));
  if (in.bad()) return InvalidArgument(fmt::format("--api-key-file '{}': cannot read it", path));
  key.resize(static_cast<size_t>(in.gcount()));
  if (key.size() > kMaxKeyFileBytes) {
    return InvalidArgument(
        fmt::format("--api-key-file '{}': over {} bytes; it should hold one key", path, kMaxKeyFileBytes));
  }
  // `echo KEY > file` writes one line ending; that is not part of the key.
  if (!key.empty() && key.back() == '\n') key.pop_back();
  if (!key.empty() && key.back() == '\r') key.pop_back();
  if (key.empty()) return InvalidArgument(fmt::format("--api-key-file '{}': the file is empty", path));
  // A key with a line break would split the Authorization header: refused, not sent.
  if (key.find_first_of("\r\n") != std::string::npos) {
    return InvalidArgument(fmt::format("--api-key-file '{}': holds more than one line; it should hold one key", path));
  }
  return key;
}

Status ResolveServerSecurity(net::ServerSecurity* s) {
  if (!s->api_key_file.empty()) {
    if (!s->api_key.empty()) {
      return InvalidArgument(
          fmt::format("--api-key and --api-key-file '{}' are both given; give the key one way (--api-key-file "
                      "keeps it out of ps)",
                      s->api_key_file));
    }
    RC_ASSIGN_OR_RETURN(s->api_key, ReadApiKeyFile(s->api_key_file));
  } else if (!s->api_key.empty()) {
    RC_LOG_WARN(
        "--api-key puts the key on the command line, where every local user can read it (ps, /proc/PID/cmdline); "
        "use --api-key-file PATH or ${} instead",
        net::kApiKeyEnv);
  } else if (const char* env = std::getenv(net::kApiKeyEnv)) {
    s->api_key = env;
  }
  net::ClientConfig c = net::ClientConfig::Default();
  if (!s->api_key.empty()) c.api_key = s->api_key;
  net::SetDefaultClientConfig(c);
  return OkStatus();
}

}  // namespace rc::apps
