#include "rolloutcore/transport/local.h"

#include <fmt/format.h>
#include <unistd.h>

#include <charconv>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "rolloutcore/base/mutex.h"

namespace rc::transport {
namespace {

struct Region {
  const std::byte* addr;
  uint64_t length;
};

// Process-wide table of registered regions.
class RegionTable {
 public:
  static RegionTable& Get() {
    static RegionTable* table = new RegionTable();  // never destroyed: used until exit
    return *table;
  }

  uint64_t Add(const Region& r) {
    rc::MutexLock lock(mu_);
    const uint64_t id = next_id_++;
    regions_.emplace(id, r);
    return id;
  }

  bool Remove(uint64_t id) {
    rc::MutexLock lock(mu_);
    return regions_.erase(id) > 0;
  }

  bool Find(uint64_t id, Region* out) {
    rc::MutexLock lock(mu_);
    auto it = regions_.find(id);
    if (it == regions_.end()) return false;
    *out = it->second;
    return true;
  }

  // Checks every op, then copies them all, under one lock so a concurrent Deregister cannot free
  // a region between the check and the copy.
  Status ReadBatch(std::span<const ReadOp> ops) {
    rc::MutexLock lock(mu_);
    std::vector<const std::byte*> src(ops.size());
    for (size_t i = 0; i < ops.size(); ++i) {
      const ReadOp& op = ops[i];
      auto it = regions_.find(op.source.id);
      if (it == regions_.end()) {
        return Unavailable(fmt::format("read {} of batch: local region {} is not registered (deregistered?)", i,
                                       op.source.id));
      }
      const Region& r = it->second;
      if (op.source_offset > r.length || op.length > r.length - op.source_offset) {
        return InvalidArgument(fmt::format("read {} of batch: bytes {}..{} outside local region {} of {} bytes", i,
                                           op.source_offset, op.source_offset + op.length, op.source.id, r.length));
      }
      if (op.length > 0 && op.dest == nullptr) {
        return InvalidArgument(fmt::format("read {} of batch: null destination for {} bytes", i, op.length));
      }
      src[i] = r.addr + op.source_offset;
    }
    for (size_t i = 0; i < ops.size(); ++i) {
      if (ops[i].length > 0) std::memmove(ops[i].dest, src[i], ops[i].length);
    }
    return OkStatus();
  }

 private:
  rc::Mutex mu_;
  uint64_t next_id_ GUARDED_BY(mu_) = 1;                          // guarded by mu_
  std::unordered_map<uint64_t, Region> regions_ GUARDED_BY(mu_);  // guarded by mu_
};

class LocalTransfer final : public Transfer {
 public:
  LocalTransfer(Status status, uint64_t bytes) : status_(std::move(status)), bytes_(bytes) {}
  TransferState Poll() override { return status_.ok() ? TransferState::kDone : TransferState::kFailed; }
  Status Wait(int64_t /*deadline_ns*/) override { return status_; }
  void Cancel() override {}  // already complete: nothing left to stop
  Status status() const override { return status_; }
  uint64_t bytes() const override { return bytes_; }

 private:
  Status status_;
  uint64_t bytes_;
};

class LocalTransport final : public Transport {
 public:
  explicit LocalTransport(Clock* clock) : clock_(clock) {}

  std::string_view name() const override { return "local"; }
  Capabilities capabilities() const override {
    Capabilities c;
    c.host_memory = true;
    return c;
  }
  Clock& clock() const override { return *clock_; }

  Result<Registration> RegisterMemory(const MemoryRegion& region) override {
    if (region.kind != MemoryKind::kHost) {
      return Unimplemented("local transport registers host memory only");
    }
    if (region.addr == nullptr && region.length > 0) {
      return InvalidArgument(fmt::format("local transport: null address for {} bytes", region.length));
    }
    const uint64_t id = RegionTable::Get().Add({static_cast<const std::byte*>(region.addr), region.length});
    return Registration{id, fmt::format("local:v1:{}:{}:{}", ::getpid(), id, region.length)};
  }

  Status Deregister(uint64_t id) override {
    if (!RegionTable::Get().Remove(id)) return NotFound(fmt::format("local region {} is not registered", id));
    return OkStatus();
  }

  Result<RemoteMemory> Import(std::string_view descriptor) override {
    // local:v1:<pid>:<id>:<length>
    const std::string_view prefix = "local:v1:";
    auto bad = [&] { return InvalidArgument(fmt::format("'{}' is not a local transport descriptor", descriptor)); };
    if (descriptor.substr(0, prefix.size()) != prefix) return bad();
    uint64_t fields[3];
    const char* p = descriptor.data() + prefix.size();
    const char* end = descriptor.data() + descriptor.size();
    for (int i = 0; i < 3; ++i) {
      auto [next, ec] = std::from_chars(p, end, fields[i]);
      if (ec != std::errc()) return bad();
      p = next;
      if (i < 2) {
        if (p == end || *p != ':') return bad();
        ++p;
      }
    }
    if (p != end) return bad();
    if (fields[0] != static_cast<uint64_t>(::getpid())) {
      return Unavailable(fmt::format("descriptor {} belongs to process {}; the local transport reaches only its own",
                                     descriptor, fields[0]));
    }
    Region r;
    if (!RegionTable::Get().Find(fields[1], &r)) {
      return NotFound(fmt::format("descriptor {}: region is not registered", descriptor));
    }
    if (r.length != fields[2]) {
      return NotFound(fmt::format("descriptor {}: region has {} bytes now", descriptor, r.length));
    }
    return RemoteMemory{fields[1], r.length};
  }

  Status ReleaseRemote(const RemoteMemory& /*remote*/) override { return OkStatus(); }

  Result<std::unique_ptr<Transfer>> PostReads(std::span<const ReadOp> ops) override {
    uint64_t bytes = 0;
    for (const ReadOp& op : ops) bytes += op.length;
    Status s = RegionTable::Get().ReadBatch(ops);
    return std::unique_ptr<Transfer>(std::make_unique<LocalTransfer>(std::move(s), bytes));
  }

 private:
  Clock* clock_;
};

}  // namespace

Result<std::unique_ptr<Transport>> CreateLocalTransport(const TransportOptions& options) {
  Clock* clock = options.clock ? options.clock : SystemClock::Default();
  return std::unique_ptr<Transport>(std::make_unique<LocalTransport>(clock));
}

}  // namespace rc::transport
