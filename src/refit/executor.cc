#include "rolloutcore/refit/executor.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "refit/geometry.h"
#include "rolloutcore/base/parallel.h"

namespace rc::refit {
namespace {

void CancelAll(std::vector<std::pair<int32_t, std::unique_ptr<transport::Transfer>>>& transfers,
               int64_t deadline_ns) {
  for (auto& [rank, t] : transfers) {
    if (t->Poll() == transport::TransferState::kPending) t->Cancel();
  }
  for (auto& [rank, t] : transfers) (void)t->Wait(deadline_ns);
}

}  // namespace

Result<transport::RemoteMemory> ImportCache::Get(const std::string& handle) {
  auto it = by_handle_.find(handle);
  if (it != by_handle_.end()) return it->second;
  RC_ASSIGN_OR_RETURN(transport::RemoteMemory r, t_.Import(handle));
  by_handle_.emplace(handle, r);
  return r;
}

void ImportCache::Release() {
  for (auto& [handle, remote] : by_handle_) (void)t_.ReleaseRemote(remote);
  by_handle_.clear();
}

std::byte* StagingArena::Reserve(uint64_t bytes) {
  if (bytes > capacity_) {
    data_.reset();
    data_ = std::make_unique_for_overwrite<std::byte[]>(bytes);
    // Fault the pages in now, once, rather than inside the first reads.
    std::memset(data_.get(), 0, bytes);
    capacity_ = bytes;
  }
  return data_.get();
}

Result<ExecuteStats> ExecutePlan(const TransferPlan& plan, transport::Transport& transport,
                                 const DestinationBuffers& params, const ExecuteOptions& options) {
  ExecuteStats stats;
  Clock& clock = transport.clock();
  const int64_t deadline = clock.NowNs() + options.timeout_ms * 1'000'000;

  const int64_t import_start = clock.NowNs();
  std::optional<ImportCache> own_imports;
  if (options.imports == nullptr) own_imports.emplace(transport);
  ImportCache& imports = options.imports != nullptr ? *options.imports : *own_imports;
  std::vector<transport::RemoteMemory> remote(plan.sources.size());
  for (size_t i = 0; i < plan.sources.size(); ++i) {
    const PlanSource& s = plan.sources[i];
    const std::string& tensor = s.tensor < plan.tensors.size() ? plan.tensors[s.tensor] : std::string();
    if (s.handle.empty()) {
      return FailedPrecondition(
          fmt::format("tensor {}: shard {} of rank {} has no memory handle", tensor, s.shard, s.rank));
    }
    auto r = imports.Get(s.handle);
    if (!r.ok()) return r.status().WithContext(fmt::format("tensor {}: shard of rank {}", tensor, s.rank));
    if (r->length < s.bytes) {
      return FailedPrecondition(fmt::format("tensor {}: shard of rank {} registered {} bytes but holds {}", tensor,
                                            s.rank, r->length, s.bytes));
    }
    remote[i] = *r;
  }
  stats.import_ns = clock.NowNs() - import_start;

  // Destination pointers: parameters now, staging per wave.
  std::vector<std::byte*> ptr(plan.buffers.size(), nullptr);
  auto need_param = [&](uint32_t b) -> Status {
    if (ptr[b] != nullptr) return OkStatus();
    const PlanBuffer& pb = plan.buffers[b];
    auto it = params.find(pb.name);
    if (it == params.end() || it->second.size() != pb.bytes) {
      return FailedPrecondition(fmt::format("destination {}: no buffer of {} bytes given", pb.name, pb.bytes));
    }
    ptr[b] = it->second.data();
    return OkStatus();
  };
  for (uint64_t i = 0; i < plan.direct_runs; ++i) RC_RETURN_IF_ERROR(need_param(plan.runs[i].buffer));
  for (const InstallStep& s : plan.installs) RC_RETURN_IF_ERROR(need_param(s.param));

  size_t step = 0;
  bool first = true;
  while (first || step < plan.installs.size()) {
    const size_t wave_begin = step;
    uint64_t wave_bytes = 0;
    while (step < plan.installs.size()) {
      const uint64_t b = plan.buffers[plan.installs[step].staging].bytes;
      if (step > wave_begin && wave_bytes + b > options.max_staging_bytes) break;
      wave_bytes += b;
      ++step;
    }
    std::vector<std::unique_ptr<std::byte[]>> staging;
    if (options.arena != nullptr && step > wave_begin) {
      // Carve the wave's staging buffers out of the arena, 64-byte aligned.
      std::vector<uint64_t> offsets;
      uint64_t total = 0;
      for (size_t s = wave_begin; s < step; ++s) {
        offsets.push_back(total);
        total += (plan.buffers[plan.installs[s].staging].bytes + 63) & ~uint64_t{63};
      }
      const int64_t reserve_start = clock.NowNs();
      std::byte* base = options.arena->Reserve(total);
      stats.staging_ns += clock.NowNs() - reserve_start;
      for (size_t s = wave_begin; s < step; ++s) ptr[plan.installs[s].staging] = base + offsets[s - wave_begin];
    } else {
      for (size_t s = wave_begin; s < step; ++s) {
        const uint32_t b = plan.installs[s].staging;
        staging.push_back(std::make_unique_for_overwrite<std::byte[]>(plan.buffers[b].bytes));
        ptr[b] = staging.back().get();
      }
    }
    const int64_t wire_start = clock.NowNs();
    // Reads of this wave, one batch per source rank.
    std::map<int32_t, std::vector<transport::ReadOp>> batches;
    auto add_runs = [&](uint64_t begin, uint64_t end) -> Status {
      for (uint64_t i = begin; i < end; ++i) {
        const ReadRun& r = plan.runs[i];
        if (r.dest_offset > plan.buffers[r.buffer].bytes || r.length > plan.buffers[r.buffer].bytes - r.dest_offset) {
          return Internal(fmt::format("plan run {} writes bytes {}..{} of {} ({} bytes)", i, r.dest_offset,
                                      r.dest_offset + r.length, plan.buffers[r.buffer].name,
                                      plan.buffers[r.buffer].bytes));
        }
        batches[plan.sources[r.source].rank].push_back(
            transport::ReadOp{remote[r.source], r.source_offset, ptr[r.buffer] + r.dest_offset, r.length});
        stats.bytes_read += r.length;
        stats.reads++;
      }
      return OkStatus();
    };
    if (first) RC_RETURN_IF_ERROR(add_runs(0, plan.direct_runs));
    for (size_t s = wave_begin; s < step; ++s) {
      RC_RETURN_IF_ERROR(add_runs(plan.installs[s].run_begin, plan.installs[s].run_end));
    }
    std::vector<std::pair<int32_t, std::unique_ptr<transport::Transfer>>> transfers;
    for (auto& [rank, ops] : batches) {
      auto t = transport.PostReads(ops);
      if (!t.ok()) {
        CancelAll(transfers, deadline);
        return t.status().WithContext(fmt::format("posting reads from rank {}", rank));
      }
      transfers.emplace_back(rank, std::move(t).value());
      stats.batches++;
    }
    for (size_t i = 0; i < transfers.size(); ++i) {
      Status s = transfers[i].second->Wait(deadline);
      if (!s.ok()) {
        CancelAll(transfers, deadline);
        return s.WithContext(fmt::format("reads from rank {}", transfers[i].first));
      }
    }
    const int64_t transform_start = clock.NowNs();
    stats.wire_ns += transform_start - wire_start;
    // Install steps write disjoint destination bytes, so they may run side by side.
    auto run_step = [&](size_t s) {
      const InstallStep& in = plan.installs[s];
      internal::CopyViewFromBlock(in.source_dtype, ptr[in.staging], in.block, in.box, in.view_to_source,
                                  in.param_dtype, ptr[in.param], in.dest_offset, in.dest_strides);
    };
    const size_t wave_steps = step - wave_begin;
    ParallelFor(wave_steps, options.transform_threads, [&](size_t k) { run_step(wave_begin + k); });
    for (size_t s = wave_begin; s < step; ++s) ptr[plan.installs[s].staging] = nullptr;
    stats.installs += wave_steps;
    stats.transform_ns += clock.NowNs() - transform_start;
    stats.waves++;
    first = false;
  }
  return stats;
}

}  // namespace rc::refit
