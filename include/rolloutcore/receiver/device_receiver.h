// DeviceReceiver (module `receiver`, CUDA builds): the refit receiver of weights that live in GPU
// memory owned by someone else — vLLM's parameters, reached through the worker extension
// (python/rolloutcore/vllm.py; rolloutcore._core.DeviceStager is its binding). It runs the same
// pipeline steps as RefitReceiver (src/receiver/pipeline.h: resolve in the directory under the
// stage's deadline → one plan cached by topology → the import cache keyed by the same topology,
// source_imports.h → pull → staged digest checked against the manifest), with device memory:
// the pull lands device to device (cuda_ipc / nccl, no host copy) and every digest runs on the GPU.
// From a host transport (shm, ucx: a trainer publishing from host memory) a full stage lands in host
// mirrors of the staging buffers, copied to the GPU after (stage_ms host_pull, to_device).
//
// The engine's side is a DeviceLiveWeights (live_weights.h: where the staged image goes, the live
// parameters the install writes and the live digest reads), given at creation, and two captures of
// vLLM's own load_weights, set once (SetCaptures):
//   * the staging capture: every recorded copy lands in its own dense staging parameter (device
//     memory the extension allocates once and keeps: DeviceLiveWeights::StagingBuffers), so the
//     planner's coverage proof is exact;
//   * the live capture: the same copies with the real destination (the live vLLM parameter,
//     element offset and strides: DeviceLiveWeights::LiveBuffers), used to digest the live weights
//     in source coordinates and to install.
// The receiver asks the live weights for their buffers at each call (the extension reads the
// tensors' addresses from PyTorch), and keeps a device table (live digest, fused install) only
// while the buffers (names, addresses, sizes) are unchanged. Where the embedded engine's receiver
// installs through LiveWeights::InstallLive (host storage it may exchange), this one installs with
// one fused kernel (DeviceInstall: staging → live copies that digest what they write), prepared
// while vLLM still serves (PrepareInstall) and launched only while it is paused (Install; the
// caller's duty: nothing here can see vLLM's scheduler). Nothing else here writes a live parameter.
//
// Thread safety: none; one DeviceReceiver belongs to one worker thread (vLLM runs collective_rpc
// calls one at a time).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "rolloutcore/base/content_digest.h"
#include "rolloutcore/base/status.h"
#include "rolloutcore/receiver/live_weights.h"
#include "rolloutcore/receiver/refit_choice.h"
#include "rolloutcore/refit/capture.h"
#include "rolloutcore/refit/executor.h"
#include "rolloutcore/refit/manifest.h"

namespace rc::receiver {

namespace internal {
struct ResolvedVersion;  // receiver/pipeline.h
}  // namespace internal

struct DeviceStageRequest {
  std::string directory;  // base URL of the directory
  std::string model;
  std::string version;
  int64_t timeout_ms = 60'000;  // the whole stage: discovery, imports, the pull, the digest
  // Full or delta (refit_choice.h), for a version published with deltas whose base is the version
  // the staging image holds (proven: the last stage of this receiver, into the same buffers).
  DeltaPolicy delta_policy = DeltaPolicy::kAuto;
  // Fault injection for tests (rc_fault stage_pull_delay_ms; 0 in production): holds the pull
  // that long (within the deadline) after the sources were imported and before the reads are
  // posted, so a test can kill the trainer mid-pull.
  int64_t pull_delay_ms = 0;
};

// What a stage did. stage_ms: discover, plan, import, wire, digest, total (and fault_pull_delay
// when injected), milliseconds; a delta stage: discover, wire, planning, table, upload, kernel,
// total.
struct DeviceStageReport {
  std::map<std::string, double> stage_ms;
  std::string mode = "full";  // "full" or "delta"
  // Why the version could not be staged as a delta ("" when it could, or carries none), and the
  // choice between the two when it could.
  std::string delta_ineligible;
  std::optional<DeltaChoice> delta_choice;
  int64_t changed = 0;          // delta: changed elements the tasks decoded
  uint64_t delta_writes = 0;    // delta: staging elements overwritten
  uint64_t bytes_uploaded = 0;  // delta: tables and tile bodies copied to the GPU
  std::string transport;
  uint64_t bytes_needed = 0, bytes_planned = 0, bytes_pulled = 0, descriptors = 0, reads = 0;
  bool plan_cached = false;
  bool digest_table_cached = false;  // full: the staging digest's device table was kept (same buffers)
  ContentDigest staged_digest;    // combined digest of what was staged (the tensors the engine loads)
  ContentDigest manifest_digest;  // the manifest's content digest
  refit::TensorDigests published;  // every tensor of the manifest (the caller reports what it did not load)
};

// Per-tensor digests of device memory, computed by one kernel.
struct DeviceDigestReport {
  refit::TensorDigests tensors;
  ContentDigest content_digest;
  double kernel_ms = 0;   // GPU time of the kernel
  double digest_ms = 0;   // wall time of the call
  bool table_cached = false;  // the uploaded table was kept (same buffers as last time)
  // CompleteExchange without a re-read: the staged image's proven digests, not a kernel's.
  bool staged = false;
};

// PrepareInstall: ok, or why the copies cannot run as one launch (overlapping live elements; the
// caller then copies in order and digests afterwards).
struct DevicePrepareReport {
  bool ok = false;
  std::string reason;
  uint64_t chunks = 0, bytes = 0, elements = 0;
  double prepare_ms = 0;
};

// Install: ok with the digest of every byte the fused kernel wrote, or refused (nothing written)
// with the reason.
struct DeviceInstallReport {
  bool ok = false;
  std::string reason;
  DeviceDigestReport digest;
  uint64_t bytes = 0;
};

class DeviceReceiver {
 public:
  // InvalidArgument when `device` is not one of the visible CUDA devices or `weights` is null.
  // `weights` outlives the receiver.
  [[nodiscard]] static Result<std::unique_ptr<DeviceReceiver>> Create(int device, DeviceLiveWeights* weights);
  ~DeviceReceiver();
  DeviceReceiver(const DeviceReceiver&) = delete;
  DeviceReceiver& operator=(const DeviceReceiver&) = delete;

  // Sets the two captures (see the header comment); proves that the staging capture writes every
  // staging byte exactly once. Drops every cache (plans, imports, device tables).
  [[nodiscard]] Status SetCaptures(refit::Capture staging, refit::Capture live);
  // Pulls `request.version` into the staging buffers and checks the staged bytes against the
  // published per-tensor digests. FailedPrecondition before SetCaptures.
  // A version published with deltas on the version the staging image holds may be staged as a
  // delta (request.delta_policy; docs/refit.md "Delta on the GPU"): only the tiles of the changed
  // elements the staging capture needs are pulled (into host memory), uploaded, and applied to the
  // staging image by one kernel, which also sums the digest terms of every old and new value; the
  // image's per-tensor digests predicted from them must equal the manifest's, as a full stage's
  // digest must. Any failed stage leaves the staging image unproven (the next stage is full).
  [[nodiscard]] Result<DeviceStageReport> Stage(const DeviceStageRequest& request);
  // Per-tensor digests of the live parameters through the live capture.
  [[nodiscard]] Result<DeviceDigestReport> LiveDigest();
  // Builds and uploads the fused install table for the current staging and live buffers (kept
  // while they are unchanged). Never writes a live byte.
  [[nodiscard]] Result<DevicePrepareReport> PrepareInstall();
  // Launches the prepared install (only while the engine is paused); refused, writing nothing,
  // when nothing was prepared for exactly the current buffers.
  [[nodiscard]] Result<DeviceInstallReport> Install();

  // Install by exchange (receiver/exchange.h; docs/vllm.md "Install by exchange"): the caller
  // points every live parameter at the staged storage instead of copying it.
  // PrepareExchange, after a successful stage and while vLLM still serves: `live_after` is where
  // the live parameters will be after the exchange (one slab per live parameter, by the live
  // capture's names). ok only when the staging image holds a version proven by the last stage into
  // the current buffers and making `live_after` the live parameters makes every live copy read
  // exactly the staged bytes (ExchangeLayoutIssue); then the live digest table of those buffers is
  // built and kept. Otherwise ok=false with the reason, and nothing is kept.
  [[nodiscard]] Result<DevicePrepareReport> PrepareExchange(const refit::DestinationBuffers& live_after);
  // After the caller exchanged the storages (inside the pause): FailedPrecondition unless the live
  // buffers are now exactly the prepared `live_after` and no stage ran since. Returns the digest of
  // the live weights: re-read by the kernel (reread), or the digests the stage proved for these very
  // bytes (staged = true). Either way the staging image is unproven afterwards: its buffers are the
  // old live storages, holding the version that was live.
  [[nodiscard]] Result<DeviceDigestReport> CompleteExchange(bool reread);

 private:
  struct State;
  DeviceReceiver(int device, DeviceLiveWeights* weights);
  // The live digest of `live` through the live capture (the table kept for the last two buffer
  // sets: an exchange install alternates two).
  [[nodiscard]] Result<DeviceDigestReport> DigestLive(const refit::DestinationBuffers& live, bool run);
  [[nodiscard]] Result<DeviceStageReport> StageFull(const DeviceStageRequest& request, const internal::ResolvedVersion& resolved,
                                                    const refit::DestinationBuffers& staging, DeviceStageReport report);
  [[nodiscard]] Result<refit::ExecuteStats> PullThroughHost(const refit::TransferPlan& plan,
                                                            const refit::DestinationBuffers& staging, int64_t timeout_ms,
                                                            DeviceStageReport* report);
  [[nodiscard]] Result<DeviceStageReport> StageDeltaOnDevice(const DeviceStageRequest& request, const internal::ResolvedVersion& resolved,
                                                             const refit::DestinationBuffers& staging,
                                                             DeviceStageReport report);
  const int device_;
  DeviceLiveWeights* const weights_;
  std::unique_ptr<State> state_;
};

}  // namespace rc::receiver
