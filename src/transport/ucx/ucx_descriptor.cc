#include "transport/ucx/ucx_descriptor.h"

#include <fmt/format.h>

#include <array>
#include <limits>

#include "transport/common/descriptor_codec.h"

namespace rc::transport::ucx_internal {
namespace {

constexpr std::string_view kPrefix = "ucx:v1:";

enum Field : size_t { kHost, kPid, kId, kAddr, kLen, kWorker, kRkey, kFieldCount };
constexpr std::array<std::string_view, kFieldCount> kNames = {"host", "pid", "id", "addr", "len", "worker", "rkey"};

}  // namespace

std::string HexEncode(std::string_view bytes) { return codec::HexEncode(bytes); }

bool HexDecode(std::string_view hex, std::string* out) { return codec::HexDecode(hex, out); }

std::string FormatUcxDescriptor(const UcxDescriptor& d) {
  return fmt::format("{}host={}:pid={}:id={}:addr={:x}:len={}:worker={}:rkey={}", kPrefix, d.host, d.pid, d.id,
                     d.address, d.length, HexEncode(d.worker_address), HexEncode(d.rkey));
}

Result<UcxDescriptor> ParseUcxDescriptor(std::string_view text) {
  RC_ASSIGN_OR_RETURN(codec::DescriptorFields f, codec::DescriptorFields::Parse("ucx", kPrefix, text, kNames));
  UcxDescriptor d;
  RC_ASSIGN_OR_RETURN(const std::string_view host, f.NonEmpty(kHost));
  d.host = std::string(host);
  RC_ASSIGN_OR_RETURN(const uint64_t pid, f.Number(kPid, 10, 1, std::numeric_limits<int32_t>::max()));
  d.pid = static_cast<int64_t>(pid);
  RC_ASSIGN_OR_RETURN(d.id, f.Number(kId, 10, 0, UINT64_MAX));
  RC_ASSIGN_OR_RETURN(d.address, f.Number(kAddr, 16, 0, UINT64_MAX));
  RC_ASSIGN_OR_RETURN(d.length, f.Number(kLen, 10, 0, UINT64_MAX));
  if (d.address + d.length < d.address) return f.Error("fields 'addr'+'len' overflow");
  RC_ASSIGN_OR_RETURN(d.worker_address, f.Bytes(kWorker));
  RC_ASSIGN_OR_RETURN(d.rkey, f.Bytes(kRkey));
  return d;
}

}  // namespace rc::transport::ucx_internal
