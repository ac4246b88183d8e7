#include "rolloutcore/base/content_digest.h"

#include <fmt/format.h>

#include "rolloutcore/base/encoding.h"

namespace rc {

std::string ContentDigest::ToHex() const { return Hex64(value_); }

Result<uint64_t> ContentDigest::ParseHex(std::string_view text, std::string_view what) {
  auto v = ParseHex64(text);
  if (!v.ok()) {
    const std::string_view shown = text.substr(0, 64);
    return InvalidArgument(fmt::format("{}: '{}{}' is not 16 hex digits", what, shown, text.size() > 64 ? "..." : ""));
  }
  return *v;
}

Result<ContentDigest> ContentDigest::FromHex(std::string_view text, std::string_view what) {
  RC_ASSIGN_OR_RETURN(uint64_t v, ParseHex(text, what));
  return ContentDigest(v);
}

}  // namespace rc
