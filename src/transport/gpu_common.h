// Helpers shared by the GPU transport backends (cuda_ipc, nccl): CUDA error text, a scoped
// current-device switch, owner-process liveness and strict key=value descriptor parsing.
// Header-only and included only by those backends (it includes the CUDA runtime header).
//
// Thread safety: DeviceGuard changes the calling thread's current device until it is destroyed;
// the other helpers are pure or read /proc.
#pragma once

#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/encoding.h"
#include "rolloutcore/base/status.h"

namespace rc::transport::gpu_internal {

inline std::string CudaErrorText(cudaError_t e) {
  return fmt::format("{} ({}: {})", cudaGetErrorString(e), cudaGetErrorName(e), static_cast<int>(e));
}

// Sets the current device for the scope and restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (device >= 0 && device != previous_) status_ = cudaSetDevice(device);
  }
  ~DeviceGuard() {
    int now = -1;
    if (previous_ >= 0 && cudaGetDevice(&now) == cudaSuccess && now != previous_) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  cudaError_t status_ = cudaSuccess;
};

// True when process `pid` is gone or a zombie (killed and not yet reaped by its parent: such a
// process still answers kill(pid, 0) but runs no code any more).
inline bool ProcessGone(pid_t pid) {
  if (pid <= 0) return false;
  if (::kill(pid, 0) != 0 && errno == ESRCH) return true;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return errno == ENOENT;
  char buf[512] = {};
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  const std::string_view stat(buf, n);
  const size_t paren = stat.rfind(')');  // the command name may contain spaces and parens
  if (paren == std::string_view::npos || paren + 2 >= stat.size()) return false;
  const char state = stat[paren + 2];
  return state == 'Z' || state == 'X';
}

inline std::string HexEncode(const void* data, size_t n) { return rc::HexEncode(data, n); }

// False unless `hex` is exactly 2*n hex digits.
inline bool HexDecode(std::string_view hex, void* out, size_t n) { return rc::HexDecodeInto(hex, out, n); }

inline std::string Abbrev(std::string_view s) {
  return s.size() <= 64 ? std::string(s) : fmt::format("{}...({} chars)", s.substr(0, 48), s.size());
}

// Splits "<prefix>k1=v1:k2=v2..." into the values of `names` (each exactly once, no unknown key).
// Errors are InvalidArgument "<backend> descriptor '<text>': <why>" naming the field.
template <size_t N>
Status ParseFields(std::string_view backend, std::string_view prefix, std::string_view text,
                   const std::array<std::string_view, N>& names, std::array<std::string_view, N>* values) {
  auto error = [&](const std::string& why) {
    return InvalidArgument(fmt::format("{} descriptor '{}': {}", backend, Abbrev(text), why));
  };
  if (text.substr(0, prefix.size()) != prefix) {
    return error(fmt::format("does not start with '{}' (not a {} descriptor, or another version)", prefix, backend));
  }
  std::array<bool, N> seen{};
  std::string_view rest = text.substr(prefix.size());
  while (!rest.empty()) {
    const size_t colon = rest.find(':');
    const std::string_view item = rest.substr(0, colon);
    rest = colon == std::string_view::npos ? std::string_view() : rest.substr(colon + 1);
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos) return error(fmt::format("item '{}' is not key=value", Abbrev(item)));
    const std::string_view key = item.substr(0, eq);
    size_t field = N;
    for (size_t i = 0; i < N; ++i) {
      if (names[i] == key) field = i;
    }
    if (field == N) return error(fmt::format("unknown field '{}'", Abbrev(key)));
    if (seen[field]) return error(fmt::format("field '{}' appears twice", key));
    seen[field] = true;
    (*values)[field] = item.substr(eq + 1);
  }
  for (size_t i = 0; i < N; ++i) {
    if (!seen[i]) return error(fmt::format("missing field '{}'", names[i]));
  }
  return OkStatus();
}

// A decimal field in [min, max]; InvalidArgument naming the field otherwise.
inline Status ParseDecimalField(std::string_view backend, std::string_view text, std::string_view field,
                                std::string_view value, uint64_t min, uint64_t max, uint64_t* out) {
  auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), *out);
  if (value.empty() || ec != std::errc() || end != value.data() + value.size()) {
    return InvalidArgument(fmt::format("{} descriptor '{}': field '{}': '{}' is not a decimal number", backend,
                                       Abbrev(text), field, Abbrev(value)));
  }
  if (*out < min || *out > max) {
    return InvalidArgument(fmt::format("{} descriptor '{}': field '{}': {} is out of range [{}, {}]", backend,
                                       Abbrev(text), field, *out, min, max));
  }
  return OkStatus();
}

}  // namespace rc::transport::gpu_internal
