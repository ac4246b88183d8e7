// Encoding: hex and base64 text forms of bytes and 64-bit values, the one place rolloutcore
// writes and reads them (transport descriptors, digests, journal chains, etcd keys).
//
// Hex is lowercase on output and accepts either case on input. Base64 is RFC 4648 with padding
// on output; decoding also accepts the URL-safe alphabet ('-', '_') and stops at the first '='.
//
// Thread safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "rolloutcore/base/status.h"

namespace rc {

// Two lowercase hex digits per byte.
std::string HexEncode(const void* data, size_t n);
inline std::string HexEncode(std::string_view bytes) { return HexEncode(bytes.data(), bytes.size()); }
// The bytes of an even-length hex string; InvalidArgument names the first bad digit and its offset.
[[nodiscard]] Result<std::string> HexDecode(std::string_view hex);
// Decodes exactly 2*n hex digits into out[0..n); false (out partly written) otherwise.
[[nodiscard]] bool HexDecodeInto(std::string_view hex, void* out, size_t n);

// 16 lowercase hex digits, most significant first (also declared in hash.h, its first home).
std::string Hex64(uint64_t v);
// The value of exactly 16 hex digits; InvalidArgument otherwise.
[[nodiscard]] Result<uint64_t> ParseHex64(std::string_view hex);

std::string Base64Encode(std::string_view bytes);
// InvalidArgument names the first character outside the alphabet and its offset.
[[nodiscard]] Result<std::string> Base64Decode(std::string_view text);

}  // namespace rc
