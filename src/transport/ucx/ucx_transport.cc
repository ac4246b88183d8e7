#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "rolloutcore/base/log.h"
#include "rolloutcore/base/mutex.h"
#include "rolloutcore/transport/ucx.h"
#include "transport/common/core_transport.h"
#include "transport/common/process.h"
#include "transport/common/transfer_base.h"
#include "transport/ucx/ucx_descriptor.h"

namespace rc::transport {
namespace {

using ucx_internal::UcxDescriptor;

std::string UcsError(ucs_status_t s) { return fmt::format("{} ({})", ucs_status_string(s), static_cast<int>(s)); }

std::string LocalHostName() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0 || buf[0] == '\0') return "unknown-host";
  return buf;
}

class Core;

// One connection to a peer worker. Guarded by Core::mu_ except the immutable fields.
struct Peer : std::enable_shared_from_this<Peer> {
  Core* core = nullptr;      // immutable
  std::string label;         // "pid 123 on host" (immutable)
  pid_t pid = 0;             // immutable
  bool same_host = false;    // immutable: liveness of pid can be checked here
  bool peer_error_mode = false;  // immutable: UCP_ERR_HANDLING_MODE_PEER (else NONE, see ucx.h)
  ucp_ep_h ep = nullptr;     // null once closed
  ucs_status_t error = UCS_OK;
  std::string worker_address;  // cache key (immutable)
};

// An imported registration. Destroyed only under Core::mu_ or in ~Core (it owns a UCP rkey).
struct Remote {
  uint64_t id = 0;
  UcxDescriptor descriptor;
  std::shared_ptr<Peer> peer;
  ucp_rkey_h rkey = nullptr;
  Remote() = default;
  Remote(const Remote&) = delete;
  Remote& operator=(const Remote&) = delete;
  ~Remote() {
    if (rkey != nullptr) ucp_rkey_destroy(rkey);
  }
};

// State of one transfer, shared by the Transfer and the UCX callbacks of its gets.
struct TransferShared {
  explicit TransferShared(uint64_t total) : bytes(total) {}
  const uint64_t bytes;
  std::string peers_label;  // set before posting; then read-only
  std::atomic<int64_t>* core_in_flight = nullptr;  // set before posting

  rc::Mutex mu;
  rc::CondVar cv;
  size_t in_flight GUARDED_BY(mu) = 0;               // guarded by mu
  bool cancelled GUARDED_BY(mu) = false;             // guarded by mu
  bool abandoned GUARDED_BY(mu) = false;             // guarded by mu: its peer died; gets may never complete
  ucs_status_t first_error GUARDED_BY(mu) = UCS_OK;  // guarded by mu
  Status failure GUARDED_BY(mu);                     // guarded by mu: a failure found while posting

  // Remotes used by the transfer; released under Core::mu_ by ~UcxTransfer.
  std::vector<std::shared_ptr<Remote>> remotes;

  bool FinishedLocked() const REQUIRES(mu) { return in_flight == 0 || abandoned; }
  Status FinalLocked() const REQUIRES(mu) {
    if (!failure.ok()) return failure;
    if (first_error != UCS_OK) {
      const std::string what =
          fmt::format("ucx transfer of {} bytes from {} failed: {}", bytes, peers_label, UcsError(first_error));
      return first_error == UCS_ERR_CANCELED ? Aborted(what) : Unavailable(what);
    }
    if (cancelled) return Aborted(fmt::format("ucx transfer of {} bytes cancelled", bytes));
    return OkStatus();
  }
};

void GetDone(void* request, ucs_status_t status, void* user_data) {
  auto* t = static_cast<TransferShared*>(user_data);
  {
    rc::MutexLock lock(t->mu);
    if (status != UCS_OK && t->first_error == UCS_OK) t->first_error = status;
    if (--t->in_flight == 0) t->cv.notify_all();
  }
  t->core_in_flight->fetch_sub(1);
  ucp_request_free(request);
}

void PeerFailed(void* arg, ucp_ep_h /*ep*/, ucs_status_t status);

// Everything that touches UCP. Shared by the transport and its transfers so a transfer can
// outlive the transport object safely.
class Core {
 public:
  Core(Clock* clock, UcxTransportOptions options) : clock_(clock), options_(options), host_(LocalHostName()) {}

  ~Core() {
    Shutdown();
    // Abandoned transfers may still be known to UCX (their gets never completed): keep their
    // state alive until the worker is gone, but destroy their rkeys while the context exists.
    std::vector<std::shared_ptr<TransferShared>> abandoned(transfers_in_flight_.begin(), transfers_in_flight_.end());
    transfers_in_flight_.clear();
    for (const auto& t : abandoned) t->remotes.clear();
    remotes_.clear();  // rkeys first
    for (auto& [id, memh] : registrations_) ucp_mem_unmap(context_, memh);
    registrations_.clear();
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    if (context_ != nullptr) ucp_cleanup(context_);
    if (wake_fd_ >= 0) ::close(wake_fd_);
  }

  Status Init() {
    ucp_config_t* config = nullptr;
    ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
    if (s != UCS_OK) return Unavailable(fmt::format("ucx transport: ucp_config_read: {}", UcsError(s)));
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
    params.name = "rolloutcore";
    s = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    if (s != UCS_OK) return Unavailable(fmt::format("ucx transport: ucp_init: {}", UcsError(s)));
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    s = ucp_worker_create(context_, &wp, &worker_);
    if (s != UCS_OK) return Unavailable(fmt::format("ucx transport: ucp_worker_create: {}", UcsError(s)));
    s = ucp_worker_get_efd(worker_, &efd_);
    if (s != UCS_OK) return Unavailable(fmt::format("ucx transport: ucp_worker_get_efd: {}", UcsError(s)));
    ucp_worker_attr_t attr{};
    attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
    s = ucp_worker_query(worker_, &attr);
    if (s != UCS_OK) return Unavailable(fmt::format("ucx transport: ucp_worker_query: {}", UcsError(s)));
    worker_address_.assign(reinterpret_cast<const char*>(attr.address), attr.address_length);
    ucp_worker_release_address(worker_, attr.address);
    wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) return Unavailable(fmt::format("ucx transport: eventfd: {}", std::strerror(errno)));
    progress_ = std::thread([this] { ProgressLoop(); });
    return OkStatus();
  }

  // Stops the progress thread and force-closes every endpoint so no get stays in flight.
  void Shutdown() {
    {
      rc::MutexLock lock(mu_);
      if (stopped_) return;
      stopped_ = true;
    }
    Wake();
    if (progress_.joinable()) progress_.join();
    rc::MutexLock lock(mu_);
    if (worker_ == nullptr) return;
    for (auto& [key, peer] : peers_) CloseEndpointLocked(*peer, UCS_ERR_CANCELED);
    peers_.clear();
    for (auto& remote : remotes_) CloseEndpointLocked(*remote.second->peer, UCS_ERR_CANCELED);
    // Wait for the gets UCX still owes a callback, except those of abandoned transfers (a dead
    // peer without error handling may never answer them).
    auto owed = [&]() REQUIRES(mu_) {
      size_t n = 0;
      for (const auto& t : transfers_in_flight_) {
        rc::MutexLock tl(t->mu);
        if (!t->abandoned) n += t->in_flight;
      }
      return n;
    };
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while ((!closing_.empty() || owed() > 0) && std::chrono::steady_clock::now() < give_up) {
      ucp_worker_progress(worker_);
      ReapClosingLocked();
    }
  }

  Clock& clock() const { return *clock_; }
  const UcxTransportOptions& options() const { return options_; }

  Result<Registration> Register(const MemoryRegion& region) {
    if (region.kind != MemoryKind::kHost) return Unimplemented("ucx transport registers host memory only (for now)");
    if (region.addr == nullptr || region.length == 0) {
      return InvalidArgument(fmt::format("ucx transport: cannot register {} bytes at {}", region.length, region.addr));
    }
    rc::MutexLock lock(mu_);
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = const_cast<void*>(region.addr);
    mp.length = region.length;
    ucp_mem_h memh = nullptr;
    ucs_status_t s = ucp_mem_map(context_, &mp, &memh);
    if (s != UCS_OK) {
      return Unavailable(fmt::format("ucx transport: ucp_mem_map of {} bytes at {}: {}", region.length, region.addr,
                                     UcsError(s)));
    }
    void* packed = nullptr;
    size_t packed_size = 0;
    s = ucp_rkey_pack(context_, memh, &packed, &packed_size);
    if (s != UCS_OK) {
      ucp_mem_unmap(context_, memh);
      return Unavailable(fmt::format("ucx transport: ucp_rkey_pack: {}", UcsError(s)));
    }
    UcxDescriptor d;
    d.host = host_;
    d.pid = ::getpid();
    d.id = next_registration_id_++;
    d.address = reinterpret_cast<uint64_t>(region.addr);
    d.length = region.length;
    d.worker_address = worker_address_;
    d.rkey.assign(static_cast<const char*>(packed), packed_size);
    ucp_rkey_buffer_release(packed);
    registrations_.emplace(d.id, memh);
    return Registration{d.id, ucx_internal::FormatUcxDescriptor(d)};
  }

  Status Deregister(uint64_t id) {
    rc::MutexLock lock(mu_);
    auto it = registrations_.find(id);
    if (it == registrations_.end()) return NotFound(fmt::format("ucx registration {} is not registered here", id));
    const ucs_status_t s = ucp_mem_unmap(context_, it->second);
    registrations_.erase(it);
    if (s != UCS_OK) return Internal(fmt::format("ucx transport: ucp_mem_unmap of registration {}: {}", id, UcsError(s)));
    return OkStatus();
  }

  Result<RemoteMemory> Import(std::string_view descriptor) {
    RC_ASSIGN_OR_RETURN(UcxDescriptor d, ucx_internal::ParseUcxDescriptor(descriptor));
    const std::string label = fmt::format("pid {} on {}", d.pid, d.host);
    if (d.host == host_ && ::kill(static_cast<pid_t>(d.pid), 0) != 0 && errno == ESRCH) {
      return Unavailable(fmt::format("ucx descriptor of registration {}: owner process {} is gone", d.id, label));
    }
    rc::MutexLock lock(mu_);
    if (stopped_) return FailedPrecondition("ucx transport is shut down");
    std::shared_ptr<Peer>& peer = peers_[d.worker_address];
    if (peer == nullptr || peer->ep == nullptr) {
      auto fresh = std::make_shared<Peer>();
      fresh->core = this;
      fresh->label = label;
      fresh->pid = static_cast<pid_t>(d.pid);
      fresh->same_host = d.host == host_;
      fresh->worker_address = d.worker_address;
      ucp_ep_params_t ep{};
      ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep.address = reinterpret_cast<const ucp_address_t*>(fresh->worker_address.data());
      ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      ep.err_handler.cb = &PeerFailed;
      ep.err_handler.arg = fresh.get();
      fresh->peer_error_mode = true;
      ucs_status_t s = ucp_ep_create(worker_, &ep, &fresh->ep);
      if (s == UCS_ERR_UNREACHABLE && fresh->same_host && options_.allow_no_peer_error_handling) {
        // UCX 1.13's shared-memory transports have no peer failure handler; fall back to NONE and
        // watch the owner's pid ourselves (see ucx.h).
        RC_LOG_DEBUG("ucx transport: no transport to {} supports peer error handling; using the pid watchdog",
                     label);
        ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
        fresh->peer_error_mode = false;
        s = ucp_ep_create(worker_, &ep, &fresh->ep);
      }
      if (s != UCS_OK) {
        peers_.erase(d.worker_address);
        return Unavailable(fmt::format("ucx descriptor of registration {}: cannot connect to {}: {}", d.id, label,
                                       UcsError(s)));
      }
      peer = fresh;
    }
    auto remote = std::make_shared<Remote>();
    remote->descriptor = std::move(d);
    remote->peer = peer;
    const ucs_status_t s = ucp_ep_rkey_unpack(peer->ep, remote->descriptor.rkey.data(), &remote->rkey);
    if (s != UCS_OK) {
      return InvalidArgument(fmt::format("ucx descriptor of registration {} from {}: field 'rkey': cannot unpack: {}",
                                         remote->descriptor.id, label, UcsError(s)));
    }
    remote->id = next_remote_id_++;
    remotes_.emplace(remote->id, remote);
    return RemoteMemory{remote->id, remote->descriptor.length};
  }

  Status Release(const RemoteMemory& remote) {
    rc::MutexLock lock(mu_);
    if (remotes_.erase(remote.id) == 0) return NotFound(fmt::format("ucx remote {} is not imported", remote.id));
    return OkStatus();
  }

  static Result<std::unique_ptr<Transfer>> PostReads(const std::shared_ptr<Core>& core, std::span<const ReadOp> ops);

  // Checks the batch, then posts every get. Returns the shared state (in_flight counts posted gets).
  Result<std::shared_ptr<TransferShared>> Post(std::span<const ReadOp> ops) {
    rc::MutexLock lock(mu_);
    if (stopped_) return FailedPrecondition("ucx transport is shut down");
    uint64_t total = 0;
    std::vector<Remote*> by_op(ops.size());
    std::unordered_map<uint64_t, std::shared_ptr<Remote>> used;
    for (size_t i = 0; i < ops.size(); ++i) {
      const ReadOp& op = ops[i];
      auto it = remotes_.find(op.source.id);
      if (it == remotes_.end()) {
        return InvalidArgument(
            fmt::format("read {} of batch: ucx remote {} is not imported (or was released)", i, op.source.id));
      }
      const Remote& r = *it->second;
      RC_RETURN_IF_ERROR(internal::CheckReadOp(i, op, r.descriptor.length,
                                               [&] { return fmt::format("ucx remote {}", op.source.id); }));
      by_op[i] = it->second.get();
      used.emplace(op.source.id, it->second);
      total += op.length;
    }
    auto t = std::make_shared<TransferShared>(total);
    t->core_in_flight = &in_flight_;
    std::unordered_set<const Peer*> seen_peers;
    for (auto& [id, r] : used) {
      if (seen_peers.insert(r->peer.get()).second) {
        t->peers_label += t->peers_label.empty() ? r->peer->label : ", " + r->peer->label;
      }
      t->remotes.push_back(r);
    }
    // A dead peer fails the batch as a transfer (not as a malformed batch): nothing is posted.
    for (auto& [id, r] : used) {
      if (r->peer->ep == nullptr) {
        rc::MutexLock tl(t->mu);  // not shared yet: uncontended, keeps `failure` checked
        t->failure = Unavailable(fmt::format("ucx peer {} of remote {} failed earlier ({}); re-import its descriptors",
                                             r->peer->label, id, UcsError(r->peer->error)));
        return t;
      }
    }
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = &GetDone;
    param.user_data = t.get();
    for (size_t i = 0; i < ops.size(); ++i) {
      const ReadOp& op = ops[i];
      if (op.length == 0) continue;
      Remote& r = *by_op[i];
      {
        rc::MutexLock tl(t->mu);
        ++t->in_flight;  // before posting: the callback may run inside ucp_get_nbx
      }
      ++in_flight_;
      ucs_status_ptr_t p = ucp_get_nbx(r.peer->ep, op.dest, op.length, r.descriptor.address + op.source_offset,
                                       r.rkey, &param);
      if (p == nullptr || UCS_PTR_IS_ERR(p)) {
        rc::MutexLock tl(t->mu);
        --t->in_flight;
        --in_flight_;
        if (UCS_PTR_IS_ERR(p)) {
          t->failure = Unavailable(fmt::format("read {} of batch: ucp_get_nbx from {}: {}", i, r.peer->label,
                                               UcsError(UCS_PTR_STATUS(p))));
          break;  // gets already posted still complete; nothing more is posted
        }
      } else {
        transfers_in_flight_.insert(t);
      }
    }
    Wake();
    return t;
  }

  // Called by ~UcxTransfer when its gets did not drain in time.
  void ForceClosePeersOf(const TransferShared& t) {
    rc::MutexLock lock(mu_);
    for (const auto& r : t.remotes) {
      if (r->peer->ep != nullptr) {
        auto it = peers_.find(r->peer->worker_address);
        if (it != peers_.end() && it->second == r->peer) peers_.erase(it);
        CloseEndpointLocked(*r->peer, UCS_ERR_CANCELED);
        AbandonTransfersOfLocked(*r->peer, UCS_ERR_CANCELED);
      }
    }
    Wake();
  }

  void ReleaseTransfer(const std::shared_ptr<TransferShared>& t) {
    rc::MutexLock lock(mu_);
    {
      rc::MutexLock tl(t->mu);
      // An abandoned transfer may still have gets in UCX: the core keeps it (and its rkeys) until
      // their callbacks come, if ever.
      if (t->in_flight > 0) return;
    }
    t->remotes.clear();  // rkey destruction happens under mu_
    transfers_in_flight_.erase(t);
  }

  // Runs inside a UCP call (progress or close), so with mu_ held.
  void OnPeerFailedLocked(Peer* peer, ucs_status_t status) REQUIRES(mu_) {
    if (peer->error == UCS_OK) peer->error = status;
    if (auto keep = peer->weak_from_this().lock()) failed_peers_.push_back(std::move(keep));
  }

 private:
  void Wake() {
    const uint64_t one = 1;
    if (wake_fd_ >= 0) (void)!::write(wake_fd_, &one, sizeof one);
  }

  void CloseEndpointLocked(Peer& peer, ucs_status_t why) REQUIRES(mu_) {
    if (peer.ep == nullptr) return;
    if (peer.error == UCS_OK) peer.error = why;
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t req = ucp_ep_close_nbx(peer.ep, &p);
    peer.ep = nullptr;
    if (req != nullptr && !UCS_PTR_IS_ERR(req)) closing_.push_back(req);
  }

  void ReapClosingLocked() REQUIRES(mu_) {
    for (size_t i = 0; i < closing_.size();) {
      if (ucp_request_check_status(closing_[i]) != UCS_INPROGRESS) {
        ucp_request_free(closing_[i]);
        closing_[i] = closing_.back();
        closing_.pop_back();
      } else {
        ++i;
      }
    }
  }

  // Ends (failed) every transfer with gets on `peer`, whether or not UCX completes them.
  void AbandonTransfersOfLocked(const Peer& peer, ucs_status_t why) REQUIRES(mu_) {
    for (const auto& t : transfers_in_flight_) {
      bool uses = false;
      for (const auto& r : t->remotes) uses = uses || r->peer.get() == &peer;
      if (!uses) continue;
      rc::MutexLock tl(t->mu);
      if (t->in_flight == 0) continue;
      t->abandoned = true;
      if (t->first_error == UCS_OK) t->first_error = why;
      t->cv.notify_all();
    }
  }

  // The pid watchdog: a same-host owner that is gone fails its endpoint even where UCX has no
  // peer failure detection (and sooner than a keepalive would where it has).
  void WatchPeersLocked() REQUIRES(mu_) {
    const auto now = std::chrono::steady_clock::now();
    if (now < next_watch_) return;
    next_watch_ = now + std::chrono::milliseconds(50);
    std::unordered_set<Peer*> busy;
    for (const auto& t : transfers_in_flight_) {
      for (const auto& r : t->remotes) busy.insert(r->peer.get());
    }
    for (Peer* peer : busy) {
      if (peer->ep != nullptr && peer->same_host && internal::ProcessGone(peer->pid)) {
        OnPeerFailedLocked(peer, UCS_ERR_CONNECTION_RESET);
      }
    }
  }

  // A failed endpoint is closed and dropped from the cache, so a re-import reconnects.
  void HandleFailedPeersLocked() REQUIRES(mu_) {
    std::vector<std::shared_ptr<Peer>> failed;
    failed.swap(failed_peers_);
    for (const auto& peer : failed) {
      RC_LOG_WARN("ucx transport: peer {} failed: {}", peer->label, UcsError(peer->error));
      auto it = peers_.find(peer->worker_address);
      if (it != peers_.end() && it->second == peer) peers_.erase(it);
      // Abandon first: the forced close completes the peer's outstanding gets with
      // UCS_ERR_CANCELED, and the transfer must report the peer's failure (Unavailable), not a
      // cancellation nobody asked for (that was Aborted, HTTP 500, when the pid watchdog saw the
      // death before UCX did).
      AbandonTransfersOfLocked(*peer, peer->error);
      CloseEndpointLocked(*peer, peer->error);
    }
  }

  void ProgressLoop() {
    for (;;) {
      ucs_status_t armed;
      bool closing = false;
      {
        rc::MutexLock lock(mu_);
        if (stopped_) return;
        while (ucp_worker_progress(worker_) != 0) {
        }
        WatchPeersLocked();
        HandleFailedPeersLocked();
        ReapClosingLocked();
        // Transfers whose gets all completed no longer need tracking (their Transfer, if still
        // alive, keeps them). Dropped outside their own lock: this may destroy them.
        std::vector<std::shared_ptr<TransferShared>> done;
        for (const auto& t : transfers_in_flight_) {
          rc::MutexLock tl(t->mu);
          if (t->in_flight == 0) done.push_back(t);
        }
        for (const auto& t : done) transfers_in_flight_.erase(t);
        done.clear();
        armed = ucp_worker_arm(worker_);
        closing = !closing_.empty();
      }
      if (armed == UCS_ERR_BUSY) continue;
      pollfd fds[2] = {{efd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
      // Short timeout while gets are in flight: not every UCT transport can wake the efd.
      // (closing_ is read above, under mu_: reading it here raced with CloseEndpointLocked.)
      const int timeout_ms = in_flight_.load() > 0 || closing ? 1 : 50;
      ::poll(fds, 2, timeout_ms);
      uint64_t drained;
      while (::read(wake_fd_, &drained, sizeof drained) > 0) {
      }
    }
  }

  Clock* const clock_;
  const UcxTransportOptions options_;
  const std::string host_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1;
  int wake_fd_ = -1;
  std::string worker_address_;
  std::thread progress_;

  rc::Mutex mu_;  // serializes every UCP call on worker_ and guards the fields below
  bool stopped_ GUARDED_BY(mu_) = false;                                                   // guarded by mu_
  std::unordered_map<uint64_t, ucp_mem_h> registrations_ GUARDED_BY(mu_);                  // guarded by mu_
  uint64_t next_registration_id_ GUARDED_BY(mu_) = 1;                                      // guarded by mu_
  std::unordered_map<std::string, std::shared_ptr<Peer>> peers_ GUARDED_BY(mu_);           // guarded by mu_
  std::unordered_map<uint64_t, std::shared_ptr<Remote>> remotes_ GUARDED_BY(mu_);          // guarded by mu_
  uint64_t next_remote_id_ GUARDED_BY(mu_) = 1;                                            // guarded by mu_
  std::vector<std::shared_ptr<Peer>> failed_peers_ GUARDED_BY(mu_);                        // guarded by mu_
  std::vector<void*> closing_ GUARDED_BY(mu_);                                             // guarded by mu_
  std::unordered_set<std::shared_ptr<TransferShared>> transfers_in_flight_ GUARDED_BY(mu_);  // guarded by mu_
  std::chrono::steady_clock::time_point next_watch_{};  // progress thread only
  std::atomic<int64_t> in_flight_{0};  // gets posted and not completed (approximate, for polling)
};

// UCX calls this only from inside ucp_worker_progress / endpoint close, which the core calls with
// mu_ held; the analysis cannot see through the C callback, hence the one exemption.
void PeerFailed(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) NO_THREAD_SAFETY_ANALYSIS {
  auto* peer = static_cast<Peer*>(arg);
  peer->core->OnPeerFailedLocked(peer, status);
}

class UcxTransfer final : public internal::PollingTransfer {
 public:
  UcxTransfer(std::shared_ptr<Core> core, std::shared_ptr<TransferShared> shared)
      : PollingTransfer(core->clock()), core_(std::move(core)), shared_(std::move(shared)) {}

  ~UcxTransfer() override {
    Cancel();
    const auto grace = std::chrono::nanoseconds(core_->options().drain_grace_ns);
    bool drained;
    {
      rc::MutexLock lock(shared_->mu);
      drained = shared_->cv.wait_for(lock, grace, [&]() REQUIRES(shared_->mu) { return shared_->FinishedLocked(); });
    }
    if (!drained) {
      RC_LOG_WARN("ucx transfer destroyed with gets still in flight after {} ms; force-closing peers {}",
                  core_->options().drain_grace_ns / 1'000'000, shared_->peers_label);
      core_->ForceClosePeersOf(*shared_);
      rc::MutexLock lock(shared_->mu);
      shared_->cv.wait(lock, [&]() REQUIRES(shared_->mu) { return shared_->FinishedLocked(); });
    }
    core_->ReleaseTransfer(shared_);
  }

  TransferState Poll() override {
    rc::MutexLock lock(shared_->mu);
    if (!shared_->FinishedLocked()) return TransferState::kPending;
    return shared_->FinalLocked().ok() ? TransferState::kDone : TransferState::kFailed;
  }

  void Cancel() override {
    rc::MutexLock lock(shared_->mu);
    if (!shared_->FinishedLocked()) shared_->cancelled = true;
  }

  Status status() const override {
    rc::MutexLock lock(shared_->mu);
    if (!shared_->FinishedLocked()) return Unavailable("pending");
    return shared_->FinalLocked();
  }

  uint64_t bytes() const override { return shared_->bytes; }

 private:
  std::string PendingAtDeadline() const override {
    rc::MutexLock lock(shared_->mu);
    return fmt::format("ucx transfer of {} bytes from {}: {} gets still in flight at the deadline", shared_->bytes,
                       shared_->peers_label, shared_->in_flight);
  }
  // The last get's callback wakes the wait at once.
  void AwaitProgress(int64_t max_ns) override {
    rc::MutexLock lock(shared_->mu);
    if (!shared_->FinishedLocked()) shared_->cv.wait_for(lock, std::chrono::nanoseconds(max_ns));
  }

  std::shared_ptr<Core> core_;
  std::shared_ptr<TransferShared> shared_;
};

Result<std::unique_ptr<Transfer>> Core::PostReads(const std::shared_ptr<Core>& core, std::span<const ReadOp> ops) {
  RC_ASSIGN_OR_RETURN(std::shared_ptr<TransferShared> shared, core->Post(ops));
  return std::unique_ptr<Transfer>(std::make_unique<UcxTransfer>(core, std::move(shared)));
}

Capabilities UcxCapabilities() {
  Capabilities c;
  c.host_memory = true;
  c.cross_process = true;
  c.cross_host = true;
  c.asynchronous = true;
  return c;
}

class UcxTransport final : public internal::CoreTransport<Core> {
 public:
  explicit UcxTransport(std::shared_ptr<Core> core) : CoreTransport("ucx", UcxCapabilities(), std::move(core)) {}
  ~UcxTransport() override { core().Shutdown(); }
};

}  // namespace

Result<std::unique_ptr<Transport>> CreateUcxTransport(const TransportOptions& options) {
  return CreateUcxTransport(options, UcxTransportOptions{});
}

Result<std::unique_ptr<Transport>> CreateUcxTransport(const TransportOptions& options,
                                                      const UcxTransportOptions& ucx_options) {
  if (ucx_options.drain_grace_ns < 0) return InvalidArgument("ucx transport: drain_grace_ns must be >= 0");
  Clock* clock = options.clock ? options.clock : SystemClock::Default();
  auto core = std::make_shared<Core>(clock, ucx_options);
  RC_RETURN_IF_ERROR(core->Init());
  return std::unique_ptr<Transport>(std::make_unique<UcxTransport>(std::move(core)));
}

}  // namespace rc::transport
