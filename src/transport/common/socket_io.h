// Blocking-free TCP helpers for the transports' control connections (the nccl backend's owner
// server and its readers): connect, send and receive, each bounded by a deadline, so no external
// operation can hang a thread (DESIGN.md: every external operation has a deadline).
//
// Deadlines are absolute SteadyNs() values (real time: these wait on the kernel, not on a test
// clock). Errors name `peer` (e.g. "owner pid 12 at 10.0.0.2:4000"): DeadlineExceeded when the
// deadline passed first, Unavailable when the peer refused, closed or failed, InvalidArgument for
// an address that is not IPv4. Plain POSIX sockets, no CUDA; thread-safe (per call, per fd).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string_view>

#include "rolloutcore/base/status.h"

namespace rc::transport::internal {

// steady_clock now, in nanoseconds.
int64_t SteadyNs();

// A connected TCP socket (blocking mode, CLOEXEC, TCP_NODELAY) to host:port (IPv4 dotted quad),
// or an error naming `peer` and the address: DeadlineExceeded when the connection is not
// established by `deadline_ns` (a host that drops SYNs, a full accept queue), Unavailable when it
// is refused or unreachable. `check` (may be empty) is called between 20 ms polls; a non-OK status
// from it ends the attempt with that status.
[[nodiscard]] Result<int> ConnectTcp(std::string_view host, uint16_t port, int64_t deadline_ns, std::string_view peer,
                                     const std::function<Status()>& check = {});

// Sends all `n` bytes (MSG_NOSIGNAL); Unavailable on an error.
[[nodiscard]] Status SendAll(int fd, const void* data, size_t n);

// Reads exactly `n` bytes; polls in 20 ms slices, calling `check` between them (a non-OK status
// ends the wait), until `deadline_ns`. Unavailable when the peer closed the connection.
[[nodiscard]] Status RecvAll(int fd, void* data, size_t n, int64_t deadline_ns, const std::function<Status()>& check);

// True when the peer closed the connection (readable data is not a close).
bool ConnectionClosed(int fd);

}  // namespace rc::transport::internal
