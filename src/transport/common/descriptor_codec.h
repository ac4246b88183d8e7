// The descriptor codec shared by the transport backends (shm, ucx, cuda_ipc, nccl): descriptors are
// printable strings "<backend>:v<N>:k1=v1:k2=v2..." that go into shard tables; this is the one
// strict parser for them (every field exactly once, no unknown field, numbers in range) and the one
// hex codec for the binary fields (UCX worker addresses and rkeys, CUDA IPC handles).
//
// Errors are InvalidArgument "<backend> descriptor '<text>': <why>", naming the field and the bad
// value (long texts abbreviated). Pure functions, no CUDA/UCX/NCCL: the backends' descriptor code
// builds and is tested in every build. Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/status.h"

namespace rc::transport::codec {

// `s` itself when at most 64 characters, else its first 48 and the length.
std::string Abbrev(std::string_view s);

std::string HexEncode(const void* data, size_t n);
inline std::string HexEncode(std::string_view bytes) { return HexEncode(bytes.data(), bytes.size()); }
// False unless `hex` is exactly 2*n hex digits.
[[nodiscard]] bool HexDecode(std::string_view hex, void* out, size_t n);
// False on odd length or a non-hex digit.
[[nodiscard]] bool HexDecode(std::string_view hex, std::string* out);

// The fields of one parsed descriptor, in the order of the names given to Parse.
class DescriptorFields {
 public:
  // Splits `text` = "<prefix>k1=v1:k2=v2..." into the values of `names`. Values may be empty; they
  // never contain ':'.
  [[nodiscard]] static Result<DescriptorFields> Parse(std::string_view backend, std::string_view prefix,
                                                      std::string_view text, std::span<const std::string_view> names);

  std::string_view value(size_t field) const { return values_[field]; }
  // InvalidArgument "<backend> descriptor '<text>': <why>".
  [[nodiscard]] Status Error(std::string_view why) const;
  // A number in `base` (10 or 16) within [min, max]; with `digits` > 0 exactly that many digits.
  [[nodiscard]] Result<uint64_t> Number(size_t field, int base, uint64_t min, uint64_t max, size_t digits = 0) const;
  // A non-empty value.
  [[nodiscard]] Result<std::string_view> NonEmpty(size_t field) const;
  // Hex bytes: exactly `n` bytes into `out`.
  [[nodiscard]] Status FixedHex(size_t field, void* out, size_t n) const;
  // Hex bytes: any non-empty, even number of digits.
  [[nodiscard]] Result<std::string> Bytes(size_t field) const;

 private:
  std::string_view backend_, text_;
  std::vector<std::string_view> names_, values_;
};

}  // namespace rc::transport::codec
