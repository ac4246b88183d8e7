// libFuzzer target: the safetensors header parser must reject hostile input without crashing,
// and every accepted tensor must lie inside the file with a byte size matching dtype x shape.
#include <cstdint>
#include <cstdlib>
#include <span>

#include "rolloutcore/formats/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto h = rc::formats::ParseSafetensorsHeader(std::span<const uint8_t>(data, size), size);
  if (!h.ok()) return 0;
  for (const auto& t : h->tensors) {
    if (t.begin > t.end || h->data_offset + t.end > size) std::abort();
    uint64_t n = 1;
    for (int64_t d : t.shape) n *= static_cast<uint64_t>(d);
    if (n * rc::formats::DTypeSize(t.dtype) != t.end - t.begin) std::abort();
  }
  return 0;
}
