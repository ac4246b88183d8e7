// The nccl transport's descriptor (see rolloutcore/transport/nccl.h):
//   nccl:v1:host=<addr>:port=<u>:pid=<u>:tok=<16 hex>:id=<u>:dev=<u>:len=<u>
// and the framing of its control protocol. Parsing is strict: every field exactly once, no
// unknown field; errors name the field. Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "rolloutcore/base/status.h"

namespace rc::transport::nccl_internal {

struct NcclDescriptor {
  std::string host;
  uint16_t port = 0;
  int64_t pid = 0;
  uint64_t token = 0;
  uint64_t id = 0;
  int32_t device = 0;
  uint64_t length = 0;
};

std::string FormatNcclDescriptor(const NcclDescriptor& d);
[[nodiscard]] Result<NcclDescriptor> ParseNcclDescriptor(std::string_view text);

// Control protocol frames: u32 type, u32 payload bytes, payload (host byte order: both ends run
// this code on the same architecture).
enum class FrameType : uint32_t {
  kHello = 1,    // reader -> owner: u64 token, i32 reader pid, ncclUniqueId (128 bytes)
  kReady = 2,    // owner -> reader: communicator ready
  kQuery = 3,    // reader -> owner: u64 registration id
  kQueryOk = 4,  // owner -> reader: u64 length, i32 device
  kRead = 5,     // reader -> owner: u64 n, then n x {u64 id, u64 offset, u64 length}
  kReadOk = 6,   // owner -> reader: the sends are being posted
  kError = 7,    // owner -> reader: message text
};
inline constexpr uint32_t kMaxFrameBytes = 64u << 20;

}  // namespace rc::transport::nccl_internal
