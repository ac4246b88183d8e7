#include "cuda/gpu_delta.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <chrono>

#include "cuda/kernels.h"
#include "rolloutcore/cuda/gpu_refit.h"
#include "transport/gpu_common.h"

namespace rc::cuda {
namespace {

using rc::gpu_internal::CheckCuda;


template <typename T>
Result<DeviceBuffer> Upload(int device, std::span<const T> host, uint64_t* bytes) {
  const uint64_t n = host.size() * sizeof(T);
  RC_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::Allocate(device, n));
  if (n > 0) RC_RETURN_IF_ERROR(CopyToDevice(b.data(), host.data(), n, device));
  *bytes += n;
  return b;
}

// The views, back to back, in one device buffer.
Result<DeviceBuffer> UploadConcatenated(int device, std::span<const std::span<const std::byte>> views, uint64_t total,
                                        uint64_t* bytes) {
  RC_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::Allocate(device, total));
  uint64_t at = 0;
  for (const std::span<const std::byte> v : views) {
    if (v.empty()) continue;
    RC_RETURN_IF_ERROR(CopyToDevice(b.data() + at, v.data(), v.size(), device));
    at += v.size();
  }
  *bytes += total;
  return b;
}

}  // namespace

Result<DeviceDeltaOutput> RunDeltaOnDevice(int device, const DeviceDeltaInput& in) {
  uint64_t body_bytes = 0;
  for (const std::span<const std::byte> v : in.bodies) body_bytes += v.size();
  for (size_t i = 0; i < in.tasks.size(); ++i) {
    const internal::DeltaTask& t = in.tasks[i];
    if (t.piece >= in.pieces.size() || t.body > body_bytes || t.bytes > body_bytes - t.body) {
      return InvalidArgument(fmt::format("device delta: task {} names piece {} of {} and body bytes [{}, {}) of {}", i,
                                         t.piece, in.pieces.size(), t.body, t.body + t.bytes, body_bytes));
    }
  }
  for (const internal::DeltaPieceDesc& p : in.pieces) {
    if (p.tensor >= in.slots || p.owned_begin + p.owned_count > in.owned.size()) {
      return InvalidArgument(fmt::format("device delta: a piece names slot {} of {} or owned boxes past {}", p.tensor,
                                         in.slots, in.owned.size()));
    }
  }
  DeviceDeltaOutput out;
  out.old_terms.assign(in.slots, 0);
  out.new_terms.assign(in.slots, 0);
  if (in.tasks.empty()) return out;
  rc::gpu_internal::DeviceGuard guard(device);
  RC_RETURN_IF_ERROR(guard.status(device));
  const auto t0 = std::chrono::steady_clock::now();
  RC_ASSIGN_OR_RETURN(DeviceBuffer pieces, Upload(device, in.pieces, &out.uploaded_bytes));
  RC_ASSIGN_OR_RETURN(DeviceBuffer owned, Upload(device, in.owned, &out.uploaded_bytes));
  RC_ASSIGN_OR_RETURN(DeviceBuffer tasks, Upload(device, in.tasks, &out.uploaded_bytes));
  RC_ASSIGN_OR_RETURN(DeviceBuffer bodies, UploadConcatenated(device, in.bodies, body_bytes, &out.uploaded_bytes));
  // old sums, new sums, then counts[2] and first_error.
  std::vector<uint64_t> results(2 * in.slots + 3, 0);
  results.back() = ~uint64_t{0};
  RC_ASSIGN_OR_RETURN(DeviceBuffer sums, Upload(device, std::span<const uint64_t>(results), &out.uploaded_bytes));
  out.upload_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();

  cudaEvent_t start = nullptr, stop = nullptr;
  RC_RETURN_IF_ERROR(CheckCuda(cudaEventCreate(&start), "cudaEventCreate"));
  Status launched = CheckCuda(cudaEventCreate(&stop), "cudaEventCreate");
  auto* s = reinterpret_cast<uint64_t*>(sums.data());
  if (launched.ok()) launched = CheckCuda(cudaEventRecord(start, nullptr), "cudaEventRecord");
  if (launched.ok()) {
    launched = CheckCuda(internal::LaunchDeltaTasks(reinterpret_cast<const internal::DeltaPieceDesc*>(pieces.data()),
                                                reinterpret_cast<const internal::DeltaOwnedBox*>(owned.data()),
                                                reinterpret_cast<const internal::DeltaTask*>(tasks.data()),
                                                in.tasks.size(), reinterpret_cast<const unsigned char*>(bodies.data()),
                                                s, s + in.slots, s + 2 * in.slots, s + 2 * in.slots + 2, nullptr),
                     "delta kernel launch");
  }
  if (launched.ok()) launched = CheckCuda(cudaEventRecord(stop, nullptr), "cudaEventRecord");
  if (launched.ok()) launched = CheckCuda(cudaEventSynchronize(stop), "delta kernel");
  float ms = 0;
  if (launched.ok()) launched = CheckCuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  if (start != nullptr) (void)cudaEventDestroy(start);
  if (stop != nullptr) (void)cudaEventDestroy(stop);
  RC_RETURN_IF_ERROR(launched);
  out.kernel_ms = ms;
  RC_RETURN_IF_ERROR(CopyToHost(results.data(), sums.data(), results.size() * 8, device));
  for (size_t i = 0; i < in.slots; ++i) {
    out.old_terms[i] = results[i];
    out.new_terms[i] = results[in.slots + i];
  }
  out.writes = results[2 * in.slots];
  out.owned = results[2 * in.slots + 1];
  if (const uint64_t e = results[2 * in.slots + 2]; e != ~uint64_t{0}) {
    out.failed_task = e >> 2;
    out.error = static_cast<uint32_t>(e & 3);
  }
  return out;
}

}  // namespace rc::cuda
