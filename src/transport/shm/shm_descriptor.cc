#include "transport/shm/shm_descriptor.h"

#include <fmt/format.h>

#include <array>
#include <charconv>
#include <limits>

namespace rc::transport::shm_internal {
namespace {

constexpr std::string_view kPrefix = "shm:v1:";

enum Field : int { kPid, kFd, kTok, kOff, kLen, kCtl, kCtok, kSlot, kGen, kFieldCount };
constexpr std::array<std::string_view, kFieldCount> kNames = {"pid", "fd",   "tok",  "off", "len",
                                                              "ctl", "ctok", "slot", "gen"};
constexpr std::array<bool, kFieldCount> kHex = {false, false, true, false, false, false, true, false, false};
constexpr std::array<uint64_t, kFieldCount> kMax = {
    std::numeric_limits<int32_t>::max(),  std::numeric_limits<int32_t>::max(), UINT64_MAX,
    UINT64_MAX,                           UINT64_MAX,                          std::numeric_limits<int32_t>::max(),
    UINT64_MAX,                           std::numeric_limits<uint32_t>::max(), UINT64_MAX};

}  // namespace

std::string FormatShmDescriptor(const ShmDescriptor& d) {
  return fmt::format("{}pid={}:fd={}:tok={:016x}:off={}:len={}:ctl={}:ctok={:016x}:slot={}:gen={}", kPrefix, d.pid,
                     d.fd, d.token, d.offset, d.length, d.ctl_fd, d.ctl_token, d.slot, d.generation);
}

Result<ShmDescriptor> ParseShmDescriptor(std::string_view text) {
  auto error = [&](std::string why) {
    return InvalidArgument(fmt::format("shm descriptor '{}': {}", text, why));
  };
  if (text.substr(0, kPrefix.size()) != kPrefix) {
    return error(fmt::format("does not start with '{}' (not an shm descriptor, or another version)", kPrefix));
  }
  std::array<uint64_t, kFieldCount> values{};
  std::array<bool, kFieldCount> seen{};
  std::string_view rest = text.substr(kPrefix.size());
  while (!rest.empty()) {
    const size_t colon = rest.find(':');
    const std::string_view item = rest.substr(0, colon);
    rest = colon == std::string_view::npos ? std::string_view() : rest.substr(colon + 1);
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos) return error(fmt::format("item '{}' is not key=value", item));
    const std::string_view key = item.substr(0, eq);
    const std::string_view value = item.substr(eq + 1);
    int field = -1;
    for (int i = 0; i < kFieldCount; ++i) {
      if (kNames[i] == key) field = i;
    }
    if (field < 0) return error(fmt::format("unknown field '{}'", key));
    if (seen[field]) return error(fmt::format("field '{}' appears twice", key));
    seen[field] = true;
    uint64_t v = 0;
    const int base = kHex[field] ? 16 : 10;
    auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v, base);
    if (value.empty() || ec != std::errc() || end != value.data() + value.size()) {
      return error(fmt::format("field '{}': '{}' is not a {} number", key, value, kHex[field] ? "hex" : "decimal"));
    }
    if (v > kMax[field]) return error(fmt::format("field '{}': {} is out of range (max {})", key, v, kMax[field]));
    values[field] = v;
  }
  for (int i = 0; i < kFieldCount; ++i) {
    if (!seen[i]) return error(fmt::format("missing field '{}'", kNames[i]));
  }
  ShmDescriptor d;
  d.pid = static_cast<int64_t>(values[kPid]);
  d.fd = static_cast<int32_t>(values[kFd]);
  d.token = values[kTok];
  d.offset = values[kOff];
  d.length = values[kLen];
  d.ctl_fd = static_cast<int32_t>(values[kCtl]);
  d.ctl_token = values[kCtok];
  d.slot = static_cast<uint32_t>(values[kSlot]);
  d.generation = values[kGen];
  if (d.pid <= 0) return error("field 'pid': must be positive");
  if (d.generation == 0) return error("field 'gen': must be non-zero");
  if (d.offset + d.length < d.offset) return error("fields 'off'+'len' overflow");
  return d;
}

}  // namespace rc::transport::shm_internal
