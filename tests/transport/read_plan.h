// ScatterPlan: a reproducible mix of reads over a peer's regions (many small ops at odd
// offsets, some medium, a few large), each landing in its own range of one destination buffer,
// grouped into one batch per source. Used to compare every byte against the seeded contents.
// Single-threaded helper for tests.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "rolloutcore/transport/transport.h"
#include "transport/peer_data.h"

namespace rc::transport::testing {

struct PlannedRead {
  uint64_t region;
  uint64_t source_offset;
  uint64_t dest_offset;
  uint64_t length;
};

struct ScatterPlan {
  std::vector<PlannedRead> reads;
  uint64_t dest_bytes = 0;
};

inline ScatterPlan MakeScatterPlan(const std::vector<uint64_t>& sizes, uint64_t seed, int small_per_region = 400) {
  std::mt19937_64 rng(seed);
  ScatterPlan plan;
  uint64_t dpos = 1;  // odd destination offsets too
  auto add = [&](uint64_t region, uint64_t off, uint64_t len) {
    plan.reads.push_back({region, off, dpos, len});
    dpos += len + (rng() % 5);
  };
  for (uint64_t r = 0; r < sizes.size(); ++r) {
    const uint64_t size = sizes[r];
    for (int i = 0; i < small_per_region; ++i) {
      const uint64_t len = 1 + rng() % std::min<uint64_t>(size, 300);
      add(r, rng() % (size - len + 1), len);
    }
    for (int i = 0; i < 20; ++i) {
      const uint64_t len = 1 + rng() % std::min<uint64_t>(size, 64 << 10);
      add(r, rng() % (size - len + 1), len);
    }
    // Large ops: the whole region in up to three pieces, at odd boundaries.
    const uint64_t cut1 = std::min(size, size / 3 + 1);
    const uint64_t cut2 = std::min(size, 2 * size / 3 + 3);
    add(r, 0, cut1);
    if (cut2 > cut1) add(r, cut1, cut2 - cut1);
    if (size > cut2) add(r, cut2, size - cut2);
  }
  plan.dest_bytes = dpos + 8;
  return plan;
}

// Posts one batch per region (all before any wait), waits, and returns the destination.
inline std::vector<std::byte> RunPlan(Transport& t, const std::vector<RemoteMemory>& remotes, const ScatterPlan& plan,
                                      int64_t timeout_ns = 60'000'000'000) {
  std::vector<std::byte> dest(plan.dest_bytes, std::byte{0xAB});
  std::vector<std::vector<ReadOp>> batches(remotes.size());
  for (const PlannedRead& r : plan.reads) {
    batches[r.region].push_back(ReadOp{remotes[r.region], r.source_offset, dest.data() + r.dest_offset, r.length});
  }
  std::vector<std::unique_ptr<Transfer>> transfers;
  for (const auto& batch : batches) {
    auto tr = t.PostReads(batch);
    EXPECT_TRUE(tr.ok()) << tr.status().ToString();
    if (tr.ok()) transfers.push_back(std::move(tr).value());
  }
  const int64_t deadline = t.clock().NowNs() + timeout_ns;
  for (auto& tr : transfers) {
    const Status s = tr->Wait(deadline);
    EXPECT_TRUE(s.ok()) << t.name() << ": " << s.ToString();
  }
  return dest;
}

// Checks every planned byte (and that bytes between reads were not touched).
inline void ExpectPlanBytes(const ScatterPlan& plan, const std::vector<std::byte>& dest, uint64_t seed) {
  std::vector<std::byte> expected;
  std::vector<bool> covered(dest.size(), false);
  for (const PlannedRead& r : plan.reads) {
    expected.resize(r.length);
    FillPeerBytes(seed, r.region, r.source_offset, expected.data(), r.length);
    ASSERT_EQ(std::memcmp(dest.data() + r.dest_offset, expected.data(), r.length), 0)
        << "region " << r.region << " bytes " << r.source_offset << ".." << r.source_offset + r.length;
    std::fill(covered.begin() + r.dest_offset, covered.begin() + r.dest_offset + r.length, true);
  }
  for (size_t i = 0; i < dest.size(); ++i) {
    if (!covered[i]) {
      ASSERT_EQ(dest[i], std::byte{0xAB}) << "byte " << i << " outside every read was written";
    }
  }
}

}  // namespace rc::transport::testing
