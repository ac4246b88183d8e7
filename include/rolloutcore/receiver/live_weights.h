// The live weights: what a refit receiver needs from whatever serves the weights it stages
// (docs/architecture.md, module `receiver`), three questions — where the staged image goes, how it
// is installed, how the live digest is read — answered in the memory the weights live in:
//
//   |                      | LiveWeights (host memory)            | DeviceLiveWeights (GPU memory)        |
//   |----------------------|--------------------------------------|---------------------------------------|
//   | implemented by       | the embedded engine (engine::Engine) | the vLLM extension's binding           |
//   |                      |                                      | (_core.DeviceStager, src/python)       |
//   | driven by            | RefitReceiver (receiver.h)           | DeviceReceiver (device_receiver.h)     |
//   | staged image goes to | a WeightImage of RefitModelConfig()  | StagingBuffers(): device memory the    |
//   |                      | the receiver allocates               | engine keeps, one buffer per parameter |
//   |                      |                                      | of the staging capture                 |
//   | installed by         | InstallLive (copy or storage         | the receiver's fused copy+digest       |
//   |                      | exchange; the engine checks paused)  | kernel into LiveBuffers(), launched    |
//   |                      |                                      | while paused (the caller's duty)       |
//   | live digest read     | Parameters(rank)                     | LiveBuffers() through the live capture |
//
// Neither receiver links what implements it. LiveWeights follows; DeviceLiveWeights is at the end.
//
// The geometry (RefitModelConfig, RefitWeightDType, tensor_parallel_size, the names, shapes and
// dtype of Parameters(rank)) is fixed for the object's life; only bytes change, and only through
// InstallLive (while paused) or WriteLiveForTesting.
//
// Thread safety: every method may be called from any thread; Parameters() must not race an
// install (the receiver serializes its own reads with its installs).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "rolloutcore/base/status.h"
#include "rolloutcore/receiver/weights.h"
#include "rolloutcore/refit/capture.h"
#include "rolloutcore/refit/model_config.h"
#include "rolloutcore/refit/tensor.h"

namespace rc::receiver {

// One probe a pre-replay runs: the exact request a replay on the live weights is later asked for.
struct ReplayProbeRequest {
  std::vector<int32_t> prompt;
  int64_t steps = 0;
  int64_t top_k = 0;
  // A hint, not part of the request: the continuation the trainer recorded (the probe's expected
  // greedy tokens, `steps` of them; empty when unknown). PreReplay feeds it teacher-forced — every
  // step scored in one forward — and falls back to decoding from the first step where the engine's
  // greedy token differs, so the result is the same either way (docs/engine.md).
  std::vector<int32_t> forced = {};
  // Two requests are the same request when prompt, steps and top_k are (the hint is not compared:
  // Replay is asked without it).
  bool operator==(const ReplayProbeRequest& o) const {
    return prompt == o.prompt && steps == o.steps && top_k == o.top_k;
  }
};

// What a pre-replay did (the stage evidence's "prereplay").
struct PreReplayReport {
  int64_t probes = 0;
  bool ran = false;       // every probe ran to its last step and the results are cached
  std::string why;        // when !ran: the reason (no KV blocks to spare, deadline, bad probe, ...)
  double ms = 0;
  bool batched = false;   // the probes ran as one batch per step
  // Teacher forcing (ReplayProbeRequest::forced): probes whose every step came from the one
  // forced forward, probes that diverged from the hint (decoded on from there), forwards run.
  int64_t forced = 0;
  int64_t diverged = 0;
  int64_t forwards = 0;
};

// How an install writes the live weights: kInPlace writes bytes into them (made writable for the
// write, read-only again after it); kExchange only exchanges storage (ParameterStore::
// ExchangeStorage with buffers the caller made read-only) and writes no live byte.
enum class InstallWrites { kInPlace, kExchange };

// Writes (or exchanges) one rank's live parameters during an install.
using LiveWrite = std::function<Status(int rank, ParameterStore* params)>;

class LiveWeights {
 public:
  virtual ~LiveWeights() = default;

  // Where the staged image goes: the refit geometry of the live weights.
  virtual refit::ModelConfig RefitModelConfig() const = 0;
  // The dtype the live parameters are kept in, as a refit dtype (InvalidArgument if none).
  virtual Result<refit::DType> RefitWeightDType() const = 0;
  virtual int tensor_parallel_size() const = 0;
  // Read access to a rank's live parameters (the live digest is computed from them).
  virtual const ParameterStore& Parameters(int rank) const = 0;

  virtual bool IsPaused() const = 0;
  virtual std::string WeightVersion() const = 0;
  // Installs into the live weights since start; every install moves it to the generation it names.
  virtual int64_t InstallGeneration() const = 0;

  // How the staged image is installed: only while paused (FailedPrecondition otherwise, nothing
  // touched); moves the install generation to `generation` (which must exceed the current one)
  // before `write` runs for every rank, then sets the label `label`. reset_prefix_cache=false is
  // for the stale-cache negative control only.
  virtual Status InstallLive(const LiveWrite& write, const std::string& label, int64_t generation,
                             bool reset_prefix_cache, InstallWrites writes) = 0;
  // Runs `write` on rank `rank`'s live parameters outside an install (test-only faults).
  virtual Status WriteLiveForTesting(int rank, const std::function<Status(ParameterStore*)>& write) = 0;

  // Pre-replay on a staged image (best effort, never fails: the report says whether it ran); the
  // caller keeps `image` alive and unchanged for the call. AdoptPreReplay declares that the image
  // tagged `image_id` became the live weights at install generation `generation`; DropPreReplay
  // forgets the results.
  virtual PreReplayReport PreReplay(const WeightImage& image, uint64_t image_id,
                                    const std::vector<ReplayProbeRequest>& probes,
                                    std::chrono::steady_clock::time_point deadline) = 0;
  virtual bool AdoptPreReplay(uint64_t image_id, int64_t generation) = 0;
  virtual void DropPreReplay() = 0;
};

// The live weights in GPU memory owned by someone else (vLLM's parameters, reached through the
// worker extension; see the table above). Their geometry comes as two captures of the engine's own
// loader (DeviceReceiver::SetCaptures); the memory is asked for at each use, because the engine
// (PyTorch) owns it and may move it: the receiver keeps a device table built from these buffers
// only while they are unchanged (names, addresses, sizes).
//
// Thread safety: called only from the thread that drives the DeviceReceiver.
class DeviceLiveWeights {
 public:
  virtual ~DeviceLiveWeights() = default;
  // Where the staged image goes: one device buffer per parameter of the staging capture, by name.
  virtual Result<refit::DestinationBuffers> StagingBuffers() = 0;
  // The live parameters by the live capture's names: what the live digest reads and the install writes.
  virtual Result<refit::DestinationBuffers> LiveBuffers() = 0;
};

}  // namespace rc::receiver
