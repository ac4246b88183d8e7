// The `cuda_ipc` transport: one-sided reads of GPU memory between processes (and devices) of one
// host through CUDA IPC memory handles; the copies run on the reader's copy engines over NVLink or
// PCIe. Built only with ROLLOUTCORE_WITH_CUDA; the CUDA runtime is linked only by this backend.
//
// Owner side. RegisterMemory takes device memory (MemoryKind::kDevice) allocated with cudaMalloc
// (any sub-range of an allocation: the base is found with cuMemGetAddressRange). The descriptor is
//   cuda_ipc:v1:pid=<owner pid>:id=<registration id>:dev=<owner device ordinal>:off=<offset of
//   the region in its allocation>:len=<bytes>:handle=<128 hex digits of cudaIpcMemHandle_t>
// Host memory is refused (Unimplemented): use shm or ucx for host memory.
//
// Reader side. Import parses the descriptor (errors name the field), checks that the owner is
// alive (Unavailable otherwise) and opens the allocation's handle with cudaIpcOpenMemHandle
// (cudaIpcMemLazyEnablePeerAccess) on the transport's device, once per (owner, allocation): every
// region of one allocation shares the mapping, which is closed when the last remote using it is
// released. A descriptor of this very process is served without IPC (CUDA refuses to open a
// process's own handles): the reader copies from the registered pointer, enabling peer access to
// the owner's device when the hardware allows it.
//
// PostReads checks the whole batch first (InvalidArgument before anything is issued: unknown
// remote, bytes outside the region, null destination), then issues one cudaMemcpyAsync per op on
// `streams` non-blocking streams of the reader's device, longest ops first onto the least-loaded
// stream, and records one event per used stream. Destinations may be device memory of the reader's
// device (the refit case) or host memory. Transfer::Poll/Wait query the events; Wait sleeps
// briefly between polls and never blocks past its deadline.
//
// Dead owner. While a transfer is pending, and once more when its copies have completed, the
// owner processes of its remotes are checked (kill(pid, 0) plus the zombie state in /proc): a
// gone owner fails the transfer with Unavailable naming the pid, within about `liveness_period_ns`
// of its death, whether or not the copies ever complete. Completion is not trusted after the owner
// died because nothing proves the bytes were read before its memory was released. A CUDA error
// reported by an event (e.g. a fault on the peer mapping) fails the transfer with Unavailable too;
// such an error may be sticky for the reader's CUDA context, as CUDA defines.
//
// Deregistration removes the registration from the owner's table; a later Import of it is
// NotFound for same-process readers, and same-process reads of it fail with Unavailable. A reader
// in another process that opened the handle earlier keeps a valid mapping while the owner's
// allocation lives (CUDA IPC has no revocation): owners free memory only after the version is
// retired, which is the refit contract anyway.
//
// Cancellation is best effort: issued copies cannot be withdrawn. Cancel() marks the transfer; it
// ends Aborted (unless it had already completed) once its copies have finished. Destroying a
// Transfer waits up to `drain_grace_ns` for its copies, so normally nothing writes its
// destinations afterwards; past that (a wedged device) it logs and returns.
//
// Thread safety: a transport's methods may be called from any thread (one mutex guards its
// tables and stream assignment); every CUDA call switches to the right device for its duration
// and restores the caller's device. A Transfer belongs to one caller and may outlive its transport.
#pragma once

#include <cstdint>
#include <memory>

#include "rolloutcore/transport/transport.h"

namespace rc::transport {

struct CudaIpcTransportOptions {
  int32_t streams = 4;                     // copy streams of the reader's device
  int64_t liveness_period_ns = 2'000'000;  // owner pid check period while waiting
  int64_t drain_grace_ns = 2'000'000'000;  // ~Transfer waits this long for issued copies
};

[[nodiscard]] Result<std::unique_ptr<Transport>> CreateCudaIpcTransport(const TransportOptions& options = {});
[[nodiscard]] Result<std::unique_ptr<Transport>> CreateCudaIpcTransport(const TransportOptions& options,
                                                                        const CudaIpcTransportOptions& cuda_options);

}  // namespace rc::transport
