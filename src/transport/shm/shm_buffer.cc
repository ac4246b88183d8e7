#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <utility>
#include <unordered_map>
#include <vector>

#include "rolloutcore/base/mutex.h"
#include "rolloutcore/transport/shm.h"
#include "transport/shm/shm_owner.h"

namespace rc::transport {
namespace shm_internal {
namespace {

uint64_t PageRound(uint64_t n) {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return (n + page - 1) / page * page;
}

struct BufferInfo {
  uint64_t size;
  int fd;
  uint64_t token;
};

struct RegistrationInfo {
  std::byte* buffer_base;
  uint32_t slot;
  uint64_t generation;
  ShmDescriptor descriptor;
};

class OwnerState {
 public:
  static OwnerState& Get() {
    static OwnerState* state = new OwnerState();  // never destroyed: buffers may outlive statics
    return *state;
  }

  void AddBuffer(std::byte* base, uint64_t size, int fd, uint64_t token) {
    rc::MutexLock lock(mu_);
    buffers_[base] = BufferInfo{size, fd, token};
  }

  void RemoveBuffer(std::byte* base) {
    rc::MutexLock lock(mu_);
    buffers_.erase(base);
    for (auto& [id, reg] : registrations_) {
      if (reg.buffer_base == base) Kill(reg);
    }
  }

  Result<OwnerRegistration> Register(const void* addr, uint64_t length) {
    rc::MutexLock lock(mu_);
    const auto* p = static_cast<const std::byte*>(addr);
    // The buffer with the greatest base <= addr is the only candidate.
    auto it = buffers_.upper_bound(const_cast<std::byte*>(p));
    if (it == buffers_.begin()) return NotInBuffer(addr, length);
    --it;
    const uint64_t offset = static_cast<uint64_t>(p - it->first);
    if (offset > it->second.size || length > it->second.size - offset) return NotInBuffer(addr, length);
    RC_RETURN_IF_ERROR(EnsureControl());
    uint32_t slot;
    if (!free_slots_.empty()) {
      slot = free_slots_.back();
      free_slots_.pop_back();
    } else if (next_slot_ < kControlSlots) {
      slot = next_slot_++;
    } else {
      return FailedPrecondition(fmt::format(
          "shm transport: all {} registration slots of this process are in use; deregister regions first",
          kControlSlots));
    }
    const uint64_t generation = next_generation_++;
    ControlWord(slot).store(generation, std::memory_order_release);
    ShmDescriptor d;
    d.pid = ::getpid();
    d.fd = it->second.fd;
    d.token = it->second.token;
    d.offset = offset;
    d.length = length;
    d.ctl_fd = ctl_fd_;
    d.ctl_token = ctl_token_;
    d.slot = slot;
    d.generation = generation;
    const uint64_t id = next_id_++;
    registrations_.emplace(id, RegistrationInfo{it->first, slot, generation, d});
    return OwnerRegistration{id, d};
  }

  Status Deregister(uint64_t id) {
    rc::MutexLock lock(mu_);
    auto it = registrations_.find(id);
    if (it == registrations_.end()) return NotFound(fmt::format("shm registration {} is not registered", id));
    Kill(it->second);
    free_slots_.push_back(it->second.slot);
    registrations_.erase(it);
    return OkStatus();
  }

 private:
  Status NotInBuffer(const void* addr, uint64_t length) const {
    return FailedPrecondition(
        fmt::format("shm transport: region {} ({} bytes) is not inside a live ShmBuffer of this process; "
                    "allocate shards with ShmBuffer::Create (the shm transport shares memfd memory, it does not "
                    "copy arbitrary memory), or use the local/ucx transport",
                    addr, length));
  }

  std::atomic<uint64_t>& ControlWord(uint32_t slot) { return ctl_words_[slot]; }

  // Clears the control word; the release fence orders it before any later write the owner makes
  // to the buffer, so a reader that copied such a write sees the cleared word afterwards.
  void Kill(RegistrationInfo& reg) {
    ControlWord(reg.slot).store(0, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }

  Status EnsureControl() REQUIRES(mu_) {
    if (ctl_words_ != nullptr) return OkStatus();
    const uint64_t token = RandomToken();
    const std::string name = ControlMemfdName(token);
    const int fd = ::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) return Unavailable(fmt::format("shm transport: memfd_create for the control block: {}", std::strerror(errno)));
    const uint64_t bytes = PageRound(uint64_t{kControlSlots} * sizeof(uint64_t));
    if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0 ||
        ::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
      const int err = errno;
      ::close(fd);
      return Unavailable(fmt::format("shm transport: sizing the control block: {}", std::strerror(err)));
    }
    void* m = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return Unavailable(fmt::format("shm transport: mapping the control block: {}", std::strerror(err)));
    }
    static_assert(std::atomic<uint64_t>::is_always_lock_free);
    ctl_words_ = static_cast<std::atomic<uint64_t>*>(m);
    ctl_fd_ = fd;
    ctl_token_ = token;
    return OkStatus();
  }

  rc::Mutex mu_;
  std::map<std::byte*, BufferInfo> buffers_ GUARDED_BY(mu_);                     // guarded by mu_
  std::unordered_map<uint64_t, RegistrationInfo> registrations_ GUARDED_BY(mu_);  // guarded by mu_
  std::vector<uint32_t> free_slots_ GUARDED_BY(mu_);                              // guarded by mu_
  uint32_t next_slot_ GUARDED_BY(mu_) = 0;                                        // guarded by mu_
  uint64_t next_generation_ GUARDED_BY(mu_) = 1;                                  // guarded by mu_
  uint64_t next_id_ GUARDED_BY(mu_) = 1;                                          // guarded by mu_
  std::atomic<uint64_t>* ctl_words_ = nullptr;                    // set once under mu_
  int ctl_fd_ GUARDED_BY(mu_) = -1;                                               // guarded by mu_
  uint64_t ctl_token_ GUARDED_BY(mu_) = 0;                                        // guarded by mu_
};

}  // namespace

uint64_t RandomToken() {
  static rc::Mutex mu;
  static std::mt19937_64 rng = [] {
    std::random_device rd;
    std::seed_seq seq{rd(), rd(), rd(), rd(), static_cast<unsigned>(::getpid())};
    return std::mt19937_64(seq);
  }();
  rc::MutexLock lock(mu);
  uint64_t t = 0;
  while (t == 0) t = rng();
  return t;
}

std::string BufferMemfdName(uint64_t token) { return fmt::format("rc-shm-{:016x}", token); }
std::string ControlMemfdName(uint64_t token) { return fmt::format("rc-shmctl-{:016x}", token); }

void AddBuffer(std::byte* base, uint64_t size, int fd, uint64_t token) {
  OwnerState::Get().AddBuffer(base, size, fd, token);
}
void RemoveBuffer(std::byte* base) { OwnerState::Get().RemoveBuffer(base); }
Result<OwnerRegistration> Register(const void* addr, uint64_t length) {
  return OwnerState::Get().Register(addr, length);
}
Status Deregister(uint64_t id) { return OwnerState::Get().Deregister(id); }

}  // namespace shm_internal

Result<ShmBuffer> ShmBuffer::Create(uint64_t size) {
  if (size == 0) return InvalidArgument("ShmBuffer::Create: size must be positive");
  const uint64_t token = shm_internal::RandomToken();
  const std::string name = shm_internal::BufferMemfdName(token);
  const int fd = ::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return Unavailable(fmt::format("ShmBuffer::Create({}): memfd_create: {}", size, std::strerror(errno)));
  const uint64_t mapped = shm_internal::PageRound(size);
  // Sealed against shrinking so a reader's mapping can never fault, and against growing so the
  // size a reader checks is the size for good.
  if (::ftruncate(fd, static_cast<off_t>(mapped)) != 0 ||
      ::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    const int err = errno;
    ::close(fd);
    return Unavailable(fmt::format("ShmBuffer::Create({}): sizing the memfd: {}", size, std::strerror(err)));
  }
  void* m = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) {
    const int err = errno;
    ::close(fd);
    return Unavailable(fmt::format("ShmBuffer::Create({}): mmap: {}", size, std::strerror(err)));
  }
  ShmBuffer b;
  b.data_ = static_cast<std::byte*>(m);
  b.size_ = size;
  b.mapped_ = mapped;
  b.fd_ = fd;
  shm_internal::AddBuffer(b.data_, size, fd, token);
  return b;
}

ShmBuffer::ShmBuffer(ShmBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      mapped_(std::exchange(other.mapped_, 0)),
      fd_(std::exchange(other.fd_, -1)) {}

ShmBuffer& ShmBuffer::operator=(ShmBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_ = std::exchange(other.mapped_, 0);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

ShmBuffer::~ShmBuffer() { Reset(); }

void ShmBuffer::Reset() {
  if (data_ == nullptr) return;
  shm_internal::RemoveBuffer(data_);
  ::munmap(data_, mapped_);
  ::close(fd_);
  data_ = nullptr;
  size_ = mapped_ = 0;
  fd_ = -1;
}

MemoryRegion ShmBuffer::region(uint64_t offset, uint64_t length) const {
  MemoryRegion r;
  r.addr = data_ + offset;
  r.length = length;
  r.kind = MemoryKind::kHost;
  return r;
}

}  // namespace rc::transport
