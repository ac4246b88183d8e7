#include "rolloutcore/refit/delta.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>

namespace rc::refit {
namespace {

template <typename T>
void Put(std::vector<std::byte>& out, T v) {
  const size_t at = out.size();
  out.resize(at + sizeof v);
  std::memcpy(out.data() + at, &v, sizeof v);
}

template <typename T>
T Get(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

size_t VarintLen(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

// The elements of `n` whose bits differ between `a` and `b` (elements of type U), in order: their
// offsets, and their new bits appended to `values`. Whole 32-byte blocks first: four 8-byte words
// compared at once skip an unchanged block (most of them at the RL regime's 1-5 % of changed
// elements) without looking at its elements; a block with a difference is compared element by
// element.
template <typename U>
void FindChanges(const std::byte* a, const std::byte* b, int64_t n, std::vector<int64_t>& offsets,
                 std::vector<std::byte>& values) {
  constexpr size_t kBlock = 32;
  constexpr int64_t kPerBlock = kBlock / sizeof(U);
  auto compare = [&](int64_t from, int64_t to) {
    for (int64_t i = from; i < to; ++i) {
      U x, y;
      std::memcpy(&x, a + static_cast<size_t>(i) * sizeof(U), sizeof(U));
      std::memcpy(&y, b + static_cast<size_t>(i) * sizeof(U), sizeof(U));
      if (x == y) continue;
      offsets.push_back(i);
      const size_t at = values.size();
      values.resize(at + sizeof(U));
      std::memcpy(values.data() + at, &y, sizeof(U));
    }
  };
  // Per 8-byte word of XORed bits, the top bit of every lane (element) that differs.
  constexpr int kLaneBits = 8 * sizeof(U);
  constexpr uint64_t kTop = ~uint64_t{0} / ((uint64_t{1} << (kLaneBits - 1) << 1) - 1) << (kLaneBits - 1);
  constexpr uint64_t kLow = ~kTop;
  int64_t i = 0;
  for (; i + kPerBlock <= n; i += kPerBlock) {
    const size_t at = static_cast<size_t>(i) * sizeof(U);
    uint64_t w[8];
    std::memcpy(w, a + at, kBlock);
    std::memcpy(w + 4, b + at, kBlock);
    for (int q = 0; q < 4; ++q) w[q] ^= w[q + 4];
    if ((w[0] | w[1] | w[2] | w[3]) == 0) continue;
    for (int q = 0; q < 4; ++q) {
      for (uint64_t lanes = (((w[q] & kLow) + kLow) | w[q]) & kTop; lanes != 0; lanes &= lanes - 1) {
        const int64_t e = i + q * static_cast<int64_t>(8 / sizeof(U)) + std::countr_zero(lanes) / kLaneBits;
        offsets.push_back(e);
        const size_t v = values.size();
        values.resize(v + sizeof(U));
        std::memcpy(values.data() + v, b + static_cast<size_t>(e) * sizeof(U), sizeof(U));
      }
    }
  }
  compare(i, n);
}

// Encodes a change list already known to be valid. The changes are grouped by tile with a counting
// sort (stable: offsets increase, and inside one tile row-major tile order follows shard order), each
// tile's body size is computed first and the payload is sized once.
EncodedDelta Encode(DType dtype, const Shape& local_shape, std::span<const int64_t> offsets, const std::byte* values) {
  const DeltaTiling g = TilingFor(local_shape);
  const size_t es = DTypeSize(dtype);
  const size_t m = offsets.size();
  const auto tiles = static_cast<size_t>(g.tiles());
  EncodedDelta out;
  out.changed = static_cast<int64_t>(m);
  std::vector<size_t> tile_of(m);
  std::vector<int64_t> in_tile(m);  // the element's position inside its tile
  std::vector<size_t> first(tiles + 1, 0);
  // The offsets increase, so the row (and the tile row) is tracked instead of divided out per change;
  // only the column's tile takes a division, and none when the tile spans the row.
  int64_t r = -1, row_start = 0, tr = 0;
  for (size_t i = 0; i < m; ++i) {
    const int64_t o = offsets[i];
    if (o >= row_start + g.cols || r < 0) {
      r = o / g.cols;
      row_start = r * g.cols;
      tr = r / g.tile_rows;
    }
    const int64_t c = o - row_start;
    const int64_t tc = g.tiles_c == 1 ? 0 : c / g.tile_cols;
    const int64_t t = tr * g.tiles_c + tc;
    tile_of[i] = static_cast<size_t>(t);
    in_tile[i] = (r - tr * g.tile_rows) * std::min(g.tile_cols, g.cols - tc * g.tile_cols) + (c - tc * g.tile_cols);
    ++first[static_cast<size_t>(t) + 1];
  }
  for (size_t t = 0; t < tiles; ++t) first[t + 1] += first[t];
  std::vector<size_t> order(m);
  {
    std::vector<size_t> next(first.begin(), first.end() - 1);
    for (size_t i = 0; i < m; ++i) order[next[tile_of[i]]++] = i;
  }
  // Per tile: the index as a bitmap when that is smaller than the varint gaps.
  std::vector<size_t> index_bytes(tiles);
  std::vector<bool> bitmap(tiles);
  size_t bodies = 0;
  for (size_t t = 0; t < tiles; ++t) {
    size_t varint_bytes = 0;
    int64_t prev = -1;
    for (size_t j = first[t]; j < first[t + 1]; ++j) {
      const int64_t k = in_tile[order[j]];
      varint_bytes += VarintLen(static_cast<uint64_t>(prev < 0 ? k : k - prev));
      prev = k;
    }
    const int64_t n = g.TileRows(static_cast<int64_t>(t)) * g.TileCols(static_cast<int64_t>(t));
    const auto bitmap_bytes = static_cast<size_t>((n + 7) / 8);
    bitmap[t] = first[t + 1] > first[t] && bitmap_bytes < varint_bytes;
    index_bytes[t] = bitmap[t] ? bitmap_bytes : varint_bytes;
    bodies += index_bytes[t] + (first[t + 1] - first[t]) * es;
  }
  std::vector<std::byte>& b = out.bytes;
  Put<uint32_t>(b, kDeltaMagic);
  Put<uint16_t>(b, kDeltaFormat);
  Put<uint16_t>(b, static_cast<uint16_t>(es));
  Put<uint64_t>(b, static_cast<uint64_t>(g.rows * g.cols));
  Put<uint32_t>(b, static_cast<uint32_t>(g.tile_rows));
  Put<uint32_t>(b, static_cast<uint32_t>(g.tile_cols));
  Put<uint64_t>(b, static_cast<uint64_t>(g.tiles()));
  Put<uint64_t>(b, static_cast<uint64_t>(m));
  const size_t table_at = b.size();
  b.resize(table_at + tiles * kDeltaEntryBytes + bodies, std::byte{0});
  size_t body_at = table_at + tiles * kDeltaEntryBytes;
  for (size_t t = 0; t < tiles; ++t) {
    std::byte* p = b.data() + body_at;
    if (bitmap[t]) {
      for (size_t j = first[t]; j < first[t + 1]; ++j) {
        const int64_t k = in_tile[order[j]];
        p[k / 8] |= static_cast<std::byte>(1u << (k % 8));
      }
      p += index_bytes[t];
    } else {
      int64_t prev = -1;
      for (size_t j = first[t]; j < first[t + 1]; ++j) {
        const int64_t k = in_tile[order[j]];
        uint64_t v = static_cast<uint64_t>(prev < 0 ? k : k - prev);
        prev = k;
        while (v >= 0x80) {
          *p++ = static_cast<std::byte>((v & 0x7f) | 0x80);
          v >>= 7;
        }
        *p++ = static_cast<std::byte>(v);
      }
    }
    for (size_t j = first[t]; j < first[t + 1]; ++j, p += es) std::memcpy(p, values + order[j] * es, es);
    std::byte* e = b.data() + table_at + t * kDeltaEntryBytes;
    const uint64_t off = body_at;
    const auto len = static_cast<uint32_t>(p - (b.data() + body_at));
    const uint32_t cnt = static_cast<uint32_t>(first[t + 1] - first[t]) | (bitmap[t] ? kDeltaBitmapFlag : 0u);
    std::memcpy(e, &off, 8);
    std::memcpy(e + 8, &len, 4);
    std::memcpy(e + 12, &cnt, 4);
    body_at += len;
  }
  return out;
}

// The checks both tile decoders start with: the body has the table's size and room for its
// `changed` values. Returns the size of the index part (the values follow it).
Result<size_t> TileIndexBytes(size_t es, int64_t t, const DeltaTile& entry, std::span<const std::byte> body) {
  if (body.size() != entry.bytes) {
    return DataLoss(fmt::format("delta tile {}: {} bytes, table says {}", t, body.size(), entry.bytes));
  }
  const uint64_t values_bytes = entry.changed * es;
  if (values_bytes > body.size()) {
    return DataLoss(fmt::format("delta tile {}: body too short for {} values", t, entry.changed));
  }
  return body.size() - static_cast<size_t>(values_bytes);
}

}  // namespace

int64_t DeltaTiling::TileRows(int64_t t) const {
  const int64_t tr = t / tiles_c;
  return std::min(tile_rows, rows - tr * tile_rows);
}
int64_t DeltaTiling::TileCols(int64_t t) const {
  const int64_t tc = t % tiles_c;
  return std::min(tile_cols, cols - tc * tile_cols);
}
int64_t DeltaTiling::LocalOffset(int64_t t, int64_t k) const {
  const int64_t tr = t / tiles_c, tc = t % tiles_c;
  const int64_t w = TileCols(t);
  return (tr * tile_rows + k / w) * cols + tc * tile_cols + k % w;
}

DeltaTiling TilingFor(const Shape& local_shape) {
  DeltaTiling g;
  if (!local_shape.empty()) {
    g.cols = local_shape.back();
    g.rows = 1;
    for (size_t d = 0; d + 1 < local_shape.size(); ++d) g.rows *= local_shape[d];
  }
  if (g.rows <= 0 || g.cols <= 0) {
    g.rows = g.cols = 0;
    g.tiles_r = g.tiles_c = 0;
    return g;
  }
  g.tile_cols = std::min<int64_t>(g.cols, kDeltaMaxTileCols);
  g.tile_rows = std::clamp<int64_t>(kDeltaTargetTileElements / g.tile_cols, 1, g.rows);
  g.tiles_r = (g.rows + g.tile_rows - 1) / g.tile_rows;
  g.tiles_c = (g.cols + g.tile_cols - 1) / g.tile_cols;
  return g;
}

EncodedDelta EncodeShardDelta(DType dtype, const Shape& local_shape, const void* old_data, const void* new_data) {
  const size_t es = DTypeSize(dtype);
  const int64_t n = NumElements(local_shape);
  const auto* a = static_cast<const std::byte*>(old_data);
  const auto* b = static_cast<const std::byte*>(new_data);
  std::vector<int64_t> offsets;
  std::vector<std::byte> values;
  switch (es) {
    case 1: FindChanges<uint8_t>(a, b, n, offsets, values); break;
    case 2: FindChanges<uint16_t>(a, b, n, offsets, values); break;
    case 4: FindChanges<uint32_t>(a, b, n, offsets, values); break;
    case 8: FindChanges<uint64_t>(a, b, n, offsets, values); break;
    default:
      for (int64_t i = 0; i < n; ++i) {
        const size_t at = static_cast<size_t>(i) * es;
        if (std::memcmp(a + at, b + at, es) != 0) {
          offsets.push_back(i);
          values.insert(values.end(), b + at, b + at + es);
        }
      }
  }
  return Encode(dtype, local_shape, offsets, values.data());
}

Result<EncodedDelta> EncodeShardDeltaFromChanges(DType dtype, const Shape& local_shape,
                                                 std::span<const int64_t> offsets, std::span<const std::byte> values) {
  const size_t es = DTypeSize(dtype);
  const int64_t n = NumElements(local_shape);
  if (values.size() != offsets.size() * es) {
    return InvalidArgument(fmt::format("delta of shape {}: {} offsets need {} value bytes of {}, got {}",
                                       ShapeToString(local_shape), offsets.size(), offsets.size() * es,
                                       DTypeName(dtype), values.size()));
  }
  for (size_t i = 0; i < offsets.size(); ++i) {
    if (offsets[i] < 0 || offsets[i] >= n || (i > 0 && offsets[i] <= offsets[i - 1])) {
      return InvalidArgument(fmt::format("delta of shape {}: offset [{}] = {} is not strictly increasing inside "
                                         "the shard's {} elements",
                                         ShapeToString(local_shape), i, offsets[i], n));
    }
  }
  return Encode(dtype, local_shape, offsets, values.data());
}

Result<std::vector<DeltaTile>> ParseDeltaTable(DType dtype, const Shape& local_shape,
                                               std::span<const std::byte> prefix, uint64_t payload_bytes) {
  const DeltaTiling g = TilingFor(local_shape);
  if (prefix.size() < g.table_bytes()) {
    return DataLoss(fmt::format("delta table: {} bytes, need {}", prefix.size(), g.table_bytes()));
  }
  const std::byte* p = prefix.data();
  auto bad = [&](std::string_view field, uint64_t got, uint64_t want) {
    return DataLoss(fmt::format("delta header {}: {} (expected {})", field, got, want));
  };
  if (Get<uint32_t>(p) != kDeltaMagic) return bad("magic", Get<uint32_t>(p), kDeltaMagic);
  if (Get<uint16_t>(p + 4) != kDeltaFormat) return bad("format", Get<uint16_t>(p + 4), kDeltaFormat);
  if (Get<uint16_t>(p + 6) != DTypeSize(dtype)) return bad("element size", Get<uint16_t>(p + 6), DTypeSize(dtype));
  if (Get<uint64_t>(p + 8) != static_cast<uint64_t>(g.rows * g.cols)) {
    return bad("elements", Get<uint64_t>(p + 8), static_cast<uint64_t>(g.rows * g.cols));
  }
  if (Get<uint32_t>(p + 16) != g.tile_rows) return bad("tile rows", Get<uint32_t>(p + 16), g.tile_rows);
  if (Get<uint32_t>(p + 20) != g.tile_cols) return bad("tile cols", Get<uint32_t>(p + 20), g.tile_cols);
  if (Get<uint64_t>(p + 24) != static_cast<uint64_t>(g.tiles())) return bad("tiles", Get<uint64_t>(p + 24), g.tiles());
  const uint64_t changed = Get<uint64_t>(p + 32);
  std::vector<DeltaTile> out(static_cast<size_t>(g.tiles()));
  uint64_t sum = 0;
  for (int64_t t = 0; t < g.tiles(); ++t) {
    const std::byte* e = p + kDeltaHeaderBytes + static_cast<uint64_t>(t) * kDeltaEntryBytes;
    DeltaTile& d = out[static_cast<size_t>(t)];
    d.offset = Get<uint64_t>(e);
    d.bytes = Get<uint32_t>(e + 8);
    const uint32_t c = Get<uint32_t>(e + 12);
    d.bitmap = (c & kDeltaBitmapFlag) != 0;
    d.changed = c & ~kDeltaBitmapFlag;
    const uint64_t n = static_cast<uint64_t>(g.TileRows(t) * g.TileCols(t));
    if (d.changed > n || d.offset < g.table_bytes() || d.offset > payload_bytes || d.bytes > payload_bytes - d.offset) {
      return DataLoss(fmt::format("delta tile {}: {} changes in {} bytes at {} do not fit a {}-element tile inside "
                                  "the {}-byte payload",
                                  t, d.changed, d.bytes, d.offset, n, payload_bytes));
    }
    sum += d.changed;
  }
  if (sum != changed) return bad("changed elements (sum over tiles)", sum, changed);
  return out;
}

Status DecodeDeltaTile(const DeltaTiling& g, size_t es, int64_t t, const DeltaTile& entry,
                       std::span<const std::byte> body,
                       const std::function<void(int64_t local_offset, const std::byte* value)>& fn) {
  RC_ASSIGN_OR_RETURN(const size_t index_bytes, TileIndexBytes(es, t, entry, body));
  const int64_t n = g.TileRows(t) * g.TileCols(t);
  const uint64_t count = entry.changed;
  const std::byte* values = body.data() + index_bytes;
  if (entry.bitmap) {
    if (index_bytes != static_cast<size_t>((n + 7) / 8)) {
      return DataLoss(fmt::format("delta tile {}: bitmap of {} bytes for {} elements", t, index_bytes, n));
    }
    uint64_t i = 0;
    for (int64_t k = 0; k < n; ++k) {
      if ((static_cast<uint8_t>(body[static_cast<size_t>(k / 8)]) >> (k % 8)) & 1u) {
        if (i == count) return DataLoss(fmt::format("delta tile {}: bitmap has more than {} bits set", t, count));
        fn(g.LocalOffset(t, k), values + i * es);
        ++i;
      }
    }
    // Bits past the tile's end must be clear.
    for (int64_t k = n; k < static_cast<int64_t>(index_bytes) * 8; ++k) {
      if ((static_cast<uint8_t>(body[static_cast<size_t>(k / 8)]) >> (k % 8)) & 1u) {
        return DataLoss(fmt::format("delta tile {}: bitmap bit {} is past the tile's {} elements", t, k, n));
      }
    }
    if (i != count) return DataLoss(fmt::format("delta tile {}: bitmap has {} bits set, table says {}", t, i, count));
    return OkStatus();
  }
  size_t pos = 0;
  int64_t prev = -1;
  for (uint64_t i = 0; i < count; ++i) {
    uint64_t v = 0;
    int shift = 0;
    for (;;) {
      if (pos >= index_bytes || shift > 56) return DataLoss(fmt::format("delta tile {}: index {} is truncated", t, i));
      const uint8_t byte = static_cast<uint8_t>(body[pos++]);
      v |= static_cast<uint64_t>(byte & 0x7f) << shift;
      shift += 7;
      if ((byte & 0x80) == 0) break;
    }
    if (i > 0 && v == 0) return DataLoss(fmt::format("delta tile {}: index {} repeats offset {}", t, i, prev));
    const uint64_t k = prev < 0 ? v : static_cast<uint64_t>(prev) + v;
    if (k >= static_cast<uint64_t>(n)) {
      return DataLoss(fmt::format("delta tile {}: index {} is offset {}, past the tile's {} elements", t, i, k, n));
    }
    prev = static_cast<int64_t>(k);
    fn(g.LocalOffset(t, prev), values + i * es);
  }
  if (pos != index_bytes) {
    return DataLoss(fmt::format("delta tile {}: {} index bytes left over after {} indices", t, index_bytes - pos, count));
  }
  return OkStatus();
}

Result<const std::byte*> DecodeDeltaTileOffsets(const DeltaTiling& g, size_t es, int64_t t, const DeltaTile& entry,
                                                std::span<const std::byte> body, uint16_t* offsets) {
  RC_ASSIGN_OR_RETURN(const size_t index_bytes, TileIndexBytes(es, t, entry, body));
  const int64_t n = g.TileRows(t) * g.TileCols(t);
  const uint64_t count = entry.changed;
  const auto* p = reinterpret_cast<const uint8_t*>(body.data());
  const std::byte* values = body.data() + index_bytes;
  if (entry.bitmap) {
    if (index_bytes != static_cast<size_t>((n + 7) / 8)) {
      return DataLoss(fmt::format("delta tile {}: bitmap of {} bytes for {} elements", t, index_bytes, n));
    }
    uint64_t i = 0;
    // Bits at or past n (in the last byte) must be clear: checked on the last word below.
    for (size_t at = 0; at < index_bytes; at += 8) {
      const size_t len = std::min<size_t>(8, index_bytes - at);
      uint64_t w = 0;
      std::memcpy(&w, p + at, len);
      const int64_t base = static_cast<int64_t>(at) * 8;
      if (base + 64 > n) {
        const uint64_t past = n - base >= 64 ? 0 : ~uint64_t{0} << (n - base);
        if ((w & past) != 0) {
          return DataLoss(fmt::format("delta tile {}: bitmap bit {} is past the tile's {} elements", t,
                                      base + std::countr_zero(w & past), n));
        }
      }
      const auto bits = static_cast<uint64_t>(std::popcount(w));
      if (i + bits > count) return DataLoss(fmt::format("delta tile {}: bitmap has more than {} bits set", t, count));
      while (w != 0) {
        offsets[i++] = static_cast<uint16_t>(base + std::countr_zero(w));
        w &= w - 1;
      }
    }
    if (i != count) return DataLoss(fmt::format("delta tile {}: bitmap has {} bits set, table says {}", t, i, count));
    return values;
  }
  size_t pos = 0;
  uint64_t prev = 0;
  uint64_t i = 0;
  // Fast path while two bytes remain: gaps inside a tile (< 2^13 elements) take one or two
  // varint bytes, decoded without a branch on the length; anything longer (or the last byte)
  // goes through the general loop below, which reports malformed varints.
  if (count > 0 && index_bytes >= 2) {
    {
      const uint64_t b0 = p[0], b1 = p[1];
      const uint64_t two = b0 >> 7;
      if (two == 0 || (b1 & 0x80) == 0) {
        const uint64_t v = (b0 & 0x7f) | ((b1 << 7) & (uint64_t{0} - two));
        if (v >= static_cast<uint64_t>(n)) {
          return DataLoss(fmt::format("delta tile {}: index {} is offset {}, past the tile's {} elements", t, 0, v, n));
        }
        offsets[0] = static_cast<uint16_t>(v);
        prev = v;
        pos = 1 + two;
        i = 1;
      }
    }
    while (i > 0 && i < count && pos + 2 <= index_bytes) {
      const uint64_t b0 = p[pos], b1 = p[pos + 1];
      const uint64_t two = b0 >> 7;
      if (two != 0 && (b1 & 0x80) != 0) break;
      const uint64_t v = (b0 & 0x7f) | ((b1 << 7) & (uint64_t{0} - two));
      if (v == 0) return DataLoss(fmt::format("delta tile {}: index {} repeats offset {}", t, i, prev));
      const uint64_t k = prev + v;
      if (k >= static_cast<uint64_t>(n)) {
        return DataLoss(fmt::format("delta tile {}: index {} is offset {}, past the tile's {} elements", t, i, k, n));
      }
      offsets[i++] = static_cast<uint16_t>(k);
      prev = k;
      pos += 1 + two;
    }
  }
  for (; i < count; ++i) {
    if (pos >= index_bytes) return DataLoss(fmt::format("delta tile {}: index {} is truncated", t, i));
    uint64_t v = p[pos++];
    if (v >= 0x80) {  // multi-byte varint (gaps of 128 or more)
      v &= 0x7f;
      int shift = 7;
      for (;;) {
        if (pos >= index_bytes || shift > 56) return DataLoss(fmt::format("delta tile {}: index {} is truncated", t, i));
        const uint8_t byte = p[pos++];
        v |= static_cast<uint64_t>(byte & 0x7f) << shift;
        shift += 7;
        if ((byte & 0x80) == 0) break;
      }
    }
    if (i > 0 && v == 0) return DataLoss(fmt::format("delta tile {}: index {} repeats offset {}", t, i, prev));
    const uint64_t k = i == 0 ? v : prev + v;
    if (k >= static_cast<uint64_t>(n) || k < prev) {
      return DataLoss(fmt::format("delta tile {}: index {} is offset {}, past the tile's {} elements", t, i, k, n));
    }
    offsets[i] = static_cast<uint16_t>(k);
    prev = k;
  }
  if (pos != index_bytes) {
    return DataLoss(fmt::format("delta tile {}: {} index bytes left over after {} indices", t, index_bytes - pos, count));
  }
  return values;
}

std::vector<int64_t> TilesTouching(const DeltaTiling& g, const Shape& local_shape, const Box& b) {
  std::vector<int64_t> out;
  if (g.tiles() == 0 || b.numel() == 0) return out;
  const size_t nd = local_shape.size();
  int64_t c0 = 0, c1 = 1;
  if (nd > 0) {
    c0 = b.start[nd - 1];
    c1 = b.start[nd - 1] + b.extent[nd - 1];
  }
  const int64_t tc0 = c0 / g.tile_cols, tc1 = (c1 - 1) / g.tile_cols;
  std::vector<bool> row_tiles(static_cast<size_t>(g.tiles_r), false);
  if (nd <= 1) {
    row_tiles[0] = true;
  } else if (nd == 2) {
    for (int64_t tr = b.start[0] / g.tile_rows; tr <= (b.start[0] + b.extent[0] - 1) / g.tile_rows; ++tr) {
      row_tiles[static_cast<size_t>(tr)] = true;
    }
  } else {
    // Flattened rows of the leading dims: walk the box's leading indices.
    const Shape strides = RowMajorStrides(Shape(local_shape.begin(), local_shape.end() - 1));
    std::vector<int64_t> idx(nd - 1, 0);
    for (;;) {
      int64_t row = 0;
      for (size_t d = 0; d + 1 < nd; ++d) row += (b.start[d] + idx[d]) * strides[d];
      row_tiles[static_cast<size_t>(row / g.tile_rows)] = true;
      size_t d = nd - 1;
      bool done = true;
      while (d > 0) {
        --d;
        if (++idx[d] < b.extent[d]) {
          done = false;
          break;
        }
        idx[d] = 0;
      }
      if (done) break;
    }
  }
  for (int64_t tr = 0; tr < g.tiles_r; ++tr) {
    if (!row_tiles[static_cast<size_t>(tr)]) continue;
    for (int64_t tc = tc0; tc <= tc1; ++tc) out.push_back(tr * g.tiles_c + tc);
  }
  return out;
}

uint64_t PlainDeltaBytes(std::span<const int64_t> sorted_offsets, size_t element_size) {
  uint64_t total = sorted_offsets.size() * element_size;
  int64_t prev = -1;
  for (int64_t o : sorted_offsets) {
    total += VarintLen(static_cast<uint64_t>(prev < 0 ? o : o - prev));
    prev = o;
  }
  return total;
}

}  // namespace rc::refit
