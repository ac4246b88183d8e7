#include "rolloutcore/directory/memory_store.h"

#include <fmt/format.h>

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <set>

#include "directory/version_record.h"
#include "rolloutcore/base/mutex.h"

namespace rc::directory {
namespace {

using internal::VersionMeta;

struct VersionRecord {
  VersionMeta meta;
  std::map<int32_t, std::vector<refit::ShardTable>> tables;  // STAGING: per published rank
  std::vector<refit::Probe> probes;                          // STAGING: rank 0's
  refit::Manifest manifest;                                  // COMMITTED
};

class MemoryStore final : public DirectoryStore {
 public:
  explicit MemoryStore(Clock* clock) : clock_(clock), rng_(std::random_device{}()) {}

  Result<PublishResult> Publish(const PublishRequest& r) override {
    RC_RETURN_IF_ERROR(internal::ValidatePublishRequest(r));
    rc::MutexLock lock(mu_);
    ExpireLeasesLocked();
    VersionRecord* rec = FindLocked(r.model, r.version, /*include_released=*/true);
    RC_ASSIGN_OR_RETURN(bool completes, internal::CheckPublish(rec ? &rec->meta : nullptr, r));

    int64_t lease_id = r.lease_id;
    int64_t ttl_ms = r.lease_ttl_ms;
    if (lease_id != 0) {
      auto it = leases_.find(lease_id);
      if (it == leases_.end()) return LeaseNotFound(lease_id);
      ttl_ms = it->second.ttl_ms;
    }

    PublishResult out;
    out.expected_ranks = r.expected_ranks;
    if (completes) {
      std::map<int32_t, const std::vector<refit::ShardTable>*> by_rank;
      if (rec) {
        for (const auto& [rank, tables] : rec->tables) by_rank[rank] = &tables;
      }
      by_rank[r.rank] = &r.tables;
      const std::vector<refit::Probe>& probes = r.rank == 0 || !rec ? r.probes : rec->probes;
      RC_ASSIGN_OR_RETURN(refit::Manifest manifest,
                          internal::MergeRankTables(r.model, r.version, r.expected_ranks, by_rank, probes));
      if (lease_id == 0) lease_id = GrantLocked(ttl_ms);
      if (!rec) rec = CreateLocked(r);
      uint64_t& last = last_seq_[r.model];
      rec->meta.state = VersionState::kCommitted;
      rec->meta.commit_seq = ++last;
      rec->meta.content_digest = manifest.content_digest;
      rec->meta.rank_leases.clear();
      rec->tables.clear();
      rec->manifest = std::move(manifest);
      staging_.erase({r.model, r.version});
      commits_[{r.model, rec->meta.commit_seq}] = r.version;
      out.state = VersionState::kCommitted;
      out.ranks_published = r.expected_ranks;
      out.commit_seq = rec->meta.commit_seq;
      out.content_digest = rec->meta.content_digest;
      lock.unlock();
      commit_cv_.notify_all();
    } else {
      if (lease_id == 0) lease_id = GrantLocked(ttl_ms);
      if (!rec) rec = CreateLocked(r);
      rec->meta.rank_leases[r.rank] = lease_id;
      rec->tables[r.rank] = r.tables;
      if (r.rank == 0) rec->probes = r.probes;
      out.state = VersionState::kStaging;
      out.ranks_published = static_cast<int32_t>(rec->meta.rank_leases.size());
    }
    out.lease_id = lease_id;
    out.lease_ttl_ms = ttl_ms;
    return out;
  }

  Result<LeaseInfo> KeepAlive(int64_t lease_id) override {
    rc::MutexLock lock(mu_);
    ExpireLeasesLocked();
    auto it = leases_.find(lease_id);
    if (it == leases_.end()) return LeaseNotFound(lease_id);
    it->second.expires_ms = clock_->NowMs() + it->second.ttl_ms;
    return LeaseInfo{lease_id, it->second.ttl_ms};
  }

  Result<refit::Manifest> Get(std::string_view model, std::string_view version) override {
    rc::MutexLock lock(mu_);
    ExpireLeasesLocked();
    VersionRecord* rec = FindLocked(model, version, /*include_released=*/false);
    if (!rec) return internal::VersionNotFound(model, version);
    if (rec->meta.state != VersionState::kCommitted) return internal::NotCommitted(model, version, rec->meta);
    return rec->manifest;
  }

  Result<VersionInfo> GetInfo(std::string_view model, std::string_view version) override {
    rc::MutexLock lock(mu_);
    ExpireLeasesLocked();
    VersionRecord* rec = FindLocked(model, version, /*include_released=*/false);
    if (!rec) return internal::VersionNotFound(model, version);
    return internal::MakeVersionInfo(model, version, rec->meta);
  }

  Result<std::vector<VersionInfo>> List(std::string_view model, StateFilter filter) override {
    RC_RETURN_IF_ERROR(ValidateName(model, "model"));
    rc::MutexLock lock(mu_);
    ExpireLeasesLocked();
    std::vector<VersionInfo> out;
    for (auto it = versions_.lower_bound(Key{std::string(model), std::string()});
         it != versions_.end() && it->first.first == model; ++it) {
      const VersionMeta& meta = it->second->meta;
      if (!meta.released && FilterMatches(filter, meta.state)) {
        out.push_back(internal::MakeVersionInfo(model, it->first.second, meta));
      }
    }
    internal::SortVersionInfos(&out);
    return out;
  }

  Result<std::vector<CommitEvent>> WaitForCommits(std::string_view model, uint64_t after_seq,
                                                  int64_t timeout_ms) override {
    RC_RETURN_IF_ERROR(ValidateName(model, "model"));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max<int64_t>(timeout_ms, 0));
    rc::MutexLock lock(mu_);
    while (true) {
      std::vector<CommitEvent> events = CommitsAfterLocked(model, after_seq);
      if (!events.empty() || std::chrono::steady_clock::now() >= deadline) return events;
      commit_cv_.wait_until(lock, deadline);
    }
  }

  Status Release(std::string_view model, std::string_view version) override {
    rc::MutexLock lock(mu_);
    ExpireLeasesLocked();
    VersionRecord* rec = FindLocked(model, version, /*include_released=*/false);
    if (!rec) return internal::VersionNotFound(model, version);
    if (rec->meta.state == VersionState::kCommitted) commits_.erase({std::string(model), rec->meta.commit_seq});
    staging_.erase({std::string(model), std::string(version)});
    rec->meta.released = true;
    rec->meta.rank_leases.clear();
    rec->tables.clear();
    rec->manifest = refit::Manifest();
    return OkStatus();
  }

  Status MarkUnavailable(std::string_view model, std::string_view version, std::string_view reason) override {
    rc::MutexLock lock(mu_);
    ExpireLeasesLocked();
    VersionRecord* rec = FindLocked(model, version, /*include_released=*/false);
    RC_ASSIGN_OR_RETURN(VersionState before,
                        internal::ApplyMarkUnavailable(rec ? &rec->meta : nullptr, model, version, reason));
    if (before == VersionState::kCommitted) {
      commits_.erase({std::string(model), rec->meta.commit_seq});
      rec->manifest = refit::Manifest();
    } else if (before == VersionState::kStaging) {
      staging_.erase({std::string(model), std::string(version)});
      rec->tables.clear();
    }
    return OkStatus();
  }

 private:
  struct Lease {
    int64_t ttl_ms = 0;
    int64_t expires_ms = 0;
  };
  using Key = std::pair<std::string, std::string>;  // (model, version)

  static Status LeaseNotFound(int64_t lease_id) {
    return NotFound(fmt::format("lease {} does not exist (expired, or never granted)", lease_id));
  }

  VersionRecord* FindLocked(std::string_view model, std::string_view version, bool include_released) REQUIRES(mu_) {
    auto it = versions_.find(Key{std::string(model), std::string(version)});
    if (it == versions_.end() || (!include_released && it->second->meta.released)) return nullptr;
    return it->second.get();
  }

  VersionRecord* CreateLocked(const PublishRequest& r) REQUIRES(mu_) {
    auto rec = std::make_unique<VersionRecord>();
    rec->meta.expected_ranks = r.expected_ranks;
    VersionRecord* raw = rec.get();
    versions_[{r.model, r.version}] = std::move(rec);
    staging_.insert({r.model, r.version});
    return raw;
  }

  int64_t GrantLocked(int64_t ttl_ms) REQUIRES(mu_) {
    int64_t id = 0;
    do {
      id = static_cast<int64_t>(rng_() >> 1);
    } while (id == 0 || leases_.count(id));
    leases_[id] = Lease{ttl_ms, clock_->NowMs() + ttl_ms};
    return id;
  }

  // Abandons every STAGING version one of whose ranks holds an expired lease, then forgets the
  // expired leases. Runs first in every call, so no decision is made on a dead lease.
  void ExpireLeasesLocked() REQUIRES(mu_) {
    const int64_t now = clock_->NowMs();
    std::set<int64_t> expired;
    for (const auto& [id, lease] : leases_) {
      if (lease.expires_ms <= now) expired.insert(id);
    }
    if (expired.empty()) return;
    for (auto it = staging_.begin(); it != staging_.end();) {
      VersionRecord& rec = *versions_.at(*it);
      bool abandoned = false;
      for (const auto& [rank, lease] : rec.meta.rank_leases) {
        if (expired.count(lease)) {
          rec.meta.state = VersionState::kAbandoned;
          rec.meta.reason = internal::LeaseExpiredReason(rank, lease);
          abandoned = true;
          break;
        }
      }
      if (abandoned) {
        rec.tables.clear();
        it = staging_.erase(it);
      } else {
        ++it;
      }
    }
    for (int64_t id : expired) leases_.erase(id);
  }

  std::vector<CommitEvent> CommitsAfterLocked(std::string_view model, uint64_t after_seq) const REQUIRES(mu_) {
    std::vector<CommitEvent> out;
    if (after_seq == UINT64_MAX) return out;
    for (auto it = commits_.lower_bound({std::string(model), after_seq + 1});
         it != commits_.end() && it->first.first == model; ++it) {
      const VersionRecord& rec = *versions_.at(Key{it->first.first, it->second});
      out.push_back(CommitEvent{it->first.first, it->second, it->first.second, rec.meta.content_digest});
    }
    return out;
  }

  Clock* const clock_;
  rc::Mutex mu_;
  rc::CondVar commit_cv_;
  std::mt19937_64 rng_ GUARDED_BY(mu_);                                      // guarded by mu_
  std::map<Key, std::unique_ptr<VersionRecord>> versions_ GUARDED_BY(mu_);   // guarded by mu_ (tombstones stay)
  std::set<Key> staging_ GUARDED_BY(mu_);                                    // guarded by mu_
  std::map<int64_t, Lease> leases_ GUARDED_BY(mu_);                          // guarded by mu_
  std::map<std::string, uint64_t, std::less<>> last_seq_ GUARDED_BY(mu_);    // guarded by mu_
  std::map<std::pair<std::string, uint64_t>, std::string> commits_ GUARDED_BY(mu_);  // guarded by mu_; retained only
};

}  // namespace

std::unique_ptr<DirectoryStore> NewMemoryStore(Clock* clock) { return std::make_unique<MemoryStore>(clock); }

}  // namespace rc::directory
