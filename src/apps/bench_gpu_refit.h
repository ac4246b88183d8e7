// The GPU variant of `rolloutcore bench refit` (bench_gpu_refit_cmd.cc, built only with
// ROLLOUTCORE_WITH_CUDA): `--transport cuda_ipc|nccl` runs it instead of the host-memory bench.
#pragma once

#include <cstdint>
#include <string>

#include "rolloutcore/base/status.h"

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

}  // namespace rc::apps
