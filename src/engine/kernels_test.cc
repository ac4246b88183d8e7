#include "engine/kernels.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <span>
#include <vector>

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
      EXPECT_EQ(Dot(x.data() + m * K, w.data() + n * K, K), big[m * N + n]);
    }
  }
}

TEST(KernelsTest, PortablePathEqualsAvx2Bitwise) {
  if (!KernelsUseAvx2()) GTEST_SKIP() << "no AVX2 on this CPU";
  const int64_t M = 4, K = 45, N = 9;
  auto x = Random(static_cast<size_t>(M * K), 5), w = Random(static_cast<size_t>(N * K), 6);
  std::vector<float> a(static_cast<size_t>(M * N)), b(static_cast<size_t>(M * N));
  internal::MatMulColumnsAvx2(x.data(), M, K, w.data(), 0, N, a.data(), N);
  internal::MatMulColumnsPortable(x.data(), M, K, w.data(), 0, N, b.data(), N);
  EXPECT_EQ(a, b);
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
          internal::MatMulColumnsAvx2(x.data(), M, K, w.widened.data(), 0, N, aa.data(), N);
          internal::MatMulColumnsAvx2(x.data(), M, K, w.bits.data(), 0, N, ab.data(), N);
          ASSERT_EQ(0, std::memcmp(aa.data(), ab.data(), aa.size() * 4)) << "avx2 " << M << "x" << K << "x" << N;
          ASSERT_EQ(0, std::memcmp(aa.data(), pb.data(), aa.size() * 4)) << "avx2 bf16 vs portable bf16";
        }
      }
    }
  }
}

// The AVX-512 row-pair kernel keeps the AVX2 lane order: bit for bit the portable path, for f32
// and bf16 weights, odd M (a padded pair), K with and without a lane tail (and K < 8: no block),
// N with column remainders, a column range that starts inside the matrix, and MatMulNT's
// dispatch (which packs x itself).
TEST(KernelsTest, Avx512RowPairsEqualThePortablePathBitwise) {
  if (!KernelsUseAvx512()) GTEST_SKIP() << "no AVX-512 (F, BW, DQ, VL) on this CPU";
  ThreadPool pool(2);
  for (int64_t K : {3, 8, 45, 64, 1027}) {
    for (int64_t N : {1, 5, 18, 131}) {
      for (int64_t M : {1, 2, 3, 4, 5, 6, 7, 9, 30, 31}) {
        auto x = Random(static_cast<size_t>(M * K), static_cast<uint32_t>(21 + K + M));
        Bf16Weights w = RandomBf16(static_cast<size_t>(N * K), static_cast<uint32_t>(22 + N));
        std::vector<float> xp(static_cast<size_t>((M + 1) / 2 * internal::PackedPairStride(K)));
        internal::PackRowPairs(x.data(), M, K, xp.data());
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

}  // namespace
}  // namespace rc::engine
