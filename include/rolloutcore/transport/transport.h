// Transport: one-sided reads of registered memory, the data plane of refit.
//
// An owner registers a memory region (host now; device memory through backends that support it)
// and gets a Registration whose descriptor (a printable string) goes into its shard table. A
// reader imports the descriptor to get a RemoteMemory, then posts batches of reads (source region,
// source offset, destination pointer, length). Each post returns a Transfer with its own state
// (pending / done / failed) that the reader polls or waits on with a deadline. All peers are
// meant to be posted before any wait.
//
// Cancellation is best effort: Cancel() asks the backend to stop issuing the transfer's reads.
// Reads already issued may still complete and write their destinations; after Cancel() the
// transfer ends failed (Aborted) unless it had already completed. Callers must therefore treat
// every destination of a cancelled transfer as possibly written.
//
// This header is the interface only (CMake target rolloutcore::transport_api, which links no
// backend). Backends (`local`, `shm`, `ucx`, `cuda_ipc`, `nccl`) are listed in one explicit
// registry, rolloutcore/transport/registry.h (target rolloutcore::transport, which links every
// backend built); optional ones appear there only when built.
//
// Thread safety: a Transport's methods may be called from any thread concurrently. A Transfer is
// owned by one caller; Poll/Wait/Cancel on one Transfer are not called concurrently.
// Invariants: a Transfer never reads outside the imported region (an out-of-range read fails the
// transfer before touching memory); a RemoteMemory is usable until ReleaseRemote; deregistering a
// region makes later reads of it fail instead of touching freed memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "rolloutcore/base/clock.h"
#include "rolloutcore/base/status.h"

namespace rc::transport {

enum class MemoryKind : uint8_t { kHost, kDevice };

struct Capabilities {
  bool host_memory = false;
  bool device_memory = false;
  bool cross_process = false;  // peers in other processes on the same host
  bool cross_host = false;
  bool asynchronous = false;   // transfers may still be pending after PostReads returns
  uint64_t max_batch_ops = UINT64_MAX;
};

struct MemoryRegion {
  const void* addr = nullptr;
  uint64_t length = 0;
  MemoryKind kind = MemoryKind::kHost;
  int32_t device = -1;  // device ordinal for kDevice
};

// An owner's handle on a registered region.
struct Registration {
  uint64_t id = 0;
  std::string descriptor;  // what peers import
};

// A reader's handle on a peer's region.
struct RemoteMemory {
  uint64_t id = 0;
  uint64_t length = 0;
};

// Told about a read's destination bytes as they land, by backends that land them with the CPU
// (shm): Landed(dest, n) runs on the backend's copy thread right after bytes [dest, dest + n) of a
// read's destination were written (in pieces of at most a few hundred KiB, while they are still in
// cache), before the transfer completes; calls for one transfer may run concurrently on several
// threads. Other backends never call it, and a transfer that fails may have called it for some
// bytes: an observer must itself check which bytes it was told about. Landed must not fail or
// block for long; it must outlive the transfer.
// CopyLanded(dest, src, n) offers the observer the copy itself, so that it can observe the values
// in the same pass that writes them (one pass over memory instead of a copy and a read-back): it
// returns true after it wrote all n bytes of src to dest and observed them, or false having
// written nothing, and the backend then copies and calls Landed. The default takes nothing. The
// backend still validates the source around the call as around its own copy.
class LandingObserver {
 public:
  virtual ~LandingObserver() = default;
  virtual void Landed(std::byte* dest, uint64_t length) = 0;
  virtual bool CopyLanded(std::byte* /*dest*/, const std::byte* /*src*/, uint64_t /*length*/) { return false; }
};

struct ReadOp {
  RemoteMemory source;
  uint64_t source_offset = 0;
  void* dest = nullptr;
  uint64_t length = 0;
  LandingObserver* observer = nullptr;  // optional; see LandingObserver
};

enum class TransferState : uint8_t { kPending, kDone, kFailed };
std::string_view TransferStateName(TransferState state);

class Transfer {
 public:
  virtual ~Transfer() = default;
  // Non-blocking.
  virtual TransferState Poll() = 0;
  // Blocks until done, failed or the deadline (Clock::NowNs() of the transport's clock) passes.
  // OK when done; the failure status when failed; DeadlineExceeded (transfer still pending)
  // when the deadline passed.
  [[nodiscard]] virtual Status Wait(int64_t deadline_ns) = 0;
  // Best effort; see the header comment.
  virtual void Cancel() = 0;
  // OK when done; the failure when failed; Unavailable("pending") while pending.
  [[nodiscard]] virtual Status status() const = 0;
  virtual uint64_t bytes() const = 0;  // bytes the transfer reads in total
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual std::string_view name() const = 0;
  virtual Capabilities capabilities() const = 0;
  virtual Clock& clock() const = 0;

  [[nodiscard]] virtual Result<Registration> RegisterMemory(const MemoryRegion& region) = 0;
  [[nodiscard]] virtual Status Deregister(uint64_t registration_id) = 0;
  // NotFound / Unavailable naming the descriptor when it cannot be reached from here.
  [[nodiscard]] virtual Result<RemoteMemory> Import(std::string_view descriptor) = 0;
  [[nodiscard]] virtual Status ReleaseRemote(const RemoteMemory& remote) = 0;
  // Fails immediately (InvalidArgument) on a malformed batch; otherwise returns a Transfer whose
  // state reports how the reads went.
  [[nodiscard]] virtual Result<std::unique_ptr<Transfer>> PostReads(std::span<const ReadOp> ops) = 0;
};

struct TransportOptions {
  Clock* clock = nullptr;  // SystemClock::Default() when null
  // GPU backends (cuda_ipc, nccl): the CUDA device whose memory reads land in and whose streams
  // run them; -1 takes the creating thread's current device. Host-only backends ignore it.
  int32_t device = -1;
};

}  // namespace rc::transport
