// The content digest of a version's weights (docs/refit.md "Content digest": sharding-invariant,
// combined from per-tensor digests) as one value type with one text form. Every place a digest
// crosses a boundary as text (manifests, the directory's stores and HTTP API, vLLM's extension
// replies, the journal's evidence) writes ToHex() and reads FromHex(), so there is one parser and
// one spelling: exactly 16 lowercase hex digits (uppercase digits are read, never written).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "rolloutcore/base/status.h"

namespace rc {

class ContentDigest {
 public:
  constexpr ContentDigest() = default;
  constexpr explicit ContentDigest(uint64_t value) : value_(value) {}

  [[nodiscard]] constexpr uint64_t value() const { return value_; }
  // 16 lowercase hex digits, most significant first.
  [[nodiscard]] std::string ToHex() const;

  // Exactly 16 hex digits; otherwise InvalidArgument "<what>: '<text>' is not 16 hex digits" (the
  // text abbreviated past 64 characters), so the error names the field that carried it.
  [[nodiscard]] static Result<ContentDigest> FromHex(std::string_view text, std::string_view what);
  // The same, returning the number (for the structs that still hold digests as uint64_t).
  [[nodiscard]] static Result<uint64_t> ParseHex(std::string_view text, std::string_view what);

  friend constexpr bool operator==(ContentDigest a, ContentDigest b) = default;

 private:
  uint64_t value_ = 0;
};

// The text form of a digest held as a number: ContentDigest(v).ToHex().
inline std::string DigestHex(uint64_t v) { return ContentDigest(v).ToHex(); }

// The text of an all-zero digest: the default where a record has none.
inline constexpr std::string_view kZeroDigestHex = "0000000000000000";

}  // namespace rc
