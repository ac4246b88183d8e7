// The FP8 image digest (fp8_digest.h) over images made by formats/fp8.h's quantizer: split over TP
// boxes it sums to the whole, and each way an engine's FP8 weights can be wrong changes it.
#include "rolloutcore/refit/fp8_digest.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "rolloutcore/formats/fp8.h"
#include "rolloutcore/formats/safetensors.h"
#include "rolloutcore/refit/manifest.h"

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

namespace rc::refit {
namespace {

// A manifest of one projection split over two ranks and a norm, with FP8 parts on the projection.
Manifest TwoRanks() {
  Manifest m;
  m.model = "m";
  m.version = "v";
  m.expected_ranks = 2;
  ShardTable o{"model.layers.0.self_attn.o_proj.weight", DType::kBF16, {8, 4}, {}};
  ShardInfo a{0, {0, 0}, {4, 4}, "local:a", 1};
  ShardInfo b{1, {4, 0}, {4, 4}, "local:b", 2};
  a.fp8["fp8_per_block"] = Fp8ImageDigest{10, 20};
  b.fp8["fp8_per_block"] = Fp8ImageDigest{1, 0};
  o.shards = {a, b};
  ShardTable norm{"model.norm.weight", DType::kBF16, {4}, {ShardInfo{0, {0}, {4}, "local:c", 3}}};
  m.tables = {norm, o};
  return m;
}

TEST(PublishedFp8ImageTest, PartsAddUpPerParameterAndSurviveJson) {
  const Manifest m = TwoRanks();
  EXPECT_EQ(PublishedFp8Quantizations(m), std::vector<std::string>{"fp8_per_block"});
  auto image = PublishedFp8Image(m, "fp8_per_block");
  ASSERT_TRUE(image.ok()) << image.status().ToString();
  ASSERT_EQ(image->size(), 1u);
  EXPECT_EQ(image->at("model.layers.0.self_attn.o_proj.weight"), (Fp8ImageDigest{11, 20}));
  auto none = PublishedFp8Image(m, "fp8_per_tensor");
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
  EXPECT_EQ(PublishedFp8Image(m, "fp8").status().code(), StatusCode::kInvalidArgument);
  auto back = ManifestFromJson(ManifestToJson(m));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->tables[1].shards[0].fp8.at("fp8_per_block"), (Fp8ImageDigest{10, 20}));
  EXPECT_TRUE(back->tables[0].shards[0].fp8.empty());
  Json bad = ManifestToJson(m);
  bad["tensors"][1]["shards"][0]["fp8"] = Json{{"fp8_per_block", Json{{"bytes", "000000000000000a"}}}};
  EXPECT_NE(ManifestFromJson(bad).status().message().find("scales"), std::string::npos);
  bad["tensors"][1]["shards"][0]["fp8"] = Json{{"int8", Json{{"bytes", "0"}, {"scales", "0"}}}};
  EXPECT_NE(ManifestFromJson(bad).status().message().find("'int8' is not an FP8 quantization"), std::string::npos)
      << ManifestFromJson(bad).status().ToString();
}

TEST(PublishedFp8ImageTest, APartMissingOrOnATensorServedInBf16IsRefusedByName) {
  Manifest m = TwoRanks();
  m.tables[1].shards[1].fp8.clear();
  auto missing = PublishedFp8Image(m, "fp8_per_block");
  ASSERT_EQ(missing.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("rank 1's shard [4:8, 0:4] carries no fp8_per_block part"),
            std::string::npos)
      << missing.status().ToString();
  m = TwoRanks();
  m.tables[0].shards[0].fp8["fp8_per_block"] = Fp8ImageDigest{1, 1};
  auto norm = PublishedFp8Image(m, "fp8_per_block");
  ASSERT_EQ(norm.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(norm.status().message().find("model.norm.weight"), std::string::npos) << norm.status().ToString();
}

TEST(Fp8ParametersTest, FusesInVllmOrderAndNamesWhatCannotFuse) {
  std::vector<TensorSpec> specs{{"l.0.self_attn.v_proj.weight", DType::kBF16, {2, 8}},
                                {"l.0.self_attn.q_proj.weight", DType::kBF16, {8, 8}},
                                {"l.0.self_attn.k_proj.weight", DType::kBF16, {2, 8}},
                                {"l.0.mlp.down_proj.weight", DType::kBF16, {8, 16}},
                                {"l.0.input_layernorm.weight", DType::kBF16, {8}}};
  auto p = Fp8Parameters(specs);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  ASSERT_EQ(p->size(), 2u);
  const Fp8Param& qkv = p->at("l.0.self_attn.qkv_proj.weight");
  EXPECT_EQ(qkv.shape, (Shape{12, 8}));
  ASSERT_EQ(qkv.parts.size(), 3u);
  EXPECT_EQ(qkv.parts[1].tensor, "l.0.self_attn.k_proj.weight");
  EXPECT_EQ(qkv.parts[1].row0, 8);
  EXPECT_EQ(qkv.parts[2].row0, 10);
  specs[0].shape = {2, 9};
  EXPECT_NE(Fp8Parameters(specs).status().message().find("columns"), std::string::npos);
  specs[0].shape = {2, 8};
  specs[3].dtype = DType::kF32;
  EXPECT_NE(Fp8Parameters(specs).status().message().find("down_proj"), std::string::npos);
  specs.erase(specs.begin());
  specs.pop_back();
  specs.pop_back();
  EXPECT_NE(Fp8Parameters(specs).status().message().find("v_proj is missing"), std::string::npos)
      << Fp8Parameters(specs).status().ToString();
}

// The projection a tensor feeds, matched by hand: a 100000-character name (a publish body) is an
// answer, not a stack overflow (std::regex recursed once per character).
TEST(Fp8ParametersTest, ParameterOfMatchesTheProjectionNamesAndSurvivesLongNames) {
  auto q = Fp8ParameterOf("model.layers.3.self_attn.q_proj.weight");
  ASSERT_TRUE(q.has_value());
  EXPECT_EQ(q->param, "model.layers.3.self_attn.qkv_proj.weight");
  EXPECT_EQ(q->part, "q");
  auto up = Fp8ParameterOf("model.layers.0.mlp.up_proj.weight");
  ASSERT_TRUE(up.has_value());
  EXPECT_EQ(up->param, "model.layers.0.mlp.gate_up_proj.weight");
  auto down = Fp8ParameterOf("m.mlp.down_proj.weight");
  ASSERT_TRUE(down.has_value());
  EXPECT_EQ(down->param, "m.mlp.down_proj.weight");
  EXPECT_EQ(down->part, "down");
  for (const char* no : {"model.layers.0.mlp.up_proj.bias", "mlp.up_proj.weight", "model.layers.0.attn.q_proj.weight",
                         "model.layers.0.self_attn.x_proj.weight", "_proj.weight", "model.norm.weight"}) {
    EXPECT_FALSE(Fp8ParameterOf(no).has_value()) << no;
  }
  const std::string long_name = std::string(100000, 'x') + ".self_attn.o_proj.weight";
  auto o = Fp8ParameterOf(long_name);
  ASSERT_TRUE(o.has_value());
  EXPECT_EQ(o->part, "o");
  EXPECT_FALSE(Fp8ParameterOf(std::string(100000, 'x')).has_value());
}

}  // namespace
}  // namespace rc::refit
