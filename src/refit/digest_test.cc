#include "rolloutcore/refit/digest.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "refit/geometry.h"
#include "rolloutcore/refit/layouts.h"
#include "rolloutcore/refit/model_config.h"

namespace rc::refit {
namespace {

using ::testing::HasSubstr;

std::vector<float> Iota(int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = static_cast<float>(i % 17) - 8.0f;
  return v;
}

uint64_t Full(const std::vector<float>& v, const Shape& shape) {
  return DigestBlock(DType::kF32, shape, FullBox(shape), v.data());
}

// Digest of `box` of a whole row-major f32 tensor.
uint64_t OfBox(const std::vector<float>& v, const Shape& shape, const Box& box) {
  std::vector<float> sub(static_cast<size_t>(box.numel()));
  std::vector<int32_t> id(shape.size());
  for (size_t d = 0; d < id.size(); ++d) id[d] = static_cast<int32_t>(d);
  internal::CopyViewFromBlock(DType::kF32, reinterpret_cast<const std::byte*>(v.data()), FullBox(shape), box, id,
                              DType::kF32, reinterpret_cast<std::byte*>(sub.data()), 0, RowMajorStrides(box.extent));
  return DigestBlock(DType::kF32, shape, box, sub.data());
}

// Golden values of rc-digest-2, computed once by an independent implementation of the formula in
// digest.h (Python integers, masked to 64 bits):
//   def term(i, b):
//     K = mix64((i >> 6) + 0x9E3779B97F4A7C15); j = i & 63
//     A = ((K >> 32) & 0xffffffff) ^ ((j * 0x9E3779B9) & 0xffffffff)
//     B = ((K + j * 0xD1B54A32D192ED03) & M) | 1
//     return ((b ^ A) * B) & M
// with mix64 the SplitMix64 finalizer (x += golden; two xor-shift-multiply rounds; xor-shift).
TEST(DigestTest, TermMatchesTheIndependentReference) {
  struct Golden {
    uint64_t index, bits, term;
  };
  const Golden golden[] = {
      {0x0ull, 0x0ull, 0x4330e0ae74896d72ull},
      {0x0ull, 0x3f80ull, 0xe95b55e47d6e46f2ull},
      {0x5ull, 0x3f80ull, 0xfbdceca54a3b8565ull},
      {0x3full, 0xffffull, 0x84eee5b451711372ull},
      {0x40ull, 0x3f800000ull, 0x55c86f4d4d2467c7ull},
      {0x3039ull, 0xbf800000ull, 0xff0a3dfba5df5be8ull},
      {0xffffffffffffffffull, 0x1003f800001ull, 0xbd7ffe52878a6be6ull},  // poisoned bf16-in-f32
      {0x10000000007ull, 0xfedcba9876543210ull, 0x3c7b89dd39bc080dull},  // 64-bit element
  };
  for (const Golden& g : golden) {
    EXPECT_EQ(DigestTerm(g.index, g.bits), g.term) << "index " << g.index << " bits " << g.bits;
    EXPECT_EQ(DigestTermInBlock(DigestBlockKey(g.index >> 6), static_cast<uint32_t>(g.index & 63), g.bits), g.term);
  }
  static_assert(DigestTerm(0, 0x3f80) == 0xe95b55e47d6e46f2ull, "constexpr, as the CUDA kernels use it");
  const float one = 1.0f;
  EXPECT_EQ(DigestBlock(DType::kF32, {1}, FullBox({1}), &one), 0x642fbcd4ae096d72ull);
  EXPECT_EQ(kDigestAlgorithm, "rc-digest-2");
}

// Every single-element change is detected, with certainty: over a bf16 tensor whose length is not
// a multiple of 64 (so a partial block is included), every element, every one of its 16 bit flips
// and a few whole-value replacements.
TEST(DigestTest, EverySingleElementChangeChangesIt) {
  const Shape shape{3, 50};  // 150 elements: blocks 0, 1 and a partial block 2
  std::vector<uint16_t> v(150);
  std::mt19937 rng(99);
  for (auto& x : v) x = static_cast<uint16_t>(rng());
  const uint64_t d = DigestBlock(DType::kBF16, shape, FullBox(shape), v.data());
  int checked = 0;
  for (size_t e = 0; e < v.size(); ++e) {
    const uint16_t keep = v[e];
    std::vector<uint16_t> changes;
    changes.reserve(20);
    for (int bit = 0; bit < 16; ++bit) changes.push_back(static_cast<uint16_t>(keep ^ (1u << bit)));
    for (uint16_t to : {uint16_t{0}, uint16_t{0xffff}, uint16_t{0x8000}, static_cast<uint16_t>(keep + 1)}) {
      if (to != keep) changes.push_back(to);
    }
    for (uint16_t to : changes) {
      v[e] = to;
      ASSERT_NE(DigestBlock(DType::kBF16, shape, FullBox(shape), v.data()), d)
          << "element " << e << " changed from " << keep << " to " << to;
      ++checked;
    }
    v[e] = keep;
  }
  EXPECT_GE(checked, 150 * 16);
}

// The delta rule the engine and the trainer use: D_new = D_old + sum over changed elements of
// DigestTerm(i, new) - DigestTerm(i, old), equal to recomputing.
TEST(DigestTest, DeltaUpdateEqualsRecompute) {
  const Shape shape{7, 37};
  std::vector<uint32_t> v(size_t{7} * 37);
  std::mt19937 rng(5);
  for (auto& x : v) x = rng();
  uint64_t d = DigestBlock(DType::kF32, shape, FullBox(shape), v.data());
  for (int round = 0; round < 50; ++round) {
    for (int k = 0; k < 5; ++k) {
      const size_t e = rng() % v.size();
      const uint32_t to = rng();
      d += DigestTerm(e, to) - DigestTerm(e, v[e]);
      v[e] = to;
    }
    ASSERT_EQ(d, DigestBlock(DType::kF32, shape, FullBox(shape), v.data())) << "round " << round;
  }
}

TEST(DigestTest, SwappedElementsInsideABlockChangeIt) {
  std::vector<uint16_t> v(64);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint16_t>(0x3f80 + i);
  const uint64_t d = DigestBlock(DType::kBF16, {64}, FullBox({64}), v.data());
  for (size_t a = 0; a < 64; ++a) {
    for (size_t b = a + 1; b < 64; ++b) {
      std::swap(v[a], v[b]);
      ASSERT_NE(DigestBlock(DType::kBF16, {64}, FullBox({64}), v.data()), d) << a << " <-> " << b;
      std::swap(v[a], v[b]);
    }
  }
}

TEST(DigestTest, FlippedBitChangesIt) {
  const Shape shape{6, 5};
  auto v = Iota(30);
  const uint64_t d = Full(v, shape);
  uint32_t bits;
  std::memcpy(&bits, &v[13], 4);
  bits ^= 1u;  // lowest mantissa bit
  std::memcpy(&v[13], &bits, 4);
  EXPECT_NE(Full(v, shape), d);
}

TEST(DigestTest, SwappedEqualSumRowsChangeIt) {
  const Shape shape{2, 4};
  std::vector<float> a{1, 2, 3, 4, 4, 3, 2, 1};  // both rows sum to 10
  std::vector<float> b{4, 3, 2, 1, 1, 2, 3, 4};
  EXPECT_NE(Full(a, shape), Full(b, shape));
}

TEST(DigestTest, ShiftedRunChangesIt) {
  const Shape shape{32};
  auto v = Iota(32);
  const uint64_t d = Full(v, shape);
  std::vector<float> shifted(32, 0.0f);
  std::copy(v.begin(), v.begin() + 31, shifted.begin() + 1);
  shifted[0] = v[31];  // same multiset of values, every position moved by one
  EXPECT_NE(Full(shifted, shape), d);
}

TEST(DigestTest, MissingRegionChangesIt) {
  const Shape shape{8, 4};
  auto v = Iota(32);
  const uint64_t d = Full(v, shape);
  EXPECT_NE(OfBox(v, shape, Box{{0, 0}, {6, 4}}), d);  // rows 6..8 never digested
  auto zeroed = v;
  std::fill(zeroed.begin() + 24, zeroed.end(), 0.0f);  // region left unwritten
  EXPECT_NE(Full(zeroed, shape), d);
}

TEST(DigestTest, EveryPartitionSumsToTheSameDigest) {
  const Shape shape{7, 5, 3};
  auto v = Iota(105);
  const uint64_t d = Full(v, shape);
  std::mt19937 rng(12345);
  for (int trial = 0; trial < 200; ++trial) {
    // Random guillotine partition: split boxes along random dims at random points.
    std::vector<Box> boxes{FullBox(shape)};
    for (int k = 0; k < 6; ++k) {
      const size_t pick = rng() % boxes.size();
      Box b = boxes[pick];
      const size_t dim = rng() % 3;
      if (b.extent[dim] < 2) continue;
      const int64_t cut = 1 + static_cast<int64_t>(rng() % static_cast<uint32_t>(b.extent[dim] - 1));
      Box lo = b, hi = b;
      lo.extent[dim] = cut;
      hi.start[dim] += cut;
      hi.extent[dim] -= cut;
      boxes[pick] = lo;
      boxes.push_back(hi);
    }
    uint64_t sum = 0;
    for (const Box& b : boxes) sum += OfBox(v, shape, b);
    ASSERT_EQ(sum, d) << "trial " << trial << " with " << boxes.size() << " boxes";
  }
}

TEST(DigestTest, InstalledDigestMapsConvertedValuesBackToSourceBits) {
  // Source bf16 [2, 3]; installed transposed into f32 [3, 2].
  uint16_t src[6];
  for (int i = 0; i < 6; ++i) src[i] = F32ToBf16Bits(0.5f * static_cast<float>(i) - 1.0f);
  const uint64_t want = DigestBlock(DType::kBF16, {2, 3}, FullBox({2, 3}), src);
  CaptureContext ctx({{"w", DType::kBF16, {2, 3}}}, {{"p", DType::kF32, {3, 2}}});
  auto v = ctx.Source("w");
  ASSERT_TRUE(v.ok());
  ASSERT_TRUE(ctx.CopyInto(v->Transpose(0, 1), DestRegion::Whole("p", {3, 2}, true)).ok());
  float installed[6];
  for (int a = 0; a < 3; ++a) {
    for (int b = 0; b < 2; ++b) installed[a * 2 + b] = Bf16BitsToF32(src[b * 3 + a]);
  }
  DestinationBuffers bufs{{"p", std::as_writable_bytes(std::span(installed))}};
  const std::vector<DigestRegion> all{{0, Box{{0, 0}, {2, 3}}}};
  auto got = DigestInstalled(ctx.capture(), bufs, all);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->at("w"), want);
  // A low-mantissa flip of the f32 value, invisible after truncation to bf16, is still caught.
  uint32_t bits;
  std::memcpy(&bits, &installed[3], 4);
  bits ^= 1u;
  std::memcpy(&installed[3], &bits, 4);
  EXPECT_NE(DigestInstalled(ctx.capture(), bufs, all)->at("w"), want);
}

TEST(DigestTest, OwnershipCountsEachSourceElementOnce) {
  Capture a, b;
  a.params = b.params = {{"p", DType::kF32, {4}}};
  CapturedCopy c{"w", DType::kF32, {8}, Box{{0}, {4}}, {0}, 0, 0, {4}, {1}, false};
  a.copies = {c};
  b.copies = {c};
  const Capture* ranks[] = {&a, &b};
  auto owned = AssignDigestOwnership(ranks);
  ASSERT_EQ(owned[0].size(), 1u);
  EXPECT_EQ(owned[0][0].box, (Box{{0}, {4}}));
  EXPECT_TRUE(owned[1].empty());
  // A partially overlapping box owns only what is new: [4, 6).
  b.copies[0].box = Box{{2}, {4}};
  owned = AssignDigestOwnership(ranks);
  ASSERT_EQ(owned[1].size(), 1u);
  EXPECT_EQ(owned[1][0].box, (Box{{4}, {2}}));
  // 2-d: a block inside a larger one is fully owned by the larger; an L-shaped rest is cut.
  Capture x;
  x.params = {{"p", DType::kF32, {100}}};
  x.copies = {CapturedCopy{"m", DType::kF32, {6, 6}, Box{{0, 0}, {4, 4}}, {0, 1}, 0, 0, {4, 4}, {4, 1}, false},
              CapturedCopy{"m", DType::kF32, {6, 6}, Box{{2, 2}, {4, 4}}, {0, 1}, 0, 16, {4, 4}, {4, 1}, false}};
  const Capture* one[] = {&x};
  auto cut = AssignDigestOwnership(one);
  int64_t total = 0;
  for (const auto& r : cut[0]) total += r.box.numel();
  EXPECT_EQ(total, 16 + 12);
}

TEST(DigestTest, CombinedDigestDependsOnNamesAndValues) {
  TensorDigests a{{"a", 1}, {"b", 2}};
  TensorDigests b{{"a", 2}, {"b", 1}};
  TensorDigests c{{"a", 1}, {"c", 2}};
  EXPECT_NE(CombineTensorDigests(a), CombineTensorDigests(b));
  EXPECT_NE(CombineTensorDigests(a), CombineTensorDigests(c));
  EXPECT_EQ(CombineTensorDigests(a), CombineTensorDigests(TensorDigests{{"b", 2}, {"a", 1}}));
}

// A manifest names its digest algorithm; one naming another or none is refused where published
// digests are read (receivers, verifiers, the directory's commit), naming the field and value.
TEST(DigestTest, ManifestOfAnotherOrNoDigestAlgorithmIsRefused) {
  Manifest m;
  m.version = "v7";
  m.tables.push_back(ShardTable{"w", DType::kF32, {2}, {{0, {0}, {2}, "", 10}}});
  EXPECT_EQ(m.digest_algorithm, "rc-digest-2");
  const Json j = ManifestToJson(m);
  EXPECT_EQ(j.at("digest"), "rc-digest-2");
  auto back = ManifestFromJson(j);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->digest_algorithm, "rc-digest-2");
  ASSERT_TRUE(TensorDigestsFromShards(*back).ok());

  Json other = j;
  other["digest"] = "rc-digest-1";
  auto o = ManifestFromJson(other);
  ASSERT_TRUE(o.ok());
  auto refused = TensorDigestsFromShards(*o);
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("version v7: field \"digest\" is \"rc-digest-1\""));
  EXPECT_THAT(refused.status().message(), HasSubstr("\"rc-digest-2\""));

  Json none = j;
  none.erase("digest");
  auto n = ManifestFromJson(none);
  ASSERT_TRUE(n.ok());
  auto missing = TensorDigestsFromShards(*n);
  EXPECT_EQ(missing.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(missing.status().message(), HasSubstr("field \"digest\" (content digest algorithm) is missing"));
}

TEST(DigestTest, ManifestDigestCountsReplicasOnceAndCatchesDisagreement) {
  Manifest m;
  ShardTable t{"w", DType::kF32, {4}, {}};
  t.shards.push_back({0, {0}, {2}, "", 10});
  t.shards.push_back({1, {0}, {2}, "", 10});
  t.shards.push_back({2, {2}, {2}, "", 5});
  m.tables.push_back(t);
  auto d = TensorDigestsFromShards(m);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->at("w"), 15u);
  m.tables[0].shards[1].digest = 11;
  auto bad = TensorDigestsFromShards(m);
  EXPECT_EQ(bad.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(bad.status().message(), HasSubstr("tensor w: replicas on ranks 0 and 1"));
}

}  // namespace
}  // namespace rc::refit

namespace rc::refit {
namespace {

// The fused install: over a tp 2 capture with replicated kv heads and tied embeddings (so rank 1
// owns fewer elements than it installs), every staged byte lands in the live buffers and the
// digest equals what DigestInstalled reads back from them.
TEST(DigestTest, FusedInstallCopiesEveryByteAndDigestsWhatItWrote) {
  ModelConfig c = *ModelPreset("tiny");
  c.hidden_size = 16;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 1;  // replicated on both tp ranks
  c.head_dim = 4;
  c.intermediate_size = 24;
  c.vocab_size = 40;
  c.num_hidden_layers = 2;
  c.tie_word_embeddings = true;
  c.dtype = DType::kBF16;
  EngineLayout layout;
  layout.tp = 2;
  std::vector<Capture> caps;
  for (int r = 0; r < 2; ++r) {
    auto cap = CaptureEngineRank(c, layout, r);
    ASSERT_TRUE(cap.ok()) << cap.status().ToString();
    caps.push_back(std::move(cap).value());
  }
  const Capture* ptrs[] = {&caps[0], &caps[1]};
  const auto regions = AssignDigestOwnership(ptrs);
  std::mt19937 rng(17);
  bool some_uncovered = false;
  for (int r = 0; r < 2; ++r) {
    std::map<std::string, std::vector<std::byte>> staged_mem, live_mem;
    DestinationBuffers staged, live;
    for (const TensorSpec& p : caps[r].params) {
      auto& s = staged_mem[p.name];
      s.resize(static_cast<size_t>(p.bytes()));
      for (size_t i = 0; i < s.size(); ++i) {
        // bf16-exact f32 values mostly, a few with dirty low bits (poisoned digest terms).
        s[i] = (i % 4 < 2 && rng() % 64 != 0) ? std::byte{0} : static_cast<std::byte>(rng());
      }
      live_mem[p.name].assign(s.size(), std::byte{0x5A});
      staged.emplace(p.name, std::span<std::byte>(s));
      live.emplace(p.name, std::span<std::byte>(live_mem[p.name]));
    }
    auto uncovered = BytesOutsideRegions(caps[r], regions[r]);
    ASSERT_TRUE(uncovered.ok()) << uncovered.status().ToString();
    some_uncovered = some_uncovered || !uncovered->empty();
    auto fused = CopyAndDigestInstalledParallel(caps[r], staged, live, regions[r], *uncovered, 3);
    ASSERT_TRUE(fused.ok()) << fused.status().ToString();
    for (const auto& [name, bytes] : staged_mem) {
      EXPECT_TRUE(live_mem[name] == bytes) << "rank " << r << " parameter " << name << " not copied exactly";
    }
    auto read_back = DigestInstalled(caps[r], live, regions[r]);
    ASSERT_TRUE(read_back.ok());
    EXPECT_EQ(*fused, *read_back) << "rank " << r;
    EXPECT_FALSE(fused->empty());
  }
  EXPECT_TRUE(some_uncovered) << "the case should exercise the plain copy of bytes no region owns";
}

TEST(DigestTest, FusedInstallOfATransposedViewDigestsElementByElement) {
  uint16_t src[6];
  for (int i = 0; i < 6; ++i) src[i] = F32ToBf16Bits(0.25f * static_cast<float>(i) - 0.5f);
  const uint64_t want = DigestBlock(DType::kBF16, {2, 3}, FullBox({2, 3}), src);
  CaptureContext ctx({{"w", DType::kBF16, {2, 3}}}, {{"p", DType::kF32, {3, 2}}});
  auto v = ctx.Source("w");
  ASSERT_TRUE(v.ok());
  ASSERT_TRUE(ctx.CopyInto(v->Transpose(0, 1), DestRegion::Whole("p", {3, 2}, true)).ok());
  float staged[6], live[6] = {0, 0, 0, 0, 0, 0};
  for (int a = 0; a < 3; ++a) {
    for (int b = 0; b < 2; ++b) staged[a * 2 + b] = Bf16BitsToF32(src[b * 3 + a]);
  }
  DestinationBuffers from{{"p", std::as_writable_bytes(std::span(staged))}};
  DestinationBuffers to{{"p", std::as_writable_bytes(std::span(live))}};
  const std::vector<DigestRegion> all{{0, Box{{0, 0}, {2, 3}}}};
  auto got = CopyAndDigestInstalled(ctx.capture(), from, to, all);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->at("w"), want);
  // Byte identity of the installed copy is the property (NaN payloads and -0.0 included).
  EXPECT_EQ(std::memcmp(staged, live, sizeof staged), 0);  // NOLINT(bugprone-suspicious-memory-comparison)
  // A staged buffer of the wrong size is refused, naming the parameter.
  float small[4];
  DestinationBuffers bad{{"p", std::as_writable_bytes(std::span(small))}};
  auto refused = CopyAndDigestInstalled(ctx.capture(), bad, to, all);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("source p"));
}

}  // namespace
}  // namespace rc::refit
