// The ucx transport's descriptor: what an owner publishes for one registration.
//
//   ucx:v1:host=<hostname>:pid=<u>:id=<u>:addr=<hex>:len=<u>:worker=<hex bytes>:rkey=<hex bytes>
// Parsing is strict: every field exactly once, no unknown field; errors name the field and the
// offending text (long values abbreviated). Pure functions, no UCX calls; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "rolloutcore/base/status.h"

namespace rc::transport::ucx_internal {

struct UcxDescriptor {
  std::string host;
  int64_t pid = 0;
  uint64_t id = 0;
  uint64_t address = 0;
  uint64_t length = 0;
  std::string worker_address;  // raw bytes of the owner's UCP worker address
  std::string rkey;            // raw bytes of the packed rkey
};

std::string FormatUcxDescriptor(const UcxDescriptor& d);
[[nodiscard]] Result<UcxDescriptor> ParseUcxDescriptor(std::string_view text);

std::string HexEncode(std::string_view bytes);
// False on odd length or a non-hex digit.
bool HexDecode(std::string_view hex, std::string* out);

}  // namespace rc::transport::ucx_internal
