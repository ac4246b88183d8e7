#pragma once
// The x86 instruction sets this CPU has, for the kernels that pick a vector loop at run time
// (engine matmul, refit digest, fp8 quantizer). Each answer is computed once and cached.
//
// Thread safety: may be called from any thread.

namespace rc {

bool CpuHasAvx2();
bool CpuHasFma();
// AVX-512 F, BW, DQ and VL (what every AVX-512 loop of the project uses).
bool CpuHasAvx512();

}  // namespace rc
