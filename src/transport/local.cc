#include "rolloutcore/transport/local.h"

#include <fmt/format.h>
#include <unistd.h>

#include <charconv>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "transport/common/core_transport.h"
#include "transport/common/transfer_base.h"

namespace rc::transport {
namespace {

struct Region {
  const std::byte* addr;
  uint64_t length;
};

// Process-wide table of registered regions.
internal::RegionTable<Region>& Regions() {
  static auto* table = new internal::RegionTable<Region>();  // never destroyed: used until exit
  return *table;
}

// Checks every op, then copies them all, under the table's lock so a concurrent Deregister cannot
// free a region between the check and the copy.
Status ReadBatch(std::span<const ReadOp> ops) {
  return Regions().Locked([&](const std::unordered_map<uint64_t, Region>& regions) -> Status {
    std::vector<const std::byte*> src(ops.size());
    for (size_t i = 0; i < ops.size(); ++i) {
      const ReadOp& op = ops[i];
      auto it = regions.find(op.source.id);
      if (it == regions.end()) {
        return Unavailable(fmt::format("read {} of batch: local region {} is not registered (deregistered?)", i,
                                       op.source.id));
      }
      const Region& r = it->second;
      RC_RETURN_IF_ERROR(
          internal::CheckReadOp(i, op, r.length, [&] { return fmt::format("local region {}", op.source.id); }));
      src[i] = r.addr + op.source_offset;
    }
    for (size_t i = 0; i < ops.size(); ++i) {
      if (ops[i].length > 0) std::memmove(ops[i].dest, src[i], ops[i].length);
    }
    return OkStatus();
  });
}

// Complete when made: the copies ran inside PostReads.
class LocalTransfer final : public internal::RecordedTransfer {
 public:
  LocalTransfer(Clock& clock, Status status, uint64_t bytes) : RecordedTransfer(clock, bytes) {
    const bool ok = status.ok();
    Finish(ok ? TransferState::kDone : TransferState::kFailed, std::move(status));
  }
  void Cancel() override {}  // already complete: nothing left to stop

 private:
  TransferState PollPending() override { return state(); }
  std::string PendingAtDeadline() const override { return "local transfer pending"; }
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
    const uint64_t id = Regions().Add({static_cast<const std::byte*>(region.addr), region.length});
    return Registration{id, fmt::format("local:v1:{}:{}:{}", ::getpid(), id, region.length)};
  }

  Status Deregister(uint64_t id) override {
    if (!Regions().Remove(id)) return NotFound(fmt::format("local region {} is not registered", id));
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
    if (!Regions().Find(fields[1], &r)) {
      return NotFound(fmt::format("descriptor {}: region is not registered", descriptor));
    }
    if (r.length != fields[2]) {
      return NotFound(fmt::format("descriptor {}: region has {} bytes now", descriptor, r.length));
    }
    return RemoteMemory{fields[1], r.length};
  }

  Status ReleaseRemote(const RemoteMemory& /*remote*/) override { return OkStatus(); }

  Result<std::unique_ptr<Transfer>> PostReads(std::span<const ReadOp> ops) override {
    Status s = ReadBatch(ops);
    return std::unique_ptr<Transfer>(std::make_unique<LocalTransfer>(*clock_, std::move(s), internal::BatchBytes(ops)));
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
