// Mutex, MutexLock, CondVar: the locks that clang's thread-safety analysis checks.
//
// A field that a mutex protects is declared `T field_ GUARDED_BY(mu_);`, a function that must
// be called with the mutex held (the `...Locked` helpers) is declared `REQUIRES(mu_)`, and a
// function that takes the mutex itself is `EXCLUDES(mu_)`. The clang build (preset tsan, with
// -Wthread-safety -Werror) then rejects any access to a guarded field without its lock. On other
// compilers (GCC, nvcc) the macros expand to nothing and the types are thin wrappers over
// std::mutex / std::condition_variable, so the generated code is the same.
// After leveldb's port/thread_annotations.h and abseil's Mutex.
//
//   rc::Mutex mu_;
//   int count_ GUARDED_BY(mu_) = 0;
//   void Bump() EXCLUDES(mu_) { rc::MutexLock lock(mu_); ++count_; }
//
// Waiting: rc::CondVar takes the rc::MutexLock that holds the mutex, as std::condition_variable
// takes a std::unique_lock. A predicate lambda reads guarded fields, and clang analyses a
// lambda's body on its own, so mark it: `cv_.wait(lock, [&]() REQUIRES(mu_) { return done_; })`.
//
// Thread safety: Mutex and CondVar are shared between threads; a MutexLock belongs to the thread
// that made it. Names of the lock/wait methods follow the standard library (lock, unlock, wait,
// wait_for, notify_one...) so that these types drop in for the std ones and work with
// std::scoped_lock-style generic code.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#if defined(__clang__) && !defined(SWIG)
#define RC_THREAD_ANNOTATION_(x) __attribute__((x))
#else
#define RC_THREAD_ANNOTATION_(x)
#endif

#ifndef CAPABILITY
#define CAPABILITY(x) RC_THREAD_ANNOTATION_(capability(x))
#endif
#ifndef SCOPED_CAPABILITY
#define SCOPED_CAPABILITY RC_THREAD_ANNOTATION_(scoped_lockable)
#endif
#ifndef GUARDED_BY
#define GUARDED_BY(x) RC_THREAD_ANNOTATION_(guarded_by(x))
#endif
#ifndef PT_GUARDED_BY
#define PT_GUARDED_BY(x) RC_THREAD_ANNOTATION_(pt_guarded_by(x))
#endif
#ifndef ACQUIRED_BEFORE
#define ACQUIRED_BEFORE(...) RC_THREAD_ANNOTATION_(acquired_before(__VA_ARGS__))
#endif
#ifndef ACQUIRED_AFTER
#define ACQUIRED_AFTER(...) RC_THREAD_ANNOTATION_(acquired_after(__VA_ARGS__))
#endif
#ifndef REQUIRES
#define REQUIRES(...) RC_THREAD_ANNOTATION_(requires_capability(__VA_ARGS__))
#endif
#ifndef EXCLUDES
#define EXCLUDES(...) RC_THREAD_ANNOTATION_(locks_excluded(__VA_ARGS__))
#endif
#ifndef ACQUIRE
#define ACQUIRE(...) RC_THREAD_ANNOTATION_(acquire_capability(__VA_ARGS__))
#endif
#ifndef RELEASE
#define RELEASE(...) RC_THREAD_ANNOTATION_(release_capability(__VA_ARGS__))
#endif
#ifndef TRY_ACQUIRE
#define TRY_ACQUIRE(...) RC_THREAD_ANNOTATION_(try_acquire_capability(__VA_ARGS__))
#endif
#ifndef ASSERT_CAPABILITY
#define ASSERT_CAPABILITY(x) RC_THREAD_ANNOTATION_(assert_capability(x))
#endif
#ifndef RETURN_CAPABILITY
#define RETURN_CAPABILITY(x) RC_THREAD_ANNOTATION_(lock_returned(x))
#endif
// Turns the analysis off for one function. Every use says why the analysis cannot see the lock.
#ifndef NO_THREAD_SAFETY_ANALYSIS
#define NO_THREAD_SAFETY_ANALYSIS RC_THREAD_ANNOTATION_(no_thread_safety_analysis)
#endif

namespace rc {

class CondVar;

// A non-recursive mutex (std::mutex underneath) that the analysis knows as a capability.
class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void lock() ACQUIRE() { mu_.lock(); }
  void unlock() RELEASE() { mu_.unlock(); }
  bool try_lock() TRY_ACQUIRE(true) { return mu_.try_lock(); }
  // Tells the analysis that the calling thread holds the mutex (checked by nothing at run time):
  // for code reached only from a locked caller that the analysis cannot follow (a callback).
  void AssertHeld() const ASSERT_CAPABILITY(this) {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds a Mutex for its scope, like std::unique_lock: it may be unlocked and locked again inside
// the scope (unlock() / lock()), and CondVar waits on it.
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  // Takes over a mutex the caller already holds (after `if (!mu.try_lock()) ...`).
  MutexLock(Mutex& mu, std::adopt_lock_t) REQUIRES(mu) : mu_(mu) {}
  ~MutexLock() RELEASE() {
    if (held_) mu_.unlock();
  }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  void unlock() RELEASE() {
    held_ = false;
    mu_.unlock();
  }
  void lock() ACQUIRE() {
    mu_.lock();
    held_ = true;
  }
  bool owns_lock() const { return held_; }

 private:
  friend class CondVar;
  Mutex& mu_;
  bool held_ = true;
};

// A condition variable (std::condition_variable underneath) for rc::Mutex. Each wait takes the
// MutexLock that holds the mutex, releases it while blocked and holds it again on return, with the
// meaning of the std::condition_variable method of the same name.
class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  void notify_one() noexcept { cv_.notify_one(); }
  void notify_all() noexcept { cv_.notify_all(); }

  void wait(MutexLock& lock) {
    Adopted a(lock);
    cv_.wait(a.lock);
  }
  template <typename Pred>
  void wait(MutexLock& lock, Pred pred) {
    Adopted a(lock);
    cv_.wait(a.lock, std::move(pred));
  }
  template <typename Rep, typename Period>
  std::cv_status wait_for(MutexLock& lock, const std::chrono::duration<Rep, Period>& timeout) {
    Adopted a(lock);
    return cv_.wait_for(a.lock, timeout);
  }
  template <typename Rep, typename Period, typename Pred>
  bool wait_for(MutexLock& lock, const std::chrono::duration<Rep, Period>& timeout, Pred pred) {
    Adopted a(lock);
    return cv_.wait_for(a.lock, timeout, std::move(pred));
  }
  template <typename Clock, typename Duration>
  std::cv_status wait_until(MutexLock& lock, const std::chrono::time_point<Clock, Duration>& deadline) {
    Adopted a(lock);
    return cv_.wait_until(a.lock, deadline);
  }
  template <typename Clock, typename Duration, typename Pred>
  bool wait_until(MutexLock& lock, const std::chrono::time_point<Clock, Duration>& deadline, Pred pred) {
    Adopted a(lock);
    return cv_.wait_until(a.lock, deadline, std::move(pred));
  }

 private:
  // Lends the held std::mutex to std::condition_variable for one wait and takes it back, so the
  // MutexLock still owns it afterwards (the std wait returns with the mutex held, always).
  struct Adopted {
    explicit Adopted(MutexLock& l) : lock(l.mu_.mu_, std::adopt_lock) {}
    ~Adopted() { lock.release(); }
    std::unique_lock<std::mutex> lock;
  };
  std::condition_variable cv_;
};

// A mutex that one thread re-takes in a loop (the engine's step) is not fair: std::mutex lets the
// thread that just unlocked lock again at once, so another caller can wait for seconds. Callers
// that must get in between two iterations take the mutex through PriorityLock, which counts them
// in a Turnstile; the looping thread calls YieldToWaiters() before each lock and steps aside
// while any is counted. A waiter stops being counted once it holds the mutex.
class Turnstile {
 public:
  // Returns once no PriorityLock is waiting for the mutex: yields at first, then sleeps in short
  // naps (a waiter may wait long behind another holder).
  void YieldToWaiters() const {
    for (int spins = 0; waiting_.load(std::memory_order_acquire) > 0; ++spins) {
      if (spins < 64) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }
  int waiting() const { return waiting_.load(std::memory_order_acquire); }

 private:
  friend class PriorityLock;
  std::atomic<int> waiting_{0};
};

// Holds a Mutex for its scope, as MutexLock does, announced in `turnstile` while it waits.
class SCOPED_CAPABILITY PriorityLock {
 public:
  PriorityLock(Mutex& mu, Turnstile& turnstile) ACQUIRE(mu) : mu_(mu) {
    turnstile.waiting_.fetch_add(1, std::memory_order_acq_rel);
    mu_.lock();
    turnstile.waiting_.fetch_sub(1, std::memory_order_acq_rel);
  }
  ~PriorityLock() RELEASE() { mu_.unlock(); }
  PriorityLock(const PriorityLock&) = delete;
  PriorityLock& operator=(const PriorityLock&) = delete;

 private:
  Mutex& mu_;
};

}  // namespace rc
