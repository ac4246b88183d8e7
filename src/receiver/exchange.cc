#include "receiver/exchange.h"

#include <fmt/format.h>

#include <cstdint>
#include <set>
#include <string>

namespace rc::receiver::internal {
namespace {

// True when `strides` walk `shape` row-major without gaps (unit dims may carry any stride).
bool Dense(const refit::Shape& shape, const refit::Shape& strides) {
  if (shape.size() != strides.size()) return false;
  int64_t expect = 1;
  for (size_t k = shape.size(); k-- > 0;) {
    if (shape[k] == 1) continue;
    if (strides[k] != expect) return false;
    expect *= shape[k];
  }
  return true;
}

int64_t Numel(const refit::Shape& shape) {
  int64_t n = 1;
  for (int64_t x : shape) n *= x;
  return n;
}

}  // namespace

std::string ExchangeLayoutIssue(const refit::Capture& staging, const refit::Capture& live,
                                const refit::DestinationBuffers& staging_buffers,
                                const refit::DestinationBuffers& live_after) {
  if (staging.copies.size() != live.copies.size()) {
    return fmt::format("the staging capture has {} copies, the live one {}", staging.copies.size(), live.copies.size());
  }
  if (live.copies.empty()) return "the live capture has no copies";
  if (Status s = refit::CheckDestinationCoverage(live); !s.ok()) {
    return "the copies do not write every byte of the live parameters exactly once: " + s.message();
  }
  std::set<std::string, std::less<>> with_copies;
  for (size_t i = 0; i < live.copies.size(); ++i) {
    const refit::CapturedCopy& s = staging.copies[i];
    const refit::CapturedCopy& l = live.copies[i];
    const refit::TensorSpec& lp = live.params.at(l.param);
    const refit::TensorSpec& sp = staging.params.at(s.param);
    if (s.source != l.source || s.box.start != l.box.start || s.box.extent != l.box.extent ||
        s.view_to_source != l.view_to_source || s.dest_shape != l.dest_shape) {
      return fmt::format("copy {} ({}): the staging and live captures copy different boxes", i, l.source);
    }
    if (sp.dtype != lp.dtype) {
      return fmt::format("copy {} ({}): staging dtype {} is not the live parameter {}'s {}", i, l.source,
                         refit::DTypeName(sp.dtype), lp.name, refit::DTypeName(lp.dtype));
    }
    if (s.dest_offset != 0 || !Dense(s.dest_shape, s.dest_strides)) {
      return fmt::format("copy {} ({}): not dense at the start of its staging buffer {}", i, l.source, sp.name);
    }
    if (!Dense(l.dest_shape, l.dest_strides)) {
      return fmt::format("copy {} ({}): a strided box of {} (strides {}): its staged bytes cannot lie in place", i,
                         l.source, lp.name, refit::ShapeToString(l.dest_strides));
    }
    const auto sb = staging_buffers.find(sp.name);
    if (sb == staging_buffers.end()) return fmt::format("copy {} ({}): no staging buffer {}", i, l.source, sp.name);
    const auto lb = live_after.find(lp.name);
    if (lb == live_after.end()) return fmt::format("copy {} ({}): live parameter {} is not exchanged", i, l.source, lp.name);
    const uint64_t esize = refit::DTypeSize(lp.dtype);
    const uint64_t param_bytes = static_cast<uint64_t>(Numel(lp.shape)) * esize;
    if (lb->second.size() != param_bytes) {
      return fmt::format("live parameter {}: its slab holds {} bytes, the parameter {}", lp.name, lb->second.size(),
                         param_bytes);
    }
    const uint64_t copy_bytes = static_cast<uint64_t>(Numel(l.dest_shape)) * esize;
    if (sb->second.size() < copy_bytes) {
      return fmt::format("copy {} ({}): staging buffer {} holds {} bytes, the copy {}", i, l.source, sp.name,
                         sb->second.size(), copy_bytes);
    }
    const auto expect = reinterpret_cast<uintptr_t>(lb->second.data()) + static_cast<uint64_t>(l.dest_offset) * esize;
    if (reinterpret_cast<uintptr_t>(sb->second.data()) != expect) {
      return fmt::format("copy {} ({}): staging buffer {} is at {:#x}, not at {:#x} (slab of {} + element {})", i,
                         l.source, sp.name, reinterpret_cast<uintptr_t>(sb->second.data()), expect, lp.name,
                         l.dest_offset);
    }
    with_copies.insert(lp.name);
  }
  for (const auto& entry : live_after) {
    if (!with_copies.contains(entry.first)) {
      return fmt::format("{} is not a live parameter the copies write", entry.first);
    }
  }
  return "";
}

}  // namespace rc::receiver::internal
