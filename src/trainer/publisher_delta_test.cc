// Delta publishing (PublisherOptions::delta): the published tables carry each shard's delta
// against the previous committed version, the payload decodes to exactly the changed elements,
// and a base that is not committed yields no delta.
#include <gtest/gtest.h>

#include <cstring>
#include <algorithm>
#include <map>

#include "rolloutcore/base/clock.h"
#include "rolloutcore/directory/memory_store.h"
#include "rolloutcore/refit/delta.h"
#include "rolloutcore/refit/digest.h"
#include "rolloutcore/trainer/publisher.h"
#include "rolloutcore/trainer/synthetic_trainer.h"
#include "rolloutcore/transport/local.h"
#include "trainer/publisher_test_util.h"

namespace rc::trainer {
namespace {

using refit::DType;
using refit::Shape;

ShardSource Whole(const std::string& name, const Shape& shape, const void* data) {
  ShardSource s;
  s.name = name;
  s.dtype = DType::kBF16;
  s.global_shape = shape;
  s.offset = Shape(shape.size(), 0);
  s.local_shape = shape;
  s.data = data;
  return s;
}

std::vector<std::byte> Read(transport::Transport& t, const std::string& descriptor, uint64_t offset, uint64_t bytes) {
  return testing::ReadRemote(t, descriptor, offset, bytes);
}

// The changes a shard's published bf16 delta payload holds, read through the transport: offset -> bits.
std::map<int64_t, uint16_t> DecodedChanges(transport::Transport& t, const refit::ShardInfo& s, const Shape& shape) {
  std::map<int64_t, uint16_t> got;
  std::vector<std::byte> payload = Read(t, s.delta->handle, s.delta->offset, s.delta->bytes);
  auto tiles = refit::ParseDeltaTable(DType::kBF16, shape, payload, payload.size());
  EXPECT_TRUE(tiles.ok()) << tiles.status().ToString();
  if (!tiles.ok()) return got;
  const refit::DeltaTiling g = refit::TilingFor(shape);
  for (int64_t k = 0; k < g.tiles(); ++k) {
    const refit::DeltaTile& e = (*tiles)[static_cast<size_t>(k)];
    EXPECT_TRUE(refit::DecodeDeltaTile(g, 2, k, e, std::span<const std::byte>(payload).subspan(e.offset, e.bytes),
                                       [&](int64_t off, const std::byte* v) {
                                         uint16_t b;
                                         std::memcpy(&b, v, 2);
                                         got[off] = b;
                                       })
                    .ok());
  }
  return got;
}

class PublisherDeltaTest : public testing::PublisherFixture {};

TEST_F(PublisherDeltaTest, SecondVersionCarriesADeltaThatDecodesToTheChanges) {
  PublisherOptions o;
  o.delta = true;
  Publisher p(transport_.get(), store_.get(), "m", 0, 1, o);
  const Shape shape{64, 300};
  std::vector<uint16_t> v0(size_t{64} * 300), v1;
  for (size_t i = 0; i < v0.size(); ++i) v0[i] = static_cast<uint16_t>(i * 13);
  v1 = v0;
  std::map<int64_t, uint16_t> changed;
  for (size_t i = 5; i < v1.size(); i += 97) {
    v1[i] = static_cast<uint16_t>(v1[i] + 1);
    changed[static_cast<int64_t>(i)] = v1[i];
  }
  ASSERT_TRUE(p.AddShard("v0", Whole("w", shape, v0.data())).ok());
  auto r0 = p.Publish("v0");
  ASSERT_TRUE(r0.ok()) << r0.status().ToString();
  EXPECT_EQ(r0->delta_base, "") << "the first version has nothing to be a delta on";
  EXPECT_FALSE(r0->tables[0].shards[0].delta.has_value());

  ASSERT_TRUE(p.AddShard("v1", Whole("w", shape, v1.data())).ok());
  auto r1 = p.Publish("v1");
  ASSERT_TRUE(r1.ok()) << r1.status().ToString();
  EXPECT_EQ(r1->delta_base, "v0");
  EXPECT_EQ(r1->delta_changed, static_cast<int64_t>(changed.size()));
  // The committed manifest (through the directory's JSON) names base, base digest and sizes.
  auto m = store_->Get("m", "v1");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const refit::ShardInfo& s = m->tables[0].shards[0];
  ASSERT_TRUE(s.delta.has_value());
  EXPECT_EQ(s.delta->base, "v0");
  EXPECT_EQ(s.delta->base_digest, r0->tables[0].shards[0].digest);
  EXPECT_EQ(s.delta->changed, static_cast<int64_t>(changed.size()));
  EXPECT_LT(s.delta->bytes, 64u * 300u * 2u / 10u) << "about 1 % changed: far below the shard's bytes";
  // Decoding the payload read through the transport gives exactly the changes, and updating the
  // base digest with them gives the published digest.
  const std::map<int64_t, uint16_t> got = DecodedChanges(*transport_, s, shape);
  uint64_t digest = s.delta->base_digest;
  for (const auto& [off, b] : got) {
    digest += refit::DigestTerm(static_cast<uint64_t>(off), b) -
              refit::DigestTerm(static_cast<uint64_t>(off), v0[static_cast<size_t>(off)]);
  }
  EXPECT_EQ(got, changed);
  EXPECT_EQ(digest, s.digest);
}

// The changes of every shard of a version, as decoded from its published delta payload.
std::map<std::string, std::map<int64_t, uint16_t>> PublishedChanges(directory::DirectoryStore& store,
                                                                    transport::Transport& t,
                                                                    const std::string& version, const Shape& shape) {
  std::map<std::string, std::map<int64_t, uint16_t>> out;
  auto m = store.Get("m", version);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  if (!m.ok()) return out;
  for (const auto& table : m->tables) {
    for (const refit::ShardInfo& s : table.shards) {
      EXPECT_TRUE(s.delta.has_value()) << table.name;
      if (s.delta) out[table.name] = DecodedChanges(t, s, shape);
    }
  }
  return out;
}

TEST_F(PublisherDeltaTest, ShardsEncodedAndKeptInParallelGiveEachShardItsOwnDelta) {
  // Several host shards on several threads: each shard's delta holds exactly its own changes, and
  // the copies kept in parallel are the next version's correct base.
  PublisherOptions o;
  o.delta = true;
  o.delta_threads = 4;
  Publisher p(transport_.get(), store_.get(), "m", 0, 1, o);
  const Shape shape{32, 130};
  const size_t n = size_t{32} * 130;
  constexpr int kShards = 7;
  constexpr int kVersions = 3;
  std::vector<std::vector<std::vector<uint16_t>>> data(kVersions, std::vector<std::vector<uint16_t>>(kShards));
  std::vector<std::map<std::string, std::map<int64_t, uint16_t>>> want(kVersions);
  for (int s = 0; s < kShards; ++s) {
    data[0][s].resize(n);
    for (size_t i = 0; i < n; ++i) data[0][s][i] = static_cast<uint16_t>(i * 7 + static_cast<size_t>(s) * 1000);
  }
  for (int v = 1; v < kVersions; ++v) {
    for (int s = 0; s < kShards; ++s) {
      data[v][s] = data[v - 1][s];
      // A different stride per shard and version: a mixed-up shard or a stale base shows.
      const size_t first = static_cast<size_t>(s) + static_cast<size_t>(v);
      const size_t stride = 11 + (3 * static_cast<size_t>(s)) + static_cast<size_t>(v);
      for (size_t i = first; i < n; i += stride) {
        data[v][s][i] = static_cast<uint16_t>(data[v][s][i] ^ (1u << ((i + static_cast<size_t>(v)) % 16)));
        want[v]["w" + std::to_string(s)][static_cast<int64_t>(i)] = data[v][s][i];
      }
    }
  }
  for (int v = 0; v < kVersions; ++v) {
    const std::string version = "v" + std::to_string(v);
    for (int s = 0; s < kShards; ++s) {
      ASSERT_TRUE(p.AddShard(version, Whole("w" + std::to_string(s), shape, data[v][s].data())).ok());
    }
    auto r = p.Publish(version);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    if (v == 0) continue;
    EXPECT_EQ(r->delta_base, "v" + std::to_string(v - 1));
    EXPECT_EQ(r->delta_shards, kShards);
    EXPECT_EQ(PublishedChanges(*store_, *transport_, version, shape), want[v]) << version;
  }
}

TEST_F(PublisherDeltaTest, NoDeltaOnABaseThatIsNotCommitted) {
  PublisherOptions o;
  o.delta = true;
  // Two expected ranks, only rank 0 publishes: v0 stays STAGING.
  Publisher p(transport_.get(), store_.get(), "m", 0, 2, o);
  std::vector<uint16_t> a(128, 1), b(128, 1);
  b[3] = 2;
  ASSERT_TRUE(p.AddShard("v0", Whole("w", {128}, a.data())).ok());
  ASSERT_TRUE(p.Publish("v0").ok());
  ASSERT_TRUE(p.AddShard("v1", Whole("w", {128}, b.data())).ok());
  auto r1 = p.Publish("v1");
  ASSERT_TRUE(r1.ok()) << r1.status().ToString();
  EXPECT_EQ(r1->delta_base, "") << "a receiver could never prove it holds a base that never committed";
  EXPECT_FALSE(r1->tables[0].shards[0].delta.has_value());
}

TEST_F(PublisherDeltaTest, WithoutTheOptionNothingIsKeptOrPublished) {
  Publisher p(transport_.get(), store_.get(), "m", 0, 1);
  std::vector<uint16_t> a(128, 1), b(128, 1);
  b[3] = 2;
  ASSERT_TRUE(p.AddShard("v0", Whole("w", {128}, a.data())).ok());
  ASSERT_TRUE(p.Publish("v0").ok());
  ASSERT_TRUE(p.AddShard("v1", Whole("w", {128}, b.data())).ok());
  auto r1 = p.Publish("v1");
  ASSERT_TRUE(r1.ok());
  EXPECT_FALSE(r1->tables[0].shards[0].delta.has_value());
}

// AttachDeltaPayload (a delta the caller computed for a shard in device memory): refused, naming
// the shard, for a host shard (the Publisher diffs those itself), a shard that is not staged, a
// payload shorter than the shard's tile table, and a version already published. (Publishing a
// device shard's payload needs a transport that registers device memory: test_delta_cuda.py.)
TEST_F(PublisherDeltaTest, AttachDeltaPayloadRefusesWhatItCannotPublish) {
  PublisherOptions o;
  o.delta = true;
  Publisher p(transport_.get(), store_.get(), "m", 0, 1, o);
  std::vector<uint16_t> host(128, 1);
  ASSERT_TRUE(p.AddShard("v0", Whole("h", {128}, host.data())).ok());
  ShardSource dev = Whole("d", {64, 300}, host.data());  // never read: staged only
  dev.memory_kind = transport::MemoryKind::kDevice;
  dev.device = 0;
  dev.digest = 1;
  ASSERT_TRUE(p.AddShard("v0", dev).ok());
  std::vector<std::byte> payload(4096);
  auto attach = [&](const std::string& version, const std::string& tensor, uint64_t bytes) {
    DeltaPayloadSource d;
    d.tensor = tensor;
    d.offset = tensor == "h" ? refit::Shape{0} : refit::Shape{0, 0};
    d.data = payload.data();
    d.bytes = bytes;
    d.device = 0;
    d.changed = 3;
    return p.AttachDeltaPayload(version, std::move(d));
  };
  Status host_shard = attach("v0", "h", payload.size());
  EXPECT_EQ(host_shard.code(), StatusCode::kInvalidArgument) << host_shard.ToString();
  EXPECT_NE(host_shard.message().find("host memory"), std::string::npos) << host_shard.ToString();
  Status missing = attach("v0", "x", payload.size());
  EXPECT_EQ(missing.code(), StatusCode::kNotFound) << missing.ToString();
  EXPECT_NE(missing.message().find("tensor x"), std::string::npos) << missing.ToString();
  Status no_version = attach("v9", "d", payload.size());
  EXPECT_EQ(no_version.code(), StatusCode::kNotFound) << no_version.ToString();
  const uint64_t table = refit::TilingFor({64, 300}).table_bytes();
  Status too_short = attach("v0", "d", table - 1);
  EXPECT_EQ(too_short.code(), StatusCode::kInvalidArgument) << too_short.ToString();
  EXPECT_NE(too_short.message().find("tile table"), std::string::npos) << too_short.ToString();
  EXPECT_TRUE(attach("v0", "d", table + 16).ok());
  // Published (here: refused by the host transport, which registers host memory only): the version
  // is no longer staged, and a late payload is refused.
  (void)p.Publish("v0");
  std::vector<uint16_t> h1(128, 2);
  ASSERT_TRUE(p.AddShard("v1", Whole("h", {128}, h1.data())).ok());
  ASSERT_TRUE(p.Publish("v1").ok());
  Status late = attach("v1", "h", payload.size());
  EXPECT_EQ(late.code(), StatusCode::kFailedPrecondition) << late.ToString();
  EXPECT_NE(late.message().find("already published"), std::string::npos) << late.ToString();
}

TEST(SyntheticChangeFractionTest, StepsChangeAboutFOfTheBf16ElementsClusteredByTensor) {
  SyntheticWeights w{7, 1e-3f, 0.01f};
  int64_t total = 0, changed = 0;
  double lo = 1, hi = 0;
  for (int t = 0; t < 8; ++t) {
    refit::TensorSpec spec{"model.layers." + std::to_string(t) + ".mlp.up_proj.weight", DType::kBF16, {256, 256}};
    const refit::Box box{{0, 0}, {256, 256}};
    auto a = ComputeBf16(w, spec, box, 3), b = ComputeBf16(w, spec, box, 4);
    int64_t c = 0;
    for (size_t i = 0; i < a.size(); ++i) c += a[i] != b[i];
    total += static_cast<int64_t>(a.size());
    changed += c;
    const double f = static_cast<double>(c) / static_cast<double>(a.size());
    lo = std::min(lo, f);
    hi = std::max(hi, f);
    // Advancing a master step by step equals computing it from scratch (trainer export relies on it).
    std::vector<float> m(static_cast<size_t>(box.numel())), scratch(m.size());
    ComputeMaster(w, spec, box, 3, m.data());
    AdvanceMaster(w, spec, box, 3, m.data());
    ComputeMaster(w, spec, box, 4, scratch.data());
    EXPECT_EQ(m, scratch);
  }
  const double f = static_cast<double>(changed) / static_cast<double>(total);
  EXPECT_GT(f, 0.004);
  EXPECT_LT(f, 0.02);
  EXPECT_GT(hi, 2 * lo) << "some tensors change more than others";
  // F = 1 (the default) is the dense formula: nearly every element changes.
  SyntheticWeights dense{7, 1e-3f};
  refit::TensorSpec spec{"w", DType::kBF16, {64, 64}};
  auto a = ComputeBf16(dense, spec, refit::Box{{0, 0}, {64, 64}}, 0), b = ComputeBf16(dense, spec, refit::Box{{0, 0}, {64, 64}}, 1);
  int64_t c = 0;
  for (size_t i = 0; i < a.size(); ++i) c += a[i] != b[i];
  EXPECT_GT(c, 64 * 64 / 2);
}

}  // namespace
}  // namespace rc::trainer
