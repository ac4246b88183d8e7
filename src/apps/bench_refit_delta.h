// `rolloutcore bench refit --delta` (bench_refit_delta.cc): full and sparse delta refit side by side.
#pragma once

#include <string>
#include <vector>

#include "rolloutcore/base/status.h"

namespace rc::apps {

struct DeltaBenchOptions {
  std::string transport = "shm";
  std::string model = "qwen3-0.6b";
  std::string engine_model;  // default: the engine preset matching the model
  int ranks = 2;
  int tp = 1;
  std::vector<double> fractions = {0.01, 0.1};
  bool json = false;
};

Status RunDeltaRefitBench(const DeltaBenchOptions& options);

}  // namespace rc::apps
