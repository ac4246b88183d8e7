// The transport backend registry: the one explicit list of the backends built into this binary
// (`local`, `shm`, and `ucx`, `cuda_ipc`, `nccl` under their CMake options), and creation by name.
//
// CMake target rolloutcore::transport: it links every backend that was built, so only code that
// creates transports by name (the engine's receiver, the trainer, the apps, the Python module, the
// GPU executor) links it. Code that only moves bytes through a Transport it was handed includes
// rolloutcore/transport/transport.h and links rolloutcore::transport_api (no backend).
//
// Thread safety: RegisteredBackends and CreateTransport may be called from any thread; the list
// is a constant.
#pragma once

#include <memory>
#include <span>
#include <string_view>

#include "rolloutcore/transport/transport.h"

namespace rc::transport {

struct BackendEntry {
  std::string_view name;
  std::string_view description;
  Result<std::unique_ptr<Transport>> (*create)(const TransportOptions& options);
};

// The backends built into this binary, in preference order.
std::span<const BackendEntry> RegisteredBackends();
// NotFound listing the registered names when `name` is not one.
[[nodiscard]] Result<std::unique_ptr<Transport>> CreateTransport(std::string_view name,
                                                                 const TransportOptions& options = {});

}  // namespace rc::transport
