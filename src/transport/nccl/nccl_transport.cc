#include <arpa/inet.h>
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <nccl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>
#include <vector>

#include "rolloutcore/base/log.h"
#include "rolloutcore/base/mutex.h"
#include "rolloutcore/transport/nccl.h"
#include "transport/common/core_transport.h"
#include "transport/common/descriptor_codec.h"
#include "transport/common/process.h"
#include "transport/common/socket_io.h"
#include "transport/common/transfer_base.h"
#include "transport/gpu_common.h"
#include "transport/nccl/nccl_descriptor.h"

namespace rc::transport {
namespace {

using gpu_internal::CudaErrorText;
using gpu_internal::DeviceGuard;
using nccl_internal::FrameType;
using nccl_internal::NcclDescriptor;

using internal::ConnectionClosed;
using internal::RecvAll;
using internal::SendAll;
using internal::SteadyNs;

std::string NcclText(ncclResult_t r) { return fmt::format("{} ({})", ncclGetErrorString(r), static_cast<int>(r)); }

std::string NcclCommText(ncclResult_t r, ncclComm_t comm) {
  const char* last = comm != nullptr ? ncclGetLastError(comm) : ncclGetLastError(nullptr);
  return last != nullptr && last[0] != '\0' ? fmt::format("{}: {}", NcclText(r), last) : NcclText(r);
}

// ---- control connection --------------------------------------------------------------------------

Status SendFrame(int fd, FrameType type, std::string_view payload) {
  uint32_t header[2] = {static_cast<uint32_t>(type), static_cast<uint32_t>(payload.size())};
  std::string buf(reinterpret_cast<const char*>(header), sizeof header);
  buf.append(payload);
  return SendAll(fd, buf.data(), buf.size());
}

Status RecvFrame(int fd, int64_t deadline_ns, const std::function<Status()>& check, FrameType* type,
                 std::string* payload) {
  uint32_t header[2];
  RC_RETURN_IF_ERROR(RecvAll(fd, header, sizeof header, deadline_ns, check));
  if (header[1] > nccl_internal::kMaxFrameBytes) {
    return Unavailable(fmt::format("control connection: frame of {} bytes exceeds the limit", header[1]));
  }
  *type = static_cast<FrameType>(header[0]);
  payload->resize(header[1]);
  return RecvAll(fd, payload->data(), payload->size(), deadline_ns, check);
}

template <typename T>
void Put(std::string* s, T v) {
  s->append(reinterpret_cast<const char*>(&v), sizeof v);
}
template <typename T>
bool Get(std::string_view* s, T* v) {
  if (s->size() < sizeof(T)) return false;
  std::memcpy(v, s->data(), sizeof(T));
  s->remove_prefix(sizeof(T));
  return true;
}

// Polls a non-blocking communicator until its pending operation (init or enqueue) is done.
Status WaitComm(ncclComm_t comm, int64_t deadline_ns, const std::function<Status()>& check, std::string_view what) {
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return Unavailable(fmt::format("{}: ncclCommGetAsyncError: {}", what, NcclText(r)));
    if (state == ncclSuccess) return OkStatus();
    if (state != ncclInProgress) return Unavailable(fmt::format("{}: {}", what, NcclCommText(state, comm)));
    if (check) RC_RETURN_IF_ERROR(check().WithContext(what));
    if (SteadyNs() >= deadline_ns) return DeadlineExceeded(fmt::format("{}: not done before the deadline", what));
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

ncclConfig_t NonBlockingConfig() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

struct OwnedRegion {
  const std::byte* ptr = nullptr;
  uint64_t length = 0;
};

struct ReadRequestOp {
  uint64_t id = 0, offset = 0, length = 0;
};

// ---- owner side ----------------------------------------------------------------------------------

// The owner's control server: one thread accepting connections, one thread per reader.
class OwnerServer {
 public:
  OwnerServer(int device, uint64_t token, NcclTransportOptions options)
      : device_(device), token_(token), options_(std::move(options)) {}
  ~OwnerServer() { Stop(); }

  Status Start(const std::string& address) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (listen_fd_ < 0) return Unavailable(fmt::format("nccl transport: socket: {}", std::strerror(errno)));
    const int one = 1;
    ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = 0;
    if (::inet_pton(AF_INET, address.c_str(), &sa.sin_addr) != 1) {
      return InvalidArgument(fmt::format("nccl transport: listen address '{}' is not an IPv4 address", address));
    }
    if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 || ::listen(listen_fd_, 64) != 0) {
      return Unavailable(fmt::format("nccl transport: cannot listen on {}: {}", address, std::strerror(errno)));
    }
    socklen_t len = sizeof sa;
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&sa), &len);
    address_ = address;
    port_ = ntohs(sa.sin_port);
    accept_thread_ = std::thread([this] { AcceptLoop(); });
    return OkStatus();
  }

  void Stop() {
    {
      rc::MutexLock lock(mu_);
      if (stopped_) return;
      stopped_ = true;
      for (int fd : connections_) ::shutdown(fd, SHUT_RDWR);
    }
    if (listen_fd_ >= 0) ::shutdown(listen_fd_, SHUT_RDWR);
    if (accept_thread_.joinable()) accept_thread_.join();
    std::vector<std::thread> threads;
    {
      rc::MutexLock lock(mu_);
      threads.swap(threads_);
    }
    for (auto& t : threads) t.join();
    if (listen_fd_ >= 0) ::close(listen_fd_);
    listen_fd_ = -1;
  }

  const std::string& address() const { return address_; }
  uint16_t port() const { return port_; }

  uint64_t Add(const OwnedRegion& r) { return regions_.Add(r); }
  bool Remove(uint64_t id) { return regions_.Remove(id); }

 private:
  void AcceptLoop() {
    for (;;) {
      pollfd pfd{listen_fd_, POLLIN, 0};
      const int pr = ::poll(&pfd, 1, 100);
      {
        rc::MutexLock lock(mu_);
        if (stopped_) return;
      }
      if (pr <= 0) continue;
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      rc::MutexLock lock(mu_);
      if (stopped_) {
        ::close(fd);
        return;
      }
      connections_.push_back(fd);
      threads_.emplace_back([this, fd] {
        Serve(fd);
        rc::MutexLock l(mu_);
        connections_.erase(std::find(connections_.begin(), connections_.end(), fd));
        ::close(fd);
      });
    }
  }

  bool Stopped() {
    rc::MutexLock lock(mu_);
    return stopped_;
  }

  // One reader: handshake, then requests until the connection closes. Any failure aborts the
  // communicator (making this side's pending sends return) and closes the connection.
  void Serve(int fd) {
    ncclComm_t comm = nullptr;
    cudaStream_t stream = nullptr;
    std::string peer = "reader";
    Status s = ServeLoop(fd, &comm, &stream, &peer);
    if (!s.ok() && !Stopped()) RC_LOG_WARN("nccl transport (owner): {}: {}", peer, s.ToString());
    DeviceGuard guard(device_);
    if (comm != nullptr) (void)ncclCommAbort(comm);
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
  }

  Status ServeLoop(int fd, ncclComm_t* comm, cudaStream_t* stream, std::string* peer) {
    auto closed = [&]() -> Status {
      if (Stopped()) return Aborted("owner transport shut down");
      if (ConnectionClosed(fd)) return Unavailable(fmt::format("{} closed the control connection", *peer));
      return OkStatus();
    };
    FrameType type;
    std::string payload;
    RC_RETURN_IF_ERROR(RecvFrame(fd, SteadyNs() + options_.connect_timeout_ns, [&] {
      return Stopped() ? Aborted("owner transport shut down") : OkStatus();
    }, &type, &payload));
    std::string_view in = payload;
    uint64_t token = 0;
    int32_t reader_pid = 0;
    ncclUniqueId uid;
    if (type != FrameType::kHello || !Get(&in, &token) || !Get(&in, &reader_pid) || in.size() != sizeof uid) {
      (void)SendFrame(fd, FrameType::kError, "malformed hello");
      return InvalidArgument("malformed hello");
    }
    *peer = fmt::format("reader pid {}", reader_pid);
    if (token != token_) {
      (void)SendFrame(fd, FrameType::kError,
                      fmt::format("token {:016x} does not match this transport's (stale descriptor?)", token));
      return InvalidArgument("wrong token");
    }
    std::memcpy(&uid, in.data(), sizeof uid);
    DeviceGuard guard(device_);
    cudaError_t ce = guard.status();
    if (ce == cudaSuccess) ce = cudaStreamCreateWithFlags(stream, cudaStreamNonBlocking);
    if (ce != cudaSuccess) {
      const std::string why = fmt::format("owner device {}: {}", device_, CudaErrorText(ce));
      (void)SendFrame(fd, FrameType::kError, why);
      return Unavailable(why);
    }
    ncclConfig_t config = NonBlockingConfig();
    ncclResult_t r = ncclCommInitRankConfig(comm, 2, uid, 0, &config);
    Status init = (r == ncclSuccess || r == ncclInProgress)
                      ? WaitComm(*comm, SteadyNs() + options_.connect_timeout_ns, closed, "communicator init")
                      : Unavailable(fmt::format("ncclCommInitRankConfig: {}", NcclText(r)));
    if (!init.ok()) {
      (void)SendFrame(fd, FrameType::kError, init.ToString());
      return init;
    }
    RC_RETURN_IF_ERROR(SendFrame(fd, FrameType::kReady, ""));
    for (;;) {
      Status got = RecvFrame(fd, INT64_MAX, [&] { return Stopped() ? Aborted("owner transport shut down") : OkStatus(); },
                             &type, &payload);
      if (!got.ok()) return got.code() == StatusCode::kUnavailable ? OkStatus() : got;  // closed: normal end
      in = payload;
      if (type == FrameType::kQuery) {
        uint64_t id = 0;
        if (!Get(&in, &id)) return InvalidArgument("malformed query");
        OwnedRegion reg;
        if (!regions_.Find(id, &reg)) {
          RC_RETURN_IF_ERROR(SendFrame(fd, FrameType::kError, fmt::format("registration {} is not registered", id)));
          continue;
        }
        std::string out;
        Put(&out, reg.length);
        Put(&out, static_cast<int32_t>(device_));
        RC_RETURN_IF_ERROR(SendFrame(fd, FrameType::kQueryOk, out));
      } else if (type == FrameType::kRead) {
        uint64_t n = 0;
        if (!Get(&in, &n) || in.size() != n * sizeof(ReadRequestOp)) return InvalidArgument("malformed read");
        std::vector<ReadRequestOp> ops(n);
        std::memcpy(ops.data(), in.data(), in.size());
        std::vector<const std::byte*> src(n);
        const std::string error = regions_.Locked([&](const std::unordered_map<uint64_t, OwnedRegion>& regions) {
          for (size_t i = 0; i < n; ++i) {
            auto it = regions.find(ops[i].id);
            if (it == regions.end()) {
              return fmt::format("read {}: registration {} is not registered (deregistered?)", i, ops[i].id);
            }
            if (ops[i].offset > it->second.length || ops[i].length > it->second.length - ops[i].offset) {
              return fmt::format("read {}: bytes {}..{} outside registration {} of {} bytes", i, ops[i].offset,
                                 ops[i].offset + ops[i].length, ops[i].id, it->second.length);
            }
            src[i] = it->second.ptr + ops[i].offset;
          }
          return std::string();
        });
        if (!error.empty()) {
          RC_RETURN_IF_ERROR(SendFrame(fd, FrameType::kError, error));
          continue;
        }
        // Answer first: the reader's receives and these sends must be enqueued concurrently (the
        // first transfer also sets up the point-to-point connection, which needs both sides).
        RC_RETURN_IF_ERROR(SendFrame(fd, FrameType::kReadOk, ""));
        const size_t group = static_cast<size_t>(std::max(1, options_.max_ops_per_group));
        for (size_t begin = 0; begin < n; begin += group) {
          const size_t end = std::min<size_t>(n, begin + group);
          ncclGroupStart();
          ncclResult_t pr = ncclSuccess;
          for (size_t i = begin; i < end && pr == ncclSuccess; ++i) {
            if (ops[i].length > 0) pr = ncclSend(src[i], ops[i].length, ncclUint8, 1, *comm, *stream);
          }
          const ncclResult_t gr = ncclGroupEnd();
          if (pr != ncclSuccess && pr != ncclInProgress) return Unavailable(fmt::format("ncclSend: {}", NcclCommText(pr, *comm)));
          if (gr != ncclSuccess && gr != ncclInProgress) return Unavailable(fmt::format("ncclGroupEnd: {}", NcclCommText(gr, *comm)));
          RC_RETURN_IF_ERROR(WaitComm(*comm, SteadyNs() + options_.connect_timeout_ns, closed, "posting sends"));
        }
      } else {
        return InvalidArgument(fmt::format("unexpected frame type {}", static_cast<uint32_t>(type)));
      }
    }
  }

  const int device_;
  const uint64_t token_;
  const NcclTransportOptions options_;
  int listen_fd_ = -1;
  std::string address_;
  uint16_t port_ = 0;
  std::thread accept_thread_;

  rc::Mutex mu_;
  bool stopped_ GUARDED_BY(mu_) = false;
  std::vector<int> connections_ GUARDED_BY(mu_);
  std::vector<std::thread> threads_ GUARDED_BY(mu_);
  internal::RegionTable<OwnedRegion> regions_;  // its own lock
};

// ---- reader side ---------------------------------------------------------------------------------

// One connection + communicator to an owner transport.
struct Peer {
  std::string key;    // host:port:token (immutable)
  std::string label;  // "owner pid P at host:port" (immutable)
  pid_t pid = 0;      // immutable
  bool same_host = false;
  int device = 0;     // reader device (immutable)

  rc::Mutex mu;  // serializes the socket and NCCL calls on comm
  int fd GUARDED_BY(mu) = -1;                   // guarded by mu
  ncclComm_t comm GUARDED_BY(mu) = nullptr;     // guarded by mu; null once aborted
  cudaStream_t stream = nullptr;  // immutable after connect
  std::atomic<bool> aborted{false};
  Status failure GUARDED_BY(mu);  // guarded by mu; set before `aborted`
  std::atomic<int64_t> pending{0};       // transfers in flight
  std::atomic<int64_t> last_progress_ns{0};

  // Aborts the communicator (pending kernels return) and closes the connection; idempotent.
  void Abort(Status why) {
    rc::MutexLock lock(mu);
    AbortLocked(std::move(why));
  }
  void AbortLocked(Status why) REQUIRES(mu) {
    if (aborted.load()) return;
    failure = std::move(why);
    aborted.store(true);
    DeviceGuard guard(device);
    if (comm != nullptr) (void)ncclCommAbort(comm);
    comm = nullptr;
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
  Status Failure() {
    rc::MutexLock lock(mu);
    return failure;
  }
  ~Peer() {
    Abort(Aborted("connection closed"));
    if (stream != nullptr) {
      DeviceGuard guard(device);
      (void)cudaStreamSynchronize(stream);
      (void)cudaStreamDestroy(stream);
    }
  }
};

struct RemoteEntry {
  std::shared_ptr<Peer> peer;
  uint64_t id = 0;  // owner's registration id
  uint64_t length = 0;
  std::string descriptor;
};

struct Part {
  std::shared_ptr<Peer> peer;
  cudaEvent_t event = nullptr;
};

class Core : public std::enable_shared_from_this<Core> {
 public:
  Core(Clock* clock, int device, NcclTransportOptions options)
      : clock_(clock), device_(device), options_(std::move(options)) {
    std::random_device rd;
    token_ = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(SteadyNs());
    char host[256] = {};
    if (::gethostname(host, sizeof host - 1) == 0) hostname_ = host;
  }

  ~Core() {
    {
      rc::MutexLock lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    if (server_) server_->Stop();
    std::vector<std::shared_ptr<Peer>> peers;
    {
      rc::MutexLock lock(mu_);
      for (auto& [k, p] : peers_) peers.push_back(p);
      peers_.clear();
      remotes_.clear();
    }
    for (auto& p : peers) p->Abort(Aborted("nccl transport destroyed"));
  }

  void StartWatchdog() {
    watchdog_ = std::thread([this] { WatchdogLoop(); });
  }

  Clock& clock() const { return *clock_; }
  int device() const { return device_; }
  const NcclTransportOptions& options() const { return options_; }

  Result<Registration> Register(const MemoryRegion& region) {
    if (region.kind != MemoryKind::kDevice) {
      return Unimplemented("nccl transport registers device memory only (use shm or ucx for host memory)");
    }
    if (region.addr == nullptr || region.length == 0) {
      return InvalidArgument(fmt::format("nccl transport: cannot register {} bytes at {}", region.length, region.addr));
    }
    cudaPointerAttributes attr{};
    const cudaError_t e = cudaPointerGetAttributes(&attr, region.addr);
    if (e != cudaSuccess || attr.type != cudaMemoryTypeDevice) {
      (void)cudaGetLastError();
      return InvalidArgument(fmt::format("nccl transport: {} is not device memory", region.addr));
    }
    if (attr.device != device_ || (region.device >= 0 && region.device != device_)) {
      return InvalidArgument(fmt::format(
          "nccl transport on device {} cannot register memory of device {} (create one transport per device)",
          device_, attr.device));
    }
    rc::MutexLock lock(mu_);
    if (!server_) {
      const char* env = std::getenv("ROLLOUTCORE_NCCL_ADDRESS");
      const std::string address = env != nullptr && env[0] != '\0' ? env : options_.listen_address;
      auto server = std::make_unique<OwnerServer>(device_, token_, options_);
      RC_RETURN_IF_ERROR(server->Start(address));
      server_ = std::move(server);
    }
    NcclDescriptor d;
    d.host = server_->address();
    d.port = server_->port();
    d.pid = ::getpid();
    d.token = token_;
    d.device = device_;
    d.length = region.length;
    d.id = server_->Add({static_cast<const std::byte*>(region.addr), region.length});
    return Registration{d.id, nccl_internal::FormatNcclDescriptor(d)};
  }

  Status Deregister(uint64_t id) {
    rc::MutexLock lock(mu_);
    if (!server_ || !server_->Remove(id)) return NotFound(fmt::format("nccl registration {} is not registered", id));
    return OkStatus();
  }

  Result<RemoteMemory> Import(std::string_view descriptor) {
    RC_ASSIGN_OR_RETURN(NcclDescriptor d, nccl_internal::ParseNcclDescriptor(descriptor));
    const std::string key = fmt::format("{}:{}:{:016x}", d.host, d.port, d.token);
    std::shared_ptr<Peer> peer;
    {
      rc::MutexLock lock(mu_);
      auto it = peers_.find(key);
      if (it != peers_.end() && !it->second->aborted.load()) peer = it->second;
      if (it != peers_.end() && it->second->aborted.load()) peers_.erase(it);
    }
    if (!peer) {
      RC_ASSIGN_OR_RETURN(peer, Connect(d, key));
      rc::MutexLock lock(mu_);
      auto [it, inserted] = peers_.emplace(key, peer);
      if (!inserted) {
        if (it->second->aborted.load()) {
          it->second = peer;
        } else {
          peer = it->second;  // another thread connected first; ours closes when dropped
        }
      }
    }
    // Ask the owner for the registration.
    uint64_t length = 0;
    {
      rc::MutexLock lock(peer->mu);
      if (peer->aborted.load()) return Unavailable(fmt::format("nccl descriptor {}: {}", codec::Abbrev(descriptor), peer->failure.ToString()));
      std::string q;
      Put(&q, d.id);
      FrameType type;
      std::string payload;
      Status s = SendFrame(peer->fd, FrameType::kQuery, q);
      if (s.ok()) s = RecvFrame(peer->fd, SteadyNs() + options_.connect_timeout_ns, LivenessCheck(*peer), &type, &payload);
      if (!s.ok()) {
        peer->AbortLocked(s);
        return Unavailable(fmt::format("nccl descriptor {}: {}: {}", codec::Abbrev(descriptor), peer->label, s.ToString()));
      }
      if (type == FrameType::kError) {
        return NotFound(fmt::format("nccl descriptor {}: {}", codec::Abbrev(descriptor), payload));
      }
      std::string_view in = payload;
      int32_t dev = 0;
      if (type != FrameType::kQueryOk || !Get(&in, &length) || !Get(&in, &dev)) {
        peer->AbortLocked(Unavailable("malformed answer"));
        return Unavailable(fmt::format("nccl descriptor {}: malformed answer from {}", codec::Abbrev(descriptor), peer->label));
      }
    }
    if (length != d.length) {
      return NotFound(fmt::format("nccl descriptor {}: registration {} has {} bytes now", codec::Abbrev(descriptor), d.id, length));
    }
    rc::MutexLock lock(mu_);
    const uint64_t id = next_remote_++;
    remotes_.emplace(id, RemoteEntry{peer, d.id, d.length, std::string(descriptor)});
    return RemoteMemory{id, d.length};
  }

  Status Release(const RemoteMemory& remote) {
    rc::MutexLock lock(mu_);
    if (remotes_.erase(remote.id) == 0) return NotFound(fmt::format("nccl remote {} is not imported", remote.id));
    // Drop peers no remote uses any more (their connection closes when the last transfer goes).
    for (auto it = peers_.begin(); it != peers_.end();) {
      bool used = false;
      for (auto& [id, r] : remotes_) used |= r.peer == it->second;
      it = used ? std::next(it) : peers_.erase(it);
    }
    return OkStatus();
  }

  static Result<std::unique_ptr<Transfer>> PostReads(const std::shared_ptr<Core>& core, std::span<const ReadOp> ops);

  struct Posted {
    std::vector<Part> parts;
    Status failure;
  };

  Result<Posted> Post(std::span<const ReadOp> ops) {
    // Validate everything first.
    std::map<Peer*, std::pair<std::shared_ptr<Peer>, std::vector<size_t>>> by_peer;
    std::vector<uint64_t> reg(ops.size());
    {
      rc::MutexLock lock(mu_);
      for (size_t i = 0; i < ops.size(); ++i) {
        const ReadOp& op = ops[i];
        auto it = remotes_.find(op.source.id);
        if (it == remotes_.end()) {
          return InvalidArgument(fmt::format("read {} of batch: nccl remote {} is not imported", i, op.source.id));
        }
        const RemoteEntry& r = it->second;
        RC_RETURN_IF_ERROR(internal::CheckReadOp(i, op, r.length,
                                                 [&] { return fmt::format("nccl region {}", r.descriptor); }));
        reg[i] = r.id;
        auto& slot = by_peer[r.peer.get()];
        slot.first = r.peer;
        slot.second.push_back(i);
      }
    }
    Posted posted;
    for (auto& [raw, entry] : by_peer) {
      const std::shared_ptr<Peer>& peer = entry.first;
      Status s = PostToPeer(peer, ops, reg, entry.second, &posted.parts);
      if (!s.ok()) {
        posted.failure = s;
        break;
      }
    }
    return posted;
  }

 private:
  std::function<Status()> LivenessCheck(Peer& peer) {
    return [&peer] {
      if (peer.same_host && internal::ProcessGone(peer.pid)) {
        return Unavailable(fmt::format("{}: owner process is gone", peer.label));
      }
      return OkStatus();
    };
  }

  Result<std::shared_ptr<Peer>> Connect(const NcclDescriptor& d, const std::string& key) {
    auto peer = std::make_shared<Peer>();
    peer->key = key;
    peer->label = fmt::format("owner pid {} at {}:{}", d.pid, d.host, d.port);
    peer->pid = static_cast<pid_t>(d.pid);
    peer->same_host = d.host == "127.0.0.1" || d.host == "localhost" || d.host == hostname_;
    peer->device = device_;
    if (peer->same_host && internal::ProcessGone(peer->pid)) {
      return Unavailable(fmt::format("{}: owner process is gone", peer->label));
    }
    // One deadline for the whole connect: TCP handshake, hello, both sides' communicator init.
    const int64_t deadline = SteadyNs() + options_.connect_timeout_ns;
    RC_ASSIGN_OR_RETURN(const int fd, internal::ConnectTcp(d.host, d.port, deadline, peer->label, LivenessCheck(*peer)));
    {
      rc::MutexLock lock(peer->mu);  // not shared yet: uncontended, keeps fd checked
      peer->fd = fd;
    }
    ncclUniqueId uid;
    ncclResult_t r = ncclGetUniqueId(&uid);
    if (r != ncclSuccess) return Unavailable(fmt::format("{}: ncclGetUniqueId: {}", peer->label, NcclText(r)));
    std::string hello;
    Put(&hello, d.token);
    Put(&hello, static_cast<int32_t>(::getpid()));
    hello.append(reinterpret_cast<const char*>(&uid), sizeof uid);
    RC_RETURN_IF_ERROR(SendFrame(fd, FrameType::kHello, hello).WithContext(peer->label));
    DeviceGuard guard(device_);
    cudaError_t ce = guard.status();
    if (ce == cudaSuccess) ce = cudaStreamCreateWithFlags(&peer->stream, cudaStreamNonBlocking);
    if (ce != cudaSuccess) return Unavailable(fmt::format("{}: reader device {}: {}", peer->label, device_, CudaErrorText(ce)));
    ncclConfig_t config = NonBlockingConfig();
    rc::MutexLock lock(peer->mu);
    r = ncclCommInitRankConfig(&peer->comm, 2, uid, 1, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      return Unavailable(fmt::format("{}: ncclCommInitRankConfig: {}", peer->label, NcclText(r)));
    }
    // Both sides initialise concurrently; the owner answers Ready (or Error) when its side is done.
    FrameType type;
    std::string payload;
    auto check = LivenessCheck(*peer);
    Status s = RecvFrame(fd, deadline, check, &type, &payload);
    if (s.ok() && type == FrameType::kError) s = Unavailable(fmt::format("owner refused: {}", payload));
    if (s.ok() && type != FrameType::kReady) s = Unavailable("malformed answer to hello");
    if (s.ok()) s = WaitComm(peer->comm, deadline, check, "communicator init");
    if (!s.ok()) {
      peer->AbortLocked(s);
      return s.WithContext(peer->label);
    }
    peer->last_progress_ns.store(SteadyNs());
    return peer;
  }

  Status PostToPeer(const std::shared_ptr<Peer>& shared, std::span<const ReadOp> ops, const std::vector<uint64_t>& reg,
                    const std::vector<size_t>& indices, std::vector<Part>* parts) {
    Peer& peer = *shared;
    rc::MutexLock lock(peer.mu);
    if (peer.aborted.load()) return Unavailable(fmt::format("{}: {}", peer.label, peer.failure.ToString()));
    std::string req;
    Put(&req, static_cast<uint64_t>(indices.size()));
    for (size_t i : indices) {
      Put(&req, ReadRequestOp{reg[i], ops[i].source_offset, ops[i].length});
    }
    const int64_t deadline = SteadyNs() + options_.connect_timeout_ns;
    auto check = LivenessCheck(peer);
    FrameType type;
    std::string payload;
    Status s = SendFrame(peer.fd, FrameType::kRead, req);
    if (s.ok()) s = RecvFrame(peer.fd, deadline, check, &type, &payload);
    if (!s.ok()) {
      peer.AbortLocked(s);
      return Unavailable(fmt::format("{}: {}", peer.label, s.ToString()));
    }
    if (type == FrameType::kError) return Unavailable(fmt::format("{} refused the reads: {}", peer.label, payload));
    if (type != FrameType::kReadOk) {
      peer.AbortLocked(Unavailable("malformed answer"));
      return Unavailable(fmt::format("{}: malformed answer to a read request", peer.label));
    }
    DeviceGuard guard(device_);
    const size_t group = static_cast<size_t>(std::max(1, options_.max_ops_per_group));
    for (size_t begin = 0; begin < indices.size(); begin += group) {
      const size_t end = std::min(indices.size(), begin + group);
      ncclGroupStart();
      ncclResult_t pr = ncclSuccess;
      for (size_t k = begin; k < end && pr == ncclSuccess; ++k) {
        const ReadOp& op = ops[indices[k]];
        if (op.length > 0) pr = ncclRecv(op.dest, op.length, ncclUint8, 0, peer.comm, peer.stream);
      }
      const ncclResult_t gr = ncclGroupEnd();
      if (pr != ncclSuccess && pr != ncclInProgress) s = Unavailable(fmt::format("ncclRecv: {}", NcclCommText(pr, peer.comm)));
      if (s.ok() && gr != ncclSuccess && gr != ncclInProgress) s = Unavailable(fmt::format("ncclGroupEnd: {}", NcclCommText(gr, peer.comm)));
      if (s.ok()) s = WaitComm(peer.comm, deadline, check, "posting receives");
      if (!s.ok()) {
        // The owner's sends can never match now: abort both sides.
        peer.AbortLocked(s);
        return Unavailable(fmt::format("{}: {}", peer.label, s.ToString()));
      }
    }
    cudaEvent_t ev = nullptr;
    cudaError_t ce = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (ce == cudaSuccess) ce = cudaEventRecord(ev, peer.stream);
    if (ce != cudaSuccess) {
      if (ev != nullptr) (void)cudaEventDestroy(ev);
      peer.AbortLocked(Unavailable("event"));
      return Unavailable(fmt::format("{}: cudaEventRecord: {}", peer.label, CudaErrorText(ce)));
    }
    lock.unlock();
    peer.pending.fetch_add(1);
    peer.last_progress_ns.store(SteadyNs());
    // Shared ownership of the peer keeps its stream and connection alive while the transfer lives.
    parts->push_back(Part{shared, ev});
    return OkStatus();
  }

  void WatchdogLoop() {
    rc::MutexLock lock(mu_);
    while (!stop_) {
      cv_.wait_for(lock, std::chrono::nanoseconds(options_.watchdog_period_ns));
      if (stop_) return;
      std::vector<std::shared_ptr<Peer>> peers;
      for (auto& [k, p] : peers_) peers.push_back(p);
      for (auto& [id, r] : remotes_) peers.push_back(r.peer);
      lock.unlock();
      std::sort(peers.begin(), peers.end());
      peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
      const int64_t now = SteadyNs();
      for (auto& p : peers) {
        if (p->aborted.load()) continue;
        if (p->same_host && internal::ProcessGone(p->pid)) {
          p->Abort(Unavailable(fmt::format("{}: owner process died", p->label)));
          continue;
        }
        if (!p->mu.try_lock()) continue;  // a post is talking to it and checks liveness itself
        rc::MutexLock pl(p->mu, std::adopt_lock);
        if (p->fd >= 0 && ConnectionClosed(p->fd)) {
          p->AbortLocked(Unavailable(fmt::format("{}: control connection closed (owner died or closed its transport)", p->label)));
          continue;
        }
        if (p->comm != nullptr) {
          ncclResult_t state = ncclSuccess;
          if (ncclCommGetAsyncError(p->comm, &state) == ncclSuccess && state != ncclSuccess && state != ncclInProgress) {
            p->AbortLocked(Unavailable(fmt::format("{}: NCCL error: {}", p->label, NcclCommText(state, p->comm))));
            continue;
          }
        }
        if (options_.stall_timeout_ns > 0 && p->pending.load() > 0 &&
            now - p->last_progress_ns.load() > options_.stall_timeout_ns) {
          p->AbortLocked(Unavailable(fmt::format("{}: transfers made no progress for {} s", p->label,
                                                 options_.stall_timeout_ns / 1'000'000'000)));
        }
      }
      lock.lock();
    }
  }

  Clock* clock_;
  const int device_;
  const NcclTransportOptions options_;
  uint64_t token_ = 0;
  std::string hostname_;
  std::thread watchdog_;

  rc::Mutex mu_;
  rc::CondVar cv_;
  bool stop_ GUARDED_BY(mu_) = false;                                              // guarded by mu_
  std::unique_ptr<OwnerServer> server_ GUARDED_BY(mu_);                            // guarded by mu_
  uint64_t next_remote_ GUARDED_BY(mu_) = 1;                                       // guarded by mu_
  std::unordered_map<uint64_t, RemoteEntry> remotes_ GUARDED_BY(mu_);              // guarded by mu_
  std::unordered_map<std::string, std::shared_ptr<Peer>> peers_ GUARDED_BY(mu_);   // guarded by mu_
};

class NcclTransfer final : public internal::RecordedTransfer {
 public:
  NcclTransfer(std::shared_ptr<Core> core, Core::Posted posted, uint64_t bytes)
      : RecordedTransfer(core->clock(), bytes), core_(std::move(core)), parts_(std::move(posted.parts)) {
    if (!posted.failure.ok()) {
      // Parts posted before the failure are cancelled: their peers are aborted.
      for (Part& p : parts_) p.peer->Abort(Aborted("a later part of the same transfer failed to post"));
      Done(TransferState::kFailed, std::move(posted.failure));
    }
  }

  ~NcclTransfer() override {
    if (state() == TransferState::kPending) Cancel();
    DeviceGuard guard(core_->device());
    const int64_t give_up = SteadyNs() + core_->options().drain_grace_ns;
    for (Part& p : parts_) {
      while (cudaEventQuery(p.event) == cudaErrorNotReady && SteadyNs() < give_up) {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      (void)cudaEventDestroy(p.event);
      if (!counted_done_) p.peer->pending.fetch_sub(1);
    }
    (void)cudaGetLastError();
  }

  void Cancel() override {
    if (Poll() != TransferState::kPending) return;
    cancelled_ = true;
    for (Part& p : parts_) p.peer->Abort(Aborted(fmt::format("a transfer of {} bytes was cancelled", bytes())));
    Poll();
  }

 private:
  std::string PendingAtDeadline() const override {
    return fmt::format("nccl transfer of {} bytes still pending at the deadline", bytes());
  }

  TransferState PollPending() override {
    const uint64_t bytes_ = bytes();
    DeviceGuard guard(core_->device());
    bool all_done = true;
    for (Part& p : parts_) {
      // The event first, then the abort flag: an event that completed before the peer was
      // aborted proves the data arrived; one completing after the abort proves nothing.
      const cudaError_t e = cudaEventQuery(p.event);
      if (p.peer->aborted.load()) {
        if (cancelled_) return Done(TransferState::kFailed, Aborted(fmt::format("nccl transfer of {} bytes cancelled", bytes_)));
        const Status why = p.peer->Failure();
        return Done(TransferState::kFailed,
                      why.code() == StatusCode::kAborted ? why : Unavailable(fmt::format("nccl transfer of {} bytes failed: {}", bytes_, why.message())));
      }
      if (e == cudaErrorNotReady) {
        all_done = false;
        continue;
      }
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return Done(TransferState::kFailed, Unavailable(fmt::format("nccl transfer of {} bytes from {}: {}", bytes_,
                                                                      p.peer->label, CudaErrorText(e))));
      }
    }
    if (!all_done) return TransferState::kPending;
    for (Part& p : parts_) p.peer->last_progress_ns.store(SteadyNs());
    return Done(TransferState::kDone, OkStatus());
  }

  // Finish, and the transfer no longer counts as in flight on its peers.
  TransferState Done(TransferState state, Status status) {
    if (!counted_done_) {
      for (Part& p : parts_) p.peer->pending.fetch_sub(1);
      counted_done_ = true;
    }
    return Finish(state, std::move(status));
  }

  std::shared_ptr<Core> core_;
  std::vector<Part> parts_;
  bool cancelled_ = false;
  bool counted_done_ = false;
};

Result<std::unique_ptr<Transfer>> Core::PostReads(const std::shared_ptr<Core>& core, std::span<const ReadOp> ops) {
  RC_ASSIGN_OR_RETURN(Core::Posted posted, core->Post(ops));
  return std::unique_ptr<Transfer>(std::make_unique<NcclTransfer>(core, std::move(posted), internal::BatchBytes(ops)));
}

Capabilities NcclCapabilities() {
  Capabilities c;
  c.device_memory = true;
  c.cross_process = true;
  c.cross_host = true;
  c.asynchronous = true;
  return c;
}

}  // namespace

Result<std::unique_ptr<Transport>> CreateNcclTransport(const TransportOptions& options) {
  return CreateNcclTransport(options, NcclTransportOptions{});
}

Result<std::unique_ptr<Transport>> CreateNcclTransport(const TransportOptions& options,
                                                       const NcclTransportOptions& nccl_options) {
  // Never use NVLink multicast (NVLS): it can take shared GPUs out of service. (setenv only when
  // needed: it races with getenv in other threads.)
  if (const char* nvls = std::getenv("NCCL_NVLS_ENABLE"); nvls == nullptr || std::strcmp(nvls, "0") != 0) {
    ::setenv("NCCL_NVLS_ENABLE", "0", 1);
  }
  RC_ASSIGN_OR_RETURN(const int device, gpu_internal::ResolveDevice("nccl", options.device));
  if (nccl_options.watchdog_period_ns <= 0 || nccl_options.connect_timeout_ns <= 0) {
    return InvalidArgument("nccl transport: watchdog_period_ns and connect_timeout_ns must be positive");
  }
  Clock* clock = options.clock ? options.clock : SystemClock::Default();
  auto core = std::make_shared<Core>(clock, device, nccl_options);
  core->StartWatchdog();
  return std::unique_ptr<Transport>(
      std::make_unique<internal::CoreTransport<Core>>("nccl", NcclCapabilities(), std::move(core)));
}

}  // namespace rc::transport
