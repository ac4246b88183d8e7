// Clock: an injectable source of monotonic time, so deadline logic is testable without sleeping.
//
// NowMs()/NowNs() are monotonic (steady) times with an arbitrary epoch. SystemClock reads
// std::chrono::steady_clock. ManualClock only moves when told to (Advance/Set) and is what tests
// and the simulator use; SleepFor on a ManualClock advances it instead of sleeping.
//
// Thread safety: all methods of both clocks may be called from any thread.
#pragma once

#include <atomic>
#include <cstdint>

namespace rc {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual int64_t NowNs() const = 0;
  int64_t NowMs() const { return NowNs() / 1'000'000; }
  // Blocks the caller for duration_ns of this clock's time.
  virtual void SleepForNs(int64_t duration_ns) = 0;
  void SleepForMs(int64_t ms) { SleepForNs(ms * 1'000'000); }
};

class SystemClock final : public Clock {
 public:
  int64_t NowNs() const override;
  void SleepForNs(int64_t duration_ns) override;
  // A process-wide instance.
  static SystemClock* Default();
};

class ManualClock final : public Clock {
 public:
  explicit ManualClock(int64_t start_ns = 0) : now_ns_(start_ns) {}
  int64_t NowNs() const override { return now_ns_.load(std::memory_order_acquire); }
  void SleepForNs(int64_t duration_ns) override { Advance(duration_ns); }
  void Advance(int64_t delta_ns) { now_ns_.fetch_add(delta_ns, std::memory_order_acq_rel); }
  void AdvanceMs(int64_t ms) { Advance(ms * 1'000'000); }
  void Set(int64_t now_ns) { now_ns_.store(now_ns, std::memory_order_release); }

 private:
  std::atomic<int64_t> now_ns_;
};

// Wall-clock time in milliseconds since the Unix epoch (for journal timestamps shown to people).
int64_t WallTimeMs();

}  // namespace rc
