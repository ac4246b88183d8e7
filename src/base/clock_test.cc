#include "rolloutcore/base/clock.h"

#include <gtest/gtest.h>

namespace rc {
namespace {

TEST(ManualClockTest, MovesOnlyWhenTold) {
  ManualClock clock(5'000'000);
  EXPECT_EQ(clock.NowMs(), 5);
  clock.AdvanceMs(10);
  EXPECT_EQ(clock.NowMs(), 15);
  clock.SleepForMs(3);  // advances instead of sleeping
  EXPECT_EQ(clock.NowMs(), 18);
  clock.Set(0);
  EXPECT_EQ(clock.NowNs(), 0);
}

TEST(SystemClockTest, IsMonotonic) {
  auto* clock = SystemClock::Default();
  int64_t a = clock->NowNs();
  clock->SleepForNs(1'000'000);
  int64_t b = clock->NowNs();
  EXPECT_GE(b - a, 1'000'000);
}

}  // namespace
}  // namespace rc
