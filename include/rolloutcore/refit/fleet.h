// Fleet planning: the real per-receiver refit plans of a whole deployment (T trainer ranks, R engine
// replicas of W ranks each), folded into the loads a network sees: bytes per source rank, bytes per
// receiver rank, bytes per link, descriptor counts, plan time, and a lower bound on the transfer
// time for the stated link speeds. `rolloutcore plan-fleet` prints it; docs/scale.md reads it.
//
// Every figure comes from BuildPlan over CaptureEngineRank(rank) and MakeTrainerManifest (the
// planner the receivers run, not a model of it). Plans are built once per *distinct receiver
// class* and multiplied: BuildPlan is a pure function of (capture, manifest, dest_rank), and
// dest_rank matters only through the replica rotation `(k + dest_rank) mod c_b` of boxes held by
// c_b > 1 trainer ranks. So receiver g = replica * W + r gets exactly the plan of the class
// (r, g mod L) with L = lcm of every c_b (L = 1 when no box is replicated, e.g. fsdp: then the
// plan of engine rank r is the same for every replica). `plan_every_receiver` skips the folding
// (tests compare both).
//
// Links: trainer rank t sits on trainer node t / G, receiver g on engine node g / G (G GPUs per
// node; a replica of W = G ranks is one node). A node has K links of S Gb/s each; GPU i of a node
// sends (trainer) or receives (engine) through link i * K / G. The lower bound is the busiest
// link's bytes / its speed, over both sides: it assumes a non-blocking fabric between the links,
// every GPU driving its link at line rate for the whole transfer, no relay through other GPUs, and
// ignores latency, the descriptor rate and install time (docs/scale.md lists the assumptions).
//
// Thread safety: pure functions (PlanFleet builds plans one after another; no threads, no I/O; time
// only through the caller's FleetSpec::clock).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/clock.h"
#include "rolloutcore/base/status.h"
#include "rolloutcore/refit/layouts.h"
#include "rolloutcore/refit/model_config.h"
#include "rolloutcore/refit/planner.h"

namespace rc::refit {

struct NodeLinks {
  int32_t count = 8;    // links (NICs) per node
  double gbps = 400.0;  // speed of each, Gb/s (10^9 bit/s), one direction
};

struct FleetLinks {
  int32_t gpus_per_node = 8;
  NodeLinks trainer;                           // every trainer node, unless overridden below
  NodeLinks engine;                            // every engine node, unless overridden below
  std::map<int32_t, NodeLinks> trainer_nodes;  // node index -> links
  std::map<int32_t, NodeLinks> engine_nodes;
};

// The links file (docs/scale.md), one setting per line, '#' starts a comment:
//   gpus_per_node 8
//   trainer 8x400          COUNTxGBPS for every trainer node
//   engine 8x400           ... every engine node
//   trainer_node 3 4x200   override for trainer node 3
//   engine_node 0 8x100    override for engine node 0
// Unset settings keep the defaults (8 GPUs per node, 8x400 Gb/s on both sides). InvalidArgument
// naming `what`, the line number and the text otherwise.
[[nodiscard]] Result<FleetLinks> ParseFleetLinks(std::string_view text, std::string_view what);
std::string NodeLinksToString(const NodeLinks& links);  // "8x400"

// "128xtp:8+ep:8@bf16" -> {128, layout}; "tp:8" means one replica.
[[nodiscard]] Result<std::pair<int32_t, EngineLayout>> ParseFleetEngines(std::string_view text);

struct FleetSpec {
  ModelConfig model;
  TrainerLayout trainer;
  int32_t replicas = 1;
  EngineLayout engine;
  FleetLinks links;
  int64_t descriptor_budget = 64;
  bool plan_every_receiver = false;
  // Times capture_ms / plan_ms (refit_core reads no clock itself). Null: every time is 0.
  const Clock* clock = nullptr;
};

// One distinct plan and the receivers that share it.
struct FleetPlanClass {
  int32_t engine_rank = 0;  // rank within a replica
  int64_t rotation = 0;     // g mod L of its receivers
  int64_t receivers = 0;
  PlanStats stats;
  double capture_ms = 0;
};

struct LinkLoad {
  bool trainer = false;  // trainer side (outbound) or engine side (inbound)
  int32_t node = 0;
  int32_t link = 0;
  double gbps = 0;
  uint64_t bytes = 0;
  double seconds() const { return gbps > 0 ? static_cast<double>(bytes) * 8.0 / (gbps * 1e9) : 0; }
};

struct FleetReport {
  uint64_t model_bytes = 0;  // every source tensor once, in its published dtype
  int32_t trainer_ranks = 0;
  int32_t engine_world = 0;     // ranks per replica
  int64_t receivers = 0;        // replicas * engine_world
  int64_t rotation_period = 1;  // L
  std::vector<FleetPlanClass> classes;
  std::vector<uint64_t> receiver_bytes;        // per receiver g
  std::vector<uint64_t> receiver_descriptors;  // per receiver g
  std::vector<uint64_t> source_bytes;          // per trainer rank, summed over all receivers
  std::vector<uint64_t> source_descriptors;    // runs served, per trainer rank
  uint64_t total_bytes = 0;
  uint64_t total_descriptors = 0;
  double capture_ms_total = 0;
  double plan_ms_total = 0;     // sum over the distinct plans built
  double plan_ms_max = 0;       // slowest single plan: what one receiver rank spends planning
  std::vector<LinkLoad> links;  // every link of every node, trainer nodes first
  double lower_bound_s = 0;     // busiest link
  LinkLoad bottleneck;
};

[[nodiscard]] Result<FleetReport> PlanFleet(const FleetSpec& spec);

}  // namespace rc::refit
