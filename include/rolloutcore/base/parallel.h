// ParallelFor: runs f(i) for every i in [0, n) on up to `threads` threads (the caller's included),
// handing out indices one at a time so uneven work balances. Returns when all calls returned.
// With threads <= 1 or n <= 1 it runs inline. f must be safe to call concurrently for distinct i.
//
// The helpers are a process-wide persistent pool (SharedWorkers), started on first use with
// hardware_concurrency() - 1 threads (at least `threads` - 1 when more are asked for, up to 64),
// so a call costs a condition-variable wake-up, not a thread start per helper. A call made from
// inside a pool task runs inline (no nested fan-out, no deadlock); calls from several outside
// threads at once are served one at a time by the helpers while each caller also works on its
// own range, so they never wait on each other for longer than one index of another caller.
//
// Thread safety: ParallelFor may be called from any thread.
#pragma once

#include <cstddef>
#include <functional>

namespace rc {

namespace internal {
// Runs f over [0, n) with the calling thread plus up to threads - 1 pool helpers.
void ParallelForShared(size_t n, int threads, const std::function<void(size_t)>& f);
// Threads a ParallelFor may use at most: pool helpers + the caller.
int SharedParallelism();
}  // namespace internal

template <typename F>
void ParallelFor(size_t n, int threads, F&& f) {
  if (n == 0) return;
  if (threads <= 1 || n == 1) {
    for (size_t i = 0; i < n; ++i) f(i);
    return;
  }
  internal::ParallelForShared(n, threads, std::function<void(size_t)>(std::ref(f)));
}

}  // namespace rc
