// The transport conformance suite (src/transport/transport_conformance.h) over the host backends of
// the normal build: local, shm and ucx (when built).
//
// local and shm: owner and reader live in this process; the dead-owner case uses an
// rc_transport_peer child that has exited and been reaped.
//
// ucx: the owner is the real ucx transport of an rc_transport_peer child, so each process has one
// UCX worker, as in production (two workers of one process trip UCX 1.13's TCP wireup: "Assertion
// ... got REP message" after a "Connection refused", aborting the test binary now and then). The
// env's sources are ShmBuffers of this process that the peer maps shared (REGSHM): the test writes
// and checks them here, the peer's worker registers and serves them; owner() forwards
// RegisterMemory and Deregister to the peer (PeerOwner below). The dead-owner case SIGKILLs and
// reaps that peer after it registered a region.
#include "transport/transport_conformance.h"

#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "rolloutcore/transport/local.h"
#include "rolloutcore/transport/shm.h"
#include "transport/peer_process.h"
#ifdef RC_HAVE_UCX
#include "rolloutcore/transport/ucx.h"
#endif

namespace rc::transport::testing {
namespace {

// Page-aligned heap memory (local, ucx).
class HeapBuffer final : public TestBuffer {
 public:
  explicit HeapBuffer(uint64_t bytes)
      : size_(bytes), data_(static_cast<std::byte*>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096))) {
    std::memset(data_, 0, size_);
  }
  ~HeapBuffer() override { std::free(data_); }
  MemoryRegion region() const override { return {data_, size_, MemoryKind::kHost, -1}; }
  Status Write(uint64_t offset, const void* src, uint64_t n) override {
    std::memcpy(data_ + offset, src, n);
    return OkStatus();
  }
  Status Read(uint64_t offset, void* dst, uint64_t n) const override {
    std::memcpy(dst, data_ + offset, n);
    return OkStatus();
  }

 private:
  uint64_t size_;
  std::byte* data_;
};

class ShmTestBuffer : public TestBuffer {
 public:
  explicit ShmTestBuffer(ShmBuffer b) : b_(std::move(b)) {}
  MemoryRegion region() const override { return b_.region(); }
  int fd() const { return b_.fd(); }
  Status Write(uint64_t offset, const void* src, uint64_t n) override {
    std::memcpy(b_.data() + offset, src, n);
    return OkStatus();
  }
  Status Read(uint64_t offset, void* dst, uint64_t n) const override {
    std::memcpy(dst, b_.data() + offset, n);
    return OkStatus();
  }

 private:
  ShmBuffer b_;
};

// The descriptor of region 0 of an rc_transport_peer that has exited (reaped on return).
Result<std::string> DeadPeerDescriptor(const std::string& backend) {
  RC_ASSIGN_OR_RETURN(std::unique_ptr<PeerProcess> peer, PeerProcess::Spawn(backend, 1, {4096}));
  const std::string d = peer->descriptors().at(0);
  peer.reset();  // closes its stdin: it exits, and is reaped
  return d;
}

class LocalEnv final : public TransportEnv {
 public:
  explicit LocalEnv(std::unique_ptr<Transport> t) : t_(std::move(t)) {}
  Transport& owner() override { return *t_; }
  Transport& reader() override { return *t_; }
  Result<std::unique_ptr<TestBuffer>> Allocate(uint64_t bytes) override {
    return std::unique_ptr<TestBuffer>(std::make_unique<HeapBuffer>(bytes));
  }
  // What a local descriptor of another (now dead) process looks like.
  Result<std::string> DeadOwnerDescriptor() override {
    const pid_t child = ::fork();
    if (child == 0) ::_exit(0);
    if (child < 0) return Internal("fork failed");
    ::waitpid(child, nullptr, 0);
    return fmt::format("local:v1:{}:1:4096", child);
  }

 private:
  std::unique_ptr<Transport> t_;
};

class TwoTransportEnv : public TransportEnv {
 public:
  TwoTransportEnv(std::string backend, std::unique_ptr<Transport> owner, std::unique_ptr<Transport> reader)
      : backend_(std::move(backend)), owner_(std::move(owner)), reader_(std::move(reader)) {}
  Transport& owner() override { return *owner_; }
  Transport& reader() override { return *reader_; }
  Result<std::string> DeadOwnerDescriptor() override { return DeadPeerDescriptor(backend_); }

 private:
  std::string backend_;
  std::unique_ptr<Transport> owner_;
  std::unique_ptr<Transport> reader_;
};

class ShmEnv final : public TwoTransportEnv {
 public:
  using TwoTransportEnv::TwoTransportEnv;
  Result<std::unique_ptr<TestBuffer>> Allocate(uint64_t bytes) override {
    RC_ASSIGN_OR_RETURN(ShmBuffer b, ShmBuffer::Create(bytes));
    return std::unique_ptr<TestBuffer>(std::make_unique<ShmTestBuffer>(std::move(b)));
  }
};

#ifdef RC_HAVE_UCX
// The source buffers a UcxPeerEnv handed out that are still alive: what PeerOwner can ask the peer
// to map. Used from the test thread only (the suite allocates and registers there).
class PeerSources {
 public:
  struct Entry {
    const std::byte* base;
    uint64_t size;
    int fd;  // the ShmBuffer's memfd in this process
  };
  void Add(const Entry& e) { entries_.push_back(e); }
  void Remove(const std::byte* base) {
    std::erase_if(entries_, [&](const Entry& e) { return e.base == base; });
  }
  // The buffer that holds all of [addr, addr + length), or nullptr.
  const Entry* Find(const void* addr, uint64_t length) const {
    const auto a = reinterpret_cast<uintptr_t>(addr);
    for (const Entry& e : entries_) {
      const auto base = reinterpret_cast<uintptr_t>(e.base);
      if (a >= base && a - base <= e.size && length <= e.size - (a - base)) return &e;
    }
    return nullptr;
  }

 private:
  std::vector<Entry> entries_;
};

// A source of the ucx env: shared memory of this process that the owner peer maps.
class PeerSourceBuffer final : public ShmTestBuffer {
 public:
  PeerSourceBuffer(ShmBuffer b, std::shared_ptr<PeerSources> sources)
      : ShmTestBuffer(std::move(b)), sources_(std::move(sources)) {
    sources_->Add({data(), size(), fd()});
  }
  ~PeerSourceBuffer() override { sources_->Remove(data()); }

 private:
  std::shared_ptr<PeerSources> sources_;
};

// "ERR <code name>: <message>" of rc_transport_peer as the Status it names.
Status PeerError(std::string_view answer, std::string_view command, pid_t pid) {
  if (answer.rfind("ERR ", 0) == 0) {
    answer.remove_prefix(4);
    const size_t colon = answer.find(": ");
    if (colon != std::string_view::npos) {
      if (auto code = StatusCodeFromName(answer.substr(0, colon))) {
        return Status(*code, std::string(answer.substr(colon + 2)));
      }
    }
  }
  return Unavailable(fmt::format("owner peer (pid {}) answered '{}' to '{}'", pid, answer, command));
}

// owner() of the ucx env: RegisterMemory and Deregister are those of the real ucx transport in an
// rc_transport_peer child, reached over its stdin/stdout (REGSHM, REGKIND, DEREGID; see
// transport_peer_main.cc). Host memory must lie in one of the env's live source buffers (the peer
// maps that memfd; anything else is FailedPrecondition here, since the peer cannot see it); other
// kinds go to the peer as REGKIND, so the backend itself answers for the kind. The suite makes no
// other owner() calls: Import, ReleaseRemote and PostReads are Unimplemented (reads go through the
// env's reader). KillPeer() SIGKILLs and reaps the child; later calls are Unavailable.
class PeerOwner final : public Transport {
 public:
  PeerOwner(std::string backend, Capabilities capabilities, std::unique_ptr<PeerProcess> peer,
            std::shared_ptr<PeerSources> sources)
      : backend_(std::move(backend)),
        capabilities_(capabilities),
        peer_(std::move(peer)),
        pid_(peer_->pid()),
        sources_(std::move(sources)) {}

  std::string_view name() const override { return backend_; }
  Capabilities capabilities() const override { return capabilities_; }
  Clock& clock() const override { return *SystemClock::Default(); }

  Result<Registration> RegisterMemory(const MemoryRegion& region) override {
    std::string command;
    if (region.kind == MemoryKind::kHost) {
      const PeerSources::Entry* e = sources_->Find(region.addr, region.length);
      if (e == nullptr) {
        return FailedPrecondition(fmt::format(
            "{} owner peer (pid {}): {} bytes at {} are not inside a source buffer of the env (the peer maps only "
            "those)",
            backend_, pid_, region.length, region.addr));
      }
      command = fmt::format("REGSHM {} {} {} {}", ::getpid(), e->fd,
                            static_cast<const std::byte*>(region.addr) - e->base, region.length);
    } else {
      command = fmt::format("REGKIND device {} {}", region.device, region.length);
    }
    RC_ASSIGN_OR_RETURN(const std::string answer, Command(command));
    if (answer.rfind("REG ", 0) != 0) return PeerError(answer, command, pid_);
    const size_t sp = answer.find(' ', 4);
    if (sp == std::string::npos) return PeerError(answer, command, pid_);
    return Registration{std::strtoull(answer.c_str() + 4, nullptr, 10), answer.substr(sp + 1)};
  }

  Status Deregister(uint64_t registration_id) override {
    const std::string command = fmt::format("DEREGID {}", registration_id);
    RC_ASSIGN_OR_RETURN(const std::string answer, Command(command));
    return answer == "OK" ? OkStatus() : PeerError(answer, command, pid_);
  }

  Result<RemoteMemory> Import(std::string_view) override { return ReaderOnly("Import"); }
  Status ReleaseRemote(const RemoteMemory&) override { return ReaderOnly("ReleaseRemote"); }
  Result<std::unique_ptr<Transfer>> PostReads(std::span<const ReadOp>) override { return ReaderOnly("PostReads"); }

  void KillPeer() {
    if (!killed_) peer_->KillAndReap();
    killed_ = true;
  }

 private:
  Result<std::string> Command(const std::string& command) {
    if (killed_) return Unavailable(fmt::format("{} owner peer (pid {}) was killed", backend_, pid_));
    std::string answer = peer_->Command(command);
    if (answer.empty()) {
      return Unavailable(fmt::format("{} owner peer (pid {}) did not answer '{}' (see its stderr)", backend_, pid_,
                                     command));
    }
    return answer;
  }
  Status ReaderOnly(std::string_view what) const {
    return Unimplemented(fmt::format("{} owner peer (pid {}): {} belongs to the env's reader", backend_, pid_, what));
  }

  const std::string backend_;
  const Capabilities capabilities_;
  std::unique_ptr<PeerProcess> peer_;
  const pid_t pid_;
  std::shared_ptr<PeerSources> sources_;
  bool killed_ = false;
};

class UcxPeerEnv final : public TransportEnv {
 public:
  // Nullptr with *skip set when this machine has no usable UCX (the reader cannot be created);
  // a peer that does not start is a test failure, not a skip.
  static std::unique_ptr<TransportEnv> Make(std::string* skip) {
    auto reader = CreateTransport("ucx");
    if (!reader.ok()) {
      *skip = reader.status().ToString();
      return nullptr;
    }
    auto peer = PeerProcess::Spawn("ucx", 0, {});
    if (!peer.ok()) {
      ADD_FAILURE() << "ucx owner peer: " << peer.status().ToString();
      *skip = "no ucx owner peer";
      return nullptr;
    }
    auto sources = std::make_shared<PeerSources>();
    const Capabilities caps = (*reader)->capabilities();
    auto owner = std::make_unique<PeerOwner>("ucx", caps, std::move(peer).value(), sources);
    return std::unique_ptr<TransportEnv>(new UcxPeerEnv(std::move(sources), std::move(owner), std::move(reader).value()));
  }

  Transport& owner() override { return *owner_; }
  Transport& reader() override { return *reader_; }
  Result<std::unique_ptr<TestBuffer>> Allocate(uint64_t bytes) override {
    return std::unique_ptr<TestBuffer>(std::make_unique<HeapBuffer>(bytes));
  }
  Result<std::unique_ptr<TestBuffer>> AllocateSource(uint64_t bytes) override {
    RC_ASSIGN_OR_RETURN(ShmBuffer b, ShmBuffer::Create(bytes));
    return std::unique_ptr<TestBuffer>(std::make_unique<PeerSourceBuffer>(std::move(b), sources_));
  }
  // A region the owner peer registered, then the peer SIGKILLed and reaped (as a crashed trainer).
  Result<std::string> DeadOwnerDescriptor() override {
    RC_ASSIGN_OR_RETURN(std::unique_ptr<TestBuffer> source, AllocateSource(4096));
    RC_ASSIGN_OR_RETURN(Registration reg, owner_->RegisterMemory(source->region()));
    owner_->KillPeer();
    return reg.descriptor;
  }
  // ucx.h: on tcp and shared-memory transports UCX does not check rkeys after unmap.
  bool deregistration_fails_reads() const override { return false; }

  // The owner peer is SIGKILLed first, the reader destroyed after it, and the order matters: UCX
  // 1.13 aborts a process that purges a pending wireup REP message (openucx/ucx PR #8175 removed
  // that assertion), and only the owner ever queues a REP (it answers the reader's wireup REQ).
  // The owner must therefore never see the reader go away: a peer that got EOF after the reader
  // was destroyed aborted in ucp_worker_destroy in 8 of 260 cases. The reader, in turn, sees its
  // owner die (as after a trainer crash) and fails that peer; when a wireup was still unfinished
  // UCX logs a "Connection refused" for it, which is expected here.
  ~UcxPeerEnv() override {
    owner_->KillPeer();
    reader_.reset();
  }

 private:
  UcxPeerEnv(std::shared_ptr<PeerSources> sources, std::unique_ptr<PeerOwner> owner, std::unique_ptr<Transport> reader)
      : sources_(std::move(sources)), owner_(std::move(owner)), reader_(std::move(reader)) {}

  std::shared_ptr<PeerSources> sources_;
  std::unique_ptr<PeerOwner> owner_;  // its peer is killed before reader_ goes (see the destructor)
  std::unique_ptr<Transport> reader_;
};
#endif  // RC_HAVE_UCX

template <typename Env>
std::function<std::unique_ptr<TransportEnv>(std::string*)> MakeTwo(const std::string& backend) {
  return [backend](std::string* skip) -> std::unique_ptr<TransportEnv> {
    auto owner = CreateTransport(backend);
    auto reader = CreateTransport(backend);
    if (!owner.ok() || !reader.ok()) {
      *skip = (owner.ok() ? reader.status() : owner.status()).ToString();
      return nullptr;
    }
    return std::make_unique<Env>(backend, std::move(owner).value(), std::move(reader).value());
  };
}

std::vector<TransportParam> HostBackends() {
  std::vector<TransportParam> out;
  out.push_back({"local", [](std::string* skip) -> std::unique_ptr<TransportEnv> {
                   auto t = CreateTransport("local");
                   if (!t.ok()) {
                     *skip = t.status().ToString();
                     return nullptr;
                   }
                   return std::make_unique<LocalEnv>(std::move(t).value());
                 }});
  out.push_back({"shm", MakeTwo<ShmEnv>("shm")});
#ifdef RC_HAVE_UCX
  out.push_back({"ucx", UcxPeerEnv::Make});
#endif
  return out;
}

INSTANTIATE_TEST_SUITE_P(HostBackends, TransportConformanceTest, ::testing::ValuesIn(HostBackends()), ParamName);

}  // namespace
}  // namespace rc::transport::testing
