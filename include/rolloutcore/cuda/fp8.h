#pragma once
// The fp8 quantizer on the GPU (CUDA builds): formats/fp8.h's rule, the same bits as
// formats::QuantizeBf16ToFp8 (tests/gpu/gpu_kernels_test.cc holds them together).

#include <cstdint>
#include <string_view>

#include "rolloutcore/base/status.h"
#include "rolloutcore/formats/fp8.h"

namespace rc::cuda {

// Quantizes the row-major bf16 matrix at device address `bf16` (layout.NumElements() elements) on
// `device` into `q` (one byte per element) and `scales` (layout.NumScales() floats), both device
// memory, and waits for it. A non-finite element is refused (InvalidArgument naming `name`, the row
// and the column) before anything is written.
[[nodiscard]] Status QuantizeBf16ToFp8OnDevice(int device, const void* bf16, const formats::Fp8Layout& layout,
                                               void* q, float* scales, std::string_view name);

}  // namespace rc::cuda
