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
    // Any one bit of the element: the encoder's word-wise compare must see every lane's top and
    // bottom bits alike.
    const uint64_t bit = uint64_t{1} << (rng() % (8 * sizeof(T)));
    b[static_cast<size_t>(i)] = static_cast<T>(static_cast<uint64_t>(a[static_cast<size_t>(i)]) ^ bit);
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
    // One- and eight-byte elements, and lengths that end inside a 32-byte compare block.
    RoundTrip<uint8_t>(DType::kU8, {37, 301}, f, 5);
    RoundTrip<uint64_t>(DType::kI64, {3, 259}, f, 6);
    RoundTrip<uint16_t>(DType::kBF16, {7}, f, 7);
  }
}

TEST(DeltaTest, DenseTilesUseBitmapsSparseTilesVarints) {
  const Shape shape{64, 128};
  std::vector<uint16_t> a(size_t{64} * 128, 0), b = a;
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
  std::vector<uint16_t> a(size_t{1024} * 1024), b;
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


// The bulk decoder against the scalar reference (DecodeDeltaTile): over shapes with partial last
// tiles in both directions, 0-d and 1-d shards, every density from empty through varint tiles
// with multi-byte gaps to bitmap tiles, every tile gives the same offsets and values.
std::vector<std::pair<int64_t, uint64_t>> BulkDecodeTile(const DeltaTiling& g, DType dtype, int64_t t,
                                                         const DeltaTile& e, std::span<const std::byte> body,
                                                         Status* status) {
  std::vector<uint16_t> k(e.changed + 1);
  std::vector<std::pair<int64_t, uint64_t>> out;
  auto values = DecodeDeltaTileOffsets(g, DTypeSize(dtype), t, e, body, k.data());
  *status = values.status();
  if (!values.ok()) return out;
  for (uint32_t i = 0; i < e.changed; ++i) {
    out.emplace_back(g.LocalOffset(t, k[i]), ElementBits(dtype, *values + i * DTypeSize(dtype)));
  }
  return out;
}

std::vector<std::pair<int64_t, uint64_t>> ReferenceDecodeTile(const DeltaTiling& g, DType dtype, int64_t t,
                                                              const DeltaTile& e, std::span<const std::byte> body,
                                                              Status* status) {
  std::vector<std::pair<int64_t, uint64_t>> out;
  *status = DecodeDeltaTile(g, DTypeSize(dtype), t, e, body,
                            [&](int64_t o, const std::byte* v) { out.emplace_back(o, ElementBits(dtype, v)); });
  if (!status->ok()) out.clear();
  return out;
}

TEST(DeltaTest, BulkTileDecodeEqualsTheScalarReference) {
  std::mt19937 rng(21);
  const std::vector<Shape> shapes{{300, 700}, {130, 129}, {65, 64}, {3, 5, 260}, {1000}, {70001}, {}, {1, 1},
                                  {8193, 1}, {77, 3}};
  int bitmaps = 0, varints = 0, multibyte = 0;
  for (const Shape& shape : shapes) {
    for (double f : {0.0, 0.0005, 0.004, 0.03, 0.11, 0.2, 0.5, 1.0}) {
      const int64_t n = NumElements(shape);
      std::vector<uint16_t> a(static_cast<size_t>(n)), b;
      for (auto& v : a) v = static_cast<uint16_t>(rng());
      b = a;
      std::bernoulli_distribution pick(f);
      for (auto& v : b) {
        if (pick(rng)) v = static_cast<uint16_t>(v ^ (1u + rng() % 0xfffe));
      }
      if (n > 1) b[static_cast<size_t>(n - 1)] ^= 1;  // the last element of the last (partial) tile
      EncodedDelta d = EncodeShardDelta(DType::kBF16, shape, a.data(), b.data());
      auto table = ParseDeltaTable(DType::kBF16, shape, d.bytes, d.bytes.size());
      ASSERT_TRUE(table.ok()) << table.status().ToString();
      const DeltaTiling g = TilingFor(shape);
      for (int64_t t = 0; t < g.tiles(); ++t) {
        const DeltaTile& e = (*table)[static_cast<size_t>(t)];
        const auto body = std::span<const std::byte>(d.bytes).subspan(e.offset, e.bytes);
        Status sb, sr;
        const auto bulk = BulkDecodeTile(g, DType::kBF16, t, e, body, &sb);
        const auto ref = ReferenceDecodeTile(g, DType::kBF16, t, e, body, &sr);
        ASSERT_TRUE(sb.ok()) << sb.ToString();
        ASSERT_TRUE(sr.ok()) << sr.ToString();
        ASSERT_EQ(bulk, ref) << ShapeToString(shape) << " f " << f << " tile " << t;
        if (e.bitmap) ++bitmaps;
        if (!e.bitmap && e.changed > 0) ++varints;
        if (!e.bitmap && e.bytes > e.changed * 3) ++multibyte;  // some gaps took 2+ bytes
      }
    }
  }
  EXPECT_GT(bitmaps, 0);
  EXPECT_GT(varints, 0);
  EXPECT_GT(multibyte, 0);
}

// Corrupted bodies: the bulk decoder refuses exactly the bodies the reference refuses (DataLoss),
// and where both accept, they agree.
TEST(DeltaTest, BulkTileDecodeRefusesWhatTheReferenceRefuses) {
  std::mt19937 rng(22);
  int refused = 0, accepted = 0;
  for (const Shape& shape : std::vector<Shape>{{200, 300}, {64, 100}, {5000}}) {
    for (double f : {0.002, 0.02, 0.3}) {
      const int64_t n = NumElements(shape);
      std::vector<uint16_t> a(static_cast<size_t>(n), 0x3f80), b = a;
      std::bernoulli_distribution pick(f);
      for (auto& v : b) {
        if (pick(rng)) v = 0x4000;
      }
      EncodedDelta d = EncodeShardDelta(DType::kBF16, shape, a.data(), b.data());
      auto table = ParseDeltaTable(DType::kBF16, shape, d.bytes, d.bytes.size());
      ASSERT_TRUE(table.ok());
      const DeltaTiling g = TilingFor(shape);
      for (int trial = 0; trial < 300; ++trial) {
        const int64_t t = static_cast<int64_t>(rng() % static_cast<uint32_t>(g.tiles()));
        DeltaTile e = (*table)[static_cast<size_t>(t)];
        if (e.bytes == 0) continue;
        std::vector<std::byte> body(d.bytes.begin() + static_cast<std::ptrdiff_t>(e.offset),
                                    d.bytes.begin() + static_cast<std::ptrdiff_t>(e.offset + e.bytes));
        const size_t index_bytes = body.size() - size_t{e.changed} * 2;
        switch (trial % 4) {
          case 0:  // a flipped bit in the index part
            if (index_bytes > 0) body[rng() % index_bytes] ^= static_cast<std::byte>(1u << (rng() % 8));
            break;
          case 1:  // a wrong count
            e.changed = static_cast<uint32_t>(std::max<int64_t>(0, int64_t{e.changed} + (trial % 8 < 4 ? 1 : -1)));
            break;
          case 2:  // a random index byte
            if (index_bytes > 0) body[rng() % index_bytes] = static_cast<std::byte>(rng());
            break;
          default:  // a truncated body
            body.pop_back();
            e.bytes -= 1;
            break;
        }
        Status sb, sr;
        const auto bulk = BulkDecodeTile(g, DType::kBF16, t, e, body, &sb);
        const auto ref = ReferenceDecodeTile(g, DType::kBF16, t, e, body, &sr);
        ASSERT_EQ(sb.ok(), sr.ok()) << "bulk: " << sb.ToString() << " reference: " << sr.ToString();
        if (!sb.ok()) {
          EXPECT_EQ(sb.code(), StatusCode::kDataLoss);
          ++refused;
        } else {
          EXPECT_EQ(bulk, ref);
          ++accepted;
        }
      }
    }
  }
  EXPECT_GT(refused, 100);
  EXPECT_GT(accepted, 10);
}

}  // namespace
}  // namespace rc::refit
