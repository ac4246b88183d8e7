#include "engine/kernels.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <span>
#include <thread>
#include <vector>

#include "rolloutcore/formats/fp8.h"

namespace rc::engine {
namespace {

// The bit patterns of floats: bitwise equality is what the bf16 tests assert (not value equality,
// which would also accept -0.0 == 0.0).
std::vector<uint32_t> Bits(std::span<const float> v) {
  std::vector<uint32_t> out;
  out.reserve(v.size());
  for (float f : v) out.push_back(std::bit_cast<uint32_t>(f));
  return out;
}

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> d(-1, 1);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

TEST(KernelsTest, MatMulMatchesReference) {
  ThreadPool pool(2);
  for (int64_t K : {1, 7, 8, 33, 64}) {
    const int64_t M = 5, N = 11;
    auto x = Random(static_cast<size_t>(M * K), 1), w = Random(static_cast<size_t>(N * K), 2);
    std::vector<float> y(static_cast<size_t>(M * N));
    MatMulNT(&pool, x.data(), M, K, w.data(), N, y.data());
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double ref = 0;
        for (int64_t k = 0; k < K; ++k) ref += static_cast<double>(x[m * K + k]) * w[n * K + k];
        EXPECT_NEAR(y[m * N + n], ref, 1e-4) << K;
      }
  }
}

TEST(KernelsTest, BatchAndThreadInvariantBitwise) {
  const int64_t M = 7, K = 77, N = 70;
  auto x = Random(static_cast<size_t>(M * K), 3), w = Random(static_cast<size_t>(N * K), 4);
  ThreadPool one(1), three(3);
  std::vector<float> big(static_cast<size_t>(M * N)), big3(static_cast<size_t>(M * N));
  MatMulNT(&one, x.data(), M, K, w.data(), N, big.data());
  MatMulNT(&three, x.data(), M, K, w.data(), N, big3.data());
  EXPECT_EQ(big, big3);
  for (int64_t m = 0; m < M; ++m) {
    std::vector<float> row(static_cast<size_t>(N));
    MatMulNT(&three, x.data() + m * K, 1, K, w.data(), N, row.data());
    for (int64_t n = 0; n < N; ++n) {
      EXPECT_EQ(row[n], big[m * N + n]);
      float alone;  // the element alone: one row, one column, the portable path
      internal::MatMulColumnsPortable(x.data() + m * K, 1, K, w.data() + n * K, 0, 1, &alone, 1);
      EXPECT_EQ(alone, big[m * N + n]);
    }
  }
}

// x packed for the AVX2 and AVX-512 kernels, as MatMulNT packs it.
std::vector<float> Packed(const std::vector<float>& x, int64_t M, int64_t K) {
  std::vector<float> xq(static_cast<size_t>(M * internal::PackedRowStride(K)));
  internal::PackEvenOdd(x.data(), M, K, xq.data());
  return xq;
}

TEST(KernelsTest, PortablePathEqualsAvx2Bitwise) {
  if (!KernelsUseAvx2()) GTEST_SKIP() << "no AVX2 on this CPU";
  for (int64_t K : {45, 64, 100}) {  // one chunk + a tail, two whole chunks, three + a tail
    const int64_t M = 5, N = 9;
    auto x = Random(static_cast<size_t>(M * K), 5), w = Random(static_cast<size_t>(N * K), 6);
    std::vector<float> a(static_cast<size_t>(M * N)), b(static_cast<size_t>(M * N));
    internal::MatMulColumnsAvx2(Packed(x, M, K).data(), x.data(), M, K, w.data(), 0, N, a.data(), N);
    internal::MatMulColumnsPortable(x.data(), M, K, w.data(), 0, N, b.data(), N);
    EXPECT_EQ(a, b) << K;
    for (int64_t n = 0; n < N; ++n) {
      EXPECT_EQ(internal::DotAvx2(x.data(), w.data() + n * K, K), internal::DotPortable(x.data(), w.data() + n * K, K));
    }
  }
}

// The order is the documented one (kernels.h), not merely the same on every path: an element
// computed by hand in that order equals the kernels' bit for bit, and summing the same products
// in plain k order gives other bits for these inputs (so the check can fail).
TEST(KernelsTest, MatMulFollowsTheDocumentedLaneOrder) {
  const int64_t K = 70;  // two whole chunks and a tail of 6
  auto x = Random(static_cast<size_t>(K), 31), w = Random(static_cast<size_t>(K), 32);
  float lanes[16] = {};
  for (int64_t c = 0; c + 32 <= K; c += 32) {
    for (int64_t l = 0; l < 16; ++l) {
      lanes[l] = std::fma(x[c + 2 * l], w[c + 2 * l], lanes[l]);
      lanes[l] = std::fma(x[c + 2 * l + 1], w[c + 2 * l + 1], lanes[l]);
    }
  }
  float want = (((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))) +
               (((lanes[8] + lanes[9]) + (lanes[10] + lanes[11])) + ((lanes[12] + lanes[13]) + (lanes[14] + lanes[15])));
  for (int64_t k = 64; k < K; ++k) want = std::fma(x[k], w[k], want);
  float plain = 0;
  for (int64_t k = 0; k < K; ++k) plain = std::fma(x[k], w[k], plain);
  ASSERT_NE(std::bit_cast<uint32_t>(want), std::bit_cast<uint32_t>(plain)) << "inputs that do not tell orders apart";
  ThreadPool pool(2);
  float got = 0;
  MatMulNT(&pool, x.data(), 1, K, w.data(), 1, &got);
  EXPECT_EQ(std::bit_cast<uint32_t>(want), std::bit_cast<uint32_t>(got));
  internal::MatMulColumnsPortable(x.data(), 1, K, w.data(), 0, 1, &got, 1);
  EXPECT_EQ(std::bit_cast<uint32_t>(want), std::bit_cast<uint32_t>(got));
}

// ThreadPool hands out pieces as threads come free: while one call is held up (its thread
// preempted), the other thread runs every remaining piece. A static split would have given the
// held call [0, 8), its whole half.
TEST(ThreadPoolTest, AHeldUpThreadLeavesItsRemainingPiecesToTheOthers) {
  ThreadPool pool(2);
  const int64_t n = 16;
  std::vector<std::atomic<int>> hits(n);
  std::atomic<int64_t> others{0};
  std::atomic<bool> held_saw_all{false};
  std::atomic<int64_t> held_size{0};
  pool.ParallelForRange(n, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) hits[static_cast<size_t>(i)].fetch_add(1);
    if (b == 0) {
      held_size = e - b;
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (others.load() < n - (e - b) && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
      held_saw_all = others.load() == n - (e - b);
    } else {
      others.fetch_add(e - b);
    }
  });
  EXPECT_LT(held_size.load(), n / 2) << "the held call was given a whole thread's share";
  EXPECT_TRUE(held_saw_all) << "the other thread did not take the held thread's remaining pieces";
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(hits[static_cast<size_t>(i)].load(), 1) << i;
}

TEST(KernelsTest, RmsNormAndRope) {
  std::vector<float> x = {1, 2, 3, 4}, w = {1, 1, 2, 2}, y(4);
  RmsNorm(x.data(), w.data(), 4, 0.f, y.data());
  const float inv = 1.0f / std::sqrt(7.5f);
  EXPECT_NEAR(y[0], inv, 1e-6);
  EXPECT_NEAR(y[3], 8 * inv, 1e-5);
  // Rope at position 0 is the identity; rotation preserves the norm.
  std::vector<float> v = {1, 2, 3, 4}, inv_freq = {1.0f, 0.01f};
  auto v0 = v;
  ApplyRope(v.data(), 1, 4, 0, inv_freq.data());
  EXPECT_EQ(v, v0);
  ApplyRope(v.data(), 1, 4, 3, inv_freq.data());
  EXPECT_NEAR(v[0] * v[0] + v[2] * v[2], 10.0, 1e-5);
  EXPECT_NEAR(v[0], std::cos(3.f) * 1 - std::sin(3.f) * 3, 1e-5);
}

// bf16 weights (random bits, all finite) and the same weights widened to f32.
struct Bf16Weights {
  std::vector<uint16_t> bits;
  std::vector<float> widened;
};
Bf16Weights RandomBf16(size_t n, uint32_t seed) {
  Bf16Weights w;
  for (float v : Random(n, seed)) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    w.bits.push_back(static_cast<uint16_t>(u >> 16));  // truncation: any finite bf16 will do
    const uint32_t back = static_cast<uint32_t>(w.bits.back()) << 16;
    float f;
    std::memcpy(&f, &back, 4);
    w.widened.push_back(f);
  }
  return w;
}

TEST(KernelsTest, Bf16WeightsGiveTheBitsOfTheWidenedF32Path) {
  ThreadPool pool(2);
  // Odd K (lane tail) and odd N (column tiles of 3, 2, 1), M covering the row tiles of 3, 2, 1.
  for (int64_t K : {1, 7, 9, 45, 77}) {
    for (int64_t N : {1, 3, 9, 70}) {
      for (int64_t M : {1, 2, 4, 7}) {
        auto x = Random(static_cast<size_t>(M * K), static_cast<uint32_t>(7 + K));
        Bf16Weights w = RandomBf16(static_cast<size_t>(N * K), static_cast<uint32_t>(8 + N));
        std::vector<float> f32(static_cast<size_t>(M * N)), bf16(static_cast<size_t>(M * N));
        MatMulNT(&pool, x.data(), M, K, w.widened.data(), N, f32.data());
        MatMulNT(&pool, x.data(), M, K, w.bits.data(), N, bf16.data());
        ASSERT_EQ(0, std::memcmp(f32.data(), bf16.data(), f32.size() * 4)) << M << "x" << K << "x" << N;
        // Both paths, column range by column range.
        std::vector<float> pa(f32.size()), pb(f32.size());
        internal::MatMulColumnsPortable(x.data(), M, K, w.widened.data(), 0, N, pa.data(), N);
        internal::MatMulColumnsPortable(x.data(), M, K, w.bits.data(), 0, N, pb.data(), N);
        ASSERT_EQ(0, std::memcmp(pa.data(), pb.data(), pa.size() * 4)) << "portable " << M << "x" << K << "x" << N;
        ASSERT_EQ(0, std::memcmp(pa.data(), f32.data(), pa.size() * 4)) << "portable vs dispatched";
        if (KernelsUseAvx2()) {
          std::vector<float> aa(f32.size()), ab(f32.size());
          const std::vector<float> xq = Packed(x, M, K);
          internal::MatMulColumnsAvx2(xq.data(), x.data(), M, K, w.widened.data(), 0, N, aa.data(), N);
          internal::MatMulColumnsAvx2(xq.data(), x.data(), M, K, w.bits.data(), 0, N, ab.data(), N);
          ASSERT_EQ(0, std::memcmp(aa.data(), ab.data(), aa.size() * 4)) << "avx2 " << M << "x" << K << "x" << N;
          ASSERT_EQ(0, std::memcmp(aa.data(), pb.data(), aa.size() * 4)) << "avx2 bf16 vs portable bf16";
        }
      }
    }
  }
}

// The AVX-512 kernel keeps the lane order: bit for bit the portable path, for f32 and bf16
// weights, every row-tile split (M 1..31: tiles of 5, 4, 3, 2, 1 rows), K with and without a tail
// (and K < 32: no whole chunk), N with column remainders, a column range that starts inside the
// matrix, and MatMulNT's dispatch (which packs x itself).
TEST(KernelsTest, Avx512EqualsThePortablePathBitwise) {
  if (!KernelsUseAvx512()) GTEST_SKIP() << "no AVX-512 (F, BW, DQ, VL) on this CPU";
  ThreadPool pool(2);
  for (int64_t K : {3, 8, 45, 64, 1027}) {
    for (int64_t N : {1, 5, 18, 131}) {
      for (int64_t M : {1, 2, 3, 4, 5, 6, 7, 9, 11, 16, 28, 30, 31}) {
        auto x = Random(static_cast<size_t>(M * K), static_cast<uint32_t>(21 + K + M));
        Bf16Weights w = RandomBf16(static_cast<size_t>(N * K), static_cast<uint32_t>(22 + N));
        const std::vector<float> xp = Packed(x, M, K);
        const int64_t n0 = N > 3 ? 2 : 0;  // a range that starts inside: the kernel indexes columns, not ranges
        std::vector<float> ref(static_cast<size_t>(M * N), -1.f), a(ref.size(), -1.f), b(ref.size(), -1.f);
        internal::MatMulColumnsPortable(x.data(), M, K, w.bits.data(), n0, N, ref.data(), N);
        internal::MatMulColumnsAvx512(xp.data(), x.data(), M, K, w.bits.data(), n0, N, a.data(), N);
        internal::MatMulColumnsAvx512(xp.data(), x.data(), M, K, w.widened.data(), n0, N, b.data(), N);
        ASSERT_EQ(0, std::memcmp(ref.data(), a.data(), ref.size() * 4)) << "bf16 " << M << "x" << K << "x" << N;
        ASSERT_EQ(0, std::memcmp(ref.data(), b.data(), ref.size() * 4)) << "f32 " << M << "x" << K << "x" << N;
        std::vector<float> d(ref.size());
        MatMulNT(&pool, x.data(), M, K, w.bits.data(), N, d.data());
        std::vector<float> full(ref.size());
        internal::MatMulColumnsPortable(x.data(), M, K, w.bits.data(), 0, N, full.data(), N);
        ASSERT_EQ(0, std::memcmp(full.data(), d.data(), d.size() * 4)) << "MatMulNT " << M << "x" << K << "x" << N;
      }
    }
  }
}

TEST(KernelsTest, Bf16NormEmbeddingAndBiasEqualTheWidenedF32) {
  const int64_t dim = 37;
  auto x = Random(dim, 11);
  Bf16Weights w = RandomBf16(dim, 12);
  std::vector<float> a(dim), b(dim);
  RmsNorm(x.data(), w.widened.data(), dim, 1e-6f, a.data());
  RmsNorm(x.data(), w.bits.data(), dim, 1e-6f, b.data());
  EXPECT_EQ(Bits(a), Bits(b));
  WidenRow(WeightRef(w.bits.data()).Row(1, 5), 5, a.data());
  EXPECT_EQ(Bits(std::span<const float>(a).first(5)), Bits(std::span<const float>(w.widened).subspan(5, 5)));
  WidenRow(WeightRef(w.widened.data()).Row(2, 5), 5, a.data());
  EXPECT_EQ(Bits(std::span<const float>(a).first(5)), Bits(std::span<const float>(w.widened).subspan(10, 5)));
  std::vector<float> c = x, d = x;
  AddRow(w.widened.data(), dim, c.data());
  AddRow(w.bits.data(), dim, d.data());
  EXPECT_EQ(Bits(c), Bits(d));
  EXPECT_NE(Bits(c), Bits(x));
  EXPECT_EQ(WeightRef(w.bits.data()).At(3), w.widened[3]);
}

// ---- FP8 (E4M3FN) weights -------------------------------------------------------------------

// Every E4M3FN code but the NaN ones (0x7F, 0xFF): ±0, the subnormals 0x01..0x07 (k * 2^-9) and
// their negatives, the normals up to ±448 (0x7E, 0xFE).
std::vector<uint8_t> Fp8Codes() {
  std::vector<uint8_t> codes;
  for (int b = 0; b < 256; ++b) {
    if (b != 0x7F && b != 0xFF) codes.push_back(static_cast<uint8_t>(b));
  }
  return codes;
}

// Scales worth testing: the smallest per-channel scale vLLM gives (1 / 229376), a tiny one, a
// large one, and ordinary ones whose products round.
const std::vector<float> kFp8TestScales = {1e-6f, 1.0f / 229376.0f, 1e3f, 0.1f, 3.7e-3f, 1.0f, 0.02317f};

// Scale number i of a per-row or block layout: the test scales in turn, each round of them times
// another factor, so no two scales of a matrix (up to 7 * 4096) are equal and reading a
// neighbour's scale shows.
float MixedScale(int64_t i, uint32_t seed) {
  const int64_t n = static_cast<int64_t>(kFp8TestScales.size());
  const int64_t round = (i + seed) / n;  // integral on purpose: the factor changes once per round
  return kFp8TestScales[static_cast<size_t>((i + seed) % n)] * (1.0f + static_cast<float>(round) / 4096.0f);
}

// An fp8 [N, K] matrix in WeightRef's per-row form and the same matrix dequantized element by
// element with the formats module's decoder: fl32(Fp8E4M3ToF32(b) * s).
struct Fp8Matrix {
  std::vector<uint8_t> q;
  std::vector<float> scales;
  int64_t scale_cols = 1, scale_block_cols = 0;
  std::vector<float> dequantized;
  WeightRef Ref() const { return WeightRef::Fp8(q.data(), scales.data(), scale_cols, scale_block_cols); }
};

enum class Fp8ScaleLayout { kPerTensor, kPerRow, kBlock128 };

// Every code appears once N * K >= 254 (each code is used as evenly as the size allows, then the
// bytes are shuffled). `tensor_scale`: the per-tensor layout's one scale.
Fp8Matrix RandomFp8(int64_t N, int64_t K, Fp8ScaleLayout layout, float tensor_scale, uint32_t seed) {
  Fp8Matrix m;
  const std::vector<uint8_t> codes = Fp8Codes();
  std::mt19937 g(seed);
  m.q.resize(static_cast<size_t>(N * K));
  for (size_t i = 0; i < m.q.size(); ++i) m.q[i] = codes[(i + seed) % codes.size()];
  std::shuffle(m.q.begin(), m.q.end(), g);
  switch (layout) {
    case Fp8ScaleLayout::kPerTensor:
      m.scale_cols = 1;
      m.scale_block_cols = K;
      m.scales.assign(static_cast<size_t>(N), tensor_scale);  // the one scale, expanded per row
      break;
    case Fp8ScaleLayout::kPerRow:
      m.scale_cols = 1;
      m.scale_block_cols = K;
      for (int64_t n = 0; n < N; ++n) m.scales.push_back(MixedScale(n, seed));
      break;
    case Fp8ScaleLayout::kBlock128:
      m.scale_cols = (K + 127) / 128;
      m.scale_block_cols = 128;
      for (int64_t i = 0; i < N * m.scale_cols; ++i) m.scales.push_back(MixedScale(i, seed));
      break;
  }
  m.dequantized.resize(m.q.size());
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k) {
      const float s =
          m.scales[static_cast<size_t>(n * m.scale_cols + (m.scale_cols == 1 ? 0 : k / m.scale_block_cols))];
      const float v = formats::Fp8E4M3ToF32(m.q[static_cast<size_t>(n * K + k)]);
      m.dequantized[static_cast<size_t>(n * K + k)] = v * s;
    }
  }
  return m;
}

bool HasEveryFp8Code(const std::vector<uint8_t>& q) {
  std::vector<bool> seen(256);
  for (uint8_t b : q) seen[b] = true;
  for (uint8_t b : Fp8Codes()) {
    if (!seen[b]) return false;
  }
  return true;
}

const char* LayoutName(Fp8ScaleLayout l) {
  static const char* const kNames[] = {"per-tensor", "per-row", "block-128"};
  return kNames[static_cast<int>(l)];
}

// The contract (kernels.h): MatMulNT over fp8 weights is bitwise MatMulNT over the f32 matrix
// dequantized element by element, on every path this CPU has (portable, AVX2, AVX-512, each
// called directly, and MatMulNT's dispatch with 1 and 3 threads), whole chunks and a tail, every
// scale layout, every non-NaN code, tiny and large scales.
TEST(KernelsTest, Fp8WeightsGiveTheBitsOfTheDequantizedF32Path) {
  ThreadPool one(1), three(3);
  // N = 131: 9 column groups of 16 for the pool (the last of 3 columns) and column-tile
  // remainders; at K = 1000 even M = 1 is big enough for MatMulNT to use the threads.
  const int64_t N = 131;
  int checked = 0;
  for (Fp8ScaleLayout layout : {Fp8ScaleLayout::kPerTensor, Fp8ScaleLayout::kPerRow, Fp8ScaleLayout::kBlock128}) {
    // The per-tensor layout runs once per test scale; the others mix the scales over rows / blocks.
    const std::vector<float> tensor_scales =
        layout == Fp8ScaleLayout::kPerTensor ? kFp8TestScales : std::vector<float>{0.f};
    for (float tensor_scale : tensor_scales) {
      for (int64_t K : {32, 64, 96 + 7, 1000}) {
        const Fp8Matrix w =
            RandomFp8(N, K, layout, tensor_scale, static_cast<uint32_t>(K + 7 * static_cast<int64_t>(layout)));
        ASSERT_TRUE(HasEveryFp8Code(w.q)) << K;
        for (int64_t M : {1, 3, 17}) {
          SCOPED_TRACE(testing::Message()
                       << LayoutName(layout) << " scale " << tensor_scale << " M " << M << " K " << K);
          const auto x = Random(static_cast<size_t>(M * K), static_cast<uint32_t>(M * 1000 + K));
          const size_t size = static_cast<size_t>(M * N);
          std::vector<float> want(size, -1.f), got(size, -2.f);
          MatMulNT(&one, x.data(), M, K, w.dequantized.data(), N, want.data());
          MatMulNT(&one, x.data(), M, K, w.Ref(), N, got.data());
          ASSERT_EQ(Bits(want), Bits(got)) << "MatMulNT, 1 thread";
          std::fill(got.begin(), got.end(), -2.f);
          MatMulNT(&three, x.data(), M, K, w.Ref(), N, got.data());
          ASSERT_EQ(Bits(want), Bits(got)) << "MatMulNT, 3 threads";
          // Each path directly, over all columns and over a range that starts inside the matrix
          // (the kernels find a column's scales by its index, not by its place in the range).
          for (int64_t n0 : {int64_t{0}, int64_t{2}}) {
            SCOPED_TRACE(testing::Message() << "columns from " << n0);
            std::vector<float> ref(size, -1.f), a(size, -1.f);
            internal::MatMulColumnsPortable(x.data(), M, K, w.dequantized.data(), n0, N, ref.data(), N);
            internal::MatMulColumnsPortable(x.data(), M, K, w.q.data(), w.scales.data(), w.scale_cols,
                                            w.scale_block_cols, n0, N, a.data(), N);
            ASSERT_EQ(Bits(ref), Bits(a)) << "portable";
            if (n0 == 0) {
              ASSERT_EQ(Bits(want), Bits(a)) << "portable vs MatMulNT";
            }
            const std::vector<float> xq = Packed(x, M, K);
            if (KernelsUseAvx2()) {
              std::vector<float> f(size, -1.f), b(size, -1.f);
              internal::MatMulColumnsAvx2(xq.data(), x.data(), M, K, w.dequantized.data(), n0, N, f.data(), N);
              internal::MatMulColumnsAvx2(xq.data(), x.data(), M, K, w.q.data(), w.scales.data(), w.scale_cols,
                                          w.scale_block_cols, n0, N, b.data(), N);
              ASSERT_EQ(Bits(f), Bits(b)) << "avx2";
              ASSERT_EQ(Bits(ref), Bits(b)) << "avx2 vs portable";
            }
            if (KernelsUseAvx512()) {
              std::vector<float> f(size, -1.f), b(size, -1.f);
              internal::MatMulColumnsAvx512(xq.data(), x.data(), M, K, w.dequantized.data(), n0, N, f.data(), N);
              internal::MatMulColumnsAvx512(xq.data(), x.data(), M, K, w.q.data(), w.scales.data(), w.scale_cols,
                                            w.scale_block_cols, n0, N, b.data(), N);
              ASSERT_EQ(Bits(f), Bits(b)) << "avx512";
              ASSERT_EQ(Bits(ref), Bits(b)) << "avx512 vs portable";
            }
          }
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, (7 + 1 + 1) * 4 * 3);
  if (!KernelsUseAvx2()) std::printf("note: no AVX2 on this CPU; only the portable path was checked\n");
  if (!KernelsUseAvx512()) std::printf("note: no AVX-512 on this CPU; its path was not checked\n");
}

// Each code on its own, in every position of a chunk and of the tail, on every path: with x one-hot
// at k the output is the dequantized weight at k itself (plus zeros), so a widening that got one
// code, one lane or one half wrong shows here by value, not only through a sum.
TEST(KernelsTest, Fp8EveryCodeDequantizesExactlyInEveryLane) {
  const int64_t K = 35;  // one whole chunk and a tail of 3
  for (float scale : {1.0f, 1e3f, 1.0f / 229376.0f}) {
    for (uint8_t b : Fp8Codes()) {
      const std::vector<uint8_t> q(static_cast<size_t>(K), b);
      const float want = formats::Fp8E4M3ToF32(b) * scale;
      for (int64_t p : {0, 1, 2, 15, 16, 17, 30, 31, 32, 34}) {
        std::vector<float> x(static_cast<size_t>(K), 0.f);
        x[static_cast<size_t>(p)] = 1.f;
        const std::vector<float> xq = Packed(x, 1, K);
        float y = -7.f;
        internal::MatMulColumnsPortable(x.data(), 1, K, q.data(), &scale, 1, K, 0, 1, &y, 1);
        ASSERT_EQ(want, y) << "portable, code " << int{b} << " at k " << p;
        if (KernelsUseAvx2()) {
          y = -7.f;
          internal::MatMulColumnsAvx2(xq.data(), x.data(), 1, K, q.data(), &scale, 1, K, 0, 1, &y, 1);
          ASSERT_EQ(want, y) << "avx2, code " << int{b} << " at k " << p;
        }
        if (KernelsUseAvx512()) {
          y = -7.f;
          internal::MatMulColumnsAvx512(xq.data(), x.data(), 1, K, q.data(), &scale, 1, K, 0, 1, &y, 1);
          ASSERT_EQ(want, y) << "avx512, code " << int{b} << " at k " << p;
        }
      }
    }
  }
}

// Row() advances the bytes by row * cols and the scales by row * scale_cols; At(k) of a row view
// is element (row, k) of the matrix, bit for bit the dequantized value; the row-wise helpers
// (embedding row, bias, norm weight) read fp8 the same way.
TEST(KernelsTest, Fp8RowAndAt) {
  const int64_t N = 5, K = 300;  // three 128-column scale blocks, the last one partial
  const Fp8Matrix w = RandomFp8(N, K, Fp8ScaleLayout::kBlock128, 0.f, 41);
  ASSERT_TRUE(HasEveryFp8Code(w.q));
  ASSERT_EQ(w.scale_cols, 3);
  const WeightRef ref = w.Ref();
  EXPECT_EQ(ref.type, WeightType::kFP8);
  for (int64_t n = 0; n < N; ++n) {
    const WeightRef row = ref.Row(n, K);
    EXPECT_EQ(row.type, WeightType::kFP8);
    EXPECT_EQ(row.data, w.q.data() + n * K);
    EXPECT_EQ(row.scales, w.scales.data() + n * w.scale_cols);
    EXPECT_EQ(row.scale_cols, w.scale_cols);
    EXPECT_EQ(row.scale_block_cols, w.scale_block_cols);
    for (int64_t k = 0; k < K; ++k) {
      ASSERT_EQ(std::bit_cast<uint32_t>(row.At(k)), std::bit_cast<uint32_t>(w.dequantized[n * K + k])) << n << "," << k;
    }
    std::vector<float> a(static_cast<size_t>(K));
    WidenRow(row, K, a.data());
    EXPECT_EQ(Bits(a), Bits(std::span<const float>(w.dequantized).subspan(static_cast<size_t>(n * K), K)));
  }
  // Element i of the unsliced view is row 0's.
  EXPECT_EQ(std::bit_cast<uint32_t>(ref.At(200)), std::bit_cast<uint32_t>(w.dequantized[200]));
  // Per-row scales (scale_cols 1): the row's one scale for every k.
  const Fp8Matrix pr = RandomFp8(N, K, Fp8ScaleLayout::kPerRow, 0.f, 42);
  EXPECT_EQ(std::bit_cast<uint32_t>(pr.Ref().Row(3, K).At(299)), std::bit_cast<uint32_t>(pr.dequantized[3 * K + 299]));
  // Bias and norm weight over an fp8 row: the dequantized f32 row's bits.
  auto x = Random(static_cast<size_t>(K), 43);
  const std::span<const float> row2(w.dequantized.data() + 2 * K, static_cast<size_t>(K));
  std::vector<float> c = x, d = x;
  AddRow(row2.data(), K, c.data());
  AddRow(ref.Row(2, K), K, d.data());
  EXPECT_EQ(Bits(c), Bits(d));
  std::vector<float> e(static_cast<size_t>(K)), f(static_cast<size_t>(K));
  RmsNorm(x.data(), row2.data(), K, 1e-6f, e.data());
  RmsNorm(x.data(), ref.Row(2, K), K, 1e-6f, f.data());
  EXPECT_EQ(Bits(e), Bits(f));
}

// Scale blocks that split a chunk would give one chunk two scales: MatMulNT refuses them.
TEST(KernelsDeathTest, Fp8ScaleBlocksMustBeWholeChunks) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the pool has threads
  const int64_t K = 96, N = 2;
  const std::vector<uint8_t> q(static_cast<size_t>(N * K), 0x38);
  const std::vector<float> scales(static_cast<size_t>(N * 2), 1.f), x(static_cast<size_t>(K), 1.f);
  std::vector<float> y(static_cast<size_t>(N));
  ThreadPool pool(2);
  EXPECT_DEATH(MatMulNT(&pool, x.data(), 1, K, WeightRef::Fp8(q.data(), scales.data(), 2, 48), N, y.data()),
               "scale_block_cols 48");
  // Blocks of 32 that do not cover the row (2 * 32 < 96).
  EXPECT_DEATH(MatMulNT(&pool, x.data(), 1, K, WeightRef::Fp8(q.data(), scales.data(), 2, 32), N, y.data()),
               "scale_cols 2, scale_block_cols 32, K 96");
}

}  // namespace
}  // namespace rc::engine
