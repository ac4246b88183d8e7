// Seeded synthetic tensor contents for GPU benchmarks and tests: a pure function of (seed, tensor
// name, global element index), so the GPU owner (which fills device memory with a kernel) and a
// CPU reference (which regenerates the same bytes on the host) agree bit for bit whatever the
// layout. Values are small normal numbers of either sign (|x| in [2^-10, 2^-4)) for the float
// dtypes, raw random bits for the integer ones.
//
// The functions are constexpr so the CUDA kernels call the very same code (the CUDA module is
// compiled with --expt-relaxed-constexpr). Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <string_view>

#include "rolloutcore/base/hash.h"
#include "rolloutcore/refit/tensor.h"

namespace rc::cuda {

// Per-tensor key; the name hash is Hash64(name).
constexpr uint64_t SeededTensorKey(uint64_t seed, uint64_t name_hash) { return Mix64(seed ^ Mix64(name_hash)); }
inline uint64_t SeededTensorKey(uint64_t seed, std::string_view name) { return SeededTensorKey(seed, Hash64(name)); }

// The element's bits (zero-extended) in `dtype` (a refit::DType value).
constexpr uint64_t SeededElementBits(uint8_t dtype, uint64_t key, uint64_t global_index) {
  const uint64_t r = Mix64(key + global_index);
  const uint64_t sign = r & 1;
  const uint64_t exp_step = (r >> 1) % 6;
  switch (static_cast<refit::DType>(dtype)) {
    case refit::DType::kBF16: return (sign << 15) | ((117 + exp_step) << 7) | ((r >> 8) & 0x7f);
    case refit::DType::kF16: return (sign << 15) | ((5 + exp_step) << 10) | ((r >> 8) & 0x3ff);
    case refit::DType::kF32: return (sign << 31) | ((117 + exp_step) << 23) | ((r >> 8) & 0x7fffff);
    case refit::DType::kI32: return r & 0xffffffffu;
    case refit::DType::kI64: return r;
    default: return r & 0xff;  // 1-byte types
  }
}

}  // namespace rc::cuda
