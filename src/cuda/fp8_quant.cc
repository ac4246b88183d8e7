#include "rolloutcore/cuda/fp8.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <array>

#include "cuda/fp8_kernels.h"
#include "rolloutcore/cuda/gpu_refit.h"
#include "transport/gpu_common.h"

namespace rc::cuda {
namespace {

Status Check(cudaError_t e, std::string_view what) {
  if (e == cudaSuccess) return OkStatus();
  (void)cudaGetLastError();
  return Internal(fmt::format("{}: {} ({})", what, cudaGetErrorString(e), cudaGetErrorName(e)));
}

}  // namespace

Status QuantizeBf16ToFp8OnDevice(int device, const void* bf16, const formats::Fp8Layout& layout, void* q,
                                 float* scales, std::string_view name) {
  RC_RETURN_IF_ERROR(layout.Validate().WithContext(fmt::format("quantizing {} on the GPU", name)));
  if (layout.NumElements() == 0) return OkStatus();
  const int64_t groups = layout.NumScales();
  rc::gpu_internal::DeviceGuard guard(device);
  RC_RETURN_IF_ERROR(guard.status(device));
  // amax [groups] then the two status words, in one scratch buffer.
  const uint64_t amax_bytes = (static_cast<uint64_t>(groups) * 4 + 15) / 16 * 16;
  RC_ASSIGN_OR_RETURN(DeviceBuffer scratch, DeviceBuffer::Allocate(device, amax_bytes + 16));
  cudaStream_t stream = nullptr;
  RC_RETURN_IF_ERROR(Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate"));
  struct StreamCloser {
    cudaStream_t s;
    ~StreamCloser() { (void)cudaStreamDestroy(s); }
  } closer{stream};
  internal::Fp8QuantArgs a;
  a.src = reinterpret_cast<uint64_t>(bf16);
  a.q = reinterpret_cast<uint64_t>(q);
  a.scales = reinterpret_cast<uint64_t>(scales);
  a.amax = reinterpret_cast<uint64_t>(scratch.data());
  a.status = a.amax + amax_bytes;
  a.rows = layout.rows;
  a.cols = layout.cols;
  a.scheme = static_cast<uint8_t>(layout.scheme);
  if (layout.scheme == formats::Fp8Scheme::kBlock) {
    a.seg_cols = layout.block_cols;
    a.segs_per_row = layout.ScaleGrid()[1];
    a.block_rows = layout.block_rows;
  } else {
    a.seg_cols = layout.cols;
  }
  RC_RETURN_IF_ERROR(Check(cudaMemsetAsync(scratch.data(), 0, amax_bytes, stream), "cudaMemsetAsync"));
  RC_RETURN_IF_ERROR(Check(cudaMemsetAsync(scratch.data() + amax_bytes, 0xFF, 16, stream), "cudaMemsetAsync"));
  RC_RETURN_IF_ERROR(Check(internal::LaunchFp8Amax(a, stream), "fp8 amax kernel"));
  // Nothing is written to `scales` or `q` before this check: a non-finite input leaves both as they
  // were.
  std::array<unsigned long long, 2> status{};  // [1] unused: 16-byte copy
  RC_RETURN_IF_ERROR(Check(cudaMemcpyAsync(status.data(), scratch.data() + amax_bytes, 16, cudaMemcpyDeviceToHost,
                                           stream), "reading the fp8 status"));
  RC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(stream), "fp8 amax"));
  if (status[0] != ~0ull) {
    uint16_t bits = 0;
    RC_RETURN_IF_ERROR(Check(cudaMemcpy(&bits, static_cast<const uint16_t*>(bf16) + status[0], 2,
                                        cudaMemcpyDeviceToHost), "reading the non-finite element"));
    const auto row = static_cast<int64_t>(status[0]) / layout.cols, col = static_cast<int64_t>(status[0]) % layout.cols;
    return InvalidArgument(fmt::format("{}[{}, {}] is {} (bf16 0x{:04x}): only finite weights can be quantized to fp8",
                                       name, row, col,
                                       (bits & 0x7F) != 0 ? "NaN" : (bits & 0x8000) ? "-inf" : "+inf", bits));
  }
  RC_RETURN_IF_ERROR(Check(internal::LaunchFp8Scales(a, groups, stream), "fp8 scale kernel"));
  RC_RETURN_IF_ERROR(Check(internal::LaunchFp8Quantize(a, stream), "fp8 quantize kernel"));
  return Check(cudaStreamSynchronize(stream), "fp8 quantize");
}

}  // namespace rc::cuda
