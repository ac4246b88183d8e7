// The transport conformance suite (src/transport/transport_conformance.h) over the host backends of
// the normal build: local, shm and ucx (when built). Owner and reader live in this process; the
// dead-owner case uses an rc_transport_peer child that has exited and been reaped.
#include "transport/transport_conformance.h"

#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

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

class ShmTestBuffer final : public TestBuffer {
 public:
  explicit ShmTestBuffer(ShmBuffer b) : b_(std::move(b)) {}
  MemoryRegion region() const override { return b_.region(); }
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

class UcxEnv final : public TwoTransportEnv {
 public:
  using TwoTransportEnv::TwoTransportEnv;
  Result<std::unique_ptr<TestBuffer>> Allocate(uint64_t bytes) override {
    return std::unique_ptr<TestBuffer>(std::make_unique<HeapBuffer>(bytes));
  }
  // ucx.h: on tcp and shared-memory transports UCX does not check rkeys after unmap.
  bool deregistration_fails_reads() const override { return false; }
};

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
  // Owner and reader as two UCX workers of one process: UCX 1.13 (Debian 12) aborts in its TCP
  // wireup now and then ("Assertion ... got REP message" after a "Connection refused"), several
  // times in 13 cases x 5 runs. Until the ucx env moves the owner into a peer process (as
  // ucx_test's cross-process tests do), the ucx instantiation runs only on request.
  out.push_back({"ucx", [](std::string* skip) -> std::unique_ptr<TransportEnv> {
                   const char* on = std::getenv("ROLLOUTCORE_CONFORMANCE_UCX");
                   if (on == nullptr || std::string(on) != "1") {
                     *skip = "ucx: in-process owner+reader trips a UCX 1.13 wireup assertion; "
                             "ROLLOUTCORE_CONFORMANCE_UCX=1 runs it";
                     return nullptr;
                   }
                   return MakeTwo<UcxEnv>("ucx")(skip);
                 }});
#endif
  return out;
}

INSTANTIATE_TEST_SUITE_P(HostBackends, TransportConformanceTest, ::testing::ValuesIn(HostBackends()), ParamName);

}  // namespace
}  // namespace rc::transport::testing
