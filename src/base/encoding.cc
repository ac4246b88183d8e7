#include "rolloutcore/base/encoding.h"

#include <fmt/format.h>

namespace rc {
namespace {

constexpr char kHexDigits[] = "0123456789abcdef";
constexpr char kB64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

int B64Value(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+' || c == '-') return 62;
  if (c == '/' || c == '_') return 63;
  return -1;
}

// Offset of the first character of `hex` that is not a hex digit, or npos.
size_t FirstNonHex(std::string_view hex) {
  for (size_t i = 0; i < hex.size(); ++i) {
    if (HexValue(hex[i]) < 0) return i;
  }
  return std::string_view::npos;
}

}  // namespace

std::string HexEncode(const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::string out;
  out.reserve(n * 2);
  for (size_t i = 0; i < n; ++i) {
    out.push_back(kHexDigits[p[i] >> 4]);
    out.push_back(kHexDigits[p[i] & 15]);
  }
  return out;
}

bool HexDecodeInto(std::string_view hex, void* out, size_t n) {
  if (hex.size() != 2 * n) return false;
  auto* p = static_cast<unsigned char*>(out);
  for (size_t i = 0; i < n; ++i) {
    const int hi = HexValue(hex[2 * i]);
    const int lo = HexValue(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    p[i] = static_cast<unsigned char>(hi * 16 + lo);
  }
  return true;
}

Result<std::string> HexDecode(std::string_view hex) {
  if (const size_t bad = FirstNonHex(hex); bad != std::string_view::npos) {
    return InvalidArgument(fmt::format("hex: character 0x{:02x} at offset {} is not a hex digit",
                                       static_cast<unsigned char>(hex[bad]), bad));
  }
  if (hex.size() % 2 != 0) return InvalidArgument(fmt::format("hex: odd length {}", hex.size()));
  std::string out(hex.size() / 2, '\0');
  if (!HexDecodeInto(hex, out.data(), out.size())) return Internal("hex: decode failed after validation");
  return out;
}

std::string Hex64(uint64_t v) {
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4) out[static_cast<size_t>(i)] = kHexDigits[v & 15];
  return out;
}

Result<uint64_t> ParseHex64(std::string_view hex) {
  if (hex.size() != 16 || FirstNonHex(hex) != std::string_view::npos) {
    return InvalidArgument(fmt::format("'{}' is not 16 hex digits", hex));
  }
  uint64_t v = 0;
  for (char c : hex) v = (v << 4) | static_cast<uint64_t>(HexValue(c));
  return v;
}

std::string Base64Encode(std::string_view in) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  auto byte = [&](size_t i) { return i < in.size() ? uint32_t{static_cast<uint8_t>(in[i])} : 0u; };
  for (size_t i = 0; i < in.size(); i += 3) {
    const uint32_t v = (byte(i) << 16) | (byte(i + 1) << 8) | byte(i + 2);
    const size_t left = in.size() - i;  // 1, 2 or 3+ bytes of input in this group
    out += kB64[(v >> 18) & 63];
    out += kB64[(v >> 12) & 63];
    out += left > 1 ? kB64[(v >> 6) & 63] : '=';
    out += left > 2 ? kB64[v & 63] : '=';
  }
  return out;
}

Result<std::string> Base64Decode(std::string_view in) {
  std::string out;
  out.reserve(in.size() / 4 * 3);
  uint32_t acc = 0;
  int bits = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    const char c = in[i];
    if (c == '=') break;
    const int v = B64Value(c);
    if (v < 0) {
      return InvalidArgument(fmt::format("base64: invalid character 0x{:02x} at offset {}",
                                         static_cast<unsigned char>(c), i));
    }
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xFF);
    }
  }
  return out;
}

}  // namespace rc
