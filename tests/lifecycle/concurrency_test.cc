// Randomized concurrency: 8 threads admit and finish rollouts while a runner thread performs
// updates against a real-time FakeEngine. Invariants: no binding ever spans a weight mutation,
// the active count never goes negative, and every admitted rollout is finished.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

#include "rolloutcore/lifecycle/runner.h"
#include "testing/fake_engine.h"

namespace rc::lifecycle {
namespace {

TEST(LifecycleConcurrencyTest, NoBindingSpansAMutation) {
  constexpr int kThreads = 8;
  constexpr int64_t kTargetOps = 12000;  // successful admissions + finishes
  SystemClock* clock = SystemClock::Default();
  MemoryJournal journal;
  auto c = std::move(Controller::Open(clock, &journal)).value();
  ASSERT_TRUE(c->Initialize({"v0", 0}, {"d-v0", "", "", 0}).ok());
  rc::testing::FakeEngine engine("v0", "d-v0", std::chrono::microseconds(50));
  auto shared = engine.shared();
  RunnerOptions opts;
  opts.drain_poll_interval_ms = 1;
  opts.deadlines.install_ms = 5000;
  opts.deadlines.pause_ms = 5000;
  opts.deadlines.reset_ms = 5000;
  opts.deadlines.validate_ms = 5000;
  opts.deadlines.resume_ms = 5000;
  opts.deadlines.poll_ms = 5000;
  Runner runner(c.get(), &engine, clock, opts);

  std::atomic<int64_t> ops{0};
  std::atomic<int64_t> admitted{0}, finished{0}, refused{0}, violations{0}, negative{0};
  std::atomic<bool> stop{false};

  auto worker = [&](int tid) {
    std::mt19937_64 rng(1234 + tid);
    int n = 0;
    while (!stop.load()) {
      // (Built with append: GCC 12 at -O3 reports a false -Wrestrict for "literal" + std::string, GCC PR 105329.)
      std::string id = std::string("t").append(std::to_string(tid)).append("-").append(std::to_string(n++));
      auto b = c->Admit(id);
      if (!b.ok()) {
        EXPECT_EQ(b.status().code(), StatusCode::kUnavailable);
        refused.fetch_add(1);
        std::this_thread::sleep_for(std::chrono::microseconds(200));  // a client backing off
        continue;
      }
      ops.fetch_add(1);
      admitted.fetch_add(1);
      engine.StartRequest();
      // The weights this rollout runs on: no mutation may start or finish until it finishes.
      int64_t started = shared->mutations_started.load();
      int64_t done = shared->mutations_finished.load();
      if (shared->mutating.load() || started != done) violations.fetch_add(1);
      {
        std::lock_guard<std::mutex> lock(shared->mu);
        if (shared->label != b->version.label) violations.fetch_add(1);
      }
      for (int spin = static_cast<int>(rng() % 50); spin > 0; --spin) std::this_thread::yield();
      if (shared->mutations_started.load() != started || shared->mutating.load()) violations.fetch_add(1);
      engine.EndRequest();
      if (c->active_count() < 0) negative.fetch_add(1);
      ASSERT_TRUE(c->Finish(id).ok());
      finished.fetch_add(1);
      ops.fetch_add(1);
    }
  };

  std::vector<std::thread> threads;
  threads.reserve(kThreads);
  for (int i = 0; i < kThreads; ++i) threads.emplace_back(worker, i);

  int updates = 0;
  while (ops.load() < kTargetOps || updates < 5) {
    UpdateTarget t;
    t.label = "v" + std::to_string(updates + 1);
    t.identity.content_digest = "d-" + t.label;
    auto started = runner.StartUpdate(t);
    ASSERT_TRUE(started.ok()) << started.status().ToString();
    auto rec = runner.RunToCompletion();
    ASSERT_TRUE(rec.ok());
    ASSERT_EQ(rec->outcome, UpdateOutcome::kCommitted) << rec->reason;
    ++updates;
    std::this_thread::sleep_for(std::chrono::milliseconds(3));
    if (updates > 2000) break;
  }
  stop.store(true);
  for (auto& th : threads) th.join();

  std::printf("ops=%lld admitted=%lld refused=%lld updates=%d\n", static_cast<long long>(ops.load()),
              static_cast<long long>(admitted.load()), static_cast<long long>(refused.load()), updates);
  EXPECT_GE(ops.load(), kTargetOps);
  EXPECT_GE(updates, 5);
  EXPECT_EQ(violations.load(), 0);
  EXPECT_EQ(negative.load(), 0);
  EXPECT_EQ(admitted.load(), finished.load());
  EXPECT_EQ(c->active_count(), 0);
  EXPECT_GT(refused.load(), 0) << "admissions were refused while updates ran";
  EXPECT_EQ(c->version().generation, updates);
  auto counters = c->counters();
  EXPECT_EQ(counters.admissions, admitted.load());
  EXPECT_EQ(counters.finishes, finished.load());
  EXPECT_EQ(counters.updates_committed, updates);

  // The journal agrees: every admit has its finish, and no admit falls between a begin_install
  // and the commit that follows it.
  auto records = journal.ReadAll().value();
  std::map<std::string, int> open;
  bool mutating = false;
  for (const auto& r : records) {
    if (r.event == "admit") {
      EXPECT_FALSE(mutating) << "admission during a mutation at seq " << r.seq;
      open[r.rollout]++;
    } else if (r.event == "finish") {
      open[r.rollout]--;
    } else if (r.event == "begin_install") {
      int alive = 0;
      for (auto& [id, n] : open) alive += n;
      EXPECT_EQ(alive, 0) << "install began with live bindings at seq " << r.seq;
      mutating = true;
    } else if (r.event == "resumed") {
      mutating = false;
    }
  }
  for (auto& [id, n] : open) EXPECT_EQ(n, 0) << id;
}

}  // namespace
}  // namespace rc::lifecycle
