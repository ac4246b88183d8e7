#include "rolloutcore/refit/tensor.h"

#include "refit/digest_simd.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cctype>
#include <cstring>

namespace rc::refit {
namespace {

struct DTypeInfo {
  DType dtype;
  size_t size;
  std::string_view name;
  std::array<std::string_view, 4> aliases;
};

constexpr std::array<DTypeInfo, kNumDTypes> kDTypes = {{
    {DType::kF32, 4, "f32", {"float32", "float", "fp32", ""}},
    {DType::kBF16, 2, "bf16", {"bfloat16", "", "", ""}},
    {DType::kF16, 2, "f16", {"float16", "half", "fp16", ""}},
    {DType::kF8E4M3, 1, "f8_e4m3", {"float8_e4m3fn", "fp8_e4m3", "float8_e4m3", ""}},
    {DType::kF8E5M2, 1, "f8_e5m2", {"float8_e5m2", "fp8_e5m2", "", ""}},
    {DType::kI8, 1, "i8", {"int8", "", "", ""}},
    {DType::kU8, 1, "u8", {"uint8", "", "", ""}},
    {DType::kI32, 4, "i32", {"int32", "", "", ""}},
    {DType::kI64, 8, "i64", {"int64", "", "", ""}},
}};

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) != std::tolower(static_cast<unsigned char>(b[i]))) {
      return false;
    }
  }
  return true;
}

template <typename T>
T LoadAs(const void* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename T>
void StoreAs(void* p, T v) {
  std::memcpy(p, &v, sizeof v);
}

}  // namespace

size_t DTypeSize(DType dtype) { return kDTypes[static_cast<size_t>(dtype)].size; }
std::string_view DTypeName(DType dtype) { return kDTypes[static_cast<size_t>(dtype)].name; }

Result<DType> ParseDType(std::string_view text) {
  for (const auto& info : kDTypes) {
    if (EqualsIgnoreCase(text, info.name)) return info.dtype;
    for (auto alias : info.aliases) {
      if (!alias.empty() && EqualsIgnoreCase(text, alias)) return info.dtype;
    }
  }
  // safetensors spells them F32, BF16, F8_E4M3 ... which the canonical names cover except for
  // the f8 variants' capitalisation (handled above) and these:
  if (EqualsIgnoreCase(text, "torch.float32")) return DType::kF32;
  if (EqualsIgnoreCase(text, "torch.bfloat16")) return DType::kBF16;
  if (EqualsIgnoreCase(text, "torch.float16")) return DType::kF16;
  return InvalidArgument(fmt::format("unknown dtype '{}' (expected one of f32, bf16, f16, f8_e4m3, "
                                     "f8_e5m2, i8, u8, i32, i64)",
                                     text));
}

int64_t NumElements(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Shape RowMajorStrides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= std::max<int64_t>(shape[i], 1);
  }
  return strides;
}

Status ValidateShape(const Shape& shape, std::string_view what) {
  if (shape.size() > kMaxDims) {
    return InvalidArgument(fmt::format("{}: {} dims, at most {} supported", what, shape.size(), kMaxDims));
  }
  int64_t n = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) {
      return InvalidArgument(fmt::format("{}: dim {} has negative extent {}", what, i, shape[i]));
    }
    if (shape[i] > kMaxElements || (shape[i] != 0 && n > kMaxElements / shape[i])) {
      return InvalidArgument(
          fmt::format("{}: shape {} has more than 2^50 elements", what, ShapeToString(shape)));
    }
    n *= shape[i];
  }
  return OkStatus();
}

std::string ShapeToString(const Shape& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

Box FullBox(const Shape& shape) { return Box{Shape(shape.size(), 0), shape}; }

bool Intersect(const Box& a, const Box& b, Box* out) {
  const size_t n = a.ndim();
  out->start.resize(n);
  out->extent.resize(n);
  bool nonempty = true;
  for (size_t d = 0; d < n; ++d) {
    const int64_t lo = std::max(a.start[d], b.start[d]);
    const int64_t hi = std::min(a.start[d] + a.extent[d], b.start[d] + b.extent[d]);
    out->start[d] = lo;
    out->extent[d] = hi > lo ? hi - lo : 0;
    nonempty = nonempty && hi > lo;
  }
  return nonempty;
}

bool Contains(const Box& outer, const Box& inner) {
  if (outer.ndim() != inner.ndim()) return false;
  for (size_t d = 0; d < outer.ndim(); ++d) {
    if (inner.start[d] < outer.start[d]) return false;
    if (inner.start[d] + inner.extent[d] > outer.start[d] + outer.extent[d]) return false;
  }
  return true;
}

std::string BoxToString(const Box& box) {
  std::string s = "[";
  for (size_t d = 0; d < box.ndim(); ++d) {
    if (d) s += ", ";
    s += fmt::format("{}:{}", box.start[d], box.start[d] + box.extent[d]);
  }
  return s + "]";
}

// ---- Conversion ---------------------------------------------------------------------------------

bool IsConversionSupported(DType from, DType to) {
  if (from == to) return true;
  if (to == DType::kF32) return from == DType::kBF16 || from == DType::kF16;
  if (from == DType::kF32) return to == DType::kBF16 || to == DType::kF16;
  return false;
}

Status CheckConversion(std::string_view tensor, DType from, DType to, bool declared) {
  if (from == to) return OkStatus();
  if (!declared) {
    return InvalidArgument(fmt::format(
        "tensor {}: source dtype {} differs from destination dtype {} and no conversion was declared",
        tensor, DTypeName(from), DTypeName(to)));
  }
  if (!IsConversionSupported(from, to)) {
    return InvalidArgument(fmt::format(
        "tensor {}: no conversion from {} to {} (supported: bf16<->f32, f16<->f32)", tensor,
        DTypeName(from), DTypeName(to)));
  }
  return OkStatus();
}

float Bf16BitsToF32(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

uint16_t F32ToBf16Bits(float value) {
  uint32_t u = std::bit_cast<uint32_t>(value);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float F16BitsToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24 is exact in f32.
    const float v = static_cast<float>(mant) * 0x1p-24f;
    return std::bit_cast<float>(sign | std::bit_cast<uint32_t>(v));
  }
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

uint16_t F32ToF16Bits(float value) {
  // Round to nearest even (after F. Giesen's float_to_half_fast3_rtne).
  uint32_t x = std::bit_cast<uint32_t>(value);
  const uint32_t sign = x & 0x80000000u;
  x ^= sign;
  uint32_t o;
  if (x >= (143u << 23)) {  // >= 2^16: overflow to infinity, or Inf / NaN
    if (x > 0x7f800000u) {
      const uint32_t m = (x >> 13) & 0x3ffu;
      o = 0x7c00u | (m != 0 ? m : 0x200u);
    } else {
      o = 0x7c00u;
    }
  } else if (x < (113u << 23)) {  // result is subnormal or zero
    const uint32_t magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    const float f = std::bit_cast<float>(x) + std::bit_cast<float>(magic);
    o = std::bit_cast<uint32_t>(f) - magic;
  } else {
    const uint32_t mant_odd = (x >> 13) & 1u;
    x -= 112u << 23;
    x += 0xfffu + mant_odd;
    o = x >> 13;
  }
  return static_cast<uint16_t>(o | (sign >> 16));
}

namespace {

template <typename Fn>
void Loop(const std::byte* s, int64_t ss, std::byte* d, int64_t ds, int64_t n, size_t sz_s, size_t sz_d,
          Fn fn) {
  for (int64_t i = 0; i < n; ++i) {
    fn(s + static_cast<size_t>(i * ss) * sz_s, d + static_cast<size_t>(i * ds) * sz_d);
  }
}

}  // namespace

void ConvertElements(DType from, const void* src, int64_t src_stride, DType to, void* dst,
                     int64_t dst_stride, int64_t n) {
  const auto* s = static_cast<const std::byte*>(src);
  auto* d = static_cast<std::byte*>(dst);
  const size_t ss = DTypeSize(from);
  const size_t ds = DTypeSize(to);
  if (from == to) {
    if (src_stride == 1 && dst_stride == 1) {
      if (n > 0) std::memcpy(d, s, static_cast<size_t>(n) * ss);
      return;
    }
    Loop(s, src_stride, d, dst_stride, n, ss, ds, [ss](const std::byte* a, std::byte* b) { std::memcpy(b, a, ss); });
    return;
  }
  if (from == DType::kBF16 && to == DType::kF32) {
    if (src_stride == 1 && dst_stride == 1) {
      internal::WidenBf16ToF32(d, s, n);  // vectorized (refit/digest_simd.h)
      return;
    }
    Loop(s, src_stride, d, dst_stride, n, ss, ds, [](const std::byte* a, std::byte* b) {
      StoreAs<float>(b, Bf16BitsToF32(LoadAs<uint16_t>(a)));
    });
  } else if (from == DType::kF16 && to == DType::kF32) {
    Loop(s, src_stride, d, dst_stride, n, ss, ds, [](const std::byte* a, std::byte* b) {
      StoreAs<float>(b, F16BitsToF32(LoadAs<uint16_t>(a)));
    });
  } else if (from == DType::kF32 && to == DType::kBF16) {
    Loop(s, src_stride, d, dst_stride, n, ss, ds, [](const std::byte* a, std::byte* b) {
      StoreAs<uint16_t>(b, F32ToBf16Bits(LoadAs<float>(a)));
    });
  } else if (from == DType::kF32 && to == DType::kF16) {
    Loop(s, src_stride, d, dst_stride, n, ss, ds, [](const std::byte* a, std::byte* b) {
      StoreAs<uint16_t>(b, F32ToF16Bits(LoadAs<float>(a)));
    });
  }
}

uint64_t ElementBits(DType dtype, const void* element) {
  switch (DTypeSize(dtype)) {
    case 1: return LoadAs<uint8_t>(element);
    case 2: return LoadAs<uint16_t>(element);
    case 4: return LoadAs<uint32_t>(element);
    default: return LoadAs<uint64_t>(element);
  }
}

}  // namespace rc::refit
