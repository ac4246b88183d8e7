// ThreadPool: a fixed set of worker threads running ParallelFor over an index range.
//
// ParallelFor(n, fn) calls fn(i) for every i in [0, n) exactly once and returns when all calls
// finished; the caller's thread takes part. [0, n) is cut into up to kPiecesPerThread contiguous
// pieces per thread, which the threads take in turn as they finish the previous one: a thread
// the OS preempts (another process, the receiver's unmapping thread) leaves its remaining pieces
// to the others instead of holding the whole call up by its share. A given kernel still assigns
// each output element to exactly one call, so results never depend on the thread count or on
// which thread ran a piece (reductions stay inside one call).
//
// Thread safety: ParallelFor may be called from one thread at a time (the engine's step
// thread); concurrent callers are serialized by an internal mutex.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "rolloutcore/base/mutex.h"

namespace rc::engine {

class ThreadPool {
 public:
  // num_threads <= 0: std::thread::hardware_concurrency().
  explicit ThreadPool(int num_threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }
  // fn(begin, end) over contiguous chunks covering [0, n).
  void ParallelForRange(int64_t n, const std::function<void(int64_t, int64_t)>& fn);
  void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn) {
    ParallelForRange(n, [&fn](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) fn(i);
    });
  }

 private:
  static constexpr int kPiecesPerThread = 8;
  void WorkerLoop();
  void RunPieces(const std::function<void(int64_t, int64_t)>& fn, int64_t n, int64_t pieces);

  rc::Mutex call_mu_;  // serializes ParallelForRange callers
  rc::Mutex mu_;
  rc::CondVar cv_;
  rc::CondVar done_cv_;
  // Not guarded: filled by the constructor before any job can be posted, read-only afterwards
  // (ParallelForRange and the workers only read its size; the destructor joins).
  std::vector<std::thread> workers_;
  // guarded by mu_:
  const std::function<void(int64_t, int64_t)>* job_ GUARDED_BY(mu_) = nullptr;
  int64_t job_n_ GUARDED_BY(mu_) = 0;
  int64_t job_pieces_ GUARDED_BY(mu_) = 0;
  std::atomic<int64_t> next_piece_{0};  // the job's next piece to take (reset with the job, under mu_)
  uint64_t job_seq_ GUARDED_BY(mu_) = 0;
  int pending_ GUARDED_BY(mu_) = 0;
  bool stop_ GUARDED_BY(mu_) = false;
};

}  // namespace rc::engine
