#include "rolloutcore/refit/tensor.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>

namespace rc::refit {
namespace {

TEST(DTypeTest, NamesSizesAndParsing) {
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kF8E4M3), 1u);
  EXPECT_EQ(DTypeSize(DType::kI64), 8u);
  for (int i = 0; i < kNumDTypes; ++i) {
    const DType d = static_cast<DType>(i);
    auto parsed = ParseDType(DTypeName(d));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, d);
  }
  EXPECT_EQ(*ParseDType("bfloat16"), DType::kBF16);
  EXPECT_EQ(*ParseDType("BF16"), DType::kBF16);
  EXPECT_EQ(*ParseDType("float8_e4m3fn"), DType::kF8E4M3);
  EXPECT_EQ(*ParseDType("F8_E5M2"), DType::kF8E5M2);
  EXPECT_EQ(*ParseDType("torch.float16"), DType::kF16);
  auto bad = ParseDType("float128");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), ::testing::HasSubstr("float128"));
}

TEST(ShapeTest, StridesBoxesAndValidation) {
  EXPECT_EQ(RowMajorStrides({2, 3, 4}), (Shape{12, 4, 1}));
  EXPECT_EQ(NumElements({}), 1);
  EXPECT_EQ(NumElements({3, 0}), 0);
  EXPECT_TRUE(ValidateShape({4096, 151936}, "x").ok());
  EXPECT_EQ(ValidateShape({-1}, "t").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateShape({int64_t{1} << 30, int64_t{1} << 30}, "t").code(), StatusCode::kInvalidArgument);
  Box a{{0, 2}, {4, 4}}, b{{2, 0}, {4, 4}}, out;
  ASSERT_TRUE(Intersect(a, b, &out));
  EXPECT_EQ(out, (Box{{2, 2}, {2, 2}}));
  EXPECT_FALSE(Intersect(Box{{0}, {2}}, Box{{2}, {2}}, &out));
  EXPECT_EQ(BoxToString(out), "[2:2]");
  EXPECT_TRUE(Contains(FullBox({4, 6}), a));
  EXPECT_FALSE(Contains(FullBox({4, 5}), a));
}

TEST(ConversionTest, F16RoundTripsEveryValueExactly) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = F16BitsToF32(static_cast<uint16_t>(h));
    ASSERT_EQ(F32ToF16Bits(f), h) << "f16 bits " << h;
  }
}

TEST(ConversionTest, Bf16RoundTripsEveryNonSignalingValue) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = Bf16BitsToF32(static_cast<uint16_t>(b));
    EXPECT_EQ(std::bit_cast<uint32_t>(f), b << 16);
    const bool snan = std::isnan(f) && (b & 0x40) == 0;
    if (!snan) {
      ASSERT_EQ(F32ToBf16Bits(f), b) << "bf16 bits " << b;
    }
  }
}

TEST(ConversionTest, NarrowingRoundsToNearestEven) {
  EXPECT_EQ(F32ToBf16Bits(1.0f), 0x3f80);
  // 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125: ties to even (1.0).
  EXPECT_EQ(F32ToBf16Bits(1.00390625f), 0x3f80);
  EXPECT_EQ(F32ToBf16Bits(1.01171875f), 0x3f82);  // 1 + 3 * 2^-8 ties up to even
  EXPECT_EQ(F32ToF16Bits(65504.0f), 0x7bff);
  EXPECT_EQ(F32ToF16Bits(65520.0f), 0x7c00);  // rounds to infinity
  EXPECT_EQ(F32ToF16Bits(5.9604645e-08f), 0x0001);  // smallest subnormal
  EXPECT_EQ(F32ToF16Bits(-0.0f), 0x8000);
}

TEST(ConversionTest, ConvertElementsStrided) {
  const uint16_t src[4] = {F32ToBf16Bits(1.5f), 0, F32ToBf16Bits(-2.0f), 0};
  float dst[4] = {0, 0, 0, 0};
  ConvertElements(DType::kBF16, src, 2, DType::kF32, dst, 3, 2);
  EXPECT_EQ(dst[0], 1.5f);
  EXPECT_EQ(dst[3], -2.0f);
  EXPECT_TRUE(IsConversionSupported(DType::kF32, DType::kF16));
  EXPECT_FALSE(IsConversionSupported(DType::kBF16, DType::kF16));
  EXPECT_FALSE(IsConversionSupported(DType::kF8E4M3, DType::kF32));
  Status s = CheckConversion("model.x", DType::kBF16, DType::kF32, false);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), ::testing::HasSubstr("tensor model.x"));
  EXPECT_TRUE(CheckConversion("model.x", DType::kBF16, DType::kF32, true).ok());
}

}  // namespace
}  // namespace rc::refit
