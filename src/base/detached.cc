#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "rolloutcore/base/pending.h"
#include "rolloutcore/base/mutex.h"

namespace rc::internal {
namespace {

// Parked workers wait for tasks; a task is handed to a parked worker when there is one (counted
// by `idle_`), else a new worker is started for it. A worker that finished its task parks again.
class DetachedWorkers {
 public:
  static DetachedWorkers& Get() {
    // Leaked on purpose: parked workers outlive static destruction.
    static DetachedWorkers* w = new DetachedWorkers();
    return *w;
  }

  void Run(std::function<void()> task) {
    {
      rc::MutexLock l(mu_);
      if (idle_ > static_cast<int64_t>(tasks_.size())) {
        tasks_.push_back(std::move(task));
        cv_.notify_one();
        return;
      }
    }
    started_.fetch_add(1, std::memory_order_relaxed);
    std::thread([this, task = std::move(task)]() mutable { Loop(std::move(task)); }).detach();
  }

  int64_t started() const { return started_.load(std::memory_order_relaxed); }

 private:
  void Loop(std::function<void()> task) {
    for (;;) {
      task();
      task = nullptr;  // drop captures (and the Pending's state) before parking
      rc::MutexLock l(mu_);
      ++idle_;
      cv_.wait(l, [&]() REQUIRES(mu_) { return !tasks_.empty(); });
      --idle_;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
  }

  rc::Mutex mu_;
  rc::CondVar cv_;
  std::deque<std::function<void()>> tasks_ GUARDED_BY(mu_);  // guarded by mu_; never more than idle_
  int64_t idle_ GUARDED_BY(mu_) = 0;                         // guarded by mu_: parked workers
  std::atomic<int64_t> started_{0};
};

}  // namespace

void RunOnDetachedWorker(std::function<void()> task) { DetachedWorkers::Get().Run(std::move(task)); }
int64_t DetachedWorkersStarted() { return DetachedWorkers::Get().started(); }

}  // namespace rc::internal
