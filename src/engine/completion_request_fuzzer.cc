// libFuzzer target: the /v1/completions request parser must never crash, throw or hang on any
// body; on success the result satisfies its documented bounds.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "rolloutcore/engine/http_server.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const rc::engine::ByteTokenizer kTokenizer(512);
  auto r = rc::engine::ParseCompletionRequest(std::string_view(reinterpret_cast<const char*>(data), size), kTokenizer);
  if (r.ok()) {
    if (r->prompts.empty() || r->sampling.max_tokens < 1 || r->n < 1 || r->sampling.num_logprobs > 20) std::abort();
    for (const auto& p : r->prompts)
      if (p.empty()) std::abort();
  }
  return 0;
}
