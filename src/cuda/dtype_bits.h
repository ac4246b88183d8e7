// Bit-exact element conversions usable from host and device code: the same algorithms as
// rc::refit::{Bf16BitsToF32, F32ToBf16Bits, F16BitsToF32, F32ToF16Bits} (tensor.cc), written on
// bit patterns. gpu_kernels_test checks every f16/bf16 pattern and sampled f32 patterns against
// the CPU functions on the host and on the device.
//
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define RC_HD __host__ __device__ __forceinline__
#else
#define RC_HD inline
#endif

namespace rc::cuda::internal {

RC_HD uint32_t FloatToBits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
RC_HD float BitsToFloat(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

RC_HD uint32_t Bf16ToF32Bits(uint16_t b) { return static_cast<uint32_t>(b) << 16; }

RC_HD uint16_t F32BitsToBf16(uint32_t u) {
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

RC_HD uint32_t F16ToF32Bits(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return sign | 0x7f800000u | (mant << 13);
  if (exp == 0) {
    const float v = static_cast<float>(mant) * 0x1p-24f;  // exact
    return sign | FloatToBits(v);
  }
  return sign | ((exp + 112u) << 23) | (mant << 13);
}

RC_HD uint16_t F32BitsToF16(uint32_t x) {
  const uint32_t sign = x & 0x80000000u;
  x ^= sign;
  uint32_t o;
  if (x >= (143u << 23)) {
    if (x > 0x7f800000u) {
      const uint32_t m = (x >> 13) & 0x3ffu;
      o = 0x7c00u | (m != 0 ? m : 0x200u);
    } else {
      o = 0x7c00u;
    }
  } else if (x < (113u << 23)) {
    const uint32_t magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    const float f = BitsToFloat(x) + BitsToFloat(magic);  // IEEE round-to-nearest-even add
    o = FloatToBits(f) - magic;
  } else {
    const uint32_t mant_odd = (x >> 13) & 1u;
    x -= 112u << 23;
    x += 0xfffu + mant_odd;
    o = x >> 13;
  }
  return static_cast<uint16_t>(o | (sign >> 16));
}

// How an installed element maps back to source bits for the digest (refit/digest.cc SourceBits).
enum BitsMode : uint8_t {
  kBitsRaw = 0,         // same dtype
  kBitsF32FromBf16 = 1,  // installed f32, source bf16
  kBitsF32FromF16 = 2,   // installed f32, source f16
  kBitsBf16FromF32 = 3,  // installed bf16, source f32
  kBitsF16FromF32 = 4,   // installed f16, source f32
  kBitsMismatch = 5,     // any other pair: poisoned
};

inline constexpr uint64_t kPoison = uint64_t{1} << 40;

RC_HD uint64_t SourceBitsFromInstalled(uint8_t mode, uint64_t raw) {
  switch (mode) {
    case kBitsRaw: return raw;
    case kBitsF32FromBf16: {
      const uint32_t u = static_cast<uint32_t>(raw);
      return (u & 0xffffu) == 0 ? (u >> 16) : (kPoison | u);
    }
    case kBitsF32FromF16: {
      const uint32_t u = static_cast<uint32_t>(raw);
      const uint16_t h = F32BitsToF16(u);
      return F16ToF32Bits(h) == u ? h : (kPoison | u);
    }
    case kBitsBf16FromF32: return Bf16ToF32Bits(static_cast<uint16_t>(raw));
    case kBitsF16FromF32: return F16ToF32Bits(static_cast<uint16_t>(raw));
    default: return (kPoison << 1) | raw;
  }
}

}  // namespace rc::cuda::internal
