#include "rolloutcore/cuda/fp8.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <map>
#include <mutex>

#include "cuda/fp8_kernels.h"
#include "rolloutcore/cuda/gpu_refit.h"
#include "transport/gpu_common.h"

namespace rc::cuda {
namespace {

using rc::gpu_internal::CheckCuda;


// Per device: the scratch (amax + status) and the stream the quantizer uses, kept between calls
// (a refit quantizes every projection of a model in a row: 144 calls for an 8B model, and a
// cudaMalloc/cudaFree pair per call cost more than the kernels). One call at a time per process.
struct Fp8DeviceState {
  DeviceBuffer scratch;
  cudaStream_t stream = nullptr;  // never destroyed: lives as long as the process
};
std::mutex g_fp8_mu;
std::map<int, Fp8DeviceState>& Fp8States() {
  static auto* states = new std::map<int, Fp8DeviceState>();
  return *states;
}

}  // namespace

Status QuantizeBf16ToFp8OnDevice(int device, const void* bf16, const formats::Fp8Layout& layout, void* q,
                                 float* scales, std::string_view name) {
  RC_RETURN_IF_ERROR(layout.Validate().WithContext(fmt::format("quantizing {} on the GPU", name)));
  if (layout.NumElements() == 0) return OkStatus();
  const int64_t groups = layout.NumScales();
  rc::gpu_internal::DeviceGuard guard(device);
  RC_RETURN_IF_ERROR(guard.status(device));
  std::lock_guard<std::mutex> lock(g_fp8_mu);
  Fp8DeviceState& state = Fp8States()[device];
  // amax [groups] then the two status words, in one scratch buffer.
  const uint64_t amax_bytes = (static_cast<uint64_t>(groups) * 4 + 15) / 16 * 16;
  if (state.scratch.size() < amax_bytes + 16) {
    state.scratch = DeviceBuffer();
    RC_ASSIGN_OR_RETURN(state.scratch, DeviceBuffer::Allocate(device, std::max<uint64_t>(amax_bytes + 16, 1 << 20)));
  }
  if (state.stream == nullptr) {
    RC_RETURN_IF_ERROR(CheckCuda(cudaStreamCreateWithFlags(&state.stream, cudaStreamNonBlocking), "cudaStreamCreate"));
  }
  cudaStream_t stream = state.stream;
  std::byte* scratch = state.scratch.data();
  internal::Fp8QuantArgs a;
  a.src = reinterpret_cast<uint64_t>(bf16);
  a.q = reinterpret_cast<uint64_t>(q);
  a.scales = reinterpret_cast<uint64_t>(scales);
  a.amax = reinterpret_cast<uint64_t>(scratch);
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
  // The input may have been written on another stream (the legacy default stream of a caller such
  // as torch's current stream): order after everything queued on the device so far.
  RC_RETURN_IF_ERROR(CheckCuda(cudaDeviceSynchronize(), "waiting for the input"));
  RC_RETURN_IF_ERROR(CheckCuda(cudaMemsetAsync(scratch, 0, amax_bytes, stream), "cudaMemsetAsync"));
  RC_RETURN_IF_ERROR(CheckCuda(cudaMemsetAsync(scratch + amax_bytes, 0xFF, 16, stream), "cudaMemsetAsync"));
  RC_RETURN_IF_ERROR(CheckCuda(internal::LaunchFp8Amax(a, stream), "fp8 amax kernel"));
  // The scale and quantize kernels write nothing once the amax pass found a non-finite element: a
  // non-finite input leaves `scales` and `q` as they were, and the host checks once, at the end.
  RC_RETURN_IF_ERROR(CheckCuda(internal::LaunchFp8Scales(a, groups, stream), "fp8 scale kernel"));
  RC_RETURN_IF_ERROR(CheckCuda(internal::LaunchFp8Quantize(a, stream), "fp8 quantize kernel"));
  std::array<unsigned long long, 2> status{};  // [1] unused: 16-byte copy
  RC_RETURN_IF_ERROR(CheckCuda(cudaMemcpyAsync(status.data(), scratch + amax_bytes, 16, cudaMemcpyDeviceToHost, stream),
                           "reading the fp8 status"));
  RC_RETURN_IF_ERROR(CheckCuda(cudaStreamSynchronize(stream), "fp8 quantize"));
  if (status[0] != ~0ull) {
    uint16_t bits = 0;
    RC_RETURN_IF_ERROR(CheckCuda(cudaMemcpy(&bits, static_cast<const uint16_t*>(bf16) + status[0], 2,
                                        cudaMemcpyDeviceToHost), "reading the non-finite element"));
    const auto row = static_cast<int64_t>(status[0]) / layout.cols, col = static_cast<int64_t>(status[0]) % layout.cols;
    return InvalidArgument(fmt::format("{}[{}, {}] is {} (bf16 0x{:04x}): only finite weights can be quantized to fp8",
                                       name, row, col,
                                       (bits & 0x7F) != 0 ? "NaN" : (bits & 0x8000) ? "-inf" : "+inf", bits));
  }
  return OkStatus();
}

}  // namespace rc::cuda
