#include "transport/cuda_ipc/cuda_ipc_descriptor.h"

#include <fmt/format.h>

#include <limits>

#include "transport/common/descriptor_codec.h"

namespace rc::transport::cuda_ipc_internal {
namespace {

constexpr std::string_view kPrefix = "cuda_ipc:v1:";
constexpr std::string_view kBackend = "cuda_ipc";
enum Field : size_t { kPid, kId, kDev, kOff, kLen, kHandle, kFieldCount };
constexpr std::array<std::string_view, kFieldCount> kNames = {"pid", "id", "dev", "off", "len", "handle"};

}  // namespace

std::string FormatCudaIpcDescriptor(const CudaIpcDescriptor& d) {
  return fmt::format("{}pid={}:id={}:dev={}:off={}:len={}:handle={}", kPrefix, d.pid, d.id, d.device, d.offset,
                     d.length, codec::HexEncode(d.handle.data(), d.handle.size()));
}

Result<CudaIpcDescriptor> ParseCudaIpcDescriptor(std::string_view text) {
  RC_ASSIGN_OR_RETURN(codec::DescriptorFields f, codec::DescriptorFields::Parse(kBackend, kPrefix, text, kNames));
  CudaIpcDescriptor d;
  RC_ASSIGN_OR_RETURN(const uint64_t pid, f.Number(kPid, 10, 1, std::numeric_limits<int32_t>::max()));
  d.pid = static_cast<int64_t>(pid);
  RC_ASSIGN_OR_RETURN(d.id, f.Number(kId, 10, 1, UINT64_MAX));
  RC_ASSIGN_OR_RETURN(const uint64_t dev, f.Number(kDev, 10, 0, 1023));
  d.device = static_cast<int32_t>(dev);
  RC_ASSIGN_OR_RETURN(d.offset, f.Number(kOff, 10, 0, UINT64_MAX));
  RC_ASSIGN_OR_RETURN(d.length, f.Number(kLen, 10, 0, UINT64_MAX));
  if (d.offset + d.length < d.offset) return f.Error("fields 'off'+'len' overflow");
  RC_RETURN_IF_ERROR(f.FixedHex(kHandle, d.handle.data(), d.handle.size()));
  return d;
}

}  // namespace rc::transport::cuda_ipc_internal
