#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "rolloutcore/base/mutex.h"
#include "rolloutcore/transport/shm.h"
#include "transport/common/transfer_base.h"
#include "transport/shm/shm_descriptor.h"
#include "transport/shm/shm_owner.h"

namespace rc::transport {
namespace {

using shm_internal::ShmDescriptor;

// A read-only mapping of a peer's memfd. Unmapped when the last Remote or transfer using it goes.
struct Mapping {
  const std::byte* addr = nullptr;
  uint64_t size = 0;
  Mapping(const std::byte* a, uint64_t s) : addr(a), size(s) {}
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { ::munmap(const_cast<std::byte*>(addr), size); }
};

// An imported registration.
struct Remote {
  uint64_t id = 0;
  ShmDescriptor descriptor;
  std::shared_ptr<Mapping> data;
  std::shared_ptr<Mapping> control;

  const std::atomic<uint64_t>& word() const {
    return reinterpret_cast<const std::atomic<uint64_t>*>(control->addr)[descriptor.slot];
  }
  bool Live() const { return word().load(std::memory_order_acquire) == descriptor.generation; }
  Status Deregistered() const {
    return Unavailable(fmt::format("shm source region {} (owner pid {}, slot {}, generation {}) was deregistered",
                                   id, descriptor.pid, descriptor.slot, descriptor.generation));
  }
};

struct Segment {
  const std::byte* src;
  std::byte* dst;
  uint64_t length;
  uint32_t remote;  // index into TransferShared::remotes
  LandingObserver* observer;  // of the read; may be null
};

// With an observer, a segment is copied in chunks this large and each chunk is reported while it
// is still in the copying core's cache (L2 is 1 MiB per core on the machines we measure).
constexpr uint64_t kObservedChunkBytes = 256 << 10;

// State shared by a Transfer, its pieces in the copy pool, and nobody else.
struct TransferShared {
  explicit TransferShared(uint64_t total_bytes) : bytes(total_bytes) {}

  const uint64_t bytes;
  std::vector<std::shared_ptr<const Remote>> remotes;  // set before any piece runs; then read-only
  std::atomic<bool> cancelled{false};
  std::atomic<bool> failed{false};

  rc::Mutex mu;
  rc::CondVar cv;
  size_t remaining GUARDED_BY(mu) = 0;  // guarded by mu: pieces not finished
  bool finished GUARDED_BY(mu) = false;  // guarded by mu
  Status failure GUARDED_BY(mu);        // guarded by mu: first failure

  void FinishPiece(const Status& s) {
    rc::MutexLock lock(mu);
    if (!s.ok() && failure.ok()) {
      failure = s;
      failed.store(true, std::memory_order_relaxed);
    }
    if (--remaining == 0) {
      finished = true;
      if (failure.ok() && cancelled.load()) failure = Aborted("shm transfer cancelled");
      cv.notify_all();
    }
  }
};

struct Piece {
  std::shared_ptr<TransferShared> transfer;
  std::vector<Segment> segments;
};

Status RunPiece(const Piece& piece) {
  TransferShared& t = *piece.transfer;
  if (t.cancelled.load(std::memory_order_relaxed) || t.failed.load(std::memory_order_relaxed)) return OkStatus();
  uint32_t last = UINT32_MAX;
  for (const Segment& s : piece.segments) {
    if (s.remote != last && !t.remotes[s.remote]->Live()) return t.remotes[s.remote]->Deregistered();
    last = s.remote;
  }
  for (const Segment& s : piece.segments) {
    if (s.observer == nullptr) {
      std::memcpy(s.dst, s.src, s.length);
      continue;
    }
    for (uint64_t at = 0; at < s.length; at += kObservedChunkBytes) {
      const uint64_t n = std::min(kObservedChunkBytes, s.length - at);
      if (s.observer->CopyLanded(s.dst + at, s.src + at, n)) continue;
      std::memcpy(s.dst + at, s.src + at, n);
      s.observer->Landed(s.dst + at, n);
    }
  }
  // Seqlock read side: the copies above happen before the control words are read again; if the
  // owner deregistered (and maybe reused the memory) meanwhile, the words have changed.
  std::atomic_thread_fence(std::memory_order_acquire);
  last = UINT32_MAX;
  for (const Segment& s : piece.segments) {
    if (s.remote != last && !t.remotes[s.remote]->Live()) return t.remotes[s.remote]->Deregistered();
    last = s.remote;
  }
  return OkStatus();
}

// A few threads that run pieces in FIFO order. Threads start on first use. The destructor runs
// what is queued (cancelled pieces are skipped quickly) and joins, so no piece outlives the pool.
class CopyPool {
 public:
  explicit CopyPool(int threads) : threads_wanted_(threads) {}
  CopyPool(const CopyPool&) = delete;
  CopyPool& operator=(const CopyPool&) = delete;
  ~CopyPool() {
    {
      rc::MutexLock lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

  void Submit(std::vector<Piece> pieces) {
    {
      rc::MutexLock lock(mu_);
      if (threads_.empty()) {
        for (int i = 0; i < threads_wanted_; ++i) threads_.emplace_back([this] { Loop(); });
      }
      for (Piece& p : pieces) queue_.push_back(std::move(p));
    }
    cv_.notify_all();
  }

 private:
  void Loop() {
    rc::MutexLock lock(mu_);
    for (;;) {
      cv_.wait(lock, [&]() REQUIRES(mu_) { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      Piece p = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      const Status s = RunPiece(p);
      p.transfer->FinishPiece(s);
      p.transfer.reset();
      lock.lock();
    }
  }

  const int threads_wanted_;
  rc::Mutex mu_;
  rc::CondVar cv_;
  std::vector<std::thread> threads_ GUARDED_BY(mu_);  // guarded by mu_ (started once)
  std::deque<Piece> queue_ GUARDED_BY(mu_);           // guarded by mu_
  bool stopping_ GUARDED_BY(mu_) = false;             // guarded by mu_
};

class ShmTransfer final : public internal::PollingTransfer {
 public:
  ShmTransfer(std::shared_ptr<TransferShared> shared, Clock* clock)
      : PollingTransfer(*clock), shared_(std::move(shared)) {}
  ~ShmTransfer() override {
    // Nothing may write the caller's destinations once the Transfer is gone.
    Cancel();
    rc::MutexLock lock(shared_->mu);
    shared_->cv.wait(lock, [&]() REQUIRES(shared_->mu) { return shared_->finished; });
  }

  TransferState Poll() override {
    rc::MutexLock lock(shared_->mu);
    if (!shared_->finished) return TransferState::kPending;
    return shared_->failure.ok() ? TransferState::kDone : TransferState::kFailed;
  }

  void Cancel() override { shared_->cancelled.store(true); }

  Status status() const override {
    rc::MutexLock lock(shared_->mu);
    if (!shared_->finished) return Unavailable("pending");
    return shared_->failure;
  }

  uint64_t bytes() const override { return shared_->bytes; }

 private:
  std::string PendingAtDeadline() const override {
    return fmt::format("shm transfer of {} bytes still pending at its deadline", shared_->bytes);
  }
  // Completion wakes the wait at once.
  void AwaitProgress(int64_t max_ns) override {
    rc::MutexLock lock(shared_->mu);
    if (!shared_->finished) shared_->cv.wait_for(lock, std::chrono::nanoseconds(max_ns));
  }

  std::shared_ptr<TransferShared> shared_;
};

std::string Errno(int err) { return std::strerror(err); }

const char* FileKind(mode_t m) {
  if (S_ISFIFO(m)) return "FIFO or pipe";
  if (S_ISSOCK(m)) return "socket";
  if (S_ISCHR(m)) return "character device";
  if (S_ISBLK(m)) return "block device";
  if (S_ISDIR(m)) return "directory";
  if (S_ISLNK(m)) return "symbolic link";
  return "non-regular file";
}

class ShmTransport final : public Transport {
 public:
  ShmTransport(Clock* clock, const ShmTransportOptions& options)
      : clock_(clock), options_(options), pool_(std::make_unique<CopyPool>(options.copy_threads)) {}

  ~ShmTransport() override {
    rc::MutexLock lock(mu_);
    for (uint64_t id : owned_) (void)shm_internal::Deregister(id);
  }

  std::string_view name() const override { return "shm"; }
  Capabilities capabilities() const override {
    Capabilities c;
    c.host_memory = true;
    c.cross_process = true;
    c.asynchronous = true;
    return c;
  }
  Clock& clock() const override { return *clock_; }

  Result<Registration> RegisterMemory(const MemoryRegion& region) override {
    if (region.kind != MemoryKind::kHost) {
      return Unimplemented("shm transport registers host memory only (device memory: use cuda_ipc)");
    }
    if (region.addr == nullptr) return InvalidArgument("shm transport: null address");
    RC_ASSIGN_OR_RETURN(shm_internal::OwnerRegistration r, shm_internal::Register(region.addr, region.length));
    rc::MutexLock lock(mu_);
    owned_.insert(r.id);
    return Registration{r.id, shm_internal::FormatShmDescriptor(r.descriptor)};
  }

  Status Deregister(uint64_t id) override {
    {
      rc::MutexLock lock(mu_);
      if (owned_.erase(id) == 0) {
        return NotFound(fmt::format("shm registration {} was not made by this transport (or is already gone)", id));
      }
    }
    return shm_internal::Deregister(id);
  }

  Result<RemoteMemory> Import(std::string_view descriptor) override {
    RC_ASSIGN_OR_RETURN(ShmDescriptor d, shm_internal::ParseShmDescriptor(descriptor));
    const pid_t pid = static_cast<pid_t>(d.pid);
    if (::kill(pid, 0) != 0 && errno == ESRCH) {
      return Unavailable(fmt::format("shm descriptor {}: owner process {} is gone", descriptor, d.pid));
    }
    if (d.slot >= shm_internal::kControlSlots) {
      return InvalidArgument(fmt::format("shm descriptor {}: field 'slot': {} is out of range (max {})", descriptor,
                                         d.slot, shm_internal::kControlSlots - 1));
    }
    auto remote = std::make_shared<Remote>();
    remote->descriptor = d;
    RC_ASSIGN_OR_RETURN(remote->data,
                        OpenMapping(descriptor, pid, d.fd, shm_internal::BufferMemfdName(d.token), d.offset + d.length));
    RC_ASSIGN_OR_RETURN(remote->control,
                        OpenMapping(descriptor, pid, d.ctl_fd, shm_internal::ControlMemfdName(d.ctl_token),
                                    (uint64_t{d.slot} + 1) * sizeof(uint64_t)));
    rc::MutexLock lock(mu_);
    remote->id = next_remote_id_++;
    if (!remote->Live()) {
      return NotFound(fmt::format("shm descriptor {}: the owner no longer registers this region", descriptor));
    }
    remotes_.emplace(remote->id, remote);
    return RemoteMemory{remote->id, d.length};
  }

  Status ReleaseRemote(const RemoteMemory& remote) override {
    rc::MutexLock lock(mu_);
    if (remotes_.erase(remote.id) == 0) return NotFound(fmt::format("shm remote {} is not imported", remote.id));
    return OkStatus();
  }

  Result<std::unique_ptr<Transfer>> PostReads(std::span<const ReadOp> ops) override {
    uint64_t total = 0;
    std::vector<std::shared_ptr<const Remote>> remotes;
    std::vector<uint32_t> op_remote(ops.size());
    {
      rc::MutexLock lock(mu_);
      std::unordered_map<uint64_t, uint32_t> index;
      for (size_t i = 0; i < ops.size(); ++i) {
        const ReadOp& op = ops[i];
        auto it = remotes_.find(op.source.id);
        if (it == remotes_.end()) {
          return InvalidArgument(
              fmt::format("read {} of batch: shm remote {} is not imported (or was released)", i, op.source.id));
        }
        const Remote& r = *it->second;
        RC_RETURN_IF_ERROR(internal::CheckReadOp(i, op, r.descriptor.length,
                                                 [&] { return fmt::format("shm remote {}", op.source.id); }));
        auto [slot, inserted] = index.emplace(op.source.id, static_cast<uint32_t>(remotes.size()));
        if (inserted) remotes.push_back(it->second);
        op_remote[i] = slot->second;
        total += op.length;
      }
    }
    auto shared = std::make_shared<TransferShared>(total);
    shared->remotes = std::move(remotes);

    // Group by source (stable), then cut into pieces of about piece_bytes.
    std::vector<uint32_t> order(ops.size());
    for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return op_remote[a] < op_remote[b]; });
    const bool inline_copy = total <= options_.inline_bytes;
    const uint64_t piece_bytes = inline_copy ? UINT64_MAX : std::max<uint64_t>(options_.piece_bytes, 4096);
    std::vector<Piece> pieces;
    Piece current{shared, {}};
    uint64_t current_bytes = 0;
    for (uint32_t i : order) {
      const ReadOp& op = ops[i];
      const Remote& r = *shared->remotes[op_remote[i]];
      const std::byte* src = r.data->addr + r.descriptor.offset + op.source_offset;
      auto* dst = static_cast<std::byte*>(op.dest);
      uint64_t left = op.length;
      while (left > 0) {
        const uint64_t n = std::min(left, piece_bytes - current_bytes);
        current.segments.push_back(Segment{src, dst, n, op_remote[i], op.observer});
        src += n;
        dst += n;
        left -= n;
        current_bytes += n;
        if (current_bytes == piece_bytes) {
          pieces.push_back(std::move(current));
          current = Piece{shared, {}};
          current_bytes = 0;
        }
      }
    }
    if (!current.segments.empty() || pieces.empty()) pieces.push_back(std::move(current));
    {
      // Not shared with a worker yet (the pieces are submitted below): the lock is uncontended and
      // keeps `remaining` checked by the analysis.
      rc::MutexLock lock(shared->mu);
      shared->remaining = pieces.size();
    }

    if (inline_copy) {
      for (const Piece& p : pieces) shared->FinishPiece(RunPiece(p));
    } else {
      pool_->Submit(std::move(pieces));
    }
    return std::unique_ptr<Transfer>(std::make_unique<ShmTransfer>(std::move(shared), clock_));
  }

 private:
  // Opens fd `fd` of process `pid`, checks it is the memfd named `name` (so a recycled pid or fd
  // number is refused), sealed against shrinking and at least `need` bytes long, and maps it
  // read-only. Mappings are shared by every Remote of the same memfd.
  Result<std::shared_ptr<Mapping>> OpenMapping(std::string_view descriptor, pid_t pid, int fd,
                                               const std::string& name, uint64_t need) {
    const std::string key = fmt::format("{}/{}/{}", pid, fd, name);
    {
      rc::MutexLock lock(mu_);
      auto it = mappings_.find(key);
      if (it != mappings_.end()) {
        if (auto m = it->second.lock()) {
          if (m->size < need) {
            return InvalidArgument(fmt::format("shm descriptor {}: needs {} bytes but memfd {} of process {} has {}",
                                               descriptor, need, fd, pid, m->size));
          }
          return m;
        }
      }
    }
    const std::string path = fmt::format("/proc/{}/fd/{}", pid, fd);
    // Look before opening: opening a FIFO (or a pipe's read end) blocks until a writer appears,
    // and a device may act on open. A descriptor naming anything but a regular file (a memfd is
    // one) is refused without opening it.
    struct stat before;
    if (::stat(path.c_str(), &before) == 0 && !S_ISREG(before.st_mode)) {
      return FailedPrecondition(fmt::format("shm descriptor {}: fd {} of process {} is a {}, not a memfd (a regular "
                                            "file); refusing to open it",
                                            descriptor, fd, pid, FileKind(before.st_mode)));
    }
    // O_NONBLOCK: even if the fd was swapped for a FIFO after the stat, open returns at once.
    const int f = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (f < 0) {
      const int err = errno;
      if (err == ENOENT || err == ESRCH) {
        return Unavailable(fmt::format("shm descriptor {}: owner process {} no longer holds fd {} (it exited, or "
                                       "freed the buffer)",
                                       descriptor, pid, fd));
      }
      return Unavailable(fmt::format("shm descriptor {}: cannot open {}: {}", descriptor, path, Errno(err)));
    }
    struct Closer {
      int fd;
      ~Closer() { ::close(fd); }
    } closer{f};
    // Check what we actually opened, through our own fd (no race with the owner's fd table).
    struct stat opened;
    if (::fstat(f, &opened) != 0) {
      return Unavailable(fmt::format("shm descriptor {}: fstat of {}: {}", descriptor, path, Errno(errno)));
    }
    if (!S_ISREG(opened.st_mode)) {
      return FailedPrecondition(fmt::format("shm descriptor {}: fd {} of process {} is a {}, not a memfd (a regular "
                                            "file); refusing to map it",
                                            descriptor, fd, pid, FileKind(opened.st_mode)));
    }
    char link[256];
    const std::string self = fmt::format("/proc/self/fd/{}", f);
    const ssize_t n = ::readlink(self.c_str(), link, sizeof link - 1);
    const std::string expected = "/memfd:" + name + " (deleted)";
    if (n < 0 || std::string_view(link, static_cast<size_t>(n)) != expected) {
      return Unavailable(fmt::format("shm descriptor {}: fd {} of process {} is not the memfd {} any more (the "
                                     "owner exited and the pid was reused, or the buffer was freed)",
                                     descriptor, fd, pid, name));
    }
    const int seals = ::fcntl(f, F_GET_SEALS);
    if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
      return FailedPrecondition(
          fmt::format("shm descriptor {}: memfd {} is not sealed against shrinking; refusing to map it", descriptor, name));
    }
    struct stat st;
    if (::fstat(f, &st) != 0) {
      return Unavailable(fmt::format("shm descriptor {}: fstat of {}: {}", descriptor, path, Errno(errno)));
    }
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    if (size < need) {
      return InvalidArgument(fmt::format("shm descriptor {}: needs {} bytes but memfd {} has {}", descriptor, need,
                                         name, size));
    }
    // MAP_POPULATE: page tables are filled at import (registration), not during the first reads.
    void* m = ::mmap(nullptr, size, PROT_READ, MAP_SHARED | MAP_POPULATE, f, 0);
    if (m == MAP_FAILED) {
      return Unavailable(fmt::format("shm descriptor {}: mmap of {} ({} bytes): {}", descriptor, path, size,
                                     Errno(errno)));
    }
    auto mapping = std::make_shared<Mapping>(static_cast<const std::byte*>(m), size);
    rc::MutexLock lock(mu_);
    mappings_[key] = mapping;
    return mapping;
  }

  Clock* const clock_;
  const ShmTransportOptions options_;
  const std::unique_ptr<CopyPool> pool_;

  mutable rc::Mutex mu_;
  std::unordered_set<uint64_t> owned_ GUARDED_BY(mu_);                                       // guarded by mu_
  std::unordered_map<uint64_t, std::shared_ptr<const Remote>> remotes_ GUARDED_BY(mu_);      // guarded by mu_
  std::unordered_map<std::string, std::weak_ptr<Mapping>> mappings_ GUARDED_BY(mu_);        // guarded by mu_
  uint64_t next_remote_id_ GUARDED_BY(mu_) = 1;                                              // guarded by mu_
};

}  // namespace

Result<std::unique_ptr<Transport>> CreateShmTransport(const TransportOptions& options) {
  return CreateShmTransport(options, ShmTransportOptions{});
}

Result<std::unique_ptr<Transport>> CreateShmTransport(const TransportOptions& options,
                                                      const ShmTransportOptions& shm_options) {
  ShmTransportOptions o = shm_options;
  if (o.copy_threads < 0 || o.copy_threads > 64) {
    return InvalidArgument(fmt::format("shm transport: copy_threads {} is outside 0..64", o.copy_threads));
  }
  if (o.copy_threads == 0) {
    o.copy_threads = static_cast<int>(std::clamp<unsigned>(std::thread::hardware_concurrency(), 1, 4));
  }
  Clock* clock = options.clock ? options.clock : SystemClock::Default();
  return std::unique_ptr<Transport>(std::make_unique<ShmTransport>(clock, o));
}

}  // namespace rc::transport
