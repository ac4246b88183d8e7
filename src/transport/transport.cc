#include "rolloutcore/transport/registry.h"

#include <fmt/format.h>

#include <array>
#include <string>

#include "rolloutcore/transport/local.h"
#include "rolloutcore/transport/shm.h"
#ifdef ROLLOUTCORE_WITH_UCX
#include "rolloutcore/transport/ucx.h"
#endif
#ifdef ROLLOUTCORE_WITH_CUDA
#include "rolloutcore/transport/cuda_ipc.h"
#endif
#ifdef ROLLOUTCORE_WITH_NCCL
#include "rolloutcore/transport/nccl.h"
#endif

namespace rc::transport {
namespace {

// The one list of backends. Optional backends add their line under their CMake option, e.g.
//   #ifdef ROLLOUTCORE_WITH_UCX
//     {"ucx", "one-sided RMA over UCX", &CreateUcxTransport},
//   #endif
constexpr BackendEntry kBackends[] = {
    {"local", "same-process memcpy", &CreateLocalTransport},
    {"shm", "same-host shared memory (memfd), read-only mappings", &CreateShmTransport},
#ifdef ROLLOUTCORE_WITH_UCX
    {"ucx", "one-sided RMA over UCX (tcp, shared memory, RDMA where present)", &CreateUcxTransport},
#endif
#ifdef ROLLOUTCORE_WITH_CUDA
    {"cuda_ipc", "same-host GPU memory through CUDA IPC handles, copy engines on several streams",
     &CreateCudaIpcTransport},
#endif
#ifdef ROLLOUTCORE_WITH_NCCL
    {"nccl", "GPU memory through NCCL send/recv answered by the owner's serving thread",
     &CreateNcclTransport},
#endif
};

}  // namespace

std::span<const BackendEntry> RegisteredBackends() { return kBackends; }

Result<std::unique_ptr<Transport>> CreateTransport(std::string_view name, const TransportOptions& options) {
  std::string names;
  for (const BackendEntry& b : RegisteredBackends()) {
    if (b.name == name) return b.create(options);
    names += names.empty() ? "" : ", ";
    names += b.name;
  }
  return NotFound(fmt::format("transport backend '{}' is not built in (available: {})", name, names));
}

}  // namespace rc::transport
