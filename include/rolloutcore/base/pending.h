// Pending<T>: the result of an asynchronous operation that completes at most once.
//
// The producer (an adapter's worker thread, or a scripted fake ticking in virtual time) calls
// Fulfill() once; consumers poll Ready() or block in WaitFor(). A consumer that stops caring
// (the call overran its deadline) simply drops its copy: the shared state lives until the
// producer is done with it too, so an abandoned call can never write into freed memory.
//
// Thread safety: all methods may be called from any thread; copies share one state.
// Invariant: once Ready() is true the value never changes.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "rolloutcore/base/status.h"
#include "rolloutcore/base/mutex.h"

namespace rc {

namespace internal {
// A spin-wait hint to the CPU (x86 `pause`); nothing elsewhere.
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}
}  // namespace internal

template <typename T>
class Pending {
 public:
  Pending() : state_(std::make_shared<State>()) {}

  // A Pending that is already complete.
  static Pending Completed(Result<T> value) {
    Pending p;
    p.Fulfill(std::move(value));
    return p;
  }

  // Completes the operation; later calls are ignored (returns false). Runs the OnReady callbacks
  // on this thread just before the value is published: a time taken in one is never later than
  // the moment any consumer can see the answer.
  bool Fulfill(Result<T> value) const {
    std::vector<std::function<void()>> callbacks;
    rc::MutexLock lock(state_->mu);
    if (state_->value.has_value() || state_->claimed) return false;
    if (!state_->on_ready.empty()) {
      // Observers: run them unlocked before publishing (without any, one lock publishes).
      state_->claimed = true;  // a concurrent Fulfill loses from here on
      callbacks.swap(state_->on_ready);
      lock.unlock();
      for (auto& fn : callbacks) fn();
      callbacks.clear();
      lock.lock();
      callbacks.swap(state_->on_ready);  // registered while the first ones ran
    }
    state_->value.emplace(std::move(value));
    state_->ready.store(true, std::memory_order_release);
    lock.unlock();
    state_->cv.notify_all();
    for (auto& fn : callbacks) fn();
    return true;
  }

  // Runs `fn` once when the operation completes: on the fulfilling thread just before the answer
  // is published (so `fn` does not see it yet), or here at once when it is complete already. For
  // observers (timing, logging) that would otherwise keep a thread blocked on the answer; `fn`
  // must be quick, must not block, and must not hold a copy of this Pending (the state would keep
  // itself alive until fulfilled).
  void OnReady(std::function<void()> fn) const {
    {
      rc::MutexLock lock(state_->mu);
      if (!state_->value.has_value()) {
        state_->on_ready.push_back(std::move(fn));
        return;
      }
    }
    fn();
  }

  // Spins (no sleep, no lock) up to `max` for the answer; true when ready. For a consumer that
  // expects an answer within microseconds and would otherwise pay a thread wake-up (tens to
  // hundreds of microseconds on a virtual machine) to learn of it.
  bool SpinFor(std::chrono::nanoseconds max) const {
    const auto until = std::chrono::steady_clock::now() + max;
    for (;;) {
      if (ReadyNow()) return true;
      if (std::chrono::steady_clock::now() >= until) return false;
      for (int i = 0; i < 16; ++i) internal::CpuRelax();
    }
  }

  // Ready() without the lock (an atomic load): for a caller that polls in a spin.
  bool ReadyNow() const { return state_->ready.load(std::memory_order_acquire); }

  bool Ready() const {
    rc::MutexLock lock(state_->mu);
    return state_->value.has_value();
  }

  // Blocks up to `timeout` of real time; true when ready.
  bool WaitFor(std::chrono::nanoseconds timeout) const {
    rc::MutexLock lock(state_->mu);
    return state_->cv.wait_for(lock, timeout, [&]() REQUIRES(state_->mu) { return state_->value.has_value(); });
  }

  // The result; only valid once Ready().
  Result<T> Get() const {
    rc::MutexLock lock(state_->mu);
    if (!state_->value.has_value()) return Internal("Pending::Get called before the operation completed");
    return *state_->value;
  }

 private:
  struct State {
    rc::Mutex mu;
    rc::CondVar cv;
    std::optional<Result<T>> value GUARDED_BY(mu);  // guarded by mu
    std::atomic<bool> ready{false};                 // value is set (SpinFor reads it without mu)
    std::vector<std::function<void()>> on_ready GUARDED_BY(mu);  // run once, by Fulfill
    bool claimed GUARDED_BY(mu) = false;                          // a Fulfill is completing it
  };
  std::shared_ptr<State> state_;
};

// RunDetached: runs fn on a detached worker (internal::RunOnDetachedWorker) and returns its
// Pending. If the caller abandons the Pending (deadline), the worker still runs fn to completion
// and its result is dropped; fn must own everything it touches (capture shared_ptrs, not
// references).
// Blocks for the result up to timeout_ms; DeadlineExceeded naming `what` when it did not come.
// It spins the first kAwaitSpinUs (a quick call answers without a wake-up), then sleeps.
inline constexpr int64_t kAwaitSpinUs = 200;
template <typename T>
Result<T> AwaitPending(Pending<T> p, int64_t timeout_ms, const std::string& what) {
  const int64_t spin_us = std::min<int64_t>(kAwaitSpinUs, timeout_ms * 1000);
  if (!p.SpinFor(std::chrono::microseconds(spin_us)) && !p.WaitFor(std::chrono::milliseconds(timeout_ms))) {
    return DeadlineExceeded(what + " did not answer within " + std::to_string(timeout_ms) + " ms");
  }
  return p.Get();
}

namespace internal {
// Runs `task` on a worker of a process-wide elastic pool: an idle worker takes it at once; when
// none is idle a new worker is started, so a task that hangs never delays another (it only keeps
// its own worker). Workers are kept parked for reuse (issue 15: no thread start per adapter call).
// (Workers that spin before parking were tried: on 2 cores the spinners delayed the calls they
// waited for, 3.8 ms of controller overhead against 3.1–3.6 ms parked.)
void RunOnDetachedWorker(std::function<void()> task);
// Workers started so far (for tests).
int64_t DetachedWorkersStarted();
}  // namespace internal

template <typename T>
Pending<T> RunDetached(std::function<Result<T>()> fn) {
  Pending<T> p;
  internal::RunOnDetachedWorker([p, fn = std::move(fn)]() mutable { p.Fulfill(fn()); });
  return p;
}

}  // namespace rc
