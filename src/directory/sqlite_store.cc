#include "rolloutcore/directory/sqlite_store.h"

#include <fmt/format.h>
#include <sqlite3.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <random>

#include "directory/version_record.h"
#include "rolloutcore/base/sqlite.h"
#include "rolloutcore/base/mutex.h"

namespace rc::directory {
namespace {

using internal::VersionMeta;

constexpr const char* kSchema = R"sql(
CREATE TABLE IF NOT EXISTS rc_dir_models(
  model TEXT PRIMARY KEY,
  last_seq INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS rc_dir_versions(
  model TEXT NOT NULL,
  version TEXT NOT NULL,
  state TEXT NOT NULL,
  released INTEGER NOT NULL DEFAULT 0,
  expected_ranks INTEGER NOT NULL,
  commit_seq INTEGER NOT NULL DEFAULT 0,
  content_digest INTEGER NOT NULL DEFAULT 0,
  reason TEXT NOT NULL DEFAULT '',
  manifest TEXT,
  PRIMARY KEY(model, version));
CREATE INDEX IF NOT EXISTS rc_dir_versions_seq ON rc_dir_versions(model, commit_seq);
CREATE TABLE IF NOT EXISTS rc_dir_ranks(
  model TEXT NOT NULL,
  version TEXT NOT NULL,
  rank INTEGER NOT NULL,
  lease_id INTEGER NOT NULL,
  tables TEXT NOT NULL,
  PRIMARY KEY(model, version, rank));
CREATE INDEX IF NOT EXISTS rc_dir_ranks_lease ON rc_dir_ranks(lease_id);
CREATE TABLE IF NOT EXISTS rc_dir_leases(
  id INTEGER PRIMARY KEY,
  ttl_ms INTEGER NOT NULL,
  expires_ms INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS rc_dir_leases_expiry ON rc_dir_leases(expires_ms);
)sql";

using Stmt = sqlite::Statement;

struct LoadedVersion {
  VersionMeta meta;
  bool exists = false;
};

class SqliteStore final : public DirectoryStore {
 public:
  SqliteStore(sqlite::Database db, Clock* clock, SqliteStoreOptions options)
      : db_(std::move(db)), clock_(clock), options_(options), rng_(std::random_device{}()) {}

  Status Init() {
    {
      rc::MutexLock lock(mu_);  // not shared yet (Init runs at open); the lock keeps db_ checked
      RC_RETURN_IF_ERROR(db_.Exec("PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL; PRAGMA foreign_keys=OFF;"));
    }
    return InTxn([&]() REQUIRES(mu_) -> Status { return db_.Exec(kSchema); });
  }

  Result<PublishResult> Publish(const PublishRequest& r) override {
    RC_RETURN_IF_ERROR(internal::ValidatePublishRequest(r));
    PublishResult out;
    Status s = InTxn([&]() REQUIRES(mu_) -> Status {
      RC_RETURN_IF_ERROR(ExpireLeases());
      RC_ASSIGN_OR_RETURN(LoadedVersion v, Load(r.model, r.version));
      RC_ASSIGN_OR_RETURN(bool completes, internal::CheckPublish(v.exists ? &v.meta : nullptr, r));
      int64_t lease_id = r.lease_id;
      int64_t ttl_ms = r.lease_ttl_ms;
      if (lease_id != 0) {
        Stmt q(db_, "SELECT ttl_ms FROM rc_dir_leases WHERE id = ?");
        q.Bind(1, lease_id);
        if (!q.Step()) {
          RC_RETURN_IF_ERROR(q.status());
          return NotFound(fmt::format("lease {} does not exist (expired, or never granted)", lease_id));
        }
        ttl_ms = q.Int(0);
      }
      out = PublishResult();
      out.expected_ranks = r.expected_ranks;
      if (completes) {
        std::map<int32_t, std::vector<refit::ShardTable>> others;
        std::vector<refit::Probe> probes = r.probes;
        Stmt q(db_, "SELECT rank, tables FROM rc_dir_ranks WHERE model = ? AND version = ?");
        q.Bind(1, r.model).Bind(2, r.version);
        while (q.Step()) {
          const auto rank = static_cast<int32_t>(q.Int(0));
          if (rank == r.rank) continue;
          auto j = ParseJson(q.Text(1), "stored tables");
          if (!j.ok()) return DataLoss(j.status().message());
          auto row = internal::RankRowFromJson(*j);
          if (!row.ok()) return DataLoss("stored tables of rank " + std::to_string(rank) + ": " + row.status().message());
          others[rank] = std::move(row->tables);
          if (rank == 0) probes = std::move(row->probes);
        }
        RC_RETURN_IF_ERROR(q.status());
        std::map<int32_t, const std::vector<refit::ShardTable>*> by_rank;
        for (const auto& [rank, tables] : others) by_rank[rank] = &tables;
        by_rank[r.rank] = &r.tables;
        RC_ASSIGN_OR_RETURN(refit::Manifest manifest,
                            internal::MergeRankTables(r.model, r.version, r.expected_ranks, by_rank, probes));
        if (lease_id == 0) {
          RC_ASSIGN_OR_RETURN(lease_id, GrantLease(ttl_ms));
        }
        int64_t seq = 0;
        {
          Stmt m(db_, "SELECT last_seq FROM rc_dir_models WHERE model = ?");
          m.Bind(1, r.model);
          if (m.Step()) seq = m.Int(0);
          RC_RETURN_IF_ERROR(m.status());
        }
        ++seq;
        RC_RETURN_IF_ERROR(Stmt(db_, "INSERT INTO rc_dir_models(model, last_seq) VALUES(?, ?) "
                                     "ON CONFLICT(model) DO UPDATE SET last_seq = excluded.last_seq")
                               .Bind(1, r.model)
                               .Bind(2, seq)
                               .Run());
        RC_RETURN_IF_ERROR(
            Stmt(db_, "INSERT INTO rc_dir_versions(model, version, state, expected_ranks, commit_seq, content_digest, "
                      "manifest) VALUES(?, ?, 'COMMITTED', ?, ?, ?, ?) ON CONFLICT(model, version) DO UPDATE SET "
                      "state = 'COMMITTED', commit_seq = excluded.commit_seq, content_digest = "
                      "excluded.content_digest, manifest = excluded.manifest")
                .Bind(1, r.model)
                .Bind(2, r.version)
                .Bind(3, int64_t{r.expected_ranks})
                .Bind(4, seq)
                .Bind(5, static_cast<int64_t>(manifest.content_digest))
                .Bind(6, refit::ManifestToJson(manifest).dump())
                .Run());
        RC_RETURN_IF_ERROR(Stmt(db_, "DELETE FROM rc_dir_ranks WHERE model = ? AND version = ?")
                               .Bind(1, r.model)
                               .Bind(2, r.version)
                               .Run());
        out.state = VersionState::kCommitted;
        out.ranks_published = r.expected_ranks;
        out.commit_seq = static_cast<uint64_t>(seq);
        out.content_digest = manifest.content_digest;
      } else {
        if (lease_id == 0) {
          RC_ASSIGN_OR_RETURN(lease_id, GrantLease(ttl_ms));
        }
        RC_RETURN_IF_ERROR(Stmt(db_, "INSERT OR IGNORE INTO rc_dir_versions(model, version, state, expected_ranks) "
                                     "VALUES(?, ?, 'STAGING', ?)")
                               .Bind(1, r.model)
                               .Bind(2, r.version)
                               .Bind(3, int64_t{r.expected_ranks})
                               .Run());
        RC_RETURN_IF_ERROR(
            Stmt(db_, "INSERT OR REPLACE INTO rc_dir_ranks(model, version, rank, lease_id, tables) VALUES(?, ?, ?, ?, ?)")
                .Bind(1, r.model)
                .Bind(2, r.version)
                .Bind(3, int64_t{r.rank})
                .Bind(4, lease_id)
                .Bind(5, internal::RankRowToJson(r).dump())
                .Run());
        out.state = VersionState::kStaging;
        out.ranks_published =
            static_cast<int32_t>(v.meta.rank_leases.size() + (v.meta.rank_leases.count(r.rank) ? 0 : 1));
      }
      out.lease_id = lease_id;
      out.lease_ttl_ms = ttl_ms;
      return OkStatus();
    });
    RC_RETURN_IF_ERROR(s);
    if (out.state == VersionState::kCommitted) {
      {
        rc::MutexLock lock(wait_mu_);
        ++commit_generation_;
      }
      commit_cv_.notify_all();
    }
    return out;
  }

  Result<LeaseInfo> KeepAlive(int64_t lease_id) override {
    LeaseInfo info;
    Status txn_status = InTxn([&]() REQUIRES(mu_) -> Status {
      RC_RETURN_IF_ERROR(ExpireLeases());
      Stmt q(db_, "SELECT ttl_ms FROM rc_dir_leases WHERE id = ?");
      q.Bind(1, lease_id);
      if (!q.Step()) {
        RC_RETURN_IF_ERROR(q.status());
        return NotFound(fmt::format("lease {} does not exist (expired, or never granted)", lease_id));
      }
      info = LeaseInfo{lease_id, q.Int(0)};
      return Stmt(db_, "UPDATE rc_dir_leases SET expires_ms = ? WHERE id = ?")
          .Bind(1, clock_->NowMs() + info.ttl_ms)
          .Bind(2, lease_id)
          .Run();
    });
    if (!txn_status.ok()) return txn_status;
    return info;
  }

  Result<refit::Manifest> Get(std::string_view model, std::string_view version) override {
    refit::Manifest manifest;
    Status txn_status = InTxn([&]() REQUIRES(mu_) -> Status {
      RC_RETURN_IF_ERROR(ExpireLeases());
      RC_ASSIGN_OR_RETURN(LoadedVersion v, Load(model, version));
      if (!v.exists || v.meta.released) return internal::VersionNotFound(model, version);
      if (v.meta.state != VersionState::kCommitted) return internal::NotCommitted(model, version, v.meta);
      Stmt q(db_, "SELECT manifest FROM rc_dir_versions WHERE model = ? AND version = ?");
      q.Bind(1, model).Bind(2, version);
      if (!q.Step()) {
        RC_RETURN_IF_ERROR(q.status());
        return internal::VersionNotFound(model, version);
      }
      auto j = ParseJson(q.Text(0), "stored manifest");
      if (!j.ok()) return DataLoss(j.status().message());
      auto m = refit::ManifestFromJson(*j);
      if (!m.ok()) return DataLoss("stored manifest: " + m.status().message());
      manifest = std::move(*m);
      return OkStatus();
    });
    if (!txn_status.ok()) return txn_status;
    return manifest;
  }

  Result<VersionInfo> GetInfo(std::string_view model, std::string_view version) override {
    VersionInfo info;
    Status txn_status = InTxn([&]() REQUIRES(mu_) -> Status {
      RC_RETURN_IF_ERROR(ExpireLeases());
      RC_ASSIGN_OR_RETURN(LoadedVersion v, Load(model, version));
      if (!v.exists || v.meta.released) return internal::VersionNotFound(model, version);
      info = internal::MakeVersionInfo(model, version, v.meta);
      return OkStatus();
    });
    if (!txn_status.ok()) return txn_status;
    return info;
  }

  Result<std::vector<VersionInfo>> List(std::string_view model, StateFilter filter) override {
    RC_RETURN_IF_ERROR(ValidateName(model, "model"));
    std::vector<VersionInfo> out;
    Status txn_status = InTxn([&]() REQUIRES(mu_) -> Status {
      RC_RETURN_IF_ERROR(ExpireLeases());
      out.clear();
      std::vector<std::string> names;
      Stmt q(db_, "SELECT version FROM rc_dir_versions WHERE model = ? AND released = 0");
      q.Bind(1, model);
      while (q.Step()) names.push_back(q.Text(0));
      RC_RETURN_IF_ERROR(q.status());
      for (const std::string& name : names) {
        RC_ASSIGN_OR_RETURN(LoadedVersion v, Load(model, name));
        if (v.exists && FilterMatches(filter, v.meta.state)) out.push_back(internal::MakeVersionInfo(model, name, v.meta));
      }
      return OkStatus();
    });
    if (!txn_status.ok()) return txn_status;
    internal::SortVersionInfos(&out);
    return out;
  }

  Result<std::vector<CommitEvent>> WaitForCommits(std::string_view model, uint64_t after_seq,
                                                  int64_t timeout_ms) override {
    RC_RETURN_IF_ERROR(ValidateName(model, "model"));
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max<int64_t>(timeout_ms, 0));
    while (true) {
      uint64_t generation = 0;
      {
        rc::MutexLock lock(wait_mu_);
        generation = commit_generation_;
      }
      RC_ASSIGN_OR_RETURN(std::vector<CommitEvent> events, CommitsAfter(model, after_seq));
      const auto now = std::chrono::steady_clock::now();
      if (!events.empty() || now >= deadline) return events;
      // Commits through this instance wake us at once; other processes are seen by polling.
      rc::MutexLock lock(wait_mu_);
      commit_cv_.wait_until(lock, std::min(deadline, now + std::chrono::milliseconds(options_.poll_interval_ms)),
                            [&]() REQUIRES(wait_mu_) { return commit_generation_ != generation; });
    }
  }

  Status Release(std::string_view model, std::string_view version) override {
    return InTxn([&]() REQUIRES(mu_) -> Status {
      RC_RETURN_IF_ERROR(ExpireLeases());
      RC_ASSIGN_OR_RETURN(LoadedVersion v, Load(model, version));
      if (!v.exists || v.meta.released) return internal::VersionNotFound(model, version);
      RC_RETURN_IF_ERROR(Stmt(db_, "UPDATE rc_dir_versions SET released = 1, manifest = NULL WHERE model = ? AND "
                                   "version = ?")
                             .Bind(1, model)
                             .Bind(2, version)
                             .Run());
      return Stmt(db_, "DELETE FROM rc_dir_ranks WHERE model = ? AND version = ?").Bind(1, model).Bind(2, version).Run();
    });
  }

  Status MarkUnavailable(std::string_view model, std::string_view version, std::string_view reason) override {
    return InTxn([&]() REQUIRES(mu_) -> Status {
      RC_RETURN_IF_ERROR(ExpireLeases());
      RC_ASSIGN_OR_RETURN(LoadedVersion v, Load(model, version));
      RC_ASSIGN_OR_RETURN(VersionState before,
                          internal::ApplyMarkUnavailable(v.exists ? &v.meta : nullptr, model, version, reason));
      if (before != VersionState::kCommitted && before != VersionState::kStaging) return OkStatus();
      // The commit feed and List read `state`, so the new state takes the version out of both.
      RC_RETURN_IF_ERROR(Stmt(db_, "UPDATE rc_dir_versions SET state = ?, reason = ?, manifest = NULL WHERE model = ? "
                                   "AND version = ?")
                             .Bind(1, VersionStateName(v.meta.state))
                             .Bind(2, v.meta.reason)
                             .Bind(3, model)
                             .Bind(4, version)
                             .Run());
      return Stmt(db_, "DELETE FROM rc_dir_ranks WHERE model = ? AND version = ?").Bind(1, model).Bind(2, version).Run();
    });
  }

 private:
  // Runs fn inside BEGIN IMMEDIATE ... COMMIT (ROLLBACK when fn fails), holding mu_.
  template <typename Fn>
  Status InTxn(Fn&& fn) {
    rc::MutexLock lock(mu_);
    RC_RETURN_IF_ERROR(db_.Exec("BEGIN IMMEDIATE"));
    Status s = fn();
    if (s.ok()) {
      s = db_.Exec("COMMIT");
      if (s.ok()) return s;
    }
    Status rb = db_.Exec("ROLLBACK");
    (void)rb;  // the original failure is what the caller needs
    return s;
  }

  Result<LoadedVersion> Load(std::string_view model, std::string_view version) REQUIRES(mu_) {
    LoadedVersion v;
    Stmt q(db_, "SELECT state, released, expected_ranks, commit_seq, content_digest, reason FROM rc_dir_versions "
                "WHERE model = ? AND version = ?");
    q.Bind(1, model).Bind(2, version);
    if (!q.Step()) {
      RC_RETURN_IF_ERROR(q.status());
      return v;
    }
    v.exists = true;
    auto state = ParseVersionState(q.Text(0));
    if (!state.ok()) return DataLoss("stored version state: " + state.status().message());
    v.meta.state = *state;
    v.meta.released = q.Int(1) != 0;
    v.meta.expected_ranks = static_cast<int32_t>(q.Int(2));
    v.meta.commit_seq = static_cast<uint64_t>(q.Int(3));
    v.meta.content_digest = static_cast<uint64_t>(q.Int(4));
    v.meta.reason = q.Text(5);
    if (v.meta.state == VersionState::kStaging && !v.meta.released) {
      Stmt r(db_, "SELECT rank, lease_id FROM rc_dir_ranks WHERE model = ? AND version = ?");
      r.Bind(1, model).Bind(2, version);
      while (r.Step()) v.meta.rank_leases[static_cast<int32_t>(r.Int(0))] = r.Int(1);
      RC_RETURN_IF_ERROR(r.status());
    }
    return v;
  }

  Result<int64_t> GrantLease(int64_t ttl_ms) REQUIRES(mu_) {
    for (int attempt = 0; attempt < 16; ++attempt) {
      int64_t id = 0;
      {
        rc::MutexLock lock(wait_mu_);
        id = static_cast<int64_t>(rng_() >> 1);
      }
      if (id == 0) continue;
      Stmt ins(db_, "INSERT OR IGNORE INTO rc_dir_leases(id, ttl_ms, expires_ms) VALUES(?, ?, ?)");
      ins.Bind(1, id).Bind(2, ttl_ms).Bind(3, clock_->NowMs() + ttl_ms);
      RC_RETURN_IF_ERROR(ins.Run());
      if (sqlite3_changes(db_.handle()) == 1) return id;
    }
    return Internal("could not draw an unused lease id");
  }

  // Abandons every STAGING version one of whose ranks holds an expired lease, then deletes the
  // expired leases. Runs first inside every transaction.
  Status ExpireLeases() REQUIRES(mu_) {
    const int64_t now = clock_->NowMs();
    struct Victim {
      std::string model, version;
      int64_t rank, lease;
    };
    std::vector<Victim> victims;
    {
      Stmt q(db_, "SELECT r.model, r.version, r.rank, r.lease_id FROM rc_dir_ranks r JOIN rc_dir_leases l "
                  "ON r.lease_id = l.id WHERE l.expires_ms <= ? ORDER BY r.model, r.version, r.rank");
      q.Bind(1, now);
      while (q.Step()) victims.push_back(Victim{q.Text(0), q.Text(1), q.Int(2), q.Int(3)});
      RC_RETURN_IF_ERROR(q.status());
    }
    for (const Victim& v : victims) {
      RC_RETURN_IF_ERROR(Stmt(db_, "UPDATE rc_dir_versions SET state = 'ABANDONED', reason = ? WHERE model = ? AND "
                                   "version = ? AND state = 'STAGING'")
                             .Bind(1, internal::LeaseExpiredReason(static_cast<int32_t>(v.rank), v.lease))
                             .Bind(2, v.model)
                             .Bind(3, v.version)
                             .Run());
      RC_RETURN_IF_ERROR(
          Stmt(db_, "DELETE FROM rc_dir_ranks WHERE model = ? AND version = ?").Bind(1, v.model).Bind(2, v.version).Run());
    }
    return Stmt(db_, "DELETE FROM rc_dir_leases WHERE expires_ms <= ?").Bind(1, now).Run();
  }

  Result<std::vector<CommitEvent>> CommitsAfter(std::string_view model, uint64_t after_seq) {
    std::vector<CommitEvent> out;
    if (after_seq >= static_cast<uint64_t>(INT64_MAX)) return out;
    rc::MutexLock lock(mu_);
    Stmt q(db_, "SELECT version, commit_seq, content_digest FROM rc_dir_versions WHERE model = ? AND state = "
                "'COMMITTED' AND released = 0 AND commit_seq > ? ORDER BY commit_seq");
    q.Bind(1, model).Bind(2, static_cast<int64_t>(after_seq));
    while (q.Step()) {
      out.push_back(CommitEvent{std::string(model), q.Text(0), static_cast<uint64_t>(q.Int(1)),
                                static_cast<uint64_t>(q.Int(2))});
    }
    RC_RETURN_IF_ERROR(q.status());
    return out;
  }

  const sqlite::Database db_ GUARDED_BY(mu_);
  Clock* const clock_;
  const SqliteStoreOptions options_;
  rc::Mutex mu_;  // serializes use of db_
  rc::Mutex wait_mu_;
  rc::CondVar commit_cv_;
  uint64_t commit_generation_ GUARDED_BY(wait_mu_) = 0;  // guarded by wait_mu_
  std::mt19937_64 rng_ GUARDED_BY(wait_mu_);             // guarded by wait_mu_
};

}  // namespace

Result<std::unique_ptr<DirectoryStore>> OpenSqliteStore(const std::string& path, Clock* clock,
                                                        const SqliteStoreOptions& options) {
  RC_ASSIGN_OR_RETURN(sqlite::Database db,
                      sqlite::Database::Open(path, "directory database",
                                             {.create = true, .serialized = false,
                                              .busy_timeout_ms = static_cast<int64_t>(options.busy_timeout_ms)}));
  auto store = std::make_unique<SqliteStore>(std::move(db), clock, options);
  Status s = store->Init();
  if (!s.ok()) return s.WithContext(fmt::format("directory database '{}'", path));
  return std::unique_ptr<DirectoryStore>(std::move(store));
}

}  // namespace rc::directory
