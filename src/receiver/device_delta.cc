#include "receiver/device_delta.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <span>

#include "receiver/nonfinite.h"
#include "rolloutcore/refit/delta.h"

namespace rc::receiver::internal {
namespace {

namespace ci = cuda::internal;

// The device's conversion of a (source, parameter) dtype pair, or kBitsMismatch.
uint8_t ModeOf(refit::DType source, refit::DType dest) {
  using refit::DType;
  if (source == dest) return ci::kBitsRaw;
  if (dest == DType::kF32 && source == DType::kBF16) return ci::kBitsF32FromBf16;
  if (dest == DType::kF32 && source == DType::kF16) return ci::kBitsF32FromF16;
  if (source == DType::kF32 && dest == DType::kBF16) return ci::kBitsBf16FromF32;
  if (source == DType::kF32 && dest == DType::kF16) return ci::kBitsF16FromF32;
  return ci::kBitsMismatch;
}

uint8_t FiniteCheckOf(refit::DType source) {
  switch (source) {
    case refit::DType::kBF16: return 1;
    case refit::DType::kF16: return 2;
    case refit::DType::kF32: return 3;
    default: return 0;
  }
}

void CopyLead(const refit::Shape& from, int64_t* to) {
  for (size_t d = 0; d < from.size(); ++d) to[d] = from[d];
}

}  // namespace

std::string DeviceDeltaIneligibility(const DeltaStaged& staged, const refit::Manifest& manifest, size_t rank,
                                     const refit::Capture& capture) {
  for (const DeltaPiece& p : staged.pieces) {
    if (p.rank != rank) continue;
    const std::string& tensor = manifest.tables[staged.shards[p.shard].table].name;
    if (p.lead_shape.size() > static_cast<size_t>(ci::kDeltaMaxLead)) {
      return fmt::format("tensor {} has {} dims; the device delta handles up to {}", tensor, p.lead_shape.size() + 1,
                         ci::kDeltaMaxLead + 1);
    }
    if (refit::DTypeSize(p.source) > 4) {
      return fmt::format("tensor {} is {}; the device delta handles elements of up to 4 bytes", tensor,
                         refit::DTypeName(p.source));
    }
    if (ModeOf(p.source, p.dest) == ci::kBitsMismatch) {
      return fmt::format("tensor {} ({}) is installed into {} parameter {}; the device delta converts only between "
                         "bf16/f16 and f32",
                         tensor, refit::DTypeName(p.source), refit::DTypeName(p.dest), capture.params[p.param].name);
    }
  }
  return "";
}

Result<DeviceDeltaTable> BuildDeviceDeltaTable(const DeltaStaged& staged, const refit::Manifest& manifest, size_t rank,
                                               const refit::Capture& capture, const refit::DestinationBuffers& image) {
  if (std::string why = DeviceDeltaIneligibility(staged, manifest, rank, capture); !why.empty()) {
    return InvalidArgument("delta on the device: " + why);
  }
  DeviceDeltaTable t;
  t.tensors = staged.tensors;
  // The rank's shard bodies as views at their offsets in the concatenation the device uploads.
  std::vector<uint64_t> shard_base(staged.shards.size(), UINT64_MAX);
  for (size_t s = 0; s < staged.shards.size(); ++s) {
    const DeltaShard& sh = staged.shards[s];
    if (sh.rank != rank) continue;
    shard_base[s] = t.body_bytes;
    if (sh.bodies.empty()) continue;
    t.bodies.emplace_back(sh.bodies);
    t.body_begin.push_back(t.body_bytes);
    t.body_bytes += sh.bodies.size();
  }
  if (staged.rank_jobs.size() <= rank) return t;
  const auto [job_begin, job_end] = staged.rank_jobs[rank];
  uint64_t tiles = 0;
  for (size_t j = job_begin; j < job_end; ++j) tiles += staged.jobs[j].tile_end - staged.jobs[j].tile_begin;
  t.tasks.reserve(tiles);
  t.task_piece.reserve(tiles);
  std::vector<int64_t> piece_index(staged.pieces.size(), -1);
  for (size_t j = job_begin; j < job_end; ++j) {
    const DeltaJob& job = staged.jobs[j];
    const DeltaPiece& p = staged.pieces[job.piece];
    const DeltaShard& sh = staged.shards[p.shard];
    if (piece_index[job.piece] < 0) {
      const refit::TensorSpec& param = capture.params.at(p.param);
      auto it = image.find(param.name);
      if (it == image.end()) {
        return FailedPrecondition(fmt::format("delta on the device: the image has no parameter {}", param.name));
      }
      ci::DeltaPieceDesc d;
      d.image = reinterpret_cast<uint64_t>(it->second.data());
      d.dest0 = p.dest0;
      d.global0 = p.global0;
      d.col_dest = p.col_dest;
      d.nlead = static_cast<uint32_t>(p.lead_shape.size());
      CopyLead(p.lead_shape, d.lead_shape);
      CopyLead(p.lead_dest, d.lead_dest);
      CopyLead(p.lead_global, d.lead_global);
      CopyLead(p.in.lead_lo, d.lead_lo);
      CopyLead(p.in.lead_hi, d.lead_hi);
      d.col_lo = p.in.col_lo;
      d.col_hi = p.in.col_hi;
      d.rows = sh.tiling.rows;
      d.cols = sh.tiling.cols;
      d.tile_rows = sh.tiling.tile_rows;
      d.tile_cols = sh.tiling.tile_cols;
      d.tiles_c = sh.tiling.tiles_c;
      d.tensor = p.tensor;
      d.source_es = static_cast<uint8_t>(refit::DTypeSize(sh.dtype));
      d.dest_es = static_cast<uint8_t>(refit::DTypeSize(p.dest));
      d.mode = ModeOf(p.source, p.dest);
      d.finite = FiniteCheckOf(sh.dtype);
      d.own_all = p.own_all ? 1 : 0;
      d.owned_begin = static_cast<uint32_t>(t.owned.size());
      d.owned_count = p.own_all ? 0 : static_cast<uint32_t>(p.owned.size());
      if (!p.own_all) {
        for (const DeltaLocalBox& b : p.owned) {
          ci::DeltaOwnedBox box;
          CopyLead(b.lead_lo, box.lead_lo);
          CopyLead(b.lead_hi, box.lead_hi);
          box.col_lo = b.col_lo;
          box.col_hi = b.col_hi;
          t.owned.push_back(box);
        }
      }
      piece_index[job.piece] = static_cast<int64_t>(t.pieces.size());
      t.pieces.push_back(d);
    }
    for (uint32_t ti = job.tile_begin; ti < job.tile_end; ++ti) {
      const auto [tile, at] = p.tiles[ti];
      const refit::DeltaTile& e = sh.entries[static_cast<size_t>(tile)];
      if (e.changed == 0) continue;
      ci::DeltaTask task;
      task.body = shard_base[p.shard] + at;
      task.tile = tile;
      task.bytes = e.bytes;
      task.changed = e.changed;
      task.piece = static_cast<uint32_t>(piece_index[job.piece]);
      task.bitmap = e.bitmap ? 1 : 0;
      t.tasks.push_back(task);
      t.task_piece.push_back(job.piece);
      t.changed_in_tasks += e.changed;
    }
  }
  return t;
}

std::span<const std::byte> TaskBody(const DeviceDeltaTable& table, const ci::DeltaTask& task) {
  const auto after = std::upper_bound(table.body_begin.begin(), table.body_begin.end(), task.body);
  if (after == table.body_begin.begin()) return {};
  const size_t view = static_cast<size_t>(after - table.body_begin.begin()) - 1;
  const uint64_t at = task.body - table.body_begin[view];
  const std::span<const std::byte> v = table.bodies[view];
  if (at > v.size() || task.bytes > v.size() - at) return {};
  return v.subspan(at, task.bytes);
}

DeviceDeltaSums EvaluateDeviceDeltaOnHost(const DeviceDeltaTable& table) {
  DeviceDeltaSums s;
  s.old_terms.assign(table.tensors.size(), 0);
  s.new_terms.assign(table.tensors.size(), 0);
  // One buffer, as the device's: the tasks address the concatenation.
  std::vector<unsigned char> all(table.body_bytes);
  for (size_t v = 0; v < table.bodies.size(); ++v) {
    std::memcpy(all.data() + table.body_begin[v], table.bodies[v].data(), table.bodies[v].size());
  }
  const unsigned char* bodies = all.data();
  for (uint64_t i = 0; i < table.tasks.size(); ++i) {
    const ci::DeltaTask& task = table.tasks[i];
    const ci::DeltaPieceDesc& p = table.pieces[task.piece];
    const ci::DeltaTaskResult r = ci::RunDeltaTask(p, task, bodies, table.owned.data());
    if (r.error != ci::kDeltaTaskOk) {
      if (!s.failed_task) {
        s.failed_task = i;
        s.error = r.error;
      }
      continue;
    }
    s.old_terms[p.tensor] += r.old_terms;
    s.new_terms[p.tensor] += r.new_terms;
    s.writes += r.writes;
    s.owned += r.owned;
  }
  return s;
}

Status DeviceDeltaTaskError(const DeviceDeltaTable& table, const DeltaStaged& staged, const refit::Manifest& manifest,
                            uint64_t task, uint32_t error) {
  if (task >= table.tasks.size()) return Internal(fmt::format("device delta: task {} out of range", task));
  const ci::DeltaTask& t = table.tasks[task];
  const DeltaPiece& p = staged.pieces[table.task_piece[task]];
  const DeltaShard& sh = staged.shards[p.shard];
  const refit::ShardTable& tab = manifest.tables[sh.table];
  const refit::ShardInfo& info = tab.shards[sh.shard];
  const refit::DeltaTile& entry = sh.entries[static_cast<size_t>(t.tile)];
  const size_t es = refit::DTypeSize(sh.dtype);
  const std::span<const std::byte> body = TaskBody(table, t);
  if (body.size() != t.bytes) {
    return Internal(fmt::format("device delta: task {} names body bytes [{}, {}) outside the pulled bodies", task,
                                t.body, t.body + t.bytes));
  }
  std::vector<uint16_t> offsets(static_cast<size_t>(refit::kDeltaTargetTileElements));
  auto decoded = refit::DecodeDeltaTileOffsets(sh.tiling, es, t.tile, entry, body, offsets.data());
  if (!decoded.ok()) {
    return decoded.status().WithContext(fmt::format("delta of tensor {} shard of rank {}", tab.name, info.rank));
  }
  if (error == ci::kDeltaTaskNonFinite) {
    for (uint32_t i = 0; i < entry.changed; ++i) {
      uint64_t bits = 0;
      std::memcpy(&bits, *decoded + i * es, es);
      if (!IsNonFiniteBits(sh.dtype, bits)) continue;
      return InvalidArgument(fmt::format("delta of tensor {}: shard-local element {} of rank {}'s shard is "
                                         "non-finite; non-finite weights are refused (nothing was installed, the "
                                         "staging image is discarded)",
                                         tab.name, sh.tiling.LocalOffset(t.tile, offsets[i]), info.rank));
    }
  }
  return DataLoss(fmt::format("delta of tensor {} shard of rank {}: tile {} failed on the device (code {}) but "
                              "decodes on the host",
                              tab.name, info.rank, t.tile, error));
}

refit::TensorDigests PredictedAfterDeviceDelta(const refit::TensorDigests& base, const DeviceDeltaTable& table,
                                               const DeviceDeltaSums& sums) {
  refit::TensorDigests out = base;
  for (size_t i = 0; i < table.tensors.size(); ++i) out[table.tensors[i]] += sums.new_terms[i] - sums.old_terms[i];
  return out;
}

}  // namespace rc::receiver::internal
