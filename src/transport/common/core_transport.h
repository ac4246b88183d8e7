// Two pieces of the backends' shape, written once:
//
// RegionTable<Entry>: a process-wide (or per-transport) table of registered regions keyed by a
// 64-bit id that is never reused (local, cuda_ipc and nccl owners). Every method may be called from
// any thread; one mutex guards the table, and Locked() runs a function under it (a batch checked and
// copied under one lock cannot race a Deregister).
//
// CoreTransport<Core>: the Transport facade of a backend whose state lives in a shared Core (ucx,
// cuda_ipc, nccl): the Core is shared with the Transfers so that a Transfer may outlive its
// Transport. The facade forwards every call; the Core provides
//   Clock& clock() const;
//   Result<Registration> Register(const MemoryRegion&);  Status Deregister(uint64_t);
//   Result<RemoteMemory> Import(std::string_view);       Status Release(const RemoteMemory&);
//   static Result<std::unique_ptr<Transfer>> PostReads(const std::shared_ptr<Core>&, std::span<const ReadOp>);
// Thread safety: as the Core's.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "rolloutcore/base/mutex.h"
#include "rolloutcore/transport/transport.h"

namespace rc::transport::internal {

template <typename Entry>
class RegionTable {
 public:
  uint64_t Add(const Entry& e) {
    rc::MutexLock lock(mu_);
    const uint64_t id = next_id_++;
    entries_.emplace(id, e);
    return id;
  }
  bool Remove(uint64_t id) {
    rc::MutexLock lock(mu_);
    return entries_.erase(id) > 0;
  }
  bool Find(uint64_t id, Entry* out) const {
    rc::MutexLock lock(mu_);
    auto it = entries_.find(id);
    if (it == entries_.end()) return false;
    *out = it->second;
    return true;
  }
  // f(const std::unordered_map<uint64_t, Entry>&) under the table's lock.
  template <typename F>
  auto Locked(F&& f) const {
    rc::MutexLock lock(mu_);
    return std::forward<F>(f)(entries_);
  }

 private:
  mutable rc::Mutex mu_;
  uint64_t next_id_ GUARDED_BY(mu_) = 1;
  std::unordered_map<uint64_t, Entry> entries_ GUARDED_BY(mu_);
};

template <typename Core>
class CoreTransport : public Transport {
 public:
  CoreTransport(std::string_view name, const Capabilities& capabilities, std::shared_ptr<Core> core)
      : name_(name), capabilities_(capabilities), core_(std::move(core)) {}

  std::string_view name() const final { return name_; }
  Capabilities capabilities() const final { return capabilities_; }
  Clock& clock() const final { return core_->clock(); }
  Result<Registration> RegisterMemory(const MemoryRegion& region) final { return core_->Register(region); }
  Status Deregister(uint64_t id) final { return core_->Deregister(id); }
  Result<RemoteMemory> Import(std::string_view descriptor) final { return core_->Import(descriptor); }
  Status ReleaseRemote(const RemoteMemory& remote) final { return core_->Release(remote); }
  Result<std::unique_ptr<Transfer>> PostReads(std::span<const ReadOp> ops) final { return Core::PostReads(core_, ops); }

 protected:
  Core& core() const { return *core_; }

 private:
  const std::string_view name_;
  const Capabilities capabilities_;
  std::shared_ptr<Core> core_;
};

}  // namespace rc::transport::internal
