// The `ucx` transport: one-sided RMA reads through UCP, over whatever UCX finds (shared memory,
// TCP, RDMA). Built only with ROLLOUTCORE_WITH_UCX; UCX itself is linked only by this backend.
//
// Owner side. RegisterMemory maps any host memory with ucp_mem_map (no special allocator needed)
// and packs its rkey. The descriptor carries everything a reader needs to reach it:
//   ucx:v1:host=<hostname>:pid=<owner pid>:id=<registration id>:addr=<hex remote address>
//         :len=<bytes>:worker=<hex UCP worker address>:rkey=<hex packed rkey>
// Every transport has one UCP worker and a progress thread. The owner's thread matters: on
// transports without hardware RMA (tcp, and shared-memory ones without a zero-copy path) UCX
// emulates a get with active messages that the owner's worker must answer.
//
// Reader side. Import parses the descriptor (errors name the bad field), checks that the owner
// process is alive when it is on this host (Unavailable otherwise), connects to the owner's worker
// (one endpoint per peer worker, cached) with UCP_ERR_HANDLING_MODE_PEER and unpacks the rkey.
// Peer failure: endpoints are created with UCP_ERR_HANDLING_MODE_PEER and an error callback.
// UCX 1.13's shared-memory transports (posix, sysv, cma) have no peer failure handler, so with
// UCX_TLS=sm,self that mode is refused; for a peer on this host the transport then falls back to
// UCP_ERR_HANDLING_MODE_NONE (allow_no_peer_error_handling) and relies on its pid watchdog: the
// progress thread checks every ~50 ms whether the owner of any peer with gets in flight is gone
// (or a zombie) and fails that peer itself. Either way, transfers on a failed peer end with
// Unavailable: gets UCX still holds are abandoned (the core keeps their state until UCX
// completes them, so a late completion never touches freed memory; with a dead owner no data can
// still arrive except bytes already in flight in a local shared-memory FIFO).
//
// PostReads checks the whole batch first (InvalidArgument before anything is posted), then posts
// ucp_get_nbx for every op, all before returning; the progress thread drives them. A peer that
// dies fails its transfers with Unavailable (UCX reports the broken endpoint) and is dropped from
// the endpoint cache, so re-importing after a restart reconnects. Wait(deadline) never blocks past
// its deadline, whether or not UCX has noticed a failure yet.
//
// Deregistration: Deregister unmaps the memory handle. On RDMA transports that invalidates the
// rkey, so later reads fail; on tcp and shared-memory transports UCX does not check rkeys after
// unmap, so a reader can still read the owner's address range while it stays mapped. Owners must
// therefore deregister only after the version is retired (the directory's lease), which is the
// refit contract anyway.
//
// Cancellation is best effort: UCP cannot withdraw an RMA get once posted. Cancel() marks the
// transfer; it ends Aborted (unless it had already completed) once its gets in flight have
// finished, which may take as long as the peer takes. Destroying a Transfer cancels it and waits
// up to `drain_grace_ns` (real time) for its gets; then it force-closes the endpoints those gets
// use (failing other transfers on the same peers with Aborted, and making their remotes unusable
// until re-imported) and waits for UCX to complete them. So after ~Transfer returns no destination
// of it is written any more.
//
// Thread safety: a transport's methods may be called from any thread; all UCP calls on its worker
// are serialized by one mutex (the worker runs in UCS_THREAD_MODE_SERIALIZED). A Transfer
// belongs to one caller. Transfers may outlive their transport: the shared core stays alive until
// the last of them is gone, but the transport's destructor force-closes every endpoint first.
#pragma once

#include <cstdint>
#include <memory>

#include "rolloutcore/transport/transport.h"

namespace rc::transport {

struct UcxTransportOptions {
  int64_t drain_grace_ns = 250'000'000;  // see "Cancellation" above (gets to a live peer finish in ms)
  // Same-host peers only: fall back to UCP_ERR_HANDLING_MODE_NONE plus the pid watchdog when no
  // transport offers peer error handling (shared memory in UCX 1.13). Off: such peers are refused.
  bool allow_no_peer_error_handling = true;
};

[[nodiscard]] Result<std::unique_ptr<Transport>> CreateUcxTransport(const TransportOptions& options = {});
[[nodiscard]] Result<std::unique_ptr<Transport>> CreateUcxTransport(const TransportOptions& options,
                                                                    const UcxTransportOptions& ucx_options);

}  // namespace rc::transport
