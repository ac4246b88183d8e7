// `rolloutcore bench refit --transport cuda_ipc|nccl ...`: refit of GPU-resident weights between two
// processes on two GPUs, and the hidden `rolloutcore bench gpu-owner` that plays the trainer.
//
// The owner (a child process, GPU `--owner-device`) allocates the model sharded by `--source` in one
// device allocation, fills it with seeded bf16 values, digests every shard on the GPU (and checks a
// sample of shards against the CPU digest), registers the shards with the transport and writes the
// manifest (shard table with handles and digests) to a file. The receiver (this process, GPU
// `--device`) captures the engine layout `--target` with bf16 parameters, plans against the
// manifest, imports the sources once, then measures in one run:
//   wire     ExecutePlanOnDevice into device staging parameters (best of --repeats), against a
//            cudaMemcpyPeer of the same bytes from the owner's GPU to this one;
//   install  one batched copy kernel staging -> live parameters, against one device-to-device
//            cudaMemcpy of the same bytes;
//   digest   the content digest of the live parameters on the GPU (one kernel), compared tensor by
//            tensor with the manifest's digests, and on a sample of tensors with the CPU digest.
// With --kill-owner-mid-transfer it finally starts one more transfer, SIGKILLs the owner while the
// transfer runs and reports how long the executor took to fail (it must fail, within the deadline).
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "apps/bench_gpu_refit.h"
#include "apps/child_process.h"
#include "apps/cli_checks.h"
#include "apps/commands.h"
#include "apps/stop_signals.h"
#include "rolloutcore/base/json.h"
#include "rolloutcore/cuda/gpu_refit.h"
#include "rolloutcore/refit/digest.h"
#include "rolloutcore/refit/layouts.h"
#include "rolloutcore/refit/manifest.h"
#include "rolloutcore/refit/model_config.h"
#include "rolloutcore/refit/planner.h"
#include "rolloutcore/transport/registry.h"

namespace rc::apps {
namespace {

using Clk = std::chrono::steady_clock;

double MsSince(Clk::time_point t0) { return std::chrono::duration<double, std::milli>(Clk::now() - t0).count(); }
double Gbps(uint64_t bytes, double ms) { return ms > 0 ? static_cast<double>(bytes) / (ms * 1e6) : 0.0; }

Status WriteFileAtomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) return Unavailable(fmt::format("cannot write '{}'", tmp));
    f << text;
    if (!f) return Unavailable(fmt::format("cannot write '{}'", tmp));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return Unavailable(fmt::format("cannot rename '{}' to '{}': {}", tmp, path, ec.message()));
  return OkStatus();
}

// ---- owner ------------------------------------------------------------------------------------------

struct OwnerOptions {
  std::string transport = "cuda_ipc";
  std::string model = "qwen3-8b";
  std::string layout = "fsdp:1";
  int device = 0;
  uint64_t seed = 1;
  std::string manifest_out;
  uint64_t cpu_check_bytes = uint64_t{256} << 20;
};

// Checks shards (smallest first, up to `budget` bytes) against the CPU DigestBlock.
Result<Json> CpuCheckShards(const cuda::GpuOwner& owner, int device, uint64_t budget) {
  const std::vector<cuda::DeviceBlock>& blocks = owner.blocks();
  struct Item {
    size_t t, s;
    uint64_t bytes;
  };
  const refit::Manifest& m = owner.manifest();
  std::vector<Item> items;
  size_t k = 0;
  for (size_t t = 0; t < m.tables.size(); ++t) {
    for (size_t s = 0; s < m.tables[t].shards.size(); ++s, ++k) {
      items.push_back({t, s, static_cast<uint64_t>(refit::NumElements(m.tables[t].shards[s].shape)) *
                                 refit::DTypeSize(m.tables[t].dtype)});
    }
  }
  std::vector<size_t> flat_index(items.size());
  for (size_t i = 0; i < items.size(); ++i) flat_index[i] = i;
  std::stable_sort(flat_index.begin(), flat_index.end(), [&](size_t a, size_t b) { return items[a].bytes < items[b].bytes; });
  uint64_t used = 0, checked = 0;
  std::vector<std::byte> host;
  for (size_t i : flat_index) {
    const Item& it = items[i];
    if (used + it.bytes > budget) break;
    used += it.bytes;
    const refit::ShardTable& table = m.tables[it.t];
    const refit::ShardInfo& shard = table.shards[it.s];
    host.resize(it.bytes);
    RC_RETURN_IF_ERROR(cuda::CopyToHost(host.data(), blocks[i].data, it.bytes, device));
    const uint64_t cpu = refit::DigestBlock(table.dtype, table.shape, shard.box(), host.data());
    if (cpu != shard.digest) {
      return DataLoss(fmt::format("tensor {} rank {}: GPU digest {} != CPU digest {}", table.name, shard.rank,
                                  Hex64(shard.digest), Hex64(cpu)));
    }
    ++checked;
  }
  return Json{{"cpu_checked_shards", checked}, {"cpu_checked_bytes", used}};
}

Status RunOwner(const OwnerOptions& o) {
  // SIGTERM / SIGINT end the owner; block them before any thread starts so sigwait gets them.
  const StopSignals stop_signals;
  ::setenv("NCCL_NVLS_ENABLE", "0", 1);
  if (o.manifest_out.empty()) return InvalidArgument("--manifest-out is required");
  RC_ASSIGN_OR_RETURN(refit::ModelConfig config, refit::ResolveModelSpec(o.model));
  RC_ASSIGN_OR_RETURN(refit::TrainerLayout layout, refit::ParseTrainerLayout(o.layout));
  cuda::GpuOwnerOptions go;
  go.config = config;
  go.layout = layout;
  go.transport = o.transport;
  go.device = o.device;
  go.seed = o.seed;
  std::cerr << fmt::format("gpu-owner: pid {}, {} on device {} ({}), {} over {}\n", ::getpid(), o.model, o.device,
                           cuda::DeviceDescription(o.device), o.layout, o.transport);
  const auto t0 = Clk::now();
  RC_ASSIGN_OR_RETURN(std::unique_ptr<cuda::GpuOwner> owner, cuda::GpuOwner::Start(go));
  const double start_ms = MsSince(t0);
  RC_ASSIGN_OR_RETURN(Json check, CpuCheckShards(*owner, o.device, o.cpu_check_bytes));
  const refit::Manifest& m = owner->manifest();
  Json report{{"pid", ::getpid()},
              {"device", o.device},
              {"bytes", owner->bytes()},
              {"start_ms", start_ms},
              {"fill_ms", owner->fill_ms()},
              {"shard_digest_kernel_ms", owner->digest_ms()},
              {"cpu_check", check},
              {"manifest", refit::ManifestToJson(m)}};
  RC_RETURN_IF_ERROR(WriteFileAtomically(o.manifest_out, report.dump()));
  std::cerr << fmt::format("gpu-owner: {} tensors, {:.2f} GB published in {:.0f} ms (fill {:.0f} ms, shard digests "
                           "{:.2f} ms); manifest {}\n",
                           m.tables.size(), static_cast<double>(owner->bytes()) / 1e9, start_ms, owner->fill_ms(),
                           owner->digest_ms(), o.manifest_out);
  const int sig = stop_signals.Wait();
  std::cerr << "gpu-owner: signal " << sig << ", exiting\n";
  return OkStatus();
}

// ---- receiver ---------------------------------------------------------------------------------------

Result<Json> WaitForOwner(ChildProcess* owner, const std::string& path, int seconds) {
  const auto t0 = Clk::now();
  while (MsSince(t0) < seconds * 1000.0) {
    if (std::filesystem::exists(path)) {
      std::ifstream f(path);
      std::stringstream ss;
      ss << f.rdbuf();
      return ParseJson(ss.str(), path);
    }
    if (!owner->Alive()) return Unavailable("the gpu-owner process exited:\n" + owner->LogTail(30));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return DeadlineExceeded(fmt::format("the gpu-owner published nothing in {} s:\n{}", seconds, owner->LogTail(30)));
}

// CPU digest of a sample of tensors (those whose regions all lie in small parameters), against the
// GPU digests.
Result<Json> CpuCrossCheck(const refit::Capture& capture, const refit::DestinationBuffers& live,
                           std::span<const refit::DigestRegion> regions, const refit::TensorDigests& gpu, int device,
                           uint64_t budget) {
  std::vector<size_t> order(capture.params.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return capture.params[a].bytes() < capture.params[b].bytes(); });
  std::set<uint32_t> chosen;
  uint64_t used = 0;
  for (size_t i : order) {
    if (used + capture.params[i].bytes() > budget) break;
    used += capture.params[i].bytes();
    chosen.insert(static_cast<uint32_t>(i));
  }
  std::map<std::string, bool> tensor_ok;  // tensor -> all its regions in chosen params
  for (const refit::DigestRegion& r : regions) {
    const refit::CapturedCopy& c = capture.copies[r.copy];
    auto [it, inserted] = tensor_ok.emplace(c.source, true);
    it->second = it->second && chosen.count(c.param) > 0;
  }
  std::vector<refit::DigestRegion> sample;
  for (const refit::DigestRegion& r : regions) {
    if (tensor_ok[capture.copies[r.copy].source]) sample.push_back(r);
  }
  std::map<std::string, std::vector<std::byte>> host;
  refit::DestinationBuffers host_views;
  for (uint32_t i : chosen) {
    const refit::TensorSpec& p = capture.params[i];
    auto& bytes = host[p.name];
    bytes.resize(p.bytes());
    RC_RETURN_IF_ERROR(cuda::CopyToHost(bytes.data(), live.at(p.name).data(), p.bytes(), device));
    host_views.emplace(p.name, std::span<std::byte>(bytes));
  }
  RC_ASSIGN_OR_RETURN(refit::TensorDigests cpu, refit::DigestInstalled(capture, host_views, sample));
  for (const auto& [name, d] : cpu) {
    auto it = gpu.find(name);
    if (it == gpu.end() || it->second != d) {
      return DataLoss(fmt::format("tensor {}: GPU digest {} != CPU digest {}", name,
                                  it == gpu.end() ? std::string("(none)") : Hex64(it->second), Hex64(d)));
    }
  }
  return Json{{"cpu_checked_tensors", cpu.size()}, {"cpu_checked_param_bytes", used}};
}

// The receiver's side, set up while the owner fills its memory: the captured engine layout, the
// staging and live parameters, the owner's report and manifest, the plan, the transport and the
// sources imported once. Filled in place (PrepareReceiver) and never moved: the imports use the
// transport.
struct GpuReceiver {
  refit::Capture capture;
  double capture_ms = 0;
  GpuParamArena staging;
  GpuParamArena live;
  Json owner_report;
  refit::Manifest manifest;
  refit::TransferPlan plan;
  double plan_ms = 0;
  std::unique_ptr<rc::transport::Transport> transport;
  std::unique_ptr<cuda::PlanImports> imports;
  double import_ms = 0;
  cuda::DeviceExecuteOptions eo;
};

// The device checks before this process uses a GPU, and the line that names the devices.
Status CheckGpuRefitDevices(const GpuRefitBenchOptions& o) {
  const int devices = cuda::DeviceCount();
  if (devices == 0) return FailedPrecondition("no CUDA device: the GPU refit bench needs one or two GPUs");
  if (o.device >= devices || o.owner_device >= devices) {
    return InvalidArgument(fmt::format("--device {} / --owner-device {}: this machine has {} CUDA device(s)", o.device,
                                       o.owner_device, devices));
  }
  if (o.transport == "nccl" && o.device == o.owner_device) {
    return InvalidArgument("nccl needs the owner and the receiver on different GPUs (--device != --owner-device)");
  }
  std::cerr << fmt::format("bench refit (gpu): receiver on device {} ({}), owner on device {} ({}), peer access {}\n",
                           o.device, cuda::DeviceDescription(o.device), o.owner_device,
                           cuda::DeviceDescription(o.owner_device),
                           cuda::CanAccessPeer(o.device, o.owner_device) ? "yes" : "no");
  return OkStatus();
}

Status PrepareReceiver(const GpuRefitBenchOptions& o, const refit::ModelConfig& config,
                       const refit::EngineLayout& target, ChildProcess* owner, const std::string& manifest_path,
                       GpuReceiver* r) {
  // Plan while the owner fills its memory.
  auto t0 = Clk::now();
  RC_ASSIGN_OR_RETURN(r->capture, refit::CaptureEngineRank(config, target, 0));
  r->capture_ms = MsSince(t0);
  RC_ASSIGN_OR_RETURN(r->staging, AllocateGpuParams(r->capture.params, o.device));
  RC_ASSIGN_OR_RETURN(r->live, AllocateGpuParams(r->capture.params, o.device));

  RC_ASSIGN_OR_RETURN(r->owner_report, WaitForOwner(owner, manifest_path, 900));
  RC_ASSIGN_OR_RETURN(r->manifest, refit::ManifestFromJson(r->owner_report["manifest"]));
  t0 = Clk::now();
  RC_ASSIGN_OR_RETURN(r->plan, refit::BuildPlan(r->capture, r->manifest));
  r->plan_ms = MsSince(t0);
  const refit::TransferPlan& plan = r->plan;
  std::cerr << fmt::format("bench refit (gpu): plan: {} runs ({} direct), {} install steps, {:.2f} GB to move\n",
                           plan.runs.size(), plan.direct_runs, plan.installs.size(),
                           static_cast<double>(plan.stats.bytes_planned) / 1e9);

  transport::TransportOptions topts;
  topts.device = o.device;
  RC_ASSIGN_OR_RETURN(r->transport, transport::CreateTransport(o.transport, topts));
  if (o.transport == "cuda_ipc") (void)cuda::EnablePeerAccess(o.device, o.owner_device);
  t0 = Clk::now();
  RC_ASSIGN_OR_RETURN(r->imports, cuda::PlanImports::Import(plan, *r->transport));
  r->import_ms = MsSince(t0);

  r->eo.device = o.device;
  r->eo.timeout_ms = o.timeout_ms;
  return OkStatus();
}

// wire: ExecutePlanOnDevice into the staging parameters, --repeats times, and its baseline.
struct WireFigures {
  std::vector<double> wire_ms;
  double wire_best = 0;
  refit::ExecuteStats exec;
  bool peer = false;
  std::vector<double> peer_ms;
  double peer_best = 0;
};

Result<WireFigures> MeasureWire(const GpuRefitBenchOptions& o, const GpuReceiver& r) {
  WireFigures w;
  for (int i = 0; i < o.repeats; ++i) {
    const auto t0 = Clk::now();
    RC_ASSIGN_OR_RETURN(w.exec, cuda::ExecutePlanOnDevice(r.plan, *r.imports, r.staging.views, r.eo));
    w.wire_ms.push_back(MsSince(t0));
    std::cerr << fmt::format("bench refit (gpu): stage {}: {:.1f} ms, {:.1f} GB/s\n", i + 1, w.wire_ms.back(),
                             Gbps(w.exec.bytes_read, w.wire_ms.back()));
  }
  w.wire_best = *std::min_element(w.wire_ms.begin(), w.wire_ms.end());

  // Peer-copy baseline: the same number of bytes from the owner's GPU to this one.
  w.peer = cuda::EnablePeerAccess(o.device, o.owner_device);
  {
    RC_ASSIGN_OR_RETURN(cuda::DeviceBuffer src, cuda::DeviceBuffer::Allocate(o.owner_device, w.exec.bytes_read));
    for (int i = 0; i < o.repeats; ++i) {
      RC_ASSIGN_OR_RETURN(double ms, cuda::TimedMemcpy(r.live.buffer.data(), o.device, src.data(), o.owner_device,
                                                       std::min<uint64_t>(w.exec.bytes_read, r.live.buffer.size())));
      w.peer_ms.push_back(ms);
    }
  }
  w.peer_best = *std::min_element(w.peer_ms.begin(), w.peer_ms.end());
  return w;
}

// install: staging -> live, one batched kernel, against one D2D memcpy of the same bytes.
struct InstallFigures {
  std::vector<double> install_ms, d2d_ms;
  double install_best = 0, d2d_best = 0;
};

Result<InstallFigures> MeasureInstall(const GpuRefitBenchOptions& o, const GpuReceiver& r) {
  std::vector<cuda::DeviceCopy> copies;
  for (const refit::TensorSpec& p : r.capture.params) {
    copies.push_back({r.staging.views.at(p.name).data(), r.live.views.at(p.name).data(), p.bytes()});
  }
  InstallFigures f;
  for (int i = 0; i < o.repeats; ++i) {
    RC_ASSIGN_OR_RETURN(double d2d, cuda::TimedMemcpy(r.live.buffer.data(), o.device, r.staging.buffer.data(), o.device,
                                                      r.live.bytes));
    f.d2d_ms.push_back(d2d);
    RC_ASSIGN_OR_RETURN(double ms, cuda::CopyOnDevice(copies, o.device));  // last: live holds the install
    f.install_ms.push_back(ms);
  }
  f.install_best = *std::min_element(f.install_ms.begin(), f.install_ms.end());
  f.d2d_best = *std::min_element(f.d2d_ms.begin(), f.d2d_ms.end());
  return f;
}

// digest: the content digest of the live parameters on the GPU, its baseline (a read sweep), the
// comparison with the manifest's digests and the CPU cross-check.
struct DigestFigures {
  cuda::DeviceDigest digest;
  double build_ms = 0;
  std::vector<double> digest_ms;
  double digest_best = 0;
  std::vector<double> read_ms;
  double read_best = 0;
  uint64_t mismatched = 0, compared = 0;
  std::string first_mismatch;
  bool combined_ok = false;
  Json cpu_check;
};

Result<DigestFigures> MeasureDigest(const GpuRefitBenchOptions& o, const GpuReceiver& r) {
  DigestFigures f;
  const refit::Capture& capture = r.capture;
  const GpuParamArena& live = r.live;
  // Digest of the live parameters.
  const refit::Capture* ranks[] = {&capture};
  const std::vector<std::vector<refit::DigestRegion>> owned = refit::AssignDigestOwnership(ranks);
  auto t0 = Clk::now();
  RC_ASSIGN_OR_RETURN(f.digest, cuda::DeviceDigest::ForInstalled(capture, live.views, owned[0], o.device));
  f.build_ms = MsSince(t0);
  refit::TensorDigests installed;
  for (int i = 0; i < o.repeats; ++i) {
    double ms = 0;
    RC_ASSIGN_OR_RETURN(installed, f.digest.Run(&ms));
    f.digest_ms.push_back(ms);
  }
  f.digest_best = *std::min_element(f.digest_ms.begin(), f.digest_ms.end());
  // The device's read bandwidth over the same bytes (a plain 16-byte-load sweep of the live
  // buffer): the digest's reference (issue 15: digest >= 0.8 x read).
  for (int i = 0; i < o.repeats; ++i) {
    RC_ASSIGN_OR_RETURN(double ms, cuda::TimedReadSweep(live.buffer.data(), live.bytes / 16 * 16, o.device));
    f.read_ms.push_back(ms);
  }
  f.read_best = *std::min_element(f.read_ms.begin(), f.read_ms.end());
  RC_ASSIGN_OR_RETURN(refit::TensorDigests expected, refit::TensorDigestsFromShards(r.manifest));
  for (const auto& [name, d] : installed) {
    ++f.compared;
    auto it = expected.find(name);
    if (it == expected.end() || it->second != d) {
      if (f.mismatched++ == 0) {
        f.first_mismatch = fmt::format("{}: installed {} expected {}", name, Hex64(d),
                                       it == expected.end() ? std::string("(none)") : Hex64(it->second));
      }
    }
  }
  const bool all_tensors = installed.size() == expected.size();
  f.combined_ok = all_tensors && refit::CombineTensorDigests(installed) == r.manifest.content_digest;
  RC_ASSIGN_OR_RETURN(f.cpu_check, CpuCrossCheck(capture, live.views, owned[0], installed, o.device, uint64_t{512} << 20));
  return f;
}

// --kill-owner-mid-transfer: one more stage; SIGKILL the owner while it runs (a third of a stage
// in), and how long the executor took to fail.
Json KillOwnerMidTransfer(const GpuRefitBenchOptions& o, const GpuReceiver& r, ChildProcess* owner, double wire_best) {
  std::atomic<bool> done{false};
  Status result;
  double returned_ms = 0;
  const auto start = Clk::now();
  std::thread stage([&] {
    auto x = cuda::ExecutePlanOnDevice(r.plan, *r.imports, r.staging.views, r.eo);
    result = x.ok() ? OkStatus() : x.status();
    returned_ms = MsSince(start);
    done = true;
  });
  const double kill_at_ms = wire_best / 3;
  std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(kill_at_ms * 1000)));
  const bool finished_before_kill = done.load();
  const double killed_ms = MsSince(start);
  owner->Kill();
  stage.join();
  const bool detected = !result.ok() && (result.code() == StatusCode::kUnavailable ||
                                         result.code() == StatusCode::kAborted);
  return Json{{"killed_at_ms", killed_ms},
              {"finished_before_kill", finished_before_kill},
              {"executor_returned_ms", returned_ms},
              {"detection_ms", returned_ms - killed_ms},
              {"deadline_ms", o.timeout_ms},
              {"status", result.ToString()},
              // A stage that completed before the kill landed proves nothing either way.
              {"detected_within_deadline",
               finished_before_kill ? Json(nullptr)
                                    : Json(detected && returned_ms < static_cast<double>(o.timeout_ms))}};
}

// The JSON report. `r` is not const: the owner's figures are read with Json::operator[] as before
// (a key the owner did not write reads null).
// GB/s of the best runs: the wire and its peer-copy baseline over the bytes read, the install and
// its D2D baseline over the parameter bytes.
struct Bandwidths {
  double wire = 0, peer = 0, install = 0, d2d = 0;
};

Bandwidths BandwidthsOf(const GpuReceiver& r, const WireFigures& w, const InstallFigures& in) {
  Bandwidths b;
  b.wire = Gbps(w.exec.bytes_read, w.wire_best);
  b.peer = Gbps(w.exec.bytes_read, w.peer_best);
  b.install = Gbps(r.live.bytes, in.install_best);
  b.d2d = Gbps(r.live.bytes, in.d2d_best);
  return b;
}

Json GpuRefitReport(const GpuRefitBenchOptions& o, const std::string& target_text, GpuReceiver& r,
                    const WireFigures& w, const InstallFigures& in, const DigestFigures& d, const Json& kill) {
  const GpuParamArena& live = r.live;
  const refit::TransferPlan& plan = r.plan;
  const Bandwidths bw = BandwidthsOf(r, w, in);
  const double wire_gbps = bw.wire, peer_gbps = bw.peer, install_gbps = bw.install, d2d_gbps = bw.d2d;
  return Json{{"transport", o.transport},
              {"model", o.model},
              {"source_layout", o.source},
              {"target_layout", target_text},
              {"owner_device", o.owner_device},
              {"device", o.device},
              {"device_name", cuda::DeviceDescription(o.device)},
              {"peer_access", w.peer},
              {"params", r.capture.params.size()},
              {"param_bytes", live.bytes},
              {"bytes_needed", plan.stats.bytes_needed},
              {"bytes_planned", plan.stats.bytes_planned},
              {"bytes_read", w.exec.bytes_read},
              {"runs", plan.runs.size()},
              {"direct_runs", plan.direct_runs},
              {"install_steps", plan.installs.size()},
              {"wire_ms", w.wire_ms},
              {"wire_gbps", wire_gbps},
              {"peer_copy_ms", w.peer_ms},
              {"peer_copy_gbps", peer_gbps},
              {"wire_to_peer_ratio", peer_gbps > 0 ? wire_gbps / peer_gbps : 0.0},
              {"install_ms", in.install_ms},
              {"install_gbps", install_gbps},
              {"d2d_memcpy_ms", in.d2d_ms},
              {"d2d_memcpy_gbps", d2d_gbps},
              {"install_to_d2d_ratio", d2d_gbps > 0 ? install_gbps / d2d_gbps : 0.0},
              {"digest_ms", d.digest_ms},
              {"digest_best_ms", d.digest_best},
              {"digest_gbps", Gbps(live.bytes, d.digest_best)},
              {"read_sweep_ms", d.read_ms},
              {"read_gbps", Gbps(live.bytes / 16 * 16, d.read_best)},
              {"digest_to_read_ratio",
               d.read_best > 0 ? Gbps(live.bytes, d.digest_best) / Gbps(live.bytes / 16 * 16, d.read_best) : 0.0},
              {"digest_chunks", d.digest.chunks()},
              {"digest_table_build_ms", d.build_ms},
              {"digest_tensors_compared", d.compared},
              {"digest_tensors_mismatched", d.mismatched},
              {"digest_first_mismatch", d.first_mismatch},
              {"digest_verified", d.mismatched == 0 && d.combined_ok},
              {"cpu_cross_check", d.cpu_check},
              {"capture_ms", r.capture_ms},
              {"plan_ms", r.plan_ms},
              {"import_ms", r.import_ms},
              {"owner", Json{{"start_ms", r.owner_report["start_ms"]},
                             {"fill_ms", r.owner_report["fill_ms"]},
                             {"shard_digest_kernel_ms", r.owner_report["shard_digest_kernel_ms"]},
                             {"cpu_check", r.owner_report.value("cpu_check", Json())}}},
              {"kill_owner_mid_transfer", kill}};
}

// The table (without --json).
void PrintGpuRefitTable(const GpuRefitBenchOptions& o, const std::string& target_text, const GpuReceiver& r,
                        const WireFigures& w, const InstallFigures& in, const DigestFigures& d, const Json& report,
                        const Json& kill) {
  const GpuParamArena& live = r.live;
  const refit::TransferPlan& plan = r.plan;
  const Bandwidths bw = BandwidthsOf(r, w, in);
  std::cout << fmt::format(
      "GPU refit {} over {}: {} -> {} (device {} <- device {})\n"
      "  {} params, {:.2f} GB; needed {} planned {} read {} bytes; {} runs ({} direct), {} install steps\n"
      "  | stage   | ms (best of {}) | GB/s    | baseline               | ratio | target |\n"
      "  | wire    | {:>14.2f} | {:>7.1f} | peer copy {:>7.1f} GB/s | {:.2f}  | >= 0.9 |\n"
      "  | install | {:>14.2f} | {:>7.1f} | d2d memcpy {:>6.1f} GB/s | {:.2f}  | >= 0.8 |\n"
      "  | digest  | {:>14.2f} | {:>7.1f} | read sweep {:>6.1f} GB/s | {:.2f}  | >= 0.8 |\n"
      "  digest verified: {} ({} tensors, {} mismatched{}{}); CPU cross-check: {}\n"
      "  capture {:.1f} ms, plan {:.1f} ms, import {:.1f} ms, digest table {:.1f} ms ({} chunks)\n",
      o.model, o.transport, o.source, target_text, o.device, o.owner_device, r.capture.params.size(),
      static_cast<double>(live.bytes) / 1e9, plan.stats.bytes_needed, plan.stats.bytes_planned, w.exec.bytes_read,
      plan.runs.size(), plan.direct_runs, plan.installs.size(), o.repeats, w.wire_best, bw.wire, bw.peer,
      report["wire_to_peer_ratio"].get<double>(), in.install_best, bw.install, bw.d2d,
      report["install_to_d2d_ratio"].get<double>(), d.digest_best, Gbps(live.bytes, d.digest_best),
      report["read_gbps"].get<double>(), report["digest_to_read_ratio"].get<double>(),
      report["digest_verified"].dump(), d.compared, d.mismatched, d.first_mismatch.empty() ? "" : ": ",
      d.first_mismatch, d.cpu_check.dump(), r.capture_ms, r.plan_ms, r.import_ms, d.build_ms, d.digest.chunks());
  if (!kill.is_null()) std::cout << "  kill owner mid-transfer: " << kill.dump() << "\n";
}

}  // namespace

Result<GpuParamArena> AllocateGpuParams(const std::vector<refit::TensorSpec>& params, int device) {
  GpuParamArena a;
  std::vector<uint64_t> offsets;
  uint64_t total = 0;
  for (const refit::TensorSpec& p : params) {
    offsets.push_back(total);
    total += (p.bytes() + 255) & ~uint64_t{255};
    a.bytes += p.bytes();
  }
  RC_ASSIGN_OR_RETURN(a.buffer, cuda::DeviceBuffer::Allocate(device, total));
  RC_RETURN_IF_ERROR(cuda::FillBytes(a.buffer.data(), 0, total, device));
  for (size_t i = 0; i < params.size(); ++i) {
    a.views.emplace(params[i].name, std::span<std::byte>(a.buffer.data() + offsets[i], params[i].bytes()));
  }
  return a;
}

Status RunGpuRefitBench(const GpuRefitBenchOptions& o) {
  ::setenv("NCCL_NVLS_ENABLE", "0", 1);
  if (o.repeats < 1) return InvalidArgument(fmt::format("--repeats must be at least 1, got {}", o.repeats));
  RC_ASSIGN_OR_RETURN(refit::ModelConfig config, refit::ResolveModelSpec(o.model));
  RC_ASSIGN_OR_RETURN(refit::TrainerLayout source, refit::ParseTrainerLayout(o.source));
  const std::string target_text = o.target.find('@') == std::string::npos ? o.target + "@bf16" : o.target;
  RC_ASSIGN_OR_RETURN(refit::EngineLayout target, refit::ParseEngineLayout(target_text));
  (void)source;

  char tmpl[] = "/tmp/rolloutcore-bench-gpu-refit-XXXXXX";
  const char* made = ::mkdtemp(tmpl);
  if (made == nullptr) return Unavailable("cannot create a work directory under /tmp");
  const std::string dir = made;
  struct RemoveDir {
    std::string path;
    ~RemoveDir() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  } remove_dir{dir};
  const std::string manifest_path = dir + "/manifest.json";
  std::cerr << "bench refit (gpu): work dir " << dir << "\n";
  // The owner starts before this process touches CUDA (fork + exec of a CUDA process is fine, but
  // keep the child free of any inherited CUDA state anyway).
  RC_ASSIGN_OR_RETURN(auto owner,
                      ChildProcess::Spawn("gpu-owner",
                                          {"bench", "gpu-owner", "--transport", o.transport, "--model", o.model,
                                           "--layout", o.source, "--device", std::to_string(o.owner_device), "--seed",
                                           std::to_string(o.seed), "--manifest-out", manifest_path},
                                          dir + "/owner.log"));
  RC_RETURN_IF_ERROR(CheckGpuRefitDevices(o));
  GpuReceiver r;
  RC_RETURN_IF_ERROR(PrepareReceiver(o, config, target, owner.get(), manifest_path, &r));
  RC_ASSIGN_OR_RETURN(WireFigures wire, MeasureWire(o, r));
  RC_ASSIGN_OR_RETURN(InstallFigures install, MeasureInstall(o, r));
  RC_ASSIGN_OR_RETURN(DigestFigures digest, MeasureDigest(o, r));
  Json kill = nullptr;
  if (o.kill_owner_mid_transfer) kill = KillOwnerMidTransfer(o, r, owner.get(), wire.wire_best);

  const Json report = GpuRefitReport(o, target_text, r, wire, install, digest, kill);
  if (!o.json_out.empty()) RC_RETURN_IF_ERROR(WriteFileAtomically(o.json_out, report.dump(2) + "\n"));
  if (o.json) {
    std::cout << report.dump(2) << "\n";
  } else {
    PrintGpuRefitTable(o, target_text, r, wire, install, digest, report, kill);
  }
  r.imports.reset();
  r.transport.reset();
  StopAllChildren();
  if (!report["digest_verified"].get<bool>()) {
    return DataLoss(fmt::format("installed weights do not match the owner's digests ({} of {} tensors differ{}{})",
                                digest.mismatched, digest.compared, digest.first_mismatch.empty() ? "" : ": ",
                                digest.first_mismatch));
  }
  if (!kill.is_null() && kill["detected_within_deadline"].is_boolean() && !kill["detected_within_deadline"].get<bool>()) {
    return Internal(fmt::format("the killed owner was not detected within the deadline: {}", kill.dump()));
  }
  return OkStatus();
}

void RegisterBenchGpuOwnerCommand(CLI::App& app, int* exit_code) {
  CLI::App* bench = nullptr;
  for (CLI::App* sub : app.get_subcommands([](CLI::App* a) { return a->get_name() == "bench"; })) bench = sub;
  if (bench == nullptr) {
    bench = app.add_subcommand("bench", "Benchmarks.");
    bench->require_subcommand(1);
  }
  auto o = std::make_shared<OwnerOptions>();
  auto* cmd = bench->add_subcommand("gpu-owner", "(internal) the trainer process of the GPU refit bench");
  cmd->group("");  // hidden
  cmd->add_option("--transport", o->transport, "cuda_ipc or nccl")->capture_default_str();
  cmd->add_option("--model", o->model, "Model preset or config.json")->capture_default_str();
  cmd->add_option("--layout", o->layout, "Trainer layout (fsdp:N, tp:N, replicated:N)")->capture_default_str();
  cmd->add_option("--device", o->device, "CUDA device")->capture_default_str();
  cmd->add_option("--seed", o->seed, "Seed of the weights")->check(Unsigned())->capture_default_str();
  cmd->add_option("--manifest-out", o->manifest_out, "Where to write the manifest (JSON)")->required();
  cmd->add_option("--cpu-check-bytes", o->cpu_check_bytes, "Shard bytes to check against the CPU digest")
      ->capture_default_str();
  cmd->callback([o, exit_code] {
    Status s = RunOwner(*o);
    if (!s.ok()) {
      std::cerr << "bench gpu-owner: " << s.ToString() << "\n";
      *exit_code = 1;
      return;
    }
    *exit_code = 0;
  });
}

}  // namespace rc::apps
