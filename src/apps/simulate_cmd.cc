// `rolloutcore simulate SCENARIO.json`: the lifecycle simulator (see lifecycle/simulator.h).
#include <fmt/format.h>

#include <iostream>

#include "apps/commands.h"
#include "rolloutcore/base/json.h"
#include "rolloutcore/lifecycle/simulator.h"

namespace rc::apps {
namespace {

std::string Cell(const Json& j) {
  if (j.is_null()) return "-";
  if (j.is_string()) return j.get<std::string>();
  return j.dump();
}

void PrintText(const Json& report, const std::string& scenario_path) {
  const Json& f = report["final"];
  fmt::print("Scenario {}\n", scenario_path);
  fmt::print("  final state : {}  (label {}, generation {}; engine label {}, engine paused: {})\n",
             Cell(f["state"]), Cell(f["label"]), Cell(f["generation"]), Cell(f["engine_label"]),
             Cell(f["engine_paused"]));
  fmt::print("\nUpdates\n  {:<4} {:<10} {:<10} {:<58}\n", "#", "target", "outcome", "phases (ms)");
  for (const auto& u : report["updates"]) {
    std::string phases;
    for (auto it = u["phases_ms"].begin(); it != u["phases_ms"].end(); ++it) {
      phases += fmt::format("{}={} ", it.key(), it.value().get<int64_t>());
    }
    fmt::print("  {:<4} {:<10} {:<10} {}\n", Cell(u["ordinal"]), Cell(u["target"]),
               Cell(u["outcome"]) + (u["recovery"].get<bool>() ? "*" : ""), phases);
    if (!u["reason"].get<std::string>().empty()) fmt::print("       reason: {}\n", Cell(u["reason"]));
  }
  fmt::print("  (* = recovery)\n\nRollouts\n  {:<8} {:<9} {:<8} {:<5} {:<9} {:<9} {}\n", "id", "admitted", "label",
             "gen", "finished", "interr.", "refused because");
  for (const auto& r : report["rollouts"]) {
    fmt::print("  {:<8} {:<9} {:<8} {:<5} {:<9} {:<9} {}\n", Cell(r["id"]), Cell(r["admitted"]), Cell(r["label"]),
               Cell(r["generation"]), Cell(r["finished_t_ms"]), Cell(r["interrupted"]),
               r["refused_reason"].is_null() ? "" : Cell(r["refused_reason"]));
  }
  for (const auto& rs : report["restarts"]) {
    fmt::print("\nController restart at t={} ms: {} -> {}, interrupted {}\n", Cell(rs["t_ms"]),
               Cell(rs["state_at_crash"]), Cell(rs["state_now"]), rs["interrupted"].dump());
  }
  fmt::print("\nJournal ({} records)\n", report["journal"].size());
  for (const auto& j : report["journal"]) {
    std::string move = j["from"].is_null() ? "" : Cell(j["from"]) + " -> " + Cell(j["to"]);
    fmt::print("  {:>3} t={:<6} {:<24} {:<28} {}\n", Cell(j["seq"]), Cell(j["t_ms"]), Cell(j["event"]), move,
               j["rollout"].is_null() ? (j["update"].is_null() ? "" : "update " + Cell(j["update"]))
                                      : "rollout " + Cell(j["rollout"]));
  }
  const Json& c = report["checks"];
  fmt::print("\nChecks\n  no binding spans a weight mutation : {}\n  every admitted rollout accounted    : {}\n"
             "  committed version is live           : {}\n",
             Cell(c["no_binding_spans_mutation"]), Cell(c["every_admitted_rollout_accounted"]),
             Cell(c["committed_version_is_live"]));
  for (const auto& v : c["violations"]) fmt::print("  VIOLATION: {}\n", Cell(v));
}

}  // namespace

void RegisterSimulateCommand(CLI::App& app, int* exit_code) {
  auto* cmd = app.add_subcommand(
      "simulate",
      "Run the real lifecycle Controller and Runner against a scripted fake engine in virtual time and print a "
      "report (JSON by default). Scenario format: docs/lifecycle.md; examples: examples/scenarios/.");
  struct Opts {
    std::string scenario;
    std::string format = "json";
    std::string expect;
  };
  auto opts = std::make_shared<Opts>();
  cmd->add_option("scenario", opts->scenario, "Scenario file (JSON)")->required()->check(CLI::ExistingFile);
  cmd->add_option("--format", opts->format, "Output format: json (the report) or text (a readable summary)")
      ->check(CLI::IsMember({"json", "text"}));
  cmd->add_option("--expect", opts->expect,
                  "Expected-report file: exit 1 unless the report contains it (the format of "
                  "examples/scenarios/*.expected.json)")
      ->check(CLI::ExistingFile);
  cmd->callback([opts, exit_code] {
    auto scenario = ReadJsonFile(opts->scenario);
    if (!scenario.ok()) {
      std::cerr << "simulate: " << scenario.status().ToString() << "\n";
      *exit_code = 2;
      return;
    }
    auto report = lifecycle::RunScenario(*scenario);
    if (!report.ok()) {
      std::cerr << "simulate: " << opts->scenario << ": " << report.status().ToString() << "\n";
      *exit_code = 2;
      return;
    }
    if (opts->format == "json") {
      std::cout << report->dump(2) << "\n";
    } else {
      PrintText(*report, opts->scenario);
    }
    *exit_code = 0;
    if (!opts->expect.empty()) {
      auto expected = ReadJsonFile(opts->expect);
      if (!expected.ok()) {
        std::cerr << "simulate: " << expected.status().ToString() << "\n";
        *exit_code = 2;
        return;
      }
      Status m = lifecycle::MatchExpected(*report, *expected);
      if (!m.ok()) {
        std::cerr << "simulate: report does not match " << opts->expect << ": " << m.message() << "\n";
        *exit_code = 1;
      } else {
        std::cerr << "simulate: report matches " << opts->expect << "\n";
      }
    }
  });
}

}  // namespace rc::apps
