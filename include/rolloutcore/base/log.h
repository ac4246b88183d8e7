// Logging: a thin layer over spdlog so every module logs the same way.
//
// RC_LOG_INFO("installed {} bytes", n) etc. Output goes to stderr; the level comes from
// SetLogLevel or the ROLLOUTCORE_LOG environment variable (trace|debug|info|warn|error|off).
//
// Thread safety: spdlog's multithreaded sink; any thread may log.
#pragma once

#include <spdlog/spdlog.h>

#include <string_view>

#include "rolloutcore/base/status.h"

namespace rc {

// Sets the level by name; InvalidArgument naming the level when unknown.
Status SetLogLevel(std::string_view level);
// Reads ROLLOUTCORE_LOG once; defaults to "warn" so CLI output stays clean.
void InitLoggingFromEnv();

}  // namespace rc

#define RC_LOG_TRACE(...) SPDLOG_TRACE(__VA_ARGS__)
#define RC_LOG_DEBUG(...) ::spdlog::debug(__VA_ARGS__)
#define RC_LOG_INFO(...) ::spdlog::info(__VA_ARGS__)
#define RC_LOG_WARN(...) ::spdlog::warn(__VA_ARGS__)
#define RC_LOG_ERROR(...) ::spdlog::error(__VA_ARGS__)
