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

Result<std::byte*> HostPlanMemory::AllocateStaging(uint64_t bytes) {
  if (arena_ != nullptr) return arena_->Reserve(bytes);
  wave_.reset();
  wave_ = std::make_unique_for_overwrite<std::byte[]>(bytes);
  return wave_.get();
}

Status HostPlanMemory::Install(const TransferPlan& plan, size_t begin, size_t end, std::span<std::byte* const> ptr) {
  // Install steps write disjoint destination bytes, so they may run side by side.
  ParallelFor(end - begin, transform_threads_, [&](size_t k) {
    const InstallStep& in = plan.installs[begin + k];
    internal::CopyViewFromBlock(in.source_dtype, ptr[in.staging], in.block, in.box, in.view_to_source,
                                in.param_dtype, ptr[in.param], in.dest_offset, in.dest_strides);
  });
  return OkStatus();
}

Status HostPlanMemory::CopyToHost(void* dst, const std::byte* src, uint64_t n) {
  if (n > 0) std::memcpy(dst, src, n);
  return OkStatus();
}

Result<TensorDigests> HostPlanMemory::Digest(const Capture& capture, const DestinationBuffers& buffers,
                                             std::span<const DigestRegion> regions) {
  return DigestInstalled(capture, buffers, regions);
}

Result<std::vector<transport::RemoteMemory>> ImportPlanSources(const TransferPlan& plan, ImportCache& imports) {
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
  return remote;
}

Result<ExecuteStats> ExecuteWaves(const TransferPlan& plan, transport::Transport& transport,
                                  std::span<const transport::RemoteMemory> remote, const DestinationBuffers& params,
                                  PlanMemory& memory, int64_t deadline, uint64_t max_staging_bytes,
                                  transport::LandingObserver* direct_observer) {
  if (remote.size() != plan.sources.size()) {
    return InvalidArgument(
        fmt::format("imports hold {} sources but the plan has {}", remote.size(), plan.sources.size()));
  }
  ExecuteStats stats;
  Clock& clock = transport.clock();
  const uint64_t align = memory.staging_alignment();

  // Destination pointers: parameters now, staging per wave.
  std::vector<std::byte*> ptr(plan.buffers.size(), nullptr);
  auto need_param = [&](uint32_t b) -> Status {
    if (ptr[b] != nullptr) return OkStatus();
    const PlanBuffer& pb = plan.buffers[b];
    auto it = params.find(pb.name);
    if (it == params.end() || it->second.size() != pb.bytes) {
      return FailedPrecondition(
          fmt::format("destination {}: no {} of {} bytes given", pb.name, memory.buffer_noun(), pb.bytes));
    }
    ptr[b] = it->second.data();
    return OkStatus();
  };
  for (uint64_t i = 0; i < plan.direct_runs; ++i) RC_RETURN_IF_ERROR(need_param(plan.runs[i].buffer));
  for (const InstallStep& s : plan.installs) RC_RETURN_IF_ERROR(need_param(s.param));

  size_t step = 0;
  bool first = true;
  std::vector<uint64_t> offsets;
  while (first || step < plan.installs.size()) {
    // The wave: install steps while their staging fits the budget (at least one).
    const size_t wave_begin = step;
    uint64_t wave_bytes = 0;
    offsets.clear();
    while (step < plan.installs.size()) {
      const uint64_t b = plan.buffers[plan.installs[step].staging].bytes;
      if (step > wave_begin && wave_bytes + b > max_staging_bytes) break;
      offsets.push_back(wave_bytes);
      wave_bytes += (b + align - 1) & ~(align - 1);
      ++step;
    }
    if (step > wave_begin) {
      const int64_t reserve_start = clock.NowNs();
      RC_ASSIGN_OR_RETURN(std::byte * base, memory.AllocateStaging(wave_bytes));
      stats.staging_ns += clock.NowNs() - reserve_start;
      for (size_t s = wave_begin; s < step; ++s) ptr[plan.installs[s].staging] = base + offsets[s - wave_begin];
    }
    const int64_t wire_start = clock.NowNs();
    // Reads of this wave, one batch per source rank.
    std::map<int32_t, std::vector<transport::ReadOp>> batches;
    auto add_runs = [&](uint64_t begin, uint64_t end, transport::LandingObserver* observer) -> Status {
      for (uint64_t i = begin; i < end; ++i) {
        const ReadRun& r = plan.runs[i];
        if (r.dest_offset > plan.buffers[r.buffer].bytes || r.length > plan.buffers[r.buffer].bytes - r.dest_offset) {
          return Internal(fmt::format("plan run {} writes bytes {}..{} of {} ({} bytes)", i, r.dest_offset,
                                      r.dest_offset + r.length, plan.buffers[r.buffer].name,
                                      plan.buffers[r.buffer].bytes));
        }
        batches[plan.sources[r.source].rank].push_back(
            transport::ReadOp{remote[r.source], r.source_offset, ptr[r.buffer] + r.dest_offset, r.length, observer});
        stats.bytes_read += r.length;
        stats.reads++;
      }
      return OkStatus();
    };
    if (first) RC_RETURN_IF_ERROR(add_runs(0, plan.direct_runs, direct_observer));
    for (size_t s = wave_begin; s < step; ++s) {
      RC_RETURN_IF_ERROR(add_runs(plan.installs[s].run_begin, plan.installs[s].run_end, nullptr));
    }
    // Every rank posted before any wait.
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
    RC_RETURN_IF_ERROR(memory.Install(plan, wave_begin, step, ptr));
    for (size_t s = wave_begin; s < step; ++s) ptr[plan.installs[s].staging] = nullptr;
    stats.installs += step - wave_begin;
    stats.transform_ns += clock.NowNs() - transform_start;
    stats.waves++;
    first = false;
  }
  return stats;
}

Result<ExecuteStats> ExecutePlan(const TransferPlan& plan, transport::Transport& transport,
                                 const DestinationBuffers& params, const ExecuteOptions& options) {
  Clock& clock = transport.clock();
  const int64_t deadline = clock.NowNs() + options.timeout_ms * 1'000'000;
  const int64_t import_start = clock.NowNs();
  std::optional<ImportCache> own_imports;
  if (options.imports == nullptr) own_imports.emplace(transport);
  ImportCache& imports = options.imports != nullptr ? *options.imports : *own_imports;
  RC_ASSIGN_OR_RETURN(const std::vector<transport::RemoteMemory> remote, ImportPlanSources(plan, imports));
  const int64_t import_ns = clock.NowNs() - import_start;
  HostPlanMemory memory(options.arena, options.transform_threads);
  RC_ASSIGN_OR_RETURN(ExecuteStats stats,
                      ExecuteWaves(plan, transport, remote, params, memory, deadline, options.max_staging_bytes,
                                   options.landing_observer));
  stats.import_ns = import_ns;
  return stats;
}

}  // namespace rc::refit
