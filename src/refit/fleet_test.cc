#include "rolloutcore/refit/fleet.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <numeric>

namespace rc::refit {
namespace {

using ::testing::HasSubstr;

uint64_t Sum(const std::vector<uint64_t>& v) { return std::accumulate(v.begin(), v.end(), uint64_t{0}); }

FleetSpec Spec(std::string_view model, std::string_view trainer, std::string_view engines) {
  FleetSpec s;
  s.model = *ModelPreset(model);
  s.trainer = *ParseTrainerLayout(trainer);
  auto e = ParseFleetEngines(engines);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  s.replicas = e->first;
  s.engine = e->second;
  return s;
}

// Bytes of the shards each trainer rank publishes.
std::vector<uint64_t> PublishedBytesPerRank(const FleetSpec& s) {
  const Manifest m = *MakeTrainerManifest(s.model, s.trainer);
  std::vector<uint64_t> per(static_cast<size_t>(s.trainer.ranks), 0);
  for (const ShardTable& t : m.tables) {
    for (const ShardInfo& sh : t.shards) {
      per[static_cast<size_t>(sh.rank)] += static_cast<uint64_t>(NumElements(sh.shape)) * DTypeSize(t.dtype);
    }
  }
  return per;
}

TEST(FleetTest, WholeModelReceiversEachPullTheModelOnceFromTheShardOwners) {
  // tp:1 at the checkpoint dtype: every receiver needs every source byte exactly once.
  FleetSpec s = Spec("tiny-moe", "fsdp:4", "3xtp:1@bf16");
  auto r = PlanFleet(s);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const uint64_t model = s.model.num_parameters() * DTypeSize(s.model.dtype);
  EXPECT_EQ(r->model_bytes, model);
  ASSERT_EQ(r->receivers, 3);
  for (uint64_t b : r->receiver_bytes) EXPECT_EQ(b, model);
  EXPECT_EQ(r->total_bytes, 3 * model);
  EXPECT_EQ(Sum(r->source_bytes), 3 * model);
  // fsdp has no replicated box: one plan per engine rank, shared by all replicas.
  EXPECT_EQ(r->rotation_period, 1);
  EXPECT_EQ(r->classes.size(), 1u);
  // Each trainer rank serves its own shards once per replica.
  const auto published = PublishedBytesPerRank(s);
  for (size_t t = 0; t < published.size(); ++t) EXPECT_EQ(r->source_bytes[t], 3 * published[t]) << "rank " << t;
  EXPECT_EQ(Sum(r->receiver_descriptors), r->total_descriptors);
  EXPECT_EQ(Sum(r->source_descriptors), r->total_descriptors);
}

TEST(FleetTest, FoldedPlansGiveTheSameLoadsAsPlanningEveryReceiver) {
  // tp:2 trainer: norms and the router are replicated on both trainer ranks, so the replica
  // rotation makes receivers differ by rank; the folded plans must reproduce every load.
  FleetSpec s = Spec("tiny-moe", "tp:2", "5xtp:2+ep:2@bf16");
  s.links.gpus_per_node = 2;
  s.links.trainer = {1, 8.0};
  s.links.engine = {2, 4.0};
  auto folded = PlanFleet(s);
  ASSERT_TRUE(folded.ok()) << folded.status().ToString();
  s.plan_every_receiver = true;
  auto every = PlanFleet(s);
  ASSERT_TRUE(every.ok()) << every.status().ToString();
  EXPECT_EQ(folded->rotation_period, 2);
  EXPECT_LT(folded->classes.size(), every->classes.size());
  EXPECT_EQ(every->classes.size(), 10u);
  EXPECT_EQ(folded->source_bytes, every->source_bytes);
  EXPECT_EQ(folded->source_descriptors, every->source_descriptors);
  EXPECT_EQ(folded->receiver_bytes, every->receiver_bytes);
  EXPECT_EQ(folded->receiver_descriptors, every->receiver_descriptors);
  EXPECT_EQ(folded->total_bytes, every->total_bytes);
  // Conservation: what the sources send is what the receivers get; each replica's receivers
  // together get at least the model (replicated parameters are pulled by every rank).
  EXPECT_EQ(Sum(folded->source_bytes), folded->total_bytes);
  EXPECT_EQ(Sum(folded->receiver_bytes), folded->total_bytes);
  EXPECT_GE(folded->total_bytes, 5 * folded->model_bytes);
  // Both trainer ranks carry load (the rotation spreads replicated boxes).
  EXPECT_GT(folded->source_bytes[0], 0u);
  EXPECT_GT(folded->source_bytes[1], 0u);

  // Links: 2 trainer GPUs on one node with one 8 Gb/s link; 10 receivers on 5 nodes with two
  // 4 Gb/s links each (one GPU per link).
  uint64_t trainer_link_bytes = 0, engine_link_bytes = 0;
  double worst = 0;
  int trainer_links = 0, engine_links = 0;
  for (const LinkLoad& l : folded->links) {
    (l.trainer ? trainer_link_bytes : engine_link_bytes) += l.bytes;
    (l.trainer ? trainer_links : engine_links)++;
    worst = std::max(worst, static_cast<double>(l.bytes) * 8 / (l.gbps * 1e9));
  }
  EXPECT_EQ(trainer_links, 1);
  EXPECT_EQ(engine_links, 10);
  EXPECT_EQ(trainer_link_bytes, folded->total_bytes);
  EXPECT_EQ(engine_link_bytes, folded->total_bytes);
  // The single trainer link carries everything at 8 Gb/s; the busiest engine link one rank's bytes
  // at 4 Gb/s.
  EXPECT_DOUBLE_EQ(folded->lower_bound_s, worst);
  const uint64_t max_receiver = *std::max_element(folded->receiver_bytes.begin(), folded->receiver_bytes.end());
  EXPECT_DOUBLE_EQ(worst, std::max(folded->total_bytes * 8 / 8e9, max_receiver * 8 / 4e9));
}

TEST(FleetTest, LinksFileAndEnginesParse) {
  auto l = ParseFleetLinks(
      "# cluster\ngpus_per_node 4\ntrainer 4x200\nengine 2x400 # two rails\n"
      "engine_node 3 1x100\n",
      "links.txt");
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->gpus_per_node, 4);
  EXPECT_EQ(l->trainer.count, 4);
  EXPECT_DOUBLE_EQ(l->trainer.gbps, 200);
  EXPECT_EQ(l->engine.count, 2);
  EXPECT_DOUBLE_EQ(l->engine_nodes.at(3).gbps, 100);
  EXPECT_EQ(NodeLinksToString(l->engine), "2x400");
  auto bad = ParseFleetLinks("gpus_per_node 8\ntrainer 8y400\n", "links.txt");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("links.txt line 2: 'trainer 8y400'"));
  EXPECT_FALSE(ParseFleetLinks("wormhole 3\n", "f").ok());

  auto e = ParseFleetEngines("128xtp:8+ep:8@bf16");
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  EXPECT_EQ(e->first, 128);
  EXPECT_EQ(e->second.tp, 8);
  EXPECT_EQ(e->second.ep, 8);
  EXPECT_EQ(e->second.param_dtype, DType::kBF16);
  EXPECT_EQ(ParseFleetEngines("tp:2")->first, 1);
  EXPECT_FALSE(ParseFleetEngines("0xtp:8").ok());
  EXPECT_FALSE(ParseFleetEngines("4xfoo:8").ok());
}

TEST(FleetTest, AnchorShapesHaveTheirPublishedParameterCounts) {
  // Qwen3-235B-A22B's checkpoint has 235,093,634,560 parameters; the Kimi-K2 shape is within 0.2%
  // of Kimi-K2's 1,026,408,232,448 (docs/scale.md: MLA and the shared expert are approximated).
  EXPECT_EQ(ModelPreset("qwen3-235b-a22b")->num_parameters(), 235'093'634'560);
  const double kimi = static_cast<double>(ModelPreset("kimi-k2-shape")->num_parameters());
  EXPECT_NEAR(kimi / 1'026'408'232'448.0, 1.0, 0.002);
  EXPECT_TRUE(CheckEngineLayout(*ModelPreset("kimi-k2-shape"), *ParseEngineLayout("tp:8+ep:8@bf16")).ok());
}

}  // namespace
}  // namespace rc::refit
