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

}  // namespace rc::engine
