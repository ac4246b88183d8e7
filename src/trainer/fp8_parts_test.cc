// The trainer's FP8 parts (fp8_parts.h): however the ranks split the projections (whole, FSDP rows
// that cut through scale groups, TP columns, replicas), the parts the directory adds up
// (refit::PublishedFp8Image) are the image of each fused parameter quantized whole, the image
// `model fp8-digest` and the engines compute.
#include "rolloutcore/trainer/fp8_parts.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "rolloutcore/formats/fp8.h"
#include "rolloutcore/formats/safetensors.h"
#include "rolloutcore/refit/manifest.h"

namespace rc::trainer {
namespace {

using refit::Box;
using refit::Shape;

constexpr const char* kQuantizations[] = {"fp8_per_tensor", "fp8_per_channel", "fp8_per_block"};

// One layer whose sizes are not multiples of 128 (so blocks straddle q/k/v and rank boundaries).
struct Layer {
  std::map<std::string, Shape> shapes{{"model.layers.0.self_attn.q_proj.weight", {160, 136}},
                                      {"model.layers.0.self_attn.k_proj.weight", {96, 136}},
                                      {"model.layers.0.self_attn.v_proj.weight", {96, 136}},
                                      {"model.layers.0.self_attn.o_proj.weight", {136, 160}},
                                      {"model.layers.0.mlp.gate_proj.weight", {200, 136}},
                                      {"model.layers.0.mlp.up_proj.weight", {200, 136}},
                                      {"model.layers.0.mlp.down_proj.weight", {136, 200}},
                                      {"model.norm.weight", {136}}};
  std::map<std::string, std::vector<uint16_t>> w;
  explicit Layer(uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 0.02f);
    for (const auto& [name, shape] : shapes) {
      auto& v = w[name];
      v.resize(static_cast<size_t>(refit::NumElements(shape)));
      for (auto& b : v) b = formats::F32ToBF16(normal(rng));
    }
    w["model.layers.0.self_attn.k_proj.weight"][7] = 0x0001;  // a subnormal
    w["model.layers.0.mlp.up_proj.weight"][1000] = formats::F32ToBF16(3.5f);  // one large amax
  }
  // The box of `name` copied out row-major.
  std::vector<uint16_t> Copy(const std::string& name, const Box& b) const {
    const Shape& s = shapes.at(name);
    const int64_t cols = s.size() == 2 ? s[1] : s[0];
    std::vector<uint16_t> out;
    if (s.size() == 1) return std::vector<uint16_t>(w.at(name).begin() + b.start[0],
                                                    w.at(name).begin() + b.start[0] + b.extent[0]);
    for (int64_t r = b.start[0]; r < b.start[0] + b.extent[0]; ++r) {
      const uint16_t* row = w.at(name).data() + r * cols + b.start[1];
      out.insert(out.end(), row, row + b.extent[1]);
    }
    return out;
  }
};

// The image of every fused parameter quantized whole, as an engine computes it.
refit::Fp8Image Whole(const Layer& layer, std::string_view quantization) {
  const formats::Fp8Scheme scheme = *formats::Fp8SchemeFromVllmQuantization(quantization);
  std::vector<refit::TensorSpec> specs;
  for (const auto& [n, s] : layer.shapes) specs.push_back({n, refit::DType::kBF16, s});
  auto params = refit::Fp8Parameters(specs);
  EXPECT_TRUE(params.ok()) << params.status().ToString();
  refit::Fp8Image out;
  for (const auto& [name, p] : *params) {
    std::vector<uint16_t> w;
    for (const auto& part : p.parts) w.insert(w.end(), layer.w.at(part.tensor).begin(), layer.w.at(part.tensor).end());
    formats::Fp8Layout l{scheme, p.shape[0], p.shape[1]};
    std::vector<uint8_t> q(w.size());
    std::vector<float> s(static_cast<size_t>(l.NumScales()));
    EXPECT_TRUE(formats::QuantizeBf16ToFp8(w, l, q, s, name).ok());
    const auto g = l.ScaleGrid();
    const Shape grid{g[0], g[1]};
    out[name] = refit::Fp8ImagePart(p.shape, refit::FullBox(p.shape), q.data(), grid, refit::FullBox(grid), s.data());
  }
  return out;
}

// A rank's shards: `boxes(name, shape)` says which boxes of each tensor it holds.
struct Rank {
  std::vector<std::vector<uint16_t>> bytes;
  std::vector<Fp8ShardInput> meta;
  // The shards, pointing into this Rank's bytes (wherever it was copied to).
  std::vector<Fp8ShardInput> shards() const {
    std::vector<Fp8ShardInput> out = meta;
    for (size_t i = 0; i < out.size(); ++i) out[i].data = bytes[i].data();
    return out;
  }
};

template <typename Boxes>
Rank Hold(const Layer& layer, Boxes boxes) {
  Rank r;
  for (const auto& [name, shape] : layer.shapes) {
    for (const Box& b : boxes(name, shape)) {
      r.bytes.push_back(layer.Copy(name, b));
      r.meta.push_back(Fp8ShardInput{name, refit::DType::kBF16, shape, b, nullptr});
    }
  }
  return r;
}

// Rows [lo, hi) of every tensor, all columns.
auto Rows(double lo, double hi) {
  return [lo, hi](const std::string&, const Shape& s) -> std::vector<Box> {
    const auto rows = static_cast<double>(s[0]);
    const auto a = static_cast<int64_t>(rows * lo), b = static_cast<int64_t>(rows * hi);
    if (b <= a) return {};
    if (s.size() == 1) return {Box{{a}, {b - a}}};
    return {Box{{a, 0}, {b - a, s[1]}}};
  };
}

// The manifest the directory would commit from these ranks' parts.
refit::Manifest Commit(const std::vector<Rank>& ranks, const std::vector<std::vector<std::optional<refit::Fp8ImageDigest>>>& parts,
                       std::string_view quantization) {
  refit::Manifest m;
  std::map<std::string, refit::ShardTable> tables;
  for (size_t r = 0; r < ranks.size(); ++r) {
    for (size_t i = 0; i < ranks[r].meta.size(); ++i) {
      const Fp8ShardInput& s = ranks[r].meta[i];
      auto& t = tables[s.name];
      t.name = s.name;
      t.shape = s.global_shape;
      refit::ShardInfo info{static_cast<int32_t>(r), s.box.start, s.box.extent, "local:x", 0};
      if (parts[r][i]) info.fp8[std::string(quantization)] = *parts[r][i];
      t.shards.push_back(info);
    }
  }
  for (auto& [n, t] : tables) m.tables.push_back(t);
  return m;
}

// Every rank's amax merged by max (what an all-reduce MAX does), then each rank's parts.
std::vector<std::vector<std::optional<refit::Fp8ImageDigest>>> Exchange(
    const std::vector<Rank>& ranks, std::string_view quantization, const std::vector<refit::TensorSpec>& model = {}) {
  std::vector<Fp8Amax> local;
  for (const Rank& r : ranks) {
    auto a = Fp8LocalAmax(r.shards(), quantization, nullptr, 1, model);
    EXPECT_TRUE(a.ok()) << a.status().ToString();
    local.push_back(*a);
  }
  Fp8Amax merged;
  for (const Fp8Amax& a : local) {
    for (const auto& [name, v] : a) {
      auto& m = merged[name];
      if (m.empty()) m.assign(v.size(), 0);
      formats::Fp8MergeAmax(v, m);
    }
  }
  std::vector<std::vector<std::optional<refit::Fp8ImageDigest>>> out;
  for (const Rank& r : ranks) {
    auto p = Fp8PartsFromAmax(r.shards(), quantization, merged, 1, model);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    out.push_back(*p);
  }
  return out;
}

TEST(Fp8PartsTest, OneRankHoldingEverythingPublishesTheWholeImage) {
  const Layer layer(1);
  const Rank all = Hold(layer, Rows(0, 1));
  for (const char* q : kQuantizations) {
    auto parts = Fp8ShardParts(all.shards(), q);  // no exchange: every group is held here
    ASSERT_TRUE(parts.ok()) << q << ": " << parts.status().ToString();
    for (size_t i = 0; i < all.meta.size(); ++i) {
      EXPECT_EQ((*parts)[i].has_value(), all.meta[i].name != "model.norm.weight") << all.meta[i].name;
    }
    auto image = refit::PublishedFp8Image(Commit({all}, {*parts}, q), q);
    ASSERT_TRUE(image.ok()) << image.status().ToString();
    const refit::Fp8Image want = Whole(layer, q);
    ASSERT_EQ(image->size(), 4u) << q;  // qkv, o, gate_up, down
    for (const auto& [name, d] : want) EXPECT_EQ(image->at(name), d) << q << " " << name;
    EXPECT_EQ(refit::Fp8ImageCombined(*image), refit::Fp8ImageCombined(want)) << q;
  }
}

TEST(Fp8PartsTest, FsdpRowsThatCutThroughScaleGroupsAddUpOnceTheAmaxesAreExchanged) {
  const Layer layer(2);
  // Three ranks, row splits at 37 % and 71 % of every tensor: no split is on a block boundary.
  const std::vector<Rank> ranks{Hold(layer, Rows(0, 0.37)), Hold(layer, Rows(0.37, 0.71)), Hold(layer, Rows(0.71, 1))};
  for (const char* q : kQuantizations) {
    auto image = refit::PublishedFp8Image(Commit(ranks, Exchange(ranks, q), q), q);
    ASSERT_TRUE(image.ok()) << image.status().ToString();
    const refit::Fp8Image want = Whole(layer, q);
    for (const auto& [name, d] : want) EXPECT_EQ(image->at(name), d) << q << " " << name;
  }
}

TEST(Fp8PartsTest, TensorParallelColumnsAndDataParallelReplicasAddUp) {
  const Layer layer(3);
  // TP 2 (Megatron: q/k/v/gate/up split by rows, o/down by columns at 64 -- a block boundary --)
  // times DP 2: ranks 2 and 3 replicate ranks 0 and 1.
  auto tp = [](int r) {
    return [r](const std::string& name, const Shape& s) -> std::vector<Box> {
      if (s.size() == 1) return {Box{{0}, {s[0]}}};
      const bool by_cols = name.find("o_proj") != std::string::npos || name.find("down_proj") != std::string::npos;
      if (by_cols) {
        const int64_t cut = 128;
        return {r == 0 ? Box{{0, 0}, {s[0], cut}} : Box{{0, cut}, {s[0], s[1] - cut}}};
      }
      const int64_t cut = s[0] / 2;
      return {r == 0 ? Box{{0, 0}, {cut, s[1]}} : Box{{cut, 0}, {s[0] - cut, s[1]}}};
    };
  };
  const std::vector<Rank> ranks{Hold(layer, tp(0)), Hold(layer, tp(1)), Hold(layer, tp(0)), Hold(layer, tp(1))};
  for (const char* q : kQuantizations) {
    auto parts = Exchange(ranks, q);
    auto image = refit::PublishedFp8Image(Commit(ranks, parts, q), q);
    ASSERT_TRUE(image.ok()) << image.status().ToString();
    const refit::Fp8Image want = Whole(layer, q);
    for (const auto& [name, d] : want) EXPECT_EQ(image->at(name), d) << q << " " << name;
    // A replica that disagrees is refused by name.
    parts[2][0]->bytes ^= 1;
    auto bad = refit::PublishedFp8Image(Commit(ranks, parts, q), q);
    EXPECT_EQ(bad.status().code(), StatusCode::kDataLoss) << bad.status().ToString();
  }
}

TEST(Fp8PartsTest, AGroupHeldOnlyInPartNeedsTheExchangeAndIsNamedWithoutIt) {
  const Layer layer(4);
  const Rank half = Hold(layer, Rows(0, 0.5));
  for (const char* q : {"fp8_per_tensor", "fp8_per_block"}) {
    auto parts = Fp8ShardParts(half.shards(), q);
    ASSERT_EQ(parts.status().code(), StatusCode::kFailedPrecondition) << q;
    EXPECT_NE(parts.status().message().find("scale group"), std::string::npos) << parts.status().ToString();
    EXPECT_NE(parts.status().message().find("exchange"), std::string::npos) << parts.status().ToString();
    // With an exchange the call goes through (here it merges nothing: the test only checks the call).
    int calls = 0;
    auto ok = Fp8ShardParts(half.shards(), q, [&](std::string_view quantization, Fp8Amax* amax) {
      ++calls;
      EXPECT_EQ(quantization, q);
      EXPECT_EQ(amax->size(), 4u);
      return OkStatus();
    });
    EXPECT_TRUE(ok.ok()) << ok.status().ToString();
    EXPECT_EQ(calls, 1);
  }
  // Per channel a row is a group: whole rows need no exchange.
  EXPECT_TRUE(Fp8ShardParts(half.shards(), "fp8_per_channel").ok());
}

// FSDP over more ranks than k_proj has rows: rank 2 holds rows of q_proj but none of k_proj or
// v_proj. Given the model's tensors it still places its q rows, and the sum is the whole image;
// without them it is refused with the way out named.
TEST(Fp8PartsTest, ARankWithoutAShardOfSomePartPlacesItsRowsFromTheModel) {
  const Layer layer(6);
  // Rank r holds rows [40 r, 40 r + 40) of every 2-D tensor that has them: k/v_proj (96 rows) end
  // before rank 3, q_proj (160) does not.
  auto rows = [](int r) {
    return [r](const std::string&, const Shape& s) -> std::vector<Box> {
      if (s.size() == 1) return r == 0 ? std::vector<Box>{Box{{0}, {s[0]}}} : std::vector<Box>{};
      const int64_t a = int64_t{40} * r, b = std::min<int64_t>(s[0], a + 40);
      if (b <= a) return {};
      return {Box{{a, 0}, {b - a, s[1]}}};
    };
  };
  std::vector<Rank> ranks;
  ranks.reserve(5);
  for (int r = 0; r < 5; ++r) ranks.push_back(Hold(layer, rows(r)));
  std::vector<refit::TensorSpec> model;
  for (const auto& [n, s] : layer.shapes) model.push_back({n, refit::DType::kBF16, s});
  auto refused = Fp8LocalAmax(ranks[3].shards(), "fp8_per_channel");
  ASSERT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("fp8_model"), std::string::npos) << refused.status().ToString();
  for (const char* q : kQuantizations) {
    const auto parts = Exchange(ranks, q, model);
    auto image = refit::PublishedFp8Image(Commit(ranks, parts, q), q);
    ASSERT_TRUE(image.ok()) << image.status().ToString();
    const refit::Fp8Image want = Whole(layer, q);
    for (const auto& [name, d] : want) EXPECT_EQ(image->at(name), d) << q << " " << name;
  }
  // A model entry that disagrees with a shard is named.
  model[0].shape = {1, 1};
  auto bad = Fp8LocalAmax(ranks[0].shards(), "fp8_per_tensor", nullptr, 1, model);
  EXPECT_NE(bad.status().message().find("the model says"), std::string::npos) << bad.status().ToString();
}

TEST(Fp8PartsTest, BadInputsAreNamed) {
  Layer layer(5);
  Rank all = Hold(layer, Rows(0, 1));
  EXPECT_EQ(Fp8ShardParts(all.shards(), "fp8").status().code(), StatusCode::kInvalidArgument);
  // A NaN weight is refused with its tensor.
  for (size_t i = 0; i < all.meta.size(); ++i) {
    if (all.meta[i].name == "model.layers.0.mlp.down_proj.weight") all.bytes[i][5] = 0x7FC0;
  }
  auto p = Fp8ShardParts(all.shards(), "fp8_per_block");
  ASSERT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("down_proj"), std::string::npos) << p.status().ToString();
  // A fused parameter whose v_proj this rank does not hold at all: k's rows cannot be placed.
  std::vector<Fp8ShardInput> no_v;
  for (const auto& s : all.shards()) {
    if (s.name.find("v_proj") == std::string::npos) no_v.push_back(s);
  }
  auto nv = Fp8ShardParts(no_v, "fp8_per_channel");
  ASSERT_EQ(nv.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(nv.status().message().find("v_proj"), std::string::npos) << nv.status().ToString();
}

}  // namespace
}  // namespace rc::trainer
