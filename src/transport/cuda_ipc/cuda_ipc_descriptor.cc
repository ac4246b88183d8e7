#include "transport/cuda_ipc/cuda_ipc_descriptor.h"

#include <fmt/format.h>

#include <limits>

#include "transport/gpu_common.h"

namespace rc::transport::cuda_ipc_internal {
namespace {

constexpr std::string_view kPrefix = "cuda_ipc:v1:";
constexpr std::string_view kBackend = "cuda_ipc";
enum Field : size_t { kPid, kId, kDev, kOff, kLen, kHandle, kFieldCount };
constexpr std::array<std::string_view, kFieldCount> kNames = {"pid", "id", "dev", "off", "len", "handle"};

}  // namespace

std::string FormatCudaIpcDescriptor(const CudaIpcDescriptor& d) {
  return fmt::format("{}pid={}:id={}:dev={}:off={}:len={}:handle={}", kPrefix, d.pid, d.id, d.device, d.offset,
                     d.length, gpu_internal::HexEncode(d.handle.data(), d.handle.size()));
}

Result<CudaIpcDescriptor> ParseCudaIpcDescriptor(std::string_view text) {
  std::array<std::string_view, kFieldCount> v{};
  RC_RETURN_IF_ERROR(gpu_internal::ParseFields(kBackend, kPrefix, text, kNames, &v));
  CudaIpcDescriptor d;
  uint64_t n = 0;
  RC_RETURN_IF_ERROR(gpu_internal::ParseDecimalField(kBackend, text, "pid", v[kPid], 1,
                                                     std::numeric_limits<int32_t>::max(), &n));
  d.pid = static_cast<int64_t>(n);
  RC_RETURN_IF_ERROR(gpu_internal::ParseDecimalField(kBackend, text, "id", v[kId], 1, UINT64_MAX, &d.id));
  RC_RETURN_IF_ERROR(gpu_internal::ParseDecimalField(kBackend, text, "dev", v[kDev], 0, 1023, &n));
  d.device = static_cast<int32_t>(n);
  RC_RETURN_IF_ERROR(gpu_internal::ParseDecimalField(kBackend, text, "off", v[kOff], 0, UINT64_MAX, &d.offset));
  RC_RETURN_IF_ERROR(gpu_internal::ParseDecimalField(kBackend, text, "len", v[kLen], 0, UINT64_MAX, &d.length));
  if (d.offset + d.length < d.offset) {
    return InvalidArgument(fmt::format("cuda_ipc descriptor '{}': fields 'off'+'len' overflow",
                                       gpu_internal::Abbrev(text)));
  }
  if (!gpu_internal::HexDecode(v[kHandle], d.handle.data(), d.handle.size())) {
    return InvalidArgument(fmt::format("cuda_ipc descriptor '{}': field 'handle': '{}' is not {} hex digits",
                                       gpu_internal::Abbrev(text), gpu_internal::Abbrev(v[kHandle]),
                                       2 * kIpcHandleBytes));
  }
  return d;
}

}  // namespace rc::transport::cuda_ipc_internal
