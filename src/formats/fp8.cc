#include "rolloutcore/formats/fp8.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <fmt/format.h>

#include "rolloutcore/base/parallel.h"

namespace rc::formats {
namespace {

uint32_t F32Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float F32FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// bf16 magnitude bits at or above this are infinities or NaN.
constexpr uint16_t kBf16ExpMask = 0x7F80;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// One group of elements that share a scale: rows [r0, r1) × cols [c0, c1).
struct Group {
  int64_t r0, r1, c0, c1;
};

Group GroupOf(const Fp8Layout& l, int64_t g) {
  switch (l.scheme) {
    case Fp8Scheme::kPerTensor: return {0, l.rows, 0, l.cols};
    case Fp8Scheme::kPerChannel: return {g, g + 1, 0, l.cols};
    case Fp8Scheme::kBlock: {
      const int64_t gc = CeilDiv(l.cols, l.block_cols);
      const int64_t br = g / gc, bc = g % gc;
      return {br * l.block_rows, std::min(l.rows, (br + 1) * l.block_rows), bc * l.block_cols,
              std::min(l.cols, (bc + 1) * l.block_cols)};
    }
  }
  return {0, 0, 0, 0};
}

enum class Isa { kScalar, kAvx2, kAvx512 };

Isa PickIsa() {
  static const Isa kIsa = internal::CpuHasAvx512() ? Isa::kAvx512 : internal::CpuHasAvx2() ? Isa::kAvx2 : Isa::kScalar;
  return kIsa;
}

int32_t AbsMaxBitsScalar(const uint16_t* x, int64_t n) {
  int32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t a = x[i] & 0x7FFF;
    if ((a & kBf16ExpMask) == kBf16ExpMask) return -1;
    m = std::max(m, a);
  }
  return m;
}

int32_t AbsMaxBits(Isa isa, const uint16_t* x, int64_t n) {
  switch (isa) {
    case Isa::kAvx512: return internal::AbsMaxBitsAvx512(x, n);
    case Isa::kAvx2: return internal::AbsMaxBitsAvx2(x, n);
    case Isa::kScalar: break;
  }
  return AbsMaxBitsScalar(x, n);
}

void QuantizeRun(Isa isa, const uint16_t* x, int64_t n, float factor, bool divide, uint8_t* q) {
  int64_t done = 0;
  if (isa == Isa::kAvx512) done = internal::QuantizeRunAvx512(x, n, factor, divide, q);
  if (isa == Isa::kAvx2) done = internal::QuantizeRunAvx2(x, n, factor, divide, q);
  for (int64_t i = done; i < n; ++i) q[i] = internal::QuantizeOne(x[i], factor, divide);
}

Status CheckSizes(std::span<const uint16_t> bf16, const Fp8Layout& layout, std::span<uint8_t> q,
                  std::span<float> scales, std::string_view name) {
  RC_RETURN_IF_ERROR(layout.Validate().WithContext(fmt::format("quantizing {}", name)));
  const auto n = static_cast<uint64_t>(layout.NumElements());
  if (bf16.size() != n || q.size() != n) {
    return InvalidArgument(fmt::format("quantizing {}: {} × {} needs {} elements, got {} bf16 and {} fp8", name,
                                       layout.rows, layout.cols, n, bf16.size(), q.size()));
  }
  if (scales.size() != static_cast<uint64_t>(layout.NumScales())) {
    return InvalidArgument(fmt::format("quantizing {}: {} scaling needs {} scales, got {}", name,
                                       Fp8SchemeName(layout.scheme), layout.NumScales(), scales.size()));
  }
  return OkStatus();
}

// The element that made a group's amax fail: the first NaN or infinity in it.
Status NonFiniteError(std::span<const uint16_t> bf16, const Fp8Layout& l, const Group& g, std::string_view name) {
  for (int64_t r = g.r0; r < g.r1; ++r) {
    for (int64_t c = g.c0; c < g.c1; ++c) {
      const uint16_t b = bf16[static_cast<size_t>(r * l.cols + c)];
      if ((b & kBf16ExpMask) == kBf16ExpMask) {
        return InvalidArgument(fmt::format("{}[{}, {}] is {} (bf16 0x{:04x}): only finite weights can be quantized to fp8",
                                           name, r, c, (b & 0x7F) != 0 ? "NaN" : (b & 0x8000) ? "-inf" : "+inf", b));
      }
    }
  }
  return Internal(fmt::format("{}: a non-finite element was reported but not found", name));
}

Status Quantize(Isa isa, std::span<const uint16_t> bf16, const Fp8Layout& l, std::span<uint8_t> q,
                std::span<float> scales, std::string_view name, int threads) {
  RC_RETURN_IF_ERROR(CheckSizes(bf16, l, q, scales, name));
  if (l.NumElements() == 0) {
    std::fill(scales.begin(), scales.end(), 1.0f);
    return OkStatus();
  }
  const int64_t groups = l.NumScales();
  // Pass 1: every group's amax, before anything is written (a refused input leaves q and scales
  // as they were). The per-tensor group is split in row ranges so that it runs in parallel too.
  const int64_t parts = l.scheme == Fp8Scheme::kPerTensor ? std::min<int64_t>(l.rows, 64) : groups;
  std::vector<int32_t> amax(static_cast<size_t>(parts), 0);
  const auto part_rows = [&](int64_t p) {
    return Group{l.rows * p / parts, l.rows * (p + 1) / parts, 0, l.cols};
  };
  ParallelFor(static_cast<size_t>(parts), threads, [&](size_t p) {
    const Group g = l.scheme == Fp8Scheme::kPerTensor ? part_rows(static_cast<int64_t>(p))
                                                      : GroupOf(l, static_cast<int64_t>(p));
    int32_t m = 0;
    for (int64_t r = g.r0; r < g.r1 && m >= 0; ++r) {
      const int32_t a = AbsMaxBits(isa, bf16.data() + r * l.cols + g.c0, g.c1 - g.c0);
      m = a < 0 ? -1 : std::max(m, a);
    }
    amax[p] = m;
  });
  for (int64_t p = 0; p < parts; ++p) {
    if (amax[static_cast<size_t>(p)] < 0) {
      return NonFiniteError(bf16, l, l.scheme == Fp8Scheme::kPerTensor ? part_rows(p) : GroupOf(l, p), name);
    }
  }
  // Per channel divides by the scale (vLLM's _fp8_quant_per_channel); the others multiply by its
  // reciprocal (vLLM's static per-tensor kernel, per_block_cast_to_fp8).
  const bool divide = l.scheme == Fp8Scheme::kPerChannel;
  std::vector<float> factor(static_cast<size_t>(groups));
  std::vector<float> scale(static_cast<size_t>(groups));
  for (int64_t g = 0; g < groups; ++g) {
    const int32_t bits = l.scheme == Fp8Scheme::kPerTensor ? *std::max_element(amax.begin(), amax.end())
                                                           : amax[static_cast<size_t>(g)];
    const float s = Fp8ScaleForAmax(l.scheme, F32FromBits(static_cast<uint32_t>(bits) << 16));
    scale[static_cast<size_t>(g)] = s;
    factor[static_cast<size_t>(g)] = divide ? s : 1.0f / s;  // 1 / 0 = inf: see Fp8ScaleForAmax
  }
  // Pass 2: quantize, one group (per tensor: one row range) per task.
  ParallelFor(static_cast<size_t>(parts), threads, [&](size_t p) {
    const Group g = l.scheme == Fp8Scheme::kPerTensor ? part_rows(static_cast<int64_t>(p))
                                                      : GroupOf(l, static_cast<int64_t>(p));
    const float f = factor[l.scheme == Fp8Scheme::kPerTensor ? 0 : p];
    for (int64_t r = g.r0; r < g.r1; ++r) {
      const int64_t off = r * l.cols + g.c0;
      QuantizeRun(isa, bf16.data() + off, g.c1 - g.c0, f, divide, q.data() + off);
    }
  });
  std::copy(scale.begin(), scale.end(), scales.begin());
  return OkStatus();
}

}  // namespace

uint8_t Fp8E4M3FromF32(float x) {
  const uint32_t u = F32Bits(x);
  const auto sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7F;                  // NaN
  if (a >= 0x43E00000u) return static_cast<uint8_t>(sign | 0x7Eu);  // >= 448 (and infinity): saturate
  if (a < 0x3C800000u) {                             // below 2^-6: a subnormal of E4M3 (or 0)
    // Adding 2^14, whose f32 ulp is 2^-9 (E4M3's subnormal step), rounds |x| to a multiple of
    // 2^-9 in the FPU's round-to-nearest-even; the low bits are then the subnormal's mantissa (8,
    // i.e. 0x08, when it rounds up to the smallest normal, which is that normal's encoding).
    const float f = F32FromBits(a) + 16384.0f;
    return static_cast<uint8_t>(sign | (F32Bits(f) - 0x46800000u));
  }
  // Normal: round the 23-bit mantissa to 3 bits, ties to even, then rebias the exponent (127 -> 7).
  const uint32_t r = a + 0x7FFFFu + ((a >> 20) & 1u);
  return static_cast<uint8_t>(sign | ((r >> 20) - (120u << 3)));
}

float Fp8E4M3ToF32(uint8_t bits) {
  if ((bits & 0x7F) == 0x7F) return std::numeric_limits<float>::quiet_NaN();
  const int e = (bits >> 3) & 0xF;
  const int m = bits & 0x7;
  const float mag = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(static_cast<float>(8 + m), e - 10);
  return (bits & 0x80) ? -mag : mag;
}

std::string_view Fp8SchemeName(Fp8Scheme scheme) {
  switch (scheme) {
    case Fp8Scheme::kPerTensor: return "per_tensor";
    case Fp8Scheme::kPerChannel: return "per_channel";
    case Fp8Scheme::kBlock: return "block";
  }
  return "?";
}

Result<Fp8Scheme> Fp8SchemeFromName(std::string_view name) {
  for (Fp8Scheme s : {Fp8Scheme::kPerTensor, Fp8Scheme::kPerChannel, Fp8Scheme::kBlock}) {
    if (name == Fp8SchemeName(s)) return s;
  }
  return InvalidArgument(fmt::format("unknown fp8 scaling '{}' (per_tensor, per_channel or block)", name));
}

int64_t Fp8Layout::NumScales() const {
  switch (scheme) {
    case Fp8Scheme::kPerTensor: return 1;
    case Fp8Scheme::kPerChannel: return rows;
    case Fp8Scheme::kBlock:
      return block_rows > 0 && block_cols > 0 ? CeilDiv(rows, block_rows) * CeilDiv(cols, block_cols) : 0;
  }
  return 0;
}

Status Fp8Layout::Validate() const {
  if (rows < 0 || cols < 0) return InvalidArgument(fmt::format("fp8 layout {} × {}: negative size", rows, cols));
  if (cols > 0 && rows > std::numeric_limits<int64_t>::max() / cols) {
    return InvalidArgument(fmt::format("fp8 layout {} × {}: too many elements", rows, cols));
  }
  if (scheme == Fp8Scheme::kBlock && (block_rows <= 0 || block_cols <= 0)) {
    return InvalidArgument(fmt::format("fp8 block layout: block {} × {} must be positive", block_rows, block_cols));
  }
  return OkStatus();
}

float Fp8ScaleForAmax(Fp8Scheme scheme, float amax) {
  switch (scheme) {
    case Fp8Scheme::kPerTensor: return amax / kFp8E4M3Max;
    case Fp8Scheme::kPerChannel: return std::max(amax / kFp8E4M3Max, kFp8ChannelMinScale);
    case Fp8Scheme::kBlock: return std::max(amax, kFp8BlockMinAmax) * kFp8InvMax;
  }
  return 0.0f;
}

namespace internal {
uint8_t QuantizeOne(uint16_t bf16, float factor, bool divide) {
  const float x = F32FromBits(static_cast<uint32_t>(bf16) << 16);
  const float v = divide ? x / factor : x * factor;
  // fmin / fmax, not std::clamp: a NaN (0 * inf under a zero per-tensor scale) becomes 448 as in
  // vLLM's kernel (fminf returns the other operand).
  return Fp8E4M3FromF32(std::fmax(-kFp8E4M3Max, std::fmin(v, kFp8E4M3Max)));
}
}  // namespace internal

Status QuantizeBf16ToFp8(std::span<const uint16_t> bf16, const Fp8Layout& layout, std::span<uint8_t> q,
                         std::span<float> scales, std::string_view name, int threads) {
  return Quantize(PickIsa(), bf16, layout, q, scales, name, threads);
}

Status QuantizeBf16ToFp8Scalar(std::span<const uint16_t> bf16, const Fp8Layout& layout, std::span<uint8_t> q,
                               std::span<float> scales, std::string_view name) {
  return Quantize(Isa::kScalar, bf16, layout, q, scales, name, 1);
}

Status DequantizeFp8ToF32(std::span<const uint8_t> q, std::span<const float> scales, const Fp8Layout& l,
                          std::span<float> out) {
  RC_RETURN_IF_ERROR(l.Validate());
  const auto n = static_cast<uint64_t>(l.NumElements());
  if (q.size() != n || out.size() != n || scales.size() != static_cast<uint64_t>(l.NumScales())) {
    return InvalidArgument(fmt::format("dequantizing {} × {} ({}): got {} fp8, {} scales, {} outputs", l.rows, l.cols,
                                       Fp8SchemeName(l.scheme), q.size(), scales.size(), out.size()));
  }
  for (size_t i = 0; i < scales.size(); ++i) {
    if (!(std::isfinite(scales[i]) && scales[i] >= 0)) {
      return InvalidArgument(fmt::format("dequantizing: scale {} is {:g}, negative or not finite", i, scales[i]));
    }
  }
  const int64_t gc = l.scheme == Fp8Scheme::kBlock ? CeilDiv(l.cols, l.block_cols) : 1;
  for (int64_t r = 0; r < l.rows; ++r) {
    for (int64_t c = 0; c < l.cols; ++c) {
      int64_t g = 0;
      if (l.scheme == Fp8Scheme::kPerChannel) g = r;
      if (l.scheme == Fp8Scheme::kBlock) g = (r / l.block_rows) * gc + c / l.block_cols;
      const size_t i = static_cast<size_t>(r * l.cols + c);
      out[i] = Fp8E4M3ToF32(q[i]) * scales[static_cast<size_t>(g)];
    }
  }
  return OkStatus();
}

std::string_view Fp8QuantizeIsa() {
  switch (PickIsa()) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    case Isa::kScalar: break;
  }
  return "scalar";
}

}  // namespace rc::formats
