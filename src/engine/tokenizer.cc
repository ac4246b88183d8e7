#include <algorithm>
#include "rolloutcore/engine/tokenizer.h"

#include <cstdio>

namespace rc::engine {

Result<std::vector<int32_t>> ByteTokenizer::Encode(std::string_view text, std::string_view field) const {
  if (vocab_size_ < 256) {
    return InvalidArgument(std::string(field) + ": text prompts need a vocabulary of at least 256 tokens (byte-level "
                           "fallback tokenizer); send token ids instead");
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size());
  for (unsigned char c : text) ids.push_back(c);
  return ids;
}

std::string ByteTokenizer::Decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) {
    if (id >= 0 && id < 256) {
      out.push_back(static_cast<char>(id));
    } else {
      out += "<|" + std::to_string(id) + "|>";
    }
  }
  return out;
}

std::string ByteTokenizer::TokenString(int32_t id) const {
  if (id >= 0 && id < 128) return std::string(1, static_cast<char>(id));
  if (id >= 128 && id < 256) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "<0x%02X>", id);
    return buf;
  }
  return "<|" + std::to_string(id) + "|>";
}

namespace {

// The UTF-8 sequence at bytes[i]: its length when valid (1 for ASCII), else 0 with *bad_at the
// offset of the first byte that breaks it (i for a byte that cannot start a character) or
// bytes.size() when it is cut short by the end.
size_t Utf8At(std::string_view bytes, size_t i, size_t* bad_at) {
  const auto c = static_cast<unsigned char>(bytes[i]);
  if (c < 0x80) return 1;
  size_t len = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    *bad_at = i;
    return 0;
  }
  for (size_t k = 1; k < len; ++k) {
    if (i + k >= bytes.size()) {
      *bad_at = bytes.size();
      return 0;
    }
    const auto b = static_cast<unsigned char>(bytes[i + k]);
    if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xBF)) {
      *bad_at = i + k;
      return 0;
    }
  }
  return len;
}

}  // namespace

size_t ByteTokenizer::CompleteTextBytes(std::string_view bytes) {
  // Only the last three bytes can hold an unfinished character.
  for (size_t back = 1; back <= 3 && back <= bytes.size(); ++back) {
    const size_t i = bytes.size() - back;
    const auto c = static_cast<unsigned char>(bytes[i]);
    if (c < 0x80) return bytes.size();
    if (c < 0xC0) continue;  // a continuation byte: look further back for its lead
    size_t bad_at = 0;
    if (Utf8At(bytes, i, &bad_at) == 0 && bad_at == bytes.size()) return i;  // cut short by the end
    return bytes.size();
  }
  return bytes.size();
}

int64_t ByteTokenizer::TextLength(std::string_view bytes) {
  int64_t n = 0;
  size_t i = 0;
  while (i < bytes.size()) {
    size_t bad_at = 0;
    const size_t len = Utf8At(bytes, i, &bad_at);
    ++n;  // a character, or one U+FFFD for the broken sequence
    i = len > 0 ? i + len : std::max(bad_at, i + 1);
  }
  return n;
}

}  // namespace rc::engine
