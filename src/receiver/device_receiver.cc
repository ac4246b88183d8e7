#include "rolloutcore/receiver/device_receiver.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <utility>
#include <vector>

#include "receiver/pipeline.h"
#include "rolloutcore/base/hash.h"
#include "rolloutcore/cuda/gpu_refit.h"
#include "rolloutcore/receiver/source_imports.h"
#include "rolloutcore/refit/digest.h"
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

uint64_t InstallKey(const refit::DestinationBuffers& staging, const refit::DestinationBuffers& live) {
  return BuffersKey(staging) * 31 + BuffersKey(live);
}

}  // namespace

struct DeviceReceiver::State {
  refit::Capture staging;
  refit::Capture live;
  std::vector<refit::DigestRegion> staging_regions;
  std::vector<refit::DigestRegion> live_regions;
  // The pipeline's caches (pipeline.h, source_imports.h), keyed by the stage topology.
  internal::RankPlans plans;
  SourceImports sources;
  // Device tables kept while their buffers are unchanged.
  std::unique_ptr<cuda::DeviceDigest> live_digest;
  uint64_t live_digest_key = 0;
  std::unique_ptr<cuda::DeviceInstall> install;
  uint64_t install_key = 0;
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
  auto t = t_total;
  internal::ResolvedVersion resolved;
  RC_RETURN_IF_ERROR(internal::ResolveInDirectory(req.directory, req.model, req.version, deadline, &resolved));
  report.stage_ms["discover"] = MsSince(t);

  t = std::chrono::steady_clock::now();
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
    const int64_t left = req.timeout_ms - static_cast<int64_t>(MsSince(t_total));
    std::this_thread::sleep_for(std::chrono::milliseconds(std::max<int64_t>(0, std::min(req.pull_delay_ms, left))));
    report.stage_ms["fault_pull_delay"] = MsSince(t);
  }

  t = std::chrono::steady_clock::now();
  cuda::DeviceExecuteOptions eo;
  eo.device = device_;
  eo.timeout_ms = internal::MsLeft(deadline);
  auto stats = cuda::ExecutePlanOnDevice(plan, st.sources.transport(), *remotes, staging, eo);
  if (!stats.ok()) {
    // A failed pull may leave imports to a dead owner: import again next time.
    st.sources.Reset();
    return stats.status().WithContext(fmt::format("pulling {} of {} into GPU staging", req.version, req.model));
  }
  report.stage_ms["wire"] = MsSince(t);

  t = std::chrono::steady_clock::now();
  RC_ASSIGN_OR_RETURN(cuda::DeviceDigest digest,
                      cuda::DeviceDigest::ForInstalled(st.staging, staging, st.staging_regions, device_));
  RC_ASSIGN_OR_RETURN(refit::TensorDigests got, digest.Run());
  report.stage_ms["digest"] = MsSince(t);
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
  report.published = std::move(resolved.published);
  report.stage_ms["total"] = MsSince(t_total);
  return report;
}

Result<DeviceDigestReport> DeviceReceiver::LiveDigest() {
  State& st = *state_;
  if (st.live.copies.empty()) return FailedPrecondition("DeviceReceiver: set_captures was not called");
  RC_ASSIGN_OR_RETURN(const refit::DestinationBuffers live, LiveBuffersOf(*weights_));
  DeviceDigestReport report;
  const auto t0 = std::chrono::steady_clock::now();
  const uint64_t key = BuffersKey(live);
  report.table_cached = st.live_digest && key == st.live_digest_key;
  if (!report.table_cached) {
    st.live_digest.reset();
    auto digest = cuda::DeviceDigest::ForInstalled(st.live, live, st.live_regions, device_);
    if (!digest.ok()) return digest.status().WithContext("live digest");
    st.live_digest = std::make_unique<cuda::DeviceDigest>(std::move(*digest));
    st.live_digest_key = key;
  }
  auto tensors = st.live_digest->Run(&report.kernel_ms);
  if (!tensors.ok()) return tensors.status().WithContext("live digest");
  report.tensors = std::move(*tensors);
  report.content_digest = ContentDigest(refit::CombineTensorDigests(report.tensors));
  report.digest_ms = MsSince(t0);
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
