#pragma once
// What this machine has: the x86 instruction sets of its CPU, for the kernels that pick a vector
// loop at run time (engine matmul, refit digest, fp8 quantizer), each computed once and cached;
// and its physical memory, which the engine, the trainer and the export check a model against
// before they allocate it.
//
// Thread safety: may be called from any thread.

namespace rc {

bool CpuHasAvx2();
bool CpuHasFma();
// AVX-512 F, BW, DQ and VL (what every AVX-512 loop of the project uses).
bool CpuHasAvx512();

// Bytes of physical memory (sysconf); 0 when the system does not say.
double PhysicalMemoryBytes();

}  // namespace rc
