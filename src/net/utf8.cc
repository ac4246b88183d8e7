// UTF-8 validation of what enters a server, and a JSON dump that cannot throw (rc::net, http.h).
#include <fmt/format.h>

#include <vector>

#include "rolloutcore/net/http.h"

namespace rc::net {

std::optional<size_t> FirstInvalidUtf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;  // no overlongs
      if (c == 0xED) hi = 0x9F;  // no surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;  // no overlongs
      if (c == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
    } else {
      return i;
    }
    if (i + len > n) return i;
    if (p[i + 1] < lo || p[i + 1] > hi) return i;
    for (size_t k = 2; k < len; ++k) {
      if (p[i + k] < 0x80 || p[i + k] > 0xBF) return i;
    }
    i += len;
  }
  return std::nullopt;
}

namespace {

std::string Describe(std::string_view s, size_t offset) {
  return fmt::format("invalid UTF-8 (byte 0x{:02x} at offset {})", static_cast<unsigned char>(s[offset]), offset);
}

// One open container while scanning JSON text.
struct Frame {
  bool object = false;
  bool want_key = false;  // object: the next string is a key
  std::string key;        // object: the current member's key
  size_t index = 0;       // array: the current element
};

std::string PathOf(const std::vector<Frame>& stack) {
  std::string out;
  for (const Frame& f : stack) {
    if (f.object) {
      if (f.want_key) break;  // between members: the path ends at the object itself
      if (!out.empty()) out += '.';
      out += f.key;
    } else {
      out += fmt::format("[{}]", f.index);
    }
  }
  return out;
}

}  // namespace

Status CheckUtf8(std::string_view s, std::string_view what) {
  auto bad = FirstInvalidUtf8(s);
  if (!bad) return OkStatus();
  return InvalidArgument(fmt::format("{}: {}", what, Describe(s, *bad)));
}

Status CheckJsonUtf8(std::string_view text, std::string_view what) {
  auto bad = FirstInvalidUtf8(text);
  if (!bad) return OkStatus();
  // Walk the JSON text up to the bad byte, tracking the key path. The text before it is valid
  // UTF-8 but need not be valid JSON; the walk only has to be right for JSON.
  std::vector<Frame> stack;
  bool in_key = false;
  size_t i = 0;
  while (i < *bad) {
    const char c = text[i];
    if (c == '{' || c == '[') {
      Frame f;
      f.object = c == '{';
      f.want_key = f.object;
      stack.push_back(f);
      ++i;
    } else if (c == '}' || c == ']') {
      if (!stack.empty()) stack.pop_back();
      ++i;
    } else if (c == ',') {
      if (!stack.empty()) {
        if (stack.back().object) {
          stack.back().want_key = true;
        } else {
          ++stack.back().index;
        }
      }
      ++i;
    } else if (c == ':') {
      if (!stack.empty() && stack.back().object) stack.back().want_key = false;
      ++i;
    } else if (c == '"') {
      size_t j = i + 1;
      while (j < text.size() && text[j] != '"') j += text[j] == '\\' ? 2 : 1;
      const bool is_key = !stack.empty() && stack.back().object && stack.back().want_key;
      if (j >= *bad) {  // the bad byte is inside this string
        in_key = is_key;
        break;
      }
      if (is_key) stack.back().key = std::string(text.substr(i + 1, j - i - 1));
      i = j + 1;
    } else {
      ++i;
    }
  }
  std::string path = PathOf(stack);
  if (in_key) path += path.empty() ? "an object key" : " (an object key)";
  if (path.empty()) return InvalidArgument(fmt::format("{}: {}", what, Describe(text, *bad)));
  return InvalidArgument(fmt::format("{}: {}: {}", what, path, Describe(text, *bad)));
}

std::string DumpJson(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

}  // namespace rc::net
