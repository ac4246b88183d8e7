#include "rolloutcore/formats/fp8.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include <fmt/format.h>

#include "rolloutcore/base/parallel.h"

namespace rc::formats {
namespace {

uint32_t F32Bits(float f) { return std::bit_cast<uint32_t>(f); }
float F32FromBits(uint32_t u) { return std::bit_cast<float>(u); }

// bf16 magnitude bits at or above this are infinities or NaN.
constexpr uint16_t kBf16ExpMask = 0x7F80;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

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

Status CheckLayoutAndBox(const Fp8Layout& l, const Fp8Box& box, uint64_t data, std::string_view name) {
  RC_RETURN_IF_ERROR(l.Validate().WithContext(fmt::format("quantizing {}", name)));
  if (box.row0 < 0 || box.col0 < 0 || box.rows < 0 || box.cols < 0 || box.row0 + box.rows > l.rows ||
      box.col0 + box.cols > l.cols) {
    return InvalidArgument(fmt::format("quantizing {}: box rows [{}, {}) cols [{}, {}) is not inside {} × {}", name,
                                       box.row0, box.row0 + box.rows, box.col0, box.col0 + box.cols, l.rows, l.cols));
  }
  if (data != static_cast<uint64_t>(box.rows * box.cols)) {
    return InvalidArgument(fmt::format("quantizing {}: a {} × {} box needs {} elements, got {}", name, box.rows,
                                       box.cols, box.rows * box.cols, data));
  }
  return OkStatus();
}

// Work units over a box, each owning the groups it writes: per tensor, row chunks (one shared
// group, combined after); per channel, row chunks (a row is its group); block, the box's part of
// one block row (its groups are that block row's).
struct Band {
  int64_t r0, r1;  // global rows
};

std::vector<Band> BandsOf(const Fp8Layout& l, const Fp8Box& box) {
  std::vector<Band> bands;
  const int64_t end = box.row0 + box.rows;
  if (l.scheme == Fp8Scheme::kBlock) {
    for (int64_t r = box.row0; r < end; r = std::min(end, (r / l.block_rows + 1) * l.block_rows)) {
      bands.push_back({r, std::min(end, (r / l.block_rows + 1) * l.block_rows)});
    }
    return bands;
  }
  const int64_t n = std::min<int64_t>(box.rows, 64);
  for (int64_t i = 0; i < n; ++i) bands.push_back({box.row0 + box.rows * i / n, box.row0 + box.rows * (i + 1) / n});
  return bands;
}

// Calls f(global row, first global col, cols, group) for each run of the band's rows that shares a
// scale group, in row-major order.
template <typename F>
void ForEachRun(const Fp8Layout& l, const Fp8Box& box, const Band& band, F&& f) {
  for (int64_t r = band.r0; r < band.r1; ++r) {
    if (l.scheme != Fp8Scheme::kBlock) {
      f(r, box.col0, box.cols, l.GroupOf(r, box.col0));
      continue;
    }
    for (int64_t c = box.col0; c < box.col0 + box.cols;) {
      const int64_t next = std::min(box.col0 + box.cols, (c / l.block_cols + 1) * l.block_cols);
      f(r, c, next - c, l.GroupOf(r, c));
      c = next;
    }
  }
}

Status NonFiniteAt(uint16_t b, int64_t row, int64_t col, std::string_view name) {
  return InvalidArgument(fmt::format("{}[{}, {}] is {} (bf16 0x{:04x}): only finite weights can be quantized to fp8",
                                     name, row, col, (b & 0x7F) != 0 ? "NaN" : (b & 0x8000) ? "-inf" : "+inf", b));
}

Status BoxAmax(Isa isa, std::span<const uint16_t> bf16, const Fp8Layout& l, const Fp8Box& box,
               std::span<uint16_t> amax, std::string_view name, int threads) {
  RC_RETURN_IF_ERROR(CheckLayoutAndBox(l, box, bf16.size(), name));
  if (amax.size() != static_cast<uint64_t>(l.NumScales())) {
    return InvalidArgument(fmt::format("quantizing {}: {} scaling has {} groups, got {} amax entries", name,
                                       Fp8SchemeName(l.scheme), l.NumScales(), amax.size()));
  }
  const std::vector<Band> bands = BandsOf(l, box);
  // Per band: its maxima (per tensor: one; otherwise written straight into `amax`, whose groups
  // the band owns) and its first non-finite element, as a flat index into the box (or -1).
  std::vector<int32_t> band_max(bands.size(), 0);
  std::vector<int64_t> bad(bands.size(), -1);
  std::vector<int32_t> merged(amax.begin(), amax.end());
  ParallelFor(bands.size(), threads, [&](size_t i) {
    ForEachRun(l, box, bands[i], [&](int64_t r, int64_t c, int64_t n, int64_t g) {
      if (bad[i] >= 0) return;
      const uint16_t* x = bf16.data() + (r - box.row0) * box.cols + (c - box.col0);
      const int32_t m = AbsMaxBits(isa, x, n);
      if (m < 0) {
        for (int64_t j = 0; j < n; ++j) {
          if ((x[j] & kBf16ExpMask) == kBf16ExpMask) {
            bad[i] = (r - box.row0) * box.cols + (c - box.col0) + j;
            return;
          }
        }
      }
      if (l.scheme == Fp8Scheme::kPerTensor) {
        band_max[i] = std::max(band_max[i], m);
      } else {
        merged[static_cast<size_t>(g)] = std::max(merged[static_cast<size_t>(g)], m);
      }
    });
  });
  for (int64_t b : bad) {
    if (b >= 0) return NonFiniteAt(bf16[static_cast<size_t>(b)], box.row0 + b / box.cols, box.col0 + b % box.cols, name);
  }
  if (l.scheme == Fp8Scheme::kPerTensor) {
    for (int32_t m : band_max) merged[0] = std::max(merged[0], m);
  }
  for (size_t g = 0; g < amax.size(); ++g) amax[g] = static_cast<uint16_t>(merged[g]);
  return OkStatus();
}

Status QuantizeBox(Isa isa, std::span<const uint16_t> bf16, const Fp8Layout& l, const Fp8Box& box,
                   std::span<const float> scales, std::span<uint8_t> q, std::string_view name, int threads) {
  RC_RETURN_IF_ERROR(CheckLayoutAndBox(l, box, bf16.size(), name));
  if (q.size() != bf16.size() || scales.size() != static_cast<uint64_t>(l.NumScales())) {
    return InvalidArgument(fmt::format("quantizing {}: {} fp8 bytes for {} elements, {} scales for {} groups", name,
                                       q.size(), bf16.size(), scales.size(), l.NumScales()));
  }
  // Per channel divides by the scale (vLLM's _fp8_quant_per_channel); the others multiply by its
  // reciprocal (vLLM's static per-tensor kernel, per_block_cast_to_fp8). 1 / 0 = inf: see
  // Fp8ScaleForAmax.
  const bool divide = l.scheme == Fp8Scheme::kPerChannel;
  const std::vector<Band> bands = BandsOf(l, box);
  ParallelFor(bands.size(), threads, [&](size_t i) {
    ForEachRun(l, box, bands[i], [&](int64_t r, int64_t c, int64_t n, int64_t g) {
      const float s = scales[static_cast<size_t>(g)];
      const int64_t off = (r - box.row0) * box.cols + (c - box.col0);
      QuantizeRun(isa, bf16.data() + off, n, divide ? s : 1.0f / s, divide, q.data() + off);
    });
  });
  return OkStatus();
}

Status Quantize(Isa isa, std::span<const uint16_t> bf16, const Fp8Layout& l, std::span<uint8_t> q,
                std::span<float> scales, std::string_view name, int threads) {
  RC_RETURN_IF_ERROR(l.Validate().WithContext(fmt::format("quantizing {}", name)));
  if (scales.size() != static_cast<uint64_t>(l.NumScales())) {
    return InvalidArgument(fmt::format("quantizing {}: {} scaling needs {} scales, got {}", name,
                                       Fp8SchemeName(l.scheme), l.NumScales(), scales.size()));
  }
  if (q.size() != bf16.size()) {
    return InvalidArgument(fmt::format("quantizing {}: {} bf16 elements but {} fp8 bytes", name, bf16.size(), q.size()));
  }
  // Every group's amax before anything is written: a refused input leaves q and scales as they were.
  const Fp8Box all{0, 0, l.rows, l.cols};
  std::vector<uint16_t> amax(static_cast<size_t>(l.NumScales()), 0);
  RC_RETURN_IF_ERROR(BoxAmax(isa, bf16, l, all, amax, name, threads));
  std::vector<float> s(amax.size());
  Fp8ScalesFromAmax(l, amax, s);
  RC_RETURN_IF_ERROR(QuantizeBox(isa, bf16, l, all, s, q, name, threads));
  std::copy(s.begin(), s.end(), scales.begin());
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

std::string_view Fp8VllmQuantization(Fp8Scheme scheme) {
  switch (scheme) {
    case Fp8Scheme::kPerTensor: return "fp8_per_tensor";
    case Fp8Scheme::kPerChannel: return "fp8_per_channel";
    case Fp8Scheme::kBlock: return "fp8_per_block";
  }
  return "?";
}

Result<Fp8Scheme> Fp8SchemeFromVllmQuantization(std::string_view quantization) {
  for (Fp8Scheme s : {Fp8Scheme::kPerTensor, Fp8Scheme::kPerChannel, Fp8Scheme::kBlock}) {
    if (quantization == Fp8VllmQuantization(s)) return s;
  }
  return InvalidArgument(fmt::format("quantization '{}': expected one of fp8_per_tensor, fp8_per_channel, "
                                     "fp8_per_block (vLLM 0.33's online FP8 methods)",
                                     quantization));
}

std::array<int64_t, 2> Fp8Layout::ScaleGrid() const {
  switch (scheme) {
    case Fp8Scheme::kPerTensor: return {1, 1};
    case Fp8Scheme::kPerChannel: return {rows, 1};
    case Fp8Scheme::kBlock:
      if (block_rows <= 0 || block_cols <= 0) return {0, 0};
      return {CeilDiv(rows, block_rows), CeilDiv(cols, block_cols)};
  }
  return {0, 0};
}

int64_t Fp8Layout::NumScales() const {
  const auto g = ScaleGrid();
  return g[0] * g[1];
}

int64_t Fp8Layout::GroupOf(int64_t row, int64_t col) const {
  switch (scheme) {
    case Fp8Scheme::kPerTensor: return 0;
    case Fp8Scheme::kPerChannel: return row;
    case Fp8Scheme::kBlock: return (row / block_rows) * ScaleGrid()[1] + col / block_cols;
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
  for (int64_t r = 0; r < l.rows; ++r) {
    for (int64_t c = 0; c < l.cols; ++c) {
      const size_t i = static_cast<size_t>(r * l.cols + c);
      out[i] = Fp8E4M3ToF32(q[i]) * scales[static_cast<size_t>(l.GroupOf(r, c))];
    }
  }
  return OkStatus();
}

Status Fp8BoxAmax(std::span<const uint16_t> bf16, const Fp8Layout& layout, const Fp8Box& box,
                  std::span<uint16_t> amax, std::string_view name, int threads) {
  return BoxAmax(PickIsa(), bf16, layout, box, amax, name, threads);
}

void Fp8MergeAmax(std::span<const uint16_t> from, std::span<uint16_t> into) {
  for (size_t i = 0; i < std::min(from.size(), into.size()); ++i) into[i] = std::max(into[i], from[i]);
}

void Fp8ScalesFromAmax(const Fp8Layout& layout, std::span<const uint16_t> amax, std::span<float> scales) {
  for (size_t g = 0; g < std::min(amax.size(), scales.size()); ++g) {
    scales[g] = Fp8ScaleForAmax(layout.scheme, F32FromBits(static_cast<uint32_t>(amax[g]) << 16));
  }
}

Status QuantizeBf16BoxToFp8(std::span<const uint16_t> bf16, const Fp8Layout& layout, const Fp8Box& box,
                            std::span<const float> scales, std::span<uint8_t> q, std::string_view name, int threads) {
  return QuantizeBox(PickIsa(), bf16, layout, box, scales, q, name, threads);
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
