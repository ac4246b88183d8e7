// The cuda_ipc transport's descriptor (see rolloutcore/transport/cuda_ipc.h):
//   cuda_ipc:v1:pid=<u>:id=<u>:dev=<u>:off=<u>:len=<u>:handle=<128 hex digits>
// Parsing is strict: every field exactly once, no unknown field; errors name the field. Pure
// functions, no CUDA calls; thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "rolloutcore/base/status.h"

namespace rc::transport::cuda_ipc_internal {

inline constexpr size_t kIpcHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t)

struct CudaIpcDescriptor {
  int64_t pid = 0;
  uint64_t id = 0;
  int32_t device = 0;
  uint64_t offset = 0;  // of the region inside the allocation the handle names
  uint64_t length = 0;
  std::array<char, kIpcHandleBytes> handle{};
};

std::string FormatCudaIpcDescriptor(const CudaIpcDescriptor& d);
[[nodiscard]] Result<CudaIpcDescriptor> ParseCudaIpcDescriptor(std::string_view text);

}  // namespace rc::transport::cuda_ipc_internal
