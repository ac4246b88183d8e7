#include "rolloutcore/directory/etcd_store.h"

#include <fmt/format.h>

#include <chrono>
#include <thread>

#include "directory/codec.h"
#include "rolloutcore/base/content_digest.h"
#include "directory/etcd_client.h"
#include "directory/version_record.h"

namespace rc::directory {
namespace {

using internal::EtcdClient;
using internal::EtcdKv;
using internal::EtcdTxn;
using internal::VersionMeta;

std::string MetaToJson(const VersionMeta& m) {
  Json ranks = Json::object();
  for (const auto& [rank, lease] : m.rank_leases) ranks[std::to_string(rank)] = std::to_string(lease);
  return Json{{"state", VersionStateName(m.state)},
              {"released", m.released},
              {"expected_ranks", m.expected_ranks},
              {"ranks", ranks},
              {"commit_seq", m.commit_seq},
              {"content_digest", DigestHex(m.content_digest)},
              {"reason", m.reason}}
      .dump();
}

Result<VersionMeta> MetaFromJson(std::string_view text) {
  auto parsed = ParseJson(text, "stored version meta");
  if (!parsed.ok()) return DataLoss(parsed.status().message());
  const Json& j = *parsed;
  auto fail = [](const Status& s) { return DataLoss("stored version meta: " + s.message()); };
  VersionMeta m;
  auto state = GetString(j, "state", "");
  if (!state.ok()) return fail(state.status());
  auto st = ParseVersionState(*state);
  if (!st.ok()) return fail(st.status());
  m.state = *st;
  auto released = GetBool(j, "released", "", false);
  if (!released.ok()) return fail(released.status());
  m.released = *released;
  auto expected = GetNonNegativeInt(j, "expected_ranks", "");
  if (!expected.ok()) return fail(expected.status());
  m.expected_ranks = static_cast<int32_t>(*expected);
  auto ranks = j.find("ranks");
  if (ranks != j.end() && ranks->is_object()) {
    for (auto it = ranks->begin(); it != ranks->end(); ++it) {
      auto rank = internal::ParseDecimal(it.key(), "ranks key");
      if (!rank.ok()) return fail(rank.status());
      if (!it.value().is_string()) return fail(InvalidArgument("ranks: lease ids must be strings"));
      auto lease = internal::ParseDecimal(it.value().get_ref<const std::string&>(), "ranks value");
      if (!lease.ok()) return fail(lease.status());
      m.rank_leases[static_cast<int32_t>(*rank)] = *lease;
    }
  }
  auto seq = GetNonNegativeInt(j, "commit_seq", "", 0);
  if (!seq.ok()) return fail(seq.status());
  m.commit_seq = static_cast<uint64_t>(*seq);
  auto digest = GetString(j, "content_digest", "", std::string(kZeroDigestHex));
  if (!digest.ok()) return fail(digest.status());
  auto d = ContentDigest::ParseHex(*digest, "content_digest");
  if (!d.ok()) return fail(d.status());
  m.content_digest = *d;
  auto reason = GetString(j, "reason", "", std::string());
  if (!reason.ok()) return fail(reason.status());
  m.reason = *reason;
  return m;
}

// What one read of a version found.
struct Snapshot {
  bool exists = false;
  int64_t meta_revision = 0;  // 0 when absent
  VersionMeta meta;
  std::map<int32_t, EtcdKv> rank_keys;  // STAGING: live rank keys (values only when asked for)
};

class EtcdStore final : public DirectoryStore {
 public:
  explicit EtcdStore(EtcdStoreOptions options)
      : options_(std::move(options)), etcd_(options_.endpoint, options_.request_timeout_ms) {}

  Status Connect() { return etcd_.Health(); }

  Result<PublishResult> Publish(const PublishRequest& r) override {
    RC_RETURN_IF_ERROR(internal::ValidatePublishRequest(r));
    int64_t granted = 0;  // a lease this call granted; revoked when the publish fails
    int64_t granted_ttl_s = 0;
    auto fail = [&](Status s) -> Status {
      if (granted != 0) {
        Status revoke = etcd_.LeaseRevoke(granted);
        (void)revoke;  // best effort: an unrevoked lease only lingers until its TTL
      }
      return s;
    };
    int64_t given_ttl_s = 0;
    if (r.lease_id != 0) {
      auto ttl = etcd_.LeaseGrantedTtl(r.lease_id);
      if (!ttl.ok()) return ttl.status();
      given_ttl_s = *ttl;
    }
    // The digest of the committing txn this call sent last (0: none). A txn may be applied by etcd
    // although its answer was lost (the member died; the client re-sent it to another member,
    // whose compares then failed): when the re-read finds the version COMMITTED with exactly that
    // content, this publish is what committed it.
    uint64_t sent_commit_digest = 0;
    for (int attempt = 0; attempt < options_.max_txn_attempts; ++attempt) {
      auto snap = Resolve(r.model, r.version, /*with_values=*/false);
      if (!snap.ok()) return fail(snap.status());
      if (sent_commit_digest != 0 && snap->exists && !snap->meta.released &&
          snap->meta.state == VersionState::kCommitted && snap->meta.content_digest == sent_commit_digest) {
        PublishResult out;
        out.state = VersionState::kCommitted;
        out.expected_ranks = r.expected_ranks;
        out.ranks_published = r.expected_ranks;
        out.commit_seq = snap->meta.commit_seq;
        out.content_digest = snap->meta.content_digest;
        out.lease_id = r.lease_id != 0 ? r.lease_id : granted;
        out.lease_ttl_ms = (r.lease_id != 0 ? given_ttl_s : granted_ttl_s) * 1000;
        return out;
      }
      auto completes = internal::CheckPublish(snap->exists ? &snap->meta : nullptr, r);
      if (!completes.ok()) return fail(completes.status());
      int64_t lease_id = r.lease_id;
      int64_t ttl_s = given_ttl_s;
      if (lease_id == 0) {
        if (granted == 0) {
          auto id = etcd_.LeaseGrant(std::max<int64_t>(1, (r.lease_ttl_ms + 999) / 1000), &granted_ttl_s);
          if (!id.ok()) return id.status();
          granted = *id;
        }
        lease_id = granted;
        ttl_s = granted_ttl_s;
      }
      PublishResult out;
      out.expected_ranks = r.expected_ranks;
      out.lease_id = lease_id;
      out.lease_ttl_ms = ttl_s * 1000;
      VersionMeta meta = snap->exists ? snap->meta : VersionMeta{};
      if (!snap->exists) meta.expected_ranks = r.expected_ranks;
      EtcdTxn txn;
      txn.ModRevisionIs(MetaKey(r.model, r.version), snap->meta_revision);
      if (*completes) {
        // Read the other ranks' tables; their mod_revisions go into the compares, so a key that
        // expires (or is replaced) after this read fails the commit and we re-read.
        std::map<int32_t, std::vector<refit::ShardTable>> others;
        std::map<int32_t, int64_t> other_revisions;
        std::vector<refit::Probe> probes = r.probes;
        if (snap->exists) {
          auto keys = etcd_.RangePrefix(RanksPrefix(r.model, r.version));
          if (!keys.ok()) return fail(keys.status());
          for (const EtcdKv& kv : *keys) {
            auto rank = RankFromKey(r.model, r.version, kv.key);
            if (!rank.ok()) return fail(rank.status());
            if (*rank == r.rank || !meta.rank_leases.count(*rank)) continue;
            auto j = ParseJson(kv.value, "stored tables");
            if (!j.ok()) return fail(DataLoss(j.status().message()));
            auto row = internal::RankRowFromJson(*j);
            if (!row.ok()) return fail(DataLoss(fmt::format("stored tables of rank {}: {}", *rank, row.status().message())));
            others[*rank] = std::move(row->tables);
            if (*rank == 0) probes = std::move(row->probes);
            other_revisions[*rank] = kv.mod_revision;
          }
        }
        if (others.size() + 1 != static_cast<size_t>(r.expected_ranks)) continue;  // a key vanished: re-read
        std::map<int32_t, const std::vector<refit::ShardTable>*> by_rank;
        for (const auto& [rank, tables] : others) by_rank[rank] = &tables;
        by_rank[r.rank] = &r.tables;
        auto manifest = internal::MergeRankTables(r.model, r.version, r.expected_ranks, by_rank, probes);
        if (!manifest.ok()) return fail(manifest.status());
        auto seq_kv = etcd_.Get(SeqKey(r.model));
        if (!seq_kv.ok()) return fail(seq_kv.status());
        uint64_t last_seq = 0;
        int64_t seq_revision = 0;
        if (seq_kv->has_value()) {
          auto v = internal::ParseDecimal((*seq_kv)->value, "stored commit sequence");
          if (!v.ok()) return fail(DataLoss(v.status().message()));
          last_seq = static_cast<uint64_t>(*v);
          seq_revision = (*seq_kv)->mod_revision;
        }
        const uint64_t seq = last_seq + 1;
        for (const auto& [rank, rev] : other_revisions) txn.ModRevisionIs(RankKey(r.model, r.version, rank), rev);
        txn.ModRevisionIs(SeqKey(r.model), seq_revision);
        meta.state = VersionState::kCommitted;
        meta.rank_leases.clear();
        meta.commit_seq = seq;
        meta.content_digest = manifest->content_digest;
        txn.Put(MetaKey(r.model, r.version), MetaToJson(meta))
            .Put(ManifestKey(r.model, r.version), refit::ManifestToJson(*manifest).dump())
            .Put(CommitKey(r.model, seq),
                 Json{{"version", r.version}, {"content_digest", DigestHex(meta.content_digest)}}.dump())
            .Put(SeqKey(r.model), std::to_string(seq))
            .DeletePrefix(RanksPrefix(r.model, r.version));
        out.state = VersionState::kCommitted;
        out.ranks_published = r.expected_ranks;
        out.commit_seq = seq;
        out.content_digest = meta.content_digest;
        sent_commit_digest = meta.content_digest;
      } else {
        meta.rank_leases[r.rank] = lease_id;
        txn.Put(MetaKey(r.model, r.version), MetaToJson(meta))
            .Put(RankKey(r.model, r.version, r.rank), internal::RankRowToJson(r).dump(), lease_id);
        out.state = VersionState::kStaging;
        out.ranks_published = static_cast<int32_t>(meta.rank_leases.size());
      }
      auto ok = etcd_.Commit(txn);
      if (!ok.ok()) {
        if (sent_commit_digest == 0) return fail(ok.status());
        // The committing txn's fate is unknown (no member answered): say so, and which digest, so
        // the caller re-reads the version instead of assuming either outcome.
        return fail(Unavailable(fmt::format("{}: the commit by rank {} (content digest {}) may or may not have been "
                                       "applied; no etcd member confirmed it: {}",
                                       internal::DescribeVersion(r.model, r.version), r.rank,
                                       DigestHex(sent_commit_digest), ok.status().message())));
      }
      if (*ok) return out;
    }
    return fail(Aborted(fmt::format("{}: publish of rank {} lost {} optimistic races in a row; retry",
                                    internal::DescribeVersion(r.model, r.version), r.rank,
                                    options_.max_txn_attempts)));
  }

  Result<LeaseInfo> KeepAlive(int64_t lease_id) override {
    if (lease_id <= 0) return NotFound(fmt::format("lease {} does not exist (expired, or never granted)", lease_id));
    RC_ASSIGN_OR_RETURN(int64_t ttl_s, etcd_.LeaseKeepAlive(lease_id));
    return LeaseInfo{lease_id, ttl_s * 1000};
  }

  Result<refit::Manifest> Get(std::string_view model, std::string_view version) override {
    RC_RETURN_IF_ERROR(CheckNames(model, version));
    RC_ASSIGN_OR_RETURN(Snapshot snap, Resolve(model, version, false));
    if (!snap.exists || snap.meta.released) return internal::VersionNotFound(model, version);
    if (snap.meta.state != VersionState::kCommitted) return internal::NotCommitted(model, version, snap.meta);
    RC_ASSIGN_OR_RETURN(std::optional<EtcdKv> kv, etcd_.Get(ManifestKey(model, version)));
    if (!kv) return internal::VersionNotFound(model, version);  // released meanwhile
    auto j = ParseJson(kv->value, "stored manifest");
    if (!j.ok()) return DataLoss(j.status().message());
    auto m = refit::ManifestFromJson(*j);
    if (!m.ok()) return DataLoss("stored manifest: " + m.status().message());
    return std::move(*m);
  }

  Result<VersionInfo> GetInfo(std::string_view model, std::string_view version) override {
    RC_RETURN_IF_ERROR(CheckNames(model, version));
    RC_ASSIGN_OR_RETURN(Snapshot snap, Resolve(model, version, false));
    if (!snap.exists || snap.meta.released) return internal::VersionNotFound(model, version);
    return internal::MakeVersionInfo(model, version, snap.meta);
  }

  Result<std::vector<VersionInfo>> List(std::string_view model, StateFilter filter) override {
    RC_RETURN_IF_ERROR(ValidateName(model, "model"));
    const std::string meta_prefix = ModelPrefix(model) + "meta/";
    RC_ASSIGN_OR_RETURN(std::vector<EtcdKv> metas, etcd_.RangePrefix(meta_prefix));
    std::vector<VersionInfo> out;
    for (const EtcdKv& kv : metas) {
      const std::string version = kv.key.substr(meta_prefix.size());
      RC_ASSIGN_OR_RETURN(VersionMeta meta, MetaFromJson(kv.value));
      if (meta.released) continue;
      if (meta.state == VersionState::kStaging) {
        // Lease expiry is observed lazily: resolving marks it ABANDONED when a rank key is gone.
        auto snap = Resolve(model, version, false);
        if (!snap.ok()) return snap.status();
        if (!snap->exists || snap->meta.released) continue;
        meta = snap->meta;
      }
      if (FilterMatches(filter, meta.state)) out.push_back(internal::MakeVersionInfo(model, version, meta));
    }
    internal::SortVersionInfos(&out);
    return out;
  }

  Result<std::vector<CommitEvent>> WaitForCommits(std::string_view model, uint64_t after_seq,
                                                  int64_t timeout_ms) override {
    RC_RETURN_IF_ERROR(ValidateName(model, "model"));
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max<int64_t>(timeout_ms, 0));
    const std::string prefix = ModelPrefix(model) + "commits/";
    while (true) {
      std::vector<CommitEvent> out;
      if (after_seq < UINT64_MAX) {
        RC_ASSIGN_OR_RETURN(std::vector<EtcdKv> kvs,
                            etcd_.RangePrefix(prefix, false, CommitKey(model, after_seq + 1)));
        for (const EtcdKv& kv : kvs) {
          auto seq = internal::ParseDecimal(std::string_view(kv.key).substr(prefix.size()), "commit key");
          if (!seq.ok()) return DataLoss(seq.status().message());
          auto j = ParseJson(kv.value, "stored commit");
          if (!j.ok()) return DataLoss(j.status().message());
          CommitEvent e;
          e.model = std::string(model);
          e.seq = static_cast<uint64_t>(*seq);
          auto version = GetString(*j, "version", "commit");
          auto digest = GetString(*j, "content_digest", "commit");
          if (!version.ok() || !digest.ok()) return DataLoss("stored commit entry is malformed");
          e.version = *version;
          auto d = ContentDigest::ParseHex(*digest, "content_digest");
          if (!d.ok()) return DataLoss(d.status().message());
          e.content_digest = *d;
          out.push_back(std::move(e));
        }
      }
      const auto now = std::chrono::steady_clock::now();
      if (!out.empty() || now >= deadline) return out;
      std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(
          deadline - now, std::chrono::milliseconds(options_.poll_interval_ms)));
    }
  }

  Status Release(std::string_view model, std::string_view version) override {
    RC_RETURN_IF_ERROR(CheckNames(model, version));
    for (int attempt = 0; attempt < options_.max_txn_attempts; ++attempt) {
      RC_ASSIGN_OR_RETURN(Snapshot snap, Read(model, version, false));
      if (!snap.exists || snap.meta.released) return internal::VersionNotFound(model, version);
      VersionMeta meta = snap.meta;
      EtcdTxn txn;
      txn.ModRevisionIs(MetaKey(model, version), snap.meta_revision);
      if (meta.state == VersionState::kCommitted) txn.Delete(CommitKey(model, meta.commit_seq));
      meta.released = true;
      meta.rank_leases.clear();
      txn.Put(MetaKey(model, version), MetaToJson(meta))
          .Delete(ManifestKey(model, version))
          .DeletePrefix(RanksPrefix(model, version));
      RC_ASSIGN_OR_RETURN(bool ok, etcd_.Commit(txn));
      if (ok) return OkStatus();
    }
    return Aborted(fmt::format("{}: release lost {} optimistic races in a row; retry",
                               internal::DescribeVersion(model, version), options_.max_txn_attempts));
  }

  Status MarkUnavailable(std::string_view model, std::string_view version, std::string_view reason) override {
    RC_RETURN_IF_ERROR(CheckNames(model, version));
    for (int attempt = 0; attempt < options_.max_txn_attempts; ++attempt) {
      RC_ASSIGN_OR_RETURN(Snapshot snap, Resolve(model, version, false));
      VersionMeta meta = snap.meta;
      RC_ASSIGN_OR_RETURN(VersionState before,
                          internal::ApplyMarkUnavailable(snap.exists ? &meta : nullptr, model, version, reason));
      if (before != VersionState::kCommitted && before != VersionState::kStaging) return OkStatus();
      EtcdTxn txn;
      txn.ModRevisionIs(MetaKey(model, version), snap.meta_revision);
      if (before == VersionState::kCommitted) txn.Delete(CommitKey(model, meta.commit_seq));
      txn.Put(MetaKey(model, version), MetaToJson(meta))
          .Delete(ManifestKey(model, version))
          .DeletePrefix(RanksPrefix(model, version));
      RC_ASSIGN_OR_RETURN(bool ok, etcd_.Commit(txn));
      if (ok) return OkStatus();
    }
    return Aborted(fmt::format("{}: marking it unavailable lost {} optimistic races in a row; retry",
                               internal::DescribeVersion(model, version), options_.max_txn_attempts));
  }

 private:
  static Status CheckNames(std::string_view model, std::string_view version) {
    RC_RETURN_IF_ERROR(ValidateName(model, "model"));
    return ValidateName(version, "version");
  }

  std::string ModelPrefix(std::string_view model) const { return fmt::format("{}/{}/", options_.prefix, model); }
  std::string SeqKey(std::string_view model) const { return ModelPrefix(model) + "seq"; }
  std::string MetaKey(std::string_view model, std::string_view version) const {
    return fmt::format("{}meta/{}", ModelPrefix(model), version);
  }
  std::string ManifestKey(std::string_view model, std::string_view version) const {
    return fmt::format("{}manifest/{}", ModelPrefix(model), version);
  }
  std::string RanksPrefix(std::string_view model, std::string_view version) const {
    return fmt::format("{}ranks/{}/", ModelPrefix(model), version);
  }
  std::string RankKey(std::string_view model, std::string_view version, int32_t rank) const {
    return RanksPrefix(model, version) + std::to_string(rank);
  }
  std::string CommitKey(std::string_view model, uint64_t seq) const {
    return fmt::format("{}commits/{:020d}", ModelPrefix(model), seq);
  }
  Result<int32_t> RankFromKey(std::string_view model, std::string_view version, std::string_view key) const {
    const std::string prefix = RanksPrefix(model, version);
    auto rank = internal::ParseDecimal(key.substr(std::min(prefix.size(), key.size())), "rank key");
    if (!rank.ok() || *rank > kMaxExpectedRanks) return DataLoss(fmt::format("unexpected key {}", key));
    return static_cast<int32_t>(*rank);
  }

  // One read of a version: meta, and for a STAGING version its live rank keys.
  Result<Snapshot> Read(std::string_view model, std::string_view version, bool with_values) {
    Snapshot snap;
    RC_ASSIGN_OR_RETURN(std::optional<EtcdKv> meta, etcd_.Get(MetaKey(model, version)));
    if (!meta) return snap;
    snap.exists = true;
    snap.meta_revision = meta->mod_revision;
    RC_ASSIGN_OR_RETURN(snap.meta, MetaFromJson(meta->value));
    if (snap.meta.state == VersionState::kStaging && !snap.meta.released) {
      RC_ASSIGN_OR_RETURN(std::vector<EtcdKv> keys, etcd_.RangePrefix(RanksPrefix(model, version), !with_values));
      for (EtcdKv& kv : keys) {
        RC_ASSIGN_OR_RETURN(int32_t rank, RankFromKey(model, version, kv.key));
        snap.rank_keys[rank] = std::move(kv);
      }
    }
    return snap;
  }

  // Read, and when a STAGING version lists a rank whose key etcd deleted (its lease expired), mark
  // it ABANDONED first (one txn pinned on the meta revision) and read again.
  Result<Snapshot> Resolve(std::string_view model, std::string_view version, bool with_values) {
    for (int attempt = 0; attempt < options_.max_txn_attempts; ++attempt) {
      RC_ASSIGN_OR_RETURN(Snapshot snap, Read(model, version, with_values));
      if (!snap.exists || snap.meta.released || snap.meta.state != VersionState::kStaging) return snap;
      const std::pair<const int32_t, int64_t>* lost = nullptr;
      for (const auto& entry : snap.meta.rank_leases) {
        if (!snap.rank_keys.count(entry.first)) {
          lost = &entry;
          break;
        }
      }
      if (lost == nullptr) return snap;
      VersionMeta meta = snap.meta;
      meta.state = VersionState::kAbandoned;
      meta.reason = internal::LeaseExpiredReason(lost->first, lost->second);
      meta.rank_leases.clear();
      EtcdTxn txn;
      txn.ModRevisionIs(MetaKey(model, version), snap.meta_revision)
          .Put(MetaKey(model, version), MetaToJson(meta))
          .DeletePrefix(RanksPrefix(model, version));
      RC_ASSIGN_OR_RETURN(bool ok, etcd_.Commit(txn));
      (void)ok;  // either we abandoned it or someone changed it; read again in both cases
    }
    return Aborted(fmt::format("{}: could not read a stable state in {} attempts",
                               internal::DescribeVersion(model, version), options_.max_txn_attempts));
  }

  const EtcdStoreOptions options_;
  EtcdClient etcd_;
};

}  // namespace

Result<std::unique_ptr<DirectoryStore>> OpenEtcdStore(const EtcdStoreOptions& options) {
  {
    size_t start = 0;
    while (start <= options.endpoint.size()) {
      size_t comma = options.endpoint.find(',', start);
      if (comma == std::string::npos) comma = options.endpoint.size();
      const std::string_view one = std::string_view(options.endpoint).substr(start, comma - start);
      if (!one.starts_with("http://")) {
        return InvalidArgument(fmt::format("etcd endpoint must start with http://, got '{}' (in '{}')", one,
                                           options.endpoint));
      }
      start = comma + 1;
    }
  }
  if (options.prefix.empty() || options.prefix[0] != '/' || options.prefix.back() == '/') {
    return InvalidArgument(
        fmt::format("etcd key prefix must start with '/' and not end with '/', got '{}'", options.prefix));
  }
  auto store = std::make_unique<EtcdStore>(options);
  RC_RETURN_IF_ERROR(store->Connect());
  return std::unique_ptr<DirectoryStore>(std::move(store));
}

}  // namespace rc::directory
