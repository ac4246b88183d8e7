#include "refit/digest_simd.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "rolloutcore/refit/digest.h"

namespace rc::refit::internal {
namespace {

// The definition, written out independently of the kernels.
uint64_t Reference(int es, const unsigned char* p, uint64_t index, int64_t n, bool bf16_as_f32) {
  uint64_t sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    uint64_t bits = 0;
    std::memcpy(&bits, p + j * es, static_cast<size_t>(es));  // little-endian zero extension
    if (bf16_as_f32) bits = (bits & 0xffff) == 0 ? bits >> 16 : (uint64_t{1} << 40) | bits;
    // rc-digest-2 spelled out (digest.h), element by element, no block amortization.
    const uint64_t i = index + static_cast<uint64_t>(j);
    const uint64_t key = Mix64((i >> 6) + 0x9E3779B97F4A7C15ULL);
    const uint64_t a = static_cast<uint32_t>(key >> 32) ^ static_cast<uint32_t>((i & 63) * 0x9E3779B9u);
    const uint64_t b = (key + (i & 63) * 0xD1B54A32D192ED03ULL) | 1;
    sum += (bits ^ a) * b;
  }
  return sum;
}

std::vector<DigestIsa> Isas() {
  std::vector<DigestIsa> out;
  for (DigestIsa isa : {DigestIsa::kScalar, DigestIsa::kAvx2, DigestIsa::kAvx512}) {
    if (DigestIsaSupported(isa)) out.push_back(isa);
  }
  return out;
}

std::vector<unsigned char> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

TEST(DigestSimd, EveryIsaEqualsTheReferenceForEveryElementSizeLengthOffsetAndTail) {
  const std::vector<unsigned char> data = RandomBytes(8 * 1100 + 64, 7);
  // Start indices at every kind of position in a 64-element block (12345 % 64 == 57); the last
  // wraps around 2^64 mid-run.
  const uint64_t bases[] = {0, 1, 63, 64, 100, 12345, ~uint64_t{0} - 20, ~uint64_t{0} - 140};
  for (DigestIsa isa : Isas()) {
    for (int es : {1, 2, 4, 8}) {
      for (int64_t n : {0, 1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 127, 128, 129, 191, 1000, 1031}) {
        for (size_t off : {0, 1, 3, 5, 8}) {
          for (uint64_t base : bases) {
            const unsigned char* p = data.data() + off;
            EXPECT_EQ(DigestContiguous(isa, es, p, base, n), Reference(es, p, base, n, false))
                << DigestIsaName(isa) << " es " << es << " n " << n << " offset " << off << " base " << base;
          }
        }
      }
    }
  }
}

TEST(DigestSimd, Bf16InF32EqualsTheReferenceWithCleanAndPoisonedElements) {
  std::mt19937 rng(3);
  std::vector<uint32_t> v(1100);
  for (size_t i = 0; i < v.size(); ++i) {
    const uint32_t hi = rng() & 0xffff;
    v[i] = (hi << 16) | ((i % 7 == 3) ? (rng() & 0xffff) | 1 : 0);  // every 7th has dirty low bits
  }
  for (DigestIsa isa : Isas()) {
    for (int64_t n : {0, 1, 4, 7, 8, 15, 16, 17, 100, 129, 1099}) {
      for (size_t off : {0, 1}) {
        for (uint64_t base : {uint64_t{0}, uint64_t{99}, uint64_t{128}}) {
          const auto* p = reinterpret_cast<const unsigned char*>(v.data() + off);
          EXPECT_EQ(DigestBf16AsF32(isa, p, base, n), Reference(4, p, base, n, true))
              << DigestIsaName(isa) << " n " << n << " offset " << off << " base " << base;
        }
      }
    }
  }
}

TEST(DigestSimd, AWrongByteChangesTheSumInEveryIsa) {
  std::vector<unsigned char> data = RandomBytes(4096, 11);
  for (DigestIsa isa : Isas()) {
    const uint64_t before = DigestContiguous(isa, 2, data.data(), 0, 2048);
    data[2047] ^= 0x10;  // inside the vector body for every width
    EXPECT_NE(DigestContiguous(isa, 2, data.data(), 0, 2048), before) << DigestIsaName(isa);
    data[2047] ^= 0x10;
    data[4095] ^= 0x01;  // the last element (a tail for no ISA: 2048 is a multiple of 16)
    EXPECT_NE(DigestContiguous(isa, 2, data.data(), 0, 2048), before) << DigestIsaName(isa);
    data[4095] ^= 0x01;
  }
}

TEST(DigestSimd, CopyAndDigestCopiesExactlyTheRunAndDigestsIt) {
  const std::vector<unsigned char> src = RandomBytes(8 * 300 + 16, 5);
  for (DigestIsa isa : Isas()) {
    for (int es : {1, 2, 4, 8}) {
      for (int64_t n : {0, 1, 5, 16, 17, 255}) {
        for (size_t off : {0, 3}) {
          std::vector<unsigned char> dst(8 * 300 + 32, 0xAB);
          const uint64_t base = off == 0 ? 64 : 77;  // block-aligned start, and one mid-block
          const uint64_t got = CopyAndDigestContiguous(isa, es, dst.data() + 8, src.data() + off, base, n);
          EXPECT_EQ(got, Reference(es, src.data() + off, base, n, false)) << DigestIsaName(isa) << " es " << es;
          const size_t bytes = static_cast<size_t>(n * es);
          EXPECT_EQ(std::memcmp(dst.data() + 8, src.data() + off, bytes), 0) << DigestIsaName(isa);
          for (size_t i = 0; i < dst.size(); ++i) {
            if (i >= 8 && i < 8 + bytes) continue;
            ASSERT_EQ(dst[i], 0xAB) << DigestIsaName(isa) << " es " << es << " n " << n << ": byte " << i
                                    << " outside the run was written";
          }
        }
      }
    }
    std::vector<uint32_t> f(37);
    for (size_t i = 0; i < f.size(); ++i) f[i] = static_cast<uint32_t>(i * 0x10000u + (i % 5 == 0 ? 3 : 0));
    std::vector<uint32_t> out(37, 0);
    EXPECT_EQ(CopyAndDigestBf16AsF32(isa, out.data(), f.data(), 5, 37),
              Reference(4, reinterpret_cast<const unsigned char*>(f.data()), 5, 37, true));
    EXPECT_EQ(out, f);
  }
}

TEST(DigestSimd, NonFiniteF32IsFoundAtEveryPositionInEveryIsa) {
  std::vector<float> v(77, 1.5f);
  for (DigestIsa isa : Isas()) {
    EXPECT_FALSE(AnyNonFiniteF32(isa, v.data(), 77)) << DigestIsaName(isa);
    for (size_t at : {0, 7, 8, 63, 76}) {
      for (uint32_t bad : {0x7f800000u, 0xff800000u, 0x7fc00001u}) {  // +Inf, -Inf, NaN
        std::vector<float> w = v;
        std::memcpy(&w[at], &bad, 4);
        EXPECT_TRUE(AnyNonFiniteF32(isa, w.data(), 77)) << DigestIsaName(isa) << " at " << at;
        EXPECT_FALSE(AnyNonFiniteF32(isa, w.data(), static_cast<int64_t>(at))) << "only the first " << at;
      }
    }
    const float big = 3.0e38f;  // finite, largest exponent below all ones
    std::vector<float> w(20, big);
    EXPECT_FALSE(AnyNonFiniteF32(isa, w.data(), 20)) << DigestIsaName(isa);
  }
}

TEST(DigestSimd, WidenBf16IsExactForEveryLengthAndIsa) {
  std::vector<uint16_t> h(70);
  for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<uint16_t>(0x3f80 + 977 * i);
  for (DigestIsa isa : Isas()) {
    for (int64_t n : {0, 1, 7, 8, 9, 16, 69}) {
      std::vector<uint32_t> out(71, 0xdeadbeef);
      WidenBf16ToF32(isa, out.data(), h.data() + 1, n);
      for (int64_t j = 0; j < n; ++j) ASSERT_EQ(out[j], uint32_t{h[j + 1]} << 16) << DigestIsaName(isa) << " " << j;
      EXPECT_EQ(out[n], 0xdeadbeefu) << "wrote past the run";
    }
  }
}

// The bf16 finite check (32 lanes per AVX-512 compare, 16 per AVX2) sees a NaN or Inf in every
// lane position, in the vector body and the scalar tail, at any alignment, and nothing else: the
// largest finite values (exponent 0xfe) and subnormals pass.
TEST(DigestSimd, AnyNonFiniteBf16SeesEveryPositionOnEveryIsa) {
  std::vector<uint16_t> clean(140);
  for (size_t i = 0; i < clean.size(); ++i) {
    const uint16_t finite[] = {0x7f7f, 0xff7f, 0x0001, 0x8000, 0x3f80, 0x7f00, 0x807f};
    clean[i] = finite[i % 7];
  }
  for (DigestIsa isa : Isas()) {
    for (size_t off : {0, 1, 3}) {
      for (int64_t n : {0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 130}) {
        std::vector<uint16_t> v = clean;
        EXPECT_FALSE(AnyNonFiniteBf16(isa, v.data() + off, n)) << DigestIsaName(isa) << " n " << n;
        for (int64_t pos = 0; pos < n; ++pos) {
          for (uint16_t bad : {uint16_t{0x7f80}, uint16_t{0xff80}, uint16_t{0x7fc1}, uint16_t{0xffff}}) {
            v[off + static_cast<size_t>(pos)] = bad;
            ASSERT_TRUE(AnyNonFiniteBf16(isa, v.data() + off, n))
                << DigestIsaName(isa) << " n " << n << " pos " << pos << " bits " << bad;
            v[off + static_cast<size_t>(pos)] = clean[off + static_cast<size_t>(pos)];
          }
        }
        if (off + static_cast<size_t>(n) < v.size()) {
          v[off + static_cast<size_t>(n)] = 0x7fc0;  // just past the run: not looked at
          EXPECT_FALSE(AnyNonFiniteBf16(isa, v.data() + off, n)) << DigestIsaName(isa) << " n " << n;
        }
      }
    }
  }
}

// The landing copy: the bytes copied exactly, the sum equal to the definition, and a NaN/Inf found
// wherever it sits (head before the first block, inside a block, tail), for destinations that are
// 64-byte aligned (streaming stores) and not.
TEST(DigestSimd, CopyDigestAndScanCopiesDigestsAndFindsNonFiniteEverywhereInEveryIsa) {
  const std::vector<unsigned char> data = RandomBytes(4 * 1300 + 128, 11);
  for (DigestIsa isa : Isas()) {
    for (int64_t es : {2, 4}) {
      // Finite values: clear the exponent's top bit of every element (bf16 0x4000, f32 0x40000000).
      std::vector<unsigned char> src = data;
      for (size_t j = 0; j + static_cast<size_t>(es) <= src.size(); j += static_cast<size_t>(es)) {
        src[j + static_cast<size_t>(es) - 1] &= 0xbf;
      }
      for (int64_t n : {1, 7, 63, 64, 65, 130, 1000, 1217}) {
        for (size_t dst_off : {0, 2, 4, 64}) {
          for (uint64_t base : {uint64_t{0}, uint64_t{5}, uint64_t{12345}}) {
            alignas(64) static unsigned char dst[4 * 1300 + 256];
            std::memset(dst, 0xee, sizeof dst);
            bool bad = false;
            const uint64_t got =
                CopyDigestAndScan(isa, static_cast<int>(es), dst + dst_off, src.data() + 3 * es, base, n, &bad);
            const std::string what = std::string(DigestIsaName(isa)) + " es " + std::to_string(es) + " n " +
                                     std::to_string(n) + " dst offset " + std::to_string(dst_off) + " base " +
                                     std::to_string(base);
            EXPECT_EQ(got, Reference(static_cast<int>(es), src.data() + 3 * es, base, n, false)) << what;
            EXPECT_EQ(std::memcmp(dst + dst_off, src.data() + 3 * es, static_cast<size_t>(n * es)), 0) << what;
            EXPECT_EQ(dst[dst_off + static_cast<size_t>(n * es)], 0xee) << what << ": wrote past the run";
            if (dst_off > 0) {
              EXPECT_EQ(dst[dst_off - 1], 0xee) << what << ": wrote before the run";
            }
            EXPECT_FALSE(bad) << what;
            // One NaN / Inf at a time, at positions in the head, the blocks and the tail.
            for (int64_t at : {int64_t{0}, n / 2, n - 1, std::min<int64_t>(n - 1, 70)}) {
              std::vector<unsigned char> s2(src.begin() + 3 * es, src.begin() + 3 * es + n * es);
              s2[static_cast<size_t>(at * es + es - 1)] |= 0x7f;  // exponent's high bits
              s2[static_cast<size_t>(at * es + es - 2)] |= 0x80;  // and its low bit: all ones
              bool bad2 = false;
              (void)CopyDigestAndScan(isa, static_cast<int>(es), dst + dst_off, s2.data(), base, n, &bad2);
              EXPECT_TRUE(bad2) << what << " non-finite at " << at;
            }
          }
        }
      }
    }
  }
}

// Elements whose bits make x = b ^ A the same chosen value at every position of every block: the
// vector kernels' per-lane sums then all move in one direction, block after block, as far as any
// data can push them (for 16-bit elements y' = -32768 or 32767 in every lane).
std::vector<unsigned char> ConstantX(int es, uint64_t index, int64_t n, uint32_t x) {
  std::vector<unsigned char> out(static_cast<size_t>(n * es));
  for (int64_t j = 0; j < n; ++j) {
    const uint64_t i = index + static_cast<uint64_t>(j);
    const auto a = static_cast<uint32_t>(DigestPositionKey(DigestBlockKey(i >> 6), static_cast<uint32_t>(i & 63)));
    const uint32_t b = a ^ x;
    std::memcpy(out.data() + j * es, &b, static_cast<size_t>(es));  // little-endian: the low es bytes
  }
  return out;
}

// Long runs (> 2^15 whole blocks: several times the interval at which the 16-bit kernels fold their
// 32-bit lane sums into 64-bit ones) of the most lopsided data, through every kernel and ISA, with a
// head and a tail and unaligned source and destination.
TEST(DigestSimd, LongRunsOfExtremeValuesEqualTheReferenceInEveryKernelAndIsa) {
  constexpr int64_t kBlocks = (int64_t{1} << 15) + (int64_t{1} << 13) + 5;
  const uint64_t base = 5;
  const int64_t n = kBlocks * 64 + 29;  // 59 head elements, kBlocks - 1 whole blocks, 34 tail elements
  for (int es : {2, 4}) {
    const uint32_t all_ones = es == 2 ? 0xffffu : 0xffffffffu;
    for (uint32_t x : {uint32_t{0}, all_ones, es == 2 ? 0x8000u : 0x80000000u, es == 2 ? 0x7fffu : 0x7fffffffu}) {
      const std::vector<unsigned char> data = ConstantX(es, base, n, x);
      std::vector<unsigned char> src(data.size() + 3), dst(data.size() + 67);
      std::memcpy(src.data() + 1, data.data(), data.size());
      const uint64_t want = Reference(es, data.data(), base, n, false);
      for (DigestIsa isa : Isas()) {
        const std::string what = std::string(DigestIsaName(isa)) + " es " + std::to_string(es) + " x " + std::to_string(x);
        EXPECT_EQ(DigestContiguous(isa, es, src.data() + 1, base, n), want) << what;
        EXPECT_EQ(CopyAndDigestContiguous(isa, es, dst.data() + 3, src.data() + 1, base, n), want) << what;
        EXPECT_EQ(std::memcmp(dst.data() + 3, data.data(), data.size()), 0) << what;
        bool nonfinite = false;
        // 64-byte aligned destination too (the streaming stores); any 64-byte boundary of the vector.
        const size_t aligned = (64 - reinterpret_cast<uintptr_t>(dst.data()) % 64) % 64;
        for (size_t off : {size_t{3}, aligned}) {
          std::memset(dst.data(), 0, dst.size());
          EXPECT_EQ(CopyDigestAndScan(isa, es, dst.data() + off, src.data() + 1, base, n, &nonfinite), want) << what;
          EXPECT_EQ(std::memcmp(dst.data() + off, data.data(), data.size()), 0) << what;
        }
      }
    }
  }
}

// Every bit pattern class the 16-bit kernels treat specially (values >= 0x8000 for the signed
// offset, all zeros, all ones, NaN and Inf encodings) in runs of 1 to 40 whole blocks, so that the
// 8-block key batches end at every position, at every start position within a block.
TEST(DigestSimd, ExtremeBitPatternsEqualTheReferenceForEveryBlockCountAndStart) {
  const uint16_t patterns16[] = {0x0000, 0xffff, 0x8000, 0x7fff, 0x7f80, 0xff80, 0x7fc1, 0x8001, 0x00ff, 0xff00};
  const uint32_t patterns32[] = {0x00000000u, 0xffffffffu, 0x80000000u, 0x7fffffffu, 0x7f800000u,
                                 0xff800000u, 0x7fc00001u, 0x0000ffffu, 0xffff0000u, 0x80008000u};
  for (int es : {2, 4}) {
    for (size_t k = 0; k < 10; ++k) {
      std::vector<unsigned char> data(static_cast<size_t>(es) * (64 * 41 + 8));
      for (size_t e = 0; e * static_cast<size_t>(es) < data.size(); ++e) {
        // Uniform in even k, the pattern alternating with the next one in odd k.
        const size_t which = (k % 2 == 0 || e % 2 == 0) ? k : (k + 1) % 10;
        if (es == 2) {
          std::memcpy(data.data() + 2 * e, &patterns16[which], 2);
        } else {
          std::memcpy(data.data() + 4 * e, &patterns32[which], 4);
        }
      }
      for (DigestIsa isa : Isas()) {
        for (int64_t blocks = 1; blocks <= 40; blocks += (blocks < 18 ? 1 : 7)) {
          for (uint64_t base : {uint64_t{0}, uint64_t{64}, uint64_t{1}, uint64_t{63}, uint64_t{100}}) {
            const int64_t n = blocks * 64 - static_cast<int64_t>(base % 64 == 0 ? 0 : 3);
            const unsigned char* p = data.data() + es;  // not vector-aligned
            const uint64_t want = Reference(es, p, base, n, false);
            ASSERT_EQ(DigestContiguous(isa, es, p, base, n), want)
                << DigestIsaName(isa) << " es " << es << " pattern " << k << " blocks " << blocks << " base " << base;
            std::vector<unsigned char> dst(data.size() + 64);
            bool nonfinite = false;
            ASSERT_EQ(CopyDigestAndScan(isa, es, dst.data() + 64 - reinterpret_cast<uintptr_t>(dst.data()) % 64, p, base,
                                        n, &nonfinite),
                      want)
                << DigestIsaName(isa) << " es " << es << " pattern " << k << " blocks " << blocks << " base " << base;
            // The patterns with every exponent bit set are NaN or Inf (es 2: 0x7f80, 0xff80, 0x7fc1, 0xffff;
            // es 4: 0x7f800000, 0xff800000, 0x7fc00001, 0xffffffff, 0xffff0000).
            bool expect_nonfinite = false;
            for (size_t w : {k, (k + 1) % 10}) {
              if (w != k && k % 2 == 0) continue;
              if (es == 2) expect_nonfinite = expect_nonfinite || (patterns16[w] & 0x7f80) == 0x7f80;
              if (es == 4) expect_nonfinite = expect_nonfinite || (patterns32[w] & 0x7f800000u) == 0x7f800000u;
            }
            ASSERT_EQ(nonfinite, expect_nonfinite)
                << DigestIsaName(isa) << " es " << es << " pattern " << k << " blocks " << blocks << " base " << base;
          }
        }
      }
    }
  }
}

// Random contents over thousands of blocks (past a 32-bit lane flush) from odd addresses, starting
// at every kind of position in a block and near the wrap of the global index.
TEST(DigestSimd, LongRandomRunsEqualTheReferenceInEveryIsa) {
  const int64_t n = 64 * 9000 + 45;
  const std::vector<unsigned char> data = RandomBytes(static_cast<size_t>(4 * n + 8), 23);
  for (int es : {2, 4}) {
    for (uint64_t base : {uint64_t{0}, uint64_t{33}, uint64_t{1} << 40, ~uint64_t{0} - uint64_t{64} * 4000}) {
      const unsigned char* p = data.data() + 3;
      const uint64_t want = Reference(es, p, base, n, false);
      for (DigestIsa isa : Isas()) {
        EXPECT_EQ(DigestContiguous(isa, es, p, base, n), want) << DigestIsaName(isa) << " es " << es << " base " << base;
        std::vector<unsigned char> dst(static_cast<size_t>(es * n + 1));
        bool nonfinite = false;
        EXPECT_EQ(CopyDigestAndScan(isa, es, dst.data() + 1, p, base, n, &nonfinite), want)
            << DigestIsaName(isa) << " es " << es << " base " << base;
        EXPECT_EQ(std::memcmp(dst.data() + 1, p, static_cast<size_t>(es * n)), 0) << DigestIsaName(isa);
        EXPECT_TRUE(nonfinite) << "random bits hold NaN / Inf encodings";
      }
    }
  }
}

TEST(DigestSimd, TheDispatchedKernelIsASupportedOne) {
  EXPECT_TRUE(DigestIsaSupported(BestDigestIsa())) << DigestIsaName(BestDigestIsa());
}

}  // namespace
}  // namespace rc::refit::internal
