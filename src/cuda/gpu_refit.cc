#include "rolloutcore/cuda/gpu_refit.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <unordered_map>
#include <utility>

#include "cuda/digest_chunk.h"
#include "cuda/digest_table.h"
#include "cuda/dtype_bits.h"
#include "cuda/kernels.h"
#include "rolloutcore/cuda/seeded.h"
#include "rolloutcore/transport/registry.h"
#include "transport/gpu_common.h"

namespace rc::cuda {
namespace {

using rc::gpu_internal::CheckCuda;

using internal::DigestChunk;
using internal::FusedChunk;
using refit::DType;

std::string CudaText(cudaError_t e) {
  return fmt::format("{} ({})", cudaGetErrorString(e), cudaGetErrorName(e));
}

using rc::gpu_internal::DeviceGuard;


// Times work enqueued on the default stream of the current device.
class EventTimer {
 public:
  EventTimer() {
    ok_ = cudaEventCreate(&start_) == cudaSuccess && cudaEventCreate(&stop_) == cudaSuccess;
    if (ok_) ok_ = cudaEventRecord(start_, nullptr) == cudaSuccess;
  }
  ~EventTimer() {
    if (start_ != nullptr) (void)cudaEventDestroy(start_);
    if (stop_ != nullptr) (void)cudaEventDestroy(stop_);
  }
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;
  // Records the stop event, waits for it, returns the milliseconds between the events.
  Result<double> Stop() {
    if (!ok_) return Internal("cudaEventCreate/Record failed");
    RC_RETURN_IF_ERROR(CheckCuda(cudaEventRecord(stop_, nullptr), "cudaEventRecord"));
    RC_RETURN_IF_ERROR(CheckCuda(cudaEventSynchronize(stop_), "waiting for the GPU"));
    float ms = 0;
    RC_RETURN_IF_ERROR(CheckCuda(cudaEventElapsedTime(&ms, start_, stop_), "cudaEventElapsedTime"));
    return static_cast<double>(ms);
  }

 private:
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  bool ok_ = false;
};

uint8_t BitsModeFor(DType source, DType installed) {
  using namespace internal;
  if (source == installed) return kBitsRaw;
  if (installed == DType::kF32 && source == DType::kBF16) return kBitsF32FromBf16;
  if (installed == DType::kF32 && source == DType::kF16) return kBitsF32FromF16;
  if (source == DType::kF32 && installed == DType::kBF16) return kBitsBf16FromF32;
  if (source == DType::kF32 && installed == DType::kF16) return kBitsF16FromF32;
  return kBitsMismatch;
}

struct WalkDim {
  int64_t size, g, d;  // extent, global index stride, memory stride (elements)
};

constexpr uint64_t kMaxChunks = uint64_t{1} << 28;

// Appends the chunks of one strided walk (dims outer to inner).
Status AddWalk(std::vector<WalkDim> dims, uint64_t gbase, uint64_t addr, uint32_t es, uint8_t mode, uint32_t slot,
               std::vector<DigestChunk>* out, uint64_t* elements) {
  std::erase_if(dims, [](const WalkDim& d) { return d.size == 1; });
  for (const WalkDim& d : dims) {
    if (d.size <= 0) return OkStatus();
  }
  if (dims.empty()) dims.push_back({1, 1, 1});
  // Merge an outer dim into its inner neighbour when both sides are contiguous across them.
  std::vector<WalkDim> merged = std::move(dims);
  for (size_t i = merged.size(); i-- > 1;) {
    WalkDim& outer = merged[i - 1];
    const WalkDim& inner = merged[i];
    if (outer.g == inner.size * inner.g && outer.d == inner.size * inner.d) {
      outer = {outer.size * inner.size, inner.g, inner.d};
      merged.erase(merged.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
  const WalkDim inner = merged.back();
  merged.pop_back();
  const uint64_t per_chunk = std::max<uint64_t>(1, internal::kDigestChunkBytes / es);
  std::vector<int64_t> idx(merged.size(), 0);
  int64_t goff = 0, doff = 0;
  for (;;) {
    for (int64_t start = 0; start < inner.size; start += static_cast<int64_t>(per_chunk)) {
      const int64_t n = std::min<int64_t>(static_cast<int64_t>(per_chunk), inner.size - start);
      DigestChunk c;
      c.addr = addr + static_cast<uint64_t>((doff + start * inner.d) * static_cast<int64_t>(es));
      c.gindex = gbase + static_cast<uint64_t>(goff + start * inner.g);
      c.dstride = inner.d;
      c.gstride = inner.g;
      c.count = static_cast<uint32_t>(n);
      c.slot = slot;
      c.elem_size = static_cast<uint8_t>(es);
      c.mode = mode;
      out->push_back(c);
      *elements += static_cast<uint64_t>(n);
    }
    if (out->size() > kMaxChunks) {
      return InvalidArgument(fmt::format("digest walk needs more than {} chunks (element-wise strides?)", kMaxChunks));
    }
    size_t d = merged.size();
    for (;;) {
      if (d == 0) return OkStatus();
      --d;
      if (++idx[d] < merged[d].size) {
        goff += merged[d].g;
        doff += merged[d].d;
        break;
      }
      goff -= merged[d].g * (merged[d].size - 1);
      doff -= merged[d].d * (merged[d].size - 1);
      idx[d] = 0;
    }
  }
}


struct FusedDim {
  int64_t size, g, d, s;  // extent, global index stride, live stride, staging stride (elements)
};

// Appends the fused runs of one copy: the walk over its view dims (outer to inner), the staging
// side dense (the innermost walked dim has staging stride 1 by construction).
Status AddFusedWalk(std::vector<FusedDim> dims, uint64_t gbase, uint64_t dst, uint64_t src, uint32_t es, uint8_t mode,
                    uint32_t slot, uint8_t digest, std::vector<FusedChunk>* out, uint64_t* elements) {
  std::erase_if(dims, [](const FusedDim& d) { return d.size == 1; });
  for (const FusedDim& d : dims) {
    if (d.size <= 0) return OkStatus();
  }
  if (dims.empty()) dims.push_back({1, 1, 1, 1});
  for (size_t i = dims.size(); i-- > 1;) {
    FusedDim& outer = dims[i - 1];
    const FusedDim& inner = dims[i];
    if (outer.g == inner.size * inner.g && outer.d == inner.size * inner.d && outer.s == inner.size * inner.s) {
      outer = {outer.size * inner.size, inner.g, inner.d, inner.s};
      dims.erase(dims.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
  const FusedDim inner = dims.back();
  dims.pop_back();
  if (inner.s != 1) return Internal(fmt::format("fused install walk: innermost staging stride {} is not 1", inner.s));
  const uint64_t per_chunk = std::max<uint64_t>(1, internal::kDigestChunkBytes / es);
  std::vector<int64_t> idx(dims.size(), 0);
  int64_t goff = 0, doff = 0, soff = 0;
  for (;;) {
    for (int64_t start = 0; start < inner.size; start += static_cast<int64_t>(per_chunk)) {
      const int64_t n = std::min<int64_t>(static_cast<int64_t>(per_chunk), inner.size - start);
      FusedChunk c;
      c.src = src + static_cast<uint64_t>((soff + start) * static_cast<int64_t>(es));
      c.dst = dst + static_cast<uint64_t>((doff + start * inner.d) * static_cast<int64_t>(es));
      c.gindex = gbase + static_cast<uint64_t>(goff + start * inner.g);
      c.dstride = inner.d;
      c.gstride = inner.g;
      c.count = static_cast<uint32_t>(n);
      c.slot = slot;
      c.elem_size = static_cast<uint8_t>(es);
      c.mode = mode;
      c.digest = digest;
      out->push_back(c);
      if (digest) *elements += static_cast<uint64_t>(n);
    }
    if (out->size() > kMaxChunks) {
      return InvalidArgument(fmt::format("fused install walk needs more than {} chunks", kMaxChunks));
    }
    size_t d = dims.size();
    for (;;) {
      if (d == 0) return OkStatus();
      --d;
      if (++idx[d] < dims[d].size) {
        goff += dims[d].g;
        doff += dims[d].d;
        soff += dims[d].s;
        break;
      }
      goff -= dims[d].g * (dims[d].size - 1);
      doff -= dims[d].d * (dims[d].size - 1);
      soff -= dims[d].s * (dims[d].size - 1);
      idx[d] = 0;
    }
  }
}

}  // namespace

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

std::string DeviceDescription(int device) {
  cudaDeviceProp p{};
  const cudaError_t e = cudaGetDeviceProperties(&p, device);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return fmt::format("device {}: {}", device, CudaText(e));
  }
  return fmt::format("{} (sm_{}{}, {:.1f} GiB)", p.name, p.major, p.minor,
                     static_cast<double>(p.totalGlobalMem) / (1ull << 30));
}

bool CanAccessPeer(int a, int b) {
  int can = 0;
  if (cudaDeviceCanAccessPeer(&can, a, b) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return can != 0;
}

DeviceBuffer::~DeviceBuffer() {
  if (data_ != nullptr) {
    DeviceGuard guard(device_);
    (void)cudaFree(data_);
  }
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)), device_(std::exchange(o.device_, -1)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    DeviceBuffer old(std::move(*this));
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    device_ = std::exchange(o.device_, -1);
  }
  return *this;
}

Result<DeviceBuffer> DeviceBuffer::Allocate(int device, uint64_t bytes) {
  DeviceGuard guard(device);
  RC_RETURN_IF_ERROR(guard.status(device));
  DeviceBuffer b;
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, std::max<uint64_t>(bytes, 1));
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return Unavailable(fmt::format("cudaMalloc of {} bytes ({:.2f} GiB) on device {}: {}", bytes,
                                   static_cast<double>(bytes) / (1ull << 30), device, CudaText(e)));
  }
  b.data_ = static_cast<std::byte*>(p);
  b.size_ = bytes;
  b.device_ = device;
  return b;
}

Status CopyToHost(void* host_dst, const void* device_src, uint64_t bytes, int device) {
  DeviceGuard guard(device);
  RC_RETURN_IF_ERROR(guard.status(device));
  return CheckCuda(cudaMemcpy(host_dst, device_src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy device -> host");
}

Status CopyToDevice(void* device_dst, const void* host_src, uint64_t bytes, int device) {
  DeviceGuard guard(device);
  RC_RETURN_IF_ERROR(guard.status(device));
  return CheckCuda(cudaMemcpy(device_dst, host_src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy host -> device");
}

Status FillBytes(void* device_dst, uint8_t value, uint64_t bytes, int device) {
  DeviceGuard guard(device);
  RC_RETURN_IF_ERROR(guard.status(device));
  RC_RETURN_IF_ERROR(CheckCuda(cudaMemset(device_dst, value, bytes), "cudaMemset"));
  return CheckCuda(cudaDeviceSynchronize(), "cudaMemset");
}

Result<double> CopyOnDevice(std::span<const DeviceCopy> copies, int device) {
  DeviceGuard guard(device);
  RC_RETURN_IF_ERROR(guard.status(device));
  std::vector<internal::CopyChunk> chunks;
  for (const DeviceCopy& c : copies) {
    for (uint64_t off = 0; off < c.bytes; off += internal::kCopyChunkBytes) {
      chunks.push_back({reinterpret_cast<uint64_t>(c.src) + off, reinterpret_cast<uint64_t>(c.dst) + off,
                        std::min<uint64_t>(internal::kCopyChunkBytes, c.bytes - off)});
    }
  }
  if (chunks.empty()) return 0.0;
  RC_ASSIGN_OR_RETURN(DeviceBuffer table, DeviceBuffer::Allocate(device, chunks.size() * sizeof(internal::CopyChunk)));
  RC_RETURN_IF_ERROR(CheckCuda(cudaMemcpy(table.data(), chunks.data(), table.size(), cudaMemcpyHostToDevice),
                           "uploading the copy table"));
  EventTimer timer;
  RC_RETURN_IF_ERROR(CheckCuda(internal::LaunchCopyChunks(reinterpret_cast<const internal::CopyChunk*>(table.data()),
                                                      chunks.size(), nullptr),
                           "copy kernel launch"));
  return timer.Stop();
}

Result<double> TimedMemcpy(void* dst, int dst_device, const void* src, int src_device, uint64_t bytes) {
  DeviceGuard guard(dst_device);
  RC_RETURN_IF_ERROR(guard.status(dst_device));
  EventTimer timer;
  const cudaError_t e = dst_device == src_device
                            ? cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, nullptr)
                            : cudaMemcpyPeerAsync(dst, dst_device, src, src_device, bytes, nullptr);
  RC_RETURN_IF_ERROR(CheckCuda(e, fmt::format("memcpy of {} bytes from device {} to {}", bytes, src_device, dst_device)));
  return timer.Stop();
}

Status ConvertOnDevice(DType from, const void* src, DType to, void* dst, int64_t n, int device) {
  if (!refit::IsConversionSupported(from, to)) {
    return InvalidArgument(fmt::format("no conversion from {} to {} on the GPU (supported: identical, bf16<->f32, "
                                       "f16<->f32)",
                                       refit::DTypeName(from), refit::DTypeName(to)));
  }
  DeviceGuard guard(device);
  RC_RETURN_IF_ERROR(guard.status(device));
  RC_RETURN_IF_ERROR(CheckCuda(internal::LaunchConvert(src, static_cast<uint8_t>(from), dst, static_cast<uint8_t>(to), n,
                                                   nullptr),
                           "conversion kernel"));
  return CheckCuda(cudaDeviceSynchronize(), "conversion kernel");
}

Status FillSeeded(int device, void* dst, DType dtype, uint64_t key, const refit::Shape& tensor_shape,
                  const refit::Box& box) {
  if (box.ndim() != tensor_shape.size() || !refit::Contains(refit::FullBox(tensor_shape), box)) {
    return InvalidArgument(fmt::format("seeded fill: box {} is not inside shape {}", refit::BoxToString(box),
                                       refit::ShapeToString(tensor_shape)));
  }
  if (box.ndim() > static_cast<size_t>(internal::kMaxKernelDims)) {
    return InvalidArgument(fmt::format("seeded fill: {} dims (at most {})", box.ndim(), internal::kMaxKernelDims));
  }
  internal::FillArgs a;
  a.dst = reinterpret_cast<uint64_t>(dst);
  a.key = key;
  a.n = box.numel();
  a.dtype = static_cast<uint8_t>(dtype);
  a.elem_size = static_cast<uint8_t>(refit::DTypeSize(dtype));
  a.ndims = static_cast<int32_t>(box.ndim());
  const refit::Shape g = refit::RowMajorStrides(tensor_shape);
  for (size_t d = 0; d < box.ndim(); ++d) {
    a.extent[d] = box.extent[d];
    a.gstride[d] = g[d];
    a.gbase += box.start[d] * g[d];
  }
  DeviceGuard guard(device);
  RC_RETURN_IF_ERROR(guard.status(device));
  return CheckCuda(internal::LaunchSeededFill(a, nullptr), "seeded fill kernel");
}

// ---- DeviceDigest ---------------------------------------------------------------------------------

}  // namespace rc::cuda

namespace rc::cuda::internal {

Result<DigestTable> BuildBlockDigestTable(std::span<const DeviceBlock> blocks) {
  DigestTable table;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const DeviceBlock& b = blocks[i];
    if (b.box.ndim() != b.tensor_shape.size() || !refit::Contains(refit::FullBox(b.tensor_shape), b.box)) {
      return InvalidArgument(fmt::format("tensor {}: block {} is not inside shape {}", b.tensor,
                                         refit::BoxToString(b.box), refit::ShapeToString(b.tensor_shape)));
    }
    if (b.data == nullptr && b.box.numel() > 0) return InvalidArgument(fmt::format("tensor {}: null block data", b.tensor));
    const refit::Shape g = refit::RowMajorStrides(b.tensor_shape);
    const refit::Shape l = refit::RowMajorStrides(b.box.extent);
    std::vector<WalkDim> dims;
    int64_t gbase = 0;
    for (size_t d = 0; d < b.box.ndim(); ++d) {
      dims.push_back({b.box.extent[d], g[d], l[d]});
      gbase += b.box.start[d] * g[d];
    }
    table.slot_tensors.push_back(b.tensor);
    if (b.box.numel() == 0) continue;
    RC_RETURN_IF_ERROR(AddWalk(std::move(dims), static_cast<uint64_t>(gbase), reinterpret_cast<uint64_t>(b.data),
                               static_cast<uint32_t>(refit::DTypeSize(b.dtype)), kBitsRaw, static_cast<uint32_t>(i),
                               &table.chunks, &table.elements)
                           .WithContext(fmt::format("tensor {}", b.tensor)));
  }
  return table;
}

Result<DigestTable> BuildInstalledDigestTable(const refit::Capture& capture, const refit::DestinationBuffers& buffers,
                                              std::span<const refit::DigestRegion> regions) {
  DigestTable table;
  std::unordered_map<std::string, uint32_t> slot_of;
  for (const refit::DigestRegion& region : regions) {
    if (region.copy >= capture.copies.size()) {
      return InvalidArgument(fmt::format("copy index {} out of range", region.copy));
    }
    const refit::CapturedCopy& c = capture.copies[region.copy];
    if (!refit::Contains(c.box, region.box)) {
      return InvalidArgument(fmt::format("tensor {}: digest region {} is outside the copy's box {}", c.source,
                                         refit::BoxToString(region.box), refit::BoxToString(c.box)));
    }
    const refit::TensorSpec& p = capture.params[c.param];
    auto it = buffers.find(p.name);
    if (it == buffers.end() || it->second.size() != p.bytes()) {
      return FailedPrecondition(fmt::format("destination {}: no installed buffer of {} bytes", p.name, p.bytes()));
    }
    auto [slot_it, inserted] = slot_of.emplace(c.source, static_cast<uint32_t>(table.slot_tensors.size()));
    if (inserted) table.slot_tensors.push_back(c.source);
    if (region.box.numel() == 0) continue;
    const size_t n = c.box.ndim();
    const refit::Shape g = refit::RowMajorStrides(c.source_shape);
    refit::Shape ds(n, 0);
    for (size_t k = 0; k < c.view_to_source.size(); ++k) {
      if (c.view_to_source[k] >= 0) ds[static_cast<size_t>(c.view_to_source[k])] = c.dest_strides[k];
    }
    int64_t gbase = 0, dbase = c.dest_offset;
    std::vector<WalkDim> dims;
    for (size_t s = 0; s < n; ++s) {
      gbase += region.box.start[s] * g[s];
      dbase += (region.box.start[s] - c.box.start[s]) * ds[s];
      dims.push_back({region.box.extent[s], g[s], ds[s]});
    }
    const uint32_t es = static_cast<uint32_t>(refit::DTypeSize(p.dtype));
    const uint64_t addr = reinterpret_cast<uint64_t>(it->second.data()) + static_cast<uint64_t>(dbase) * es;
    RC_RETURN_IF_ERROR(AddWalk(std::move(dims), static_cast<uint64_t>(gbase), addr, es,
                               BitsModeFor(c.source_dtype, p.dtype), slot_it->second, &table.chunks, &table.elements)
                           .WithContext(fmt::format("tensor {}", c.source)));
  }
  return table;
}

Result<FusedInstallTable> BuildFusedInstallTable(const refit::Capture& live, const refit::DestinationBuffers& live_buffers,
                                                 const refit::Capture& staging,
                                                 const refit::DestinationBuffers& staging_buffers,
                                                 std::span<const refit::DigestRegion> regions) {
  if (live.copies.size() != staging.copies.size()) {
    return InvalidArgument(fmt::format("fused install: {} live copies but {} staging copies", live.copies.size(),
                                       staging.copies.size()));
  }
  FusedInstallTable t;
  std::unordered_map<std::string, uint32_t> slot_of;
  auto slot = [&](const std::string& tensor) {
    auto [it, inserted] = slot_of.emplace(tensor, static_cast<uint32_t>(t.slot_tensors.size()));
    if (inserted) t.slot_tensors.push_back(tensor);
    return it->second;
  };
  std::vector<std::vector<const refit::DigestRegion*>> owned(live.copies.size());
  for (const refit::DigestRegion& r : regions) {
    if (r.copy >= live.copies.size()) return InvalidArgument(fmt::format("copy index {} out of range", r.copy));
    owned[r.copy].push_back(&r);
  }
  // Live destination intervals per parameter: overlapping copies would race in one launch.
  std::map<uint32_t, std::vector<std::pair<int64_t, int64_t>>> intervals;
  std::vector<refit::DigestRegion> digest_only;
  for (size_t i = 0; i < live.copies.size(); ++i) {
    const refit::CapturedCopy& c = live.copies[i];
    const refit::CapturedCopy& sc = staging.copies[i];
    if (sc.source != c.source || sc.box.start != c.box.start || sc.box.extent != c.box.extent ||
        sc.view_to_source != c.view_to_source || sc.dest_shape != c.dest_shape) {
      return InvalidArgument(fmt::format("fused install: staging copy {} ({}) is not live copy {} ({})", i, sc.source,
                                         i, c.source));
    }
    const refit::TensorSpec& p = live.params[c.param];
    const refit::TensorSpec& sp = staging.params[sc.param];
    if (p.dtype != sp.dtype) {
      return InvalidArgument(fmt::format("fused install: copy {} stages {} into {} of {}", i, refit::DTypeName(sp.dtype),
                                         p.name, refit::DTypeName(p.dtype)));
    }
    auto lit = live_buffers.find(p.name);
    if (lit == live_buffers.end() || lit->second.size() != p.bytes()) {
      return FailedPrecondition(fmt::format("destination {}: no installed buffer of {} bytes", p.name, p.bytes()));
    }
    auto sit = staging_buffers.find(sp.name);
    if (sit == staging_buffers.end() || sit->second.size() != sp.bytes()) {
      return FailedPrecondition(fmt::format("staging {}: no buffer of {} bytes", sp.name, sp.bytes()));
    }
    const size_t nd = c.dest_shape.size();
    if (c.dest_strides.size() != nd || c.view_to_source.size() != nd) {
      return InvalidArgument(fmt::format("copy {} of {}: dest shape/strides/view dims disagree", i, c.source));
    }
    int64_t numel = 1, hi = c.dest_offset;
    for (size_t k = 0; k < nd; ++k) {
      numel *= c.dest_shape[k];
      if (c.dest_strides[k] < 0) {
        return FailedPrecondition(fmt::format("copy {} of {}: negative live stride {}", i, c.source, c.dest_strides[k]));
      }
      if (c.dest_shape[k] > 0) hi += (c.dest_shape[k] - 1) * c.dest_strides[k];
    }
    const uint32_t s = slot(c.source);
    if (numel == 0) continue;
    if (c.dest_offset < 0 || (hi + 1) * static_cast<int64_t>(refit::DTypeSize(p.dtype)) > static_cast<int64_t>(p.bytes())) {
      return InvalidArgument(fmt::format("copy {} of {}: live elements [{}, {}] outside {} ({} bytes)", i, c.source,
                                         c.dest_offset, hi, p.name, p.bytes()));
    }
    intervals[c.param].push_back({c.dest_offset, hi});
    const bool whole = owned[i].size() == 1 && owned[i][0]->box.start == c.box.start &&
                       owned[i][0]->box.extent == c.box.extent;
    if (!whole) {
      for (const refit::DigestRegion* r : owned[i]) digest_only.push_back(*r);
    }
    const refit::Shape g = refit::RowMajorStrides(c.source_shape);
    const refit::Shape dense = refit::RowMajorStrides(c.dest_shape);
    int64_t gbase = 0;
    for (size_t src_dim = 0; src_dim < c.box.ndim(); ++src_dim) gbase += c.box.start[src_dim] * g[src_dim];
    std::vector<FusedDim> dims;
    for (size_t k = 0; k < nd; ++k) {
      const int32_t sd = c.view_to_source[k];
      dims.push_back({c.dest_shape[k], sd >= 0 ? g[static_cast<size_t>(sd)] : 0, c.dest_strides[k], dense[k]});
    }
    const uint32_t es = static_cast<uint32_t>(refit::DTypeSize(p.dtype));
    RC_RETURN_IF_ERROR(AddFusedWalk(std::move(dims), static_cast<uint64_t>(gbase),
                                    reinterpret_cast<uint64_t>(lit->second.data()) +
                                        static_cast<uint64_t>(c.dest_offset) * es,
                                    reinterpret_cast<uint64_t>(sit->second.data()), es,
                                    BitsModeFor(c.source_dtype, p.dtype), s, whole ? 1 : 0, &t.chunks, &t.elements)
                           .WithContext(fmt::format("tensor {}", c.source)));
    t.bytes += static_cast<uint64_t>(numel) * es;
  }
  for (auto& [param, iv] : intervals) {
    std::sort(iv.begin(), iv.end());
    for (size_t k = 1; k < iv.size(); ++k) {
      if (iv[k].first <= iv[k - 1].second) {
        return FailedPrecondition(fmt::format(
            "fused install: two copies write overlapping elements of {} ([{}, {}] and [{}, {}]); one launch would race",
            live.params[param].name, iv[k - 1].first, iv[k - 1].second, iv[k].first, iv[k].second));
      }
    }
  }
  // Copies owned only in part (the same source elements installed twice): digest their owned
  // sub-boxes from staging, which holds exactly the bytes the copy writes.
  if (!digest_only.empty()) {
    RC_ASSIGN_OR_RETURN(t.digest_only, BuildInstalledDigestTable(staging, staging_buffers, digest_only));
    for (DigestChunk& dc : t.digest_only.chunks) dc.slot = slot(t.digest_only.slot_tensors[dc.slot]);
    t.elements += t.digest_only.elements;
    t.digest_only.slot_tensors.clear();
  }
  return t;
}

// Both evaluations run the kernels' own per-thread work (ChunkPart, digest_chunk.h) for every
// thread of each chunk's block in turn.
std::vector<uint64_t> EvaluateFusedInstallOnHost(const FusedInstallTable& table) {
  std::vector<uint64_t> sums(table.slot_tensors.size(), 0);
  for (const FusedChunk& c : table.chunks) {
    uint64_t sum = 0;
    for (uint32_t t = 0; t < static_cast<uint32_t>(kDigestThreads); ++t) sum += ChunkThreadSum(c, t, kDigestThreads);
    if (c.digest) sums[c.slot] += sum;
  }
  for (const DigestChunk& c : table.digest_only.chunks) {
    for (uint32_t t = 0; t < static_cast<uint32_t>(kDigestThreads); ++t) {
      sums[c.slot] += ChunkThreadSum(c, t, kDigestThreads);
    }
  }
  return sums;
}

std::vector<uint64_t> EvaluateDigestTableOnHost(const DigestTable& table) {
  std::vector<uint64_t> sums(table.slot_tensors.size(), 0);
  for (const DigestChunk& c : table.chunks) {
    for (uint32_t t = 0; t < static_cast<uint32_t>(kDigestThreads); ++t) {
      sums[c.slot] += ChunkThreadSum(c, t, kDigestThreads);
    }
  }
  return sums;
}

}  // namespace rc::cuda::internal

namespace rc::cuda {

Result<DeviceDigest> DeviceDigest::Upload(internal::DigestTable table, int device) {
  DeviceDigest dd;
  dd.device_ = device;
  dd.chunk_count_ = table.chunks.size();
  dd.elements_ = table.elements;
  dd.slot_tensors_ = std::move(table.slot_tensors);
  RC_ASSIGN_OR_RETURN(dd.chunks_, DeviceBuffer::Allocate(device, table.chunks.size() * sizeof(DigestChunk)));
  RC_ASSIGN_OR_RETURN(dd.sums_, DeviceBuffer::Allocate(device, std::max<size_t>(1, dd.slot_tensors_.size()) * 8));
  if (!table.chunks.empty()) {
    RC_RETURN_IF_ERROR(CopyToDevice(dd.chunks_.data(), table.chunks.data(), dd.chunks_.size(), device));
  }
  return dd;
}

Result<DeviceDigest> DeviceDigest::ForBlocks(std::span<const DeviceBlock> blocks, int device) {
  RC_ASSIGN_OR_RETURN(internal::DigestTable table, internal::BuildBlockDigestTable(blocks));
  return Upload(std::move(table), device);
}

Result<DeviceDigest> DeviceDigest::ForInstalled(const refit::Capture& capture, const refit::DestinationBuffers& buffers,
                                                std::span<const refit::DigestRegion> regions, int device) {
  RC_ASSIGN_OR_RETURN(internal::DigestTable table, internal::BuildInstalledDigestTable(capture, buffers, regions));
  return Upload(std::move(table), device);
}

Result<std::vector<uint64_t>> DeviceDigest::RunSlots(double* kernel_ms) {
  DeviceGuard guard(device_);
  RC_RETURN_IF_ERROR(guard.status(device_));
  std::vector<uint64_t> sums(slot_tensors_.size(), 0);
  if (sums.empty()) return sums;
  RC_RETURN_IF_ERROR(CheckCuda(cudaMemsetAsync(sums_.data(), 0, sums.size() * 8, nullptr), "cudaMemset"));
  EventTimer timer;
  RC_RETURN_IF_ERROR(CheckCuda(internal::LaunchDigest(reinterpret_cast<const DigestChunk*>(chunks_.data()), chunk_count_,
                                                  reinterpret_cast<uint64_t*>(sums_.data()), nullptr),
                           "digest kernel launch"));
  RC_ASSIGN_OR_RETURN(double ms, timer.Stop());
  if (kernel_ms != nullptr) *kernel_ms = ms;
  RC_RETURN_IF_ERROR(CheckCuda(cudaMemcpy(sums.data(), sums_.data(), sums.size() * 8, cudaMemcpyDeviceToHost),
                           "digest kernel"));
  return sums;
}

Result<refit::TensorDigests> DeviceDigest::Run(double* kernel_ms) {
  RC_ASSIGN_OR_RETURN(std::vector<uint64_t> sums, RunSlots(kernel_ms));
  refit::TensorDigests out;
  for (size_t i = 0; i < sums.size(); ++i) out[slot_tensors_[i]] += sums[i];
  return out;
}

// ---- DeviceInstall --------------------------------------------------------------------------------

Result<DeviceInstall> DeviceInstall::Prepare(const refit::Capture& live, const refit::DestinationBuffers& live_buffers,
                                             const refit::Capture& staging,
                                             const refit::DestinationBuffers& staging_buffers,
                                             std::span<const refit::DigestRegion> regions, int device) {
  RC_ASSIGN_OR_RETURN(internal::FusedInstallTable t,
                      internal::BuildFusedInstallTable(live, live_buffers, staging, staging_buffers, regions));
  DeviceInstall di;
  di.device_ = device;
  di.chunk_count_ = t.chunks.size();
  di.digest_chunk_count_ = t.digest_only.chunks.size();
  di.bytes_ = t.bytes;
  di.elements_ = t.elements;
  di.slot_tensors_ = std::move(t.slot_tensors);
  RC_ASSIGN_OR_RETURN(di.chunks_, DeviceBuffer::Allocate(device, std::max<size_t>(1, t.chunks.size()) * sizeof(internal::FusedChunk)));
  RC_ASSIGN_OR_RETURN(di.digest_chunks_,
                      DeviceBuffer::Allocate(device, std::max<size_t>(1, t.digest_only.chunks.size()) * sizeof(internal::DigestChunk)));
  RC_ASSIGN_OR_RETURN(di.sums_, DeviceBuffer::Allocate(device, std::max<size_t>(1, di.slot_tensors_.size()) * 8));
  if (!t.chunks.empty()) {
    RC_RETURN_IF_ERROR(CopyToDevice(di.chunks_.data(), t.chunks.data(), t.chunks.size() * sizeof(internal::FusedChunk), device));
  }
  if (!t.digest_only.chunks.empty()) {
    RC_RETURN_IF_ERROR(CopyToDevice(di.digest_chunks_.data(), t.digest_only.chunks.data(),
                                    t.digest_only.chunks.size() * sizeof(internal::DigestChunk), device));
  }
  return di;
}

Result<refit::TensorDigests> DeviceInstall::Run(double* kernel_ms) {
  DeviceGuard guard(device_);
  RC_RETURN_IF_ERROR(guard.status(device_));
  std::vector<uint64_t> sums(slot_tensors_.size(), 0);
  if (!sums.empty()) RC_RETURN_IF_ERROR(CheckCuda(cudaMemsetAsync(sums_.data(), 0, sums.size() * 8, nullptr), "cudaMemset"));
  EventTimer timer;
  if (chunk_count_ > 0) {
    RC_RETURN_IF_ERROR(CheckCuda(internal::LaunchFusedInstall(reinterpret_cast<const internal::FusedChunk*>(chunks_.data()),
                                                          chunk_count_, reinterpret_cast<uint64_t*>(sums_.data()), nullptr),
                             "fused install kernel launch"));
  }
  if (digest_chunk_count_ > 0) {
    RC_RETURN_IF_ERROR(CheckCuda(internal::LaunchDigest(reinterpret_cast<const internal::DigestChunk*>(digest_chunks_.data()),
                                                    digest_chunk_count_, reinterpret_cast<uint64_t*>(sums_.data()), nullptr),
                             "digest kernel launch (partly owned copies)"));
  }
  RC_ASSIGN_OR_RETURN(double ms, timer.Stop());
  if (kernel_ms != nullptr) *kernel_ms = ms;
  if (!sums.empty()) {
    RC_RETURN_IF_ERROR(CheckCuda(cudaMemcpy(sums.data(), sums_.data(), sums.size() * 8, cudaMemcpyDeviceToHost),
                             "fused install kernel"));
  }
  refit::TensorDigests out;
  for (size_t i = 0; i < sums.size(); ++i) out[slot_tensors_[i]] += sums[i];
  return out;
}

Result<double> TimedReadSweep(const void* src, uint64_t bytes, int device) {
  DeviceGuard guard(device);
  RC_RETURN_IF_ERROR(guard.status(device));
  RC_ASSIGN_OR_RETURN(DeviceBuffer sink, DeviceBuffer::Allocate(device, 8));
  RC_RETURN_IF_ERROR(CheckCuda(cudaMemset(sink.data(), 0, 8), "cudaMemset"));
  EventTimer timer;
  RC_RETURN_IF_ERROR(CheckCuda(internal::LaunchReadSweep(src, bytes, reinterpret_cast<uint64_t*>(sink.data()), nullptr),
                           fmt::format("read sweep of {} bytes", bytes)));
  return timer.Stop();
}

// ---- ExecutePlanOnDevice --------------------------------------------------------------------------

namespace {

// The view replay of an install step as kernel arguments (refit/geometry.cc CopyViewFromBlock).
Result<internal::ViewCopyArgs> ViewCopyFor(const refit::InstallStep& in, const std::byte* staging, std::byte* param) {
  internal::ViewCopyArgs a;
  const refit::Shape block_strides = refit::RowMajorStrides(in.block.extent);
  int64_t src_base = 0;
  for (size_t s = 0; s < in.block.ndim(); ++s) src_base += (in.box.start[s] - in.block.start[s]) * block_strides[s];
  a.n = 1;
  for (size_t k = 0; k < in.view_to_source.size(); ++k) {
    const int32_t s = in.view_to_source[k];
    if (s < 0) continue;
    const int64_t size = in.box.extent[static_cast<size_t>(s)];
    if (size == 0) {
      a.n = 0;
      return a;
    }
    if (size == 1) continue;
    if (a.ndims == internal::kMaxKernelDims) {
      return InvalidArgument(fmt::format("tensor {}: view has more than {} dims", in.source, internal::kMaxKernelDims));
    }
    a.size[a.ndims] = size;
    a.sstride[a.ndims] = block_strides[static_cast<size_t>(s)];
    a.dstride[a.ndims] = in.dest_strides[k];
    ++a.ndims;
    a.n *= size;
  }
  const size_t ses = refit::DTypeSize(in.source_dtype), des = refit::DTypeSize(in.param_dtype);
  a.src = reinterpret_cast<uint64_t>(staging + src_base * static_cast<int64_t>(ses));
  a.dst = reinterpret_cast<uint64_t>(param + in.dest_offset * static_cast<int64_t>(des));
  a.src_dtype = static_cast<uint8_t>(in.source_dtype);
  a.dst_dtype = static_cast<uint8_t>(in.param_dtype);
  return a;
}

// Device memory of one GPU for the shared wave loop (refit::ExecuteWaves): staging is one
// cudaMalloc per wave, install steps are view-copy kernels (one launch per step, then one sync).
class DevicePlanMemory final : public refit::PlanMemory {
 public:
  explicit DevicePlanMemory(int device) : device_(device) {}
  std::string_view buffer_noun() const override { return "device buffer"; }
  uint64_t staging_alignment() const override { return 256; }
  Result<std::byte*> AllocateStaging(uint64_t bytes) override {
    staging_ = DeviceBuffer();  // the previous wave's staging first: its steps have run
    RC_ASSIGN_OR_RETURN(staging_, DeviceBuffer::Allocate(device_, bytes));
    return staging_.data();
  }
  Status Install(const refit::TransferPlan& plan, size_t begin, size_t end, std::span<std::byte* const> ptr) override {
    for (size_t s = begin; s < end; ++s) {
      const refit::InstallStep& in = plan.installs[s];
      RC_ASSIGN_OR_RETURN(internal::ViewCopyArgs a, ViewCopyFor(in, ptr[in.staging], ptr[in.param]));
      RC_RETURN_IF_ERROR(CheckCuda(internal::LaunchViewCopy(a, nullptr), fmt::format("install of {}", in.source)));
    }
    return CheckCuda(cudaDeviceSynchronize(), "install kernels");
  }
  Status CopyToHost(void* dst, const std::byte* src, uint64_t n) override {
    return cuda::CopyToHost(dst, src, n, device_);
  }
  Result<refit::TensorDigests> Digest(const refit::Capture& capture, const refit::DestinationBuffers& buffers,
                                      std::span<const refit::DigestRegion> regions) override {
    RC_ASSIGN_OR_RETURN(DeviceDigest d, DeviceDigest::ForInstalled(capture, buffers, regions, device_));
    return d.Run();
  }

 private:
  const int device_;
  DeviceBuffer staging_;
};

}  // namespace

Result<std::unique_ptr<PlanImports>> PlanImports::Import(const refit::TransferPlan& plan,
                                                         transport::Transport& transport) {
  auto imports = std::unique_ptr<PlanImports>(new PlanImports(transport));
  imports->cache_ = std::make_unique<refit::ImportCache>(transport);
  RC_ASSIGN_OR_RETURN(imports->remotes_, refit::ImportPlanSources(plan, *imports->cache_));
  return imports;
}

PlanImports::~PlanImports() = default;  // the cache releases every import

bool EnablePeerAccess(int from, int to) {
  if (from == to) return true;
  if (!CanAccessPeer(from, to)) return false;
  DeviceGuard guard(from);
  const cudaError_t e = cudaDeviceEnablePeerAccess(to, 0);
  (void)cudaGetLastError();
  return e == cudaSuccess || e == cudaErrorPeerAccessAlreadyEnabled;
}

Result<refit::ExecuteStats> ExecutePlanOnDevice(const refit::TransferPlan& plan, transport::Transport& transport,
                                                const refit::DestinationBuffers& params,
                                                const DeviceExecuteOptions& options) {
  if (!transport.capabilities().device_memory) {
    return FailedPrecondition(fmt::format("transport {} cannot move device memory (use cuda_ipc or nccl)",
                                          transport.name()));
  }
  RC_ASSIGN_OR_RETURN(std::unique_ptr<PlanImports> imports, PlanImports::Import(plan, transport));
  return ExecutePlanOnDevice(plan, *imports, params, options);
}

Result<refit::ExecuteStats> ExecutePlanOnDevice(const refit::TransferPlan& plan, const PlanImports& imports,
                                                const refit::DestinationBuffers& params,
                                                const DeviceExecuteOptions& options) {
  return ExecutePlanOnDevice(plan, imports.transport(), imports.remotes(), params, options);
}

Result<refit::ExecuteStats> ExecutePlanOnDevice(const refit::TransferPlan& plan, transport::Transport& transport,
                                                std::span<const transport::RemoteMemory> remotes,
                                                const refit::DestinationBuffers& params,
                                                const DeviceExecuteOptions& options) {
  if (!transport.capabilities().device_memory) {
    return FailedPrecondition(fmt::format("transport {} cannot move device memory (use cuda_ipc or nccl)",
                                          transport.name()));
  }
  if (remotes.size() != plan.sources.size()) {
    return InvalidArgument(fmt::format("imports hold {} sources but the plan has {}", remotes.size(),
                                       plan.sources.size()));
  }
  DeviceGuard guard(options.device);
  RC_RETURN_IF_ERROR(guard.status(options.device));
  const int64_t deadline = transport.clock().NowNs() + options.timeout_ms * 1'000'000;
  DevicePlanMemory memory(options.device);
  return refit::ExecuteWaves(plan, transport, remotes, params, memory, deadline, options.max_staging_bytes);
}

// ---- GpuOwner -------------------------------------------------------------------------------------

GpuOwner::~GpuOwner() {
  if (transport_) {
    for (uint64_t id : registrations_) (void)transport_->Deregister(id);
  }
}

Result<std::unique_ptr<GpuOwner>> GpuOwner::Start(const GpuOwnerOptions& o) {
  auto owner = std::unique_ptr<GpuOwner>(new GpuOwner());
  transport::TransportOptions topts;
  topts.device = o.device;
  RC_ASSIGN_OR_RETURN(owner->transport_, transport::CreateTransport(o.transport, topts));
  RC_ASSIGN_OR_RETURN(refit::Manifest m, refit::MakeTrainerManifest(o.config, o.layout, o.version));
  m.model = o.config.name;
  // One allocation; shards 256-byte aligned inside it.
  std::vector<std::vector<uint64_t>> offsets(m.tables.size());
  uint64_t total = 0;
  for (size_t t = 0; t < m.tables.size(); ++t) {
    for (const refit::ShardInfo& s : m.tables[t].shards) {
      offsets[t].push_back(total);
      const uint64_t bytes = static_cast<uint64_t>(refit::NumElements(s.shape)) * refit::DTypeSize(m.tables[t].dtype);
      total += (bytes + 255) & ~uint64_t{255};
      owner->bytes_ += bytes;
    }
  }
  RC_ASSIGN_OR_RETURN(owner->arena_, DeviceBuffer::Allocate(o.device, total));
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<DeviceBlock> blocks;
  for (size_t t = 0; t < m.tables.size(); ++t) {
    refit::ShardTable& table = m.tables[t];
    const uint64_t key = SeededTensorKey(o.seed, table.name);
    for (size_t i = 0; i < table.shards.size(); ++i) {
      refit::ShardInfo& s = table.shards[i];
      std::byte* p = owner->arena_.data() + offsets[t][i];
      RC_RETURN_IF_ERROR(FillSeeded(o.device, p, table.dtype, key, table.shape, s.box())
                             .WithContext(fmt::format("tensor {} rank {}", table.name, s.rank)));
      blocks.push_back({table.name, table.dtype, table.shape, s.box(), p});
    }
  }
  {
    DeviceGuard guard(o.device);
    RC_RETURN_IF_ERROR(CheckCuda(cudaDeviceSynchronize(), "seeded fill"));
  }
  owner->fill_ms_ = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  RC_ASSIGN_OR_RETURN(DeviceDigest digest, DeviceDigest::ForBlocks(blocks, o.device));
  RC_ASSIGN_OR_RETURN(std::vector<uint64_t> sums, digest.RunSlots(&owner->digest_ms_));
  size_t k = 0;
  for (size_t t = 0; t < m.tables.size(); ++t) {
    refit::ShardTable& table = m.tables[t];
    for (size_t i = 0; i < table.shards.size(); ++i, ++k) {
      refit::ShardInfo& s = table.shards[i];
      s.digest = sums[k];
      const uint64_t bytes = static_cast<uint64_t>(refit::NumElements(s.shape)) * refit::DTypeSize(table.dtype);
      if (bytes == 0) continue;
      auto reg = owner->transport_->RegisterMemory(
          {owner->arena_.data() + offsets[t][i], bytes, transport::MemoryKind::kDevice, o.device});
      if (!reg.ok()) return reg.status().WithContext(fmt::format("registering tensor {} rank {}", table.name, s.rank));
      owner->registrations_.push_back(reg->id);
      s.handle = reg->descriptor;
    }
  }
  RC_ASSIGN_OR_RETURN(refit::TensorDigests per_tensor, refit::TensorDigestsFromShards(m));
  m.content_digest = refit::CombineTensorDigests(per_tensor);
  owner->manifest_ = std::move(m);
  owner->blocks_ = std::move(blocks);
  return owner;
}

}  // namespace rc::cuda
