#include "rolloutcore/refit/delta.h"

#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>

#include "rolloutcore/refit/digest.h"

namespace rc::refit {
namespace {

// Decodes every tile of a payload into offset -> value bits.
std::map<int64_t, uint64_t> DecodeAll(DType dtype, const Shape& shape, const std::vector<std::byte>& bytes) {
  std::map<int64_t, uint64_t> out;
  auto table = ParseDeltaTable(dtype, shape, bytes, bytes.size());
  EXPECT_TRUE(table.ok()) << table.status().ToString();
  if (!table.ok()) return out;
  const DeltaTiling g = TilingFor(shape);
  for (int64_t t = 0; t < g.tiles(); ++t) {
    const DeltaTile& e = (*table)[static_cast<size_t>(t)];
    Status s = DecodeDeltaTile(g, DTypeSize(dtype), t, e, std::span<const std::byte>(bytes).subspan(e.offset, e.bytes),
                               [&](int64_t o, const std::byte* v) { out[o] = ElementBits(dtype, v); });
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
  return out;
}

template <typename T>
void RoundTrip(DType dtype, const Shape& shape, double fraction, uint32_t seed) {
  std::mt19937 rng(seed);
  const int64_t n = NumElements(shape);
  std::vector<T> a(static_cast<size_t>(n)), b;
  for (auto& v : a) v = static_cast<T>(rng());
  b = a;
  std::map<int64_t, uint64_t> want;
  std::bernoulli_distribution pick(fraction);
  for (int64_t i = 0; i < n; ++i) {
    if (!pick(rng)) continue;
    b[static_cast<size_t>(i)] = static_cast<T>(a[static_cast<size_t>(i)] ^ 1u);
    want[i] = ElementBits(dtype, &b[static_cast<size_t>(i)]);
  }
  EncodedDelta d = EncodeShardDelta(dtype, shape, a.data(), b.data());
  EXPECT_EQ(d.changed, static_cast<int64_t>(want.size()));
  EXPECT_EQ(DecodeAll(dtype, shape, d.bytes), want) << ShapeToString(shape) << " fraction " << fraction;
}

TEST(DeltaTest, RoundTripsAcrossShapesDtypesAndDensities) {
  for (double f : {0.0, 0.001, 0.01, 0.1, 0.6, 1.0}) {
    RoundTrip<uint16_t>(DType::kBF16, {300, 700}, f, 1);
    RoundTrip<uint16_t>(DType::kF16, {4, 5, 130}, f, 2);
    RoundTrip<uint32_t>(DType::kF32, {1000}, f, 3);
    RoundTrip<uint32_t>(DType::kF32, {}, f, 4);
  }
}

TEST(DeltaTest, DenseTilesUseBitmapsSparseTilesVarints) {
  const Shape shape{64, 128};
  std::vector<uint16_t> a(64 * 128, 0), b = a;
  for (size_t i = 0; i < b.size(); i += 2) b[i] = 1;  // half of every tile changes
  EncodedDelta dense = EncodeShardDelta(DType::kBF16, shape, a.data(), b.data());
  auto table = ParseDeltaTable(DType::kBF16, shape, dense.bytes, dense.bytes.size());
  ASSERT_TRUE(table.ok());
  EXPECT_TRUE((*table)[0].bitmap);
  std::vector<uint16_t> c = a;
  c[5] = 7;
  EncodedDelta sparse = EncodeShardDelta(DType::kBF16, shape, a.data(), c.data());
  table = ParseDeltaTable(DType::kBF16, shape, sparse.bytes, sparse.bytes.size());
  ASSERT_TRUE(table.ok());
  EXPECT_FALSE((*table)[0].bitmap);
  EXPECT_EQ((*table)[0].bytes, 1u + 2u);  // one varint byte, one bf16 value
}

TEST(DeltaTest, SizeAtOnePercentIsAFewPercentOfTheShard) {
  const Shape shape{1024, 1024};
  std::mt19937 rng(9);
  std::vector<uint16_t> a(1024 * 1024), b;
  for (auto& v : a) v = static_cast<uint16_t>(rng());
  b = a;
  std::bernoulli_distribution pick(0.01);
  for (auto& v : b) {
    if (pick(rng)) v ^= 0x10;
  }
  EncodedDelta d = EncodeShardDelta(DType::kBF16, shape, a.data(), b.data());
  EXPECT_LT(static_cast<double>(d.bytes.size()), 0.03 * 2.0 * 1024 * 1024);
}

TEST(DeltaTest, FromChangesMatchesTheCompareAndRefusesBadLists) {
  const Shape shape{40, 300};
  std::vector<uint16_t> a(12000, 3), b = a;
  b[0] = 1;
  b[299] = 2;
  b[11999] = 4;
  EncodedDelta cmp = EncodeShardDelta(DType::kBF16, shape, a.data(), b.data());
  std::vector<int64_t> offs{0, 299, 11999};
  std::vector<uint16_t> vals{1, 2, 4};
  auto list = EncodeShardDeltaFromChanges(DType::kBF16, shape, offs,
                                          std::as_bytes(std::span<const uint16_t>(vals)));
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->bytes, cmp.bytes);
  std::vector<int64_t> unsorted{299, 0, 11999};
  auto bad = EncodeShardDeltaFromChanges(DType::kBF16, shape, unsorted, std::as_bytes(std::span<const uint16_t>(vals)));
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  std::vector<int64_t> outside{0, 299, 12000};
  bad = EncodeShardDeltaFromChanges(DType::kBF16, shape, outside, std::as_bytes(std::span<const uint16_t>(vals)));
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
}

TEST(DeltaTest, MalformedPayloadsAreRefused) {
  const Shape shape{16, 16};
  std::vector<uint16_t> a(256, 0), b = a;
  b[3] = 9;
  b[200] = 9;
  EncodedDelta d = EncodeShardDelta(DType::kBF16, shape, a.data(), b.data());
  // Wrong dtype / shape against the header.
  EXPECT_EQ(ParseDeltaTable(DType::kF32, shape, d.bytes, d.bytes.size()).status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(ParseDeltaTable(DType::kBF16, {16, 17}, d.bytes, d.bytes.size()).status().code(), StatusCode::kDataLoss);
  // A table claiming more changes than the header.
  std::vector<std::byte> bad = d.bytes;
  bad[32] = std::byte{3};
  EXPECT_EQ(ParseDeltaTable(DType::kBF16, shape, bad, bad.size()).status().code(), StatusCode::kDataLoss);
  // A body whose index runs past the tile.
  auto table = ParseDeltaTable(DType::kBF16, shape, d.bytes, d.bytes.size());
  ASSERT_TRUE(table.ok());
  const DeltaTile e = (*table)[0];
  ASSERT_EQ(e.changed, 2u);
  bad = d.bytes;
  bad[e.offset + 1] = std::byte{0x7f};  // second gap 127 + 1 byte? make it run past 256
  bad[e.offset] = std::byte{0x7f};
  Status s = DecodeDeltaTile(TilingFor(shape), 2, 0, e, std::span<const std::byte>(bad).subspan(e.offset, e.bytes),
                             [](int64_t, const std::byte*) {});
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
}

TEST(DeltaTest, TilesTouchingSelectsOnlyTheTilesOfABox) {
  const Shape shape{256, 512};  // tiles 64 x 128: 4 x 4
  const DeltaTiling g = TilingFor(shape);
  EXPECT_EQ(g.tile_rows, 64);
  EXPECT_EQ(g.tile_cols, 128);
  EXPECT_EQ(g.tiles(), 16);
  // The right half of the columns (a tp:2 column split).
  auto right = TilesTouching(g, shape, Box{{0, 256}, {256, 256}});
  EXPECT_EQ(right, (std::vector<int64_t>{2, 3, 6, 7, 10, 11, 14, 15}));
  // Rows 64..127.
  EXPECT_EQ(TilesTouching(g, shape, Box{{64, 0}, {64, 512}}), (std::vector<int64_t>{4, 5, 6, 7}));
  // A 3-d box.
  const Shape s3{4, 8, 64};
  const DeltaTiling g3 = TilingFor(s3);
  EXPECT_EQ(g3.tiles(), 1);
  EXPECT_EQ(TilesTouching(g3, s3, Box{{1, 0, 0}, {1, 8, 64}}), (std::vector<int64_t>{0}));
}

TEST(DeltaTest, DigestUpdateFromOldAndNewValuesEqualsTheFullDigest) {
  // D_new = D_old + sum over changed (term(i, new) - term(i, old)).
  const Shape shape{50, 70};
  std::mt19937 rng(5);
  std::vector<uint16_t> a(3500), b;
  for (auto& v : a) v = static_cast<uint16_t>(rng());
  b = a;
  for (int i = 0; i < 3500; i += 37) b[static_cast<size_t>(i)] = static_cast<uint16_t>(rng());
  const Box box{{0, 0}, shape};
  uint64_t d = DigestBlock(DType::kBF16, shape, box, a.data());
  EncodedDelta enc = EncodeShardDelta(DType::kBF16, shape, a.data(), b.data());
  auto table = ParseDeltaTable(DType::kBF16, shape, enc.bytes, enc.bytes.size());
  ASSERT_TRUE(table.ok());
  const DeltaTiling g = TilingFor(shape);
  for (int64_t t = 0; t < g.tiles(); ++t) {
    const DeltaTile& e = (*table)[static_cast<size_t>(t)];
    ASSERT_TRUE(DecodeDeltaTile(g, 2, t, e, std::span<const std::byte>(enc.bytes).subspan(e.offset, e.bytes),
                                [&](int64_t o, const std::byte* v) {
                                  d += DigestTerm(static_cast<uint64_t>(o), ElementBits(DType::kBF16, v)) -
                                       DigestTerm(static_cast<uint64_t>(o), a[static_cast<size_t>(o)]);
                                })
                    .ok());
  }
  EXPECT_EQ(d, DigestBlock(DType::kBF16, shape, box, b.data()));
}

}  // namespace
}  // namespace rc::refit
