#include <cuda.h>
#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <numeric>
#include <thread>
#include <unordered_map>
#include <vector>

#include "rolloutcore/base/log.h"
#include "rolloutcore/base/mutex.h"
#include "rolloutcore/transport/cuda_ipc.h"
#include "transport/cuda_ipc/cuda_ipc_descriptor.h"
#include "transport/common/core_transport.h"
#include "transport/common/descriptor_codec.h"
#include "transport/common/process.h"
#include "transport/common/socket_io.h"
#include "transport/common/transfer_base.h"
#include "transport/gpu_common.h"

namespace rc::transport {
namespace {

using cuda_ipc_internal::CudaIpcDescriptor;
using gpu_internal::CudaErrorText;
using gpu_internal::DeviceGuard;

using internal::SteadyNs;

// cuMemGetAddressRange through the runtime's driver entry point, so binaries need no link-time
// dependency on libcuda (the runtime loads the driver when a GPU is present).
using GetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

Result<GetAddressRangeFn> AddressRangeFn() {
  static GetAddressRangeFn fn = nullptr;
  static cudaError_t error = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    cudaError_t e = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 3020, cudaEnableDefault, &q);
    if (e == cudaSuccess && (q != cudaDriverEntryPointSuccess || p == nullptr)) e = cudaErrorSymbolNotFound;
    fn = reinterpret_cast<GetAddressRangeFn>(p);
    return e;
  }();
  if (error != cudaSuccess) {
    return Unavailable(fmt::format("cuda_ipc transport: cuMemGetAddressRange is not available: {}",
                                   CudaErrorText(error)));
  }
  return fn;
}

// The allocation containing `ptr`: base address and size.
Status AllocationOf(const void* ptr, uintptr_t* base, size_t* size) {
  RC_ASSIGN_OR_RETURN(GetAddressRangeFn fn, AddressRangeFn());
  CUdeviceptr b = 0;
  size_t s = 0;
  const CUresult r = fn(&b, &s, reinterpret_cast<CUdeviceptr>(ptr));
  if (r != CUDA_SUCCESS) {
    return InvalidArgument(fmt::format(
        "cuda_ipc transport: {} is not inside a cudaMalloc allocation of this process (cuMemGetAddressRange "
        "error {})",
        ptr, static_cast<int>(r)));
  }
  *base = static_cast<uintptr_t>(b);
  *size = s;
  return OkStatus();
}

// Registrations of this process, shared by every cuda_ipc transport in it (a same-process reader
// copies straight from the registered pointer).
struct OwnedRegion {
  const std::byte* ptr = nullptr;
  uint64_t length = 0;
  int32_t device = 0;
};

// Never destroyed: used until exit.
internal::RegionTable<OwnedRegion>& Owned() {
  static auto* table = new internal::RegionTable<OwnedRegion>();
  return *table;
}

// An imported region, as the reader sees it.
struct RemoteEntry {
  const std::byte* src = nullptr;  // address of the region's first byte in this process
  uint64_t length = 0;
  pid_t owner = 0;            // 0: this process
  uint64_t local_id = 0;      // this process: the Owned() id (checked at every post)
  std::string mapping_key;    // other process: key into Core::mappings_
  std::string descriptor;
};

struct Mapping {
  void* base = nullptr;
  size_t size = 0;
  int refs = 0;
};

class Core {
 public:
  Core(Clock* clock, int device, CudaIpcTransportOptions options)
      : clock_(clock), device_(device), options_(options) {}

  ~Core() {
    DeviceGuard guard(device_);
    for (auto& [key, m] : mappings_) {
      if (m.base != nullptr) (void)cudaIpcCloseMemHandle(m.base);
    }
    for (cudaStream_t s : streams_) (void)cudaStreamDestroy(s);
  }

  Status Init() {
    if (options_.streams < 1 || options_.streams > 64) {
      return InvalidArgument(fmt::format("cuda_ipc transport: streams must be in [1, 64], got {}", options_.streams));
    }
    DeviceGuard guard(device_);
    if (guard.status() != cudaSuccess) {
      return Unavailable(fmt::format("cuda_ipc transport: cannot use device {}: {}", device_,
                                     CudaErrorText(guard.status())));
    }
    for (int i = 0; i < options_.streams; ++i) {
      cudaStream_t s = nullptr;
      const cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
      if (e != cudaSuccess) {
        return Unavailable(fmt::format("cuda_ipc transport: cudaStreamCreate on device {}: {}", device_,
                                       CudaErrorText(e)));
      }
      streams_.push_back(s);
    }
    return OkStatus();
  }

  Clock& clock() const { return *clock_; }
  int device() const { return device_; }
  const CudaIpcTransportOptions& options() const { return options_; }

  Result<Registration> Register(const MemoryRegion& region) {
    if (region.kind != MemoryKind::kDevice) {
      return Unimplemented("cuda_ipc transport registers device memory only (use shm or ucx for host memory)");
    }
    if (region.addr == nullptr || region.length == 0) {
      return InvalidArgument(fmt::format("cuda_ipc transport: cannot register {} bytes at {}", region.length,
                                         region.addr));
    }
    int device = region.device;
    if (device < 0) {
      cudaPointerAttributes attr{};
      const cudaError_t e = cudaPointerGetAttributes(&attr, region.addr);
      if (e != cudaSuccess || attr.type != cudaMemoryTypeDevice) {
        return InvalidArgument(fmt::format("cuda_ipc transport: {} is not device memory and no device was given",
                                           region.addr));
      }
      device = attr.device;
    }
    DeviceGuard guard(device);
    if (guard.status() != cudaSuccess) {
      return InvalidArgument(fmt::format("cuda_ipc transport: region device {}: {}", device,
                                         CudaErrorText(guard.status())));
    }
    uintptr_t base = 0;
    size_t size = 0;
    RC_RETURN_IF_ERROR(AllocationOf(region.addr, &base, &size));
    const auto addr = reinterpret_cast<uintptr_t>(region.addr);
    if (addr + region.length > base + size) {
      return InvalidArgument(fmt::format(
          "cuda_ipc transport: region of {} bytes at {} runs past the end of its allocation ({} bytes at {:#x})",
          region.length, region.addr, size, base));
    }
    CudaIpcDescriptor d;
    cudaIpcMemHandle_t handle{};
    const cudaError_t e = cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base));
    if (e != cudaSuccess) {
      return InvalidArgument(fmt::format("cuda_ipc transport: cudaIpcGetMemHandle of allocation {:#x} on device {}: {}",
                                         base, device, CudaErrorText(e)));
    }
    static_assert(sizeof handle == cuda_ipc_internal::kIpcHandleBytes);
    std::memcpy(d.handle.data(), &handle, sizeof handle);
    d.pid = ::getpid();
    d.device = device;
    d.offset = addr - base;
    d.length = region.length;
    d.id = Owned().Add({static_cast<const std::byte*>(region.addr), region.length, device});
    return Registration{d.id, cuda_ipc_internal::FormatCudaIpcDescriptor(d)};
  }

  Status Deregister(uint64_t id) {
    if (!Owned().Remove(id)) return NotFound(fmt::format("cuda_ipc registration {} is not registered", id));
    return OkStatus();
  }

  Result<RemoteMemory> Import(std::string_view descriptor) {
    RC_ASSIGN_OR_RETURN(CudaIpcDescriptor d, cuda_ipc_internal::ParseCudaIpcDescriptor(descriptor));
    RemoteEntry entry;
    entry.length = d.length;
    entry.descriptor = std::string(descriptor);
    DeviceGuard guard(device_);
    if (guard.status() != cudaSuccess) {
      return Unavailable(fmt::format("cuda_ipc transport: device {}: {}", device_, CudaErrorText(guard.status())));
    }
    rc::MutexLock lock(mu_);
    if (d.pid == ::getpid()) {
      OwnedRegion r;
      if (!Owned().Find(d.id, &r)) {
        return NotFound(fmt::format("cuda_ipc descriptor {}: registration {} of this process is not registered",
                                    codec::Abbrev(descriptor), d.id));
      }
      if (r.length != d.length) {
        return NotFound(fmt::format("cuda_ipc descriptor {}: registration {} has {} bytes now",
                                    codec::Abbrev(descriptor), d.id, r.length));
      }
      if (r.device != device_) EnablePeerLocked(r.device);
      entry.src = r.ptr;
      entry.local_id = d.id;
    } else {
      if (internal::ProcessGone(static_cast<pid_t>(d.pid))) {
        return Unavailable(fmt::format("cuda_ipc descriptor {}: owner process {} is gone",
                                       codec::Abbrev(descriptor), d.pid));
      }
      entry.owner = static_cast<pid_t>(d.pid);
      entry.mapping_key = fmt::format("{}/{}", d.pid, codec::HexEncode(d.handle.data(), d.handle.size()));
      Mapping& m = mappings_[entry.mapping_key];
      if (m.base == nullptr) {
        cudaIpcMemHandle_t handle{};
        std::memcpy(&handle, d.handle.data(), sizeof handle);
        const cudaError_t e = cudaIpcOpenMemHandle(&m.base, handle, cudaIpcMemLazyEnablePeerAccess);
        if (e != cudaSuccess) {
          mappings_.erase(entry.mapping_key);
          (void)cudaGetLastError();
          return Unavailable(fmt::format("cuda_ipc descriptor {}: cudaIpcOpenMemHandle on device {}: {}",
                                         codec::Abbrev(descriptor), device_, CudaErrorText(e)));
        }
        uintptr_t base = 0;
        Status s = AllocationOf(m.base, &base, &m.size);
        if (!s.ok()) m.size = UINT64_MAX;  // size unknown: trust the descriptor
      }
      if (m.size != UINT64_MAX && d.offset + d.length > m.size) {
        if (m.refs == 0) {
          (void)cudaIpcCloseMemHandle(m.base);
          mappings_.erase(entry.mapping_key);
        }
        return InvalidArgument(fmt::format("cuda_ipc descriptor {}: bytes {}..{} lie outside the {}-byte allocation",
                                           codec::Abbrev(descriptor), d.offset, d.offset + d.length,
                                           m.size));
      }
      ++m.refs;
      entry.src = static_cast<const std::byte*>(m.base) + d.offset;
    }
    const uint64_t id = next_remote_++;
    remotes_.emplace(id, std::move(entry));
    return RemoteMemory{id, d.length};
  }

  Status Release(const RemoteMemory& remote) {
    rc::MutexLock lock(mu_);
    auto it = remotes_.find(remote.id);
    if (it == remotes_.end()) return NotFound(fmt::format("cuda_ipc remote {} is not imported", remote.id));
    if (!it->second.mapping_key.empty()) {
      auto m = mappings_.find(it->second.mapping_key);
      if (m != mappings_.end() && --m->second.refs == 0) {
        DeviceGuard guard(device_);
        (void)cudaIpcCloseMemHandle(m->second.base);
        mappings_.erase(m);
      }
    }
    remotes_.erase(it);
    return OkStatus();
  }

  static Result<std::unique_ptr<Transfer>> PostReads(const std::shared_ptr<Core>& core, std::span<const ReadOp> ops);

  struct Posted {
    std::vector<cudaEvent_t> events;
    std::vector<pid_t> owners;
    Status failure;  // found while issuing
  };

  // Validates (InvalidArgument), then issues; a failure found after validation is returned in
  // Posted::failure so the transfer reports it.
  Result<Posted> Post(std::span<const ReadOp> ops) {
    rc::MutexLock lock(mu_);
    std::vector<const std::byte*> src(ops.size());
    Posted posted;
    for (size_t i = 0; i < ops.size(); ++i) {
      const ReadOp& op = ops[i];
      auto it = remotes_.find(op.source.id);
      if (it == remotes_.end()) {
        return InvalidArgument(fmt::format("read {} of batch: cuda_ipc remote {} is not imported", i, op.source.id));
      }
      const RemoteEntry& r = it->second;
      RC_RETURN_IF_ERROR(internal::CheckReadOp(i, op, r.length,
                                               [&] { return fmt::format("cuda_ipc region {}", r.descriptor); }));
      src[i] = r.src + op.source_offset;
      if (r.owner != 0) {
        if (std::find(posted.owners.begin(), posted.owners.end(), r.owner) == posted.owners.end()) {
          posted.owners.push_back(r.owner);
        }
      } else {
        OwnedRegion o;
        if (!Owned().Find(r.local_id, &o) && posted.failure.ok()) {
          posted.failure = Unavailable(fmt::format("read {} of batch: cuda_ipc region {} was deregistered", i,
                                                   r.descriptor));
        }
      }
    }
    for (pid_t p : posted.owners) {
      if (internal::ProcessGone(p) && posted.failure.ok()) {
        posted.failure = Unavailable(fmt::format("cuda_ipc transfer: owner process {} is gone", p));
      }
    }
    if (!posted.failure.ok()) return posted;
    DeviceGuard guard(device_);
    // Longest ops first onto the least-loaded stream.
    std::vector<size_t> order(ops.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return ops[a].length > ops[b].length; });
    std::vector<uint64_t> load(streams_.size(), 0);
    std::vector<bool> used(streams_.size(), false);
    for (size_t i : order) {
      if (ops[i].length == 0) continue;
      const size_t s = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
      const cudaError_t e = cudaMemcpyAsync(ops[i].dest, src[i], ops[i].length, cudaMemcpyDefault, streams_[s]);
      if (e != cudaSuccess) {
        posted.failure = Unavailable(fmt::format("cuda_ipc transfer: cudaMemcpyAsync of {} bytes (read {}): {}",
                                                 ops[i].length, i, CudaErrorText(e)));
        break;
      }
      load[s] += ops[i].length;
      used[s] = true;
    }
    for (size_t s = 0; s < streams_.size(); ++s) {
      if (!used[s]) continue;
      cudaEvent_t ev = nullptr;
      cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
      if (e == cudaSuccess) e = cudaEventRecord(ev, streams_[s]);
      if (e != cudaSuccess) {
        if (ev != nullptr) (void)cudaEventDestroy(ev);
        // Without an event nothing tells when this stream's copies end: wait for them here.
        (void)cudaStreamSynchronize(streams_[s]);
        if (posted.failure.ok()) {
          posted.failure = Unavailable(fmt::format("cuda_ipc transfer: cudaEventRecord: {}", CudaErrorText(e)));
        }
        continue;
      }
      posted.events.push_back(ev);
    }
    return posted;
  }

 private:
  void EnablePeerLocked(int owner_device) REQUIRES(mu_) {
    int can = 0;
    if (cudaDeviceCanAccessPeer(&can, device_, owner_device) == cudaSuccess && can) {
      const cudaError_t e = cudaDeviceEnablePeerAccess(owner_device, 0);
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) {
        RC_LOG_WARN("cuda_ipc transport: peer access {} -> {}: {} (copies go through the host)", device_,
                    owner_device, CudaErrorText(e));
      }
      (void)cudaGetLastError();
    }
  }

  Clock* clock_;
  const int device_;
  const CudaIpcTransportOptions options_;
  std::vector<cudaStream_t> streams_;  // immutable after Init

  rc::Mutex mu_;
  uint64_t next_remote_ GUARDED_BY(mu_) = 1;                              // guarded by mu_
  std::unordered_map<uint64_t, RemoteEntry> remotes_ GUARDED_BY(mu_);     // guarded by mu_
  std::unordered_map<std::string, Mapping> mappings_ GUARDED_BY(mu_);     // guarded by mu_
};

class CudaIpcTransfer final : public internal::RecordedTransfer {
 public:
  CudaIpcTransfer(std::shared_ptr<Core> core, Core::Posted posted, uint64_t bytes)
      : RecordedTransfer(core->clock(), bytes),
        core_(std::move(core)),
        events_(std::move(posted.events)),
        owners_(std::move(posted.owners)) {
    if (!posted.failure.ok()) Finish(TransferState::kFailed, std::move(posted.failure));
  }

  ~CudaIpcTransfer() override {
    DeviceGuard guard(core_->device());
    const int64_t give_up = SteadyNs() + core_->options().drain_grace_ns;
    for (cudaEvent_t ev : events_) {
      while (cudaEventQuery(ev) == cudaErrorNotReady && SteadyNs() < give_up) {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      if (cudaEventQuery(ev) == cudaErrorNotReady) {
        RC_LOG_WARN("cuda_ipc transfer of {} bytes: copies still running after {} ms; destinations may still be "
                    "written",
                    bytes(), core_->options().drain_grace_ns / 1'000'000);
      }
      (void)cudaEventDestroy(ev);
    }
    (void)cudaGetLastError();
  }

  void Cancel() override { cancelled_ = true; }

 private:
  std::string PendingAtDeadline() const override {
    return fmt::format("cuda_ipc transfer of {} bytes still pending at the deadline", bytes());
  }

  TransferState PollPending() override {
    const uint64_t bytes_ = bytes();
    DeviceGuard guard(core_->device());
    bool all_done = true;
    for (cudaEvent_t ev : events_) {
      const cudaError_t e = cudaEventQuery(ev);
      if (e == cudaErrorNotReady) {
        all_done = false;
        break;
      }
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return Finish(TransferState::kFailed,
                      Unavailable(fmt::format("cuda_ipc transfer of {} bytes failed on device {}: {}", bytes_,
                                              core_->device(), CudaErrorText(e))));
      }
    }
    const int64_t now = SteadyNs();
    if (all_done || now - last_liveness_ns_ >= core_->options().liveness_period_ns) {
      last_liveness_ns_ = now;
      for (pid_t p : owners_) {
        if (internal::ProcessGone(p)) {
          return Finish(TransferState::kFailed,
                        Unavailable(fmt::format("cuda_ipc transfer of {} bytes: owner process {} died while it was "
                                                "{}; the bytes read cannot be trusted",
                                                bytes_, p, all_done ? "being read" : "pending")));
        }
      }
    }
    if (!all_done) return TransferState::kPending;
    if (cancelled_) return Finish(TransferState::kFailed, Aborted(fmt::format("cuda_ipc transfer of {} bytes cancelled", bytes_)));
    return Finish(TransferState::kDone, OkStatus());
  }

  std::shared_ptr<Core> core_;
  std::vector<cudaEvent_t> events_;
  std::vector<pid_t> owners_;
  bool cancelled_ = false;
  int64_t last_liveness_ns_ = 0;
};

Result<std::unique_ptr<Transfer>> Core::PostReads(const std::shared_ptr<Core>& core, std::span<const ReadOp> ops) {
  RC_ASSIGN_OR_RETURN(Core::Posted posted, core->Post(ops));
  return std::unique_ptr<Transfer>(std::make_unique<CudaIpcTransfer>(core, std::move(posted), internal::BatchBytes(ops)));
}

Capabilities CudaIpcCapabilities() {
  Capabilities c;
  c.device_memory = true;
  c.cross_process = true;
  c.asynchronous = true;
  return c;
}

}  // namespace

Result<std::unique_ptr<Transport>> CreateCudaIpcTransport(const TransportOptions& options) {
  return CreateCudaIpcTransport(options, CudaIpcTransportOptions{});
}

Result<std::unique_ptr<Transport>> CreateCudaIpcTransport(const TransportOptions& options,
                                                          const CudaIpcTransportOptions& cuda_options) {
  RC_ASSIGN_OR_RETURN(const int device, gpu_internal::ResolveDevice("cuda_ipc", options.device));
  Clock* clock = options.clock ? options.clock : SystemClock::Default();
  auto core = std::make_shared<Core>(clock, device, cuda_options);
  RC_RETURN_IF_ERROR(core->Init());
  return std::unique_ptr<Transport>(
      std::make_unique<internal::CoreTransport<Core>>("cuda_ipc", CudaIpcCapabilities(), std::move(core)));
}

}  // namespace rc::transport
