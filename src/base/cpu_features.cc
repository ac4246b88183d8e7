#include "rolloutcore/base/cpu_features.h"

namespace rc {

bool CpuHasAvx2() {
  static const bool kHas = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return kHas;
}

bool CpuHasFma() {
  static const bool kHas = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("fma") != 0;
  }();
  return kHas;
}

bool CpuHasAvx512() {
  static const bool kHas = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  }();
  return kHas;
}

}  // namespace rc
