// `rolloutcore plan`: plan a refit (which bytes each engine rank pulls from which trainer shard),
// prove coverage, report sizes and timings, and optionally verify the plan end to end in-process.
//
//   rolloutcore plan --model SPEC --source LAYOUT --target LAYOUT [--rank R] [--verify] [--json]
//   rolloutcore plan --spec FILE.json [--verify] [--json]
//
// Exit codes: 0 planned (and verified, with --verify); 1 --verify found a difference; 2 the plan
// was refused or the input is bad (the message on stderr names the tensor).
#include <fmt/format.h>

#include <chrono>
#include <fstream>
#include <iostream>
#include <sstream>

#include "apps/cli_checks.h"
#include "apps/commands.h"
#include "rolloutcore/base/hash.h"
#include "rolloutcore/base/json.h"
#include "rolloutcore/refit/layouts.h"
#include "rolloutcore/refit/model_config.h"
#include "rolloutcore/refit/plan_stats_json.h"
#include "rolloutcore/refit/planner.h"
#include "rolloutcore/refit/spec.h"
#include "rolloutcore/refit/verify.h"

namespace rc::apps {
namespace {

using namespace rc::refit;

struct PlanFlags {
  std::string model;
  std::string source;
  std::string target;
  std::string spec;
  int rank = -1;
  bool verify = false;
  bool json = false;
  int64_t budget = 64;
  uint64_t seed = 1;
  std::string layers;   // "A:B"
  std::string experts;  // "1,2,3"
  std::string only;     // substring of tensor names
};

struct RankLine {
  int32_t rank = 0;
  PlanStats stats;
  double capture_ms = 0;
};

std::string Bytes(uint64_t b) {
  const double gib = static_cast<double>(b) / (1024.0 * 1024.0 * 1024.0);
  if (gib >= 1) return fmt::format("{} ({:.2f} GiB)", b, gib);
  return fmt::format("{} ({:.2f} MiB)", b, static_cast<double>(b) / (1024.0 * 1024.0));
}

Status ParseSelector(const PlanFlags& f, Selector* s) {
  if (!f.layers.empty()) {
    int64_t a = 0, b = 0;
    char colon = 0;
    std::istringstream in(f.layers);
    if (!(in >> a >> colon >> b) || colon != ':' || a < 0 || b < a || !in.eof()) {
      return InvalidArgument(fmt::format("--layers '{}': expected FIRST:LAST", f.layers));
    }
    s->layers = std::pair<int64_t, int64_t>{a, b};
  }
  if (!f.experts.empty()) {
    std::istringstream in(f.experts);
    std::string item;
    while (std::getline(in, item, ',')) {
      try {
        size_t used = 0;
        const long long e = std::stoll(item, &used);
        if (used != item.size() || e < 0) throw std::invalid_argument(item);
        s->experts.push_back(e);
      } catch (const std::exception&) {
        return InvalidArgument(fmt::format("--experts '{}': expected comma-separated expert ids", f.experts));
      }
    }
  }
  if (!f.only.empty()) {
    const std::string needle = f.only;
    s->name_filter = [needle](std::string_view n) { return n.find(needle) != std::string_view::npos; };
  }
  return OkStatus();
}

Json StatsJson(const RankLine& r) {
  Json j = refit::PlanStatsToJson(r.stats);
  j["rank"] = r.rank;
  j["capture_ms"] = r.capture_ms;
  return j;
}

void PrintRank(const RankLine& r) {
  const PlanStats& s = r.stats;
  std::cout << fmt::format("rank {}\n", r.rank);
  std::cout << fmt::format("  copies          {} ({} selected)\n", s.copies, s.selected_copies);
  std::cout << fmt::format("  bytes needed    {}\n", Bytes(s.bytes_needed));
  std::cout << fmt::format("  bytes planned   {}\n", Bytes(s.bytes_planned));
  std::cout << fmt::format("  descriptors     {} from {} source shards\n", s.descriptors, s.source_shards);
  std::cout << fmt::format("  full pulls      {} copies, {} staged\n", s.full_pulls, Bytes(s.full_pull_bytes));
  std::cout << fmt::format("  conversions     {} copies\n", s.converted_copies);
  if (s.dest_bytes_selected == s.dest_bytes) {
    std::cout << fmt::format("  coverage        ok: all {} destination bytes written exactly once, all reads published\n",
                             s.dest_bytes);
  } else {
    std::cout << fmt::format("  coverage        ok: partial refit writes {} of {} destination bytes, each exactly once; "
                             "all reads published\n",
                             s.dest_bytes_selected, s.dest_bytes);
  }
  std::cout << fmt::format("  plan time       {:.2f} ms (+ {:.2f} ms capture)\n", s.plan_ms, r.capture_ms);
}

void PrintTotals(const std::vector<RankLine>& lines) {
  if (lines.size() < 2) return;
  PlanStats t;
  double ms = 0;
  for (const auto& l : lines) {
    t.bytes_needed += l.stats.bytes_needed;
    t.bytes_planned += l.stats.bytes_planned;
    t.descriptors += l.stats.descriptors;
    t.full_pulls += l.stats.full_pulls;
    ms = std::max(ms, l.stats.plan_ms + l.capture_ms);
  }
  std::cout << fmt::format("total: bytes needed {}, bytes planned {}, descriptors {}, full pulls {}, slowest rank {:.2f} ms\n",
                           Bytes(t.bytes_needed), Bytes(t.bytes_planned), t.descriptors, t.full_pulls, ms);
}

int Fail(const Status& s) {
  std::cerr << "plan: " << s.ToString() << "\n";
  return 2;
}

int RunVerify(const VerifyProblem& problem, const PlanFlags& f, const Selector& selector, Json* out) {
  VerifyOptions o;
  o.seed = f.seed;
  o.plan.descriptor_budget = f.budget;
  o.plan.selector = selector;
  if (f.rank >= 0) o.ranks = {f.rank};
  auto report = Verify(problem, o);
  if (!report.ok()) return Fail(report.status());
  bool equal = true;
  for (const auto& r : report->ranks) {
    equal = equal && r.bytes_equal;
    if (!r.bytes_equal) std::cerr << "verify: " << r.mismatch << "\n";
  }
  if (!report->digests_match) std::cerr << "verify: " << report->digest_mismatch << "\n";
  if (f.json) {
    (*out)["verify"] = Json{{"bytes_equal", equal},
                            {"digests_match", report->digests_match},
                            {"tensors_compared", report->tensors_compared},
                            {"content_digest", Hex64(report->content_digest)},
                            {"seed", f.seed}};
    (*out)["verified"] = report->verified();
  } else {
    std::cout << fmt::format("verify: {} rank(s), every destination byte compared with a direct load: {}\n",
                             report->ranks.size(), equal ? "equal" : "DIFFERENT");
    std::cout << fmt::format("verify: content digests of {} tensors {} (published content digest {})\n",
                             report->tensors_compared, report->digests_match ? "match" : "DO NOT MATCH",
                             Hex64(report->content_digest));
    std::cout << "verified: " << (report->verified() ? "true" : "false") << "\n";
  }
  return report->verified() ? 0 : 1;
}

int RunModel(const PlanFlags& f, const Selector& selector) {
  auto config = ResolveModelSpec(f.model);
  if (!config.ok()) return Fail(config.status());
  auto source = ParseTrainerLayout(f.source);
  if (!source.ok()) return Fail(source.status());
  auto target = ParseEngineLayout(f.target);
  if (!target.ok()) return Fail(target.status());
  Status st = CheckEngineLayout(*config, *target);
  if (!st.ok()) return Fail(st);
  auto manifest = MakeTrainerManifest(*config, *source);
  if (!manifest.ok()) return Fail(manifest.status());
  std::vector<int32_t> ranks;
  if (f.rank >= 0) {
    if (f.rank >= target->world_size()) {
      return Fail(InvalidArgument(fmt::format("--rank {}: engine layout {} has ranks 0..{}", f.rank,
                                              target->ToString(), target->world_size() - 1)));
    }
    ranks.push_back(f.rank);
  } else {
    for (int32_t r = 0; r < target->world_size(); ++r) ranks.push_back(r);
  }
  std::vector<RankLine> lines;
  for (int32_t r : ranks) {
    const auto t0 = std::chrono::steady_clock::now();
    auto capture = CaptureEngineRank(*config, *target, r);
    if (!capture.ok()) return Fail(capture.status());
    RankLine line;
    line.rank = r;
    line.capture_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    PlanOptions o;
    o.descriptor_budget = f.budget;
    o.selector = selector;
    o.dest_rank = r;
    const auto t1 = std::chrono::steady_clock::now();
    auto plan = BuildPlan(*capture, *manifest, o);
    if (!plan.ok()) return Fail(plan.status());
    line.stats = plan->stats;
    line.stats.plan_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t1).count();
    lines.push_back(line);
  }
  Json out{{"model", config->name},
           {"architecture", ArchitectureName(config->architecture)},
           {"parameters", config->num_parameters()},
           {"source", source->ToString()},
           {"target", target->ToString()},
           {"coverage", "ok"}};
  if (f.json) {
    Json arr = Json::array();
    for (const auto& l : lines) arr.push_back(StatsJson(l));
    out["ranks"] = arr;
  } else {
    std::cout << fmt::format("plan {} ({}, {} parameters, {}): trainer {} -> engine {} ({} rank(s))\n", config->name,
                             ArchitectureName(config->architecture), config->num_parameters(), DTypeName(config->dtype),
                             source->ToString(), target->ToString(), target->world_size());
    for (const auto& l : lines) PrintRank(l);
    PrintTotals(lines);
  }
  int code = 0;
  if (f.verify) {
    auto problem = ModelVerifyProblem(*config, *source, *target);
    if (!problem.ok()) return Fail(problem.status());
    code = RunVerify(*problem, f, selector, &out);
  }
  if (f.json) std::cout << out.dump(2, ' ', false, Json::error_handler_t::replace) << "\n";
  return code;
}

int RunSpec(const PlanFlags& f, const Selector& selector) {
  std::ifstream in(f.spec);
  if (!in) return Fail(NotFound(fmt::format("cannot open spec file '{}'", f.spec)));
  std::stringstream ss;
  ss << in.rdbuf();
  auto spec = ParsePlanSpecText(ss.str());
  if (!spec.ok()) return Fail(spec.status().WithContext(f.spec));
  const auto t0 = std::chrono::steady_clock::now();
  auto capture = CaptureSpec(*spec);
  if (!capture.ok()) return Fail(capture.status());
  RankLine line;
  line.capture_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  PlanOptions o;
  o.descriptor_budget = f.budget;
  o.selector = selector;
  const auto t1 = std::chrono::steady_clock::now();
  auto plan = BuildPlan(*capture, SpecManifest(*spec), o);
  if (!plan.ok()) return Fail(plan.status());
  line.stats = plan->stats;
  line.stats.plan_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t1).count();
  Json out{{"spec", f.spec}, {"coverage", "ok"}, {"ranks", Json::array({StatsJson(line)})}};
  if (!f.json) {
    std::cout << fmt::format("plan {}: {} source tensors -> {} targets\n", f.spec, spec->tensors.size(),
                             spec->targets.size());
    PrintRank(line);
  }
  int code = 0;
  if (f.verify) code = RunVerify(SpecVerifyProblem(*spec), f, selector, &out);
  if (f.json) std::cout << out.dump(2, ' ', false, Json::error_handler_t::replace) << "\n";
  return code;
}

}  // namespace

void RegisterPlanCommand(CLI::App& app, int* exit_code) {
  auto f = std::make_shared<PlanFlags>();
  auto* cmd = app.add_subcommand("plan", "Plan a refit: which bytes each engine rank pulls, with coverage proof.");
  auto* model = cmd->add_option("--model", f->model,
                                "Preset (tiny, tiny-llama, tiny-qwen2, tiny-moe, qwen3-0.6b, qwen3-8b, "
                                "qwen3-30b-a3b, llama3-70b) or path to a config.json / model folder");
  auto* source = cmd->add_option("--source", f->source, "Trainer layout: fsdp:N, tp:N or replicated[:N]");
  auto* target = cmd->add_option("--target", f->target, "Engine layout: tp:N, ep:M or tp:N+ep:M, optional @dtype");
  auto* spec = cmd->add_option("--spec", f->spec, "JSON plan spec with arbitrary layouts (see docs/refit.md)");
  cmd->add_option("--rank", f->rank, "Plan only this engine rank (default: every rank)")->check(CLI::Range(0, 1 << 20));
  cmd->add_flag("--verify", f->verify,
                "Fill seeded random shards, execute through the local transport, compare every destination byte "
                "with a direct load and the content digests (small models only)");
  cmd->add_flag("--json", f->json, "Print JSON");
  cmd->add_option("--budget", f->budget, "Descriptor budget per copy")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30))
      ->capture_default_str();
  cmd->add_option("--seed", f->seed, "Seed for --verify")->check(Unsigned())->capture_default_str();
  cmd->add_option("--layers", f->layers, "Partial refit: only layers FIRST:LAST");
  cmd->add_option("--experts", f->experts, "Partial refit: only these expert ids (comma-separated)");
  cmd->add_option("--only", f->only, "Partial refit: only tensors whose name contains this");
  spec->excludes(model)->excludes(source)->excludes(target);
  model->needs(source)->needs(target);
  cmd->callback([f, exit_code] {
    Selector selector;
    if (Status s = ParseSelector(*f, &selector); !s.ok()) {
      *exit_code = Fail(s);
      return;
    }
    if (f->spec.empty() && f->model.empty()) {
      *exit_code = Fail(InvalidArgument("give --model/--source/--target or --spec"));
      return;
    }
    *exit_code = f->spec.empty() ? RunModel(*f, selector) : RunSpec(*f, selector);
  });
}

}  // namespace rc::apps
