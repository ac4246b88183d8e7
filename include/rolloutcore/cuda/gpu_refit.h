// The GPU half of refit (built only with ROLLOUTCORE_WITH_CUDA): device memory, the content digest
// computed by a CUDA kernel, batched device copies (the install of staged parameters), dtype
// conversion, and a plan executor whose destinations and staging live on a GPU.
//
// Content digest on the GPU. DeviceDigest computes exactly rc::refit::DigestBlock /
// DigestInstalled (digest.h): per element DigestTerm(global index, source bits) (rc-digest-2),
// summed mod 2^64 per tensor, where the bits are the element's bits in the *source* dtype (installed f32 elements
// converted from bf16/f16 are mapped back, anything that does not round-trip is poisoned, exactly
// as the CPU does). The host cuts the walk into chunks once (a segment table: address, global
// index, strides, count, output slot; contiguous dims merged, rows cut at 128 KiB) and uploads it;
// Run() is then one kernel launch over all tensors: one block per chunk, 16-byte coalesced loads
// and one block key per 64 elements when the chunk is contiguous and aligned (src/cuda/digest_chunk.h),
// a block reduction, one 64-bit atomicAdd per block into the
// tensor's slot (integer addition mod 2^64 is associative, so the result is exact and does not
// depend on scheduling).
//
// ExecutePlanOnDevice is ExecutePlan (executor.h) for device destinations: the same wave loop
// (refit::ExecuteWaves) over device memory: parameters are device buffers of `device`, staging is
// device memory allocated per wave, install steps replay the view with a CUDA kernel (converting
// dtypes), direct runs land in the parameters. The transport must
// report device_memory in its capabilities (cuda_ipc, nccl).
//
// Thread safety: DeviceBuffer and DeviceDigest objects belong to one thread at a time; the free
// functions may be called from any thread. Every function switches to the given device for its
// duration and restores the caller's current device.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "rolloutcore/base/status.h"
#include "rolloutcore/refit/capture.h"
#include "rolloutcore/refit/digest.h"
#include "rolloutcore/refit/executor.h"
#include "rolloutcore/refit/layouts.h"
#include "rolloutcore/refit/manifest.h"
#include "rolloutcore/refit/model_config.h"
#include "rolloutcore/refit/planner.h"
#include "rolloutcore/transport/transport.h"

namespace rc::cuda {
namespace internal {
struct DigestTable;
struct FusedInstallTable;
}

// CUDA devices visible to this process; 0 when there is no driver or no device (never fails).
int DeviceCount();
// "NVIDIA H200 (sm_90, 139.8 GiB)" or the CUDA error.
std::string DeviceDescription(int device);
// Whether device `a` can read device `b`'s memory directly (NVLink / PCIe peer access).
bool CanAccessPeer(int a, int b);

// An owning cudaMalloc allocation on one device.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // Unavailable naming the device, the size and the CUDA error when the allocation fails.
  [[nodiscard]] static Result<DeviceBuffer> Allocate(int device, uint64_t bytes);
  std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }
  int device() const { return device_; }

 private:
  std::byte* data_ = nullptr;
  uint64_t size_ = 0;
  int device_ = -1;
};

// Synchronous copies between host and device memory of `device`, and a memset.
[[nodiscard]] Status CopyToHost(void* host_dst, const void* device_src, uint64_t bytes, int device);
[[nodiscard]] Status CopyToDevice(void* device_dst, const void* host_src, uint64_t bytes, int device);
[[nodiscard]] Status FillBytes(void* device_dst, uint8_t value, uint64_t bytes, int device);

struct DeviceCopy {
  const void* src = nullptr;
  void* dst = nullptr;
  uint64_t bytes = 0;
};
// Device-to-device copies of `device` in one kernel launch (cut into 1 MiB blocks); returns the
// GPU time of the launch in milliseconds (CUDA events) after it completed.
[[nodiscard]] Result<double> CopyOnDevice(std::span<const DeviceCopy> copies, int device);
// One cudaMemcpyAsync of `bytes` (the baseline the install is compared with); GPU milliseconds.
[[nodiscard]] Result<double> TimedMemcpy(void* dst, int dst_device, const void* src, int src_device, uint64_t bytes);

// n contiguous elements from `from` to `to` (identical, or bf16/f16 <-> f32 as tensor.h declares).
[[nodiscard]] Status ConvertOnDevice(refit::DType from, const void* src, refit::DType to, void* dst, int64_t n,
                                     int device);

// Fills `box` of a tensor of global shape `tensor_shape` (dense row-major box contents at `dst`)
// with SeededElementBits(dtype, key, global index) (seeded.h).
[[nodiscard]] Status FillSeeded(int device, void* dst, refit::DType dtype, uint64_t key,
                                const refit::Shape& tensor_shape, const refit::Box& box);

// A dense row-major box of a tensor held on the device (a trainer shard).
struct DeviceBlock {
  std::string tensor;
  refit::DType dtype = refit::DType::kBF16;
  refit::Shape tensor_shape;
  refit::Box box;
  const void* data = nullptr;
};

class DeviceDigest {
 public:
  // Per block DigestBlock(dtype, tensor_shape, box, data): one output slot per block.
  [[nodiscard]] static Result<DeviceDigest> ForBlocks(std::span<const DeviceBlock> blocks, int device);
  // DigestInstalled(capture, device_buffers, regions): one output slot per source tensor. Same
  // errors as the CPU function.
  [[nodiscard]] static Result<DeviceDigest> ForInstalled(const refit::Capture& capture,
                                                        const refit::DestinationBuffers& device_buffers,
                                                        std::span<const refit::DigestRegion> regions, int device);

  // Runs the kernel (synchronously); per-slot sums, and the kernel's GPU time when asked.
  [[nodiscard]] Result<std::vector<uint64_t>> RunSlots(double* kernel_ms = nullptr);
  // Per-tensor digests (slots of the same tensor added).
  [[nodiscard]] Result<refit::TensorDigests> Run(double* kernel_ms = nullptr);

  uint64_t chunks() const { return chunk_count_; }
  uint64_t elements() const { return elements_; }
  const std::vector<std::string>& slot_tensors() const { return slot_tensors_; }

 private:
  [[nodiscard]] static Result<DeviceDigest> Upload(internal::DigestTable table, int device);
  int device_ = -1;
  DeviceBuffer chunks_;
  DeviceBuffer sums_;
  uint64_t chunk_count_ = 0;
  uint64_t elements_ = 0;
  std::vector<std::string> slot_tensors_;
};

// The install of staged parameters in one pass: every staging copy is copied into its live
// destination (strided, in place) by one kernel launch, which digests the values it writes
// (source coordinates, the live capture's ownership) from the same registers, so the live digest
// costs no second pass over memory. Prepare() builds and uploads the run table once (addresses
// stable while the buffers are); Run() only launches. What Run's digest proves: the bytes the
// kernel wrote, mapped through the live capture, equal the digests it returns; it does not re-read
// live memory (DeviceDigest::ForInstalled does, for a fresh check). Prepare fails with
// FailedPrecondition when copies overlap in a live parameter (their order would matter).
class DeviceInstall {
 public:
  [[nodiscard]] static Result<DeviceInstall> Prepare(const refit::Capture& live,
                                                     const refit::DestinationBuffers& live_buffers,
                                                     const refit::Capture& staging,
                                                     const refit::DestinationBuffers& staging_buffers,
                                                     std::span<const refit::DigestRegion> regions, int device);
  // Launches the copies (+ digest), waits; per-tensor digests and the GPU time of the launch.
  [[nodiscard]] Result<refit::TensorDigests> Run(double* kernel_ms = nullptr);
  uint64_t chunks() const { return chunk_count_; }
  uint64_t bytes() const { return bytes_; }
  uint64_t elements() const { return elements_; }

 private:
  int device_ = -1;
  DeviceBuffer chunks_;
  DeviceBuffer digest_chunks_;
  DeviceBuffer sums_;
  uint64_t chunk_count_ = 0;
  uint64_t digest_chunk_count_ = 0;
  uint64_t bytes_ = 0;
  uint64_t elements_ = 0;
  std::vector<std::string> slot_tensors_;
};

// GPU milliseconds of a plain read of `bytes` at `src` (device memory of `device`, 16-byte
// aligned, bytes a multiple of 16) by a streaming kernel with 16-byte loads: the device's read
// bandwidth over those bytes, the reference of the digest's GB/s.
[[nodiscard]] Result<double> TimedReadSweep(const void* src, uint64_t bytes, int device);

struct DeviceExecuteOptions {
  int device = 0;  // where the parameters live and staging is allocated
  int64_t timeout_ms = 60'000;
  uint64_t max_staging_bytes = uint64_t{4} << 30;  // per wave; one larger step runs alone
};

// The plan's sources imported once (each distinct descriptor once), released on destruction, so
// repeated executions of one plan (cached plans, benchmarks) do not pay for imports (opening IPC
// handles, building NCCL communicators) every time. The transport must outlive it.
class PlanImports {
 public:
  [[nodiscard]] static Result<std::unique_ptr<PlanImports>> Import(const refit::TransferPlan& plan,
                                                                   transport::Transport& transport);
  ~PlanImports();
  PlanImports(const PlanImports&) = delete;
  PlanImports& operator=(const PlanImports&) = delete;
  // Per plan source (TransferPlan::sources order).
  const std::vector<transport::RemoteMemory>& remotes() const { return remotes_; }
  transport::Transport& transport() const { return transport_; }

 private:
  explicit PlanImports(transport::Transport& t) : transport_(t) {}
  transport::Transport& transport_;
  std::unique_ptr<refit::ImportCache> cache_;  // each distinct descriptor once; released with it
  std::vector<transport::RemoteMemory> remotes_;
};

// `device_params` maps every parameter the plan writes to a device buffer of exactly
// PlanBuffer::bytes on options.device. Imports the sources, executes, releases them.
[[nodiscard]] Result<refit::ExecuteStats> ExecutePlanOnDevice(const refit::TransferPlan& plan,
                                                              transport::Transport& transport,
                                                              const refit::DestinationBuffers& device_params,
                                                              const DeviceExecuteOptions& options = {});
// The same with sources imported beforehand (`imports` must come from this plan).
[[nodiscard]] Result<refit::ExecuteStats> ExecutePlanOnDevice(const refit::TransferPlan& plan,
                                                              const PlanImports& imports,
                                                              const refit::DestinationBuffers& device_params,
                                                              const DeviceExecuteOptions& options = {});
// The same with the plan's sources imported by the caller through `transport` (`remotes` per
// TransferPlan::sources, e.g. refit::ImportPlanSources over a kept refit::ImportCache).
[[nodiscard]] Result<refit::ExecuteStats> ExecutePlanOnDevice(const refit::TransferPlan& plan,
                                                              transport::Transport& transport,
                                                              std::span<const transport::RemoteMemory> remotes,
                                                              const refit::DestinationBuffers& device_params,
                                                              const DeviceExecuteOptions& options = {});

// Enables direct access from device `from` to device `to` when the hardware allows it (ignores
// "already enabled"); false when it does not.
bool EnablePeerAccess(int from, int to);

// ---- A GPU trainer stand-in -----------------------------------------------------------------------

// Holds a model sharded by a trainer layout in one device allocation of `device`, filled with
// seeded contents (seeded.h, key SeededTensorKey(seed, tensor name)), every shard registered with
// the named transport, shard digests computed on the GPU. Used by `rolloutcore bench refit` with
// GPU transports (the gpu-owner process) and by the GPU tests.
struct GpuOwnerOptions {
  refit::ModelConfig config;
  refit::TrainerLayout layout;
  std::string transport = "cuda_ipc";
  int device = 0;
  uint64_t seed = 1;
  std::string version = "v0";
};

class GpuOwner {
 public:
  [[nodiscard]] static Result<std::unique_ptr<GpuOwner>> Start(const GpuOwnerOptions& options);
  ~GpuOwner();
  GpuOwner(const GpuOwner&) = delete;
  GpuOwner& operator=(const GpuOwner&) = delete;

  // Shard tables with handles and digests; content_digest set.
  const refit::Manifest& manifest() const { return manifest_; }
  uint64_t bytes() const { return bytes_; }
  double fill_ms() const { return fill_ms_; }
  double digest_ms() const { return digest_ms_; }
  transport::Transport& transport() { return *transport_; }
  // Every shard's device block, in manifest order (tables, then shards).
  const std::vector<DeviceBlock>& blocks() const { return blocks_; }

 private:
  GpuOwner() = default;
  std::vector<DeviceBlock> blocks_;
  std::unique_ptr<transport::Transport> transport_;
  DeviceBuffer arena_;
  std::vector<uint64_t> registrations_;
  refit::Manifest manifest_;
  uint64_t bytes_ = 0;
  double fill_ms_ = 0, digest_ms_ = 0;
};

}  // namespace rc::cuda
