// Delta publishing for the Publisher (publisher.h, PublisherOptions::delta; docs/refit.md).
#include <fmt/format.h>

#include <chrono>
#include <algorithm>
#include <cstring>
#include <thread>

#include "rolloutcore/base/log.h"
#include "rolloutcore/base/mutex.h"
#include "rolloutcore/base/parallel.h"
#include "rolloutcore/refit/delta.h"
#include "rolloutcore/trainer/publisher.h"
#include "rolloutcore/transport/shm.h"

namespace rc::trainer {
namespace {

std::string ShardKey(const ShardSource& s) {
  return s.name + "|" + refit::BoxToString(refit::Box{s.offset, s.local_shape});
}

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

Status Publisher::AttachDeltaPayload(std::string_view version, DeltaPayloadSource payload) {
  if (payload.memory_kind == transport::MemoryKind::kHost) {
    return InvalidArgument(fmt::format("delta payload of tensor {}: the shard is in host memory, whose delta the "
                                       "Publisher computes itself (PublisherOptions::delta)",
                                       payload.tensor));
  }
  rc::MutexLock lock(mu_);
  auto it = versions_.find(version);
  if (it == versions_.end()) {
    return NotFound(fmt::format("rank {} has no shards staged for version {} of model {}", rank_, version, model_));
  }
  if (it->second.state != VersionEntry::State::kStaged) {
    return FailedPrecondition(fmt::format("rank {} cannot attach a delta to version {} of model {}: it is already {}",
                                          rank_, version, model_, StateWord(it->second.state)));
  }
  for (StagedShard& s : it->second.shards) {
    if (s.source.name != payload.tensor || s.source.offset != payload.offset) continue;
    const uint64_t table = refit::TilingFor(s.source.local_shape).table_bytes();
    if (payload.data == nullptr || payload.bytes < table || payload.changed < 0) {
      return InvalidArgument(fmt::format("delta payload of tensor {} (rank {}, version {}): {} bytes at {} for a shard "
                                         "whose header and tile table alone take {}",
                                         payload.tensor, rank_, version, payload.bytes, payload.data, table));
    }
    if (s.source.memory_kind == transport::MemoryKind::kHost) {
      return InvalidArgument(fmt::format("delta payload of tensor {}: the shard is in host memory, whose delta the "
                                         "Publisher computes itself (PublisherOptions::delta)",
                                         payload.tensor));
    }
    s.attached_delta = std::move(payload);
    return OkStatus();
  }
  return NotFound(fmt::format("rank {} version {}: no staged shard of tensor {} at offset {}", rank_, version,
                              payload.tensor, refit::ShapeToString(payload.offset)));
}

int Publisher::DeltaThreads() const {
  if (options_.delta_threads > 0) return options_.delta_threads;
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

Status Publisher::AttachDeltas(std::string_view version, std::vector<StagedShard>& shards, PublishReport* report) {
  const int64_t t0 = NowNs();
  bool computed = false;  // an unresolved version resumed: its deltas exist already
  for (const StagedShard& s : shards) computed = computed || s.delta.has_value();
  if (!computed) {
    std::string base;
    std::vector<std::pair<size_t, refit::EncodedDelta>> encoded;
    std::vector<uint64_t> base_digests;
    std::vector<std::pair<size_t, uint64_t>> attached;  // device shards with a caller's payload, base digest
    {
      rc::MutexLock lock(mu_);
      base = previous_version_;
      if (base.empty() || base == version) return OkStatus();
      std::vector<const std::byte*> olds;  // the previous bytes of each host shard in `encoded`
      for (size_t i = 0; i < shards.size(); ++i) {
        const ShardSource& src = shards[i].source;
        auto it = previous_.find(ShardKey(src));
        if (it == previous_.end() || it->second.dtype != src.dtype) continue;
        if (src.memory_kind != transport::MemoryKind::kHost) {
          if (shards[i].attached_delta) attached.emplace_back(i, it->second.digest);
          continue;
        }
        if (it->second.bytes.size() != src.bytes()) continue;
        encoded.emplace_back(i, refit::EncodedDelta{});
        olds.push_back(it->second.bytes.data());
        base_digests.push_back(it->second.digest);
      }
      // Shards in parallel (the copies stay put: mu_ is held until they are encoded).
      ParallelFor(encoded.size(), DeltaThreads(), [&](size_t k) {
        const ShardSource& src = shards[encoded[k].first].source;
        encoded[k].second = refit::EncodeShardDelta(src.dtype, src.local_shape, olds[k], src.data);
      });
    }
    if (encoded.empty() && attached.empty()) return OkStatus();
    // A delta names a base every receiver can prove it holds: a committed version.
    auto info = store_->GetInfo(model_, base);
    if (!info.ok() || info->state != directory::VersionState::kCommitted) {
      RC_LOG_INFO("rank {}: version {} of model {} is published without a delta: its base {} is {}", rank_, version,
                  model_, base,
                  info.ok() ? std::string(directory::VersionStateName(info->state)) : info.status().ToString());
      return OkStatus();
    }
    for (const auto& [i, base_digest] : attached) {
      const DeltaPayloadSource& a = *shards[i].attached_delta;
      auto reg = transport_->RegisterMemory(
          transport::MemoryRegion{const_cast<void*>(a.data), a.bytes, a.memory_kind, a.device});
      if (!reg.ok()) {
        return reg.status().WithContext(fmt::format("rank {} registering the {}-byte delta payload of tensor {} of "
                                                    "version {}",
                                                    rank_, a.bytes, a.tensor, version));
      }
      shards[i].delta_registration_id = reg->id;
      shards[i].delta_keep_alive = a.keep_alive;
      refit::ShardDelta d;
      d.base = base;
      d.base_digest = base_digest;
      d.handle = reg->descriptor;
      d.offset = 0;
      d.bytes = a.bytes;
      d.changed = a.changed;
      shards[i].delta = std::move(d);
    }
    if (encoded.empty()) return FillDeltaReport(shards, report, t0);
    uint64_t total = 0;
    std::vector<uint64_t> at;
    for (auto& [i, e] : encoded) {
      total = (total + 63) / 64 * 64;
      at.push_back(total);
      total += e.bytes.size();
    }
    RC_ASSIGN_OR_RETURN(transport::ShmBuffer buffer, transport::ShmBuffer::Create(std::max<uint64_t>(total, 64)));
    auto region_owner = std::make_shared<transport::ShmBuffer>(std::move(buffer));
    for (size_t k = 0; k < encoded.size(); ++k) {
      std::memcpy(region_owner->data() + at[k], encoded[k].second.bytes.data(), encoded[k].second.bytes.size());
    }
    auto reg = transport_->RegisterMemory(transport::MemoryRegion{region_owner->data(), region_owner->size(),
                                                                   transport::MemoryKind::kHost, -1});
    if (!reg.ok()) {
      return reg.status().WithContext(
          fmt::format("rank {} registering the {}-byte delta region of version {}", rank_, total, version));
    }
    StagedShard& owner = shards[encoded.front().first];
    owner.delta_registration_id = reg->id;
    owner.delta_keep_alive = region_owner;
    for (size_t k = 0; k < encoded.size(); ++k) {
      refit::ShardDelta d;
      d.base = base;
      d.base_digest = base_digests[k];
      d.handle = reg->descriptor;
      d.offset = at[k];
      d.bytes = encoded[k].second.bytes.size();
      d.changed = encoded[k].second.changed;
      shards[encoded[k].first].delta = std::move(d);
    }
  }
  return FillDeltaReport(shards, report, t0);
}

Status Publisher::FillDeltaReport(const std::vector<StagedShard>& shards, PublishReport* report, int64_t t0) {
  for (const StagedShard& s : shards) {
    if (!s.delta) continue;
    for (refit::ShardTable& t : report->tables) {
      if (t.name != s.source.name) continue;
      for (refit::ShardInfo& info : t.shards) {
        if (info.offset == s.source.offset) info.delta = *s.delta;
      }
    }
    report->delta_base = s.delta->base;
    ++report->delta_shards;
    report->delta_changed += s.delta->changed;
    report->delta_bytes += s.delta->bytes;
  }
  report->delta_ns = NowNs() - t0;
  return OkStatus();
}

void Publisher::RememberPublished(std::string_view version, const std::vector<StagedShard>& shards) {
  // Called with mu_ held. The copy is taken after the publish, so it holds the bytes whose digest
  // was published (the memory contract forbids changing them until Release).
  // The copies of the version before are overwritten in place where the same shard comes again: a
  // fresh allocation would fault in every page of the copy at every publish.
  auto before = std::move(previous_);
  previous_.clear();
  std::vector<std::pair<PreviousShard*, const StagedShard*>> copies;
  for (const StagedShard& s : shards) {
    if (s.source.data == nullptr) continue;
    PreviousShard& p = previous_[ShardKey(s.source)];
    p.dtype = s.source.dtype;
    p.digest = s.digest;
    // A device shard's bytes stay where they are: its next delta comes from the caller
    // (AttachDeltaPayload); the digest is the base digest that delta names.
    if (s.source.memory_kind != transport::MemoryKind::kHost) continue;
    if (auto it = before.find(ShardKey(s.source)); it != before.end()) p.bytes = std::move(it->second.bytes);
    copies.emplace_back(&p, &s);
  }
  before.clear();  // what no shard took is freed before the copies
  ParallelFor(copies.size(), DeltaThreads(), [&](size_t k) {
    const auto* b = static_cast<const std::byte*>(copies[k].second->source.data);
    copies[k].first->bytes.assign(b, b + copies[k].second->source.bytes());
  });
  previous_version_ = std::string(version);
}

}  // namespace rc::trainer

namespace rc::trainer {

Result<std::string> Publisher::CorruptDeltaForTesting(std::string_view version, std::string_view kind) {
  if (kind != "value" && kind != "index" && kind != "missing") {
    return InvalidArgument(fmt::format("corrupt delta kind '{}': expected value, index or missing", kind));
  }
  rc::MutexLock lock(mu_);
  auto it = versions_.find(version);
  if (it == versions_.end()) return NotFound(fmt::format("rank {} holds no version {}", rank_, version));
  std::byte* region = nullptr;
  // The host shards' payloads share one ShmBuffer (AttachDeltas); a device shard's payload is the
  // caller's (AttachDeltaPayload) and is not rewritten here.
  for (const StagedShard& s : it->second.shards) {
    if (s.delta_keep_alive && s.source.memory_kind == transport::MemoryKind::kHost) {
      region = static_cast<const transport::ShmBuffer*>(s.delta_keep_alive.get())->data();
    }
  }
  for (const StagedShard& s : it->second.shards) {
    if (!s.delta || s.delta->changed < 2 || region == nullptr || s.source.memory_kind != transport::MemoryKind::kHost) {
      continue;
    }
    const ShardSource& src = s.source;
    const size_t es = refit::DTypeSize(src.dtype);
    std::span<std::byte> payload(region + s.delta->offset, s.delta->bytes);
    RC_ASSIGN_OR_RETURN(auto table, refit::ParseDeltaTable(src.dtype, src.local_shape, payload, payload.size()));
    const refit::DeltaTiling g = refit::TilingFor(src.local_shape);
    std::vector<int64_t> offsets;
    std::vector<std::byte> values;
    for (int64_t t = 0; t < g.tiles(); ++t) {
      const refit::DeltaTile& e = table[static_cast<size_t>(t)];
      RC_RETURN_IF_ERROR(refit::DecodeDeltaTile(g, es, t, e, payload.subspan(e.offset, e.bytes),
                                                [&](int64_t o, const std::byte* v) {
                                                  offsets.push_back(o);
                                                  values.insert(values.end(), v, v + es);
                                                }));
    }
    // Tiles are decoded in tile order; the encoder wants shard order.
    std::vector<size_t> order(offsets.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return offsets[a] < offsets[b]; });
    std::vector<int64_t> o2;
    std::vector<std::byte> v2;
    for (size_t i : order) {
      o2.push_back(offsets[i]);
      v2.insert(v2.end(), values.begin() + static_cast<std::ptrdiff_t>(i * es),
                values.begin() + static_cast<std::ptrdiff_t>((i + 1) * es));
    }
    if (kind == "value") {
      v2[0] ^= std::byte{0x01};
    } else if (kind == "missing") {
      o2.erase(o2.begin());
      v2.erase(v2.begin(), v2.begin() + static_cast<std::ptrdiff_t>(es));
    } else {
      // Move one changed element to the next position, if that one is unchanged.
      bool moved = false;
      for (size_t i = 0; i + 1 < o2.size() && !moved; ++i) {
        if (o2[i] + 1 < o2[i + 1]) {
          ++o2[i];
          moved = true;
        }
      }
      if (!moved) continue;
    }
    RC_ASSIGN_OR_RETURN(refit::EncodedDelta e, refit::EncodeShardDeltaFromChanges(src.dtype, src.local_shape, o2, v2));
    if (e.bytes.size() > payload.size()) continue;
    std::memcpy(payload.data(), e.bytes.data(), e.bytes.size());
    RC_LOG_WARN("fault injection: delta of tensor {} (rank {}, version {}) corrupted: {}", src.name, rank_, version,
                kind);
    return src.name;
  }
  return NotFound(fmt::format("rank {}: version {} has no delta shard to corrupt", rank_, version));
}

}  // namespace rc::trainer
