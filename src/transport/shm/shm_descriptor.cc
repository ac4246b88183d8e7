#include "transport/shm/shm_descriptor.h"

#include <fmt/format.h>

#include <array>
#include <limits>

#include "transport/common/descriptor_codec.h"

namespace rc::transport::shm_internal {
namespace {

constexpr std::string_view kPrefix = "shm:v1:";

enum Field : size_t { kPid, kFd, kTok, kOff, kLen, kCtl, kCtok, kSlot, kGen, kFieldCount };
constexpr std::array<std::string_view, kFieldCount> kNames = {"pid", "fd",   "tok",  "off", "len",
                                                              "ctl", "ctok", "slot", "gen"};
constexpr uint64_t kMaxInt32 = std::numeric_limits<int32_t>::max();

}  // namespace

std::string FormatShmDescriptor(const ShmDescriptor& d) {
  return fmt::format("{}pid={}:fd={}:tok={:016x}:off={}:len={}:ctl={}:ctok={:016x}:slot={}:gen={}", kPrefix, d.pid,
                     d.fd, d.token, d.offset, d.length, d.ctl_fd, d.ctl_token, d.slot, d.generation);
}

Result<ShmDescriptor> ParseShmDescriptor(std::string_view text) {
  RC_ASSIGN_OR_RETURN(codec::DescriptorFields f, codec::DescriptorFields::Parse("shm", kPrefix, text, kNames));
  ShmDescriptor d;
  RC_ASSIGN_OR_RETURN(const uint64_t pid, f.Number(kPid, 10, 1, kMaxInt32));
  RC_ASSIGN_OR_RETURN(const uint64_t fd, f.Number(kFd, 10, 0, kMaxInt32));
  RC_ASSIGN_OR_RETURN(d.token, f.Number(kTok, 16, 0, UINT64_MAX));
  RC_ASSIGN_OR_RETURN(d.offset, f.Number(kOff, 10, 0, UINT64_MAX));
  RC_ASSIGN_OR_RETURN(d.length, f.Number(kLen, 10, 0, UINT64_MAX));
  RC_ASSIGN_OR_RETURN(const uint64_t ctl, f.Number(kCtl, 10, 0, kMaxInt32));
  RC_ASSIGN_OR_RETURN(d.ctl_token, f.Number(kCtok, 16, 0, UINT64_MAX));
  RC_ASSIGN_OR_RETURN(const uint64_t slot, f.Number(kSlot, 10, 0, std::numeric_limits<uint32_t>::max()));
  RC_ASSIGN_OR_RETURN(d.generation, f.Number(kGen, 10, 1, UINT64_MAX));
  d.pid = static_cast<int64_t>(pid);
  d.fd = static_cast<int32_t>(fd);
  d.ctl_fd = static_cast<int32_t>(ctl);
  d.slot = static_cast<uint32_t>(slot);
  if (d.offset + d.length < d.offset) return f.Error("fields 'off'+'len' overflow");
  return d;
}

}  // namespace rc::transport::shm_internal
