// Internal: the distinct boxes of a shard table, with the replicas that hold each.
//
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <vector>

#include "rolloutcore/base/status.h"
#include "rolloutcore/refit/manifest.h"

namespace rc::refit::internal {

// A distinct shard box. Its coordinates are those of its first replica's ShardInfo (no copies,
// so indexing a large manifest allocates little); valid while the table is alive and unchanged.
struct UniqueBox {
  const Shape* start = nullptr;
  const Shape* extent = nullptr;
  uint32_t first = 0;  // replicas are ShardIndex::order[first .. first + count)
  uint32_t count = 0;

  Box box() const { return Box{*start, *extent}; }
};

struct ShardIndex {
  std::vector<uint32_t> order;  // indices into ShardTable::shards, grouped by box
  std::vector<UniqueBox> boxes;  // sorted by (start, extent)

  uint32_t replica(const UniqueBox& b, uint64_t turn) const { return order[b.first + turn % b.count]; }
};

// Groups the non-empty shards of `table` by identical box, sorted by box. Fails (naming the tensor,
// ranks and boxes) when a shard lies outside the tensor or two distinct boxes overlap.
[[nodiscard]] Status IndexShards(const ShardTable& table, ShardIndex* out);

// Intersection of a unique box with `b`; false when empty.
bool Intersect(const UniqueBox& a, const Box& b, Box* out);

// True when the boxes tile dim 0 of `shape` without gaps and each spans all of dims 1..n-1.
bool IsDim0Partition(const Shape& shape, const ShardIndex& index);

}  // namespace rc::refit::internal
