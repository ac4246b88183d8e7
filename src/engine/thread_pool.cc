#include "engine/thread_pool.h"

#include <algorithm>

#include "rolloutcore/base/mutex.h"

namespace rc::engine {

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads <= 0) num_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    rc::MutexLock l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

namespace {
void Chunk(int64_t n, int parts, int index, int64_t* b, int64_t* e) {
  const int64_t base = n / parts, rem = n % parts;
  *b = index * base + std::min<int64_t>(index, rem);
  *e = *b + base + (index < rem ? 1 : 0);
}
}  // namespace

void ThreadPool::ParallelForRange(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    fn(0, n);
    return;
  }
  rc::MutexLock call_lock(call_mu_);
  const int parts = num_threads();
  const int64_t pieces = std::min<int64_t>(n, int64_t{kPiecesPerThread} * parts);
  {
    rc::MutexLock l(mu_);
    job_ = &fn;
    job_n_ = n;
    job_pieces_ = pieces;
    next_piece_.store(0, std::memory_order_relaxed);
    pending_ = parts - 1;
    ++job_seq_;
  }
  cv_.notify_all();
  RunPieces(fn, n, pieces);
  rc::MutexLock l(mu_);
  done_cv_.wait(l, [this]() REQUIRES(mu_) { return pending_ == 0; });
  job_ = nullptr;
}

void ThreadPool::RunPieces(const std::function<void(int64_t, int64_t)>& fn, int64_t n, int64_t pieces) {
  for (;;) {
    const int64_t p = next_piece_.fetch_add(1, std::memory_order_relaxed);
    if (p >= pieces) return;
    int64_t b, e;
    Chunk(n, static_cast<int>(pieces), static_cast<int>(p), &b, &e);
    if (b < e) fn(b, e);
  }
}

void ThreadPool::WorkerLoop() {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int64_t, int64_t)>* job;
    int64_t n, pieces;
    {
      rc::MutexLock l(mu_);
      cv_.wait(l, [&]() REQUIRES(mu_) { return stop_ || job_seq_ != seen; });
      if (stop_) return;
      seen = job_seq_;
      job = job_;
      n = job_n_;
      pieces = job_pieces_;
    }
    RunPieces(*job, n, pieces);
    {
      rc::MutexLock l(mu_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

}  // namespace rc::engine
