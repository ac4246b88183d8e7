#include "rolloutcore/base/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>
#include <mutex>
#include <string>

namespace rc {

Status SetLogLevel(std::string_view level) {
  auto lvl = spdlog::level::from_str(std::string(level));
  // from_str maps unknown names to "off"; only accept "off" when asked for explicitly.
  if (lvl == spdlog::level::off && level != "off") {
    return InvalidArgument("unknown log level '" + std::string(level) +
                           "' (expected trace|debug|info|warn|error|off)");
  }
  spdlog::set_level(lvl);
  return OkStatus();
}

void InitLoggingFromEnv() {
  static std::once_flag once;
  std::call_once(once, [] {
    auto logger = spdlog::stderr_color_mt("rolloutcore");
    spdlog::set_default_logger(logger);
    spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ %v");
    spdlog::set_level(spdlog::level::warn);
    if (const char* env = std::getenv("ROLLOUTCORE_LOG")) {
      if (!SetLogLevel(env).ok()) spdlog::warn("ignoring ROLLOUTCORE_LOG='{}'", env);
    }
  });
}

}  // namespace rc
