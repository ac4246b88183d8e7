#include "rolloutcore/base/parallel.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "rolloutcore/base/mutex.h"

namespace rc::internal {
namespace {

thread_local bool tls_in_pool_task = false;

// The shared pool's mutex. At namespace scope (constant-initialised, trivially destructible) so
// that Job's fields can name it in GUARDED_BY: they are guarded by the pool, not by the Job.
rc::Mutex pool_mu;

// One ParallelFor call: indices handed out by `next`; the caller waits until every helper that
// joined has left (`active` back to 0) and every index has been claimed.
struct Job {
  size_t n = 0;
  const std::function<void(size_t)>* f = nullptr;
  std::atomic<size_t> next{0};
  int helpers_wanted GUARDED_BY(pool_mu) = 0;
  int helpers_active GUARDED_BY(pool_mu) = 0;

  void Work() {
    for (size_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      (*f)(i);
    }
  }
};

class SharedWorkers {
 public:
  static SharedWorkers& Get() {
    // Leaked on purpose: helpers may still be parked at exit; destroying the pool during static
    // destruction would race with detached users.
    static SharedWorkers* pool = new SharedWorkers();
    return *pool;
  }

  int parallelism() {
    rc::MutexLock l(pool_mu);
    return static_cast<int>(threads_.size()) + 1;
  }

  void Run(size_t n, int threads, const std::function<void(size_t)>& f) {
    Job job;
    job.n = n;
    job.f = &f;
    {
      rc::MutexLock l(pool_mu);
      Grow(std::min(threads, 64) - 1);
      job.helpers_wanted = static_cast<int>(std::min<size_t>(n - 1, static_cast<size_t>(threads - 1)));
      queue_.push_back(&job);
    }
    cv_.notify_all();
    {
      const bool was = tls_in_pool_task;
      tls_in_pool_task = true;
      job.Work();
      tls_in_pool_task = was;
    }
    rc::MutexLock l(pool_mu);
    // No helper may join once we return: take the job off the queue first.
    auto it = std::find(queue_.begin(), queue_.end(), &job);
    if (it != queue_.end()) queue_.erase(it);
    done_cv_.wait(l, [&]() REQUIRES(pool_mu) { return job.helpers_active == 0; });
  }

 private:
  SharedWorkers() {
    const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    rc::MutexLock l(pool_mu);
    Grow(hw - 1);
  }

  void Grow(int helpers) REQUIRES(pool_mu) {
    while (static_cast<int>(threads_.size()) < helpers) {
      threads_.emplace_back([this] { Loop(); });
      threads_.back().detach();
    }
  }

  void Loop() {
    tls_in_pool_task = true;
    rc::MutexLock l(pool_mu);
    for (;;) {
      cv_.wait(l, [&]() REQUIRES(pool_mu) { return !queue_.empty(); });
      Job* job = queue_.front();
      ++job->helpers_active;
      if (--job->helpers_wanted <= 0) queue_.pop_front();
      l.unlock();
      job->Work();
      l.lock();
      if (--job->helpers_active == 0) done_cv_.notify_all();
    }
  }

  rc::CondVar cv_;       // a job was queued
  rc::CondVar done_cv_;  // a helper left a job
  std::deque<Job*> queue_ GUARDED_BY(pool_mu);           // guarded by pool_mu: jobs that still want helpers
  std::vector<std::thread> threads_ GUARDED_BY(pool_mu); // guarded by pool_mu (detached; kept for the count)
};

}  // namespace

void ParallelForShared(size_t n, int threads, const std::function<void(size_t)>& f) {
  if (tls_in_pool_task) {
    for (size_t i = 0; i < n; ++i) f(i);
    return;
  }
  SharedWorkers::Get().Run(n, threads, f);
}

int SharedParallelism() { return SharedWorkers::Get().parallelism(); }

}  // namespace rc::internal
