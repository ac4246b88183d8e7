#include "transport/nccl/nccl_descriptor.h"

#include <fmt/format.h>

#include <array>
#include <charconv>
#include <limits>

#include "transport/gpu_common.h"

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
  std::array<std::string_view, kFieldCount> v{};
  RC_RETURN_IF_ERROR(gpu_internal::ParseFields(kBackend, kPrefix, text, kNames, &v));
  NcclDescriptor d;
  d.host = std::string(v[kHost]);
  if (d.host.empty()) {
    return InvalidArgument(fmt::format("nccl descriptor '{}': field 'host': empty", gpu_internal::Abbrev(text)));
  }
  uint64_t n = 0;
  RC_RETURN_IF_ERROR(gpu_internal::ParseDecimalField(kBackend, text, "port", v[kPort], 1, 65535, &n));
  d.port = static_cast<uint16_t>(n);
  RC_RETURN_IF_ERROR(gpu_internal::ParseDecimalField(kBackend, text, "pid", v[kPid], 1,
                                                     std::numeric_limits<int32_t>::max(), &n));
  d.pid = static_cast<int64_t>(n);
  const std::string_view tok = v[kTok];
  auto [end, ec] = std::from_chars(tok.data(), tok.data() + tok.size(), d.token, 16);
  if (tok.size() != 16 || ec != std::errc() || end != tok.data() + tok.size()) {
    return InvalidArgument(fmt::format("nccl descriptor '{}': field 'tok': '{}' is not 16 hex digits",
                                       gpu_internal::Abbrev(text), gpu_internal::Abbrev(tok)));
  }
  RC_RETURN_IF_ERROR(gpu_internal::ParseDecimalField(kBackend, text, "id", v[kId], 1, UINT64_MAX, &d.id));
  RC_RETURN_IF_ERROR(gpu_internal::ParseDecimalField(kBackend, text, "dev", v[kDev], 0, 1023, &n));
  d.device = static_cast<int32_t>(n);
  RC_RETURN_IF_ERROR(gpu_internal::ParseDecimalField(kBackend, text, "len", v[kLen], 0, UINT64_MAX, &d.length));
  return d;
}

}  // namespace rc::transport::nccl_internal
