// The `shm` transport: one-sided reads between processes on one host through shared memory.
//
// Owner side. Memory that peers read must live in a ShmBuffer: an anonymous memfd
// (memfd_create) mapped read-write into the owner, sized once and sealed against shrinking or
// growing, so a reader's mapping can never fault with SIGBUS. A trainer allocates its shards in
// ShmBuffers (or one arena buffer) and registers any sub-range of them. Registering memory that is
// not inside a live ShmBuffer fails with FailedPrecondition: a silent copy would double the memory
// and publish a snapshot taken at registration time instead of the buffer the owner keeps
// updating, which is not what a shard table promises.
//
// Why a memfd reached through /proc/<pid>/fd/<fd>, not a named POSIX shm object: a memfd has no
// name in any file system, so nothing outlives the processes that use it. A trainer killed with
// SIGKILL leaks nothing (a named /dev/shm object of many GiB would stay until someone unlinks it).
// The cost: readers must be in the owner's pid namespace and allowed to open its fds
// (same user, ptrace read access, which Yama does not restrict). A recycled pid or fd number is
// detected because the memfd's name carries a random 64-bit token that the descriptor repeats.
//
// Descriptor (all fields required, any order after the prefix; numbers decimal, tokens hex):
//   shm:v1:pid=<owner pid>:fd=<memfd>:tok=<token>:off=<offset in the memfd>:len=<bytes>
//         :ctl=<control memfd>:ctok=<control token>:slot=<registration slot>:gen=<generation>
// The control memfd holds one 64-bit word per registration slot; the word equals `gen` while the
// registration is live and changes when it is deregistered (or its ShmBuffer is destroyed).
//
// Reader side. Import opens the owner's memfd, checks its name (token), seals and size, maps it
// read-only (one mapping per memfd, shared by every registration inside it) and closes the fd.
// Import fails with Unavailable when the owner process is gone: that is the explicit liveness
// check. A read is a memcpy from the mapping into the destination; a batch is checked entirely
// before any byte moves, then split into pieces that a small pool of copy threads executes, so a
// large batch approaches memory bandwidth and PostReads returns at once (all peers can be posted
// before any wait). Batches under `inline_bytes` are copied inside PostReads.
//
// Liveness and deregistration. A mapping stays valid after the owner dies (the reader holds its
// own reference to the memory), so reads of an already imported region complete even if the
// owner died after Import; the data is what the owner last wrote. Deregistration is seen through
// the control word: it is checked before each piece and again after it (seqlock style), so a
// transfer whose source is deregistered before or during the copy fails with Unavailable instead
// of returning bytes the owner may already be reusing.
//
// Cancellation: Cancel() stops pieces that have not started; pieces already copying finish
// (each is at most `piece_bytes`). The transfer ends Aborted (unless it had already completed)
// once no piece is running, so after Poll() reports failed no destination is written any more.
// Destroying a Transfer cancels it and waits for its running pieces.
//
// Thread safety: transports are safe for concurrent use; a Transfer belongs to one caller.
// A ShmBuffer is a movable owner of its mapping; moving it does not move the memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "rolloutcore/transport/transport.h"

namespace rc::transport {

// Shared memory an owner can register with the shm transport. Writable by its owner.
// Invariant: data() stays mapped at the same address for the buffer's life (moves included);
// destroying the buffer invalidates every registration inside it.
class ShmBuffer {
 public:
  // A zero-filled buffer of `size` bytes (> 0), rounded up to whole pages in the memfd.
  [[nodiscard]] static Result<ShmBuffer> Create(uint64_t size);

  ShmBuffer() = default;
  ShmBuffer(ShmBuffer&& other) noexcept;
  ShmBuffer& operator=(ShmBuffer&& other) noexcept;
  ShmBuffer(const ShmBuffer&) = delete;
  ShmBuffer& operator=(const ShmBuffer&) = delete;
  ~ShmBuffer();

  bool valid() const { return data_ != nullptr; }
  std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }
  int fd() const { return fd_; }
  // The region covering bytes [offset, offset + length) of this buffer (the whole by default).
  MemoryRegion region() const { return region(0, size_); }
  MemoryRegion region(uint64_t offset, uint64_t length) const;

 private:
  void Reset();

  std::byte* data_ = nullptr;
  uint64_t size_ = 0;  // bytes requested
  uint64_t mapped_ = 0;  // bytes mapped (whole pages)
  int fd_ = -1;
};

struct ShmTransportOptions {
  int copy_threads = 0;                  // 0: min(4, hardware threads)
  uint64_t inline_bytes = 64 << 10;      // batches this small are copied inside PostReads
  uint64_t piece_bytes = 4 << 20;        // unit of work handed to a copy thread
};

[[nodiscard]] Result<std::unique_ptr<Transport>> CreateShmTransport(const TransportOptions& options = {});
[[nodiscard]] Result<std::unique_ptr<Transport>> CreateShmTransport(const TransportOptions& options,
                                                                    const ShmTransportOptions& shm_options);

}  // namespace rc::transport
