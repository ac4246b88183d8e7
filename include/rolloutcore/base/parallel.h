// ParallelFor: runs f(i) for every i in [0, n) on up to `threads` threads (the caller's included),
// handing out indices one at a time so uneven work balances. Returns when all calls returned.
// With threads <= 1 or n <= 1 it runs inline. f must be safe to call concurrently for distinct i.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <thread>
#include <vector>

namespace rc {

template <typename F>
void ParallelFor(size_t n, int threads, F&& f) {
  const size_t t = std::min<size_t>(n, static_cast<size_t>(std::max(1, threads)));
  if (t <= 1) {
    for (size_t i = 0; i < n; ++i) f(i);
    return;
  }
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) f(i);
  };
  std::vector<std::thread> pool;
  pool.reserve(t - 1);
  for (size_t i = 1; i < t; ++i) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
}

}  // namespace rc
