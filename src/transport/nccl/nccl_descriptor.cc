#include "transport/nccl/nccl_descriptor.h"

#include <fmt/format.h>

#include <array>
#include <limits>

#include "transport/common/descriptor_codec.h"

namespace rc::transport::nccl_internal {
namespace {

constexpr std::string_view kPrefix = "nccl:v1:";
constexpr std::string_view kBackend = "nccl";
enum Field : size_t { kHost, kPort, kPid, kTok, kId, kDev, kLen, kFieldCount };
constexpr std::array<std::string_view, kFieldCount> kNames = {"host", "port", "pid", "tok", "id", "dev", "len"};

}  // namespace

std::string FormatNcclDescriptor(const NcclDescriptor& d) {
  return fmt::format("{}host={}:port={}:pid={}:tok={:016x}:id={}:dev={}:len={}", kPrefix, d.host, d.port, d.pid,
                     d.token, d.id, d.device, d.length);
}

Result<NcclDescriptor> ParseNcclDescriptor(std::string_view text) {
  RC_ASSIGN_OR_RETURN(codec::DescriptorFields f, codec::DescriptorFields::Parse(kBackend, kPrefix, text, kNames));
  NcclDescriptor d;
  RC_ASSIGN_OR_RETURN(const std::string_view host, f.NonEmpty(kHost));
  d.host = std::string(host);
  RC_ASSIGN_OR_RETURN(const uint64_t port, f.Number(kPort, 10, 1, 65535));
  d.port = static_cast<uint16_t>(port);
  RC_ASSIGN_OR_RETURN(const uint64_t pid, f.Number(kPid, 10, 1, std::numeric_limits<int32_t>::max()));
  d.pid = static_cast<int64_t>(pid);
  RC_ASSIGN_OR_RETURN(d.token, f.Number(kTok, 16, 0, UINT64_MAX, 16));
  RC_ASSIGN_OR_RETURN(d.id, f.Number(kId, 10, 1, UINT64_MAX));
  RC_ASSIGN_OR_RETURN(const uint64_t dev, f.Number(kDev, 10, 0, 1023));
  d.device = static_cast<int32_t>(dev);
  RC_ASSIGN_OR_RETURN(d.length, f.Number(kLen, 10, 0, UINT64_MAX));
  return d;
}

}  // namespace rc::transport::nccl_internal
