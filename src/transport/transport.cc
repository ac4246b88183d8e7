#include "rolloutcore/transport/transport.h"

#include <fmt/format.h>

#include <array>
#include <string>

#include "rolloutcore/transport/local.h"
#include "rolloutcore/transport/shm.h"
#ifdef ROLLOUTCORE_WITH_UCX
#include "rolloutcore/transport/ucx.h"
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
};

}  // namespace

std::string_view TransferStateName(TransferState state) {
  switch (state) {
    case TransferState::kPending: return "pending";
    case TransferState::kDone: return "done";
    case TransferState::kFailed: return "failed";
  }
  return "unknown";
}

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
