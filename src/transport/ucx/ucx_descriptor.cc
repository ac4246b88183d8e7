#include "transport/ucx/ucx_descriptor.h"

#include <fmt/format.h>

#include <array>
#include <charconv>
#include <limits>

#include "rolloutcore/base/encoding.h"

namespace rc::transport::ucx_internal {
namespace {

constexpr std::string_view kPrefix = "ucx:v1:";

enum Field : int { kHost, kPid, kId, kAddr, kLen, kWorker, kRkey, kFieldCount };
constexpr std::array<std::string_view, kFieldCount> kNames = {"host", "pid", "id", "addr", "len", "worker", "rkey"};

std::string Abbrev(std::string_view s) {
  return s.size() <= 64 ? std::string(s) : fmt::format("{}...({} chars)", s.substr(0, 48), s.size());
}

}  // namespace

std::string HexEncode(std::string_view bytes) { return rc::HexEncode(bytes); }

bool HexDecode(std::string_view hex, std::string* out) {
  auto bytes = rc::HexDecode(hex);
  if (!bytes.ok()) return false;
  *out = std::move(bytes).value();
  return true;
}

std::string FormatUcxDescriptor(const UcxDescriptor& d) {
  return fmt::format("{}host={}:pid={}:id={}:addr={:x}:len={}:worker={}:rkey={}", kPrefix, d.host, d.pid, d.id,
                     d.address, d.length, HexEncode(d.worker_address), HexEncode(d.rkey));
}

Result<UcxDescriptor> ParseUcxDescriptor(std::string_view text) {
  auto error = [&](std::string why) {
    return InvalidArgument(fmt::format("ucx descriptor '{}': {}", Abbrev(text), why));
  };
  if (text.substr(0, kPrefix.size()) != kPrefix) {
    return error(fmt::format("does not start with '{}' (not a ucx descriptor, or another version)", kPrefix));
  }
  std::array<std::string_view, kFieldCount> values{};
  std::array<bool, kFieldCount> seen{};
  std::string_view rest = text.substr(kPrefix.size());
  while (!rest.empty()) {
    const size_t colon = rest.find(':');
    const std::string_view item = rest.substr(0, colon);
    rest = colon == std::string_view::npos ? std::string_view() : rest.substr(colon + 1);
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos) return error(fmt::format("item '{}' is not key=value", Abbrev(item)));
    const std::string_view key = item.substr(0, eq);
    int field = -1;
    for (int i = 0; i < kFieldCount; ++i) {
      if (kNames[i] == key) field = i;
    }
    if (field < 0) return error(fmt::format("unknown field '{}'", Abbrev(key)));
    if (seen[field]) return error(fmt::format("field '{}' appears twice", key));
    seen[field] = true;
    values[field] = item.substr(eq + 1);
  }
  for (int i = 0; i < kFieldCount; ++i) {
    if (!seen[i]) return error(fmt::format("missing field '{}'", kNames[i]));
  }
  auto number = [&](Field f, int base, uint64_t max, uint64_t* out) -> Status {
    const std::string_view v = values[f];
    auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), *out, base);
    if (v.empty() || ec != std::errc() || end != v.data() + v.size()) {
      return error(fmt::format("field '{}': '{}' is not a {} number", kNames[f], Abbrev(v), base == 16 ? "hex" : "decimal"));
    }
    if (*out > max) return error(fmt::format("field '{}': {} is out of range (max {})", kNames[f], *out, max));
    return OkStatus();
  };
  UcxDescriptor d;
  d.host = std::string(values[kHost]);
  if (d.host.empty()) return error("field 'host': empty");
  uint64_t pid = 0;
  RC_RETURN_IF_ERROR(number(kPid, 10, std::numeric_limits<int32_t>::max(), &pid));
  if (pid == 0) return error("field 'pid': must be positive");
  d.pid = static_cast<int64_t>(pid);
  RC_RETURN_IF_ERROR(number(kId, 10, UINT64_MAX, &d.id));
  RC_RETURN_IF_ERROR(number(kAddr, 16, UINT64_MAX, &d.address));
  RC_RETURN_IF_ERROR(number(kLen, 10, UINT64_MAX, &d.length));
  if (d.address + d.length < d.address) return error("fields 'addr'+'len' overflow");
  if (values[kWorker].empty() || !HexDecode(values[kWorker], &d.worker_address)) {
    return error(fmt::format("field 'worker': '{}' is not non-empty hex bytes", Abbrev(values[kWorker])));
  }
  if (values[kRkey].empty() || !HexDecode(values[kRkey], &d.rkey)) {
    return error(fmt::format("field 'rkey': '{}' is not non-empty hex bytes", Abbrev(values[kRkey])));
  }
  return d;
}

}  // namespace rc::transport::ucx_internal
