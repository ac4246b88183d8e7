#include "rolloutcore/base/parallel.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace rc {
namespace {

std::atomic<int> g_threads_seen{0};
struct CountThread {
  CountThread() { g_threads_seen.fetch_add(1); }
};
thread_local CountThread t_count;

TEST(ParallelFor, CallsEveryIndexExactlyOnce) {
  for (size_t n : {0, 1, 2, 7, 1000}) {
    std::vector<std::atomic<int>> hits(n);
    ParallelFor(n, 4, [&](size_t i) { hits[i].fetch_add(1); });
    for (size_t i = 0; i < n; ++i) EXPECT_EQ(hits[i].load(), 1) << "n " << n << " index " << i;
  }
}

TEST(ParallelFor, ReusesItsThreadsInsteadOfStartingThemPerCall) {
  // Warm: the pool exists now and every helper has run an index (each sleeps, so all join).
  ParallelFor(64, 4, [](size_t) {
    (void)&t_count;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  const int before = g_threads_seen.load();
  for (int call = 0; call < 50; ++call) {
    ParallelFor(64, 4, [](size_t) {
      (void)&t_count;  // first touch on a new thread constructs it
      std::this_thread::yield();
    });
  }
  // Threads started per call would construct a fresh thread_local in every call (~150 here).
  EXPECT_LE(g_threads_seen.load() - before, 0) << "threads were started by the calls";
  EXPECT_GE(internal::SharedParallelism(), 4);
}

TEST(ParallelFor, NestedAndConcurrentCallsFinish) {
  std::atomic<int> total{0};
  std::vector<std::thread> callers;
  callers.reserve(3);
  for (int c = 0; c < 3; ++c) {
    callers.emplace_back([&] {
      ParallelFor(8, 4, [&](size_t) { ParallelFor(10, 4, [&](size_t) { total.fetch_add(1); }); });
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(total.load(), 3 * 8 * 10);
}

}  // namespace
}  // namespace rc

#include "rolloutcore/base/pending.h"

namespace rc {
namespace {

TEST(RunDetached, ReusesParkedWorkersAndAHungCallDelaysNoOther) {
  // Sequential calls: after the first, each one finds a parked worker.
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(RunDetached<int>([] { return Result<int>(1); }).WaitFor(std::chrono::seconds(5)));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // let the worker park
  const int64_t before = internal::DetachedWorkersStarted();
  for (int i = 0; i < 100; ++i) {
    auto p = RunDetached<int>([i] { return Result<int>(i); });
    ASSERT_TRUE(p.WaitFor(std::chrono::seconds(5)));
    EXPECT_EQ(p.Get().value(), i);
    std::this_thread::sleep_for(std::chrono::microseconds(200));  // the worker parks again
  }
  EXPECT_LE(internal::DetachedWorkersStarted() - before, 5) << "a thread was started per call";
  // A call that hangs keeps its worker; the next call still runs at once.
  auto hold = std::make_shared<std::promise<void>>();
  std::shared_future<void> release = hold->get_future().share();
  auto hung = RunDetached<int>([release] {
    release.wait();
    return Result<int>(0);
  });
  auto quick = RunDetached<int>([] { return Result<int>(7); });
  ASSERT_TRUE(quick.WaitFor(std::chrono::seconds(5))) << "a hung call delayed another";
  EXPECT_EQ(quick.Get().value(), 7);
  EXPECT_FALSE(hung.Ready());
  hold->set_value();
  EXPECT_TRUE(hung.WaitFor(std::chrono::seconds(5)));
}

// SpinFor answers without a lock or a sleep: at once when the value is in, false after about
// `max` when it is not, and true as soon as another thread fulfills it while it spins. AwaitPending
// (which spins first) still waits for a slow answer and times out on a missing one.
TEST(PendingSpin, SpinForSeesTheAnswerWithoutWaitingAndGivesUpAfterMax) {
  EXPECT_TRUE(Pending<int>::Completed(7).SpinFor(std::chrono::nanoseconds(0)));
  Pending<int> never;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(never.SpinFor(std::chrono::microseconds(300)));
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::microseconds(300));
  EXPECT_FALSE(never.Ready());

  Pending<int> soon;
  std::thread t([soon] {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    soon.Fulfill(42);
  });
  EXPECT_TRUE(soon.SpinFor(std::chrono::seconds(10)));
  t.join();
  EXPECT_EQ(soon.Get().value(), 42);

  Pending<int> slow;
  std::thread u([slow] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // past the spin: the sleep path
    slow.Fulfill(5);
  });
  auto r = AwaitPending(slow, 10000, "slow");
  u.join();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, 5);
  auto missing = AwaitPending(Pending<int>(), 5, "missing");
  EXPECT_EQ(missing.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(missing.status().message().find("missing did not answer within 5 ms"), std::string::npos);
}

}  // namespace
// OnReady runs each callback exactly once: on the fulfilling thread just before the value is
// published (a callback does not see it yet: a time it takes is never later than any consumer's
// view of the answer), or at once when registered on a completed Pending; a second Fulfill runs
// nothing again, and a Pending never fulfilled runs nothing (and frees the callback with it).
TEST(PendingOnReady, RunsEachCallbackOnceOnTheFulfillingThreadOrAtOnce) {
  Pending<int> p;
  std::atomic<int> calls{0};
  std::thread::id ran_on;
  bool saw_value = true;
  p.OnReady([&] {
    ++calls;
    ran_on = std::this_thread::get_id();
    saw_value = p.Ready() || p.SpinFor(std::chrono::nanoseconds(0));
  });
  p.OnReady([&] { ++calls; });
  EXPECT_EQ(calls.load(), 0);
  std::thread::id producer;
  std::thread t([p, &producer] {
    producer = std::this_thread::get_id();
    p.Fulfill(9);
  });
  t.join();
  EXPECT_EQ(calls.load(), 2);
  EXPECT_EQ(ran_on, producer);
  EXPECT_FALSE(saw_value) << "the callback runs before the answer is published";
  EXPECT_EQ(p.Get().value(), 9);
  EXPECT_FALSE(p.Fulfill(10));
  EXPECT_EQ(calls.load(), 2);
  p.OnReady([&] { calls += 10; });  // already complete: runs here, now
  EXPECT_EQ(calls.load(), 12);

  auto owned = std::make_shared<int>(1);
  {
    Pending<int> never;
    never.OnReady([owned] {});
    EXPECT_EQ(owned.use_count(), 2);
  }
  EXPECT_EQ(owned.use_count(), 1);
}

}  // namespace
