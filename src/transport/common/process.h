// Liveness of a peer process on this host, as the transports check it (owner of an imported
// region). CUDA-free; reads /proc; thread-safe.
#pragma once

#include <sys/types.h>

namespace rc::transport::internal {

// True when process `pid` is gone or a zombie (killed and not yet reaped by its parent: such a
// process still answers kill(pid, 0) but runs no code any more). False for pid <= 0.
bool ProcessGone(pid_t pid);

}  // namespace rc::transport::internal
