#include "engine/delta_apply.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <set>

#include "rolloutcore/base/hash.h"
#include "rolloutcore/refit/delta.h"
#include "rolloutcore/transport/registry.h"

namespace rc::engine::internal {
namespace {

double MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

bool Inside(const refit::Box& b, const int64_t* coords) {
  for (size_t d = 0; d < b.ndim(); ++d) {
    if (coords[d] < b.start[d] || coords[d] >= b.start[d] + b.extent[d]) return false;
  }
  return true;
}

// Destination element offset of global coords inside copy c's box.
int64_t DestOffset(const refit::CapturedCopy& c, const int64_t* coords) {
  int64_t d = c.dest_offset;
  for (size_t k = 0; k < c.view_to_source.size(); ++k) {
    const int32_t s = c.view_to_source[k];
    if (s >= 0) d += (coords[s] - c.box.start[static_cast<size_t>(s)]) * c.dest_strides[k];
  }
  return d;
}

bool ContainsBox(const refit::Box& outer, const refit::Box& inner) {
  for (size_t d = 0; d < outer.ndim(); ++d) {
    if (inner.start[d] < outer.start[d] || inner.start[d] + inner.extent[d] > outer.start[d] + outer.extent[d]) {
      return false;
    }
  }
  return true;
}

size_t VarintBytes(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

bool NonFinite(refit::DType dtype, uint64_t bits) {
  switch (dtype) {
    case refit::DType::kBF16: return (bits & 0x7f80u) == 0x7f80u;
    case refit::DType::kF16: return (bits & 0x7c00u) == 0x7c00u;
    case refit::DType::kF32: return (bits & 0x7f800000u) == 0x7f800000u;
    default: return false;
  }
}

// A decoded shard: its changes (shard-local flat offset, new bits in the source dtype).
struct DecodedShard {
  size_t table = 0, shard = 0;
  std::vector<std::pair<int64_t, uint64_t>> changes;
};

}  // namespace

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
                               const refit::TensorDigests* live) {
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
    if (it == live->end()) return fmt::format("tensor {} is not among the live weights", t.name);
    if (it->second != want) {
      return fmt::format("tensor {}: live digest {} is not the base {}'s {}", t.name, Hex64(it->second), base,
                         Hex64(want));
    }
  }
  return "";
}

Result<DeltaStaged> StageDelta(const DeltaStageInput& in) {
  const refit::Manifest& m = *in.manifest;
  const auto& captures = *in.captures;
  DeltaStaged out;
  out.generation = in.generation;
  out.base_digests = *in.live_digests;
  out.writes.resize(captures.size());
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(in.timeout_ms);
  std::map<std::string, size_t, std::less<>> table_of;
  for (size_t i = 0; i < m.tables.size(); ++i) table_of[m.tables[i].name] = i;
  std::map<std::string, uint32_t, std::less<>> tensor_id;

  if (m.tables.size() > UINT16_MAX || captures.size() > UINT8_MAX) {
    return InvalidArgument(fmt::format("delta refit handles up to {} tensors and {} ranks, not {} and {}", UINT16_MAX,
                                       UINT8_MAX, m.tables.size(), captures.size()));
  }
  RC_ASSIGN_OR_RETURN(std::string transport_name, refit::ManifestTransport(m));
  RC_ASSIGN_OR_RETURN(auto transport, transport::CreateTransport(transport_name));
  std::map<std::string, transport::RemoteMemory> remotes;
  struct ReleaseAll {
    transport::Transport* t;
    std::map<std::string, transport::RemoteMemory>* r;
    ~ReleaseAll() {
      for (auto& [h, remote] : *r) (void)t->ReleaseRemote(remote);
    }
  } release_all{transport.get(), &remotes};
  auto remote_of = [&](const std::string& handle) -> Result<transport::RemoteMemory> {
    auto it = remotes.find(handle);
    if (it != remotes.end()) return it->second;
    RC_ASSIGN_OR_RETURN(transport::RemoteMemory r, transport->Import(handle));
    remotes.emplace(handle, r);
    return r;
  };
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

  double wire_ms = 0, decode_ms = 0, map_ms = 0;
  std::vector<uint64_t> gain(m.tables.size(), 0);  // per tensor id: sum of (new term - old term)
  for (size_t r = 0; r < captures.size(); ++r) {
    const refit::Capture& cap = captures[r];
    // Which shards and tiles this rank needs: (table, shard) -> tiles.
    std::map<std::pair<size_t, size_t>, std::set<int64_t>> need;
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
    // Round 1: header and tile table of every shard the rank reads.
    auto t0 = std::chrono::steady_clock::now();
    std::vector<std::vector<std::byte>> prefixes(need.size());
    std::vector<transport::ReadOp> ops;
    uint64_t rank_bytes = 0, rank_reads = 0;
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
    rank_reads += ops.size();
    RC_RETURN_IF_ERROR(read_all(ops));
    // Round 2: the tiles, adjacent ones merged into one read.
    std::vector<std::vector<refit::DeltaTile>> tables(need.size());
    std::vector<std::vector<std::byte>> bodies(need.size());
    std::vector<std::vector<std::pair<int64_t, uint64_t>>> spans(need.size());  // tile -> (body offset, bytes) base
    ops.clear();
    k = 0;
    for (auto& [key, tiles] : need) {
      const refit::ShardTable& t = m.tables[key.first];
      const refit::ShardInfo& s = t.shards[key.second];
      auto parsed = refit::ParseDeltaTable(t.dtype, s.shape, prefixes[k], s.delta->bytes);
      if (!parsed.ok()) {
        return parsed.status().WithContext(fmt::format("delta of tensor {} shard of rank {}", t.name, s.rank));
      }
      tables[k] = std::move(parsed).value();
      uint64_t total = 0;
      for (int64_t tile : tiles) total += tables[k][static_cast<size_t>(tile)].bytes;
      bodies[k].resize(total);
      RC_ASSIGN_OR_RETURN(transport::RemoteMemory remote, remote_of(s.delta->handle));
      uint64_t at = 0;
      for (int64_t tile : tiles) {
        const refit::DeltaTile& e = tables[k][static_cast<size_t>(tile)];
        if (e.bytes == 0) continue;
        transport::ReadOp op{remote, s.delta->offset + e.offset, bodies[k].data() + at, e.bytes};
        if (!ops.empty() && ops.back().dest == bodies[k].data() + at - ops.back().length &&
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
    rank_reads += ops.size();
    RC_RETURN_IF_ERROR(read_all(ops));
    wire_ms += MsSince(t0);

    // Decode.
    t0 = std::chrono::steady_clock::now();
    std::vector<DecodedShard> decoded;
    k = 0;
    for (auto& [key, tiles] : need) {
      const refit::ShardTable& t = m.tables[key.first];
      const refit::ShardInfo& s = t.shards[key.second];
      const refit::DeltaTiling g = refit::TilingFor(s.shape);
      const size_t es = refit::DTypeSize(t.dtype);
      DecodedShard d{key.first, key.second, {}};
      uint64_t at = 0;
      for (int64_t tile : tiles) {
        const refit::DeltaTile& e = tables[k][static_cast<size_t>(tile)];
        Status st = refit::DecodeDeltaTile(g, es, tile, e, std::span<const std::byte>(bodies[k]).subspan(at, e.bytes),
                                           [&](int64_t o, const std::byte* v) {
                                             d.changes.emplace_back(o, refit::ElementBits(t.dtype, v));
                                           });
        if (!st.ok()) return st.WithContext(fmt::format("delta of tensor {} shard of rank {}", t.name, s.rank));
        at += e.bytes;
      }
      for (auto& [o, bits] : d.changes) {
        if (NonFinite(t.dtype, bits)) {
          return InvalidArgument(fmt::format("delta of tensor {}: shard-local element {} of rank {}'s shard is "
                                             "non-finite; non-finite weights are refused (nothing was staged, nothing "
                                             "live was touched)",
                                             t.name, o, s.rank));
        }
      }
      decoded.push_back(std::move(d));
      ++k;
    }
    decode_ms += MsSince(t0);

    // Map through the copies: writes, digest checks, and the region yardstick.
    t0 = std::chrono::steady_clock::now();
    std::map<size_t, std::vector<std::pair<uint32_t, const refit::Box*>>> regions_by_copy;
    for (const refit::DigestRegion& reg : (*in.regions)[r]) regions_by_copy[reg.copy].push_back({reg.copy, &reg.box});
    uint64_t region_bytes = 0;  // yardstick: see the loop
    int64_t region_changed = 0;
    std::vector<int64_t> coords;
    for (uint32_t ci = 0; ci < cap.copies.size(); ++ci) {
      const refit::CapturedCopy& c = cap.copies[ci];
      if (c.box.numel() == 0) continue;
      const refit::TensorSpec& param = cap.params[c.param];
      auto bit = in.live->at(r).find(param.name);
      if (bit == in.live->at(r).end()) {
        return FailedPrecondition(fmt::format("rank {} has no live parameter {}", r, param.name));
      }
      const std::byte* live = bit->second.data();
      const size_t pes = refit::DTypeSize(param.dtype);
      const auto owned = regions_by_copy.find(ci);
      for (const DecodedShard& d : decoded) {
        const refit::ShardTable& t = m.tables[d.table];
        if (t.name != c.source) continue;
        const refit::ShardInfo& s = t.shards[d.shard];
        refit::Box overlap;
        if (!refit::Intersect(c.box, s.box(), &overlap)) continue;
        const bool whole = overlap == s.box();  // every element of the shard lies in the copy's box
        bool own_all = false;  // one owned region holds the whole overlap: no per-element test
        if (owned != regions_by_copy.end()) {
          for (const auto& [copy, box] : owned->second) own_all = own_all || ContainsBox(*box, overlap);
        }
        const refit::Shape local = refit::RowMajorStrides(s.shape);
        const refit::Shape global = refit::RowMajorStrides(t.shape);
        const refit::DeltaTiling g = refit::TilingFor(s.shape);
        const size_t ses = refit::DTypeSize(t.dtype);
        const bool bf16_to_f32 = c.source_dtype == refit::DType::kBF16 && param.dtype == refit::DType::kF32;
        if (pes > 4) return InvalidArgument("delta refit: parameter " + param.name + " has elements over 4 bytes");
        auto tid = tensor_id.emplace(t.name, static_cast<uint32_t>(out.tensors.size()));
        if (tid.second) out.tensors.push_back(t.name);
        const auto tensor = static_cast<uint16_t>(tid.first->second);
        coords.assign(t.shape.size(), 0);
        int64_t prev_tile = -1, prev_k = 0;
        for (const auto& [o, bits] : d.changes) {
          int64_t rest = o;
          uint64_t gi = 0;
          for (size_t dim = 0; dim < t.shape.size(); ++dim) {
            coords[dim] = s.offset[dim] + rest / local[dim];
            rest %= local[dim];
            gi += static_cast<uint64_t>(coords[dim] * global[dim]);
          }
          if (!whole && !Inside(c.box, coords.data())) continue;
          // The yardstick: the tile bodies an encoding of only this region's changes would take.
          {
            const int64_t rr = o / g.cols, cc = o % g.cols;
            const int64_t tr = rr / g.tile_rows, tc = cc / g.tile_cols;
            const int64_t tile = tr * g.tiles_c + tc;
            const int64_t in_tile = (rr - tr * g.tile_rows) * g.TileCols(tile) + (cc - tc * g.tile_cols);
            region_bytes += ses + VarintBytes(static_cast<uint64_t>(tile == prev_tile ? in_tile - prev_k : in_tile));
            ++region_changed;
            prev_tile = tile;
            prev_k = in_tile;
          }
          const int64_t dest = DestOffset(c, coords.data());
          uint64_t dst_bits = 0;
          if (c.source_dtype == param.dtype) {
            dst_bits = bits;
          } else if (bf16_to_f32) {
            dst_bits = bits << 16;  // exact widening
          } else {
            uint64_t src_bits = bits;
            refit::ConvertElements(c.source_dtype, &src_bits, 1, param.dtype, &dst_bits, 1, 1);
          }
          out.writes[r].push_back(DeltaWrite{c.param, static_cast<uint32_t>(dst_bits), dest});
          if (owned == regions_by_copy.end()) continue;
          bool mine = own_all;
          if (!mine) {
            for (const auto& [copy, box] : owned->second) mine = mine || Inside(*box, coords.data());
          }
          // Digest regions are disjoint over copies and ranks: an element is counted once overall.
          if (!mine) continue;
          DeltaCheck chk;
          chk.global = gi;
          chk.old_term = refit::DigestTerm(
              gi, refit::InstalledSourceBits(c.source_dtype, param.dtype, live + static_cast<size_t>(dest) * pes));
          chk.write = static_cast<uint32_t>(out.writes[r].size() - 1);
          chk.tensor = tensor;
          chk.rank = static_cast<uint8_t>(r);
          chk.source = c.source_dtype;
          gain[chk.tensor] += refit::DigestTerm(gi, refit::InstalledSourceBits(c.source_dtype, param.dtype, &dst_bits)) -
                              chk.old_term;
          out.checks.push_back(chk);
        }
      }
    }
    map_ms += MsSince(t0);
    out.bytes_pulled += rank_bytes;
    out.ranks.push_back(Json{{"rank", r},
                             {"bytes_pulled", rank_bytes},
                             {"reads", rank_reads},
                             {"shards_read", need.size()},
                             {"changed_in_region", region_changed},
                             {"region_delta_bytes", region_bytes},
                             {"writes", out.writes[r].size()}});
  }
  out.changed = static_cast<int64_t>(out.checks.size());

  // The prediction: D_new = D_live + sum (new - old), tensor by tensor, against the manifest.
  auto t0 = std::chrono::steady_clock::now();
  out.predicted = out.base_digests;
  for (size_t i = 0; i < out.tensors.size(); ++i) out.predicted[out.tensors[i]] += gain[i];
  std::string mismatch = refit::FirstDigestMismatch(out.predicted, *in.published);
  out.stages_ms["wire"] = wire_ms;
  out.stages_ms["transform"] = decode_ms + map_ms;
  out.stages_ms["receive_sync"] = MsSince(t0);
  if (!mismatch.empty()) {
    return DataLoss(fmt::format("delta of {} on {} does not lead to the published digests (the live digests updated by "
                                "{} changed elements): {}; refused at stage, nothing live was touched",
                                m.version, out.base, out.changed, mismatch));
  }
  return out;
}

Status ApplyDeltaWrites(const std::vector<DeltaWrite>& writes, const refit::Capture& capture,
                        const ParameterStore& params) {
  std::vector<std::byte*> base(capture.params.size(), nullptr);
  for (size_t p = 0; p < capture.params.size(); ++p) {
    const Parameter* live = params.Find(capture.params[p].name);
    if (live == nullptr) return Internal("delta parameter " + capture.params[p].name + " is not an engine parameter");
    base[p] = reinterpret_cast<std::byte*>(live->data());
  }
  for (const DeltaWrite& w : writes) {
    const size_t es = refit::DTypeSize(capture.params[w.param].dtype);
    std::memcpy(base[w.param] + static_cast<size_t>(w.offset) * es, &w.bits, es);
  }
  return OkStatus();
}

Result<refit::TensorDigests> DigestAfterDelta(const DeltaStaged& staged, const std::vector<refit::Capture>& captures,
                                              const std::vector<refit::DestinationBuffers>& live) {
  refit::TensorDigests out = staged.base_digests;
  // Live base pointers per rank and parameter, looked up once.
  std::vector<std::vector<const std::byte*>> base(captures.size());
  for (size_t r = 0; r < captures.size(); ++r) {
    for (const refit::TensorSpec& p : captures[r].params) {
      auto it = live[r].find(p.name);
      if (it == live[r].end()) return FailedPrecondition("no live parameter " + p.name);
      base[r].push_back(it->second.data());
    }
  }
  std::vector<uint64_t> gain(staged.tensors.size(), 0);
  for (const DeltaCheck& chk : staged.checks) {
    const DeltaWrite& w = staged.writes[chk.rank][chk.write];
    const refit::DType dtype = captures[chk.rank].params[w.param].dtype;
    const std::byte* e = base[chk.rank][w.param] + static_cast<size_t>(w.offset) * refit::DTypeSize(dtype);
    gain[chk.tensor] += refit::DigestTerm(chk.global, refit::InstalledSourceBits(chk.source, dtype, e)) - chk.old_term;
  }
  for (size_t i = 0; i < gain.size(); ++i) out[staged.tensors[i]] += gain[i];
  return out;
}

}  // namespace rc::engine::internal
