#include "rolloutcore/receiver/device_receiver.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include "cuda/gpu_delta.h"
#include "receiver/delta_apply.h"
#include "receiver/device_delta.h"
#include "receiver/exchange.h"
#include "receiver/pipeline.h"
#include "rolloutcore/base/hash.h"
#include "rolloutcore/cuda/gpu_refit.h"
#include "rolloutcore/receiver/source_imports.h"
#include "rolloutcore/refit/digest.h"
#include "rolloutcore/refit/executor.h"
#include "rolloutcore/refit/planner.h"

namespace rc::receiver {
namespace {

double MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// Identity of a set of buffers (names, addresses, sizes): a cached device table stays valid while
// it is unchanged.
uint64_t BuffersKey(const refit::DestinationBuffers& b) {
  Hasher h;
  for (const auto& [name, span] : b) {
    h.Update(name);
    h.UpdateU64(reinterpret_cast<uint64_t>(span.data()));
    h.UpdateU64(span.size());
  }
  return h.Digest();
}

// The live weights' buffers, or why they could not be had (named).
Result<refit::DestinationBuffers> StagingBuffersOf(DeviceLiveWeights& weights) {
  auto b = weights.StagingBuffers();
  if (!b.ok()) return b.status().WithContext("the live weights' staging buffers");
  return b;
}

Result<refit::DestinationBuffers> LiveBuffersOf(DeviceLiveWeights& weights) {
  auto b = weights.LiveBuffers();
  if (!b.ok()) return b.status().WithContext("the live weights' live buffers");
  return b;
}

// Names and sizes only: what host mirrors of the buffers depend on (an exchange install moves the
// staging buffers to other addresses every update; the mirrors stay).
uint64_t SizesKey(const refit::DestinationBuffers& b) {
  Hasher h;
  for (const auto& [name, span] : b) {
    h.Update(name);
    h.UpdateU64(span.size());
  }
  return h.Digest();
}

uint64_t InstallKey(const refit::DestinationBuffers& staging, const refit::DestinationBuffers& live) {
  return BuffersKey(staging) * 31 + BuffersKey(live);
}

// Device digest tables kept while their buffers are unchanged (BuffersKey): the last two buffer
// sets, most recently used last (an exchange install alternates two storages, for the live
// weights and for the staging image alike).
class DigestTables {
 public:
  // The table of `buffers` under `capture` and `regions`, built when not kept; *cached says which.
  Result<cuda::DeviceDigest*> Get(const refit::Capture& capture, const refit::DestinationBuffers& buffers,
                                  std::span<const refit::DigestRegion> regions, int device, bool* cached) {
    const uint64_t key = BuffersKey(buffers);
    auto it = std::find_if(entries_.begin(), entries_.end(), [&](const auto& e) { return e.first == key; });
    *cached = it != entries_.end();
    if (*cached) {
      std::rotate(it, it + 1, entries_.end());
    } else {
      RC_ASSIGN_OR_RETURN(cuda::DeviceDigest digest, cuda::DeviceDigest::ForInstalled(capture, buffers, regions, device));
      if (entries_.size() >= 2) entries_.erase(entries_.begin());
      entries_.emplace_back(key, std::make_unique<cuda::DeviceDigest>(std::move(digest)));
    }
    return entries_.back().second.get();
  }

 private:
  std::vector<std::pair<uint64_t, std::unique_ptr<cuda::DeviceDigest>>> entries_;
};

}  // namespace

struct DeviceReceiver::State {
  refit::Capture staging;
  refit::Capture live;
  std::vector<refit::DigestRegion> staging_regions;
  std::vector<refit::DigestRegion> live_regions;
  // The pipeline's caches (pipeline.h, source_imports.h), keyed by the stage topology.
  internal::RankPlans plans;
  SourceImports sources;
  // Device tables kept while their buffers are unchanged: the live digest's, the staging digest's
  // (a full stage's check) and the fused install's.
  DigestTables live_digests;
  DigestTables staging_digest_tables;
  std::unique_ptr<cuda::DeviceInstall> install;
  uint64_t install_key = 0;
  // What the staging image holds, proven by the last successful stage into the same buffers (a
  // full stage's digest, or a delta's prediction checked against the manifest); unset while a
  // stage runs and after any failed one.
  std::optional<std::string> staging_version;
  refit::TensorDigests staging_digests;
  uint64_t staging_key = 0;
  RefitCostModel costs;  // full vs delta, per transport (refit_choice.h)
  // Host mirrors of the staging buffers for a full stage over a host transport (PullThroughHost),
  // kept while the buffers' names and sizes are.
  std::map<std::string, std::vector<std::byte>> host_staging;
  uint64_t host_staging_key = 0;
  bool mirrors_allocated = false;  // the stage running now allocated them
  // PrepareExchange: the live buffers after the exchange, and the staged proof they will hold.
  std::optional<uint64_t> exchange_key;
  refit::TensorDigests exchange_digests;
};

Result<std::unique_ptr<DeviceReceiver>> DeviceReceiver::Create(int device, DeviceLiveWeights* weights) {
  if (weights == nullptr) return InvalidArgument("DeviceReceiver: no live weights given");
  const int count = cuda::DeviceCount();
  if (device < 0 || device >= count) {
    return InvalidArgument(fmt::format("device {} is not one of the {} visible CUDA devices", device, count));
  }
  return std::unique_ptr<DeviceReceiver>(new DeviceReceiver(device, weights));
}

DeviceReceiver::DeviceReceiver(int device, DeviceLiveWeights* weights)
    : device_(device), weights_(weights), state_(std::make_unique<State>()) {}

DeviceReceiver::~DeviceReceiver() = default;

Status DeviceReceiver::SetCaptures(refit::Capture staging, refit::Capture live) {
  // The staging capture writes every staging byte exactly once, by construction; prove it.
  RC_RETURN_IF_ERROR(refit::CheckDestinationCoverage(staging).WithContext("staging capture"));
  auto s = std::make_unique<State>();
  s->staging = std::move(staging);
  s->live = std::move(live);
  const refit::Capture* live_ranks[] = {&s->live};
  s->live_regions = refit::AssignDigestOwnership(live_ranks)[0];
  const refit::Capture* staging_ranks[] = {&s->staging};
  s->staging_regions = refit::AssignDigestOwnership(staging_ranks)[0];
  state_ = std::move(s);  // every cache of the old captures goes with them
  return OkStatus();
}

Result<DeviceStageReport> DeviceReceiver::Stage(const DeviceStageRequest& req) {
  State& st = *state_;
  if (st.staging.copies.empty()) return FailedPrecondition("DeviceReceiver: set_captures was not called");
  if (req.timeout_ms <= 0) return InvalidArgument(fmt::format("timeout_ms must be positive, got {}", req.timeout_ms));
  RC_ASSIGN_OR_RETURN(const refit::DestinationBuffers staging, StagingBuffersOf(*weights_));
  DeviceStageReport report;
  const auto t_total = std::chrono::steady_clock::now();
  const auto deadline = t_total + std::chrono::milliseconds(req.timeout_ms);
  internal::ResolvedVersion resolved;
  RC_RETURN_IF_ERROR(internal::ResolveInDirectory(req.directory, req.model, req.version, deadline, &resolved));
  report.stage_ms["discover"] = MsSince(t_total);

  // Full or delta: a delta needs the staging image at the delta's base, proven, in these buffers.
  const uint64_t staging_key = BuffersKey(staging);
  if (internal::CarriesDelta(resolved.manifest)) {
    if (!st.staging_version || st.staging_key != staging_key) {
      report.delta_ineligible = "the staging image holds no proven version (no stage yet, a failed one, or new buffers)";
    } else {
      // Tensors the engine does not load (a tied lm_head) have nothing staged to prove.
      report.delta_ineligible = internal::DeltaIneligibility(resolved.manifest, *st.staging_version,
                                                             &st.staging_digests, /*loaded_only=*/true);
    }
    if (report.delta_ineligible.empty()) {
      RC_ASSIGN_OR_RETURN(const std::string transport, refit::ManifestTransport(resolved.manifest));
      report.delta_choice = st.costs.Choose(req.delta_policy, transport, WorkOf(resolved.manifest));
    }
  }
  const bool delta = report.delta_choice && report.delta_choice->delta;
  // The image is about to be written: unproven until this stage succeeds.
  st.staging_version.reset();
  st.exchange_key.reset();
  st.mirrors_allocated = false;
  auto done = delta ? StageDeltaOnDevice(req, resolved, staging, std::move(report))
                    : StageFull(req, resolved, staging, std::move(report));
  if (!done.ok()) return done.status();
  done->stage_ms["total"] = MsSince(t_total);
  const double work_ms = done->stage_ms["total"] - done->stage_ms["discover"];
  if (done->mode == "delta") {
    st.costs.RecordDelta(done->transport, WorkOf(resolved.manifest), work_ms);
  } else if (!st.mirrors_allocated) {
    // A full stage that allocated the host mirrors paid a one-time cost (16 GB of page faults for
    // an 8B model): not what the next full stage costs, so not learned from.
    st.costs.RecordFull(done->transport, WorkOf(resolved.manifest), work_ms);
  }
  st.mirrors_allocated = false;
  st.staging_version = req.version;
  st.staging_key = staging_key;
  return done;
}

Result<DeviceStageReport> DeviceReceiver::StageFull(const DeviceStageRequest& req,
                                                    const internal::ResolvedVersion& resolved,
                                                    const refit::DestinationBuffers& staging, DeviceStageReport report) {
  State& st = *state_;
  const auto t_total = std::chrono::steady_clock::now();
  const auto deadline = t_total + std::chrono::milliseconds(
                                      std::max<int64_t>(1, req.timeout_ms - static_cast<int64_t>(report.stage_ms["discover"])));
  auto t = t_total;
  const uint64_t topology = internal::StageTopology(resolved.manifest, /*receiver_rank=*/0);
  RC_ASSIGN_OR_RETURN(report.plan_cached, st.plans.Ensure(std::span<const refit::Capture>(&st.staging, 1),
                                                          resolved.manifest, topology, /*receiver_rank=*/0));
  transport::TransportOptions topts;
  topts.device = device_;
  // The transport and its imports, under the same key as the plan (kept exactly when it is).
  RC_RETURN_IF_ERROR(st.sources.Ensure(resolved.manifest, topology, topts).status());
  report.stage_ms["plan"] = MsSince(t);

  const refit::TransferPlan& plan = st.plans.plans()[0];
  t = std::chrono::steady_clock::now();
  auto remotes = refit::ImportPlanSources(plan, st.sources.imports());
  if (!remotes.ok()) {
    st.sources.Reset();
    return remotes.status();
  }
  report.stage_ms["import"] = MsSince(t);

  if (req.pull_delay_ms > 0) {
    t = std::chrono::steady_clock::now();
    const int64_t left = internal::MsLeft(deadline);
    std::this_thread::sleep_for(std::chrono::milliseconds(std::max<int64_t>(0, std::min(req.pull_delay_ms, left))));
    report.stage_ms["fault_pull_delay"] = MsSince(t);
  }

  t = std::chrono::steady_clock::now();
  Result<refit::ExecuteStats> stats = refit::ExecuteStats{};
  if (st.sources.transport().capabilities().device_memory) {
    cuda::DeviceExecuteOptions eo;
    eo.device = device_;
    eo.timeout_ms = internal::MsLeft(deadline);
    stats = cuda::ExecutePlanOnDevice(plan, st.sources.transport(), *remotes, staging, eo);
  } else {
    // A host transport (shm, ucx: a trainer publishing from host memory): the plan lands in host
    // mirrors of the staging buffers (kept while the buffers are), then one copy each to the GPU.
    stats = PullThroughHost(plan, staging, internal::MsLeft(deadline), &report);
  }
  if (!stats.ok()) {
    // A failed pull may leave imports to a dead owner: import again next time.
    st.sources.Reset();
    return stats.status().WithContext(fmt::format("pulling {} of {} into GPU staging", req.version, req.model));
  }
  report.stage_ms["wire"] = MsSince(t);

  t = std::chrono::steady_clock::now();
  bool table_cached = false;
  RC_ASSIGN_OR_RETURN(cuda::DeviceDigest* const digest,
                      st.staging_digest_tables.Get(st.staging, staging, st.staging_regions, device_, &table_cached));
  RC_ASSIGN_OR_RETURN(refit::TensorDigests got, digest->Run());
  report.stage_ms["digest"] = MsSince(t);
  report.digest_table_cached = table_cached;
  // The engine loads a subset of the manifest's tensors when it ignores some (e.g. a tied
  // lm_head): compare what it staged; the caller reports what it did not load.
  RC_RETURN_IF_ERROR(internal::CheckStagedDigests(got, resolved.published, req.model, req.version, /*subset=*/true));

  report.transport = st.sources.transport_name();
  report.bytes_needed = plan.stats.bytes_needed;
  report.bytes_planned = plan.stats.bytes_planned;
  report.descriptors = plan.stats.descriptors;
  report.bytes_pulled = stats->bytes_read;
  report.reads = stats->reads;
  report.staged_digest = ContentDigest(refit::CombineTensorDigests(got));
  report.manifest_digest = ContentDigest(resolved.manifest.content_digest);
  report.published = resolved.published;
  st.staging_digests = std::move(got);
  return report;
}

Result<refit::ExecuteStats> DeviceReceiver::PullThroughHost(const refit::TransferPlan& plan,
                                                             const refit::DestinationBuffers& staging,
                                                             int64_t timeout_ms, DeviceStageReport* report) {
  State& st = *state_;
  const uint64_t key = SizesKey(staging);
  if (st.host_staging_key != key) {
    st.mirrors_allocated = true;
    st.host_staging.clear();
    for (const auto& [name, span] : staging) st.host_staging[name].resize(span.size());
    st.host_staging_key = key;
  }
  refit::DestinationBuffers host;
  for (auto& [name, bytes] : st.host_staging) host.emplace(name, std::span<std::byte>(bytes));
  refit::ExecuteOptions eo;
  eo.timeout_ms = timeout_ms;
  eo.imports = &st.sources.imports();
  auto t = std::chrono::steady_clock::now();
  RC_ASSIGN_OR_RETURN(refit::ExecuteStats stats, refit::ExecutePlan(plan, st.sources.transport(), host, eo));
  report->stage_ms["host_pull"] = MsSince(t);
  t = std::chrono::steady_clock::now();
  for (const auto& [name, span] : staging) {
    const std::vector<std::byte>& h = st.host_staging.at(name);
    RC_RETURN_IF_ERROR(cuda::CopyToDevice(span.data(), h.data(), h.size(), device_).WithContext("host mirror " + name));
  }
  report->stage_ms["to_device"] = MsSince(t);
  return stats;
}

Result<DeviceStageReport> DeviceReceiver::StageDeltaOnDevice(const DeviceStageRequest& req,
                                                             const internal::ResolvedVersion& resolved,
                                                             const refit::DestinationBuffers& staging,
                                                             DeviceStageReport report) {
  State& st = *state_;
  report.mode = "delta";
  const std::vector<refit::Capture> captures{st.staging};
  const std::vector<std::vector<refit::DigestRegion>> regions{st.staging_regions};
  const std::vector<refit::DestinationBuffers> images{staging};
  internal::DeltaStageInput in;
  in.manifest = &resolved.manifest;
  in.published = &resolved.published;
  in.captures = &captures;
  in.regions = &regions;
  in.live = &images;
  in.live_digests = &st.staging_digests;
  in.timeout_ms = std::max<int64_t>(1, req.timeout_ms - static_cast<int64_t>(report.stage_ms["discover"]));
  auto t = std::chrono::steady_clock::now();
  auto pulled = internal::PullDelta(in);
  if (!pulled.ok()) {
    return pulled.status().WithContext(fmt::format("pulling the delta of {} of {}", req.version, req.model));
  }
  for (const auto& [k, v] : pulled->stages_ms) report.stage_ms[k] = v;
  if (std::string why = internal::DeviceDeltaIneligibility(*pulled, resolved.manifest, 0, st.staging); !why.empty()) {
    // Nothing was written: the version is staged in full instead (its full shards are published).
    report.mode = "full";
    report.delta_ineligible = "on the device: " + why;
    return StageFull(req, resolved, staging, std::move(report));
  }
  t = std::chrono::steady_clock::now();
  RC_ASSIGN_OR_RETURN(internal::DeviceDeltaTable table,
                      internal::BuildDeviceDeltaTable(*pulled, resolved.manifest, 0, st.staging, staging));
  report.stage_ms["table"] = MsSince(t);
  cuda::DeviceDeltaInput din;
  din.pieces = table.pieces;
  din.owned = table.owned;
  din.tasks = table.tasks;
  din.bodies = table.bodies;  // views of the pulled shard bodies (uploaded, not copied here first)
  din.slots = table.tensors.size();
  RC_ASSIGN_OR_RETURN(cuda::DeviceDeltaOutput out, cuda::RunDeltaOnDevice(device_, din));
  report.stage_ms["upload"] = out.upload_ms;
  report.stage_ms["kernel"] = out.kernel_ms;
  if (out.failed_task) {
    return internal::DeviceDeltaTaskError(table, *pulled, resolved.manifest, *out.failed_task, out.error)
        .WithContext(fmt::format("applying the delta of {} to GPU staging (the staging image is no longer proven)",
                                 req.version));
  }
  internal::DeviceDeltaSums sums;
  sums.old_terms = std::move(out.old_terms);
  sums.new_terms = std::move(out.new_terms);
  refit::TensorDigests predicted = internal::PredictedAfterDeviceDelta(st.staging_digests, table, sums);
  RC_RETURN_IF_ERROR(internal::CheckStagedDigests(predicted, resolved.published, req.model, req.version, /*subset=*/true)
                         .WithContext(fmt::format("the delta of {} on {} (the staging image is no longer proven)",
                                                  req.version, pulled->base)));
  RC_ASSIGN_OR_RETURN(report.transport, refit::ManifestTransport(resolved.manifest));
  // What the plan moved: the tile tables and bodies (the full layout's bytes are not needed).
  report.bytes_pulled = pulled->bytes_pulled;
  report.bytes_needed = report.bytes_planned = pulled->bytes_pulled;
  report.reads = pulled->ranks.empty() ? 0 : pulled->ranks[0].reads;
  report.changed = static_cast<int64_t>(table.changed_in_tasks);
  report.delta_writes = out.writes;
  report.bytes_uploaded = out.uploaded_bytes;
  report.staged_digest = ContentDigest(refit::CombineTensorDigests(predicted));
  report.manifest_digest = ContentDigest(resolved.manifest.content_digest);
  report.published = resolved.published;
  st.staging_digests = std::move(predicted);
  return report;
}

Result<DeviceDigestReport> DeviceReceiver::LiveDigest() {
  State& st = *state_;
  if (st.live.copies.empty()) return FailedPrecondition("DeviceReceiver: set_captures was not called");
  RC_ASSIGN_OR_RETURN(const refit::DestinationBuffers live, LiveBuffersOf(*weights_));
  return DigestLive(live, /*run=*/true);
}

Result<DeviceDigestReport> DeviceReceiver::DigestLive(const refit::DestinationBuffers& live, bool run) {
  State& st = *state_;
  DeviceDigestReport report;
  const auto t0 = std::chrono::steady_clock::now();
  auto digest = st.live_digests.Get(st.live, live, st.live_regions, device_, &report.table_cached);
  if (!digest.ok()) return digest.status().WithContext("live digest");
  if (run) {
    auto tensors = (*digest)->Run(&report.kernel_ms);
    if (!tensors.ok()) return tensors.status().WithContext("live digest");
    report.tensors = std::move(*tensors);
    report.content_digest = ContentDigest(refit::CombineTensorDigests(report.tensors));
  }
  report.digest_ms = MsSince(t0);
  return report;
}

Result<DevicePrepareReport> DeviceReceiver::PrepareExchange(const refit::DestinationBuffers& live_after) {
  State& st = *state_;
  if (st.live.copies.empty()) return FailedPrecondition("DeviceReceiver: set_captures was not called");
  RC_ASSIGN_OR_RETURN(const refit::DestinationBuffers staging, StagingBuffersOf(*weights_));
  DevicePrepareReport report;
  const auto t0 = std::chrono::steady_clock::now();
  st.exchange_key.reset();
  if (!st.staging_version || st.staging_key != BuffersKey(staging)) {
    report.reason = "the staging image holds no version proven by the last stage into these buffers";
    return report;
  }
  report.reason = internal::ExchangeLayoutIssue(st.staging, st.live, staging, live_after);
  if (!report.reason.empty()) return report;
  // The digest table of the live weights as they will be, built now while vLLM serves.
  RC_RETURN_IF_ERROR(DigestLive(live_after, /*run=*/false).status());
  for (const auto& [name, span] : live_after) report.bytes += span.size();
  st.exchange_key = BuffersKey(live_after);
  st.exchange_digests = st.staging_digests;
  report.ok = true;
  report.chunks = live_after.size();
  report.prepare_ms = MsSince(t0);
  return report;
}

Result<DeviceDigestReport> DeviceReceiver::CompleteExchange(bool reread) {
  State& st = *state_;
  if (!st.exchange_key) return FailedPrecondition("complete_exchange: nothing was prepared (prepare_exchange after the stage)");
  RC_ASSIGN_OR_RETURN(const refit::DestinationBuffers live, LiveBuffersOf(*weights_));
  if (BuffersKey(live) != *st.exchange_key) {
    return FailedPrecondition("complete_exchange: the live parameters are not the prepared slabs");
  }
  st.exchange_key.reset();
  // The staging buffers are now the old live storages: unproven.
  st.staging_version.reset();
  if (reread) return DigestLive(live, /*run=*/true);
  DeviceDigestReport report;
  report.staged = true;
  report.table_cached = true;
  report.tensors = std::move(st.exchange_digests);
  st.exchange_digests.clear();
  report.content_digest = ContentDigest(refit::CombineTensorDigests(report.tensors));
  return report;
}

Result<DevicePrepareReport> DeviceReceiver::PrepareInstall() {
  State& st = *state_;
  if (st.live.copies.empty()) return FailedPrecondition("DeviceReceiver: set_captures was not called");
  RC_ASSIGN_OR_RETURN(const refit::DestinationBuffers staging, StagingBuffersOf(*weights_));
  RC_ASSIGN_OR_RETURN(const refit::DestinationBuffers live, LiveBuffersOf(*weights_));
  DevicePrepareReport report;
  const auto t0 = std::chrono::steady_clock::now();
  const uint64_t key = InstallKey(staging, live);
  if (!st.install || key != st.install_key) {
    st.install.reset();
    auto prepared = cuda::DeviceInstall::Prepare(st.live, live, st.staging, staging, st.live_regions, device_);
    if (!prepared.ok()) {
      // Overlapping live elements cannot be written by one launch: the caller copies in order.
      if (prepared.status().code() != StatusCode::kFailedPrecondition) {
        return prepared.status().WithContext("preparing the fused install");
      }
      report.reason = prepared.status().ToString();
      return report;
    }
    st.install = std::make_unique<cuda::DeviceInstall>(std::move(*prepared));
    st.install_key = key;
  }
  report.ok = true;
  report.chunks = st.install->chunks();
  report.bytes = st.install->bytes();
  report.elements = st.install->elements();
  report.prepare_ms = MsSince(t0);
  return report;
}

Result<DeviceInstallReport> DeviceReceiver::Install() {
  State& st = *state_;
  DeviceInstallReport report;
  RC_ASSIGN_OR_RETURN(const refit::DestinationBuffers staging, StagingBuffersOf(*weights_));
  RC_ASSIGN_OR_RETURN(const refit::DestinationBuffers live, LiveBuffersOf(*weights_));
  if (!st.install || InstallKey(staging, live) != st.install_key) {
    report.reason = st.install ? "the buffers changed since prepare_install" : "prepare_install did not succeed";
    return report;
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto tensors = st.install->Run(&report.digest.kernel_ms);
  if (!tensors.ok()) return tensors.status().WithContext("fused install");
  report.ok = true;
  report.digest.tensors = std::move(*tensors);
  report.digest.content_digest = ContentDigest(refit::CombineTensorDigests(report.digest.tensors));
  report.digest.digest_ms = MsSince(t0);
  report.bytes = st.install->bytes();
  return report;
}

}  // namespace rc::receiver
