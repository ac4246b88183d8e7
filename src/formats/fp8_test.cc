#include "rolloutcore/formats/fp8.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "rolloutcore/formats/safetensors.h"

namespace rc::formats {
namespace {

float FromBits(uint32_t u) { return std::bit_cast<float>(u); }
uint32_t Bits(float f) { return std::bit_cast<uint32_t>(f); }

// The definition, by search: the finite E4M3FN value nearest to clamp(x, -448, 448), ties to the
// code with an even last bit (round to nearest even), the sign kept (so -0.0 -> 0x80).
uint8_t NearestE4M3(float x) {
  const double a = std::min(std::fabs(static_cast<double>(x)), 448.0);
  int best = 0;
  double best_d = std::numeric_limits<double>::infinity();
  for (int code = 0; code <= 0x7E; ++code) {
    const double d = std::fabs(a - static_cast<double>(Fp8E4M3ToF32(static_cast<uint8_t>(code))));
    if (d < best_d || (d == best_d && (code & 1) == 0)) {
      best = code;
      best_d = d;
    }
  }
  return static_cast<uint8_t>(best | (std::signbit(x) ? 0x80 : 0));
}

TEST(Fp8Test, DecodesTheCodesTheFormatDefines) {
  EXPECT_EQ(Fp8E4M3ToF32(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(Fp8E4M3ToF32(0x80)));
  EXPECT_EQ(Fp8E4M3ToF32(0x01), std::ldexp(1.0f, -9));   // smallest subnormal
  EXPECT_EQ(Fp8E4M3ToF32(0x07), 7 * std::ldexp(1.0f, -9));
  EXPECT_EQ(Fp8E4M3ToF32(0x08), std::ldexp(1.0f, -6));   // smallest normal
  EXPECT_EQ(Fp8E4M3ToF32(0x38), 1.0f);
  EXPECT_EQ(Fp8E4M3ToF32(0x7E), 448.0f);                  // largest finite
  EXPECT_EQ(Fp8E4M3ToF32(0xFE), -448.0f);
  EXPECT_TRUE(std::isnan(Fp8E4M3ToF32(0x7F)));
  EXPECT_TRUE(std::isnan(Fp8E4M3ToF32(0xFF)));
  EXPECT_EQ(Fp8E4M3ToF32(0x78), 256.0f);                  // 0x78..0x7E: no infinity in E4M3FN
}

TEST(Fp8Test, EveryFiniteCodeRoundTrips) {
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7F) == 0x7F) continue;
    EXPECT_EQ(Fp8E4M3FromF32(Fp8E4M3ToF32(static_cast<uint8_t>(code))), code) << code;
  }
  EXPECT_EQ(Fp8E4M3FromF32(std::numeric_limits<float>::quiet_NaN()), 0x7F);
}

TEST(Fp8Test, RoundingMatchesTheNearestValueSearch) {
  std::vector<float> xs;
  // Every bf16 value that is finite (subnormals, ±max and all in between), as is and scaled into
  // the E4M3 range as a quantizer would.
  for (uint32_t b = 0; b < 0x10000; ++b) {
    if ((b & 0x7F80) == 0x7F80) continue;
    const float x = FromBits(b << 16);
    xs.push_back(x);
    xs.push_back(x * 0x1p-120f);
    xs.push_back(x * 0x1p-100f);
  }
  // Every midpoint between neighbouring codes (the ties), and one f32 ulp either side of it.
  for (int code = 0; code < 0x7E; ++code) {
    const float mid = (Fp8E4M3ToF32(static_cast<uint8_t>(code)) + Fp8E4M3ToF32(static_cast<uint8_t>(code + 1))) / 2;
    for (float m : {mid, -mid}) {
      xs.push_back(m);
      xs.push_back(std::nextafter(m, 0.0f));
      xs.push_back(std::nextafter(m, m * 2));
    }
  }
  // Saturation: past 448, the midpoint 464 to the next (absent) code 480, infinities.
  for (float x : {448.0f, 449.0f, 463.9f, 464.0f, 465.0f, 480.0f, 1e30f, std::numeric_limits<float>::infinity()}) {
    xs.push_back(x);
    xs.push_back(-x);
  }
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> any;
  for (int i = 0; i < 200000; ++i) {
    const float x = FromBits(any(rng));
    if (std::isfinite(x)) xs.push_back(x);
  }
  int mismatches = 0;
  for (float x : xs) {
    const uint8_t want = NearestE4M3(x);
    const uint8_t got = Fp8E4M3FromF32(x);
    if (got != want && ++mismatches <= 10) {
      ADD_FAILURE() << "x = " << x << " (0x" << std::hex << Bits(x) << "): got 0x" << int{got} << ", want 0x"
                    << int{want};
    }
  }
  EXPECT_EQ(mismatches, 0) << "of " << xs.size();
}

// Weights drawn to hit the edges: ordinary values, bf16 subnormals, ±bf16 max, zeros, exact
// powers of two and values that land on E4M3 ties after scaling.
std::vector<uint16_t> EdgeWeights(size_t n, uint32_t seed, bool with_extremes) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::uniform_int_distribution<int> kind(0, 19);
  std::uniform_int_distribution<uint32_t> sub(1, 0x7F);
  std::vector<uint16_t> w(n);
  for (auto& b : w) {
    switch (kind(rng)) {
      case 0: b = 0; break;
      case 1: b = 0x8000; break;
      case 2: b = static_cast<uint16_t>(sub(rng) | (rng() & 1 ? 0x8000 : 0)); break;  // bf16 subnormal
      case 3: b = with_extremes ? (rng() & 1 ? 0x7F7F : 0xFF7F) : 0x3C00; break;       // ±bf16 max
      case 4: b = F32ToBF16(std::ldexp(1.0f, static_cast<int>(rng() % 20) - 15)); break;
      default: b = F32ToBF16(normal(rng));
    }
  }
  return w;
}

struct Case {
  Fp8Scheme scheme;
  int64_t rows, cols, br, bc;
};

std::vector<Case> Cases() {
  return {{Fp8Scheme::kPerTensor, 1, 1, 0, 0},      {Fp8Scheme::kPerTensor, 3, 37, 0, 0},
          {Fp8Scheme::kPerTensor, 130, 257, 0, 0},  {Fp8Scheme::kPerChannel, 7, 65, 0, 0},
          {Fp8Scheme::kPerChannel, 64, 128, 0, 0},  {Fp8Scheme::kBlock, 256, 384, 128, 128},
          {Fp8Scheme::kBlock, 200, 130, 128, 128},  {Fp8Scheme::kBlock, 33, 47, 16, 8},
          {Fp8Scheme::kBlock, 1, 1000, 128, 128}};
}

Fp8Layout LayoutOf(const Case& c) {
  Fp8Layout l;
  l.scheme = c.scheme;
  l.rows = c.rows;
  l.cols = c.cols;
  if (c.br > 0) {
    l.block_rows = c.br;
    l.block_cols = c.bc;
  }
  return l;
}

TEST(Fp8Test, QuantizerFollowsTheScaleRuleElementByElement) {
  for (const Case& c : Cases()) {
    const Fp8Layout l = LayoutOf(c);
    const auto w = EdgeWeights(static_cast<size_t>(l.NumElements()), 11, false);
    std::vector<uint8_t> q(w.size());
    std::vector<float> s(static_cast<size_t>(l.NumScales()));
    ASSERT_TRUE(QuantizeBf16ToFp8Scalar(w, l, q, s, "w").ok());
    // Recompute each element from its group's amax by the rule written in fp8.h.
    const int64_t gc = c.scheme == Fp8Scheme::kBlock ? (l.cols + l.block_cols - 1) / l.block_cols : 1;
    std::vector<float> amax(s.size(), 0.0f);
    auto group = [&](int64_t r, int64_t col) -> size_t {
      if (c.scheme == Fp8Scheme::kPerChannel) return static_cast<size_t>(r);
      if (c.scheme == Fp8Scheme::kBlock) return static_cast<size_t>((r / l.block_rows) * gc + col / l.block_cols);
      return 0;
    };
    for (int64_t r = 0; r < l.rows; ++r) {
      for (int64_t col = 0; col < l.cols; ++col) {
        float& a = amax[group(r, col)];
        a = std::max(a, std::fabs(BF16ToF32(w[static_cast<size_t>(r * l.cols + col)])));
      }
    }
    for (size_t g = 0; g < s.size(); ++g) {
      // docs/fp8.md's table, written out again here.
      float want = 0;
      if (c.scheme == Fp8Scheme::kPerTensor) want = amax[g] / 448.0f;
      if (c.scheme == Fp8Scheme::kPerChannel) want = std::max(amax[g] / 448.0f, 1.0f / 229376.0f);
      if (c.scheme == Fp8Scheme::kBlock) want = std::max(amax[g], 1e-4f) * (1.0f / 448.0f);
      ASSERT_EQ(Bits(s[g]), Bits(want)) << "scale " << g << " of " << Fp8SchemeName(c.scheme);
    }
    for (int64_t r = 0; r < l.rows; ++r) {
      for (int64_t col = 0; col < l.cols; ++col) {
        const size_t i = static_cast<size_t>(r * l.cols + col);
        const float sg = s[group(r, col)];
        const float x = BF16ToF32(w[i]);
        const float v = c.scheme == Fp8Scheme::kPerChannel ? x / sg : x * (1.0f / sg);
        ASSERT_EQ(q[i], NearestE4M3(std::fmax(-448.0f, std::fmin(v, 448.0f))))
            << Fp8SchemeName(c.scheme) << " [" << r << ", " << col << "]";
      }
    }
  }
}

TEST(Fp8Test, VectorLoopsGiveTheScalarBits) {
  for (bool extremes : {false, true}) {
    for (const Case& c : Cases()) {
      const Fp8Layout l = LayoutOf(c);
      const auto w = EdgeWeights(static_cast<size_t>(l.NumElements()), 23 + static_cast<uint32_t>(c.cols), extremes);
      std::vector<uint8_t> q0(w.size()), q1(w.size(), 0xAA), q2(w.size(), 0x55);
      std::vector<float> s0(static_cast<size_t>(l.NumScales())), s1(s0.size()), s2(s0.size());
      ASSERT_TRUE(QuantizeBf16ToFp8Scalar(w, l, q0, s0, "w").ok());
      ASSERT_TRUE(QuantizeBf16ToFp8(w, l, q1, s1, "w", 1).ok());
      ASSERT_TRUE(QuantizeBf16ToFp8(w, l, q2, s2, "w", 3).ok());
      EXPECT_EQ(q1, q0) << Fp8QuantizeIsa() << " " << Fp8SchemeName(c.scheme) << " " << c.rows << "x" << c.cols;
      EXPECT_EQ(q2, q0) << "threaded";
      EXPECT_EQ(s1, s0);
      EXPECT_EQ(s2, s0);
    }
  }
}

// Each vector loop on its own (the dispatcher runs only the widest this CPU has).
TEST(Fp8Test, EachInstructionSetMatchesTheScalarLoop) {
  const auto w = EdgeWeights(4099, 5, true);
  std::vector<uint8_t> want(w.size());
  const float inf = std::numeric_limits<float>::infinity();
  for (const auto& [factor, divide] : std::vector<std::pair<float, bool>>{
           {1.0f, false}, {448.0f / 3.39e38f, false}, {448.0f / 0.0625f, false}, {448.0f / 1e-4f, false},
           {3.7f, false}, {inf, false}, {0.0625f / 448.0f, true}, {1.0f / 229376.0f, true}, {3.7f, true}}) {
    for (size_t i = 0; i < w.size(); ++i) {
      const float x = BF16ToF32(w[i]);
      want[i] = NearestE4M3(std::fmax(-448.0f, std::fmin(divide ? x / factor : x * factor, 448.0f)));
      ASSERT_EQ(internal::QuantizeOne(w[i], factor, divide), want[i]) << "scalar, i " << i;
    }
    struct Isa {
      const char* name;
      bool present;
      int64_t (*run)(const uint16_t*, int64_t, float, bool, uint8_t*);
    };
    for (const Isa& isa : {Isa{"avx2", internal::CpuHasAvx2(), internal::QuantizeRunAvx2},
                           Isa{"avx512", internal::CpuHasAvx512(), internal::QuantizeRunAvx512}}) {
      if (!isa.present) continue;
      std::vector<uint8_t> got(w.size(), 0xAA);
      const int64_t done = isa.run(w.data(), static_cast<int64_t>(w.size()), factor, divide, got.data());
      ASSERT_GT(done, 4000) << isa.name;
      for (int64_t i = 0; i < done; ++i) {
        ASSERT_EQ(got[static_cast<size_t>(i)], want[static_cast<size_t>(i)])
            << isa.name << " factor " << factor << (divide ? " (divide)" : "") << " i " << i;
      }
    }
  }
  auto scalar_max = [&](size_t n) {
    int32_t m = 0;
    for (size_t i = 0; i < n; ++i) m = std::max<int32_t>(m, w[i] & 0x7FFF);
    return m;
  };
  for (size_t n : {size_t{0}, size_t{5}, size_t{31}, size_t{32}, size_t{4099}}) {
    if (internal::CpuHasAvx2()) {
      EXPECT_EQ(internal::AbsMaxBitsAvx2(w.data(), static_cast<int64_t>(n)), scalar_max(n));
    }
    if (internal::CpuHasAvx512()) {
      EXPECT_EQ(internal::AbsMaxBitsAvx512(w.data(), static_cast<int64_t>(n)), scalar_max(n));
    }
  }
  std::vector<uint16_t> bad(100, 0x3F80);
  for (size_t pos : {size_t{0}, size_t{40}, size_t{99}}) {
    for (uint16_t b : {uint16_t{0x7F80}, uint16_t{0xFF80}, uint16_t{0x7FC1}}) {
      bad[pos] = b;
      if (internal::CpuHasAvx2()) {
        EXPECT_EQ(internal::AbsMaxBitsAvx2(bad.data(), 100), -1) << pos;
      }
      if (internal::CpuHasAvx512()) {
        EXPECT_EQ(internal::AbsMaxBitsAvx512(bad.data(), 100), -1) << pos;
      }
      bad[pos] = 0x3F80;
    }
  }
}

TEST(Fp8Test, NonFiniteWeightsAreRefusedNamingTheElementAndNothingIsWritten) {
  for (Fp8Scheme scheme : {Fp8Scheme::kPerTensor, Fp8Scheme::kPerChannel, Fp8Scheme::kBlock}) {
    for (uint16_t b : {uint16_t{0x7FC0}, uint16_t{0x7F80}, uint16_t{0xFF80}}) {
      Fp8Layout l{scheme, 40, 300, 16, 128};
      auto w = EdgeWeights(static_cast<size_t>(l.NumElements()), 3, false);
      w[static_cast<size_t>(37 * 300 + 259)] = b;
      std::vector<uint8_t> q(w.size(), 0xAB);
      std::vector<float> s(static_cast<size_t>(l.NumScales()), -2.0f);
      const Status st = QuantizeBf16ToFp8(w, l, q, s, "model.layers.3.mlp.up_proj.weight", 2);
      ASSERT_FALSE(st.ok());
      EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
      EXPECT_NE(st.message().find("model.layers.3.mlp.up_proj.weight[37, 259]"), std::string::npos) << st.ToString();
      EXPECT_NE(st.message().find(b == 0x7FC0 ? "NaN" : b == 0x7F80 ? "+inf" : "-inf"), std::string::npos);
      EXPECT_EQ(q, std::vector<uint8_t>(w.size(), 0xAB));
      EXPECT_EQ(s, std::vector<float>(s.size(), -2.0f));
    }
  }
}

TEST(Fp8Test, ZeroAndTinyGroupsFollowVllm) {
  // All zeros per tensor: scale 0, and 0 * (1 / 0) is NaN, which the clamp turns into 448: every
  // byte 0x7E, as vLLM's static kernel writes it (it dequantizes to zeros: 448 * 0).
  Fp8Layout l{Fp8Scheme::kPerTensor, 4, 33};
  std::vector<uint16_t> zeros(132, 0);
  zeros[7] = 0x8000;  // -0 too
  std::vector<uint8_t> q(132, 1);
  std::vector<float> s(1, -1.0f);
  ASSERT_TRUE(QuantizeBf16ToFp8(zeros, l, q, s, "z").ok());
  EXPECT_EQ(Bits(s[0]), 0u);
  EXPECT_EQ(q, std::vector<uint8_t>(132, 0x7E));
  std::vector<float> d(132, -1.0f);
  ASSERT_TRUE(DequantizeFp8ToF32(q, s, l, d).ok());
  EXPECT_EQ(d, std::vector<float>(132, 0.0f));
  // Per channel: a zero row takes the smallest scale 1 / 229376 and quantizes to zeros.
  Fp8Layout c{Fp8Scheme::kPerChannel, 4, 33};
  std::vector<float> sc(4);
  ASSERT_TRUE(QuantizeBf16ToFp8(zeros, c, q, sc, "z").ok());
  for (float x : sc) EXPECT_EQ(Bits(x), Bits(1.0f / 229376.0f));
  EXPECT_EQ(q[7], 0x80);  // -0 stays -0
  q[7] = 0;
  EXPECT_EQ(q, std::vector<uint8_t>(132, 0));
  // A block of zeros takes the 1e-4 floor: 1e-4 * (1 / 448).
  Fp8Layout b{Fp8Scheme::kBlock, 4, 33, 2, 16};
  std::vector<float> sb(static_cast<size_t>(b.NumScales()));
  ASSERT_TRUE(QuantizeBf16ToFp8(zeros, b, q, sb, "z").ok());
  for (float x : sb) EXPECT_EQ(Bits(x), Bits(1e-4f * (1.0f / 448.0f)));
  // A per-tensor amax so small that its scale is subnormal and the reciprocal overflows: the
  // element itself saturates to 448, the zeros become 448 (NaN), as in vLLM's kernel.
  std::vector<uint16_t> tiny(132, 0);
  tiny[5] = 0x0001;  // the smallest bf16 subnormal
  tiny[6] = 0x8001;
  ASSERT_TRUE(QuantizeBf16ToFp8(tiny, l, q, s, "tiny").ok());
  EXPECT_EQ(Bits(s[0]), Bits(BF16ToF32(0x0001) / 448.0f));
  EXPECT_EQ(q[5], 0x7E);
  EXPECT_EQ(q[6], 0xFE);
  EXPECT_EQ(q[0], 0x7E);
}

TEST(Fp8Test, DequantizedWeightsAreWithinHalfAStepOfTheOriginal) {
  for (const Case& c : Cases()) {
    const Fp8Layout l = LayoutOf(c);
    const auto w = EdgeWeights(static_cast<size_t>(l.NumElements()), 99, false);
    std::vector<uint8_t> q(w.size());
    std::vector<float> s(static_cast<size_t>(l.NumScales())), d(w.size());
    ASSERT_TRUE(QuantizeBf16ToFp8(w, l, q, s, "w").ok());
    ASSERT_TRUE(DequantizeFp8ToF32(q, s, l, d).ok());
    const int64_t gc = c.scheme == Fp8Scheme::kBlock ? (l.cols + l.block_cols - 1) / l.block_cols : 1;
    for (int64_t r = 0; r < l.rows; ++r) {
      for (int64_t col = 0; col < l.cols; ++col) {
        const size_t i = static_cast<size_t>(r * l.cols + col);
        const size_t g = c.scheme == Fp8Scheme::kPerChannel ? static_cast<size_t>(r)
                         : c.scheme == Fp8Scheme::kBlock
                             ? static_cast<size_t>((r / l.block_rows) * gc + col / l.block_cols)
                             : 0;
        const float x = BF16ToF32(w[i]);
        // 3 mantissa bits: half a step is 2^-4 of the value, or half the subnormal step 2^-9.
        const float bound = std::fabs(x) * 0x1p-4f + s[g] * 0x1p-10f;
        ASSERT_LE(std::fabs(d[i] - x), bound * 1.0001f) << "[" << r << ", " << col << "] x " << x << " s " << s[g];
      }
    }
  }
}

// A matrix cut into uneven boxes (as TP / FSDP shards cut it): per-box amaxes merged in any order,
// the scales from them, each box quantized on its own: the bytes and scales of the whole.
TEST(Fp8Test, ShardedBoxesGiveTheBytesOfTheWholeMatrix) {
  for (const Case& c : Cases()) {
    const Fp8Layout l = LayoutOf(c);
    const auto w = EdgeWeights(static_cast<size_t>(l.NumElements()), 41 + static_cast<uint32_t>(c.rows), false);
    std::vector<uint8_t> whole_q(w.size());
    std::vector<float> whole_s(static_cast<size_t>(l.NumScales()));
    ASSERT_TRUE(QuantizeBf16ToFp8(w, l, whole_q, whole_s, "w").ok());
    const std::vector<int64_t> row_cuts{0, l.rows / 3, l.rows / 3 + (l.rows > 1 ? 1 : 0), l.rows};
    const std::vector<int64_t> col_cuts{0, l.cols / 2 + 1 < l.cols ? l.cols / 2 + 1 : l.cols, l.cols};
    std::vector<Fp8Box> boxes;
    for (size_t i = 0; i + 1 < row_cuts.size(); ++i) {
      for (size_t j = 0; j + 1 < col_cuts.size(); ++j) {
        boxes.push_back({row_cuts[i], col_cuts[j], row_cuts[i + 1] - row_cuts[i], col_cuts[j + 1] - col_cuts[j]});
      }
    }
    auto box_data = [&](const Fp8Box& b) {
      std::vector<uint16_t> d;
      for (int64_t r = b.row0; r < b.row0 + b.rows; ++r) {
        for (int64_t col = b.col0; col < b.col0 + b.cols; ++col) d.push_back(w[static_cast<size_t>(r * l.cols + col)]);
      }
      return d;
    };
    // Each holder's amax on its own, merged in reverse order.
    std::vector<std::vector<uint16_t>> partial;
    for (const Fp8Box& b : boxes) {
      partial.emplace_back(static_cast<size_t>(l.NumScales()), 0);
      ASSERT_TRUE(Fp8BoxAmax(box_data(b), l, b, partial.back(), "w", 2).ok());
    }
    std::vector<uint16_t> amax(static_cast<size_t>(l.NumScales()), 0);
    for (auto it = partial.rbegin(); it != partial.rend(); ++it) Fp8MergeAmax(*it, amax);
    std::vector<float> scales(amax.size());
    Fp8ScalesFromAmax(l, amax, scales);
    ASSERT_EQ(std::memcmp(scales.data(), whole_s.data(), scales.size() * 4), 0) << Fp8SchemeName(c.scheme);
    std::vector<uint8_t> assembled(w.size(), 0xAA);
    for (const Fp8Box& b : boxes) {
      const auto d = box_data(b);
      std::vector<uint8_t> bq(d.size());
      ASSERT_TRUE(QuantizeBf16BoxToFp8(d, l, b, scales, bq, "w", 2).ok());
      for (int64_t r = 0; r < b.rows; ++r) {
        for (int64_t col = 0; col < b.cols; ++col) {
          assembled[static_cast<size_t>((b.row0 + r) * l.cols + b.col0 + col)] = bq[static_cast<size_t>(r * b.cols + col)];
        }
      }
    }
    EXPECT_EQ(assembled, whole_q) << Fp8SchemeName(c.scheme) << " " << c.rows << "x" << c.cols;
  }
  // A box names the bad element by its place in the whole matrix, and a box outside is refused.
  const Fp8Layout l{Fp8Scheme::kBlock, 40, 300, 16, 128};
  std::vector<uint16_t> box(200, 0x3F80);  // 10 rows × 20 cols
  box[3 * 20 + 7] = 0x7FC0;
  std::vector<uint16_t> amax(static_cast<size_t>(l.NumScales()), 5);
  const Status st = Fp8BoxAmax(box, l, Fp8Box{30, 250, 10, 20}, amax, "w");
  EXPECT_NE(st.message().find("w[33, 257] is NaN"), std::string::npos) << st.ToString();
  EXPECT_EQ(amax, std::vector<uint16_t>(amax.size(), 5));
  EXPECT_EQ(Fp8BoxAmax(box, l, Fp8Box{35, 250, 10, 20}, amax, "w").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Fp8BoxAmax(box, l, Fp8Box{30, 250, 10, 21}, amax, "w").code(), StatusCode::kInvalidArgument);
}

TEST(Fp8Test, BadLayoutsAndSizesAreRefused) {
  std::vector<uint16_t> w(12);
  std::vector<uint8_t> q(12);
  std::vector<float> s(1);
  EXPECT_EQ(QuantizeBf16ToFp8(w, Fp8Layout{Fp8Scheme::kPerTensor, 3, 5}, q, s, "w").code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(QuantizeBf16ToFp8(w, Fp8Layout{Fp8Scheme::kPerChannel, 3, 4}, q, s, "w").code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(QuantizeBf16ToFp8(w, Fp8Layout{Fp8Scheme::kBlock, 3, 4, 0, 4}, q, s, "w").code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(QuantizeBf16ToFp8(w, Fp8Layout{Fp8Scheme::kPerTensor, -3, -4}, q, s, "w").code(),
            StatusCode::kInvalidArgument);
  std::vector<float> d(12);
  std::vector<float> bad_scale{-1.0f};
  EXPECT_EQ(DequantizeFp8ToF32(q, bad_scale, Fp8Layout{Fp8Scheme::kPerTensor, 3, 4}, d).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(*Fp8SchemeFromName("block"), Fp8Scheme::kBlock);
  EXPECT_FALSE(Fp8SchemeFromName("per_block").ok());
}

}  // namespace
}  // namespace rc::formats
