// The receiver's delta decode/map/apply/verify (delta_apply.h) against a scalar reference: every
// changed element of every source shard, mapped element by element through the captured copies
// (global coordinates, CapturedCopy arithmetic, digest ownership by box tests), must give exactly
// the (rank, parameter, destination, global index, value, owned) tuples the tile-bulk path
// produces; the prediction must equal the digest of the new version; the install must leave the
// parameters equal to the reference's; the post-install digest must see a write that did not land.
#include "receiver/delta_apply.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <tuple>

#include "receiver/device_delta.h"
#include "rolloutcore/refit/delta.h"
#include "rolloutcore/refit/digest.h"

namespace rc::receiver::internal {
namespace {

using refit::Box;
using refit::CapturedCopy;
using refit::DType;
using refit::Shape;

// (rank, param, dest, global, new bf16 bits, owned)
using Elem = std::tuple<uint32_t, uint32_t, int64_t, uint64_t, uint64_t, bool>;

struct Tensor {
  std::string name;
  Shape shape;
  std::vector<Box> shards;  // source (trainer) shards
  std::vector<uint16_t> old_bits, new_bits;
};

CapturedCopy Copy(const Tensor& t, Box box, uint32_t param, std::vector<int32_t> view_to_source, Shape dest_shape,
                  Shape dest_strides, int64_t dest_offset, DType dest = DType::kF32) {
  CapturedCopy c;
  c.source = t.name;
  c.source_dtype = DType::kBF16;
  c.source_shape = t.shape;
  c.box = std::move(box);
  c.view_to_source = std::move(view_to_source);
  c.param = param;
  c.dest_offset = dest_offset;
  c.dest_shape = std::move(dest_shape);
  c.dest_strides = std::move(dest_strides);
  c.convert = dest != DType::kBF16;
  return c;
}

bool Inside(const Box& b, const std::vector<int64_t>& coords) {
  for (size_t d = 0; d < b.ndim(); ++d) {
    if (coords[d] < b.start[d] || coords[d] >= b.start[d] + b.extent[d]) return false;
  }
  return true;
}

// The live parameters are f32 (bf16 widened, the engine before weights kept their dtype) or bf16
// (the engine's default for bf16 weights: deltas write 2-byte elements in place).
class DeltaApplyTest : public ::testing::TestWithParam<DType> {
 protected:
  DType dest() const { return GetParam(); }
  size_t esize() const { return refit::DTypeSize(dest()); }
  // The live element `dest` of parameter p as its bf16 source bits (exact for both dtypes).
  uint32_t LiveBits(const Parameter* p, int64_t dest) const {
    if (dest_is_bf16()) {
      uint16_t h;
      std::memcpy(&h, p->bytes() + dest * 2, 2);
      return h;
    }
    uint32_t u;
    std::memcpy(&u, p->bytes() + dest * 4, 4);
    return u >> 16;
  }
  bool dest_is_bf16() const { return GetParam() == DType::kBF16; }
  void SetUp() override {
    std::mt19937 rng(7);
    // w [150, 300], trainer shards on rows 0..80 and 80..150 (tiles 64 x 128: partial last tiles).
    tensors_.push_back({"w", {150, 300}, {Box{{0, 0}, {80, 300}}, Box{{80, 0}, {70, 300}}}, {}, {}});
    // t [40, 70], installed transposed.
    tensors_.push_back({"t", {40, 70}, {Box{{0, 0}, {40, 70}}}, {}, {}});
    // n [1000], replicated on both engine ranks, two trainer shards.
    tensors_.push_back({"n", {1000}, {Box{{0}, {600}}, Box{{600}, {400}}}, {}, {}});
    // e [3, 10, 70], trainer shards on dim 1; a partial box of it installed.
    tensors_.push_back({"e", {3, 10, 70}, {Box{{0, 0, 0}, {3, 4, 70}}, Box{{0, 4, 0}, {3, 6, 70}}}, {}, {}});
    // s: a scalar.
    tensors_.push_back({"s", {}, {Box{{}, {}}}, {}, {}});
    for (Tensor& t : tensors_) {
      const int64_t n = refit::NumElements(t.shape);
      t.old_bits.resize(static_cast<size_t>(n));
      for (auto& b : t.old_bits) b = static_cast<uint16_t>(0x3c00 + rng() % 0x0400);  // finite bf16
      t.new_bits = t.old_bits;
      std::bernoulli_distribution pick(t.name == "n" ? 0.3 : 0.05);  // "n": bitmap tiles
      for (auto& b : t.new_bits) {
        if (pick(rng)) b = static_cast<uint16_t>(b ^ (1u + rng() % 0x3ff));
      }
      if (t.name == "s") t.new_bits[0] ^= 1;
    }
    const Tensor &w = tensors_[0], &tt = tensors_[1], &nn = tensors_[2], &e3 = tensors_[3], &s = tensors_[4];
    // Rank 0: w[:, 0:150] -> w0, t transposed -> tT, n -> n, e[:, 2:9, 10:60] -> e0, s -> s.
    caps_.resize(2);
    const DType d = dest();
    caps_[0].params = {{"w0", d, {150, 150}}, {"tT", d, {70, 40}}, {"n", d, {1000}}, {"e0", d, {3, 7, 50}}, {"s", d, {1}}};
    caps_[0].copies = {Copy(w, Box{{0, 0}, {150, 150}}, 0, {0, 1}, {150, 150}, {150, 1}, 0, d),
                       Copy(tt, Box{{0, 0}, {40, 70}}, 1, {1, 0}, {70, 40}, {40, 1}, 0, d),
                       Copy(nn, Box{{0}, {1000}}, 2, {0}, {1000}, {1}, 0, d),
                       Copy(e3, Box{{0, 2, 10}, {3, 7, 50}}, 3, {0, 1, 2}, {3, 7, 50}, {350, 50, 1}, 0, d),
                       Copy(s, Box{{}, {}}, 4, {}, {}, {}, 0, d)};
    // Rank 1: w[100:150, :] -> wtail (first: it owns w[100:150, 150:300]), w[:, 150:300] -> w1
    // (owns only rows 0..100 of it: partial ownership), n again (owns nothing: replicated).
    caps_[1].params = {{"wtail", d, {50, 300}}, {"w1", d, {150, 150}}, {"n", d, {1000}}};
    caps_[1].copies = {Copy(w, Box{{100, 0}, {50, 300}}, 0, {0, 1}, {50, 300}, {300, 1}, 0, d),
                       Copy(w, Box{{0, 150}, {150, 150}}, 1, {0, 1}, {150, 150}, {150, 1}, 0, d),
                       Copy(nn, Box{{0}, {1000}}, 2, {0}, {1000}, {1}, 0, d)};
    std::vector<const refit::Capture*> ptrs{&caps_[0], &caps_[1]};
    regions_ = refit::AssignDigestOwnership(ptrs);

    // Manifest, payloads, and every shard pulled whole for every rank.
    for (const Tensor& t : tensors_) {
      refit::ShardTable table;
      table.name = t.name;
      table.dtype = DType::kBF16;
      table.shape = t.shape;
      for (const Box& b : t.shards) {
        refit::ShardInfo si;
        si.rank = static_cast<int32_t>(table.shards.size());
        si.offset = b.start;
        si.shape = b.extent;
        table.shards.push_back(si);
      }
      manifest_.tables.push_back(table);
    }
    for (size_t r = 0; r < caps_.size(); ++r) {
      std::vector<std::vector<uint64_t>> tile_at;
      const size_t first = staged_.shards.size();
      for (size_t ti = 0; ti < tensors_.size(); ++ti) {
        for (size_t si = 0; si < tensors_[ti].shards.size(); ++si) {
          auto [old_box, new_box] = ShardContents(tensors_[ti], tensors_[ti].shards[si]);
          const Shape& local = tensors_[ti].shards[si].extent;
          refit::EncodedDelta enc = refit::EncodeShardDelta(DType::kBF16, local, old_box.data(), new_box.data());
          DeltaShard& sh = staged_.shards.emplace_back();
          sh.rank = static_cast<uint32_t>(r);
          sh.table = static_cast<uint32_t>(ti);
          sh.shard = static_cast<uint32_t>(si);
          sh.dtype = DType::kBF16;
          sh.tiling = refit::TilingFor(local);
          auto table = refit::ParseDeltaTable(DType::kBF16, local, enc.bytes, enc.bytes.size());
          ASSERT_TRUE(table.ok()) << table.status().ToString();
          sh.entries = *table;
          sh.bodies = enc.bytes;
          std::vector<uint64_t> at;
          for (const refit::DeltaTile& entry : sh.entries) at.push_back(entry.offset);
          tile_at.push_back(at);
        }
      }
      // Live parameters hold the old values (exact bf16 -> f32 widening).
      live_.emplace_back();
      params_.emplace_back();
      for (const refit::TensorSpec& p : caps_[r].params) {
        ASSERT_TRUE(params_[r].Add(p.name, p.shape, dest_is_bf16() ? formats::DType::kBF16 : formats::DType::kF32).ok());
        const Parameter* param = params_[r].Find(p.name);
        live_[r].emplace(p.name, std::span<std::byte>(param->bytes(), param->nbytes()));
      }
      for (const CapturedCopy& c : caps_[r].copies) ForEachCopied(r, c, /*use_new=*/false, true);
      ASSERT_TRUE(PlanDeltaRank(manifest_, r, caps_[r], regions_[r], live_, first, tile_at, &staged_).ok());
    }
    for (const Tensor& t : tensors_) staged_.base_digests[t.name] = CoveredDigest(t, false);
  }

  // The digest of the part of t the engine installs (all of it, but for e), old or new values.
  uint64_t CoveredDigest(const Tensor& t, bool use_new) {
    const Box covered = t.name == "e" ? Box{{0, 2, 10}, {3, 7, 50}} : refit::FullBox(t.shape);
    auto [o, n] = ShardContents(t, covered);
    return refit::DigestBlock(DType::kBF16, t.shape, covered, use_new ? n.data() : o.data());
  }

  // The shard box's old and new contents (row-major).
  std::pair<std::vector<uint16_t>, std::vector<uint16_t>> ShardContents(const Tensor& t, const Box& b) {
    std::vector<uint16_t> o, n;
    ForEachInBox(t, b, [&](const std::vector<int64_t>&, int64_t gi) {
      o.push_back(t.old_bits[static_cast<size_t>(gi)]);
      n.push_back(t.new_bits[static_cast<size_t>(gi)]);
    });
    return {o, n};
  }

  template <typename F>
  static void ForEachInBox(const Tensor& t, const Box& b, F&& f) {
    const size_t nd = t.shape.size();
    const Shape g = refit::RowMajorStrides(t.shape);
    std::vector<int64_t> idx(nd, 0);
    if (b.numel() == 0) return;
    for (;;) {
      std::vector<int64_t> coords(nd);
      int64_t gi = 0;
      for (size_t d = 0; d < nd; ++d) {
        coords[d] = b.start[d] + idx[d];
        gi += coords[d] * g[d];
      }
      f(coords, gi);
      size_t d = nd;
      bool done = true;
      while (d > 0) {
        --d;
        if (++idx[d] < b.extent[d]) {
          done = false;
          break;
        }
        idx[d] = 0;
      }
      if (done) return;
    }
  }

  static int64_t DestOf(const CapturedCopy& c, const std::vector<int64_t>& coords) {
    int64_t d = c.dest_offset;
    for (size_t k = 0; k < c.view_to_source.size(); ++k) {
      const int32_t s = c.view_to_source[k];
      if (s >= 0) d += (coords[static_cast<size_t>(s)] - c.box.start[static_cast<size_t>(s)]) * c.dest_strides[k];
    }
    return d;
  }

  const Tensor& TensorOf(const std::string& name) const {
    return *std::find_if(tensors_.begin(), tensors_.end(), [&](const Tensor& t) { return t.name == name; });
  }

  // Writes copy c's old or new values into rank r's live parameter (write) and/or returns the
  // scalar reference's tuples of the changed elements it installs.
  std::vector<Elem> ForEachCopied(size_t r, const CapturedCopy& c, bool use_new, bool write) {
    std::vector<Elem> out;
    const Tensor& t = TensorOf(c.source);
    const Parameter* p = params_[r].Find(caps_[r].params[c.param].name);
    ForEachInBox(t, c.box, [&](const std::vector<int64_t>& coords, int64_t gi) {
      const uint16_t nb = t.new_bits[static_cast<size_t>(gi)];
      const int64_t dest = DestOf(c, coords);
      if (write) {
        const uint16_t b = use_new ? nb : t.old_bits[static_cast<size_t>(gi)];
        if (dest_is_bf16()) {
          std::memcpy(p->bytes() + dest * 2, &b, 2);
        } else {
          const uint32_t f = static_cast<uint32_t>(b) << 16;
          std::memcpy(p->bytes() + dest * 4, &f, 4);
        }
      }
      if (nb == t.old_bits[static_cast<size_t>(gi)]) return;
      const uint32_t ci = static_cast<uint32_t>(&c - caps_[r].copies.data());
      bool owned = false;
      for (const refit::DigestRegion& reg : regions_[r]) owned = owned || (reg.copy == ci && Inside(reg.box, coords));
      out.emplace_back(static_cast<uint32_t>(r), c.param, dest, static_cast<uint64_t>(gi), nb, owned);
    });
    return out;
  }

  // Every rank's live parameters back to the old version.
  void ResetOld() {
    for (size_t r = 0; r < caps_.size(); ++r) {
      for (const CapturedCopy& c : caps_[r].copies) ForEachCopied(r, c, false, true);
    }
  }
  // Every rank's live parameter bytes, by name.
  std::vector<std::map<std::string, std::vector<std::byte>>> Snapshot() const {
    std::vector<std::map<std::string, std::vector<std::byte>>> out(caps_.size());
    for (size_t r = 0; r < caps_.size(); ++r) {
      for (const auto& [name, p] : params_[r].all()) out[r][name].assign(p.bytes(), p.bytes() + p.nbytes());
    }
    return out;
  }

  std::vector<Tensor> tensors_;
  std::vector<refit::Capture> caps_;
  std::vector<std::vector<refit::DigestRegion>> regions_;
  refit::Manifest manifest_;
  std::vector<ParameterStore> params_;
  std::vector<refit::DestinationBuffers> live_;
  DeltaStaged staged_;
};

TEST_P(DeltaApplyTest, TileBulkMappingEqualsTheScalarReference) {
  std::vector<Elem> want, got;
  for (size_t r = 0; r < caps_.size(); ++r) {
    for (const CapturedCopy& c : caps_[r].copies) {
      auto e = ForEachCopied(r, c, false, false);
      want.insert(want.end(), e.begin(), e.end());
    }
  }
  for (size_t j = 0; j < staged_.jobs.size(); ++j) {
    const DeltaPiece& p = staged_.pieces[staged_.jobs[j].piece];
    ASSERT_TRUE(ForEachDeltaElement(staged_, j, [&](int64_t dest, uint64_t global, uint64_t bits, bool owned) {
                  got.emplace_back(p.rank, p.param, dest, global, bits, owned);
                }).ok());
  }
  std::sort(want.begin(), want.end());
  std::sort(got.begin(), got.end());
  ASSERT_GT(want.size(), 1000u);
  EXPECT_EQ(got, want);
  // Partial ownership was exercised: some changed elements of w1 are owned, some not.
  int owned_w1 = 0, unowned_w1 = 0;
  for (const Elem& e : want) {
    if (std::get<0>(e) == 1 && std::get<1>(e) == 1) (std::get<5>(e) ? owned_w1 : unowned_w1)++;
  }
  EXPECT_GT(owned_w1, 0);
  EXPECT_GT(unowned_w1, 0);
}

TEST_P(DeltaApplyTest, PredictApplyAndVerifyMatchTheNewVersion) {
  for (int threads : {1, 3}) {
    SCOPED_TRACE(threads);
    // Reset the live parameters to the old version.
    for (size_t r = 0; r < caps_.size(); ++r) {
      for (const CapturedCopy& c : caps_[r].copies) ForEachCopied(r, c, false, true);
    }
    ASSERT_TRUE(PredictDelta(manifest_, caps_, live_, threads, &staged_).ok());
    for (const Tensor& t : tensors_) {
      EXPECT_EQ(staged_.predicted[t.name], CoveredDigest(t, true)) << t.name;
      EXPECT_NE(staged_.predicted[t.name], CoveredDigest(t, false)) << t.name;
    }
    // The reference install on copies of the parameters, the bulk one on the live ones.
    std::vector<std::map<std::string, std::vector<std::byte>>> before(caps_.size());
    for (size_t r = 0; r < caps_.size(); ++r) {
      for (const auto& [name, p] : params_[r].all()) before[r][name].assign(p.bytes(), p.bytes() + p.nbytes());
    }
    for (size_t r = 0; r < caps_.size(); ++r) ASSERT_TRUE(ApplyDelta(staged_, r, caps_[r], params_[r], threads).ok());
    int64_t changed_floats = 0;
    for (size_t r = 0; r < caps_.size(); ++r) {
      for (const CapturedCopy& c : caps_[r].copies) {
        for (const Elem& e : ForEachCopied(r, c, true, false)) {
          const Parameter* p = params_[r].Find(caps_[r].params[std::get<1>(e)].name);
          EXPECT_EQ(LiveBits(p, std::get<2>(e)), static_cast<uint32_t>(std::get<4>(e)));
          std::memcpy(before[r][p->name].data() + std::get<2>(e) * esize(), p->bytes() + std::get<2>(e) * esize(),
                      esize());
          ++changed_floats;
        }
      }
      // Nothing else moved.
      for (const auto& [name, p] : params_[r].all()) {
        EXPECT_EQ(0, std::memcmp(before[r][name].data(), p.bytes(), p.nbytes())) << "rank " << r << " " << name;
      }
    }
    EXPECT_GT(changed_floats, 1000);
    auto after = DigestAfterDelta(staged_, caps_, live_, threads);
    ASSERT_TRUE(after.ok()) << after.status().ToString();
    EXPECT_EQ(*after, staged_.predicted);
    // A write that did not land (the first write of rank 0 flipped back) is seen.
    ASSERT_TRUE(staged_.first_write[0].has_value());
    const DeltaWrite& w = *staged_.first_write[0];
    auto* e = params_[0].Find(caps_[0].params[w.param].name)->bytes() + w.offset * esize();
    *e ^= std::byte{0x01};
    auto bad = DigestAfterDelta(staged_, caps_, live_, threads);
    ASSERT_TRUE(bad.ok());
    EXPECT_NE(*bad, staged_.predicted);
    *e ^= std::byte{0x01};
  }
}

// The staging path: the stage pass that also writes (apply) leaves the image exactly as the
// install would, and its prediction is the digest of what the image holds — so an image that is not
// at the claimed base, a wrong delta value, or a store that does not land all show as a mismatch.
TEST_P(DeltaApplyTest, ApplyPassWritesTheImageAndPredictsItsDigest) {
  const refit::TensorDigests old_digests = staged_.base_digests;
  for (int threads : {1, 3}) {
    SCOPED_TRACE(threads);
    ResetOld();
    ASSERT_TRUE(PredictDelta(manifest_, caps_, live_, threads, &staged_).ok());
    for (size_t r = 0; r < caps_.size(); ++r) ASSERT_TRUE(ApplyDelta(staged_, r, caps_[r], params_[r], threads).ok());
    const auto installed = Snapshot();
    ResetOld();
    ASSERT_TRUE(PredictDelta(manifest_, caps_, live_, threads, &staged_, /*apply=*/true).ok());
    EXPECT_EQ(Snapshot(), installed) << "the apply pass writes what the install writes, nothing else";
    for (const Tensor& t : tensors_) EXPECT_EQ(staged_.predicted[t.name], CoveredDigest(t, true)) << t.name;
    auto read_back = DigestAfterDelta(staged_, caps_, live_, threads);
    ASSERT_TRUE(read_back.ok());
    EXPECT_EQ(*read_back, staged_.predicted);

    // The image already holds the new version but is claimed to be at the old one (a staging image
    // that is not what the chain says): the prediction is the old digest, not the manifest's.
    ASSERT_TRUE(PredictDelta(manifest_, caps_, live_, threads, &staged_, /*apply=*/true).ok());
    for (const Tensor& t : tensors_) EXPECT_NE(staged_.predicted[t.name], CoveredDigest(t, true)) << t.name;
    EXPECT_EQ(staged_.predicted, old_digests);

    // A wrong delta value (one bit of the last value of every pulled body).
    ResetOld();
    auto flip_last_values = [&] {
      for (DeltaShard& sh : staged_.shards) {
        if (sh.bodies.size() >= 2) sh.bodies[sh.bodies.size() - 2] ^= std::byte{0x01};
      }
    };
    flip_last_values();
    ASSERT_TRUE(PredictDelta(manifest_, caps_, live_, threads, &staged_, /*apply=*/true).ok());
    bool wrong = false;
    for (const Tensor& t : tensors_) wrong = wrong || staged_.predicted[t.name] != CoveredDigest(t, true);
    EXPECT_TRUE(wrong);
    flip_last_values();

    // A store that does not land as the delta says: the prediction is what the image holds.
    ResetOld();
    ASSERT_TRUE(PredictDelta(manifest_, caps_, live_, threads, &staged_, /*apply=*/true,
                             /*corrupt_first_write=*/true)
                    .ok());
    bool differs = false;
    for (const Tensor& t : tensors_) differs = differs || staged_.predicted[t.name] != CoveredDigest(t, true);
    EXPECT_TRUE(differs);
    read_back = DigestAfterDelta(staged_, caps_, live_, threads);
    ASSERT_TRUE(read_back.ok());
    EXPECT_EQ(*read_back, staged_.predicted) << "the prediction is the digest of the image as written";
    staged_.base_digests = old_digests;
  }
}

TEST_P(DeltaApplyTest, NonFiniteNewValuesAreRefusedAtStage) {
  Tensor& w = tensors_[0];
  (void)w;
  // Poison one new value inside a pulled body of rank 0's first shard of w: bf16 +Inf.
  DeltaShard& sh = staged_.shards[0];
  ASSERT_EQ(sh.table, 0u);
  const refit::DeltaTile* tile = nullptr;
  for (const refit::DeltaTile& e : sh.entries) {
    if (e.changed > 0) {
      tile = &e;
      break;
    }
  }
  ASSERT_NE(tile, nullptr);
  const uint16_t inf = 0x7f80;
  std::memcpy(sh.bodies.data() + tile->offset + tile->bytes - 2, &inf, 2);  // its last value
  Status s = PredictDelta(manifest_, caps_, live_, 2, &staged_);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("non-finite"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("tensor w"), std::string::npos) << s.ToString();
}

// The device form of the apply pass (device_delta.h): the table of every rank, run through the
// kernel's own per-task code on host memory, writes exactly what PredictDelta's apply pass writes
// and predicts the same per-tensor digests; a malformed tile and a non-finite value fail their task
// (nothing of that tile stored) with the CPU path's own messages.
TEST_P(DeltaApplyTest, DeviceTableOnHostEqualsTheApplyPass) {
  const refit::TensorDigests old_digests = staged_.base_digests;
  ResetOld();
  ASSERT_TRUE(PredictDelta(manifest_, caps_, live_, 1, &staged_, /*apply=*/true).ok());
  const auto applied = Snapshot();
  const refit::TensorDigests want = staged_.predicted;
  ResetOld();
  // The device path runs per rank (one receiver per engine rank); the ranks' sums add up per
  // tensor as the CPU pass's do (digest ownership is disjoint over ranks).
  refit::TensorDigests got = old_digests;
  uint64_t writes = 0;
  int64_t want_writes = 0;
  for (size_t r = 0; r < caps_.size(); ++r) {
    EXPECT_EQ(DeviceDeltaIneligibility(staged_, manifest_, r, caps_[r]), "");
    auto table = BuildDeviceDeltaTable(staged_, manifest_, r, caps_[r], live_[r]);
    ASSERT_TRUE(table.ok()) << table.status().ToString();
    EXPECT_FALSE(table->tasks.empty());
    // The bodies are views of the rank's pulled shard bodies, back to back, none copied.
    uint64_t rank_body_bytes = 0;
    std::vector<const std::byte*> rank_bodies;
    for (const DeltaShard& sh : staged_.shards) {
      if (sh.rank != r || sh.bodies.empty()) continue;
      rank_body_bytes += sh.bodies.size();
      rank_bodies.push_back(sh.bodies.data());
    }
    EXPECT_EQ(table->body_bytes, rank_body_bytes);
    ASSERT_EQ(table->bodies.size(), rank_bodies.size());
    for (size_t v = 0; v < rank_bodies.size(); ++v) EXPECT_EQ(table->bodies[v].data(), rank_bodies[v]);
    const DeviceDeltaSums sums = EvaluateDeviceDeltaOnHost(*table);
    ASSERT_FALSE(sums.failed_task.has_value());
    for (size_t i = 0; i < table->tensors.size(); ++i) {
      got[table->tensors[i]] += sums.new_terms[i] - sums.old_terms[i];
    }
    writes += sums.writes;
    want_writes += staged_.ranks[r].writes;
  }
  EXPECT_EQ(Snapshot(), applied) << "the device tasks write what the apply pass writes, nothing else";
  EXPECT_EQ(got, want);
  for (const Tensor& t : tensors_) EXPECT_EQ(got[t.name], CoveredDigest(t, true)) << t.name;
  EXPECT_EQ(writes, static_cast<uint64_t>(want_writes));
  // One rank's prediction is its base plus its own sums (PredictedAfterDeviceDelta).
  ResetOld();
  auto t0 = BuildDeviceDeltaTable(staged_, manifest_, 0, caps_[0], live_[0]);
  ASSERT_TRUE(t0.ok());
  const DeviceDeltaSums s0 = EvaluateDeviceDeltaOnHost(*t0);
  const refit::TensorDigests p0 = PredictedAfterDeviceDelta(old_digests, *t0, s0);
  EXPECT_EQ(p0.at("t"), CoveredDigest(TensorOf("t"), true)) << "rank 0 alone holds all of t";

  // A missing image parameter is named.
  refit::DestinationBuffers partial = live_[0];
  partial.erase("tT");
  auto missing = BuildDeviceDeltaTable(staged_, manifest_, 0, caps_[0], partial);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(missing.status().message().find("tT"), std::string::npos) << missing.status().ToString();

  // A non-finite new value: its task fails before storing anything, the message names the tensor.
  // The table views the pulled bodies (not a copy), so the value goes into a copy of the staged delta.
  ResetOld();
  const auto old_image = Snapshot();
  DeltaStaged with_inf = staged_;
  auto table = BuildDeviceDeltaTable(with_inf, manifest_, 0, caps_[0], live_[0]);
  ASSERT_TRUE(table.ok());
  const cuda::internal::DeltaTask first = table->tasks[0];
  const std::span<const std::byte> first_body = TaskBody(*table, first);
  ASSERT_EQ(first_body.size(), first.bytes);
  DeltaShard& first_shard = with_inf.shards[with_inf.pieces[table->task_piece[0]].shard];
  ASSERT_GE(first_body.data(), first_shard.bodies.data()) << "the table views the shard's bodies, not a copy";
  const auto at = static_cast<size_t>(first_body.data() - first_shard.bodies.data());
  ASSERT_LE(at + first.bytes, first_shard.bodies.size());
  const uint16_t inf = 0x7f80;
  std::memcpy(first_shard.bodies.data() + at + first.bytes - 2, &inf, 2);  // the tile's last value
  cuda::internal::DeltaTask outside = first;
  outside.body = table->body_bytes - 1;  // past the end of the last view
  EXPECT_TRUE(TaskBody(*table, outside).empty());
  DeviceDeltaSums bad = EvaluateDeviceDeltaOnHost(*table);
  ASSERT_TRUE(bad.failed_task.has_value());
  EXPECT_EQ(*bad.failed_task, 0u);
  EXPECT_EQ(bad.error, cuda::internal::kDeltaTaskNonFinite);
  Status why = DeviceDeltaTaskError(*table, with_inf, manifest_, *bad.failed_task, bad.error);
  EXPECT_EQ(why.code(), StatusCode::kInvalidArgument) << why.ToString();
  EXPECT_NE(why.message().find("non-finite"), std::string::npos) << why.ToString();
  // Nothing of the failed tile was stored: only the other tasks' elements moved.
  ResetOld();
  auto clean = BuildDeviceDeltaTable(staged_, manifest_, 0, caps_[0], live_[0]);
  ASSERT_TRUE(clean.ok());
  clean->tasks.erase(clean->tasks.begin());
  clean->task_piece.erase(clean->task_piece.begin());
  EXPECT_FALSE(EvaluateDeviceDeltaOnHost(*clean).failed_task.has_value());
  const auto without_first = Snapshot();
  ResetOld();
  EXPECT_EQ(Snapshot(), old_image);
  EvaluateDeviceDeltaOnHost(*table);
  EXPECT_EQ(Snapshot(), without_first);

  // A malformed tile (its index cut short by one byte): DataLoss in the CPU decoder's words.
  ResetOld();
  auto cut = BuildDeviceDeltaTable(staged_, manifest_, 0, caps_[0], live_[0]);
  ASSERT_TRUE(cut.ok());
  size_t varint_task = cut->tasks.size();
  for (size_t i = 0; i < cut->tasks.size(); ++i) {
    if (cut->tasks[i].bitmap == 0 && cut->tasks[i].changed > 2) {
      varint_task = i;
      break;
    }
  }
  ASSERT_LT(varint_task, cut->tasks.size());
  cut->tasks[varint_task].changed -= 1;  // the table now disagrees with the body
  DeviceDeltaSums malformed = EvaluateDeviceDeltaOnHost(*cut);
  ASSERT_TRUE(malformed.failed_task.has_value());
  EXPECT_EQ(*malformed.failed_task, varint_task);
  EXPECT_EQ(malformed.error, cuda::internal::kDeltaTaskMalformed);
  Status malformed_why = DeviceDeltaTaskError(*cut, staged_, manifest_, *malformed.failed_task, malformed.error);
  EXPECT_EQ(malformed_why.code(), StatusCode::kDataLoss) << malformed_why.ToString();

  // A dtype pair the device does not convert (bf16 into an f16 parameter) is named, per tensor.
  DeltaStaged f16 = staged_;
  for (DeltaPiece& p : f16.pieces) {
    if (p.rank == 0 && manifest_.tables[f16.shards[p.shard].table].name == "n") p.dest = DType::kF16;
  }
  const std::string why_not = DeviceDeltaIneligibility(f16, manifest_, 0, caps_[0]);
  EXPECT_NE(why_not.find("tensor n"), std::string::npos) << why_not;
  EXPECT_NE(why_not.find("f16"), std::string::npos) << why_not;
  auto refused = BuildDeviceDeltaTable(f16, manifest_, 0, caps_[0], live_[0]);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  staged_.base_digests = old_digests;
}

INSTANTIATE_TEST_SUITE_P(LiveDType, DeltaApplyTest, ::testing::Values(DType::kF32, DType::kBF16),
                         [](const ::testing::TestParamInfo<DType>& i) {
                           return std::string(i.param == DType::kBF16 ? "bf16" : "f32");
                         });

TEST(DeltaApplyBitsTest, InstalledBitsFastEqualsInstalledSourceBits) {
  std::mt19937 rng(3);
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = static_cast<uint32_t>(rng());
    if (i % 2 == 0) u &= 0xffff0000u;  // exact widenings half the time
    std::byte e[4];
    std::memcpy(e, &u, 4);
    for (auto [src, dst] : {std::pair{DType::kBF16, DType::kF32}, std::pair{DType::kF32, DType::kF32},
                            std::pair{DType::kF16, DType::kF32}, std::pair{DType::kBF16, DType::kBF16}}) {
      ASSERT_EQ(InstalledBitsFast(src, dst, e), refit::InstalledSourceBits(src, dst, e)) << u;
    }
  }
}

}  // namespace
}  // namespace rc::receiver::internal
