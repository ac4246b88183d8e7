// Tensor vocabulary of refit: element types, shapes, row-major strides, boxes, TensorSpec, and
// the element conversions a refit may declare (bf16 <-> f32, f16 <-> f32).
//
// A Shape is a list of non-negative extents; tensors are always row-major and dense. A Box is a
// rectangular region of a tensor in global element coordinates (start and extent per dim). All
// extents, offsets and strides are in elements; byte counts say "bytes" in their names.
//
// Thread safety: values and pure functions; nothing here has shared state.
// Invariants: a Shape accepted by ValidateShape has at most kMaxDims dims, every extent >= 0 and
// at most kMaxElements elements, so element and byte counts never overflow int64.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/status.h"

namespace rc::refit {

enum class DType : uint8_t {
  kF32,
  kBF16,
  kF16,
  kF8E4M3,
  kF8E5M2,
  kI8,
  kU8,
  kI32,
  kI64,
};
inline constexpr int kNumDTypes = 9;

// Bytes per element.
size_t DTypeSize(DType dtype);
// Canonical short name: f32, bf16, f16, f8_e4m3, f8_e5m2, i8, u8, i32, i64.
std::string_view DTypeName(DType dtype);
// Accepts the canonical names, torch names (float32, bfloat16, float16, half, float8_e4m3fn,
// float8_e5m2, int8, uint8, int32, int64) and safetensors names (F32, BF16, F8_E4M3, ...),
// case-insensitively. InvalidArgument naming the text otherwise.
[[nodiscard]] Result<DType> ParseDType(std::string_view text);

using Shape = std::vector<int64_t>;

inline constexpr size_t kMaxDims = 16;
// 2^50 elements: large enough for any real tensor, small enough that element * 8 bytes and sums
// of a few such values cannot overflow int64.
inline constexpr int64_t kMaxElements = int64_t{1} << 50;

// Product of extents (1 for a 0-d shape). Callers pass shapes that passed ValidateShape.
int64_t NumElements(const Shape& shape);
// Row-major element strides of a dense tensor of this shape.
Shape RowMajorStrides(const Shape& shape);
// InvalidArgument "WHAT: ..." when the shape has too many dims, a negative extent, or more than
// kMaxElements elements.
[[nodiscard]] Status ValidateShape(const Shape& shape, std::string_view what);
// "[4096, 1024]".
std::string ShapeToString(const Shape& shape);

// What a tensor is, without its bytes.
struct TensorSpec {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;

  int64_t numel() const { return NumElements(shape); }
  uint64_t bytes() const { return static_cast<uint64_t>(numel()) * DTypeSize(dtype); }
  friend bool operator==(const TensorSpec&, const TensorSpec&) = default;
};

// A rectangular region in global element coordinates.
struct Box {
  Shape start;
  Shape extent;

  size_t ndim() const { return start.size(); }
  int64_t numel() const { return NumElements(extent); }
  friend bool operator==(const Box&, const Box&) = default;
  friend bool operator<(const Box& a, const Box& b) {
    return a.start != b.start ? a.start < b.start : a.extent < b.extent;
  }
};

// The whole tensor as a box.
Box FullBox(const Shape& shape);
// Intersection of two boxes of equal rank; false when it is empty (any extent 0).
bool Intersect(const Box& a, const Box& b, Box* out);
// True when `inner` lies inside `outer`.
bool Contains(const Box& outer, const Box& inner);
// "[0:4, 8:16]" (half-open ranges per dim).
std::string BoxToString(const Box& box);

// ---- Element conversion -------------------------------------------------------------------------

// True when install may convert elements from `from` to `to`: identical dtypes, or one of the
// declared pairs bf16 -> f32, f16 -> f32, f32 -> bf16, f32 -> f16.
bool IsConversionSupported(DType from, DType to);
// OK when from == to, or when the conversion is declared and supported. Otherwise
// InvalidArgument naming the tensor and both dtypes.
[[nodiscard]] Status CheckConversion(std::string_view tensor, DType from, DType to, bool declared);

// Bit-exact helpers. Widening (bf16/f16 -> f32) is exact for every value including NaN
// payloads; narrowing rounds to nearest even and keeps NaN payload bits where they fit.
float Bf16BitsToF32(uint16_t bits);
uint16_t F32ToBf16Bits(float value);
float F16BitsToF32(uint16_t bits);
uint16_t F32ToF16Bits(float value);

// Converts n elements; strides are in elements of the respective dtype. The pair must satisfy
// IsConversionSupported (callers check; an unsupported pair copies nothing).
void ConvertElements(DType from, const void* src, int64_t src_stride, DType to, void* dst,
                     int64_t dst_stride, int64_t n);

// The element's bits, zero-extended to 64 bits.
uint64_t ElementBits(DType dtype, const void* element);

}  // namespace rc::refit
