// `rolloutcore bench refit`: receiver-driven refit across processes, against a single-thread
// memcpy of the same number of bytes measured in the same run.
//
// Starts a directory, a synthetic trainer (fsdp:N) publishing over the chosen transport and an
// engine (dummy weights of the same geometry) as child processes, has the trainer publish v1,
// and asks the engine to stage it (plan + pull + digest check) --repeats times; reports the wire
// GB/s the engine measured, the ratio to memcpy, planned vs needed bytes and the per-stage
// milliseconds, then installs the last stage while paused and checks the live digest. Beside the
// wire figure it prints the end-to-end figure: bytes pulled over (last stage's total + install +
// live digest), and its ratio to a single-thread and an all-thread memcpy of the same bytes, both
// measured in the same run.
//
// With --transport cuda_ipc or nccl (builds with ROLLOUTCORE_WITH_CUDA) it runs the GPU refit bench
// instead (bench_gpu_refit_cmd.cc): trainer weights on one GPU, engine parameters on another,
// e.g. `rolloutcore bench refit --transport cuda_ipc --model qwen3-8b --source fsdp:1 --target tp:1`.
#include <fmt/format.h>
#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <thread>
#include <vector>

#include "apps/cli_checks.h"
#include "apps/bench_util.h"
#ifdef ROLLOUTCORE_WITH_CUDA
#include "apps/bench_gpu_refit.h"
#endif
#include "apps/bench_refit_delta.h"
#include "apps/child_process.h"
#include "apps/commands.h"
#include "rolloutcore/base/json.h"

namespace rc::apps {
namespace {

struct BenchRefitOptions {
  std::string transport = "shm";
  std::string model = "qwen3-0.6b";
  std::string engine_model = "";  // engine preset; default: same as the model
  int ranks = 2;
  int tp = 1;
  int repeats = 3;
  bool json = false;
  // GPU transports (cuda_ipc, nccl; built with ROLLOUTCORE_WITH_CUDA): bench_gpu_refit_cmd.cc.
  std::string source;  // trainer layout; default fsdp:<trainer-ranks>
  std::string target;  // engine layout; default tp:<tensor-parallel-size>
  int device = 1;
  int owner_device = 0;
  uint64_t seed = 1;
  int64_t timeout_ms = 120'000;
  bool kill_owner_mid_transfer = false;
  std::string json_out;
  bool delta = false;  // full and delta refit side by side (bench_refit_delta.cc)
  bool gpu = false;    // with delta: into GPU staging through the device receiver (bench_gpu_delta.cc)
  std::vector<double> change_fractions = {0.01, 0.1};
};

bool IsGpuTransport(const std::string& t) { return t == "cuda_ipc" || t == "nccl"; }

Status RunBench(const BenchRefitOptions& o) {
  char tmpl[] = "/tmp/rolloutcore-bench-refit-XXXXXX";
  std::string dir = mkdtemp(tmpl);
  RC_ASSIGN_OR_RETURN(int dir_port, FreePort());
  RC_ASSIGN_OR_RETURN(int trainer_port, FreePort());
  RC_ASSIGN_OR_RETURN(int engine_port, FreePort());
  std::string dir_url = "http://127.0.0.1:" + std::to_string(dir_port);
  auto log = [&](const std::string& n) { return dir + "/" + n + ".log"; };
  std::cerr << "bench refit: work dir " << dir << "\n";
  RC_ASSIGN_OR_RETURN(auto d, ChildProcess::Spawn("directory", {"directory", "serve", "--store", "memory", "--port",
                                                                std::to_string(dir_port)}, log("directory")));
  RC_RETURN_IF_ERROR(BenchWaitHealthy(d.get(), dir_port, "/health", 30));
  std::string engine_model = o.engine_model.empty() ? (o.model == "qwen3-0.6b" ? "qwen3-0.6b-like" : o.model) : o.engine_model;
  std::cerr << "bench refit: starting the engine (" << engine_model << ", dummy weights, tp " << o.tp << ")\n";
  RC_ASSIGN_OR_RETURN(auto e, ChildProcess::Spawn("engine", {"engine", "serve", "--model", engine_model, "--load-format",
                                                             "dummy", "--tensor-parallel-size", std::to_string(o.tp),
                                                             "--port", std::to_string(engine_port)}, log("engine")));
  std::cerr << "bench refit: starting the trainer (" << o.model << ", fsdp:" << o.ranks << ", " << o.transport << ")\n";
  RC_ASSIGN_OR_RETURN(auto t, ChildProcess::Spawn("trainer", {"trainer", "serve", "--model", o.model, "--name", "bench",
                                                              "--layout", "fsdp:" + std::to_string(o.ranks),
                                                              "--directory", dir_url, "--transport", o.transport,
                                                              "--port", std::to_string(trainer_port)}, log("trainer")));
  RC_RETURN_IF_ERROR(BenchWaitHealthy(e.get(), engine_port, "/health", 600));
  RC_RETURN_IF_ERROR(BenchWaitHealthy(t.get(), trainer_port, "/status", 600));
  Json body{{"model", "bench"}, {"version", "v0"}, {"directory", dir_url}};
  Json runs = Json::array();
  Json last;
  // Every warm stage is paired with an all-thread memcpy of the bytes it pulled, timed right
  // before and right after it (the mean of the two): the pairs' ratios, not one memcpy figure
  // taken after all stages, are what the machine's moving memory bandwidth cannot skew.
  std::unique_ptr<MemcpyPairing> pairing;
  std::vector<double> paired_ratios;
  Json pairs = Json::array();
  for (int i = 0; i < o.repeats; ++i) {
    double before_ms = 0;
    if (pairing) before_ms = pairing->CopyMs();
    RC_ASSIGN_OR_RETURN(last, BenchCall(engine_port, "POST", "/rc/refit/stage", body));
    runs.push_back(last);
    std::string paired;
    if (pairing) {
      const double copy_ms = (before_ms + pairing->CopyMs()) / 2;
      const double stage_ms = last["stages_ms"].value("total", 0.0);
      if (stage_ms > 0) {
        paired_ratios.push_back(copy_ms / stage_ms);
        pairs.push_back(Json{{"stage_ms", stage_ms}, {"memcpy_all_threads_ms", copy_ms}, {"ratio", copy_ms / stage_ms}});
        paired = fmt::format(", paired {}-thread memcpy {:.1f} ms: stage at {:.2f} x", pairing->threads(), copy_ms,
                             copy_ms / stage_ms);
      }
    } else {
      pairing = std::make_unique<MemcpyPairing>(last.value("bytes_pulled", uint64_t{0}), 0);
      (void)pairing->CopyMs();  // faults the pages in
    }
    std::cerr << fmt::format("bench refit: stage {}: {:.2f} GB/s wire, {:.1f} ms wire, {:.1f} ms stage, plan cached: {}{}\n",
                             i + 1, last["wire_gbps"].get<double>(), last["stages_ms"]["wire"].get<double>(),
                             last["stages_ms"].value("total", 0.0), last["plan_cached"].get<bool>(), paired);
  }
  pairing.reset();
  std::sort(paired_ratios.begin(), paired_ratios.end());
  const double paired_median =
      paired_ratios.empty() ? 0.0
                            : (paired_ratios[(paired_ratios.size() - 1) / 2] + paired_ratios[paired_ratios.size() / 2]) / 2;
  uint64_t bytes = last["bytes_pulled"].get<uint64_t>();
  double memcpy_gbps = MemcpyGbps(bytes);
  const int all_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  double memcpy_all_gbps = MemcpyGbpsThreads(bytes, all_threads);
  double best = 0;
  for (const auto& r : runs) best = std::max(best, r["wire_gbps"].get<double>());
  const double first = runs.empty() ? 0.0 : runs[0]["wire_gbps"].get<double>();
  RC_ASSIGN_OR_RETURN(Json paused, BenchCall(engine_port, "POST", "/pause?mode=wait"));
  (void)paused;
  RC_ASSIGN_OR_RETURN(Json installed, BenchCall(engine_port, "POST", "/rc/refit/install", Json{{"version", "v0"}}));
  RC_ASSIGN_OR_RETURN(Json resumed, BenchCall(engine_port, "POST", "/resume"));
  (void)resumed;
  // End to end: the last (warm) stage -- discovery, plan, pull, transform, finite check, staged
  // digest -- plus the install and its live digest, over the bytes pulled.
  const double stage_ms = last["stages_ms"].value("total", 0.0);
  const double install_ms = installed["stages_ms"].value("install", 0.0);
  const double verify_ms = installed["stages_ms"].value("post_install", 0.0);
  const double e2e_ms = stage_ms + install_ms + verify_ms;
  const double e2e_gbps = e2e_ms > 0 ? static_cast<double>(bytes) / (e2e_ms * 1e6) : 0.0;
  Json report{{"transport", o.transport},
              {"model", o.model},
              {"trainer_layout", "fsdp:" + std::to_string(o.ranks)},
              {"engine_layout", "tp:" + std::to_string(o.tp)},
              {"bytes_needed", last["bytes_needed"]},
              {"bytes_planned", last["bytes_planned"]},
              {"bytes_pulled", bytes},
              {"planned_equals_needed", last["bytes_needed"] == last["bytes_planned"]},
              {"descriptors", last["descriptors"]},
              {"wire_gbps_best", best},
              {"wire_gbps_first", first},
              {"memcpy_1thread_gbps", memcpy_gbps},
              {"ratio_to_memcpy", memcpy_gbps > 0 ? best / memcpy_gbps : 0.0},
              {"memcpy_all_threads_gbps", memcpy_all_gbps},
              {"memcpy_threads", all_threads},
              {"e2e_ms", e2e_ms},
              {"e2e_gbps", e2e_gbps},
              {"e2e_ratio_to_memcpy_1thread", memcpy_gbps > 0 ? e2e_gbps / memcpy_gbps : 0.0},
              {"e2e_ratio_to_memcpy_all_threads", memcpy_all_gbps > 0 ? e2e_gbps / memcpy_all_gbps : 0.0},
              // The warm stages, each against an all-thread memcpy timed beside it (stage only: the
              // swap install and its digest add ~1 ms once, reported apart).
              {"stage_ratio_to_paired_memcpy_all_threads_median", paired_median},
              {"stage_paired_memcpy", pairs},
              {"stages_ms", last["stages_ms"]},
              {"install_ms", installed["stages_ms"]["install"]},
              {"post_install_digest_ms", installed["stages_ms"]["post_install"]},
              {"digest_verified", installed["live_content_digest"] == last["content_digest"]}};
  if (o.json) {
    std::cout << report.dump(2) << "\n";
  } else {
    std::cout << fmt::format(
        "refit {} over {}: {} -> {}\n  bytes needed {} planned {} pulled {} (planned == needed: {}), {} descriptors\n"
        "  wire {:.2f} GB/s (best of {}; first, cold: {:.2f}), single-thread memcpy {:.2f} GB/s, ratio {:.2f}\n"
        "  end to end (stage + install + verify) {:.1f} ms = {:.2f} GB/s: {:.2f} x single-thread memcpy, {:.2f} x "
        "{}-thread memcpy ({:.2f} GB/s)\n"
        "  warm stages vs a {}-thread memcpy timed beside each (median of {}): {:.2f} x\n"
        "  stages (ms): {}\n  install {:.1f} ms, live digest {:.1f} ms, digest verified: {}\n",
        o.model, o.transport, report["trainer_layout"].get<std::string>(), report["engine_layout"].get<std::string>(),
        report["bytes_needed"].dump(), report["bytes_planned"].dump(), bytes, report["planned_equals_needed"].dump(),
        report["descriptors"].dump(), best, o.repeats, first, memcpy_gbps, report["ratio_to_memcpy"].get<double>(),
        e2e_ms, e2e_gbps, report["e2e_ratio_to_memcpy_1thread"].get<double>(),
        report["e2e_ratio_to_memcpy_all_threads"].get<double>(), all_threads, memcpy_all_gbps, all_threads,
        paired_ratios.size(), paired_median, last["stages_ms"].dump(), installed["stages_ms"]["install"].get<double>(),
        installed["stages_ms"]["post_install"].get<double>(), report["digest_verified"].dump());
  }
  StopAllChildren();
  std::filesystem::remove_all(dir);
  return OkStatus();
}

}  // namespace

void RegisterBenchRefitCommand(CLI::App& app, int* exit_code) {
  CLI::App* bench = nullptr;
  for (CLI::App* sub : app.get_subcommands([](CLI::App* a) { return a->get_name() == "bench"; })) bench = sub;
  if (bench == nullptr) {
    bench = app.add_subcommand("bench", "Benchmarks.");
    bench->require_subcommand(1);
  }
  auto o = std::make_shared<BenchRefitOptions>();
  auto* cmd = bench->add_subcommand(
      "refit", "Receiver-driven refit across processes: wire GB/s vs a single-thread memcpy measured in the same run.");
#ifdef ROLLOUTCORE_WITH_CUDA
  cmd->add_option("--transport", o->transport, "shm, ucx, or (GPU weights) cuda_ipc, nccl")
      ->check(CLI::IsMember({"shm", "ucx", "cuda_ipc", "nccl"}))
      ->capture_default_str();
#else
  cmd->add_option("--transport", o->transport, "shm or ucx")->check(CLI::IsMember({"shm", "ucx"}))->capture_default_str();
#endif
  cmd->add_option("--model", o->model, "Refit preset for the trainer (tiny, qwen3-0.6b, ...)")->capture_default_str();
  cmd->add_option("--engine-model", o->engine_model, "Engine preset of the same geometry (default: matching)");
  cmd->add_option("--trainer-ranks", o->ranks, "Trainer ranks (fsdp:N)")->check(CLI::Range(1, 65536))->capture_default_str();
  cmd->add_option("--tensor-parallel-size", o->tp, "Engine tensor-parallel ranks")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  cmd->add_option("--repeats", o->repeats, "Stages to time")->check(CLI::Range(1, 100000))->capture_default_str();
  cmd->add_flag("--json", o->json, "Print a JSON report");
  cmd->add_flag("--delta", o->delta,
                "Full and sparse delta refit side by side: per --change-fractions F, refit v0 in full, then v1 as a "
                "delta on v0 (bytes on the wire, stage, install, verify, pause; docs/refit.md)");
  cmd->add_option("--change-fractions", o->change_fractions,
                  "With --delta: the trainer's change fractions (space or comma separated: 0.01,0.1)")
      ->delimiter(',')
      ->check(FiniteNumber(0, 1))
      ->capture_default_str();
  cmd->add_option("--source", o->source, "Trainer layout (default fsdp:<trainer-ranks>)");
  cmd->add_option("--target", o->target,
                  "Engine layout (default tp:<tensor-parallel-size>); GPU transports use bf16 parameters unless "
                  "'@dtype' is given");
#ifdef ROLLOUTCORE_WITH_CUDA
  cmd->add_option("--device", o->device, "GPU transports: the receiver's CUDA device")->capture_default_str();
  cmd->add_option("--owner-device", o->owner_device, "GPU transports: the trainer's CUDA device")->capture_default_str();
  cmd->add_option("--seed", o->seed, "GPU transports: seed of the weights")->check(Unsigned())->capture_default_str();
  cmd->add_option("--timeout-ms", o->timeout_ms, "GPU transports: deadline of one stage")
      ->check(CLI::Range(int64_t{1}, int64_t{86'400'000}))
      ->capture_default_str();
  cmd->add_flag("--kill-owner-mid-transfer", o->kill_owner_mid_transfer,
                "GPU transports: finally SIGKILL the owner during a stage and check the failure is detected in time");
  cmd->add_option("--json-out", o->json_out, "GPU transports and --gpu: also write the JSON report to this file");
  cmd->add_flag("--gpu", o->gpu,
                "With --delta: the receiver stages into GPU memory through the device receiver vLLM's extension runs "
                "(the trainer publishes over --transport shm or ucx); --repeats full and delta stages each, "
                "alternated, then one with --delta-policy auto; on --device (the only GPU when there is one)");
#endif
  cmd->callback([o, exit_code] {
    Status s = OkStatus();
    if (IsGpuTransport(o->transport)) {
#ifdef ROLLOUTCORE_WITH_CUDA
      GpuRefitBenchOptions g;
      g.transport = o->transport;
      g.model = o->model;
      g.source = o->source.empty() ? "fsdp:" + std::to_string(o->ranks) : o->source;
      g.target = o->target.empty() ? "tp:" + std::to_string(o->tp) : o->target;
      g.device = o->device;
      g.owner_device = o->owner_device;
      g.repeats = o->repeats;
      g.seed = o->seed;
      g.timeout_ms = o->timeout_ms;
      g.kill_owner_mid_transfer = o->kill_owner_mid_transfer;
      g.json = o->json;
      g.json_out = o->json_out;
      s = RunGpuRefitBench(g);
#endif
#ifdef ROLLOUTCORE_WITH_CUDA
    } else if (o->delta && o->gpu) {
      GpuDeltaBenchOptions g;
      g.transport = o->transport;
      g.model = o->model;
      g.ranks = o->ranks;
      g.fractions = o->change_fractions;
      g.device = o->device < cuda::DeviceCount() ? o->device : 0;
      g.cycles = o->repeats;
      g.timeout_ms = o->timeout_ms;
      g.json = o->json;
      g.json_out = o->json_out;
      s = RunGpuDeltaBench(g);
#endif
    } else if (o->delta) {
      DeltaBenchOptions d;
      d.transport = o->transport;
      d.model = o->model;
      d.engine_model = o->engine_model;
      d.ranks = o->ranks;
      d.tp = o->tp;
      d.fractions = o->change_fractions;
      d.json = o->json;
      s = RunDeltaRefitBench(d);
    } else if (!o->source.empty() || !o->target.empty()) {
      s = InvalidArgument("--source/--target are for the GPU transports; use --trainer-ranks and "
                          "--tensor-parallel-size with shm/ucx");
    } else {
      s = RunBench(*o);
    }
    if (!s.ok()) {
      std::cerr << "bench refit: " << s.ToString() << "\n";
      StopAllChildren();
      *exit_code = 1;
      return;
    }
    *exit_code = 0;
  });
}

}  // namespace rc::apps
