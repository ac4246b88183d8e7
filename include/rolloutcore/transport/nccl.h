// The `nccl` transport: reads of GPU memory through NCCL send/recv, for peers that have no
// one-sided access to each other (other hosts, or GPUs without CUDA IPC). Built only with
// ROLLOUTCORE_WITH_NCCL; NCCL is linked only by this backend. NCCL_NVLS_ENABLE is forced to 0
// before the first NCCL call (NVLink multicast is never used).
//
// NCCL is two-sided; the Transport interface is one-sided reads. The adapter: the owner's
// transport runs a small TCP control server (started by the first RegisterMemory) whose threads
// answer read requests with ncclSend, so the owner's code never takes part in a transfer.
//
// Owner side. RegisterMemory takes device memory of the transport's device (one transport per
// device); the descriptor is
//   nccl:v1:host=<control address>:port=<control port>:pid=<owner pid>:tok=<16 hex digits>
//         :id=<registration id>:dev=<owner device>:len=<bytes>
// `tok` is a random token of the owner transport, so a reused port or pid never reaches the wrong
// process. The control server listens on `listen_address` (default 127.0.0.1; the environment
// variable ROLLOUTCORE_NCCL_ADDRESS overrides it, e.g. with this host's address for cross-host
// readers).
//
// Reader side. Import parses the descriptor (errors name the field), connects to the owner's
// control server once per owner transport (cached), creates an NCCL unique id and builds a 2-rank
// communicator with the owner (owner rank 0, reader rank 1) through ncclCommInitRankConfig with
// blocking = 0, then asks the owner for the registration (NotFound when it is not registered).
// PostReads checks the whole batch (InvalidArgument before anything moves), then per owner sends
// one READ request listing the ops; the owner validates it (an error fails the transfer, nothing is
// posted), answers, and posts one ncclSend per op in ncclGroupStart/End; the reader posts the
// matching ncclRecv into each destination in the same order (NCCL matches point-to-point
// operations between two ranks in order) on its stream for that owner, and records an event.
//
// Import runs under one deadline, `connect_timeout_ns` from its start: a non-blocking TCP connect
// polled against it, then HELLO/READY and the communicator init. An owner that never completes the
// handshake or never answers ends Import with DeadlineExceeded naming the owner ("owner pid P at
// host:port: ..."); a refused connection or a gone owner pid is Unavailable.
//
// Failure and deadlines. Communicators are non-blocking, so no NCCL call can hang a thread: every
// wait for NCCL (init, enqueue) polls ncclCommGetAsyncError with a deadline. A watchdog thread of the
// reader checks, every `watchdog_period_ns`, each owner with transfers in flight: control connection
// closed (the owner process died or closed the transport), owner pid gone (same host), or an NCCL
// async error; then it calls ncclCommAbort, which makes the kernels waiting for the dead peer
// return, and fails every transfer on that owner with Unavailable. A transfer that stays pending
// longer than `stall_timeout_ns` is treated the same way. So a dead owner is reported within about
// one watchdog period, and Wait never blocks past its deadline. The owner's server aborts its
// communicator the same way when its reader's control connection closes. After an abort the peer is
// dropped from the cache: re-importing reconnects with a new communicator.
//
// Completion is trusted only when the receive event completed before the peer was aborted (an
// abort makes pending kernels return early, so an event completing after the abort proves nothing).
//
// Cancellation: NCCL cannot withdraw one posted operation. Cancel() of a pending transfer aborts
// the communicator of its owners (failing the other transfers in flight on them with Aborted); the
// transfer ends Aborted. Destroying a pending Transfer cancels it and waits up to `drain_grace_ns`
// for its stream.
//
// Thread safety: a transport's methods may be called from any thread. Per owner connection one
// mutex serializes the control socket and every NCCL call on that communicator. A Transfer belongs
// to one caller and may outlive its transport.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "rolloutcore/transport/transport.h"

namespace rc::transport {

struct NcclTransportOptions {
  std::string listen_address = "127.0.0.1";  // owner control server (env ROLLOUTCORE_NCCL_ADDRESS wins)
  int64_t connect_timeout_ns = 120'000'000'000;  // Import: TCP connect + communicator init
  int64_t watchdog_period_ns = 20'000'000;
  int64_t stall_timeout_ns = 600'000'000'000;  // 0: no limit
  int64_t drain_grace_ns = 2'000'000'000;
  int32_t max_ops_per_group = 1024;
};

[[nodiscard]] Result<std::unique_ptr<Transport>> CreateNcclTransport(const TransportOptions& options = {});
[[nodiscard]] Result<std::unique_ptr<Transport>> CreateNcclTransport(const TransportOptions& options,
                                                                     const NcclTransportOptions& nccl_options);

}  // namespace rc::transport
