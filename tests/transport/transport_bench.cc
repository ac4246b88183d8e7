// transport_bench: wire throughput of the shm and ucx transports across processes, against a
// single-thread memcpy of the same number of bytes measured in the same run.
//
//   transport_bench [--mib N] [--reps R] [--no-ucx]
// A child (rc_transport_peer) registers one N MiB region (default 256); this process reads all
// of it in 1, 2 and 4 MiB ops, one batch, and reports the best and median GB/s over R repetitions
// (default 5) and the ratio of the best to the best memcpy. Destinations are pre-faulted so both
// sides measure copying, not page faults. Every run's bytes are checked against the seed.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "rolloutcore/transport/shm.h"
#include "transport/peer_data.h"
#include "transport/peer_process.h"
#include "transport/scoped_env.h"
#ifdef RC_HAVE_UCX
#include "rolloutcore/transport/ucx.h"
#endif

namespace {

using rc::transport::ReadOp;
using rc::transport::RemoteMemory;
using rc::transport::Transport;
using rc::transport::testing::PeerProcess;

constexpr uint64_t kSeed = 2024;

double Seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }

struct Stats {
  double best_gbps = 0;
  double median_gbps = 0;
};

Stats Summarize(std::vector<double> gbps) {
  std::sort(gbps.begin(), gbps.end());
  return Stats{gbps.back(), gbps[gbps.size() / 2]};
}

Stats MeasureMemcpy(uint64_t bytes, int reps, std::vector<std::byte>& dest) {
  std::vector<std::byte> src(bytes);
  rc::transport::testing::FillPeerBytes(kSeed, 0, 0, src.data(), bytes);
  std::vector<double> gbps;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(dest.data(), src.data(), bytes);
    benchmark::ClobberMemory();
    gbps.push_back(bytes / Seconds(std::chrono::steady_clock::now() - t0) / 1e9);
  }
  return Summarize(gbps);
}

bool Verify(const std::vector<std::byte>& dest, uint64_t bytes) {
  std::vector<std::byte> expected(bytes);
  rc::transport::testing::FillPeerBytes(kSeed, 0, 0, expected.data(), bytes);
  return std::memcmp(dest.data(), expected.data(), bytes) == 0;
}

// Returns false on any failure (printed).
bool MeasureTransport(const std::string& label, Transport& t, const std::string& descriptor, uint64_t bytes, int reps,
                      std::vector<std::byte>& dest, double memcpy_best) {
  auto remote = t.Import(descriptor);
  if (!remote.ok()) {
    std::printf("%-22s import failed: %s\n", label.c_str(), remote.status().ToString().c_str());
    return false;
  }
  for (uint64_t op_mib : {1, 2, 4}) {
    const uint64_t chunk = op_mib << 20;
    std::vector<ReadOp> ops;
    for (uint64_t off = 0; off < bytes; off += chunk) {
      ops.push_back({*remote, off, dest.data() + off, std::min(chunk, bytes - off)});
    }
    std::vector<double> gbps;
    for (int r = 0; r < reps + 1; ++r) {  // the first run warms up (endpoints, mappings)
      std::memset(dest.data(), 0, bytes);
      const auto t0 = std::chrono::steady_clock::now();
      auto tr = t.PostReads(ops);
      if (!tr.ok()) {
        std::printf("%-22s post failed: %s\n", label.c_str(), tr.status().ToString().c_str());
        return false;
      }
      const rc::Status s = (*tr)->Wait(t.clock().NowNs() + 120'000'000'000);
      const double secs = Seconds(std::chrono::steady_clock::now() - t0);
      if (!s.ok()) {
        std::printf("%-22s transfer failed: %s\n", label.c_str(), s.ToString().c_str());
        return false;
      }
      if (r > 0) gbps.push_back(bytes / secs / 1e9);
    }
    if (!Verify(dest, bytes)) {
      std::printf("%-22s WRONG BYTES\n", label.c_str());
      return false;
    }
    const Stats st = Summarize(gbps);
    std::printf("%-22s %4llu MiB ops x %4zu   best %6.2f GB/s   median %6.2f GB/s   ratio to memcpy %.2f\n",
                label.c_str(), static_cast<unsigned long long>(op_mib), ops.size(), st.best_gbps, st.median_gbps,
                st.best_gbps / memcpy_best);
  }
  (void)t.ReleaseRemote(*remote);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t mib = 256;
  int reps = 5;
  bool with_ucx = true;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--mib" && i + 1 < argc) mib = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--reps" && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    else if (a == "--no-ucx") with_ucx = false;
    else {
      std::fprintf(stderr, "usage: transport_bench [--mib N] [--reps R] [--no-ucx]\n");
      return 2;
    }
  }
  const uint64_t bytes = mib << 20;
  std::vector<std::byte> dest(bytes);
  std::memset(dest.data(), 1, bytes);  // pre-fault

  const Stats mc = MeasureMemcpy(bytes, reps, dest);
  std::printf("transport_bench: %llu MiB per transfer, %d reps, best-of (median) reported\n",
              static_cast<unsigned long long>(mib), reps);
  std::printf("%-22s %-24s best %6.2f GB/s   median %6.2f GB/s\n", "memcpy (1 thread)", "one 256 MiB copy",
              mc.best_gbps, mc.median_gbps);
  bool ok = true;
  {
    auto peer = PeerProcess::Spawn("shm", kSeed, {bytes});
    if (!peer.ok()) {
      std::printf("shm peer: %s\n", peer.status().ToString().c_str());
      return 1;
    }
    for (int threads : {1, 0}) {
      auto t = rc::transport::CreateShmTransport({}, {.copy_threads = threads,
                                                      .inline_bytes = 64 << 10,
                                                      .piece_bytes = 4 << 20})
                   .value();
      const std::string label = threads == 1 ? "shm (1 copy thread)" : "shm (default threads)";
      ok &= MeasureTransport(label, *t, (*peer)->descriptors()[0], bytes, reps, dest, mc.best_gbps);
    }
  }
#ifdef RC_HAVE_UCX
  if (with_ucx) {
    for (const char* tls : {"sm,self", "tcp,self"}) {
      rc::transport::testing::ScopedEnv env("UCX_TLS", tls);
      auto peer = PeerProcess::Spawn("ucx", kSeed, {bytes}, {std::string("UCX_TLS=") + tls});
      if (!peer.ok()) {
        std::printf("ucx peer (%s): %s\n", tls, peer.status().ToString().c_str());
        ok = false;
        continue;
      }
      auto t = rc::transport::CreateUcxTransport().value();
      ok &= MeasureTransport(std::string("ucx UCX_TLS=") + tls, *t, (*peer)->descriptors()[0], bytes, reps, dest,
                             mc.best_gbps);
    }
  }
#else
  (void)with_ucx;
#endif
  return ok ? 0 : 1;
}
