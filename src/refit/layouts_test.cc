#include "rolloutcore/refit/layouts.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "refit/test_util.h"
#include "rolloutcore/refit/verify.h"

namespace rc::refit {
namespace {

using ::testing::HasSubstr;
using testing::ElementAt;
using testing::World;

ModelConfig SmallGqa() {
  ModelConfig c = *ModelPreset("tiny");
  c.name = "gqa-8-2";
  c.hidden_size = 16;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 2;
  c.head_dim = 4;
  c.intermediate_size = 24;
  c.vocab_size = 32;
  c.num_hidden_layers = 1;
  c.dtype = DType::kF32;
  return c;
}

// Publishes the model's tensors with `layout` into a World.
void Publish(World& w, const ModelConfig& c, const TrainerLayout& layout) {
  auto m = MakeTrainerManifest(c, layout);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  for (auto& t : m->tables) w.AddTensor(t.name, t.dtype, t.shape, t.shards);
}

// Row `row` of parameter bytes (width h) must equal row `src_row` of source tensor `src`.
void ExpectRow(const World& w, const std::vector<std::byte>& param, DType pdt, int64_t row, int64_t h,
               const std::string& src, int64_t src_row, DType sdt) {
  for (int64_t j = 0; j < h; ++j) {
    ASSERT_EQ(ElementAt(pdt, param, row * h + j), ElementAt(sdt, w.Full(src), src_row * h + j))
        << "param row " << row << " col " << j << " from " << src << " row " << src_row;
  }
}

class FusedQkvTest : public ::testing::TestWithParam<int> {};

TEST_P(FusedQkvTest, GqaRowsAndColumnsPerRank) {
  const int tp = GetParam();
  const ModelConfig c = SmallGqa();
  World w;
  Publish(w, c, TrainerLayout{TrainerLayout::Kind::kFsdp, 3});
  EngineLayout l;
  l.tp = tp;
  const int64_t h = 16, d = 4, qpr = 8 / tp, kvl = tp <= 2 ? 2 / tp : 1, inter = 24 / tp;
  for (int r = 0; r < tp; ++r) {
    auto params = ListEngineParams(c, l, r);
    ASSERT_TRUE(params.ok());
    auto rr = testing::PlanAndRun(w, *params, [&](LoadContext& ctx) { return LoadEngineRank(c, l, r, ctx); });
    ASSERT_TRUE(rr.ok()) << rr.status().ToString();
    const auto& qkv = rr->params.at("model.layers.0.self_attn.qkv_proj.weight");
    ASSERT_EQ(qkv.size(), static_cast<size_t>((qpr + 2 * kvl) * d * h * 4));
    const int64_t kv_head = tp <= 2 ? r * kvl : r / (tp / 2);
    for (int64_t i = 0; i < qpr * d; ++i) {
      ExpectRow(w, qkv, DType::kF32, i, h, "model.layers.0.self_attn.q_proj.weight", r * qpr * d + i, DType::kF32);
    }
    for (int64_t i = 0; i < kvl * d; ++i) {
      ExpectRow(w, qkv, DType::kF32, qpr * d + i, h, "model.layers.0.self_attn.k_proj.weight", kv_head * d + i, DType::kF32);
      ExpectRow(w, qkv, DType::kF32, (qpr + kvl) * d + i, h, "model.layers.0.self_attn.v_proj.weight", kv_head * d + i,
                DType::kF32);
    }
    // o_proj: columns r*qpr*d.. ; gate_up: [gate rows; up rows]; down: columns.
    const auto& o = rr->params.at("model.layers.0.self_attn.o_proj.weight");
    const auto& gu = rr->params.at("model.layers.0.mlp.gate_up_proj.weight");
    const auto& down = rr->params.at("model.layers.0.mlp.down_proj.weight");
    for (int64_t i = 0; i < h; ++i) {
      for (int64_t j = 0; j < qpr * d; ++j) {
        ASSERT_EQ(ElementAt(DType::kF32, o, i * qpr * d + j),
                  ElementAt(DType::kF32, w.Full("model.layers.0.self_attn.o_proj.weight"), i * 32 + r * qpr * d + j));
      }
      for (int64_t j = 0; j < inter; ++j) {
        ASSERT_EQ(ElementAt(DType::kF32, down, i * inter + j),
                  ElementAt(DType::kF32, w.Full("model.layers.0.mlp.down_proj.weight"), i * 24 + r * inter + j));
      }
    }
    for (int64_t i = 0; i < inter; ++i) {
      ExpectRow(w, gu, DType::kF32, i, h, "model.layers.0.mlp.gate_proj.weight", r * inter + i, DType::kF32);
      ExpectRow(w, gu, DType::kF32, inter + i, h, "model.layers.0.mlp.up_proj.weight", r * inter + i, DType::kF32);
    }
    EXPECT_EQ(rr->params.at("model.embed_tokens.weight"), w.Full("model.embed_tokens.weight"));
    EXPECT_EQ(rr->params.at("model.layers.0.self_attn.k_norm.weight"), w.Full("model.layers.0.self_attn.k_norm.weight"));
    EXPECT_EQ(rr->plan.stats.bytes_planned, rr->plan.stats.bytes_needed) << "no full pull expected at budget 64";
  }
}

INSTANTIATE_TEST_SUITE_P(Tp, FusedQkvTest, ::testing::Values(1, 2, 4, 8));

TEST(MoeLayoutTest, ExpertsIntoFusedTensorsAtEp2) {
  ModelConfig c = *ModelPreset("tiny-moe");
  c.dtype = DType::kF32;
  World w;
  Publish(w, c, TrainerLayout{TrainerLayout::Kind::kFsdp, 4});
  auto l = ParseEngineLayout("tp:2+ep:2");
  ASSERT_TRUE(l.ok());
  const int64_t h = 64, im = 32, local = 4;
  for (int r = 0; r < 2; ++r) {
    auto params = ListEngineParams(c, *l, r);
    ASSERT_TRUE(params.ok());
    auto rr = testing::PlanAndRun(w, *params, [&](LoadContext& ctx) { return LoadEngineRank(c, *l, r, ctx); });
    ASSERT_TRUE(rr.ok()) << rr.status().ToString();
    const auto& w13 = rr->params.at("model.layers.1.mlp.experts.w13_weight");
    const auto& w2 = rr->params.at("model.layers.1.mlp.experts.w2_weight");
    ASSERT_EQ(w13.size(), static_cast<size_t>(local * 2 * im * h * 4));
    for (int64_t j = 0; j < local; ++j) {
      const int64_t e = r * local + j;
      const std::string base = "model.layers.1.mlp.experts." + std::to_string(e) + ".";
      for (int64_t i = 0; i < im; ++i) {
        ExpectRow(w, w13, DType::kF32, j * 2 * im + i, h, base + "gate_proj.weight", i, DType::kF32);
        ExpectRow(w, w13, DType::kF32, j * 2 * im + im + i, h, base + "up_proj.weight", i, DType::kF32);
      }
      for (int64_t i = 0; i < h; ++i) ExpectRow(w, w2, DType::kF32, j * h + i, im, base + "down_proj.weight", i, DType::kF32);
    }
    EXPECT_EQ(rr->params.at("model.layers.1.mlp.gate.weight"), w.Full("model.layers.1.mlp.gate.weight"));
  }
}

TEST(LayoutTest, ParsesLayouts) {
  EXPECT_EQ(ParseTrainerLayout("fsdp:8")->ranks, 8);
  EXPECT_EQ(ParseTrainerLayout("tp:4")->kind, TrainerLayout::Kind::kTp);
  EXPECT_EQ(ParseTrainerLayout("replicated")->ranks, 1);
  EXPECT_EQ(ParseTrainerLayout("replicated:3")->ranks, 3);
  EXPECT_EQ(ParseTrainerLayout("fsdp:0").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseTrainerLayout("zero:2").status().code(), StatusCode::kInvalidArgument);
  auto e = ParseEngineLayout("tp:4+ep:4@bf16");
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->tp, 4);
  EXPECT_EQ(e->ep, 4);
  EXPECT_EQ(e->param_dtype, DType::kBF16);
  EXPECT_EQ(e->ToString(), "tp:4+ep:4@bf16");
  EXPECT_EQ(ParseEngineLayout("ep:4")->world_size(), 4);
  EXPECT_EQ(ParseEngineLayout("tp:2+ep:4").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseEngineLayout("pp:2").status().code(), StatusCode::kInvalidArgument);
}

TEST(LayoutTest, EngineParamsFollowTheContract) {
  const ModelConfig c = *ModelPreset("qwen3-8b");
  auto p = ListEngineParams(c, *ParseEngineLayout("tp:2"), 1);
  ASSERT_TRUE(p.ok());
  std::map<std::string, Shape> shapes;
  for (const auto& s : *p) {
    shapes[s.name] = s.shape;
    EXPECT_EQ(s.dtype, DType::kF32);
  }
  EXPECT_EQ(shapes.at("model.layers.3.self_attn.qkv_proj.weight"), (Shape{(16 + 2 * 4) * 128, 4096}));
  EXPECT_EQ(shapes.at("model.layers.3.self_attn.o_proj.weight"), (Shape{4096, 16 * 128}));
  EXPECT_EQ(shapes.at("model.layers.3.mlp.gate_up_proj.weight"), (Shape{2 * 6144, 4096}));
  EXPECT_EQ(shapes.at("model.layers.3.mlp.down_proj.weight"), (Shape{4096, 6144}));
  EXPECT_EQ(shapes.at("lm_head.weight"), (Shape{151936, 4096}));
  EXPECT_EQ(p->size(), 1u + 36 * 8 + 2);  // per layer: 2 norms, qkv, q/k norm, o, gate_up, down

  const ModelConfig moe = *ModelPreset("qwen3-30b-a3b");
  auto q = ListEngineParams(moe, *ParseEngineLayout("tp:4+ep:4"), 3);
  ASSERT_TRUE(q.ok());
  for (const auto& s : *q) shapes[s.name] = s.shape;
  EXPECT_EQ(shapes.at("model.layers.0.mlp.experts.w13_weight"), (Shape{32, 2 * 768, 2048}));
  EXPECT_EQ(shapes.at("model.layers.0.mlp.experts.w2_weight"), (Shape{32, 2048, 768}));
  EXPECT_EQ(shapes.at("model.layers.0.self_attn.qkv_proj.weight"), (Shape{(8 + 2) * 128, 2048}));
}

TEST(LayoutTest, RefusesIndivisibleLayouts) {
  const ModelConfig c = SmallGqa();
  EngineLayout l;
  l.tp = 3;
  Status s = CheckEngineLayout(c, l);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("num_attention_heads 8 is not divisible by tp 3"));
  ModelConfig c2 = c;
  c2.num_attention_heads = 12;
  c2.num_key_value_heads = 3;
  l.tp = 2;
  EXPECT_THAT(CheckEngineLayout(c2, l).message(), HasSubstr("num_key_value_heads 3 and tp 2"));
  EXPECT_EQ(ListEngineParams(c, EngineLayout{}, 1).status().code(), StatusCode::kInvalidArgument);
  auto m = MakeTrainerManifest(c, TrainerLayout{TrainerLayout::Kind::kTp, 3});
  EXPECT_THAT(m.status().message(), HasSubstr("does not split evenly"));
}

TEST(LayoutTest, TrainerManifestsPartitionEveryTensor) {
  const ModelConfig c = *ModelPreset("tiny-moe");
  for (const char* text : {"fsdp:3", "fsdp:16", "tp:2", "replicated:2"}) {
    auto l = ParseTrainerLayout(text);
    ASSERT_TRUE(l.ok());
    auto m = MakeTrainerManifest(c, *l);
    ASSERT_TRUE(m.ok()) << text << ": " << m.status().ToString();
    for (const auto& t : m->tables) EXPECT_TRUE(ValidateShardTable(t, true).ok()) << text << " " << t.name;
  }
  auto tp = MakeTrainerManifest(c, TrainerLayout{TrainerLayout::Kind::kTp, 2});
  for (const auto& t : tp->tables) {
    if (t.name == "model.layers.0.self_attn.o_proj.weight") {
      EXPECT_EQ(t.shards[1].offset, (Shape{0, 32}));
    }
    if (t.name == "model.norm.weight") {
      EXPECT_EQ(t.shards.size(), 2u);
      EXPECT_EQ(t.shards[0].box(), t.shards[1].box());
    }
  }
}

// End-to-end: every preset-sized tiny model, several layouts, all ranks, bytes and digests.
struct E2eCase {
  const char* model;
  const char* source;
  const char* target;
};

class VerifyE2eTest : public ::testing::TestWithParam<E2eCase> {};

TEST_P(VerifyE2eTest, PlanMatchesDirectLoadAndDigests) {
  const E2eCase& tc = GetParam();
  auto c = ModelPreset(tc.model);
  ASSERT_TRUE(c.ok());
  auto problem = ModelVerifyProblem(*c, *ParseTrainerLayout(tc.source), *ParseEngineLayout(tc.target));
  ASSERT_TRUE(problem.ok()) << problem.status().ToString();
  VerifyOptions o;
  o.seed = 7;
  auto report = Verify(*problem, o);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  for (const auto& r : report->ranks) EXPECT_TRUE(r.bytes_equal) << r.mismatch;
  EXPECT_TRUE(report->digests_match) << report->digest_mismatch;
  EXPECT_TRUE(report->verified());
  EXPECT_GT(report->tensors_compared, 10u);
}

INSTANTIATE_TEST_SUITE_P(
    Models, VerifyE2eTest,
    ::testing::Values(E2eCase{"tiny", "fsdp:3", "tp:1"}, E2eCase{"tiny", "fsdp:8", "tp:2"},
                      E2eCase{"tiny", "tp:2", "tp:4"}, E2eCase{"tiny", "replicated:2", "tp:4@bf16"},
                      E2eCase{"tiny-llama", "fsdp:5", "tp:2"}, E2eCase{"tiny-qwen2", "tp:4", "tp:2"},
                      E2eCase{"tiny-moe", "fsdp:4", "tp:2+ep:2"}, E2eCase{"tiny-moe", "tp:2", "ep:4"}));

TEST(VerifyTest, PartialRefitWithSelector) {
  auto problem = ModelVerifyProblem(*ModelPreset("tiny-moe"), *ParseTrainerLayout("fsdp:2"), *ParseEngineLayout("tp:2+ep:2"));
  ASSERT_TRUE(problem.ok());
  VerifyOptions all, some;
  some.plan.selector.layers = std::pair<int64_t, int64_t>{1, 1};
  some.plan.selector.experts = {1, 6};
  auto full = Verify(*problem, all);
  auto part = Verify(*problem, some);
  ASSERT_TRUE(full.ok() && part.ok()) << part.status().ToString();
  EXPECT_TRUE(part->verified()) << part->digest_mismatch;
  uint64_t full_bytes = 0, part_bytes = 0;
  for (const auto& r : full->ranks) full_bytes += r.plan.bytes_planned;
  for (const auto& r : part->ranks) part_bytes += r.plan.bytes_planned;
  // Two experts of one layer: 2 x 3 x 32 x 64 bf16 elements.
  EXPECT_EQ(part_bytes, 2u * 3 * 32 * 64 * 2);
  EXPECT_LT(part_bytes, full_bytes / 10);
}

}  // namespace
}  // namespace rc::refit
