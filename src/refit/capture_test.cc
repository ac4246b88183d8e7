#include "rolloutcore/refit/capture.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>

namespace rc::refit {
namespace {

using ::testing::HasSubstr;

TEST(SourceViewTest, NarrowTransposeSelectRecordBoxAndOrder) {
  SourceView v("w", DType::kF32, {8, 6, 4});
  SourceView n = v.Narrow(0, 2, 4).Narrow(-1, 1, 2).Transpose(0, 2);
  ASSERT_TRUE(n.supported()) << n.unsupported_reason();
  EXPECT_EQ(n.box(), (Box{{2, 0, 1}, {4, 6, 2}}));
  EXPECT_EQ(n.view_to_source(), (std::vector<int32_t>{2, 1, 0}));
  EXPECT_EQ(n.shape(), (Shape{2, 6, 4}));
  SourceView s = n.Select(1, 5);
  EXPECT_EQ(s.box(), (Box{{2, 5, 1}, {4, 1, 2}}));
  EXPECT_EQ(s.shape(), (Shape{2, 4}));
  EXPECT_EQ(s.numel(), 8);
}

TEST(SourceViewTest, ChunkMatchesTorchChunk) {
  SourceView v("w", DType::kF32, {10, 2});
  auto pieces = v.Chunk(4, 0);  // torch.chunk(10 rows, 4) -> 3, 3, 3, 1
  ASSERT_EQ(pieces.size(), 4u);
  EXPECT_EQ(pieces[3].box(), (Box{{9, 0}, {1, 2}}));
  auto six = SourceView("w", DType::kF32, {6}).Chunk(4, 0);  // 2, 2, 2
  EXPECT_EQ(six.size(), 3u);
  EXPECT_FALSE(v.ChunkAt(4, 0, 4).supported());
  auto rows = v.Unbind(0);
  ASSERT_EQ(rows.size(), 10u);
  EXPECT_EQ(rows[7].box(), (Box{{7, 0}, {1, 2}}));
  EXPECT_EQ(rows[7].shape(), (Shape{2}));
}

TEST(SourceViewTest, UnsqueezeSqueezeAndUnitReshapeCancel) {
  SourceView v("w", DType::kF32, {4, 3});
  SourceView u = v.Unsqueeze(1).Unsqueeze(0);
  EXPECT_EQ(u.shape(), (Shape{1, 4, 1, 3}));
  SourceView back = u.Squeeze(2).Squeeze(0);
  EXPECT_EQ(back.shape(), (Shape{4, 3}));
  EXPECT_EQ(back.view_to_source(), v.view_to_source());
  EXPECT_EQ(v.Reshape({1, 4, 3, 1}).shape(), (Shape{1, 4, 3, 1}));
  EXPECT_EQ(v.Reshape({-1, 3}).shape(), (Shape{4, 3}));
  EXPECT_EQ(v.Squeeze(0).shape(), (Shape{4, 3}));  // size 4: no-op, as in PyTorch
  EXPECT_TRUE(v.Contiguous().supported());
  EXPECT_TRUE(v.Transpose(0, 1).Transpose(0, 1).Contiguous().supported());
}

TEST(SourceViewTest, UnsupportedOperationsCarryReasonsAndStick) {
  SourceView v("w", DType::kF32, {4, 6});
  EXPECT_THAT(v.Reshape({24}).unsupported_reason(), HasSubstr("merges dimensions"));
  EXPECT_THAT(v.Reshape({2, 2, 6}).unsupported_reason(), HasSubstr("splits dimensions"));
  EXPECT_THAT(v.Reshape({5, 5}).unsupported_reason(), HasSubstr("24 elements"));
  EXPECT_THAT(v.Transpose(0, 1).Contiguous().unsupported_reason(), HasSubstr("materializes a copy"));
  EXPECT_THAT(v.IndexSelect(0, {1, 3}).unsupported_reason(), HasSubstr("integer-index collapse"));
  EXPECT_THAT(v.Slice(1, 0, 6, 2).unsupported_reason(), HasSubstr("step 2"));
  EXPECT_THAT(v.Narrow(0, 2, 3).unsupported_reason(), HasSubstr("out of range"));
  EXPECT_THAT(v.Narrow(5, 0, 1).unsupported_reason(), HasSubstr("dim 5 out of range"));
  EXPECT_THAT(v.Permute({0, 0}).unsupported_reason(), HasSubstr("not a permutation"));
  SourceView bad = v.Arithmetic("add");
  EXPECT_THAT(bad.unsupported_reason(), HasSubstr("arithmetic 'add'"));
  EXPECT_EQ(bad.Narrow(0, 0, 1).Transpose(0, 1).unsupported_reason(), bad.unsupported_reason());
}

TEST(SourceViewTest, SliceClampsLikePython) {
  SourceView v("w", DType::kF32, {10});
  EXPECT_EQ(v.Slice(0, -3, 100).box(), (Box{{7}, {3}}));
  EXPECT_EQ(v.Slice(0, 5, 2).box(), (Box{{5}, {0}}));
}

TEST(CaptureContextTest, RecordsCopiesAndRejectsBadRegions) {
  CaptureContext ctx({{"w", DType::kBF16, {4, 6}}}, {{"p", DType::kF32, {6, 4}}});
  auto v = ctx.Source("w");
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(ctx.Source("nope").status().code(), StatusCode::kNotFound);
  Status s = ctx.CopyInto(*v, DestRegion::Whole("p", {6, 4}));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("tensor w -> p: view shape [4, 6] does not match destination shape [6, 4]"));
  s = ctx.CopyInto(v->Transpose(0, 1), DestRegion{"p", 1, {6, 4}, {4, 1}, true});
  EXPECT_THAT(s.message(), HasSubstr("reaches element 24"));
  s = ctx.CopyInto(v->Transpose(0, 1), DestRegion::Whole("q", {6, 4}));
  EXPECT_THAT(s.message(), HasSubstr("destination parameter q is unknown"));
  ASSERT_TRUE(ctx.CopyInto(v->Transpose(0, 1), DestRegion::Whole("p", {6, 4}, true)).ok());
  ASSERT_TRUE(ctx.CopyInto(v->Reshape({24}), DestRegion::Whole("p", {24})).ok());  // recorded as unsupported
  const Capture& c = ctx.capture();
  ASSERT_EQ(c.copies.size(), 1u);
  EXPECT_EQ(c.copies[0].view_to_source, (std::vector<int32_t>{1, 0}));
  EXPECT_TRUE(c.copies[0].convert);
  ASSERT_EQ(c.unsupported.size(), 1u);
  EXPECT_EQ(c.unsupported[0].source, "w");
  EXPECT_THAT(c.unsupported[0].reason, HasSubstr("merges"));
}

TEST(MaterializeContextTest, ResolvesViewsConvertsAndChecksCoverage) {
  // w: bf16 [2, 3] holding 0..5.
  uint16_t w[6];
  for (int i = 0; i < 6; ++i) w[i] = F32ToBf16Bits(static_cast<float>(i));
  auto lookup = [&](std::string_view name) -> Result<HostTensor> {
    if (name != "w") return NotFound("no");
    return HostTensor{DType::kBF16, {2, 3}, std::as_bytes(std::span(w))};
  };
  float out[6] = {-1, -1, -1, -1, -1, -1};
  DestinationBuffers bufs{{"p", std::as_writable_bytes(std::span(out))}};
  MaterializeContext ctx(lookup, {{"p", DType::kF32, {3, 2}}}, bufs);
  auto v = ctx.Source("w");
  ASSERT_TRUE(v.ok());
  EXPECT_THAT(ctx.CopyInto(v->Transpose(0, 1), DestRegion::Whole("p", {3, 2}, false)).message(),
              HasSubstr("no conversion was declared"));
  ASSERT_TRUE(ctx.CopyInto(v->Transpose(0, 1).Narrow(0, 0, 2), DestRegion::Rows("p", {3, 2}, 0, 2, true)).ok());
  EXPECT_THAT(ctx.CheckCoverage().message(), HasSubstr("destination p: elements 4..6 (rows 2..3) never written"));
  ASSERT_TRUE(ctx.CopyInto(v->Transpose(0, 1).Narrow(0, 2, 1), DestRegion::Rows("p", {3, 2}, 2, 1, true)).ok());
  EXPECT_TRUE(ctx.CheckCoverage().ok());
  const float want[6] = {0, 3, 1, 4, 2, 5};
  EXPECT_EQ(std::memcmp(out, want, sizeof out), 0);
  EXPECT_EQ(ctx.CopyInto(v->Arithmetic("mul"), DestRegion::Whole("p", {2, 3})).code(), StatusCode::kUnimplemented);
}

TEST(CoverageTest, SelfOverlappingStridesAreRejected) {
  CaptureContext ctx({{"w", DType::kF32, {2, 4}}}, {{"p", DType::kF32, {8}}});
  auto v = ctx.Source("w");
  ASSERT_TRUE(v.ok());
  ASSERT_TRUE(ctx.CopyInto(*v, DestRegion{"p", 0, {2, 4}, {2, 1}}).ok());
  Status s = CheckDestinationCoverage(ctx.capture());
  EXPECT_THAT(s.message(), HasSubstr("destination p: elements 2..4 written more than once"));
  EXPECT_EQ(CheckDestinationCoverage(ctx.capture(), 1).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rc::refit
