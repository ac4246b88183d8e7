// What the GPU code shares (the cuda_ipc and nccl transports, and the cuda module's kernels host
// side): CUDA error text and the one scoped current-device switch. Header-only; included only by
// code built with ROLLOUTCORE_WITH_CUDA (it includes the CUDA runtime header). Everything that needs
// no CUDA (descriptors, liveness, sockets) is in transport/common/.
//
// Thread safety: DeviceGuard changes the calling thread's current device until it is destroyed.
#pragma once

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <string>
#include <string_view>

#include "rolloutcore/base/status.h"

namespace rc::gpu_internal {

inline std::string CudaErrorText(cudaError_t e) {
  return fmt::format("{} ({}: {})", cudaGetErrorString(e), cudaGetErrorName(e), static_cast<int>(e));
}

// OkStatus for cudaSuccess; otherwise clears the sticky last error and returns Internal naming
// `what` and the error (the cuda module's host code checks every runtime call through it).
inline Status CheckCuda(cudaError_t e, std::string_view what) {
  if (e == cudaSuccess) return OkStatus();
  (void)cudaGetLastError();
  return Internal(fmt::format("{}: {} ({})", what, cudaGetErrorString(e), cudaGetErrorName(e)));
}

// Sets the current device for the scope and restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (device >= 0 && device != previous_) error_ = cudaSetDevice(device);
  }
  ~DeviceGuard() {
    int now = -1;
    if (previous_ >= 0 && cudaGetDevice(&now) == cudaSuccess && now != previous_) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  // The error of switching to the device (cudaSuccess when it worked).
  cudaError_t status() const { return error_; }
  // The same as a Status: Unavailable naming the device.
  Status status(int device) const {
    if (error_ == cudaSuccess) return OkStatus();
    return Unavailable(
        fmt::format("CUDA device {}: {} ({})", device, cudaGetErrorString(error_), cudaGetErrorName(error_)));
  }

 private:
  int previous_ = -1;
  cudaError_t error_ = cudaSuccess;
};

// The device a GPU transport created with `requested` (TransportOptions::device) works on: the
// caller's current device when -1. Unavailable when there is no CUDA device, InvalidArgument
// naming the device when it does not exist.
inline Result<int> ResolveDevice(std::string_view backend, int requested) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    return Unavailable(fmt::format("{} transport: no CUDA device ({})", backend,
                                   e != cudaSuccess ? CudaErrorText(e) : std::string("0 devices")));
  }
  int device = requested;
  if (device < 0 && cudaGetDevice(&device) != cudaSuccess) device = 0;
  if (device >= count) {
    return InvalidArgument(fmt::format("{} transport: device {} does not exist ({} devices)", backend, device, count));
  }
  return device;
}

}  // namespace rc::gpu_internal

namespace rc::transport::gpu_internal {
using rc::gpu_internal::CudaErrorText;
using rc::gpu_internal::DeviceGuard;
using rc::gpu_internal::ResolveDevice;
}  // namespace rc::transport::gpu_internal
