#include "rolloutcore/trainer/publisher.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "rolloutcore/base/log.h"
#include "rolloutcore/refit/digest.h"

namespace rc::trainer {
namespace {

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

uint64_t ShardSource::bytes() const {
  return static_cast<uint64_t>(refit::NumElements(local_shape)) * refit::DTypeSize(dtype);
}

Publisher::Publisher(transport::Transport* transport, directory::DirectoryStore* store, std::string model,
                     int32_t rank, int32_t expected_ranks, PublisherOptions options)
    : transport_(transport),
      store_(store),
      model_(std::move(model)),
      rank_(rank),
      expected_ranks_(expected_ranks),
      options_(options) {}

Publisher::~Publisher() {
  std::unique_ptr<directory::LeaseKeeper> keeper;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [label, entry] : versions_) DeregisterAll(entry.shards);
    versions_.clear();
    keeper = std::move(keeper_);
  }
  keeper.reset();  // joins the renewal thread outside the lock
}

Status Publisher::CheckNewShard(std::string_view version, const VersionEntry& entry, const ShardSource& s) const {
  const std::string what = fmt::format("shard of tensor {} on rank {} for version {}", s.name, rank_, version);
  if (s.name.empty()) return InvalidArgument(fmt::format("shard on rank {} for version {}: empty tensor name", rank_, version));
  RC_RETURN_IF_ERROR(refit::ValidateShape(s.global_shape, what + ": global shape"));
  RC_RETURN_IF_ERROR(refit::ValidateShape(s.local_shape, what + ": local shape"));
  if (s.offset.size() != s.global_shape.size() || s.local_shape.size() != s.global_shape.size()) {
    return InvalidArgument(fmt::format("{}: offset has {} dims and local shape {} dims, but the tensor {} has {}", what,
                                       s.offset.size(), s.local_shape.size(), refit::ShapeToString(s.global_shape),
                                       s.global_shape.size()));
  }
  const refit::Box box{s.offset, s.local_shape};
  for (size_t d = 0; d < s.offset.size(); ++d) {
    if (s.offset[d] < 0 || s.offset[d] + s.local_shape[d] > s.global_shape[d]) {
      return InvalidArgument(fmt::format("{}: box {} lies outside the tensor's shape {}", what, refit::BoxToString(box),
                                         refit::ShapeToString(s.global_shape)));
    }
  }
  if (refit::NumElements(s.local_shape) == 0) return InvalidArgument(what + ": the box is empty");
  if (s.data == nullptr) return InvalidArgument(what + ": data is null");
  for (const StagedShard& other : entry.shards) {
    if (other.source.name != s.name) continue;
    if (other.source.dtype != s.dtype || other.source.global_shape != s.global_shape) {
      return InvalidArgument(fmt::format("{}: declared as {} {} but an earlier shard says {} {}", what,
                                         refit::DTypeName(s.dtype), refit::ShapeToString(s.global_shape),
                                         refit::DTypeName(other.source.dtype),
                                         refit::ShapeToString(other.source.global_shape)));
    }
    refit::Box overlap;
    if (refit::Intersect(box, refit::Box{other.source.offset, other.source.local_shape}, &overlap)) {
      return InvalidArgument(fmt::format("{}: box {} overlaps the earlier shard {} at {}", what, refit::BoxToString(box),
                                         refit::BoxToString(refit::Box{other.source.offset, other.source.local_shape}),
                                         refit::BoxToString(overlap)));
    }
  }
  return OkStatus();
}

Status Publisher::AddShard(std::string_view version, ShardSource shard) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = versions_.find(version);
  if (it != versions_.end() && it->second.state != VersionEntry::State::kStaged) {
    return FailedPrecondition(fmt::format("rank {} cannot add tensor {} to version {} of model {}: it is already {}",
                                          rank_, shard.name, version, model_,
                                          it->second.state == VersionEntry::State::kPublished ? "published"
                                                                                             : "being published"));
  }
  static const VersionEntry kEmpty;
  RC_RETURN_IF_ERROR(CheckNewShard(version, it == versions_.end() ? kEmpty : it->second, shard));
  if (it == versions_.end()) it = versions_.emplace(std::string(version), VersionEntry{}).first;
  it->second.shards.push_back(StagedShard{std::move(shard), 0, "", 0});
  return OkStatus();
}

Result<PublishReport> Publisher::Publish(std::string_view version) { return PublishImpl(version, false); }
Result<PublishReport> Publisher::PublishEmpty(std::string_view version) { return PublishImpl(version, true); }

int64_t Publisher::CurrentLease() {
  // Called with mu_ held.
  if (lease_id_ != 0 && keeper_ != nullptr && keeper_->last_status().code() == StatusCode::kNotFound) {
    RC_LOG_WARN("rank {} of model {}: lease {} expired; the next publish takes a new one", rank_, model_, lease_id_);
    lease_id_ = 0;
  }
  return lease_id_;
}

void Publisher::AdoptLease(int64_t lease_id, int64_t ttl_ms) {
  // Called with mu_ held.
  if (lease_id == lease_id_ && keeper_ != nullptr) return;
  lease_id_ = lease_id;
  const int64_t interval =
      options_.keepalive_interval_ms > 0 ? options_.keepalive_interval_ms : std::max<int64_t>(ttl_ms / 3, 1);
  keeper_ = std::make_unique<directory::LeaseKeeper>(store_, lease_id, interval);
}

void Publisher::DeregisterAll(std::vector<StagedShard>& shards) {
  for (StagedShard& s : shards) {
    if (s.registration_id == 0) continue;
    Status st = transport_->Deregister(s.registration_id);
    if (!st.ok()) {
      RC_LOG_WARN("rank {}: deregistering tensor {} failed: {}", rank_, s.source.name, st.ToString());
    }
    s.registration_id = 0;
    s.descriptor.clear();
  }
}

Result<PublishReport> Publisher::PublishImpl(std::string_view version, bool allow_create) {
  std::vector<StagedShard> shards;
  int64_t lease = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = versions_.find(version);
    if (it == versions_.end()) {
      if (!allow_create) {
        return NotFound(fmt::format("rank {} has no shards staged for version {} of model {}", rank_, version, model_));
      }
      it = versions_.emplace(std::string(version), VersionEntry{}).first;
    }
    if (it->second.state != VersionEntry::State::kStaged) {
      return FailedPrecondition(fmt::format("rank {}: version {} of model {} is already {}", rank_, version, model_,
                                            it->second.state == VersionEntry::State::kPublished ? "published"
                                                                                               : "being published"));
    }
    it->second.state = VersionEntry::State::kPublishing;
    shards = std::move(it->second.shards);
    lease = CurrentLease();
  }

  PublishReport report;
  report.version = std::string(version);
  auto fail = [&](Status s) -> Status {
    DeregisterAll(shards);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = versions_.find(version);
    if (it != versions_.end()) {
      it->second.state = VersionEntry::State::kStaged;
      it->second.shards = std::move(shards);
    }
    return s;
  };

  // Register and digest. Shards of one tensor share a table; tables keep first-seen order.
  std::map<std::string, size_t, std::less<>> table_index;
  for (StagedShard& s : shards) {
    const ShardSource& src = s.source;
    if (src.memory_kind != transport::MemoryKind::kHost && !src.digest.has_value()) {
      return fail(InvalidArgument(fmt::format("rank {} tensor {} of version {}: a shard in device memory needs its "
                                              "digest computed where it lives (ShardSource::digest); the Publisher "
                                              "reads host memory only",
                                              rank_, src.name, version)));
    }
    int64_t t0 = NowNs();
    transport::MemoryRegion region{src.data, src.bytes(), src.memory_kind, src.device};
    auto reg = transport_->RegisterMemory(region);
    if (!reg.ok()) {
      return fail(reg.status().WithContext(fmt::format("rank {} registering tensor {} box {} of version {} ({} bytes)",
                                                       rank_, src.name,
                                                       refit::BoxToString(refit::Box{src.offset, src.local_shape}),
                                                       version, src.bytes())));
    }
    s.registration_id = reg->id;
    s.descriptor = reg->descriptor;
    const int64_t t1 = NowNs();
    report.register_ns += t1 - t0;
    s.digest = src.memory_kind == transport::MemoryKind::kHost
                   ? refit::DigestBlock(src.dtype, src.global_shape, refit::Box{src.offset, src.local_shape}, src.data)
                   : *src.digest;
    report.digest_ns += NowNs() - t1;

    auto [ti, inserted] = table_index.emplace(src.name, report.tables.size());
    if (inserted) report.tables.push_back(refit::ShardTable{src.name, src.dtype, src.global_shape, {}});
    report.tables[ti->second].shards.push_back(refit::ShardInfo{rank_, src.offset, src.local_shape, s.descriptor, s.digest});
    report.bytes += src.bytes();
    ++report.shards;
  }

  directory::PublishRequest request;
  request.model = model_;
  request.version = std::string(version);
  request.rank = rank_;
  request.expected_ranks = expected_ranks_;
  request.lease_id = lease;
  request.lease_ttl_ms = options_.lease_ttl_ms;
  request.tables = report.tables;
  const int64_t t2 = NowNs();
  auto published = store_->Publish(request);
  if (!published.ok() && lease != 0 && published.status().code() == StatusCode::kNotFound) {
    // The lease expired between our check and the publish: take a fresh one once.
    RC_LOG_WARN("rank {}: lease {} is gone; publishing version {} under a new lease", rank_, lease, version);
    request.lease_id = 0;
    published = store_->Publish(request);
  }
  report.publish_ns = NowNs() - t2;
  if (!published.ok()) {
    return fail(published.status().WithContext(
        fmt::format("rank {} of {} publishing version {} of model {}", rank_, expected_ranks_, version, model_)));
  }
  report.result = *published;

  std::lock_guard<std::mutex> lock(mu_);
  AdoptLease(published->lease_id, published->lease_ttl_ms);
  auto it = versions_.find(version);
  if (it == versions_.end()) {
    // Unreachable by contract (Release refuses a version being published); keep nothing dangling.
    DeregisterAll(shards);
    return Internal(fmt::format("rank {}: version {} vanished while it was being published", rank_, version));
  }
  it->second.state = VersionEntry::State::kPublished;
  it->second.shards = std::move(shards);
  return report;
}

Status Publisher::Release(std::string_view version, bool release_in_directory) {
  std::vector<StagedShard> shards;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = versions_.find(version);
    if (it == versions_.end()) {
      return NotFound(fmt::format("rank {} holds no version {} of model {}", rank_, version, model_));
    }
    if (it->second.state == VersionEntry::State::kPublishing) {
      return FailedPrecondition(
          fmt::format("rank {}: version {} of model {} is being published; release it afterwards", rank_, version, model_));
    }
    shards = std::move(it->second.shards);
    versions_.erase(it);
  }
  // Leave the directory first, so no reader discovers the version after its memory is gone.
  Status dir = OkStatus();
  if (release_in_directory) {
    dir = store_->Release(model_, version);
    if (dir.code() == StatusCode::kNotFound) dir = OkStatus();
  }
  DeregisterAll(shards);
  shards.clear();  // drops keep_alive owners
  if (!dir.ok()) return dir.WithContext(fmt::format("rank {} releasing version {} of model {}", rank_, version, model_));
  return OkStatus();
}

std::vector<std::string> Publisher::versions() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  for (const auto& [label, entry] : versions_) out.push_back(label);
  return out;
}

bool Publisher::IsPublished(std::string_view version) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = versions_.find(version);
  return it != versions_.end() && it->second.state == VersionEntry::State::kPublished;
}

int64_t Publisher::lease_id() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lease_id_;
}

}  // namespace rc::trainer
