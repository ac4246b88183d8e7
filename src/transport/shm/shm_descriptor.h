// The shm transport's descriptor: what an owner publishes for one registration and a reader parses.
//
// Format (see rolloutcore/transport/shm.h for the meaning of each field):
//   shm:v1:pid=<u>:fd=<u>:tok=<hex>:off=<u>:len=<u>:ctl=<u>:ctok=<hex>:slot=<u>:gen=<u>
// Parsing is strict: every field exactly once, no unknown field, numbers in range; an error
// names the field and the offending text. Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "rolloutcore/base/status.h"

namespace rc::transport::shm_internal {

struct ShmDescriptor {
  int64_t pid = 0;
  int32_t fd = -1;
  uint64_t token = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  int32_t ctl_fd = -1;
  uint64_t ctl_token = 0;
  uint32_t slot = 0;
  uint64_t generation = 0;
};

std::string FormatShmDescriptor(const ShmDescriptor& d);
[[nodiscard]] Result<ShmDescriptor> ParseShmDescriptor(std::string_view text);

}  // namespace rc::transport::shm_internal
