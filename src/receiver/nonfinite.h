// Whether an element's bits are NaN or +-Inf (exponent all ones): the one predicate the engine's
// refit paths (stage finite check, delta apply) use for every float dtype.
//
// Thread safety: pure function.
#pragma once

#include <cstdint>

#include "rolloutcore/refit/tensor.h"

namespace rc::receiver {

// `bits` is an element of `dtype`, zero-extended. False for dtypes without a non-finite encoding.
constexpr bool IsNonFiniteBits(refit::DType dtype, uint64_t bits) {
  switch (dtype) {
    case refit::DType::kBF16: return (bits & 0x7f80u) == 0x7f80u;
    case refit::DType::kF16: return (bits & 0x7c00u) == 0x7c00u;
    case refit::DType::kF32: return (bits & 0x7f800000u) == 0x7f800000u;
    default: return false;
  }
}

}  // namespace rc::receiver
