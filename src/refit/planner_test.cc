#include "rolloutcore/refit/planner.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <set>

#include "refit/test_util.h"

namespace rc::refit {
namespace {

using ::testing::HasSubstr;
using testing::ElementAt;
using testing::Loader;
using testing::PlanAndRun;
using testing::ReplicaShards;
using testing::Shard;
using testing::SplitShards;
using testing::World;

// Checks every element of parameter `param` (shape `pshape`, dtype `pdt`) against `expect`, which
// maps a parameter multi-index to the (tensor, linear index) it must come from.
void ExpectParam(const World& w, const testing::RunResult& rr, const std::string& param, DType pdt,
                 const Shape& pshape, const std::function<std::pair<std::string, int64_t>(const Shape&)>& expect) {
  const auto& bytes = rr.params.at(param);
  const Shape strides = RowMajorStrides(pshape);
  const int64_t n = NumElements(pshape);
  Shape idx(pshape.size(), 0);
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    int64_t rem = i;
    for (size_t d = 0; d < pshape.size(); ++d) {
      idx[d] = rem / strides[d];
      rem %= strides[d];
    }
    const auto [tensor, linear] = expect(idx);
    const DType sdt = w.manifest().tables[static_cast<size_t>(w.Tag(tensor) - 1)].dtype;
    const double want = ElementAt(sdt, w.Full(tensor), linear);
    const double got = ElementAt(pdt, bytes, i);
    if (got != want && ++bad <= 3) {
      ADD_FAILURE() << param << " element " << i << ": got " << got << " want " << want << " (" << tensor << "["
                    << linear << "])";
    }
  }
  EXPECT_EQ(bad, 0) << param;
}

Loader Copy(std::string src, std::function<SourceView(const SourceView&)> view, DestRegion dest) {
  return [=](LoadContext& ctx) -> Status {
    RC_ASSIGN_OR_RETURN(SourceView v, ctx.Source(src));
    return ctx.CopyInto(view(v), dest);
  };
}

Loader Both(Loader a, Loader b) {
  return [=](LoadContext& ctx) -> Status {
    RC_RETURN_IF_ERROR(a(ctx));
    return b(ctx);
  };
}

TEST(PlannerTest, ColumnParallelSliceFromFsdpShards) {
  World w;
  w.AddTensor("w", DType::kF32, {8, 12}, SplitShards({8, 12}, 0, 3));  // rows 3, 3, 2
  auto rr = PlanAndRun(w, {{"out", DType::kF32, {8, 4}}},
                       Copy("w", [](const SourceView& v) { return v.Narrow(1, 4, 4); },
                            DestRegion::Whole("out", {8, 4})));
  ASSERT_TRUE(rr.ok()) << rr.status().ToString();
  ExpectParam(w, *rr, "out", DType::kF32, {8, 4}, [](const Shape& i) { return std::pair{std::string("w"), i[0] * 12 + 4 + i[1]}; });
  EXPECT_EQ(rr->plan.stats.descriptors, 8u);  // one run per row
  EXPECT_EQ(rr->plan.stats.bytes_planned, rr->plan.stats.bytes_needed);
  EXPECT_EQ(rr->plan.stats.bytes_needed, 8u * 4 * 4);
}

TEST(PlannerTest, RowParallelSliceFansInFromColumnShards) {
  World w;
  w.AddTensor("w", DType::kF32, {8, 12}, SplitShards({8, 12}, 1, 4));  // 3 columns each
  auto rr = PlanAndRun(w, {{"out", DType::kF32, {4, 12}}},
                       Copy("w", [](const SourceView& v) { return v.Narrow(0, 2, 4); },
                            DestRegion::Whole("out", {4, 12})));
  ASSERT_TRUE(rr.ok()) << rr.status().ToString();
  ExpectParam(w, *rr, "out", DType::kF32, {4, 12}, [](const Shape& i) { return std::pair{std::string("w"), (i[0] + 2) * 12 + i[1]}; });
  EXPECT_EQ(rr->plan.stats.descriptors, 16u);  // 4 rows x 4 shards
  EXPECT_EQ(rr->plan.stats.source_shards, 4u);
  EXPECT_EQ(rr->plan.stats.bytes_planned, rr->plan.stats.bytes_needed);
}

TEST(PlannerTest, FanInFromGridShardsCoalescesWholeRows) {
  World w;
  // 2 x 2 grid of blocks; the destination takes everything.
  w.AddTensor("w", DType::kI32, {6, 8},
              {Shard(0, {0, 0}, {3, 4}), Shard(1, {0, 4}, {3, 4}), Shard(2, {3, 0}, {3, 4}), Shard(3, {3, 4}, {3, 4})});
  auto rr = PlanAndRun(w, {{"out", DType::kI32, {6, 8}}},
                       Copy("w", [](const SourceView& v) { return v; }, DestRegion::Whole("out", {6, 8})));
  ASSERT_TRUE(rr.ok()) << rr.status().ToString();
  ExpectParam(w, *rr, "out", DType::kI32, {6, 8}, [](const Shape& i) { return std::pair{std::string("w"), i[0] * 8 + i[1]}; });
  EXPECT_EQ(rr->plan.stats.descriptors, 12u);  // each shard row is contiguous only within the shard
}

TEST(PlannerTest, ContiguousShardCoalescesToOneRun) {
  World w;
  w.AddTensor("w", DType::kF32, {16, 32}, SplitShards({16, 32}, 0, 2));
  auto rr = PlanAndRun(w, {{"out", DType::kF32, {16, 32}}},
                       Copy("w", [](const SourceView& v) { return v; }, DestRegion::Whole("out", {16, 32})));
  ASSERT_TRUE(rr.ok()) << rr.status().ToString();
  EXPECT_EQ(rr->plan.stats.descriptors, 2u);
  EXPECT_EQ(rr->plan.runs[0].length, 8u * 32 * 4);
  EXPECT_EQ(rr->params.at("out"), w.Full("w"));
}

TEST(PlannerTest, TransposedView) {
  World w;
  w.AddTensor("w", DType::kF32, {4, 6}, SplitShards({4, 6}, 0, 2));
  auto rr = PlanAndRun(w, {{"out", DType::kF32, {6, 4}}},
                       Copy("w", [](const SourceView& v) { return v.Transpose(0, 1); }, DestRegion::Whole("out", {6, 4})));
  ASSERT_TRUE(rr.ok()) << rr.status().ToString();
  ExpectParam(w, *rr, "out", DType::kF32, {6, 4}, [](const Shape& i) { return std::pair{std::string("w"), i[1] * 6 + i[0]}; });
}

TEST(PlannerTest, Permuted3dView) {
  World w;
  w.AddTensor("w", DType::kF32, {2, 3, 4}, SplitShards({2, 3, 4}, 1, 3));
  auto rr = PlanAndRun(w, {{"out", DType::kF32, {4, 2, 3}}},
                       Copy("w", [](const SourceView& v) { return v.Permute({2, 0, 1}); },
                            DestRegion::Whole("out", {4, 2, 3})));
  ASSERT_TRUE(rr.ok()) << rr.status().ToString();
  // out[a][b][c] = w[b][c][a]
  ExpectParam(w, *rr, "out", DType::kF32, {4, 2, 3},
              [](const Shape& i) { return std::pair{std::string("w"), i[1] * 12 + i[2] * 4 + i[0]}; });
}

TEST(PlannerTest, TransposeOfNarrowedBlock) {
  World w;
  w.AddTensor("w", DType::kF32, {8, 6}, SplitShards({8, 6}, 0, 4));
  auto rr = PlanAndRun(w, {{"out", DType::kF32, {3, 4}}},
                       Copy("w", [](const SourceView& v) { return v.Narrow(0, 2, 4).Narrow(1, 1, 3).Transpose(0, 1); },
                            DestRegion::Whole("out", {3, 4})));
  ASSERT_TRUE(rr.ok()) << rr.status().ToString();
  // out[a][b] = w[2 + b][1 + a]
  ExpectParam(w, *rr, "out", DType::kF32, {3, 4},
              [](const Shape& i) { return std::pair{std::string("w"), (2 + i[1]) * 6 + 1 + i[0]}; });
}

TEST(PlannerTest, ChunkUnbindSqueezeUnsqueezeCompose) {
  World w;
  w.AddTensor("w", DType::kF32, {3, 8, 4}, SplitShards({3, 8, 4}, 0, 3));
  // w.unbind(0)[1] -> [8, 4]; chunk(2, 0)[1] -> rows 4..8; unsqueeze(0).squeeze(0) cancels.
  auto rr = PlanAndRun(w, {{"out", DType::kF32, {4, 4}}},
                       Copy("w",
                            [](const SourceView& v) {
                              return v.Unbind(0)[1].Chunk(2, 0)[1].Unsqueeze(0).Squeeze(0).Slice(1, 0, 4);
                            },
                            DestRegion::Whole("out", {4, 4})));
  ASSERT_TRUE(rr.ok()) << rr.status().ToString();
  ExpectParam(w, *rr, "out", DType::kF32, {4, 4},
              [](const Shape& i) { return std::pair{std::string("w"), 32 + (4 + i[0]) * 4 + i[1]}; });
}

TEST(PlannerTest, StridedDestinationColumnsAndTransposedStrides) {
  World w;
  w.AddTensor("a", DType::kF32, {4, 3}, SplitShards({4, 3}, 0, 2));
  w.AddTensor("b", DType::kF32, {4, 7}, SplitShards({4, 7}, 0, 4));
  // out [4, 10]: columns 0..7 from b, columns 7..10 from a (strided rows of the destination).
  Loader l = Both(Copy("b", [](const SourceView& v) { return v; }, DestRegion{"out", 0, {4, 7}, {10, 1}}),
                  Copy("a", [](const SourceView& v) { return v; }, DestRegion{"out", 7, {4, 3}, {10, 1}}));
  // out_t [3, 4] written through transposed destination strides from a.
  l = Both(l, Copy("a", [](const SourceView& v) { return v; }, DestRegion{"out_t", 0, {4, 3}, {1, 4}}));
  auto rr = PlanAndRun(w, {{"out", DType::kF32, {4, 10}}, {"out_t", DType::kF32, {3, 4}}}, l);
  ASSERT_TRUE(rr.ok()) << rr.status().ToString();
  ExpectParam(w, *rr, "out", DType::kF32, {4, 10}, [](const Shape& i) {
    return i[1] < 7 ? std::pair{std::string("b"), i[0] * 7 + i[1]} : std::pair{std::string("a"), i[0] * 3 + i[1] - 7};
  });
  ExpectParam(w, *rr, "out_t", DType::kF32, {3, 4}, [](const Shape& i) { return std::pair{std::string("a"), i[1] * 3 + i[0]}; });
}

TEST(PlannerTest, ReplicasAreReadOnceAndSpread) {
  World w;
  w.AddTensor("w", DType::kF32, {8, 4}, ReplicaShards({8, 4}, 3));
  // Four copies of different rows: each is read once, from rotating replicas.
  Loader l = [](LoadContext& ctx) -> Status {
    RC_ASSIGN_OR_RETURN(SourceView v, ctx.Source("w"));
    for (int64_t k = 0; k < 4; ++k) {
      RC_RETURN_IF_ERROR(ctx.CopyInto(v.Narrow(0, 2 * k, 2), DestRegion::Rows("out", {8, 4}, 2 * k, 2)));
    }
    return OkStatus();
  };
  auto rr = PlanAndRun(w, {{"out", DType::kF32, {8, 4}}}, l);
  ASSERT_TRUE(rr.ok()) << rr.status().ToString();
  EXPECT_EQ(rr->params.at("out"), w.Full("w"));
  EXPECT_EQ(rr->plan.stats.bytes_planned, 8u * 4 * 4);  // every byte once, not once per replica
  std::set<int32_t> ranks;
  for (const auto& s : rr->plan.sources) ranks.insert(s.rank);
  EXPECT_EQ(ranks.size(), 3u);
  // Another destination rank starts the rotation elsewhere.
  PlanOptions o;
  o.dest_rank = 1;
  auto rr1 = PlanAndRun(w, {{"out", DType::kF32, {8, 4}}}, l, o);
  ASSERT_TRUE(rr1.ok());
  EXPECT_NE(rr1->plan.sources[0].rank, rr->plan.sources[0].rank);
  EXPECT_EQ(rr1->params.at("out"), w.Full("w"));
}

TEST(PlannerTest, DeclaredConversionBf16ToF32StagesAndConverts) {
  World w;
  w.AddTensor("w", DType::kBF16, {6, 8}, SplitShards({6, 8}, 0, 4));
  auto rr = PlanAndRun(w, {{"out", DType::kF32, {8, 3}}},
                       Copy("w", [](const SourceView& v) { return v.Narrow(0, 1, 3).Transpose(0, 1); },
                            DestRegion::Whole("out", {8, 3}, /*convert=*/true)));
  ASSERT_TRUE(rr.ok()) << rr.status().ToString();
  EXPECT_EQ(rr->plan.stats.converted_copies, 1u);
  EXPECT_EQ(rr->plan.installs.size(), 1u);
  EXPECT_EQ(rr->plan.stats.bytes_planned, 3u * 8 * 2);  // source bytes, once
  ExpectParam(w, *rr, "out", DType::kF32, {8, 3}, [](const Shape& i) { return std::pair{std::string("w"), (1 + i[1]) * 8 + i[0]}; });
}

TEST(PlannerTest, DescriptorBudgetTurnsStridedRunsIntoWholeShardPulls) {
  World w;
  w.AddTensor("w", DType::kF32, {12, 10}, SplitShards({12, 10}, 0, 3));
  auto load = Copy("w", [](const SourceView& v) { return v.Narrow(1, 3, 5); }, DestRegion::Whole("out", {12, 5}));
  auto exact = PlanAndRun(w, {{"out", DType::kF32, {12, 5}}}, load);
  ASSERT_TRUE(exact.ok()) << exact.status().ToString();
  EXPECT_EQ(exact->plan.stats.descriptors, 12u);
  EXPECT_EQ(exact->plan.stats.full_pulls, 0u);
  PlanOptions o;
  o.descriptor_budget = 1;
  auto pulled = PlanAndRun(w, {{"out", DType::kF32, {12, 5}}}, load, o);
  ASSERT_TRUE(pulled.ok()) << pulled.status().ToString();
  EXPECT_EQ(pulled->plan.stats.full_pulls, 1u);
  EXPECT_EQ(pulled->plan.stats.descriptors, 3u);  // one whole shard each
  EXPECT_EQ(pulled->plan.stats.bytes_planned, 12u * 10 * 4);
  for (const ReadRun& r : pulled->plan.runs) EXPECT_EQ(r.length, 4u * 10 * 4);
  EXPECT_EQ(pulled->params.at("out"), exact->params.at("out"));
  ExpectParam(w, *pulled, "out", DType::kF32, {12, 5}, [](const Shape& i) { return std::pair{std::string("w"), i[0] * 10 + 3 + i[1]}; });
}

TEST(PlannerTest, DescriptorBudgetKeepsExactRunsForNonDim0Sharding) {
  World w;
  w.AddTensor("w", DType::kF32, {12, 10}, SplitShards({12, 10}, 1, 2));
  auto load = Copy("w", [](const SourceView& v) { return v.Narrow(1, 3, 5); }, DestRegion::Whole("out", {12, 5}));
  PlanOptions o;
  o.descriptor_budget = 1;
  auto rr = PlanAndRun(w, {{"out", DType::kF32, {12, 5}}}, load, o);
  ASSERT_TRUE(rr.ok()) << rr.status().ToString();
  EXPECT_EQ(rr->plan.stats.full_pulls, 0u);
  EXPECT_EQ(rr->plan.stats.descriptors, 24u);  // 12 rows x 2 shards
  EXPECT_EQ(rr->plan.stats.bytes_planned, rr->plan.stats.bytes_needed);
  ExpectParam(w, *rr, "out", DType::kF32, {12, 5}, [](const Shape& i) { return std::pair{std::string("w"), i[0] * 10 + 3 + i[1]}; });
}

TEST(PlannerTest, FullPullWithConversionAndStagingWaves) {
  World w;
  w.AddTensor("w", DType::kBF16, {16, 6}, SplitShards({16, 6}, 0, 4));
  w.AddTensor("v", DType::kBF16, {16, 6}, SplitShards({16, 6}, 0, 4));
  Loader l = Both(Copy("w", [](const SourceView& v) { return v.Narrow(1, 1, 2).Transpose(0, 1); },
                       DestRegion::Whole("wt", {2, 16}, true)),
                  Copy("v", [](const SourceView& v) { return v.Narrow(1, 0, 3); }, DestRegion::Whole("vt", {16, 3}, true)));
  PlanOptions o;
  o.descriptor_budget = 2;
  ExecuteOptions e;
  e.max_staging_bytes = 16;  // forces one install step per wave
  auto rr = PlanAndRun(w, {{"wt", DType::kF32, {2, 16}}, {"vt", DType::kF32, {16, 3}}}, l, o, e);
  ASSERT_TRUE(rr.ok()) << rr.status().ToString();
  EXPECT_EQ(rr->plan.stats.full_pulls, 2u);
  ExpectParam(w, *rr, "wt", DType::kF32, {2, 16}, [](const Shape& i) { return std::pair{std::string("w"), i[1] * 6 + 1 + i[0]}; });
  ExpectParam(w, *rr, "vt", DType::kF32, {16, 3}, [](const Shape& i) { return std::pair{std::string("v"), i[0] * 6 + i[1]}; });
}

// ---- Refusals -----------------------------------------------------------------------------------

Status PlanOnly(World& w, const std::vector<TensorSpec>& params, const Loader& l, const PlanOptions& o = {}) {
  CaptureContext ctx(w.Sources(), params);
  RC_RETURN_IF_ERROR(l(ctx));
  return BuildPlan(ctx.capture(), w.manifest(), o).status();
}

void ExpectRefused(const Status& s, const std::string& tensor, const std::string& detail) {
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr(tensor));
  EXPECT_THAT(s.message(), HasSubstr(detail));
}

TEST(PlannerRefusalTest, DimMergingReshape) {
  World w;
  w.AddTensor("model.w", DType::kF32, {4, 6}, SplitShards({4, 6}, 0, 2));
  ExpectRefused(PlanOnly(w, {{"out", DType::kF32, {24}}},
                         Copy("model.w", [](const SourceView& v) { return v.Reshape({24}); }, DestRegion::Whole("out", {24}))),
                "model.w", "merges dimensions");
}

TEST(PlannerRefusalTest, IntegerIndexCollapse) {
  World w;
  w.AddTensor("model.w", DType::kF32, {4, 6}, SplitShards({4, 6}, 0, 2));
  ExpectRefused(PlanOnly(w, {{"out", DType::kF32, {2, 6}}},
                         Copy("model.w", [](const SourceView& v) { return v.IndexSelect(0, {0, 3}); },
                              DestRegion::Whole("out", {2, 6}))),
                "model.w", "integer-index collapse");
}

TEST(PlannerRefusalTest, TransposeThenContiguous) {
  World w;
  w.AddTensor("model.w", DType::kF32, {4, 6}, SplitShards({4, 6}, 0, 2));
  ExpectRefused(PlanOnly(w, {{"out", DType::kF32, {6, 4}}},
                         Copy("model.w", [](const SourceView& v) { return v.Transpose(0, 1).Contiguous(); },
                              DestRegion::Whole("out", {6, 4}))),
                "model.w", "contiguous()");
}

TEST(PlannerRefusalTest, ArithmeticMarksOnlyThatSource) {
  World w;
  w.AddTensor("model.a", DType::kF32, {4}, SplitShards({4}, 0, 1));
  w.AddTensor("model.b", DType::kF32, {4}, SplitShards({4}, 0, 1));
  Loader l = Both(Copy("model.a", [](const SourceView& v) { return v.Arithmetic("mul"); }, DestRegion::Whole("pa", {4})),
                  Copy("model.b", [](const SourceView& v) { return v; }, DestRegion::Whole("pb", {4})));
  const std::vector<TensorSpec> params{{"pa", DType::kF32, {4}}, {"pb", DType::kF32, {4}}};
  ExpectRefused(PlanOnly(w, params, l), "model.a", "arithmetic 'mul'");
  // Excluding the unsupported source leaves a plan for the rest.
  PlanOptions o;
  o.selector.name_filter = [](std::string_view n) { return n == "model.b"; };
  EXPECT_TRUE(PlanOnly(w, params, l, o).ok());
}

TEST(PlannerRefusalTest, DtypeMismatchWithoutDeclaredConversion) {
  World w;
  w.AddTensor("model.w", DType::kBF16, {4, 6}, SplitShards({4, 6}, 0, 2));
  Status s = PlanOnly(w, {{"out", DType::kF32, {4, 6}}},
                      Copy("model.w", [](const SourceView& v) { return v; }, DestRegion::Whole("out", {4, 6}, false)));
  ExpectRefused(s, "model.w", "no conversion was declared");
  EXPECT_THAT(s.message(), HasSubstr("bf16"));
  EXPECT_THAT(s.message(), HasSubstr("f32"));
  // A declared but unsupported pair is refused too.
  World w2;
  w2.AddTensor("model.q", DType::kI8, {4}, SplitShards({4}, 0, 1));
  ExpectRefused(PlanOnly(w2, {{"out", DType::kF32, {4}}},
                         Copy("model.q", [](const SourceView& v) { return v; }, DestRegion::Whole("out", {4}, true))),
                "model.q", "no conversion from i8 to f32");
}

TEST(PlannerRefusalTest, GapInPublishedShards) {
  World w;
  w.AddTensor("model.layers.4.mlp.down_proj.weight", DType::kF32, {12, 4},
              {Shard(0, {0, 0}, {4, 4}), Shard(2, {8, 0}, {4, 4})});
  ExpectRefused(PlanOnly(w, {{"out", DType::kF32, {12, 4}}},
                         Copy("model.layers.4.mlp.down_proj.weight", [](const SourceView& v) { return v; },
                              DestRegion::Whole("out", {12, 4}))),
                "model.layers.4.mlp.down_proj.weight", "rows 4..8 missing");
  // Reading only the published rows is fine.
  EXPECT_TRUE(PlanOnly(w, {{"out", DType::kF32, {4, 4}}},
                       Copy("model.layers.4.mlp.down_proj.weight", [](const SourceView& v) { return v.Narrow(0, 8, 4); },
                            DestRegion::Whole("out", {4, 4})))
                  .ok());
}

TEST(PlannerRefusalTest, OverlappingShards) {
  World w;
  w.AddTensor("model.w", DType::kF32, {8, 4}, {Shard(0, {0, 0}, {5, 4}), Shard(1, {4, 0}, {4, 4})});
  Status s = PlanOnly(w, {{"out", DType::kF32, {8, 4}}},
                      Copy("model.w", [](const SourceView& v) { return v; }, DestRegion::Whole("out", {8, 4})));
  ExpectRefused(s, "model.w", "overlap at [4:5, 0:4]");
}

TEST(PlannerRefusalTest, OverlappingDestinationWrites) {
  World w;
  w.AddTensor("model.w", DType::kF32, {8, 4}, SplitShards({8, 4}, 0, 2));
  Loader l = Both(Copy("model.w", [](const SourceView& v) { return v.Narrow(0, 0, 5); }, DestRegion::Rows("out", {8, 4}, 0, 5)),
                  Copy("model.w", [](const SourceView& v) { return v.Narrow(0, 4, 4); }, DestRegion::Rows("out", {8, 4}, 4, 4)));
  Status s = PlanOnly(w, {{"out", DType::kF32, {8, 4}}}, l);
  ExpectRefused(s, "out", "written more than once");
  EXPECT_THAT(s.message(), HasSubstr("rows 4..5"));
  EXPECT_THAT(s.message(), HasSubstr("model.w"));
}

TEST(PlannerRefusalTest, DestinationNeverWritten) {
  World w;
  w.AddTensor("model.w", DType::kF32, {8, 4}, SplitShards({8, 4}, 0, 2));
  ExpectRefused(PlanOnly(w, {{"out", DType::kF32, {8, 4}}},
                         Copy("model.w", [](const SourceView& v) { return v.Narrow(0, 0, 6); },
                              DestRegion::Rows("out", {8, 4}, 0, 6))),
                "out", "rows 6..8) never written");
}

TEST(PlannerRefusalTest, UnpublishedTensorAndShapeMismatch) {
  World w;
  w.AddTensor("model.w", DType::kF32, {8, 4}, SplitShards({8, 4}, 0, 2));
  CaptureContext ctx({{"model.w", DType::kF32, {8, 4}}, {"model.x", DType::kF32, {2}}},
                     {{"out", DType::kF32, {2}}});
  auto v = ctx.Source("model.x");
  ASSERT_TRUE(v.ok());
  ASSERT_TRUE(ctx.CopyInto(*v, DestRegion::Whole("out", {2})).ok());
  Status s = BuildPlan(ctx.capture(), w.manifest()).status();
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("tensor model.x: not published"));

  CaptureContext ctx2({{"model.w", DType::kF32, {4, 8}}}, {{"out", DType::kF32, {4, 8}}});
  auto v2 = ctx2.Source("model.w");
  ASSERT_TRUE(v2.ok());
  ASSERT_TRUE(ctx2.CopyInto(*v2, DestRegion::Whole("out", {4, 8})).ok());
  ExpectRefused(BuildPlan(ctx2.capture(), w.manifest()).status(), "model.w", "published shape [8, 4]");
}

// ---- Partial refit ------------------------------------------------------------------------------

TEST(SelectorTest, MatchesLayersExpertsAndNames) {
  Selector s;
  EXPECT_TRUE(s.Matches("model.embed_tokens.weight"));
  s.layers = std::pair<int64_t, int64_t>{2, 3};
  EXPECT_TRUE(s.Matches("model.layers.2.mlp.up_proj.weight"));
  EXPECT_TRUE(s.Matches("model.layers.3.self_attn.q_proj.weight"));
  EXPECT_FALSE(s.Matches("model.layers.4.self_attn.q_proj.weight"));
  EXPECT_FALSE(s.Matches("model.layers.12.self_attn.q_proj.weight"));
  EXPECT_FALSE(s.Matches("model.norm.weight"));
  s.experts = {5};
  EXPECT_TRUE(s.Matches("model.layers.2.mlp.experts.5.up_proj.weight"));
  EXPECT_FALSE(s.Matches("model.layers.2.mlp.experts.50.up_proj.weight"));
  EXPECT_FALSE(s.Matches("model.layers.2.mlp.gate.weight"));
  s.name_filter = [](std::string_view n) { return n.find("down") != std::string_view::npos; };
  EXPECT_FALSE(s.Matches("model.layers.2.mlp.experts.5.up_proj.weight"));
  EXPECT_TRUE(s.Matches("model.layers.2.mlp.experts.5.down_proj.weight"));
}

TEST(PlannerTest, PartialRefitLimitsPlanBytesAndGate) {
  World w;
  // Only layer 1 is published; layer 0's tensor is absent.
  w.AddTensor("model.layers.1.w", DType::kF32, {4, 4}, SplitShards({4, 4}, 0, 2));
  CaptureContext ctx({{"model.layers.0.w", DType::kF32, {4, 4}}, {"model.layers.1.w", DType::kF32, {4, 4}}},
                     {{"p0", DType::kF32, {4, 4}}, {"p1", DType::kF32, {4, 4}}});
  for (int i = 0; i < 2; ++i) {
    auto v = ctx.Source(fmt::format("model.layers.{}.w", i));
    ASSERT_TRUE(v.ok());
    ASSERT_TRUE(ctx.CopyInto(*v, DestRegion::Whole(fmt::format("p{}", i), {4, 4})).ok());
  }
  EXPECT_EQ(BuildPlan(ctx.capture(), w.manifest()).status().code(), StatusCode::kNotFound);
  PlanOptions o;
  o.selector.layers = std::pair<int64_t, int64_t>{1, 1};
  auto plan = BuildPlan(ctx.capture(), w.manifest(), o);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->stats.selected_copies, 1u);
  EXPECT_EQ(plan->stats.bytes_needed, 64u);
  EXPECT_EQ(plan->stats.bytes_planned, 64u);
  EXPECT_EQ(plan->stats.dest_bytes_selected, 64u);
  EXPECT_EQ(plan->stats.dest_bytes, 128u);
  for (const ReadRun& r : plan->runs) EXPECT_EQ(plan->buffers[r.buffer].name, "p1");
}

TEST(PlannerTest, ScalarTensor) {
  World w;
  w.AddTensor("s", DType::kI64, {}, {Shard(0, {}, {}), Shard(1, {}, {})});
  auto rr = PlanAndRun(w, {{"out", DType::kI64, {1}}},
                       Copy("s", [](const SourceView& v) { return v.Unsqueeze(0); }, DestRegion::Whole("out", {1})));
  ASSERT_TRUE(rr.ok()) << rr.status().ToString();
  EXPECT_EQ(rr->params.at("out"), w.Full("s"));
  EXPECT_EQ(rr->plan.stats.descriptors, 1u);
}

}  // namespace
}  // namespace rc::refit
