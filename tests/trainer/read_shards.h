// ReadManifest: reads every shard of a committed manifest back through a transport (as an engine
// would), checks each shard's bytes against its published digest (gtest expectations), and
// reassembles whole tensors as bf16 words. Shared by the trainer's unit, e2e and fault tests.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "rolloutcore/refit/digest.h"
#include "rolloutcore/refit/manifest.h"
#include "rolloutcore/transport/transport.h"

namespace rc::trainer::testing {

inline std::map<std::string, std::vector<uint16_t>> ReadManifest(transport::Transport& t, const refit::Manifest& m) {
  std::map<std::string, std::vector<uint16_t>> out;
  for (const refit::ShardTable& table : m.tables) {
    std::vector<uint16_t>& full = out[table.name];
    full.assign(static_cast<size_t>(refit::NumElements(table.shape)), 0);
    for (const refit::ShardInfo& s : table.shards) {
      std::vector<uint16_t> local(static_cast<size_t>(refit::NumElements(s.shape)));
      auto remote = t.Import(s.handle);
      EXPECT_TRUE(remote.ok()) << table.name << ": " << remote.status().ToString();
      if (!remote.ok()) continue;
      transport::ReadOp op{*remote, 0, local.data(), local.size() * 2};
      auto transfer = t.PostReads(std::span<const transport::ReadOp>(&op, 1));
      EXPECT_TRUE(transfer.ok());
      if (!transfer.ok()) continue;
      EXPECT_TRUE((*transfer)->Wait(t.clock().NowNs() + 5'000'000'000).ok());
      EXPECT_TRUE(t.ReleaseRemote(*remote).ok());
      EXPECT_EQ(s.digest, refit::DigestBlock(refit::DType::kBF16, table.shape, s.box(), local.data())) << table.name;
      // Place the box (row-major) into the full tensor.
      const refit::Shape strides = refit::RowMajorStrides(table.shape);
      const int64_t inner = s.shape.back();
      const int64_t rows = refit::NumElements(s.shape) / std::max<int64_t>(inner, 1);
      for (int64_t r = 0; r < rows; ++r) {
        int64_t rem = r, global = 0;
        for (size_t d = s.shape.size() - 1; d-- > 0;) {
          global += (s.offset[d] + rem % s.shape[d]) * strides[d];
          rem /= s.shape[d];
        }
        global += s.offset.back();
        std::memcpy(&full[static_cast<size_t>(global)], &local[static_cast<size_t>(r * inner)],
                    static_cast<size_t>(inner) * 2);
      }
    }
  }
  return out;
}

}  // namespace rc::trainer::testing
