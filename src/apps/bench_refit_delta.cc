// `rolloutcore bench refit --delta`: full and sparse delta refit side by side in one run
// (docs/refit.md "Delta refit"). Per change fraction F: a synthetic trainer publishing with
// --change-fraction F --delta; the engine (dummy weights) refits v0 in full after one warm-up
// stage (the steady-state baseline: bytes
// on the wire, stage, install, verify, pause), the trainer steps, and the engine refits v1 as a
// delta on v0, then v2 as a delta on v1. The delta goes into the staging image and is swapped in
// (docs/refit.md "Delta on the staging image"): v1, the first delta after a full install, first
// copies the live weights into the staging image ("delta first" row); v2 re-applies v1's delta to
// the image v1 retired, the steady state of an RL loop ("delta" row, the one the ratios compare).
// Reported: the rows and the ratios (delta bytes / full bytes, delta stage+install+verify / full's).
#include <fmt/format.h>

#include <chrono>
#include <filesystem>
#include <iostream>

#include "apps/bench_refit_delta.h"
#include "apps/bench_util.h"
#include "apps/child_process.h"

namespace rc::apps {
namespace {

double Num(const Json& j, const char* key) { return j.contains(key) && j[key].is_number() ? j[key].get<double>() : 0.0; }

double StageTotal(const Json& stage) {
  double ms = 0;
  for (const auto& [k, v] : stage["stages_ms"].items()) {
    if (k != "total" && v.is_number()) ms += v.get<double>();
  }
  return ms;
}

// Stage, pause, install, resume: one refit's figures.
Result<Json> Refit(int engine_port, const std::string& model, const std::string& version, const std::string& dir_url) {
  RC_ASSIGN_OR_RETURN(Json staged, BenchCall(engine_port, "POST", "/rc/refit/stage",
                                             Json{{"model", model}, {"version", version}, {"directory", dir_url}}));
  const auto p0 = std::chrono::steady_clock::now();
  RC_ASSIGN_OR_RETURN(Json paused, BenchCall(engine_port, "POST", "/pause?mode=wait"));
  (void)paused;
  RC_ASSIGN_OR_RETURN(Json installed, BenchCall(engine_port, "POST", "/rc/refit/install", Json{{"version", version}}));
  RC_ASSIGN_OR_RETURN(Json resumed, BenchCall(engine_port, "POST", "/resume"));
  (void)resumed;
  const double pause_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - p0).count();
  const Json& st = installed["stages_ms"];
  const double stage_ms = StageTotal(staged);
  const double install_ms = Num(st, "install");
  const double verify_ms = Num(st, "post_install") + Num(st, "anchor_check");
  return Json{{"version", version},
              {"mode", staged.value("mode", std::string("?"))},
              {"mode_reason", staged.value("mode_reason", std::string())},
              // The engine runs --delta-policy always (this bench measures the delta); its choice
              // still carries the estimates auto would have weighed (docs/refit.md "Full or delta").
              {"delta_choice", staged.value("delta_choice", Json(nullptr))},
              {"delta_apply", staged.value("delta_apply", std::string())},
              {"staging_from", staged.value("staging_from", std::string())},
              {"bytes_pulled", staged["bytes_pulled"]},
              {"stage_ms", stage_ms},
              {"install_ms", install_ms},
              {"verify_ms", verify_ms},
              {"stage_install_verify_ms", stage_ms + install_ms + verify_ms},
              {"pause_ms", pause_ms},
              {"digest_verified", installed["live_content_digest"] == staged["content_digest"]},
              {"stages_ms", staged["stages_ms"]}};
}

}  // namespace

Status RunDeltaRefitBench(const DeltaBenchOptions& o) {
  char tmpl[] = "/tmp/rolloutcore-bench-delta-XXXXXX";
  std::string dir = mkdtemp(tmpl);
  auto log = [&](const std::string& n) { return dir + "/" + n + ".log"; };
  RC_ASSIGN_OR_RETURN(int dir_port, FreePort());
  RC_ASSIGN_OR_RETURN(int engine_port, FreePort());
  const std::string dir_url = "http://127.0.0.1:" + std::to_string(dir_port);
  RC_ASSIGN_OR_RETURN(auto d, ChildProcess::Spawn("directory", {"directory", "serve", "--store", "memory", "--port",
                                                                std::to_string(dir_port)}, log("directory")));
  RC_RETURN_IF_ERROR(BenchWaitHealthy(d.get(), dir_port, "/health", 30));
  const std::string engine_model =
      o.engine_model.empty() ? (o.model == "qwen3-0.6b" ? "qwen3-0.6b-like" : o.model) : o.engine_model;
  std::cerr << "bench refit --delta: engine " << engine_model << " (dummy weights, tp " << o.tp << "), work dir "
            << dir << "\n";
  RC_ASSIGN_OR_RETURN(auto e, ChildProcess::Spawn("engine", {"engine", "serve", "--model", engine_model, "--load-format",
                                                             "dummy", "--tensor-parallel-size", std::to_string(o.tp),
                                                             "--delta-policy", "always",
                                                             "--port", std::to_string(engine_port)}, log("engine")));
  RC_RETURN_IF_ERROR(BenchWaitHealthy(e.get(), engine_port, "/health", 600));
  Json rows = Json::array();
  for (double f : o.fractions) {
    const std::string name = fmt::format("bench-f{}", f);
    std::cerr << fmt::format("bench refit --delta: F = {}: trainer {} (fsdp:{}, {})\n", f, o.model, o.ranks,
                             o.transport);
    int trainer_port = 0;
    RC_ASSIGN_OR_RETURN(auto t, SpawnDeltaTrainer(name, o.model, o.ranks, dir_url, o.transport, f,
                                                  log("trainer-" + name), 600, &trainer_port));
    // Warm-up: the first stage of an engine allocates its shadow parameters and faults their pages
    // in; the full row is the steady-state refit every later full refit costs.
    RC_ASSIGN_OR_RETURN(Json warm, BenchCall(engine_port, "POST", "/rc/refit/stage",
                                             Json{{"model", name}, {"version", "v0"}, {"directory", dir_url}}));
    (void)warm;
    RC_ASSIGN_OR_RETURN(Json full, Refit(engine_port, name, "v0", dir_url));
    RC_ASSIGN_OR_RETURN(Json step, BenchCall(trainer_port, "POST", "/step"));
    RC_ASSIGN_OR_RETURN(Json delta_first, Refit(engine_port, name, "v1", dir_url));
    RC_ASSIGN_OR_RETURN(Json step2, BenchCall(trainer_port, "POST", "/step"));
    RC_ASSIGN_OR_RETURN(Json delta, Refit(engine_port, name, "v2", dir_url));
    const double fb = Num(full, "bytes_pulled"), db = Num(delta, "bytes_pulled");
    const double ft = Num(full, "stage_install_verify_ms"), dt = Num(delta, "stage_install_verify_ms");
    Json row{{"change_fraction", f},
             {"changed_elements", step2["delta_changed"]},
             {"delta_bytes_published", step2["delta_bytes"]},
             {"full", full},
             {"delta_first", delta_first},
             {"delta", delta},
             {"bytes_ratio", fb > 0 ? db / fb : 0.0},
             {"time_ratio", ft > 0 ? dt / ft : 0.0}};
    rows.push_back(row);
    if (!o.json) {
      for (const char* which : {"full", "delta_first", "delta"}) {
        const Json& r = row[which];
        std::cout << fmt::format(
            "F={:<5} {:<11} {} bytes on the wire, stage {:.1f} ms, install {:.1f} ms, verify {:.1f} ms, pause {:.1f} "
            "ms (digest verified: {}; {}{})\n",
            f, which, r["bytes_pulled"].dump(), Num(r, "stage_ms"), Num(r, "install_ms"), Num(r, "verify_ms"),
            Num(r, "pause_ms"), r["digest_verified"].dump(), r["mode"].get<std::string>(),
            r["delta_apply"].get<std::string>().empty()
                ? std::string()
                : " to " + r["delta_apply"].get<std::string>() + " from " + r["staging_from"].get<std::string>());
      }
      std::cout << fmt::format("F={:<5} delta/full: bytes {:.2f} %, stage+install+verify {:.2f} %\n", f,
                               100 * row["bytes_ratio"].get<double>(), 100 * row["time_ratio"].get<double>());
      // What --delta-policy auto would have taken for the last delta, from the engine's measured costs.
      const Json& c = row["delta"]["delta_choice"];
      if (c.is_object() && c["estimated_full_ms"].is_number() && c["estimated_delta_ms"].is_number()) {
        const double ef = c["estimated_full_ms"].get<double>(), ed = c["estimated_delta_ms"].get<double>();
        std::cout << fmt::format("F={:<5} auto would take: {} (estimated full {:.2f} ms, delta {:.2f} ms)\n", f,
                                 ed <= ef ? "delta" : "full", ef, ed);
      }
    }
    t.reset();  // stops the trainer: its versions are installed already
  }
  Json report{{"model", o.model},
              {"engine_model", engine_model},
              {"transport", o.transport},
              {"trainer_layout", "fsdp:" + std::to_string(o.ranks)},
              {"engine_layout", "tp:" + std::to_string(o.tp)},
              {"rows", rows}};
  if (o.json) std::cout << report.dump(2) << "\n";
  StopAllChildren();
  std::filesystem::remove_all(dir);
  return OkStatus();
}

}  // namespace rc::apps
