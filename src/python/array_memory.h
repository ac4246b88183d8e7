// ArrayMemory: the memory of a Python array (numpy, torch, anything with __dlpack__ or the buffer
// protocol) as the Publisher sees it — a pointer to dense row-major bytes, their shape and refit
// dtype, and an owner that keeps the caller's object (and so the memory) alive. Nothing is copied:
// the pointer is the caller's own memory.
//
// Where the memory comes from, in order:
//   1. `__dlpack__()` (DLPack, legacy "dltensor" capsule): numpy >= 1.22 and torch tensors. The
//      capsule is consumed ("used_dltensor"); its deleter runs when the owner is dropped.
//      `__dlpack_device__()` is asked first, so device memory is refused before it is exported.
//   2. The buffer protocol (memoryview, bytearray, numpy arrays that refuse DLPack, e.g. read-only
//      ones). The Py_buffer is held until the owner is dropped, which pins resizable objects.
//
// Shared allocations. Allocate() makes a zero-filled numpy array over a fresh transport::ShmBuffer
// (memfd shared memory): the only host memory the `shm` transport can register. Live allocations
// are kept in a process-wide table (address range and the refit dtype asked for), so that a shard
// can be checked to lie inside one before anything is registered, and so that a uint16 view of a
// bf16 allocation is published as bf16 without the caller repeating the dtype.
//
// Thread safety: every function here must be called with the GIL held. The allocation table has
// its own mutex (owners may be dropped by the Publisher from any thread holding the GIL). The
// owner's deleter takes the GIL itself.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "rolloutcore/base/status.h"
#include "rolloutcore/refit/tensor.h"

namespace rc::python {

namespace py = pybind11;

struct ArrayMemory {
  const void* data = nullptr;
  refit::Shape shape;
  refit::DType dtype = refit::DType::kF32;
  uint64_t bytes = 0;
  std::string source;  // "dlpack" or "buffer": how the memory was obtained
  int32_t device = -1;  // CUDA device of device memory (CUDA builds only); -1: host memory
  std::shared_ptr<const void> owner;
};

// Reads `array`'s memory (see the header comment). `dtype`, when given, reinterprets elements of
// the same width (a uint16 array as bf16); otherwise the array's own dtype is used (or the dtype
// of the shared allocation it lies in). InvalidArgument naming `what` for device memory (CUDA
// memory is accepted by CUDA builds: ArrayMemory::device is then set),
// non-contiguous arrays, element types refit does not have, and width mismatches.
[[nodiscard]] Result<ArrayMemory> ReadArrayMemory(const py::handle& array, const std::optional<refit::DType>& dtype,
                                                  const std::string& what);

// A zero-filled numpy array of `shape` over new shared memory, typed as the numpy dtype that
// holds refit `dtype` (bf16 -> uint16, f8 -> uint8; see NumpyDTypeName).
[[nodiscard]] Result<py::object> Allocate(const refit::Shape& shape, refit::DType dtype);

// The numpy dtype name that holds a refit dtype's elements.
const char* NumpyDTypeName(refit::DType dtype);

// True when [data, data + bytes) lies inside one live Allocate()d buffer.
bool InsideSharedAllocation(const void* data, uint64_t bytes);

// Number of live shared allocations and their bytes (for tests of lifetime).
std::pair<int64_t, uint64_t> SharedAllocationStats();

}  // namespace rc::python
