#include "receiver/delta_apply.h"
#include "receiver/nonfinite.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <set>

#include "rolloutcore/base/hash.h"
#include "rolloutcore/base/parallel.h"
#include "rolloutcore/refit/delta.h"
#include "rolloutcore/receiver/source_imports.h"

namespace rc::receiver::internal {
namespace {

double MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// The zero-extended bits of one element of `size` bytes (1, 2, 4 or 8).
inline uint64_t LoadBits(const std::byte* p, size_t size) {
  switch (size) {
    case 2: {
      uint16_t v;
      std::memcpy(&v, p, 2);
      return v;
    }
    case 4: {
      uint32_t v;
      std::memcpy(&v, p, 4);
      return v;
    }
    case 1: return static_cast<uint8_t>(*p);
    default: {
      uint64_t v = 0;
      std::memcpy(&v, p, std::min<size_t>(size, 8));
      return v;
    }
  }
}

inline void StoreBits(std::byte* p, size_t size, uint64_t bits) {
  switch (size) {
    case 2: {
      const auto v = static_cast<uint16_t>(bits);
      std::memcpy(p, &v, 2);
      return;
    }
    case 4: {
      const auto v = static_cast<uint32_t>(bits);
      std::memcpy(p, &v, 4);
      return;
    }
    default: std::memcpy(p, &bits, std::min<size_t>(size, 8));
  }
}

// A new value (source-dtype bits) in the parameter's dtype.
inline uint64_t ToDest(refit::DType source, refit::DType dest, uint64_t bits) {
  if (source == dest) return bits;
  if (source == refit::DType::kBF16 && dest == refit::DType::kF32) return bits << 16;  // exact widening
  uint64_t src = bits, out = 0;
  refit::ConvertElements(source, &src, 1, dest, &out, 1, 1);
  return out;
}

inline uint64_t InstalledBitsInline(refit::DType source, refit::DType installed, const std::byte* element) {
  if (source == refit::DType::kBF16 && installed == refit::DType::kF32) {
    uint32_t u;
    std::memcpy(&u, element, 4);
    return (u & 0xffffu) == 0 ? (u >> 16) : refit::InstalledSourceBits(source, installed, element);
  }
  if (source == refit::DType::kBF16 && installed == refit::DType::kBF16) {
    uint16_t h;
    std::memcpy(&h, element, 2);
    return h;
  }
  if (source == installed) return LoadBits(element, refit::DTypeSize(installed));
  return refit::InstalledSourceBits(source, installed, element);
}

// Per-thread scratch of a job: one tile's decoded in-tile offsets, the tile's row table, and a
// batch of mapped elements (several tiles' worth) that the memory pass walks.
struct JobScratch {
  static constexpr size_t kTileMax = static_cast<size_t>(refit::kDeltaTargetTileElements);
  static constexpr size_t kBatch = 4096;            // the memory pass runs when a batch holds this many
  static constexpr size_t kCap = kBatch + kTileMax;  // a batch plus one more tile
  uint16_t offsets[kTileMax];
  uint16_t ks[kTileMax];  // in-tile offsets of the tile's elements inside the copy box
  int64_t row_dest[kTileMax];
  int64_t row_global[kTileMax];
  uint8_t row_in[kTileMax];
  // The batch.
  size_t n = 0;
  int64_t dest[kCap];
  uint64_t global[kCap];
  uint64_t bits[kCap];  // new value, source-dtype bits
  uint8_t owned[kCap];
};

JobScratch& ThreadScratch() {
  thread_local std::unique_ptr<JobScratch> s = std::make_unique<JobScratch>();
  s->n = 0;
  return *s;
}

// Leading coords (shard-local) of shard row R.
inline void LeadCoords(const DeltaPiece& p, int64_t R, int64_t* out) {
  for (size_t d = p.lead_shape.size(); d-- > 0;) {
    out[d] = R % p.lead_shape[d];
    R /= p.lead_shape[d];
  }
}

// Shard row R's mapping: inside the copy's leading range, destination and global index of column 0.
inline void RowOf(const DeltaPiece& p, int64_t R, bool* in, int64_t* dest, int64_t* global) {
  const size_t lead = p.lead_shape.size();
  if (lead == 1) {  // 2-d shards: the row is the leading coord
    *in = R >= p.in.lead_lo[0] && R < p.in.lead_hi[0];
    *dest = p.dest0 + R * p.lead_dest[0];
    *global = p.global0 + R * p.lead_global[0];
    return;
  }
  int64_t l[16];
  LeadCoords(p, R, l);
  bool inside = true;
  int64_t d0 = p.dest0, g0 = p.global0;
  for (size_t d = 0; d < lead; ++d) {
    inside = inside && l[d] >= p.in.lead_lo[d] && l[d] < p.in.lead_hi[d];
    d0 += l[d] * p.lead_dest[d];
    g0 += l[d] * p.lead_global[d];
  }
  *in = inside;
  *dest = d0;
  *global = g0;
}

// Whether element (row R, column j) of a partially owned piece lies in one of its owned regions.
bool OwnedSlow(const DeltaPiece& p, int64_t R, int64_t j) {
  int64_t l[16];
  LeadCoords(p, R, l);
  for (const DeltaLocalBox& b : p.owned) {
    bool inside = j >= b.col_lo && j < b.col_hi;
    for (size_t d = 0; inside && d < p.lead_shape.size(); ++d) inside = l[d] >= b.lead_lo[d] && l[d] < b.lead_hi[d];
    if (inside) return true;
  }
  return false;
}

// Walks a job's tiles: decodes each (DecodeDeltaTileOffsets), calls v.Tile(t, count, values,
// offsets) (which may refuse it), maps its changed elements through the piece (a row table per
// tile, or per element for tiles with far more rows than changes; no branch on the element's
// position: elements outside the copy box are dropped by a branch-free compaction) into the
// batch, calls v.TileMapped(ks, count) with the in-tile offsets of the elements kept, and hands
// full batches to v.Batch(scratch) — the pass that touches parameter memory, with nothing
// unpredictable between its loads so that many misses are in flight at once.
template <typename Visitor>
Status VisitJob(const DeltaStaged& st, const DeltaJob& job, JobScratch& sc, Visitor& v) {
  const DeltaPiece& p = st.pieces[job.piece];
  const DeltaShard& sh = st.shards[p.shard];
  const refit::DeltaTiling& g = sh.tiling;
  const size_t es = refit::DTypeSize(sh.dtype);
  if (p.lead_shape.size() > 16) return InvalidArgument("delta refit: tensors of more than 17 dims are not supported");
  const bool partial_own = !p.own_all && !p.owned.empty();
  const uint8_t own_all = p.own_all ? 1 : 0;
  for (uint32_t ti = job.tile_begin; ti < job.tile_end; ++ti) {
    const auto [t, at] = p.tiles[ti];
    const refit::DeltaTile& e = sh.entries[static_cast<size_t>(t)];
    auto decoded = refit::DecodeDeltaTileOffsets(g, es, t, e, std::span<const std::byte>(sh.bodies).subspan(at, e.bytes),
                                                 sc.offsets);
    if (!decoded.ok()) return decoded.status();
    const std::byte* values = *decoded;
    const uint32_t count = e.changed;
    if (count == 0) continue;
    RC_RETURN_IF_ERROR(v.Tile(t, count, values, sc.offsets));
    const int64_t w = g.TileCols(t);
    const int64_t rows = g.TileRows(t);
    const int64_t row0 = (t / g.tiles_c) * g.tile_rows, col0 = (t % g.tiles_c) * g.tile_cols;
    const int64_t col_lo = p.in.col_lo - col0, col_hi = p.in.col_hi - col0;  // in-tile column range
    const bool table = rows <= 2 * static_cast<int64_t>(count) + 64;
    if (table) {
      for (int64_t rr = 0; rr < rows; ++rr) {
        bool in = false;
        RowOf(p, row0 + rr, &in, &sc.row_dest[rr], &sc.row_global[rr]);
        sc.row_in[rr] = in ? 1 : 0;
      }
    }
    const bool pow2 = (w & (w - 1)) == 0;
    const int shift = std::countr_zero(static_cast<uint64_t>(w));
    size_t n = sc.n;
    size_t kept = 0;
    for (uint32_t i = 0; i < count; ++i) {
      const int64_t k = sc.offsets[i];
      const int64_t rr = pow2 ? (k >> shift) : static_cast<int64_t>(static_cast<uint32_t>(k) / static_cast<uint32_t>(w));
      const int64_t c = k - rr * w;
      bool row_in;
      int64_t rd, rg;
      if (table) {
        row_in = sc.row_in[rr] != 0;
        rd = sc.row_dest[rr];
        rg = sc.row_global[rr];
      } else {
        RowOf(p, row0 + rr, &row_in, &rd, &rg);
      }
      const bool in = row_in & (c >= col_lo) & (c < col_hi);
      const int64_t j = col0 + c;
      sc.dest[n] = rd + j * p.col_dest;
      sc.global[n] = static_cast<uint64_t>(rg + j);
      sc.bits[n] = LoadBits(values + i * es, es);
      sc.owned[n] = partial_own ? (OwnedSlow(p, row0 + rr, j) ? 1 : 0) : own_all;
      sc.ks[kept] = static_cast<uint16_t>(k);
      n += in ? 1 : 0;
      kept += in ? 1 : 0;
    }
    sc.n = n;
    v.TileMapped(sc.ks, kept);
    if (sc.n >= JobScratch::kBatch) {
      v.Batch(sc);
      sc.n = 0;
    }
  }
  if (sc.n > 0) v.Batch(sc);
  sc.n = 0;
  return OkStatus();
}

// Whether the new source bits are also the installed element's source bits (InstalledSourceBits
// of the converted value): true for the same dtype and for bf16 widened to f32.
inline bool ExactInstall(refit::DType source, refit::DType dest) {
  return source == dest || (source == refit::DType::kBF16 && dest == refit::DType::kF32);
}

// What one stage job found.
struct StageResult {
  Status status;
  uint64_t old_terms = 0, new_terms = 0;
  int64_t writes = 0, owned = 0, region_changed = 0;
  uint64_t region_bytes = 0;
  std::optional<DeltaWrite> first;
};

constexpr size_t kPrefetch = 16;  // elements ahead in the memory passes
constexpr size_t kFar = 64;     // and again, into L2 (not an L1 fill buffer), further ahead

// The stage pass: non-finite check, the yardstick, and the digest terms of old and new values.
struct StageVisitor {
  const DeltaStaged& st;
  const DeltaPiece& p;
  const std::string& tensor_name;
  int32_t shard_rank;
  const std::byte* live;  // the parameter's bytes in the image the old values are read from
  std::byte* write;       // the same bytes when the pass also applies the delta; nullptr: read only
  size_t pes, ses;
  refit::DType sdtype;
  StageResult& r;
  bool corrupt_first = false;  // test-only fault: the first store of the pass has bit 0 flipped

  Status Tile(int64_t t, uint32_t count, const std::byte* values, const uint16_t* offsets) {
    bool bad = false;
    if (sdtype == refit::DType::kBF16) {
      for (uint32_t i = 0; i < count; ++i) {
        uint16_t b;
        std::memcpy(&b, values + size_t{2} * i, 2);
        bad |= IsNonFiniteBits(refit::DType::kBF16, b);
      }
    } else {
      for (uint32_t i = 0; i < count; ++i) bad |= IsNonFiniteBits(sdtype, LoadBits(values + i * ses, ses));
    }
    if (!bad) return OkStatus();
    const DeltaShard& sh = st.shards[p.shard];
    for (uint32_t i = 0; i < count; ++i) {
      if (!IsNonFiniteBits(sdtype, LoadBits(values + i * ses, ses))) continue;
      return InvalidArgument(fmt::format("delta of tensor {}: shard-local element {} of rank {}'s shard is "
                                         "non-finite; non-finite weights are refused (nothing was staged, nothing "
                                         "live was touched)",
                                         tensor_name, sh.tiling.LocalOffset(t, offsets[i]), shard_rank));
    }
    return OkStatus();
  }

  // The yardstick: the tile bodies an encoding of only this region's changes would take (gaps
  // inside a tile are below 2^14: one or two varint bytes).
  void TileMapped(const uint16_t* ks, size_t kept) {
    int64_t prev = 0;
    uint64_t bytes = 0;
    for (size_t i = 0; i < kept; ++i) {
      const int64_t gap = ks[i] - prev;
      bytes += ses + 1 + (gap >= 128 ? 1 : 0);
      prev = ks[i];
    }
    r.region_bytes += bytes;
    r.region_changed += static_cast<int64_t>(kept);
  }

  void Batch(const JobScratch& sc) {
    if (sc.n == 0) return;
    if (r.writes == 0) {
      r.first = DeltaWrite{p.param, static_cast<uint32_t>(ToDest(p.source, p.dest, sc.bits[0])), sc.dest[0]};
    }
    const bool first_batch = r.writes == 0;
    r.writes += static_cast<int64_t>(sc.n);
    if (write != nullptr) {
      Run<true>(sc);
      if (corrupt_first && first_batch) CorruptFirst(sc);
    } else {
      Run<false>(sc);
    }
  }

  // The injected fault: element 0 of the first batch is stored with bit 0 flipped, and its new
  // term taken from what it holds then (so the prediction sees what memory holds, as always).
  void CorruptFirst(const JobScratch& sc) {
    const size_t at = static_cast<size_t>(sc.dest[0]) * pes;
    const uint64_t good = InstalledBitsInline(p.source, p.dest, write + at);
    StoreBits(write + at, pes, ToDest(p.source, p.dest, sc.bits[0]) ^ 1u);
    const uint64_t bad = InstalledBitsInline(p.source, p.dest, write + at);
    const uint64_t mask = uint64_t{0} - sc.owned[0];
    r.new_terms += (refit::DigestTerm(sc.global[0], bad) & mask) - (refit::DigestTerm(sc.global[0], good) & mask);
  }

  // kWrite: the image is the one being updated (staging): each changed element's old value is
  // read, the new one stored, and the new term taken from what the element holds after the store.
  // The digest block key is computed once per run of changed elements in one 64-element block
  // (sorted offsets: consecutive changes of a row share it), not once per element.
  template <bool kWrite>
  void Run(const JobScratch& sc) {
    const bool exact = ExactInstall(p.source, p.dest);
    std::byte* out = write;
    uint64_t old_sum = 0, new_sum = 0, owned = 0;
    uint64_t block = ~uint64_t{0}, key = 0;
    for (size_t i = 0; i < sc.n; ++i) {
      if (i + kPrefetch < sc.n) {
        __builtin_prefetch(live + static_cast<size_t>(sc.dest[i + kPrefetch]) * pes, kWrite ? 1 : 0);
      }
      if (i + kFar < sc.n) __builtin_prefetch(live + static_cast<size_t>(sc.dest[i + kFar]) * pes, kWrite ? 1 : 0, 1);
      const uint64_t mask = uint64_t{0} - sc.owned[i];
      owned += sc.owned[i];
      const uint64_t b = sc.global[i] >> 6;
      if (b != block) {
        block = b;
        key = refit::DigestBlockKey(b);
      }
      const auto pos = static_cast<uint32_t>(sc.global[i] & 63);
      const size_t at = static_cast<size_t>(sc.dest[i]) * pes;
      const uint64_t old_bits = InstalledBitsInline(p.source, p.dest, live + at);
      uint64_t new_bits = sc.bits[i];
      if constexpr (kWrite) {
        StoreBits(out + at, pes, ToDest(p.source, p.dest, new_bits));
        new_bits = InstalledBitsInline(p.source, p.dest, out + at);
      } else if (!exact) {
        uint64_t dst = ToDest(p.source, p.dest, new_bits);
        new_bits = refit::InstalledSourceBits(p.source, p.dest, &dst);
      }
      // Digest regions are disjoint over copies and ranks: an element is counted once overall.
      old_sum += refit::DigestTermInBlock(key, pos, old_bits) & mask;
      new_sum += refit::DigestTermInBlock(key, pos, new_bits) & mask;
    }
    r.old_terms += old_sum;
    r.new_terms += new_sum;
    r.owned += static_cast<int64_t>(owned);
  }
};

struct InstallVisitor {
  const DeltaPiece& p;
  std::byte* live;
  size_t pes;
  Status Tile(int64_t, uint32_t, const std::byte*, const uint16_t*) { return OkStatus(); }
  void TileMapped(const uint16_t*, size_t) {}
  void Batch(const JobScratch& sc) {
    if (p.source == refit::DType::kBF16 && p.dest == refit::DType::kF32) {
      for (size_t i = 0; i < sc.n; ++i) {
        if (i + kPrefetch < sc.n) __builtin_prefetch(live + static_cast<size_t>(sc.dest[i + kPrefetch]) * 4, 1);
        if (i + kFar < sc.n) __builtin_prefetch(live + static_cast<size_t>(sc.dest[i + kFar]) * 4, 1, 1);
        const auto u = static_cast<uint32_t>(sc.bits[i] << 16);
        std::memcpy(live + static_cast<size_t>(sc.dest[i]) * 4, &u, 4);
      }
      return;
    }
    if (p.source == refit::DType::kBF16 && p.dest == refit::DType::kBF16) {
      // bf16 live weights (the engine's default for bf16 versions): 2-byte stores of the bits.
      for (size_t i = 0; i < sc.n; ++i) {
        if (i + kPrefetch < sc.n) __builtin_prefetch(live + static_cast<size_t>(sc.dest[i + kPrefetch]) * 2, 1);
        if (i + kFar < sc.n) __builtin_prefetch(live + static_cast<size_t>(sc.dest[i + kFar]) * 2, 1, 1);
        const auto u = static_cast<uint16_t>(sc.bits[i]);
        std::memcpy(live + static_cast<size_t>(sc.dest[i]) * 2, &u, 2);
      }
      return;
    }
    for (size_t i = 0; i < sc.n; ++i) {
      StoreBits(live + static_cast<size_t>(sc.dest[i]) * pes, pes, ToDest(p.source, p.dest, sc.bits[i]));
    }
  }
};

struct VerifyVisitor {
  const DeltaPiece& p;
  const std::byte* live;
  size_t pes;
  uint64_t sum = 0;
  Status Tile(int64_t, uint32_t, const std::byte*, const uint16_t*) { return OkStatus(); }
  void TileMapped(const uint16_t*, size_t) {}
  void Batch(const JobScratch& sc) {
    uint64_t s = 0;
    for (size_t i = 0; i < sc.n; ++i) {
      if (i + kPrefetch < sc.n) __builtin_prefetch(live + static_cast<size_t>(sc.dest[i + kPrefetch]) * pes);
      if (i + kFar < sc.n) __builtin_prefetch(live + static_cast<size_t>(sc.dest[i + kFar]) * pes, 0, 1);
      const uint64_t mask = uint64_t{0} - sc.owned[i];
      s += refit::DigestTerm(sc.global[i],
                             InstalledBitsInline(p.source, p.dest, live + static_cast<size_t>(sc.dest[i]) * pes)) &
           mask;
    }
    sum += s;
  }
};

// Box `b` (global coords, inside the shard's box `s`) in shard-as-matrix local coordinates.
DeltaLocalBox LocalOf(const refit::Box& b, const refit::ShardInfo& s) {
  DeltaLocalBox out;
  const size_t nd = s.shape.size();
  if (nd == 0) {
    out.col_lo = 0;
    out.col_hi = 1;
    return out;
  }
  for (size_t d = 0; d + 1 < nd; ++d) {
    out.lead_lo.push_back(b.start[d] - s.offset[d]);
    out.lead_hi.push_back(b.start[d] + b.extent[d] - s.offset[d]);
  }
  out.col_lo = b.start[nd - 1] - s.offset[nd - 1];
  out.col_hi = out.col_lo + b.extent[nd - 1];
  return out;
}

bool ContainsBox(const refit::Box& outer, const refit::Box& inner) {
  for (size_t d = 0; d < outer.ndim(); ++d) {
    if (inner.start[d] < outer.start[d] || inner.start[d] + inner.extent[d] > outer.start[d] + outer.extent[d]) {
      return false;
    }
  }
  return true;
}

// Jobs of about this many changed elements (or this many tiles), so ParallelFor balances.
constexpr uint64_t kJobChanges = 16384;
constexpr uint32_t kJobTiles = 512;

}  // namespace

uint64_t InstalledBitsFast(refit::DType source, refit::DType installed, const std::byte* element) {
  return InstalledBitsInline(source, installed, element);
}

bool CarriesDelta(const refit::Manifest& manifest) {
  bool any = false;
  for (const refit::ShardTable& t : manifest.tables) {
    for (const refit::ShardInfo& s : t.shards) {
      if (!s.delta) return false;
      any = true;
    }
  }
  return any;
}

std::string DeltaIneligibility(const refit::Manifest& manifest, const std::string& live_version,
                               const refit::TensorDigests* live, bool loaded_only) {
  std::string base;
  for (const refit::ShardTable& t : manifest.tables) {
    for (const refit::ShardInfo& s : t.shards) {
      if (!s.delta) {
        return fmt::format("version {} is published without a delta (tensor {}, shard of rank {})", manifest.version,
                           t.name, s.rank);
      }
      if (base.empty()) base = s.delta->base;
      if (s.delta->base != base) {
        return fmt::format("shards of version {} name two delta bases ({} and {})", manifest.version, base,
                           s.delta->base);
      }
    }
  }
  if (base.empty()) return fmt::format("version {} has no shards", manifest.version);
  if (live_version != base) {
    return fmt::format("the engine serves {}, not the delta's base {}", live_version.empty() ? "nothing" : live_version,
                       base);
  }
  if (live == nullptr) {
    return fmt::format("no digest of the live weights is known for the current install (the last install of {} "
                       "did not prove it), so the base cannot be proven",
                       base);
  }
  for (const refit::ShardTable& t : manifest.tables) {
    std::set<std::string> seen;
    uint64_t want = 0;
    for (const refit::ShardInfo& s : t.shards) {
      if (seen.insert(refit::BoxToString(s.box())).second) want += s.delta->base_digest;
    }
    auto it = live->find(t.name);
    if (it == live->end() && loaded_only) continue;
    if (it == live->end()) return fmt::format("tensor {} is not among the live weights", t.name);
    if (it->second != want) {
      return fmt::format("tensor {}: live digest {} is not the base {}'s {}", t.name, Hex64(it->second), base,
                         Hex64(want));
    }
  }
  return "";
}

Status PlanDeltaRank(const refit::Manifest& m, size_t r, const refit::Capture& cap,
                     const std::vector<refit::DigestRegion>& regions, const std::vector<refit::DestinationBuffers>& live,
                     size_t first_shard, const std::vector<std::vector<uint64_t>>& tile_at, DeltaStaged* out) {
  if (out->rank_jobs.size() <= r) out->rank_jobs.resize(r + 1, {0, 0});
  std::map<std::string, uint32_t, std::less<>> tensor_id;
  for (size_t i = 0; i < out->tensors.size(); ++i) tensor_id.emplace(out->tensors[i], static_cast<uint32_t>(i));
  std::map<size_t, std::vector<const refit::Box*>> regions_by_copy;
  for (const refit::DigestRegion& reg : regions) regions_by_copy[reg.copy].push_back(&reg.box);
  out->rank_jobs[r].first = out->jobs.size();
  for (uint32_t ci = 0; ci < cap.copies.size(); ++ci) {
    const refit::CapturedCopy& c = cap.copies[ci];
    if (c.box.numel() == 0) continue;
    const refit::TensorSpec& param = cap.params[c.param];
    if (live.at(r).find(param.name) == live.at(r).end()) {
      return FailedPrecondition(fmt::format("rank {} has no live parameter {}", r, param.name));
    }
    if (refit::DTypeSize(param.dtype) > 4) {
      return InvalidArgument("delta refit: parameter " + param.name + " has elements over 4 bytes");
    }
    const auto owned = regions_by_copy.find(ci);
    // Destination step per source dim (the copy's view dims that map to it).
    refit::Shape coef(c.box.ndim(), 0);
    for (size_t v = 0; v < c.view_to_source.size(); ++v) {
      const int32_t sd = c.view_to_source[v];
      if (sd >= 0) coef[static_cast<size_t>(sd)] += c.dest_strides[v];
    }
    for (size_t k2 = 0; k2 < tile_at.size(); ++k2) {
      const DeltaShard& sh = out->shards[first_shard + k2];
      const refit::ShardTable& t = m.tables[sh.table];
      if (t.name != c.source) continue;
      const refit::ShardInfo& s = t.shards[sh.shard];
      refit::Box overlap;
      if (!refit::Intersect(c.box, s.box(), &overlap)) continue;
      auto tid = tensor_id.emplace(t.name, static_cast<uint32_t>(out->tensors.size()));
      if (tid.second) out->tensors.push_back(t.name);
      DeltaPiece p;
      p.rank = static_cast<uint32_t>(r);
      p.copy = ci;
      p.param = c.param;
      p.tensor = tid.first->second;
      p.shard = static_cast<uint32_t>(first_shard + k2);
      p.source = c.source_dtype;
      p.dest = param.dtype;
      const size_t nd = s.shape.size();
      const refit::Shape global = refit::RowMajorStrides(t.shape);
      p.dest0 = c.dest_offset;
      for (size_t d = 0; d < nd; ++d) {
        p.dest0 += (s.offset[d] - c.box.start[d]) * coef[d];
        p.global0 += s.offset[d] * global[d];
      }
      for (size_t d = 0; d + 1 < nd; ++d) {
        p.lead_shape.push_back(s.shape[d]);
        p.lead_dest.push_back(coef[d]);
        p.lead_global.push_back(global[d]);
      }
      p.col_dest = nd == 0 ? 0 : coef[nd - 1];
      p.in = LocalOf(overlap, s);
      if (owned != regions_by_copy.end()) {
        for (const refit::Box* box : owned->second) {
          if (ContainsBox(*box, overlap)) p.own_all = true;
        }
        if (!p.own_all) {
          for (const refit::Box* box : owned->second) {
            refit::Box part;
            if (refit::Intersect(*box, overlap, &part)) p.owned.push_back(LocalOf(part, s));
          }
        }
      }
      refit::Box local = overlap;
      for (size_t d = 0; d < nd; ++d) local.start[d] -= s.offset[d];
      for (int64_t tile : refit::TilesTouching(sh.tiling, s.shape, local)) {
        const uint64_t at = tile_at[k2][static_cast<size_t>(tile)];
        if (at == UINT64_MAX) return Internal(fmt::format("delta tile {} of tensor {} was not pulled", tile, t.name));
        p.tiles.emplace_back(tile, at);
      }
      // Jobs: runs of tiles of about kJobChanges changes.
      const auto piece = static_cast<uint32_t>(out->pieces.size());
      uint64_t changes = 0;
      uint32_t begin = 0;
      for (uint32_t i = 0; i < p.tiles.size(); ++i) {
        changes += sh.entries[static_cast<size_t>(p.tiles[i].first)].changed;
        if (changes >= kJobChanges || i + 1 - begin >= kJobTiles || i + 1 == p.tiles.size()) {
          out->jobs.push_back(DeltaJob{piece, begin, i + 1});
          begin = i + 1;
          changes = 0;
        }
      }
      out->pieces.push_back(std::move(p));
    }
  }
  out->rank_jobs[r].second = out->jobs.size();
  return OkStatus();
}

Status PredictDelta(const refit::Manifest& m, const std::vector<refit::Capture>& captures,
                    const std::vector<refit::DestinationBuffers>& live, int threads, DeltaStaged* out,
                    bool apply, bool corrupt_first_write) {
  out->first_write.assign(captures.size(), std::nullopt);
  out->bytes_written.assign(captures.size(), 0);
  out->changed = 0;
  std::vector<StageResult> results(out->jobs.size());
  ParallelFor(out->jobs.size(), threads, [&](size_t j) {
    const DeltaJob& job = out->jobs[j];
    const DeltaPiece& p = out->pieces[job.piece];
    const DeltaShard& sh = out->shards[p.shard];
    const refit::ShardTable& t = m.tables[sh.table];
    const refit::ShardInfo& s = t.shards[sh.shard];
    const refit::TensorSpec& param = captures[p.rank].params[p.param];
    std::byte* base = live.at(p.rank).find(param.name)->second.data();
    JobScratch& sc = ThreadScratch();
    StageVisitor v{*out,
                   p,
                   t.name,
                   s.rank,
                   base,
                   apply ? base : nullptr,
                   refit::DTypeSize(p.dest),
                   refit::DTypeSize(sh.dtype),
                   sh.dtype,
                   results[j],
                   apply && corrupt_first_write && j == 0};
    Status st = VisitJob(*out, job, sc, v);
    if (!st.ok()) {
      results[j].status = st.code() == StatusCode::kDataLoss
                              ? st.WithContext(fmt::format("delta of tensor {} shard of rank {}", t.name, s.rank))
                              : st;
    }
  });
  std::vector<uint64_t> gain(out->tensors.size(), 0), new_terms(out->tensors.size(), 0);
  std::vector<int64_t> region_changed(captures.size(), 0), writes(captures.size(), 0);
  std::vector<uint64_t> region_bytes(captures.size(), 0);
  for (size_t j = 0; j < results.size(); ++j) {
    const StageResult& res = results[j];
    if (!res.status.ok()) return res.status;
    const DeltaPiece& p = out->pieces[out->jobs[j].piece];
    gain[p.tensor] += res.new_terms - res.old_terms;
    new_terms[p.tensor] += res.new_terms;
    out->changed += res.owned;
    region_changed[p.rank] += res.region_changed;
    region_bytes[p.rank] += res.region_bytes;
    writes[p.rank] += res.writes;
    out->bytes_written[p.rank] += static_cast<uint64_t>(res.writes) * refit::DTypeSize(p.dest);
    if (!out->first_write[p.rank] && res.first) out->first_write[p.rank] = res.first;
  }
  out->new_terms = std::move(new_terms);
  out->ranks.assign(captures.size(), DeltaRankReport{});
  for (size_t r = 0; r < captures.size(); ++r) {
    out->ranks[r].rank = r;
    out->ranks[r].changed_in_region = region_changed[r];
    out->ranks[r].region_delta_bytes = region_bytes[r];
    out->ranks[r].writes = writes[r];
  }

  out->predicted = out->base_digests;
  for (size_t i = 0; i < out->tensors.size(); ++i) out->predicted[out->tensors[i]] += gain[i];
  return OkStatus();
}

namespace {

// Which shards and tiles rank `r` (capture `cap`) needs: (table, shard) -> tiles.
using TilesNeeded = std::map<std::pair<size_t, size_t>, std::set<int64_t>>;
Result<TilesNeeded> DeltaTilesNeeded(const refit::Manifest& m, const std::map<std::string, size_t, std::less<>>& table_of,
                                     const refit::Capture& cap, size_t r) {
  TilesNeeded need;
  for (const refit::CapturedCopy& c : cap.copies) {
    if (c.box.numel() == 0) continue;
    auto ti = table_of.find(c.source);
    if (ti == table_of.end()) {
      return FailedPrecondition(fmt::format("tensor {} (needed by rank {}) is not in version {}", c.source, r,
                                            m.version));
    }
    const refit::ShardTable& t = m.tables[ti->second];
    std::set<std::string> boxes;
    for (size_t si = 0; si < t.shards.size(); ++si) {
      const refit::ShardInfo& s = t.shards[si];
      if (!boxes.insert(refit::BoxToString(s.box())).second) continue;  // a replica: read one
      refit::Box overlap;
      if (!refit::Intersect(c.box, s.box(), &overlap)) continue;
      for (size_t d = 0; d < overlap.ndim(); ++d) overlap.start[d] -= s.offset[d];
      const refit::DeltaTiling g = refit::TilingFor(s.shape);
      for (int64_t tile : refit::TilesTouching(g, s.shape, overlap)) need[{ti->second, si}].insert(tile);
    }
  }
  return need;
}

}  // namespace

Result<DeltaStaged> PullDelta(const DeltaStageInput& in) {
  const refit::Manifest& m = *in.manifest;
  const auto& captures = *in.captures;
  DeltaStaged out;
  for (const refit::ShardTable& t : m.tables) {
    if (!t.shards.empty() && t.shards.front().delta) {
      out.base = t.shards.front().delta->base;
      break;
    }
  }
  out.generation = in.generation;
  out.base_digests = *in.live_digests;
  out.rank_jobs.assign(captures.size(), {0, 0});
  out.first_write.assign(captures.size(), std::nullopt);
  out.bytes_written.assign(captures.size(), 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(in.timeout_ms);
  std::map<std::string, size_t, std::less<>> table_of;
  for (size_t i = 0; i < m.tables.size(); ++i) table_of[m.tables[i].name] = i;

  if (m.tables.size() > UINT16_MAX || captures.size() > UINT8_MAX) {
    return InvalidArgument(fmt::format("delta refit handles up to {} tensors and {} ranks, not {} and {}", UINT16_MAX,
                                       UINT8_MAX, m.tables.size(), captures.size()));
  }
  // The manifest's transport and the descriptors imported through it, for this stage only
  // (released, imports first, when it returns).
  SourceImports links;
  RC_RETURN_IF_ERROR(links.Ensure(m, /*topology=*/0).status());
  transport::Transport* transport = &links.transport();
  auto remote_of = [&](const std::string& handle) { return links.imports().Get(handle); };
  auto read_all = [&](std::vector<transport::ReadOp>& ops) -> Status {
    if (ops.empty()) return OkStatus();
    RC_ASSIGN_OR_RETURN(auto transfer, transport->PostReads(ops));
    const int64_t left_ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - std::chrono::steady_clock::now()).count();
    Status s = transfer->Wait(transport->clock().NowNs() + std::max<int64_t>(left_ns, 1));
    if (!s.ok()) {
      transfer->Cancel();
      return s.WithContext("pulling delta payloads");
    }
    return OkStatus();
  };

  double wire_ms = 0, plan_ms = 0;
  std::vector<DeltaRankReport> rank_reads(captures.size());  // the pull's part of each rank's report
  for (size_t r = 0; r < captures.size(); ++r) {
    const refit::Capture& cap = captures[r];
    RC_ASSIGN_OR_RETURN(TilesNeeded need, DeltaTilesNeeded(m, table_of, cap, r));
    // Round 1: header and tile table of every shard the rank reads.
    auto t0 = std::chrono::steady_clock::now();
    std::vector<std::vector<std::byte>> prefixes(need.size());
    std::vector<transport::ReadOp> ops;
    uint64_t rank_bytes = 0, reads = 0;
    size_t k = 0;
    for (auto& [key, tiles] : need) {
      const refit::ShardInfo& s = m.tables[key.first].shards[key.second];
      const refit::DeltaTiling g = refit::TilingFor(s.shape);
      if (g.table_bytes() > s.delta->bytes) {
        return DataLoss(fmt::format("tensor {} shard of rank {}: delta of {} bytes is shorter than its {}-byte table",
                                    m.tables[key.first].name, s.rank, s.delta->bytes, g.table_bytes()));
      }
      prefixes[k].resize(g.table_bytes());
      RC_ASSIGN_OR_RETURN(transport::RemoteMemory remote, remote_of(s.delta->handle));
      ops.push_back(transport::ReadOp{remote, s.delta->offset, prefixes[k].data(), g.table_bytes()});
      rank_bytes += g.table_bytes();
      ++k;
    }
    reads += ops.size();
    RC_RETURN_IF_ERROR(read_all(ops));
    // Round 2: the tiles, adjacent ones merged into one read, into the rank's DeltaShards.
    const size_t first_shard = out.shards.size();
    std::vector<std::vector<uint64_t>> tile_at(need.size());  // per needed shard: tile -> body offset
    ops.clear();
    k = 0;
    for (auto& [key, tiles] : need) {
      const refit::ShardTable& t = m.tables[key.first];
      const refit::ShardInfo& s = t.shards[key.second];
      auto parsed = refit::ParseDeltaTable(t.dtype, s.shape, prefixes[k], s.delta->bytes);
      if (!parsed.ok()) {
        return parsed.status().WithContext(fmt::format("delta of tensor {} shard of rank {}", t.name, s.rank));
      }
      DeltaShard& sh = out.shards.emplace_back();
      sh.rank = static_cast<uint32_t>(r);
      sh.table = static_cast<uint32_t>(key.first);
      sh.shard = static_cast<uint32_t>(key.second);
      sh.dtype = t.dtype;
      sh.tiling = refit::TilingFor(s.shape);
      sh.entries = std::move(parsed).value();
      uint64_t total = 0;
      for (int64_t tile : tiles) total += sh.entries[static_cast<size_t>(tile)].bytes;
      sh.bodies.resize(total);
      tile_at[k].assign(static_cast<size_t>(sh.tiling.tiles()), UINT64_MAX);
      RC_ASSIGN_OR_RETURN(transport::RemoteMemory remote, remote_of(s.delta->handle));
      uint64_t at = 0;
      for (int64_t tile : tiles) {
        const refit::DeltaTile& e = sh.entries[static_cast<size_t>(tile)];
        tile_at[k][static_cast<size_t>(tile)] = at;
        if (e.bytes == 0) continue;
        transport::ReadOp op{remote, s.delta->offset + e.offset, sh.bodies.data() + at, e.bytes};
        if (!ops.empty() && ops.back().dest == sh.bodies.data() + at - ops.back().length &&
            ops.back().source.id == remote.id && ops.back().source_offset + ops.back().length == op.source_offset) {
          ops.back().length += e.bytes;
        } else {
          ops.push_back(op);
        }
        at += e.bytes;
      }
      rank_bytes += total;
      ++k;
    }
    reads += ops.size();
    RC_RETURN_IF_ERROR(read_all(ops));
    wire_ms += MsSince(t0);

    // Pieces (copy x pulled shard) and their jobs.
    t0 = std::chrono::steady_clock::now();
    RC_RETURN_IF_ERROR(PlanDeltaRank(m, r, cap, (*in.regions)[r], *in.live, first_shard, tile_at, &out));
    plan_ms += MsSince(t0);
    out.bytes_pulled += rank_bytes;
    rank_reads[r].rank = r;
    rank_reads[r].bytes_pulled = rank_bytes;
    rank_reads[r].reads = reads;
    rank_reads[r].shards_read = need.size();
  }
  out.ranks = std::move(rank_reads);
  out.stages_ms["wire"] = wire_ms;
  out.stages_ms["planning"] = plan_ms;
  return out;
}

Result<DeltaStaged> StageDelta(const DeltaStageInput& in) {
  const refit::Manifest& m = *in.manifest;
  const auto& captures = *in.captures;
  RC_ASSIGN_OR_RETURN(DeltaStaged out, PullDelta(in));
  const std::vector<DeltaRankReport> rank_reads = out.ranks;

  // Decode, map, check and digest every job, in parallel.
  auto t0 = std::chrono::steady_clock::now();
  RC_RETURN_IF_ERROR(PredictDelta(m, captures, *in.live, in.threads, &out, in.apply, in.corrupt_first_write));
  const double map_ms = MsSince(t0);
  for (size_t r = 0; r < captures.size(); ++r) {
    out.ranks[r].bytes_pulled = rank_reads[r].bytes_pulled;
    out.ranks[r].reads = rank_reads[r].reads;
    out.ranks[r].shards_read = rank_reads[r].shards_read;
  }

  // The prediction D_new = D_live + sum (new - old), tensor by tensor, against the manifest.
  t0 = std::chrono::steady_clock::now();
  std::string mismatch = refit::FirstDigestMismatch(out.predicted, *in.published);
  out.stages_ms["transform"] = map_ms;
  out.stages_ms["receive_sync"] = MsSince(t0);
  if (!mismatch.empty()) {
    return DataLoss(fmt::format("delta of {} on {} does not lead to the published digests (the live digests updated by "
                                "{} changed elements): {}; refused at stage, nothing live was touched",
                                m.version, out.base, out.changed, mismatch));
  }
  return out;
}

namespace {

// Runs `make(job, scratch)`'s visitor over jobs [begin, end) in parallel; the first failure in
// job order, if any.
template <typename Make>
Status RunJobs(const DeltaStaged& staged, size_t begin, size_t end, int threads, Make&& make) {
  std::vector<Status> status(end - begin);
  ParallelFor(end - begin, threads, [&](size_t i) {
    JobScratch& sc = ThreadScratch();
    status[i] = make(staged.jobs[begin + i], sc);
  });
  for (Status& s : status) {
    if (!s.ok()) return s;
  }
  return OkStatus();
}

}  // namespace

Status ForEachDeltaElement(const DeltaStaged& staged, size_t job,
                           const std::function<void(int64_t dest, uint64_t global, uint64_t bits, bool owned)>& fn) {
  struct Visitor {
    const std::function<void(int64_t, uint64_t, uint64_t, bool)>& fn;
    Status Tile(int64_t, uint32_t, const std::byte*, const uint16_t*) { return OkStatus(); }
    void TileMapped(const uint16_t*, size_t) {}
    void Batch(const JobScratch& sc) {
      for (size_t i = 0; i < sc.n; ++i) fn(sc.dest[i], sc.global[i], sc.bits[i], sc.owned[i] != 0);
    }
  } v{fn};
  JobScratch& sc = ThreadScratch();
  return VisitJob(staged, staged.jobs.at(job), sc, v);
}

Status ApplyDelta(const DeltaStaged& staged, size_t rank, const refit::Capture& capture, const ParameterStore& params,
                  int threads) {
  std::vector<std::byte*> base(capture.params.size(), nullptr);
  for (size_t p = 0; p < capture.params.size(); ++p) {
    const Parameter* live = params.Find(capture.params[p].name);
    if (live == nullptr) return Internal("delta parameter " + capture.params[p].name + " is not an engine parameter");
    base[p] = live->bytes();
  }
  const auto [begin, end] = staged.rank_jobs.at(rank);
  return RunJobs(staged, begin, end, threads, [&](const DeltaJob& job, JobScratch& sc) {
    const DeltaPiece& p = staged.pieces[job.piece];
    InstallVisitor v{p, base[p.param], refit::DTypeSize(p.dest)};
    return VisitJob(staged, job, sc, v);
  });
}

Result<refit::TensorDigests> DigestAfterDelta(const DeltaStaged& staged, const std::vector<refit::Capture>& captures,
                                              const std::vector<refit::DestinationBuffers>& live, int threads) {
  // Live base pointers per rank and parameter, looked up once.
  std::vector<std::vector<const std::byte*>> base(captures.size());
  for (size_t r = 0; r < captures.size(); ++r) {
    for (const refit::TensorSpec& p : captures[r].params) {
      auto it = live[r].find(p.name);
      if (it == live[r].end()) return FailedPrecondition("no live parameter " + p.name);
      base[r].push_back(it->second.data());
    }
  }
  std::vector<uint64_t> sums(staged.jobs.size(), 0);
  std::vector<Status> status(staged.jobs.size());
  ParallelFor(staged.jobs.size(), threads, [&](size_t j) {
    const DeltaPiece& p = staged.pieces[staged.jobs[j].piece];
    JobScratch& sc = ThreadScratch();
    VerifyVisitor v{p, base[p.rank][p.param], refit::DTypeSize(p.dest)};
    status[j] = VisitJob(staged, staged.jobs[j], sc, v);
    sums[j] = v.sum;
  });
  for (const Status& s : status) {
    if (!s.ok()) return s;
  }
  // D_after = predicted - sum(new terms) + sum(terms found in live memory), per tensor.
  std::vector<uint64_t> found(staged.tensors.size(), 0);
  for (size_t j = 0; j < staged.jobs.size(); ++j) found[staged.pieces[staged.jobs[j].piece].tensor] += sums[j];
  refit::TensorDigests out = staged.predicted;
  for (size_t i = 0; i < staged.tensors.size(); ++i) out[staged.tensors[i]] += found[i] - staged.new_terms[i];
  return out;
}

}  // namespace rc::receiver::internal
