// The FP8 image digest (fp8_digest.h) over images made by formats/fp8.h's quantizer: split over TP
// boxes it sums to the whole, and each way an engine's FP8 weights can be wrong changes it.
#include "rolloutcore/refit/fp8_digest.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "rolloutcore/formats/fp8.h"
#include "rolloutcore/formats/safetensors.h"

namespace rc::refit {
namespace {

using formats::Fp8Layout;
using formats::Fp8Scheme;

struct Image {
  Fp8Layout layout;
  std::vector<uint8_t> q;
  std::vector<float> s;
  Shape grid;
};

std::vector<uint16_t> Weights(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<uint16_t> w(static_cast<size_t>(rows * cols));
  for (auto& b : w) b = formats::F32ToBF16(normal(rng));
  return w;
}

Image Quantize(const std::vector<uint16_t>& w, Fp8Layout l) {
  Image im{l, std::vector<uint8_t>(w.size()), std::vector<float>(static_cast<size_t>(l.NumScales())), {}};
  EXPECT_TRUE(formats::QuantizeBf16ToFp8(w, l, im.q, im.s, "w").ok());
  if (l.scheme == Fp8Scheme::kPerTensor) im.grid = {1, 1};
  if (l.scheme == Fp8Scheme::kPerChannel) im.grid = {l.rows, 1};
  if (l.scheme == Fp8Scheme::kBlock) {
    im.grid = {(l.rows + l.block_rows - 1) / l.block_rows, (l.cols + l.block_cols - 1) / l.block_cols};
  }
  return im;
}

Fp8ImageDigest Whole(const Image& im) {
  const Shape param{im.layout.rows, im.layout.cols};
  return Fp8ImagePart(param, FullBox(param), im.q.data(), im.grid, FullBox(im.grid), im.s.data());
}

TEST(Fp8DigestTest, TpRanksPartsSumToTheWholeImage) {
  const auto w = Weights(512, 384, 1);
  for (Fp8Scheme scheme : {Fp8Scheme::kPerTensor, Fp8Scheme::kPerChannel, Fp8Scheme::kBlock}) {
    const Image im = Quantize(w, Fp8Layout{scheme, 512, 384});
    const Shape param{512, 384};
    for (int tp : {2, 4}) {
      Fp8ImageDigest sum;
      const int64_t rows = 512 / tp;
      for (int r = 0; r < tp; ++r) {
        // Column-parallel: rank r holds rows [r * rows, (r + 1) * rows); its scale groups are its
        // rows (per channel), its block rows (block, 128-aligned), or, per tensor, the one scale,
        // owned by rank 0.
        const Box qb{{r * rows, 0}, {rows, 384}};
        Box sb{{0, 0}, {0, 1}};
        if (scheme == Fp8Scheme::kPerTensor && r == 0) sb = Box{{0, 0}, {1, 1}};
        if (scheme == Fp8Scheme::kPerChannel) sb = Box{{r * rows, 0}, {rows, 1}};
        if (scheme == Fp8Scheme::kBlock) sb = Box{{r * rows / 128, 0}, {rows / 128, 3}};
        const auto* q = im.q.data() + r * rows * 384;
        const auto* s = im.s.data() + (scheme == Fp8Scheme::kPerTensor ? 0 : sb.start[0] * im.grid[1]);
        sum += Fp8ImagePart(param, qb, q, im.grid, sb, s);
      }
      EXPECT_EQ(sum, Whole(im)) << formats::Fp8SchemeName(scheme) << " tp " << tp;
    }
  }
}

// The four ways issue 41 names, and a flipped byte, each change the digest.
TEST(Fp8DigestTest, WrongStaleSwizzledScalesAndAnotherVersionAreDetected) {
  const auto w1 = Weights(512, 384, 1);
  auto w2 = w1;
  for (size_t i = 0; i < w2.size(); i += 97) w2[i] = formats::F32ToBF16(formats::BF16ToF32(w2[i]) * 1.25f);
  for (Fp8Scheme scheme : {Fp8Scheme::kPerTensor, Fp8Scheme::kPerChannel, Fp8Scheme::kBlock}) {
    const Fp8Layout l{scheme, 512, 384};
    const Image v1 = Quantize(w1, l), v2 = Quantize(w2, l);
    const Fp8ImageDigest want = Whole(v2);
    ASSERT_NE(Whole(v1), want);
    // Wrong scale: one scale off by one ulp.
    Image wrong = v2;
    wrong.s[wrong.s.size() / 2] = std::nextafter(wrong.s[wrong.s.size() / 2], 1.0f);
    EXPECT_NE(Whole(wrong), want) << "wrong scale, " << formats::Fp8SchemeName(scheme);
    // Stale scales: version 2's bytes with version 1's scales.
    Image stale = v2;
    stale.s = v1.s;
    ASSERT_NE(stale.s, v2.s) << "version 2 must move some scale";
    EXPECT_NE(Whole(stale), want) << "stale scales, " << formats::Fp8SchemeName(scheme);
    // Another version's bytes under the right scales, and version 1 whole.
    Image old_bytes = v2;
    old_bytes.q = v1.q;
    EXPECT_NE(Whole(old_bytes), want) << "old bytes, " << formats::Fp8SchemeName(scheme);
    EXPECT_NE(Whole(v1).Combined(), want.Combined());
    // One flipped byte.
    Image flipped = v2;
    flipped.q[12345] ^= 0x01;
    EXPECT_NE(Whole(flipped), want) << "flipped byte, " << formats::Fp8SchemeName(scheme);
  }
  // Swizzled: the block grid (4 × 3) laid out column-major, as a kernel that wants the scales
  // transposed would hold them.
  const Fp8Layout bl{Fp8Scheme::kBlock, 512, 384};
  const Image v = Quantize(w1, bl);
  Image swizzled = v;
  for (int64_t i = 0; i < 4; ++i) {
    for (int64_t j = 0; j < 3; ++j) swizzled.s[static_cast<size_t>(j * 4 + i)] = v.s[static_cast<size_t>(i * 3 + j)];
  }
  ASSERT_NE(swizzled.s, v.s);
  EXPECT_NE(Whole(swizzled), Whole(v));
}

}  // namespace
}  // namespace rc::refit
