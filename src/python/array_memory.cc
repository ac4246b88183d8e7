#include "python/array_memory.h"

#include <fmt/format.h>
#include <pybind11/numpy.h>

#include <map>
#include <mutex>
#include <vector>

#include "rolloutcore/transport/shm.h"
#include "rolloutcore/base/mutex.h"

namespace rc::python {
namespace {

// ---- DLPack (legacy ABI, dlpack.h v0.8; stable since v0.2) --------------------------------------
// Declared here rather than taken from a dlpack package: the layout is a fixed ABI and this is the
// only file that reads it.
struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; null means compact row-major
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};
constexpr int32_t kDLCPU = 1;
constexpr int32_t kDLCUDA = 2;
#ifdef ROLLOUTCORE_WITH_CUDA
constexpr bool kCudaBuilt = true;  // device (kDLCUDA) arrays are published through cuda_ipc / nccl
#else
constexpr bool kCudaBuilt = false;
#endif
constexpr int32_t kDLCUDAHost = 3;
constexpr int32_t kDLCUDAManaged = 13;

// An element type as the array declares it, before it is mapped to a refit dtype.
struct ElementType {
  char kind =
      'f';  // 'i' int, 'u' uint, 'f' float, 'B' bfloat, '?' bool, 'c' complex, '8' fp8 e4m3, '5' fp8 e5m2, 'x' other
  int bits = 32;
};

std::string ElementTypeName(const ElementType& t) {
  switch (t.kind) {
    case 'i':
      return fmt::format("int{}", t.bits);
    case 'u':
      return fmt::format("uint{}", t.bits);
    case 'f':
      return fmt::format("float{}", t.bits);
    case 'B':
      return fmt::format("bfloat{}", t.bits);
    case '?':
      return "bool";
    case 'c':
      return fmt::format("complex{}", t.bits);
    case '8':
      return "float8_e4m3fn";
    case '5':
      return "float8_e5m2";
    default:
      return fmt::format("an unknown {}-bit type", t.bits);
  }
}

std::optional<refit::DType> NativeDType(const ElementType& t) {
  using refit::DType;
  if (t.kind == 'f' && t.bits == 32) return DType::kF32;
  if (t.kind == 'f' && t.bits == 16) return DType::kF16;
  if (t.kind == 'B' && t.bits == 16) return DType::kBF16;
  if (t.kind == 'i' && t.bits == 8) return DType::kI8;
  if (t.kind == 'u' && t.bits == 8) return DType::kU8;
  if (t.kind == 'i' && t.bits == 32) return DType::kI32;
  if (t.kind == 'i' && t.bits == 64) return DType::kI64;
  if (t.kind == '8') return DType::kF8E4M3;
  if (t.kind == '5') return DType::kF8E5M2;
  return std::nullopt;
}

constexpr std::string_view kDTypeList = "f32, bf16, f16, f8_e4m3, f8_e5m2, i8, u8, i32, i64";

// The refit dtype to publish an array of element type `t` as.
Result<refit::DType> ResolveDType(const ElementType& t, const std::optional<refit::DType>& asked,
                                  std::optional<refit::DType> allocation_dtype, const std::string& what) {
  const std::optional<refit::DType> native = NativeDType(t);
  if (!asked) {
    // A raw-bits view (uint16 / uint8) of a shared allocation made for bf16 / f16 / f8: its dtype.
    if (allocation_dtype && (t.kind == 'u' || t.kind == 'i') &&
        static_cast<int>(refit::DTypeSize(*allocation_dtype)) * 8 == t.bits) {
      return *allocation_dtype;
    }
    if (native) return *native;
    return InvalidArgument(fmt::format(
        "{}: {} arrays cannot be published (refit dtypes: {}); convert it first (a copy), or pass dtype= to "
        "reinterpret {}-bit raw bits (e.g. a uint16 array holding bf16 as dtype='bf16')",
        what, ElementTypeName(t), kDTypeList, t.bits));
  }
  if (native && *native == *asked) return *asked;
  const int want_bits = static_cast<int>(refit::DTypeSize(*asked)) * 8;
  if ((t.kind == 'u' || t.kind == 'i') && t.bits == want_bits) return *asked;  // raw bits, same width
  return InvalidArgument(fmt::format(
      "{}: dtype {} was asked but the array holds {} ({} bytes per element); only raw-bits integer arrays of "
      "the same width are reinterpreted. Convert the values first (a copy), e.g. into "
      "Publisher.allocate(shape, '{}')",
      what, refit::DTypeName(*asked), ElementTypeName(t), t.bits / 8, refit::DTypeName(*asked)));
}

// ---- Shared allocations ---------------------------------------------------------------------

struct Allocation {
  uintptr_t end = 0;
  refit::DType dtype = refit::DType::kF32;
  uint64_t bytes = 0;
};

rc::Mutex& AllocationMutex() {
  static rc::Mutex mu;
  return mu;
}
std::map<uintptr_t, Allocation>& Allocations() REQUIRES(AllocationMutex()) {  // guarded by AllocationMutex()
  static auto* table = new std::map<uintptr_t, Allocation>();  // never destroyed: owners may outlive statics
  return *table;
}

std::optional<refit::DType> AllocationDType(const void* data, uint64_t bytes) {
  const auto begin = reinterpret_cast<uintptr_t>(data);
  rc::MutexLock lock(AllocationMutex());
  auto& table = Allocations();
  auto it = table.upper_bound(begin);
  if (it == table.begin()) return std::nullopt;
  --it;
  if (begin >= it->first && begin + bytes <= it->second.end) return it->second.dtype;
  return std::nullopt;
}

// ---- Owners ---------------------------------------------------------------------------------

// Runs `fn` with the GIL, unless the interpreter is already gone (then the memory is left to the
// process exit: calling into Python then would crash).
template <typename Fn>
void WithGil(Fn fn) {
  if (!Py_IsInitialized()) return;
  py::gil_scoped_acquire gil;
  fn();
}

std::shared_ptr<const void> OwnDLPack(DLManagedTensor* managed) {
  return std::shared_ptr<const void>(managed, [](const void* p) {
    auto* m = static_cast<DLManagedTensor*>(const_cast<void*>(p));
    WithGil([m] {
      if (m->deleter != nullptr) m->deleter(m);
    });
  });
}

std::shared_ptr<const void> OwnBuffer(std::unique_ptr<Py_buffer> view) {
  Py_buffer* raw = view.release();
  return std::shared_ptr<const void>(raw, [](const void* p) {
    auto* v = static_cast<Py_buffer*>(const_cast<void*>(p));
    WithGil([v] { PyBuffer_Release(v); });
    delete v;
  });
}

Status CheckRowMajor(const refit::Shape& shape, const int64_t* strides, const std::string& what) {
  if (strides == nullptr) return OkStatus();
  int64_t expected = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    if (shape[d] != 1 && strides[d] != expected) {
      std::vector<int64_t> s(strides, strides + shape.size());
      return InvalidArgument(fmt::format(
          "{}: the array is not contiguous (shape {}, strides {} in elements); a shard is registered as one dense "
          "row-major box of the caller's memory, so pass a contiguous array (np.ascontiguousarray(a) or "
          "t.contiguous() copy it) or add_shard(..., copy=True)",
          what, refit::ShapeToString(shape), refit::ShapeToString(s)));
    }
    expected *= shape[d];
  }
  return OkStatus();
}

Result<ArrayMemory> FromDLPack(const py::handle& array, const std::optional<refit::DType>& dtype,
                               const std::string& what) {
  if (py::hasattr(array, "__dlpack_device__")) {
    auto dev = array.attr("__dlpack_device__")().cast<std::pair<int32_t, int32_t>>();
    if ((dev.first == kDLCUDA || dev.first == kDLCUDAManaged) && !kCudaBuilt) {
      return InvalidArgument(fmt::format(
          "{}: the tensor is in CUDA device memory (device {}); this build publishes host memory only (no CUDA "
          "transport is built). Copy it to host shared memory: buf = publisher.allocate(shape, dtype); "
          "torch.from_numpy(buf).copy_(tensor) (rolloutcore.torch_utils does this), or add_shard(..., copy=True)",
          what, dev.second));
    }
    if (dev.first != kDLCPU && dev.first != kDLCUDAHost && !(kCudaBuilt && dev.first == kDLCUDA)) {
      return InvalidArgument(
          fmt::format("{}: the array lives on DLPack device type {} (device {}); only host memory "
                      "(kDLCPU, kDLCUDAHost) can be published",
                      what, dev.first, dev.second));
    }
  }
  py::object capsule = array.attr("__dlpack__")();
  PyObject* cap = capsule.ptr();
  if (!PyCapsule_IsValid(cap, "dltensor")) {
    return InvalidArgument(what + ": __dlpack__() did not return a 'dltensor' capsule");
  }
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, "dltensor"));
  if (managed == nullptr) throw py::error_already_set();
  // Consumed: from here on the capsule's destructor leaves the tensor to us.
  if (PyCapsule_SetName(cap, "used_dltensor") != 0) throw py::error_already_set();
  std::shared_ptr<const void> owner = OwnDLPack(managed);

  const DLTensor& t = managed->dl_tensor;
  const bool on_device = kCudaBuilt && t.device.device_type == kDLCUDA;
  if (t.device.device_type != kDLCPU && t.device.device_type != kDLCUDAHost && !on_device) {
    return InvalidArgument(fmt::format(
        "{}: the array lives on DLPack device type {}; only host memory can be published", what, t.device.device_type));
  }
  if (t.dtype.lanes != 1)
    return InvalidArgument(fmt::format("{}: vector element types (lanes {}) are not supported", what, t.dtype.lanes));
  ElementType et;
  et.bits = t.dtype.bits;
  switch (t.dtype.code) {
    case 0:
      et.kind = 'i';
      break;
    case 1:
      et.kind = 'u';
      break;
    case 2:
      et.kind = 'f';
      break;
    case 4:
      et.kind = 'B';
      break;
    case 5:
      et.kind = 'c';
      break;
    case 6:
      et.kind = '?';
      break;
    case 10:
      et.kind = '8';
      break;  // kDLFloat8_e4m3fn
    case 12:
      et.kind = '5';
      break;  // kDLFloat8_e5m2
    default:
      et.kind = 'x';
      break;
  }
  ArrayMemory m;
  m.shape.assign(t.shape, t.shape + t.ndim);
  RC_RETURN_IF_ERROR(refit::ValidateShape(m.shape, what + ": shape"));
  RC_RETURN_IF_ERROR(CheckRowMajor(m.shape, t.strides, what));
  m.data = static_cast<const std::byte*>(t.data) + t.byte_offset;
  m.bytes = static_cast<uint64_t>(refit::NumElements(m.shape)) * ((et.bits + 7) / 8);
  RC_ASSIGN_OR_RETURN(m.dtype, ResolveDType(et, dtype, AllocationDType(m.data, m.bytes), what));
  m.source = "dlpack";
  if (on_device) m.device = t.device.device_id;
  m.owner = std::move(owner);
  return m;
}

Result<ArrayMemory> FromBuffer(const py::handle& array, const std::optional<refit::DType>& dtype,
                               const std::string& what) {
  auto view = std::make_unique<Py_buffer>();
  if (PyObject_GetBuffer(array.ptr(), view.get(), PyBUF_STRIDES | PyBUF_FORMAT) != 0) {
    PyErr_Clear();
    return InvalidArgument(fmt::format(
        "{}: expected an array with __dlpack__ or the buffer protocol (numpy.ndarray, torch.Tensor, memoryview), "
        "got {}",
        what, py::str(py::type::handle_of(array).attr("__name__")).cast<std::string>()));
  }
  // Held from here, released by the owner.
  ArrayMemory m;
  m.owner = OwnBuffer(std::move(view));
  const auto* v = static_cast<const Py_buffer*>(m.owner.get());
  m.shape.assign(v->shape, v->shape + v->ndim);
  RC_RETURN_IF_ERROR(refit::ValidateShape(m.shape, what + ": shape"));
  if (!PyBuffer_IsContiguous(v, 'C')) {
    std::vector<int64_t> strides;
    for (int d = 0; d < v->ndim; ++d) strides.push_back(v->strides[d] / std::max<Py_ssize_t>(v->itemsize, 1));
    Status st = CheckRowMajor(m.shape, strides.data(), what);
    if (st.ok()) st = InvalidArgument(what + ": the buffer is not C-contiguous");
    return st;
  }
  std::string format = v->format != nullptr ? v->format : "B";
  if (!format.empty() && (format[0] == '<' || format[0] == '=' || format[0] == '@')) format = format.substr(1);
  if (!format.empty() && (format[0] == '>' || format[0] == '!')) {
    return InvalidArgument(fmt::format("{}: big-endian buffers (format '{}') cannot be published", what, v->format));
  }
  ElementType et;
  et.bits = static_cast<int>(v->itemsize) * 8;
  if (format.size() != 1) {
    et.kind = 'x';
  } else {
    switch (format[0]) {
      case 'f':
      case 'd':
      case 'e':
        et.kind = 'f';
        break;
      case 'b':
      case 'h':
      case 'i':
      case 'l':
      case 'q':
      case 'n':
        et.kind = 'i';
        break;
      case 'B':
      case 'H':
      case 'I':
      case 'L':
      case 'Q':
      case 'N':
      case 'c':
        et.kind = 'u';
        break;
      case '?':
        et.kind = '?';
        break;
      default:
        et.kind = 'x';
        break;
    }
  }
  m.data = v->buf;
  m.bytes = static_cast<uint64_t>(v->len);
  RC_ASSIGN_OR_RETURN(m.dtype, ResolveDType(et, dtype, AllocationDType(m.data, m.bytes), what));
  m.source = "buffer";
  return m;
}

}  // namespace

const char* NumpyDTypeName(refit::DType dtype) {
  switch (dtype) {
    case refit::DType::kF32:
      return "float32";
    case refit::DType::kBF16:
      return "uint16";
    case refit::DType::kF16:
      return "float16";
    case refit::DType::kF8E4M3:
      return "uint8";
    case refit::DType::kF8E5M2:
      return "uint8";
    case refit::DType::kI8:
      return "int8";
    case refit::DType::kU8:
      return "uint8";
    case refit::DType::kI32:
      return "int32";
    case refit::DType::kI64:
      return "int64";
  }
  return "uint8";
}

Result<ArrayMemory> ReadArrayMemory(const py::handle& array, const std::optional<refit::DType>& dtype,
                                    const std::string& what) {
  if (py::hasattr(array, "__dlpack__")) {
    try {
      return FromDLPack(array, dtype, what);
    } catch (py::error_already_set& e) {
      // numpy refuses DLPack for read-only arrays (BufferError); the buffer protocol still works.
      if (!e.matches(PyExc_BufferError) && !e.matches(PyExc_TypeError)) throw;
      if (py::hasattr(array, "__dlpack_device__")) {
        auto dev = array.attr("__dlpack_device__")().cast<std::pair<int32_t, int32_t>>();
        if (dev.first != kDLCPU && dev.first != kDLCUDAHost) {
          return InvalidArgument(fmt::format("{}: __dlpack__ failed for a device array: {}", what, e.what()));
        }
      }
    }
  }
  return FromBuffer(array, dtype, what);
}

Result<py::object> Allocate(const refit::Shape& shape, refit::DType dtype) {
  RC_RETURN_IF_ERROR(refit::ValidateShape(shape, "allocate: shape"));
  const uint64_t bytes = static_cast<uint64_t>(refit::NumElements(shape)) * refit::DTypeSize(dtype);
  RC_ASSIGN_OR_RETURN(transport::ShmBuffer buffer, transport::ShmBuffer::Create(std::max<uint64_t>(bytes, 1)));
  auto* owned = new transport::ShmBuffer(std::move(buffer));
  const auto begin = reinterpret_cast<uintptr_t>(owned->data());
  {
    rc::MutexLock lock(AllocationMutex());
    Allocations()[begin] = Allocation{begin + std::max<uint64_t>(bytes, 1), dtype, bytes};
  }
  py::capsule base(owned, [](void* p) {
    auto* b = static_cast<transport::ShmBuffer*>(p);
    {
      rc::MutexLock lock(AllocationMutex());
      Allocations().erase(reinterpret_cast<uintptr_t>(b->data()));
    }
    delete b;
  });
  std::vector<py::ssize_t> dims(shape.begin(), shape.end());
  std::vector<py::ssize_t> strides(dims.size());
  py::ssize_t stride = static_cast<py::ssize_t>(refit::DTypeSize(dtype));
  for (size_t d = dims.size(); d-- > 0;) {
    strides[d] = stride;
    stride *= dims[d];
  }
  py::array out(py::dtype(NumpyDTypeName(dtype)), dims, strides, owned->data(), base);
  return py::object(std::move(out));
}

bool InsideSharedAllocation(const void* data, uint64_t bytes) { return AllocationDType(data, bytes).has_value(); }

std::pair<int64_t, uint64_t> SharedAllocationStats() {
  rc::MutexLock lock(AllocationMutex());
  uint64_t bytes = 0;
  for (const auto& [begin, a] : Allocations()) bytes += a.bytes;
  return {static_cast<int64_t>(Allocations().size()), bytes};
}

}  // namespace rc::python
