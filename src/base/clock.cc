#include "rolloutcore/base/clock.h"

#include <chrono>
#include <thread>

namespace rc {

int64_t SystemClock::NowNs() const {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void SystemClock::SleepForNs(int64_t duration_ns) {
  if (duration_ns > 0) std::this_thread::sleep_for(std::chrono::nanoseconds(duration_ns));
}

SystemClock* SystemClock::Default() {
  static SystemClock clock;
  return &clock;
}

int64_t WallTimeMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace rc
