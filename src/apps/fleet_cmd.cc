// `rolloutcore plan-fleet`: the real refit plans of a whole deployment, folded into network loads
// (refit/fleet.h): bytes per link, per-source load, descriptor counts, plan time, and a lower
// bound on the transfer time for the stated link speeds.
//
//   rolloutcore plan-fleet --model qwen3-235b-a22b --trainer fsdp:256 --engines 128xtp:8+ep:8@bf16
//                          [--links FILE] [--budget N] [--every-receiver] [--json]
//
// Exit codes: 0 planned; 2 bad input or a plan was refused (the message names the tensor).
#include <fmt/format.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <sstream>

#include "apps/commands.h"
#include "rolloutcore/base/json.h"
#include "rolloutcore/refit/fleet.h"

namespace rc::apps {
namespace {

using namespace rc::refit;

struct FleetFlags {
  std::string model;
  std::string trainer;
  std::string engines;
  std::string links;
  std::string wire_dtype;
  int64_t budget = 64;
  bool every = false;
  bool json = false;
};

std::string Gb(uint64_t b) { return fmt::format("{:.2f} GB", static_cast<double>(b) / 1e9); }

struct Spread {
  uint64_t min = 0, max = 0;
  double mean = 0;
};
Spread SpreadOf(const std::vector<uint64_t>& v) {
  Spread s;
  if (v.empty()) return s;
  s.min = *std::min_element(v.begin(), v.end());
  s.max = *std::max_element(v.begin(), v.end());
  double sum = 0;
  for (uint64_t x : v) sum += static_cast<double>(x);
  s.mean = sum / static_cast<double>(v.size());
  return s;
}
Json SpreadJson(const Spread& s) { return Json{{"min", s.min}, {"mean", s.mean}, {"max", s.max}}; }

int Fail(const Status& s) {
  std::cerr << "plan-fleet: " << s.ToString() << "\n";
  return 2;
}

LinkLoad Busiest(const FleetReport& r, bool trainer) {
  LinkLoad best;
  best.trainer = trainer;
  for (const LinkLoad& l : r.links) {
    if (l.trainer == trainer && l.seconds() >= best.seconds()) best = l;
  }
  return best;
}

Json LinkJson(const LinkLoad& l) {
  return Json{{"side", l.trainer ? "trainer" : "engine"},
              {"node", l.node},
              {"link", l.link},
              {"gbps", l.gbps},
              {"bytes", l.bytes},
              {"seconds", l.seconds()}};
}

int Run(const FleetFlags& f) {
  const auto t0 = std::chrono::steady_clock::now();
  FleetSpec spec;
  auto config = ResolveModelSpec(f.model);
  if (!config.ok()) return Fail(config.status());
  spec.model = *config;
  if (!f.wire_dtype.empty()) {
    auto dt = ParseDType(f.wire_dtype);
    if (!dt.ok()) return Fail(dt.status().WithContext("--wire-dtype"));
    spec.model.dtype = *dt;  // what the trainer publishes (e.g. quantized to f8_e4m3 before sending)
  }
  auto trainer = ParseTrainerLayout(f.trainer);
  if (!trainer.ok()) return Fail(trainer.status().WithContext("--trainer"));
  spec.trainer = *trainer;
  auto engines = ParseFleetEngines(f.engines);
  if (!engines.ok()) return Fail(engines.status());
  spec.replicas = engines->first;
  spec.engine = engines->second;
  spec.descriptor_budget = f.budget;
  spec.plan_every_receiver = f.every;
  spec.clock = SystemClock::Default();  // capture_ms / plan_ms in the report
  if (!f.links.empty()) {
    std::ifstream in(f.links);
    if (!in) return Fail(NotFound(fmt::format("--links: cannot open '{}'", f.links)));
    std::stringstream ss;
    ss << in.rdbuf();
    auto links = ParseFleetLinks(ss.str(), f.links);
    if (!links.ok()) return Fail(links.status());
    spec.links = *links;
  }
  auto rep = PlanFleet(spec);
  if (!rep.ok()) return Fail(rep.status());
  const double wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  const double cpu_s = static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
                       static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;

  const Spread src = SpreadOf(rep->source_bytes), dst = SpreadOf(rep->receiver_bytes);
  const Spread src_d = SpreadOf(rep->source_descriptors), dst_d = SpreadOf(rep->receiver_descriptors);
  const LinkLoad tl = Busiest(*rep, true), el = Busiest(*rep, false);
  const std::string links_text = fmt::format(
      "{} GPUs/node; trainer nodes {}, engine nodes {}{}", spec.links.gpus_per_node,
      NodeLinksToString(spec.links.trainer), NodeLinksToString(spec.links.engine),
      spec.links.trainer_nodes.empty() && spec.links.engine_nodes.empty() ? "" : " (with per-node overrides)");
  if (f.json) {
    Json classes = Json::array();
    for (const FleetPlanClass& c : rep->classes) {
      classes.push_back(Json{{"engine_rank", c.engine_rank},
                             {"rotation", c.rotation},
                             {"receivers", c.receivers},
                             {"bytes_planned", c.stats.bytes_planned},
                             {"descriptors", c.stats.descriptors},
                             {"source_shards", c.stats.source_shards},
                             {"full_pulls", c.stats.full_pulls},
                             {"staging_bytes", c.stats.staging_bytes},
                             {"plan_ms", c.stats.plan_ms},
                             {"capture_ms", c.capture_ms}});
    }
    Json links = Json::array();
    for (const LinkLoad& l : rep->links) links.push_back(LinkJson(l));
    Json out{{"model", spec.model.name},
             {"parameters", spec.model.num_parameters()},
             {"dtype", DTypeName(spec.model.dtype)},
             {"trainer", spec.trainer.ToString()},
             {"replicas", spec.replicas},
             {"engine", spec.engine.ToString()},
             {"links", links_text},
             {"model_bytes", rep->model_bytes},
             {"receivers", rep->receivers},
             {"rotation_period", rep->rotation_period},
             {"distinct_plans", rep->classes.size()},
             {"total_bytes", rep->total_bytes},
             {"total_descriptors", rep->total_descriptors},
             {"source_bytes", rep->source_bytes},
             {"source_descriptors", rep->source_descriptors},
             {"receiver_bytes", rep->receiver_bytes},
             {"receiver_descriptors", rep->receiver_descriptors},
             {"source_bytes_spread", SpreadJson(src)},
             {"receiver_bytes_spread", SpreadJson(dst)},
             {"capture_ms_total", rep->capture_ms_total},
             {"plan_ms_total", rep->plan_ms_total},
             {"plan_ms_max", rep->plan_ms_max},
             {"wall_s", wall_s},
             {"cpu_s", cpu_s},
             {"classes", classes},
             {"link_loads", links},
             {"busiest_trainer_link", LinkJson(tl)},
             {"busiest_engine_link", LinkJson(el)},
             {"lower_bound_s", rep->lower_bound_s},
             {"bottleneck", LinkJson(rep->bottleneck)}};
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  std::cout << fmt::format("plan-fleet {} ({} parameters, {}): trainer {} -> {} x engine {} = {} receiver ranks\n",
                           spec.model.name, spec.model.num_parameters(), DTypeName(spec.model.dtype),
                           spec.trainer.ToString(), spec.replicas, spec.engine.ToString(), rep->receivers);
  std::cout << fmt::format("  links            {}\n", links_text);
  std::cout << fmt::format("  model bytes      {} (every source tensor once)\n", Gb(rep->model_bytes));
  std::cout << fmt::format(
      "  plans            {} distinct (rotation period {}; each engine rank's plan is shared by "
      "the receivers of its class), {} receivers\n",
      rep->classes.size(), rep->rotation_period, rep->receivers);
  std::cout << fmt::format(
      "  bytes moved      {} in total = {:.3f} x model bytes\n", Gb(rep->total_bytes),
      static_cast<double>(rep->total_bytes) / static_cast<double>(std::max<uint64_t>(rep->model_bytes, 1)));
  std::cout << fmt::format("  per receiver     {} .. {} (mean {}), descriptors {} .. {}\n", Gb(dst.min), Gb(dst.max),
                           Gb(static_cast<uint64_t>(dst.mean)), dst_d.min, dst_d.max);
  std::cout << fmt::format("  per source rank  {} .. {} (mean {}), descriptors served {} .. {}\n", Gb(src.min),
                           Gb(src.max), Gb(static_cast<uint64_t>(src.mean)), src_d.min, src_d.max);
  std::cout << fmt::format("  descriptors      {} in total\n", rep->total_descriptors);
  std::cout << fmt::format(
      "  busiest links    trainer node {} link {}: {} ({:.3f} s at {:g} Gb/s); engine node {} "
      "link {}: {} ({:.3f} s at {:g} Gb/s)\n",
      tl.node, tl.link, Gb(tl.bytes), tl.seconds(), tl.gbps, el.node, el.link, Gb(el.bytes), el.seconds(), el.gbps);
  std::cout << fmt::format("  lower bound      {:.3f} s ({} side is the bottleneck)\n", rep->lower_bound_s,
                           rep->bottleneck.trainer ? "trainer" : "engine");
  std::cout << fmt::format(
      "  plan time        {:.0f} ms for the slowest single plan (what one receiver rank spends); "
      "{:.0f} ms for all {} distinct plans + {:.0f} ms captures; {:.1f} s wall, {:.1f} s CPU\n",
      rep->plan_ms_max, rep->plan_ms_total, rep->classes.size(), rep->capture_ms_total, wall_s, cpu_s);
  return 0;
}

}  // namespace

void RegisterPlanFleetCommand(CLI::App& app, int* exit_code) {
  auto f = std::make_shared<FleetFlags>();
  auto* cmd = app.add_subcommand(
      "plan-fleet",
      "Plan the refit of a whole deployment with the real planner: bytes per link, per-source load, descriptors, "
      "plan time and a lower-bound transfer time (docs/scale.md).");
  cmd->add_option("--model", f->model,
                  "Preset (e.g. qwen3-235b-a22b, kimi-k2-shape, qwen3-30b-a3b, tiny-moe) or a config.json path")
      ->required();
  cmd->add_option("--trainer", f->trainer, "Trainer layout: fsdp:N, tp:N or replicated[:N]")->required();
  cmd->add_option("--engines", f->engines,
                  "REPLICASxLAYOUT: engine replicas and each one's layout, e.g. 128xtp:8 or 16xtp:8+ep:8@bf16")
      ->required();
  cmd->add_option("--links", f->links,
                  "Link speeds per node (docs/scale.md); default: 8 GPUs per node, 8x400 Gb/s on every node");
  cmd->add_option("--wire-dtype", f->wire_dtype,
                  "Dtype the trainer publishes (default: the checkpoint's, bf16), e.g. f8_e4m3 for a trainer that "
                  "quantizes before sending; pair it with an engine @f8_e4m3");
  cmd->add_option("--budget", f->budget, "Descriptor budget per copy")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30))
      ->capture_default_str();
  cmd->add_flag("--every-receiver", f->every, "Build every receiver's plan instead of one per distinct class");
  cmd->add_flag("--json", f->json, "Print JSON (with per-rank and per-link vectors)");
  cmd->callback([f, exit_code] { *exit_code = Run(*f); });
}

}  // namespace rc::apps
