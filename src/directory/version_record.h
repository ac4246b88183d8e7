// The directory's publish/commit rules as pure functions, shared by every store so that memory,
// SQLite and etcd decide identically and word their refusals identically.
//
// A store loads what it holds about one version (VersionMeta, plus the other ranks' tables when a
// publish is about to complete the version), asks CheckPublish and MergeRankTables what the
// publish leads to, and writes the outcome atomically in its own way (a mutex, an SQLite
// transaction, an etcd txn with compares).
//
// Thread safety: values and pure functions.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/json.h"
#include "rolloutcore/base/status.h"
#include "rolloutcore/directory/types.h"
#include "rolloutcore/refit/manifest.h"

namespace rc::directory::internal {

// What a store knows about one version besides shard tables.
struct VersionMeta {
  VersionState state = VersionState::kStaging;
  bool released = false;  // a tombstone: invisible, refuses publishes
  int32_t expected_ranks = 0;
  std::map<int32_t, int64_t> rank_leases;  // STAGING: published rank -> its lease
  uint64_t commit_seq = 0;
  uint64_t content_digest = 0;
  std::string reason;  // ABANDONED / UNAVAILABLE: why
};

// "version V of model M".
std::string DescribeVersion(std::string_view model, std::string_view version);
// NotFound "version V of model M does not exist (never published, or released)".
Status VersionNotFound(std::string_view model, std::string_view version);

// Stateless checks of one publish: names, rank range, lease fields, every table valid on its own
// (refit::ValidateShardTable without completeness), shards carry the publishing rank, no tensor
// twice. InvalidArgument naming the field.
[[nodiscard]] Status ValidatePublishRequest(const PublishRequest& request);

// Checks a (validated) publish against the version's current meta (nullptr when the version does
// not exist yet). Returns whether the publish completes the rank set (so the store must merge and
// commit), or FailedPrecondition: the version is COMMITTED, ABANDONED or released, or declares a
// different expected_ranks.
[[nodiscard]] Result<bool> CheckPublish(const VersionMeta* meta, const PublishRequest& request);

// Merges the tables of ranks 0..N-1 into the committed manifest (tensors in name order, shards by
// rank then offset) and checks it: every tensor has one dtype and shape across ranks, its shards
// are complete and non-overlapping (replicas allowed), replicas agree on digests. Refusals carry
// refit's message naming the tensor, prefixed "version V of model M cannot commit".
[[nodiscard]] Result<refit::Manifest> MergeRankTables(
    std::string_view model, std::string_view version, int32_t expected_ranks,
    const std::map<int32_t, const std::vector<refit::ShardTable>*>& tables_by_rank,
    const std::vector<refit::Probe>& probes = {});  // rank 0's probes, carried into the manifest

// MarkUnavailable's rule applied to a version's meta (nullptr: unknown): checks the reason
// (InvalidArgument), refuses unknown or released versions (NotFound), and moves COMMITTED to
// UNAVAILABLE or STAGING to ABANDONED with the reason (rank_leases cleared). Returns the state the
// version had before; the meta is unchanged (and the store writes nothing) when that was already
// ABANDONED or UNAVAILABLE.
[[nodiscard]] Result<VersionState> ApplyMarkUnavailable(VersionMeta* meta, std::string_view model,
                                                        std::string_view version, std::string_view reason);

// FailedPrecondition for Get of a version that is not COMMITTED ("... is STAGING (1 of 2 ranks
// published)", "... is ABANDONED (reason)", "... is UNAVAILABLE (reason)").
Status NotCommitted(std::string_view model, std::string_view version, const VersionMeta& meta);

// The reason recorded when a lease expires before commit.
std::string LeaseExpiredReason(int32_t rank, int64_t lease_id);

VersionInfo MakeVersionInfo(std::string_view model, std::string_view version, const VersionMeta& meta);
// Committed first in commit order, then the others by label.
void SortVersionInfos(std::vector<VersionInfo>* infos);

// A rank's stored publish (the stores' per-rank rows): its tables and, for rank 0, the version's
// probes. Stored as the bare tables array when there are no probes (the form older rows have), as
// {"tensors": [...], "probes": [...]} otherwise; RankRowFromJson reads both.
struct RankRow {
  std::vector<refit::ShardTable> tables;
  std::vector<refit::Probe> probes;
};
Json RankRowToJson(const PublishRequest& request);
[[nodiscard]] Result<RankRow> RankRowFromJson(const Json& j);

// Shard tables as the JSON array used in publish bodies and storage (the "tensors" entries of
// refit::ManifestToJson), and back; errors name "tensors[i]....".
Json TablesToJson(const std::vector<refit::ShardTable>& tables);
[[nodiscard]] Result<std::vector<refit::ShardTable>> TablesFromJson(const Json& tensors);

}  // namespace rc::directory::internal
