// Sparse delta payloads: the elements of one published shard whose bits changed since an earlier
// version, encoded compactly so that a receiver on that earlier version moves (and verifies)
// only what changed (docs/refit.md "Delta refit").
//
// Tiling. A shard's box is viewed as a matrix [rows, cols] (cols = the last dim's extent, rows =
// the product of the others; a 0-d shard is 1 x 1) and cut into tiles of DeltaTiling's
// tile_rows x tile_cols (both fixed by the shard's shape, so publisher and receiver agree
// without exchanging them). Each tile is encoded on its own, so a receiver that needs part of a
// shard (a tp rank's rows or columns) pulls the header, the tile table and only the tiles its
// copies touch.
//
// Payload layout (little endian):
//   header (kDeltaHeaderBytes): u32 magic 'RCDL', u16 format 1, u16 element size, u64 shard
//     elements, u32 tile_rows, u32 tile_cols, u64 tile count, u64 changed elements
//   tile table: per tile (row-major over tiles) u64 body offset (from the payload start),
//     u32 body bytes, u32 changed count | kDeltaBitmapFlag when the body uses a bitmap
//   tile bodies: the changed in-tile offsets (row-major inside the tile), either as LEB128
//     varints of the gaps (first offset, then differences of consecutive offsets, strictly
//     increasing) or as a bitmap of the tile's elements (bit k of byte k/8) when that is smaller;
//     then the new values, element size bytes each, in offset order.
//
// Thread safety: pure functions and values.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "rolloutcore/base/status.h"
#include "rolloutcore/refit/tensor.h"

namespace rc::refit {

inline constexpr uint32_t kDeltaMagic = 0x4c444352;  // "RCDL"
inline constexpr uint16_t kDeltaFormat = 1;
inline constexpr uint64_t kDeltaHeaderBytes = 40;
inline constexpr uint64_t kDeltaEntryBytes = 16;
inline constexpr uint32_t kDeltaBitmapFlag = 0x80000000u;
inline constexpr int64_t kDeltaTargetTileElements = 8192;
inline constexpr int64_t kDeltaMaxTileCols = 128;

struct DeltaTiling {
  int64_t rows = 1, cols = 1;            // the shard box as a matrix
  int64_t tile_rows = 1, tile_cols = 1;  // tile extent (edge tiles are smaller)
  int64_t tiles_r = 1, tiles_c = 1;      // tiles per column / per row of tiles

  int64_t tiles() const { return tiles_r * tiles_c; }
  // Bytes of header + tile table: the prefix a receiver reads first.
  uint64_t table_bytes() const { return kDeltaHeaderBytes + static_cast<uint64_t>(tiles()) * kDeltaEntryBytes; }
  // Extent of tile t (edge tiles are cut at the shard's edge).
  int64_t TileRows(int64_t t) const;
  int64_t TileCols(int64_t t) const;
  // Shard-local flat (row-major) offset of element k (row-major inside tile t).
  int64_t LocalOffset(int64_t t, int64_t k) const;
};

// tile_cols = min(cols, kDeltaMaxTileCols); tile_rows = clamp(kDeltaTargetTileElements / tile_cols, 1, rows).
DeltaTiling TilingFor(const Shape& local_shape);

// One entry of the tile table.
struct DeltaTile {
  uint64_t offset = 0;  // body offset from the payload start
  uint32_t bytes = 0;
  uint32_t changed = 0;
  bool bitmap = false;
};

struct EncodedDelta {
  std::vector<std::byte> bytes;
  int64_t changed = 0;
};

// Encodes the changes from `old_data` to `new_data` (the shard box's row-major contents in
// `dtype`, equal lengths): an element is changed when its bits differ.
EncodedDelta EncodeShardDelta(DType dtype, const Shape& local_shape, const void* old_data, const void* new_data);
// The same from a change list: strictly increasing shard-local flat offsets and their new values
// (element size bytes each, in the same order) — what a device-side mask produces
// (torch.nonzero) without a host copy of the shard. InvalidArgument naming the position when the
// offsets are not strictly increasing or out of the shard, or the value bytes do not match.
[[nodiscard]] Result<EncodedDelta> EncodeShardDeltaFromChanges(DType dtype, const Shape& local_shape,
                                                               std::span<const int64_t> offsets,
                                                               std::span<const std::byte> values);

// Parses and checks a payload's header and tile table against the shard's dtype and shape and the
// payload length the manifest names (DataLoss naming the field when they disagree, when a body
// lies outside the payload, or when the tile counts do not add up to the header's).
[[nodiscard]] Result<std::vector<DeltaTile>> ParseDeltaTable(DType dtype, const Shape& local_shape,
                                                             std::span<const std::byte> prefix, uint64_t payload_bytes);

// Decodes tile `t`'s body (exactly entry.bytes bytes), calling fn(shard-local flat offset, pointer
// to the new value's bytes) in increasing offset order. DataLoss naming the tile when the body is
// malformed (offsets not increasing or outside the tile, a bitmap whose popcount differs from the
// count, trailing or missing bytes).
[[nodiscard]] Status DecodeDeltaTile(const DeltaTiling& tiling, size_t element_size, int64_t t, const DeltaTile& entry,
                                     std::span<const std::byte> body,
                                     const std::function<void(int64_t local_offset, const std::byte* value)>& fn);

// Bulk decode of tile `t`'s body, with the same checks and DataLoss messages as DecodeDeltaTile
// but no per-element callback: writes the entry.changed changed in-tile offsets (row-major inside
// the tile, strictly increasing, each < TileRows(t) * TileCols(t) <= kDeltaTargetTileElements)
// to `offsets` (room for entry.changed values) and returns the tile's new values (entry.changed
// elements of element_size bytes, in the same order, inside `body`). Bitmaps are read a 64-bit
// word at a time, varints with a one-byte fast path. In-tile offset k is the shard-local flat
// offset LocalOffset(t, k).
[[nodiscard]] Result<const std::byte*> DecodeDeltaTileOffsets(const DeltaTiling& tiling, size_t element_size,
                                                              int64_t t, const DeltaTile& entry,
                                                              std::span<const std::byte> body, uint16_t* offsets);
static_assert(kDeltaTargetTileElements <= 65536, "in-tile offsets must fit uint16_t");

// The tiles (indices, increasing) holding elements of `local_box` (shard-local coordinates).
std::vector<int64_t> TilesTouching(const DeltaTiling& tiling, const Shape& local_shape, const Box& local_box);

// Bytes of the plainest encoding of exactly these changes: one stream of gap varints over
// `sorted_offsets` (strictly increasing) plus element_size bytes per value. Receivers report it
// for the changes landing in their own region, next to the bytes they pulled.
uint64_t PlainDeltaBytes(std::span<const int64_t> sorted_offsets, size_t element_size);

}  // namespace rc::refit
