// `rolloutcore bench refit --delta --gpu` (CUDA builds; docs/refit.md "Delta on the GPU"): full and
// delta stages into GPU staging side by side, through receiver::DeviceReceiver — the receiver the
// vLLM extension runs — from a trainer process (`rolloutcore trainer serve --delta`) that publishes
// over a host transport (shm: a cross-process copy, the wire-bound path; or ucx). Per change
// fraction F:
//   v0 staged in full and installed (the warm-up: imports, tables);
//   then --cycles times each, alternated: the trainer steps (F of the elements change), the
//   receiver stages the new version as a delta (policy always) or in full (never), prepares and
//   launches the fused install, and holds the install's digest of the live weights to the
//   manifest's;
//   finally one stage with policy auto, which both measured costs now drive.
// Per stage: bytes on the wire, the stage's steps (delta: wire, planning, table, upload, kernel;
// full: plan, import, wire, digest), the install, and stage + install + verify; per F the medians'
// ratios delta / full.
#include <fmt/format.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "apps/bench_gpu_refit.h"
#include "apps/bench_util.h"
#include "apps/child_process.h"
#include "rolloutcore/base/json.h"
#include "rolloutcore/receiver/device_receiver.h"
#include "rolloutcore/receiver/live_weights.h"
#include "rolloutcore/refit/layouts.h"
#include "rolloutcore/refit/model_config.h"

namespace rc::apps {
namespace {

using Clk = std::chrono::steady_clock;
double MsSince(Clk::time_point t0) { return std::chrono::duration<double, std::milli>(Clk::now() - t0).count(); }

// The bench's live weights: two device arenas (staging, live) that never move.
class ArenaWeights final : public receiver::DeviceLiveWeights {
 public:
  ArenaWeights(const GpuParamArena* staging, const GpuParamArena* live) : staging_(staging), live_(live) {}
  Result<refit::DestinationBuffers> StagingBuffers() override { return staging_->views; }
  Result<refit::DestinationBuffers> LiveBuffers() override { return live_->views; }

 private:
  const GpuParamArena* staging_;
  const GpuParamArena* live_;
};

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 == 1 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

Json ChoiceJson(const receiver::DeviceStageReport& s) {
  if (!s.delta_choice) return nullptr;
  return s.delta_choice->ToJson();
}

// One stage + install of `version` under `policy`; the row of the report.
Result<Json> StageAndInstall(receiver::DeviceReceiver& r, const std::string& dir_url, const std::string& model,
                             const std::string& version, receiver::DeltaPolicy policy, int64_t timeout_ms) {
  receiver::DeviceStageRequest q;
  q.directory = dir_url;
  q.model = model;
  q.version = version;
  q.timeout_ms = timeout_ms;
  q.delta_policy = policy;
  RC_ASSIGN_OR_RETURN(receiver::DeviceStageReport s, r.Stage(q));
  const auto t0 = Clk::now();
  RC_ASSIGN_OR_RETURN(receiver::DevicePrepareReport prepared, r.PrepareInstall());
  if (!prepared.ok) return FailedPrecondition("the fused install cannot run: " + prepared.reason);
  RC_ASSIGN_OR_RETURN(receiver::DeviceInstallReport installed, r.Install());
  if (!installed.ok) return FailedPrecondition("the install was refused: " + installed.reason);
  const double install_ms = MsSince(t0);
  const bool verified = installed.digest.content_digest == s.manifest_digest;
  if (!verified) {
    return DataLoss(fmt::format("{}: the installed live digest {} is not the manifest's {}", version,
                                installed.digest.content_digest.ToHex(), s.manifest_digest.ToHex()));
  }
  Json steps = Json::object();
  for (const auto& [k, v] : s.stage_ms) steps[k] = v;
  return Json{{"version", version},
              {"mode", s.mode},
              {"policy", std::string(receiver::DeltaPolicyName(policy))},
              {"delta_choice", ChoiceJson(s)},
              {"delta_ineligible", s.delta_ineligible},
              {"bytes_pulled", s.bytes_pulled},
              {"bytes_uploaded", s.bytes_uploaded},
              {"changed", s.changed},
              {"stage_ms", steps},
              {"install_ms", install_ms},
              {"install_kernel_ms", installed.digest.kernel_ms},
              {"stage_install_verify_ms", s.stage_ms.at("total") + install_ms},
              {"digest_verified", verified}};
}

void PrintRow(double f, const Json& row) {
  std::cout << fmt::format("F={:<6} {:<5} {:>14} bytes on the wire, stage {:8.1f} ms (", f, row["mode"].get<std::string>(),
                           row["bytes_pulled"].get<uint64_t>(), row["stage_ms"]["total"].get<double>());
  bool first = true;
  for (const auto& [k, v] : row["stage_ms"].items()) {
    if (k == "total") continue;
    std::cout << (first ? "" : ", ") << k << " " << fmt::format("{:.1f}", v.get<double>());
    first = false;
  }
  std::cout << fmt::format("), install {:.1f} ms, stage+install+verify {:.1f} ms, digest verified: {}\n",
                           row["install_ms"].get<double>(), row["stage_install_verify_ms"].get<double>(),
                           row["digest_verified"].get<bool>());
}

}  // namespace

Status RunGpuDeltaBench(const GpuDeltaBenchOptions& o) {
  if (o.cycles < 1) return InvalidArgument(fmt::format("--cycles must be at least 1, got {}", o.cycles));
  RC_ASSIGN_OR_RETURN(refit::ModelConfig config, refit::ResolveModelSpec(o.model));
  RC_ASSIGN_OR_RETURN(refit::EngineLayout layout, refit::ParseEngineLayout("tp:1@bf16"));
  RC_ASSIGN_OR_RETURN(refit::Capture live_cap, refit::CaptureEngineRank(config, layout, 0));
  const refit::Capture staging_cap = refit::DenseStagingCapture(live_cap);
  RC_ASSIGN_OR_RETURN(GpuParamArena staging, AllocateGpuParams(staging_cap.params, o.device));
  RC_ASSIGN_OR_RETURN(GpuParamArena live, AllocateGpuParams(live_cap.params, o.device));
  std::cerr << fmt::format("bench refit --delta --gpu: {} ({:.2f} GB of bf16 parameters) on CUDA device {}\n", o.model,
                           static_cast<double>(live.bytes) / 1e9, o.device);

  char tmpl[] = "/tmp/rolloutcore-bench-gpu-delta-XXXXXX";
  const char* made = ::mkdtemp(tmpl);
  if (made == nullptr) return Unavailable("cannot create a work directory under /tmp");
  const std::string dir = made;
  auto log = [&](const std::string& n) { return dir + "/" + n + ".log"; };
  RC_ASSIGN_OR_RETURN(int dir_port, FreePort());
  const std::string dir_url = "http://127.0.0.1:" + std::to_string(dir_port);
  RC_ASSIGN_OR_RETURN(auto d, ChildProcess::Spawn("directory", {"directory", "serve", "--store", "memory", "--port",
                                                                std::to_string(dir_port)}, log("directory")));
  RC_RETURN_IF_ERROR(BenchWaitHealthy(d.get(), dir_port, "/health", 30));

  Json rows = Json::array();
  for (double f : o.fractions) {
    const std::string name = fmt::format("bench-gpu-f{}", f);
    std::cerr << fmt::format("bench refit --delta --gpu: F = {}: trainer {} (fsdp:{}, {}), work dir {}\n", f, o.model,
                             o.ranks, o.transport, dir);
    int trainer_port = 0;
    RC_ASSIGN_OR_RETURN(auto t, SpawnDeltaTrainer(name, o.model, o.ranks, dir_url, o.transport, f,
                                                  log("trainer-" + name), 1800, &trainer_port));
    // A receiver per F: its cost model starts unmeasured.
    ArenaWeights weights(&staging, &live);
    RC_ASSIGN_OR_RETURN(auto r, receiver::DeviceReceiver::Create(o.device, &weights));
    RC_RETURN_IF_ERROR(r->SetCaptures(staging_cap, live_cap));
    RC_ASSIGN_OR_RETURN(Json warm, StageAndInstall(*r, dir_url, name, "v0", receiver::DeltaPolicy::kNever, o.timeout_ms));
    if (!o.json) PrintRow(f, warm);
    Json stages = Json::array();
    std::vector<double> full_ms, delta_ms, full_bytes, delta_bytes;
    int version = 0;
    for (int c = 0; c < 2 * o.cycles + 1; ++c) {
      RC_ASSIGN_OR_RETURN(Json step, BenchCall(trainer_port, "POST", "/step"));
      ++version;
      const receiver::DeltaPolicy policy = c == 2 * o.cycles ? receiver::DeltaPolicy::kAuto
                                           : c % 2 == 0      ? receiver::DeltaPolicy::kAlways
                                                             : receiver::DeltaPolicy::kNever;
      RC_ASSIGN_OR_RETURN(Json row, StageAndInstall(*r, dir_url, name, "v" + std::to_string(version), policy,
                                                    o.timeout_ms));
      row["trainer_step"] = step;
      if (!o.json) PrintRow(f, row);
      if (policy != receiver::DeltaPolicy::kAuto) {
        const bool is_delta = row["mode"] == "delta";
        (is_delta ? delta_ms : full_ms).push_back(row["stage_install_verify_ms"].get<double>());
        (is_delta ? delta_bytes : full_bytes).push_back(static_cast<double>(row["bytes_pulled"].get<uint64_t>()));
      }
      stages.push_back(std::move(row));
    }
    const Json& last = stages.back();
    const double bytes_ratio = Median(full_bytes) > 0 ? Median(delta_bytes) / Median(full_bytes) : 0;
    const double time_ratio = Median(full_ms) > 0 ? Median(delta_ms) / Median(full_ms) : 0;
    Json row{{"change_fraction", f},
             {"warm", warm},
             {"stages", stages},
             {"full_stage_install_verify_ms_median", Median(full_ms)},
             {"delta_stage_install_verify_ms_median", Median(delta_ms)},
             {"bytes_ratio", bytes_ratio},
             {"time_ratio", time_ratio},
             {"auto", last}};
    if (!o.json) {
      std::cout << fmt::format(
          "F={:<6} delta/full (medians of {} each): bytes on the wire {:.2f} %, stage+install+verify {:.2f} % "
          "({:.1f} vs {:.1f} ms)\n",
          f, o.cycles, 100 * bytes_ratio, 100 * time_ratio, Median(delta_ms), Median(full_ms));
      const Json& c = last["delta_choice"];
      if (c.is_object()) {
        std::cout << fmt::format("F={:<6} auto took: {} ({})\n", f, last["mode"].get<std::string>(), c.dump());
      } else {
        std::cout << fmt::format("F={:<6} auto took: {} ({})\n", f, last["mode"].get<std::string>(),
                                 last["delta_ineligible"].get<std::string>());
      }
    }
    rows.push_back(std::move(row));
    t.reset();
  }
  Json report{{"model", o.model},
              {"transport", o.transport},
              {"trainer_layout", "fsdp:" + std::to_string(o.ranks)},
              {"receiver", "DeviceReceiver, tp:1@bf16, CUDA device " + std::to_string(o.device)},
              {"parameter_bytes", live.bytes},
              {"rows", rows}};
  if (!o.json_out.empty()) {
    std::ofstream out(o.json_out, std::ios::trunc);
    out << report.dump(2) << "\n";
    if (!out) return Unavailable(fmt::format("cannot write '{}'", o.json_out));
  }
  if (o.json) std::cout << report.dump(2) << "\n";
  StopAllChildren();
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return OkStatus();
}

}  // namespace rc::apps
