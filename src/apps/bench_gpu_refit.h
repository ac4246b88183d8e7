// The GPU variant of `rolloutcore bench refit` (bench_gpu_refit_cmd.cc, built only with
// ROLLOUTCORE_WITH_CUDA): `--transport cuda_ipc|nccl` runs it instead of the host-memory bench.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "rolloutcore/base/status.h"
#include "rolloutcore/cuda/gpu_refit.h"
#include "rolloutcore/refit/capture.h"

namespace rc::apps {

struct GpuRefitBenchOptions {
  std::string transport = "cuda_ipc";
  std::string model = "qwen3-8b";
  std::string source = "fsdp:1";  // trainer layout of the owner process
  std::string target = "tp:1";    // engine layout; parameters are bf16 unless "@dtype" says otherwise
  int owner_device = 0;
  int device = 1;  // the receiver's GPU (the owner's when only one GPU exists)
  int repeats = 3;
  uint64_t seed = 1;
  int64_t timeout_ms = 120'000;
  bool kill_owner_mid_transfer = false;
  bool json = false;
  std::string json_out;  // also write the JSON report here
};

[[nodiscard]] Status RunGpuRefitBench(const GpuRefitBenchOptions& options);

// `rolloutcore bench refit --delta --gpu` (bench_gpu_delta.cc): full and delta stages side by side
// into GPU staging, through receiver::DeviceReceiver (the vLLM extension's receiver), from a trainer
// process publishing over a host transport.
struct GpuDeltaBenchOptions {
  std::string transport = "shm";
  std::string model = "qwen3-8b";
  int ranks = 1;                        // trainer ranks (fsdp:N)
  std::vector<double> fractions = {0.01};
  int device = 0;
  int cycles = 3;                       // full and delta stages each, alternated
  int64_t timeout_ms = 600'000;         // one stage
  bool json = false;
  std::string json_out;
};
[[nodiscard]] Status RunGpuDeltaBench(const GpuDeltaBenchOptions& options);

// Every parameter of `params` in one device allocation (256-byte aligned, zeroed), by name.
struct GpuParamArena {
  cuda::DeviceBuffer buffer;
  refit::DestinationBuffers views;
  uint64_t bytes = 0;  // parameter bytes (without alignment padding)
};
[[nodiscard]] Result<GpuParamArena> AllocateGpuParams(const std::vector<refit::TensorSpec>& params, int device);

}  // namespace rc::apps
