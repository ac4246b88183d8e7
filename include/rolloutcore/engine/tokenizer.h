// ByteTokenizer: the engine's documented byte-level fallback tokenizer.
//
// The embedded engine does not implement Hugging Face tokenizers (tokenizer.json BPE); clients
// that care send token ids. For text prompts it maps each UTF-8 byte b of the text to token id
// b (so the model's vocabulary must have at least 256 entries). Decoding concatenates byte b for
// ids < 256 and writes "<|id|>" for larger ids; invalid UTF-8 in the result is replaced by
// U+FFFD when the text is put into JSON. Per-token strings (logprobs keys) are the character for
// ids < 128, "<0xHH>" for ids 128..255 and "<|id|>" above, so they are distinct per id.
//
// Thread safety: stateless; all methods are const.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/status.h"

namespace rc::engine {

class ByteTokenizer {
 public:
  explicit ByteTokenizer(int64_t vocab_size) : vocab_size_(vocab_size) {}
  // InvalidArgument naming `field` when the vocabulary is smaller than 256.
  Result<std::vector<int32_t>> Encode(std::string_view text, std::string_view field) const;
  std::string Decode(const std::vector<int32_t>& ids) const;
  std::string TokenString(int32_t id) const;

  // Text as a stream shows it (decoded bytes that may end inside a character):
  // CompleteTextBytes is how many leading bytes end on a character boundary, leaving out a
  // trailing sequence that the next bytes could still complete (so no chunk splits a character
  // into two U+FFFD); TextLength is how many characters the JSON rendering of the bytes has
  // (each invalid sequence one U+FFFD, as rc::net::DumpJson writes it): the unit of text_offset.
  static size_t CompleteTextBytes(std::string_view bytes);
  static int64_t TextLength(std::string_view bytes);

 private:
  int64_t vocab_size_;
};

}  // namespace rc::engine
