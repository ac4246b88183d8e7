// The per-tile work of a delta refit applied to an image in GPU memory (issue 39, "Delta on the
// GPU"), written once for host and device like digest_chunk.h: RunDeltaTask decodes one pulled
// delta tile (rolloutcore/refit/delta.h: gap varints or a bitmap, then the new values), maps each
// changed element through its piece (one captured copy x one pulled shard: the affine map of
// receiver/delta_apply.h's DeltaPiece, flattened into DeltaPieceDesc), stores the new value into the
// image (converted to the parameter's dtype) and sums, over the elements whose digest the copy owns,
// the digest terms of the old and of the stored value. With D_old the image's per-tensor digest
// before, D_old + new_terms - old_terms is its digest after (rolloutcore/refit/digest.h), the
// prediction the receiver checks against the manifest.
//
// The CUDA kernel (kernels.cu, LaunchDeltaTasks) runs one task per thread; EvaluateDeltaTasksOnHost
// (receiver/device_delta.h) runs every task in turn on host memory, so the CPU tests check this
// exact code against the CPU delta path (receiver/delta_apply.h's PredictDelta with apply).
//
// No CUDA header here: the receiver's CPU build includes it.
//
// Thread safety: pure functions of the task and the memory it names. Tasks of one launch write
// disjoint elements (the captured copies of one rank write disjoint destination elements; a tile
// belongs to one task per piece).
#pragma once

#include <cstdint>

#include "cuda/dtype_bits.h"
#include "rolloutcore/refit/digest.h"

namespace rc::cuda::internal {

inline constexpr int kDeltaMaxLead = 8;  // leading dims of a shard as a matrix (9-d tensors)

// One piece: a captured copy x one pulled shard it overlaps. For shard-local leading coords l and
// column j: destination element = dest0 + sum_d l_d * lead_dest[d] + j * col_dest, global source
// index = global0 + sum_d l_d * lead_global[d] + j, for (l, j) inside [lead_lo, lead_hi) x
// [col_lo, col_hi) (the overlap with the copy's box).
struct DeltaPieceDesc {
  uint64_t image = 0;  // address of the parameter in the image written (the staging buffer)
  int64_t dest0 = 0, global0 = 0, col_dest = 0;
  int64_t lead_shape[kDeltaMaxLead] = {}, lead_dest[kDeltaMaxLead] = {}, lead_global[kDeltaMaxLead] = {};
  int64_t lead_lo[kDeltaMaxLead] = {}, lead_hi[kDeltaMaxLead] = {};
  int64_t col_lo = 0, col_hi = 0;
  // The shard's tiling (refit::DeltaTiling).
  int64_t rows = 1, cols = 1, tile_rows = 1, tile_cols = 1, tiles_c = 1;
  uint32_t nlead = 0;    // leading dims
  uint32_t tensor = 0;   // output slot (per tensor)
  uint32_t owned_begin = 0, owned_count = 0;  // partial ownership: boxes in the owned table
  uint8_t source_es = 2;     // bytes of a new value (the shard's dtype)
  uint8_t dest_es = 2;       // bytes of a parameter element
  uint8_t mode = kBitsRaw;   // BitsMode of (source, parameter) dtypes (dtype_bits.h)
  uint8_t finite = 0;        // 1 bf16, 2 f16, 3 f32: the non-finite check of new values; 0 none
  uint8_t own_all = 0;       // 1: the copy owns the digest of every element of the overlap
  uint8_t pad[3] = {};
};

// An owned region of a partially owned piece, in shard-local coordinates.
struct DeltaOwnedBox {
  int64_t lead_lo[kDeltaMaxLead] = {}, lead_hi[kDeltaMaxLead] = {};
  int64_t col_lo = 0, col_hi = 0;
};

// One tile of one piece.
struct DeltaTask {
  uint64_t body = 0;     // offset of the tile's body in the bodies buffer
  int64_t tile = 0;      // tile index in the shard's tiling
  uint32_t bytes = 0;    // body bytes
  uint32_t changed = 0;  // changed elements in the tile
  uint32_t piece = 0;
  uint32_t bitmap = 0;   // 1: the body's index is a bitmap
};

enum DeltaTaskError : uint32_t {
  kDeltaTaskOk = 0,
  kDeltaTaskMalformed = 1,  // the body does not decode (the host re-decodes it for the message)
  kDeltaTaskNonFinite = 2,  // a new value is inf or NaN (refused before anything is stored)
};

struct DeltaTaskResult {
  uint64_t old_terms = 0, new_terms = 0;  // digest terms over the owned changed elements
  uint32_t writes = 0;  // elements stored (inside the copy's box)
  uint32_t owned = 0;   // of them, digest-owned
  uint32_t error = kDeltaTaskOk;
};

RC_HD uint64_t DeltaLoad(const unsigned char* p, int es) {
  uint64_t v = 0;
  for (int b = 0; b < es; ++b) v |= static_cast<uint64_t>(p[b]) << (8 * b);
  return v;
}

RC_HD void DeltaStore(unsigned char* p, int es, uint64_t v) {
  if (es == 2) {
    *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(v);
  } else if (es == 4) {
    *reinterpret_cast<uint32_t*>(p) = static_cast<uint32_t>(v);
  } else {
    for (int b = 0; b < es; ++b) p[b] = static_cast<unsigned char>(v >> (8 * b));
  }
}

// A new value (source-dtype bits) in the parameter's dtype.
RC_HD uint64_t DeltaToDest(uint8_t mode, uint64_t bits) {
  switch (mode) {
    case kBitsF32FromBf16: return Bf16ToF32Bits(static_cast<uint16_t>(bits));
    case kBitsF32FromF16: return F16ToF32Bits(static_cast<uint16_t>(bits));
    case kBitsBf16FromF32: return F32BitsToBf16(static_cast<uint32_t>(bits));
    case kBitsF16FromF32: return F32BitsToF16(static_cast<uint32_t>(bits));
    default: return bits;
  }
}

RC_HD bool DeltaNonFinite(uint8_t finite, uint64_t bits) {
  switch (finite) {
    case 1: return (bits & 0x7f80u) == 0x7f80u;
    case 2: return (bits & 0x7c00u) == 0x7c00u;
    case 3: return (bits & 0x7f800000u) == 0x7f800000u;
    default: return false;
  }
}

// Shard row R's leading coords, whether they lie in [lo, hi), and the row's destination and
// global index of column 0.
RC_HD bool DeltaRow(const DeltaPieceDesc& p, int64_t R, int64_t* dest, int64_t* global) {
  bool in = true;
  int64_t d0 = p.dest0, g0 = p.global0;
  for (int d = static_cast<int>(p.nlead) - 1; d >= 0; --d) {
    const int64_t l = R % p.lead_shape[d];
    R /= p.lead_shape[d];
    in = in && l >= p.lead_lo[d] && l < p.lead_hi[d];
    d0 += l * p.lead_dest[d];
    g0 += l * p.lead_global[d];
  }
  *dest = d0;
  *global = g0;
  return in;
}

RC_HD bool DeltaOwned(const DeltaPieceDesc& p, const DeltaOwnedBox* owned, int64_t R, int64_t j) {
  if (p.own_all) return true;
  int64_t l[kDeltaMaxLead];
  for (int d = static_cast<int>(p.nlead) - 1; d >= 0; --d) {
    l[d] = R % p.lead_shape[d];
    R /= p.lead_shape[d];
  }
  for (uint32_t b = 0; b < p.owned_count; ++b) {
    const DeltaOwnedBox& box = owned[p.owned_begin + b];
    bool inside = j >= box.col_lo && j < box.col_hi;
    for (uint32_t d = 0; inside && d < p.nlead; ++d) inside = l[d] >= box.lead_lo[d] && l[d] < box.lead_hi[d];
    if (inside) return true;
  }
  return false;
}

// Calls fn(k) for each changed in-tile offset k (row-major inside the tile) in increasing order;
// false when the index is malformed (as refit::DecodeDeltaTileOffsets would refuse it).
template <typename Fn>
RC_HD bool DeltaForEachOffset(const unsigned char* index, uint64_t index_bytes, bool bitmap, int64_t n,
                              uint32_t count, Fn&& fn) {
  uint32_t i = 0;
  if (bitmap) {
    if (index_bytes != static_cast<uint64_t>((n + 7) / 8)) return false;
    for (uint64_t at = 0; at < index_bytes; ++at) {
      uint32_t byte = index[at];
      while (byte != 0) {
#ifdef __CUDA_ARCH__
        const int b = __ffs(static_cast<int>(byte)) - 1;
#else
        const int b = __builtin_ctz(byte);
#endif
        byte &= byte - 1;
        const int64_t k = static_cast<int64_t>(at) * 8 + b;
        if (k >= n || i >= count) return false;
        fn(k, i);
        ++i;
      }
    }
    return i == count;
  }
  uint64_t pos = 0;
  int64_t prev = 0;
  for (; i < count; ++i) {
    uint64_t v = 0;
    int shift = 0;
    for (;;) {
      if (pos >= index_bytes || shift > 56) return false;
      const uint32_t byte = index[pos++];
      v |= static_cast<uint64_t>(byte & 0x7fu) << shift;
      shift += 7;
      if ((byte & 0x80u) == 0) break;
    }
    if (i > 0 && v == 0) return false;
    const uint64_t k = i == 0 ? v : static_cast<uint64_t>(prev) + v;
    if (k >= static_cast<uint64_t>(n)) return false;
    fn(static_cast<int64_t>(k), i);
    prev = static_cast<int64_t>(k);
  }
  return pos == index_bytes;
}

// One task: validates the tile (decodes it and checks every new value is finite) before it stores
// anything, then stores and sums. On an error nothing of this tile is stored.
RC_HD DeltaTaskResult RunDeltaTask(const DeltaPieceDesc& p, const DeltaTask& t, const unsigned char* bodies,
                                   const DeltaOwnedBox* owned) {
  DeltaTaskResult r;
  const uint64_t values_bytes = static_cast<uint64_t>(t.changed) * p.source_es;
  if (values_bytes > t.bytes) {
    r.error = kDeltaTaskMalformed;
    return r;
  }
  const unsigned char* body = bodies + t.body;
  const uint64_t index_bytes = t.bytes - values_bytes;
  const unsigned char* values = body + index_bytes;
  const int64_t tr = t.tile / p.tiles_c, tc = t.tile % p.tiles_c;
  const int64_t rows = p.tile_rows < p.rows - tr * p.tile_rows ? p.tile_rows : p.rows - tr * p.tile_rows;
  const int64_t w = p.tile_cols < p.cols - tc * p.tile_cols ? p.tile_cols : p.cols - tc * p.tile_cols;
  const int64_t n = rows * w;
  // Pass 1: the index decodes and every value is finite.
  bool finite = true;
  const bool ok = DeltaForEachOffset(body, index_bytes, t.bitmap != 0, n, t.changed, [&](int64_t, uint32_t i) {
    finite = finite && !DeltaNonFinite(p.finite, DeltaLoad(values + static_cast<uint64_t>(i) * p.source_es,
                                                           p.source_es));
  });
  if (!ok) {
    r.error = kDeltaTaskMalformed;
    return r;
  }
  if (!finite) {
    r.error = kDeltaTaskNonFinite;
    return r;
  }
  // Pass 2: map, store, sum.
  const int64_t row0 = tr * p.tile_rows, col0 = tc * p.tile_cols;
  // The table carries addresses as integers (one layout for host and device).
  auto* image = reinterpret_cast<unsigned char*>(p.image);  // NOLINT(performance-no-int-to-ptr)
  int64_t cached_row = -1, rd = 0, rg = 0;
  bool row_in = false;
  DeltaForEachOffset(body, index_bytes, t.bitmap != 0, n, t.changed, [&](int64_t k, uint32_t i) {
    const int64_t rr = k / w, j = col0 + (k - rr * w);
    if (row0 + rr != cached_row) {
      cached_row = row0 + rr;
      row_in = DeltaRow(p, cached_row, &rd, &rg);
    }
    if (!row_in || j < p.col_lo || j >= p.col_hi) return;
    unsigned char* at = image + (rd + j * p.col_dest) * p.dest_es;
    const uint64_t old_raw = DeltaLoad(at, p.dest_es);
    const uint64_t new_bits = DeltaLoad(values + static_cast<uint64_t>(i) * p.source_es, p.source_es);
    DeltaStore(at, p.dest_es, DeltaToDest(p.mode, new_bits));
    ++r.writes;
    if (!DeltaOwned(p, owned, cached_row, j)) return;
    ++r.owned;
    const auto global = static_cast<uint64_t>(rg + j);
    r.old_terms += refit::DigestTerm(global, SourceBitsFromInstalled(p.mode, old_raw));
    r.new_terms += refit::DigestTerm(global, SourceBitsFromInstalled(p.mode, DeltaLoad(at, p.dest_es)));
  });
  return r;
}

}  // namespace rc::cuda::internal
