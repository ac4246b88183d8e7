#include "rolloutcore/base/mutex.h"

#include <gtest/gtest.h>

#include <atomic>

#include <chrono>
#include <thread>

namespace rc {
namespace {

struct Counter {
  Mutex mu;
  CondVar cv;
  int value GUARDED_BY(mu) = 0;
};

TEST(MutexTest, CondVarWaitReturnsWithTheLockHeldAndSeesTheWrite) {
  Counter c;
  std::thread producer([&] {
    MutexLock lock(c.mu);
    c.value = 7;
    c.cv.notify_all();
  });
  MutexLock lock(c.mu);
  c.cv.wait(lock, [&]() REQUIRES(c.mu) { return c.value == 7; });
  EXPECT_EQ(c.value, 7);
  EXPECT_TRUE(lock.owns_lock());
  lock.unlock();
  EXPECT_FALSE(lock.owns_lock());
  producer.join();
  lock.lock();
  EXPECT_EQ(c.value, 7);
}

TEST(MutexTest, WaitForTimesOutAndKeepsTheLock) {
  Counter c;
  MutexLock lock(c.mu);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(c.cv.wait_for(lock, std::chrono::milliseconds(20), [&]() REQUIRES(c.mu) { return c.value > 0; }));
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(20));
  EXPECT_TRUE(lock.owns_lock());
  // Still held: another thread cannot take it.
  bool other_got_it = true;
  std::thread([&] {
    other_got_it = false;
    if (c.mu.try_lock()) {
      other_got_it = true;
      c.mu.unlock();
    }
  }).join();
  EXPECT_FALSE(other_got_it);
}

TEST(MutexTest, AdoptedLockIsReleasedAtScopeEnd) {
  Counter c;
  bool adopted = false;
  if (c.mu.try_lock()) {
    MutexLock lock(c.mu, std::adopt_lock);
    c.value = 1;
    adopted = true;
  }
  ASSERT_TRUE(adopted);
  bool free_again = false;
  if (c.mu.try_lock()) {  // released by the MutexLock
    free_again = true;
    EXPECT_EQ(c.value, 1);
    c.mu.unlock();
  }
  EXPECT_TRUE(free_again);
}

}  // namespace
TEST(MutexTest, APriorityLockGetsInBetweenTwoIterationsOfALoopThatReTakesTheMutex) {
  rc::Mutex mu;
  rc::Turnstile turnstile;
  std::atomic<bool> stop{false};
  std::atomic<int64_t> iterations{0};
  std::thread looper([&] {
    while (!stop.load()) {
      turnstile.YieldToWaiters();
      rc::MutexLock l(mu);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));  // a step's work, lock held
      iterations.fetch_add(1);
    }
  });
  while (iterations.load() < 3) std::this_thread::yield();
  for (int round = 0; round < 20; ++round) {
    const int64_t before = iterations.load();
    {
      rc::PriorityLock l(mu, turnstile);
      // At most the iteration that held the mutex when this lock was asked for finished.
      EXPECT_LE(iterations.load() - before, 1) << "round " << round;
      EXPECT_EQ(turnstile.waiting(), 0);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  stop = true;
  looper.join();
}

}  // namespace rc
