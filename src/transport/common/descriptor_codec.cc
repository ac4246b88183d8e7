#include "transport/common/descriptor_codec.h"

#include <fmt/format.h>

#include <charconv>
#include <utility>

#include "rolloutcore/base/encoding.h"

namespace rc::transport::codec {

std::string Abbrev(std::string_view s) {
  return s.size() <= 64 ? std::string(s) : fmt::format("{}...({} chars)", s.substr(0, 48), s.size());
}

// The hex of descriptors is base's (rolloutcore/base/encoding.h): one encoder in the tree.
std::string HexEncode(const void* data, size_t n) { return rc::HexEncode(data, n); }

bool HexDecode(std::string_view hex, void* out, size_t n) { return rc::HexDecodeInto(hex, out, n); }

bool HexDecode(std::string_view hex, std::string* out) {
  auto bytes = rc::HexDecode(hex);
  if (!bytes.ok()) return false;
  *out = std::move(bytes).value();
  return true;
}

Result<DescriptorFields> DescriptorFields::Parse(std::string_view backend, std::string_view prefix,
                                                 std::string_view text, std::span<const std::string_view> names) {
  DescriptorFields f;
  f.backend_ = backend;
  f.text_ = text;
  f.names_.assign(names.begin(), names.end());
  f.values_.assign(names.size(), std::string_view());
  if (text.substr(0, prefix.size()) != prefix) {
    return f.Error(fmt::format("does not start with '{}' (not {} {} descriptor, or another version)", prefix,
                               backend == "shm" ? "an" : "a", backend));
  }
  std::vector<bool> seen(names.size(), false);
  std::string_view rest = text.substr(prefix.size());
  while (!rest.empty()) {
    const size_t colon = rest.find(':');
    const std::string_view item = rest.substr(0, colon);
    rest = colon == std::string_view::npos ? std::string_view() : rest.substr(colon + 1);
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos) return f.Error(fmt::format("item '{}' is not key=value", Abbrev(item)));
    const std::string_view key = item.substr(0, eq);
    size_t field = names.size();
    for (size_t i = 0; i < names.size(); ++i) {
      if (names[i] == key) field = i;
    }
    if (field == names.size()) return f.Error(fmt::format("unknown field '{}'", Abbrev(key)));
    if (seen[field]) return f.Error(fmt::format("field '{}' appears twice", key));
    seen[field] = true;
    f.values_[field] = item.substr(eq + 1);
  }
  for (size_t i = 0; i < names.size(); ++i) {
    if (!seen[i]) return f.Error(fmt::format("missing field '{}'", names[i]));
  }
  return f;
}

Status DescriptorFields::Error(std::string_view why) const {
  return InvalidArgument(fmt::format("{} descriptor '{}': {}", backend_, Abbrev(text_), why));
}

Result<uint64_t> DescriptorFields::Number(size_t field, int base, uint64_t min, uint64_t max, size_t digits) const {
  const std::string_view v = values_[field];
  uint64_t out = 0;
  auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out, base);
  if (v.empty() || ec != std::errc() || end != v.data() + v.size() || (digits > 0 && v.size() != digits)) {
    const std::string kind = digits > 0 ? fmt::format("{} {} digits", digits, base == 16 ? "hex" : "decimal")
                                        : fmt::format("a {} number", base == 16 ? "hex" : "decimal");
    return Error(fmt::format("field '{}': '{}' is not {}", names_[field], Abbrev(v), kind));
  }
  if (out < min || out > max) {
    return Error(fmt::format("field '{}': {} is out of range [{}, {}]", names_[field], out, min, max));
  }
  return out;
}

Result<std::string_view> DescriptorFields::NonEmpty(size_t field) const {
  if (values_[field].empty()) return Error(fmt::format("field '{}': empty", names_[field]));
  return values_[field];
}

Status DescriptorFields::FixedHex(size_t field, void* out, size_t n) const {
  if (!HexDecode(values_[field], out, n)) {
    return Error(fmt::format("field '{}': '{}' is not {} hex digits", names_[field], Abbrev(values_[field]), 2 * n));
  }
  return OkStatus();
}

Result<std::string> DescriptorFields::Bytes(size_t field) const {
  std::string out;
  if (values_[field].empty() || !HexDecode(values_[field], &out)) {
    return Error(fmt::format("field '{}': '{}' is not non-empty hex bytes", names_[field], Abbrev(values_[field])));
  }
  return out;
}

}  // namespace rc::transport::codec
