#include "engine/kernels.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

namespace rc::engine {
namespace {

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

}  // namespace
}  // namespace rc::engine
