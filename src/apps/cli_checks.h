// CLI11 checks the commands share. CLI::Range and CLI::NonNegativeNumber let NaN through (every
// comparison with NaN is false), and a NaN or infinite rate, fraction, tolerance or timeout would
// then flow into the run as a silent default, an undefined cast or a meaningless figure: these
// refuse it, naming the value.
#pragma once

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <string>

#include "rolloutcore/net/http.h"

namespace rc::apps {

// A finite number in [lo, hi]; the bounds are printed in --help ("FLOAT in [lo, hi]").
inline CLI::Validator FiniteNumber(double lo = std::numeric_limits<double>::lowest(),
                                   double hi = std::numeric_limits<double>::max()) {
  const bool bounded = lo != std::numeric_limits<double>::lowest() || hi != std::numeric_limits<double>::max();
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(text, v)) return fmt::format("Value {} is not a number", text);
        if (!std::isfinite(v)) return fmt::format("Value {} is not a finite number", text);
        if (v < lo || v > hi) return fmt::format("Value {} is not in [{}, {}]", text, lo, hi);
        return "";
      },
      bounded ? fmt::format("FLOAT in [{}, {}]", lo, hi) : std::string("FLOAT (finite)"));
}

// An unsigned integer option: CLI11 reads "-1" into a uint64_t as 2^64 - 1 without a word.
inline CLI::Validator Unsigned() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos) {
          return fmt::format("Value {} is not a non-negative integer", text);
        }
        return "";
      },
      "UINT");
}

// A base URL of an HTTP service: http://HOST[:PORT] or https://... (a URL without a scheme would be
// taken as a host name and fail only at the first call, as a connection error).
inline CLI::Validator HttpUrl() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        if (net::IsHttpUrl(text)) return "";
        return fmt::format("'{}' is not the base URL of a service: http:// or https://, a host and port, no path "
                           "(e.g. http://127.0.0.1:7470)",
                           text);
      },
      "URL");
}

}  // namespace rc::apps
