#include "directory/version_record.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>
#include <tuple>

#include "rolloutcore/refit/digest.h"

namespace rc::directory::internal {
namespace {

// Tables are stored and served as JSON, whose strings must be UTF-8; binary transport
// descriptors have to be encoded by their transport (hex, base64) before they are published.
bool IsValidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 1;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3;
      cp = c & 0x07;
    } else {
      return false;
    }
    for (size_t k = 1; k <= n; ++k) {
      if (i + k >= s.size()) return false;
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    const uint32_t min[] = {0, 0x80, 0x800, 0x10000};
    if (cp < min[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n + 1;
  }
  return true;
}

}  // namespace

std::string DescribeVersion(std::string_view model, std::string_view version) {
  return fmt::format("version {} of model {}", version, model);
}

Status VersionNotFound(std::string_view model, std::string_view version) {
  return NotFound(fmt::format("{} does not exist (never published, or released)", DescribeVersion(model, version)));
}

Status ValidatePublishRequest(const PublishRequest& r) {
  RC_RETURN_IF_ERROR(ValidateName(r.model, "model"));
  RC_RETURN_IF_ERROR(ValidateName(r.version, "version"));
  if (r.expected_ranks < 1 || r.expected_ranks > kMaxExpectedRanks) {
    return InvalidArgument(
        fmt::format("expected_ranks: must be between 1 and {}, got {}", kMaxExpectedRanks, r.expected_ranks));
  }
  if (r.rank < 0 || r.rank >= r.expected_ranks) {
    return InvalidArgument(fmt::format("rank: {} is out of range for expected_ranks {} (ranks are 0..{})", r.rank,
                                       r.expected_ranks, r.expected_ranks - 1));
  }
  if (r.lease_id < 0) return InvalidArgument(fmt::format("lease_id: must not be negative, got {}", r.lease_id));
  if (r.lease_id == 0 && (r.lease_ttl_ms < 1 || r.lease_ttl_ms > kMaxLeaseTtlMs)) {
    return InvalidArgument(fmt::format("lease_ttl_ms: must be between 1 and {} when no lease_id is given, got {}",
                                       kMaxLeaseTtlMs, r.lease_ttl_ms));
  }
  if (r.digest_algorithm.empty()) {
    return InvalidArgument(fmt::format(
        "digest: required field is missing: rank {} must say which content digest its shard digests use (this "
        "directory accepts \"{}\"); a publisher that does not say predates it",
        r.rank, refit::kDigestAlgorithm));
  }
  if (r.digest_algorithm != refit::kDigestAlgorithm) {
    return InvalidArgument(fmt::format(
        "digest: rank {} computed its shard digests with \"{}\", but this directory accepts only \"{}\" (publisher "
        "and engine must be built from the same rolloutcore release)",
        r.rank, r.digest_algorithm, refit::kDigestAlgorithm));
  }
  std::set<std::string_view> names;
  for (size_t i = 0; i < r.tables.size(); ++i) {
    const refit::ShardTable& t = r.tables[i];
    const std::string path = fmt::format("tensors[{}]", i);
    if (t.name.empty()) return InvalidArgument(path + ".name: must not be empty");
    if (t.name.size() > kMaxTensorNameLength) {
      return InvalidArgument(fmt::format("{}.name: {} characters, at most {} allowed", path, t.name.size(),
                                         kMaxTensorNameLength));
    }
    if (!IsValidUtf8(t.name)) return InvalidArgument(path + ".name: must be UTF-8");
    if (!names.insert(t.name).second) {
      return InvalidArgument(
          fmt::format("{}.name: tensor {} appears twice in the tables of rank {}", path, t.name, r.rank));
    }
    for (size_t k = 0; k < t.shards.size(); ++k) {
      if (!IsValidUtf8(t.shards[k].handle)) {
        return InvalidArgument(fmt::format(
            "{}.shards[{}].handle: must be UTF-8 (encode binary transport descriptors, e.g. as base64)", path, k));
      }
      if (t.shards[k].rank != r.rank) {
        return InvalidArgument(fmt::format("{}.shards[{}].rank: {}, but the table is published by rank {}", path, k,
                                           t.shards[k].rank, r.rank));
      }
    }
    Status s = refit::ValidateShardTable(t, /*require_complete=*/false);
    if (!s.ok()) return s.WithContext(path);
    const bool projection = refit::Fp8ParameterOf(t.name).has_value();
    for (size_t k = 0; k < t.shards.size(); ++k) {
      if (!t.shards[k].fp8.empty() && !projection) {
        return InvalidArgument(fmt::format("{}.shards[{}].fp8: tensor {} is served in bf16; only the projections "
                                           "(q/k/v/o/gate/up/down_proj) carry FP8 parts",
                                           path, k, t.name));
      }
    }
  }
  if (!r.probes.empty() && r.rank != 0) {
    return InvalidArgument(fmt::format("probes: only rank 0 attaches probes to a version, rank {} sent {}", r.rank,
                                       r.probes.size()));
  }
  return refit::ValidateProbes(r.probes);
}

Result<bool> CheckPublish(const VersionMeta* meta, const PublishRequest& r) {
  if (meta == nullptr) return r.expected_ranks == 1;
  const std::string what = DescribeVersion(r.model, r.version);
  if (meta->released) {
    return FailedPrecondition(
        fmt::format("{} was released; rank {} cannot publish to it (a released label is not reused)", what, r.rank));
  }
  switch (meta->state) {
    case VersionState::kCommitted:
      return FailedPrecondition(fmt::format("{} is already COMMITTED (commit seq {}); rank {} cannot publish to it",
                                            what, meta->commit_seq, r.rank));
    case VersionState::kAbandoned:
      return FailedPrecondition(
          fmt::format("{} was ABANDONED ({}); rank {} cannot publish to it", what, meta->reason, r.rank));
    case VersionState::kUnavailable:
      return FailedPrecondition(fmt::format("{} is UNAVAILABLE (commit seq {}: {}); rank {} cannot publish to it",
                                            what, meta->commit_seq, meta->reason, r.rank));
    case VersionState::kStaging: break;
  }
  if (meta->expected_ranks != r.expected_ranks) {
    return FailedPrecondition(fmt::format(
        "{} expects {} ranks (set by its first publish), but rank {} declared expected_ranks {}", what,
        meta->expected_ranks, r.rank, r.expected_ranks));
  }
  const size_t after = meta->rank_leases.size() + (meta->rank_leases.count(r.rank) ? 0 : 1);
  return after == static_cast<size_t>(meta->expected_ranks);
}

Result<refit::Manifest> MergeRankTables(std::string_view model, std::string_view version, int32_t expected_ranks,
                                        const std::map<int32_t, const std::vector<refit::ShardTable>*>& by_rank,
                                        const std::vector<refit::Probe>& probes) {
  const std::string context = fmt::format("{} cannot commit", DescribeVersion(model, version));
  for (int32_t r = 0; r < expected_ranks; ++r) {
    if (!by_rank.count(r) || by_rank.at(r) == nullptr) {
      return Internal(fmt::format("{}: rank {} of {} has not published", context, r, expected_ranks));
    }
  }
  struct Merged {
    refit::ShardTable table;
    int32_t first_rank = 0;
  };
  std::map<std::string, Merged, std::less<>> merged;
  for (const auto& [rank, tables] : by_rank) {
    for (const refit::ShardTable& t : *tables) {
      auto it = merged.find(t.name);
      if (it == merged.end()) {
        Merged m;
        m.table = t;
        m.first_rank = rank;
        merged.emplace(t.name, std::move(m));
        continue;
      }
      refit::ShardTable& into = it->second.table;
      if (into.dtype != t.dtype || into.shape != t.shape) {
        return InvalidArgument(fmt::format("{}: tensor {}: rank {} publishes {} {} but rank {} publishes {} {}",
                                           context, t.name, it->second.first_rank, refit::DTypeName(into.dtype),
                                           refit::ShapeToString(into.shape), rank, refit::DTypeName(t.dtype),
                                           refit::ShapeToString(t.shape)));
      }
      into.shards.insert(into.shards.end(), t.shards.begin(), t.shards.end());
    }
  }
  if (merged.empty()) {
    // Such a version would commit and then fail every stage ("has no shards"), or worse be
    // installed as "nothing changed": refuse it at its last publish.
    return InvalidArgument(fmt::format("{}: tensors: none of its {} rank(s) published any tensor (a version needs at "
                                       "least one)",
                                       context, expected_ranks));
  }
  refit::Manifest m;
  m.model = std::string(model);
  m.version = std::string(version);
  m.expected_ranks = expected_ranks;
  m.tables.reserve(merged.size());
  for (auto& [name, entry] : merged) {
    refit::ShardTable& t = entry.table;
    std::stable_sort(t.shards.begin(), t.shards.end(), [](const refit::ShardInfo& a, const refit::ShardInfo& b) {
      return std::tie(a.rank, a.offset, a.shape) < std::tie(b.rank, b.offset, b.shape);
    });
    Status s = refit::ValidateShardTable(t, /*require_complete=*/true);
    if (!s.ok()) return s.WithContext(context);
    m.tables.push_back(std::move(t));
  }
  auto digests = refit::TensorDigestsFromShards(m);
  if (!digests.ok()) return digests.status().WithContext(context);
  m.content_digest = refit::CombineTensorDigests(*digests);
  // The trainer's FP8 parts (refit::ShardInfo::fp8) must add up to a whole image per quantization.
  for (const std::string& q : refit::PublishedFp8Quantizations(m)) {
    auto image = refit::PublishedFp8Image(m, q);
    if (!image.ok()) return image.status().WithContext(context);
  }
  Status ps = refit::ValidateProbes(probes);
  if (!ps.ok()) return ps.WithContext(context);
  m.probes = probes;
  return m;
}

Result<VersionState> ApplyMarkUnavailable(VersionMeta* meta, std::string_view model, std::string_view version,
                                          std::string_view reason) {
  if (reason.empty()) return InvalidArgument("reason: must not be empty");
  if (reason.size() > kMaxReasonLength) {
    return InvalidArgument(fmt::format("reason: {} bytes, at most {} allowed", reason.size(), kMaxReasonLength));
  }
  if (!IsValidUtf8(reason)) return InvalidArgument("reason: must be UTF-8");
  if (meta == nullptr || meta->released) return VersionNotFound(model, version);
  const VersionState before = meta->state;
  switch (before) {
    case VersionState::kCommitted: meta->state = VersionState::kUnavailable; break;
    case VersionState::kStaging: meta->state = VersionState::kAbandoned; break;
    case VersionState::kAbandoned:
    case VersionState::kUnavailable: return before;
  }
  meta->reason = std::string(reason);
  meta->rank_leases.clear();
  return before;
}

Status NotCommitted(std::string_view model, std::string_view version, const VersionMeta& meta) {
  const std::string what = DescribeVersion(model, version);
  switch (meta.state) {
    case VersionState::kAbandoned: return FailedPrecondition(fmt::format("{} is ABANDONED ({})", what, meta.reason));
    case VersionState::kUnavailable:
      return FailedPrecondition(fmt::format("{} is UNAVAILABLE (committed as seq {}, but {})", what, meta.commit_seq,
                                            meta.reason));
    case VersionState::kStaging:
    case VersionState::kCommitted: break;
  }
  return FailedPrecondition(fmt::format("{} is STAGING ({} of {} ranks published)", what, meta.rank_leases.size(),
                                        meta.expected_ranks));
}

std::string LeaseExpiredReason(int32_t rank, int64_t lease_id) {
  return fmt::format("the lease {} of rank {} expired before every rank had published", lease_id, rank);
}

VersionInfo MakeVersionInfo(std::string_view model, std::string_view version, const VersionMeta& meta) {
  VersionInfo info;
  info.model = std::string(model);
  info.version = std::string(version);
  info.state = meta.state;
  info.expected_ranks = meta.expected_ranks;
  if (meta.state == VersionState::kCommitted || meta.state == VersionState::kUnavailable) {
    for (int32_t r = 0; r < meta.expected_ranks; ++r) info.published_ranks.push_back(r);
  } else {
    for (const auto& [rank, lease] : meta.rank_leases) info.published_ranks.push_back(rank);
  }
  info.commit_seq = meta.commit_seq;
  info.content_digest = meta.content_digest;
  info.reason = meta.reason;
  return info;
}

void SortVersionInfos(std::vector<VersionInfo>* infos) {
  std::sort(infos->begin(), infos->end(), [](const VersionInfo& a, const VersionInfo& b) {
    const bool ca = a.state == VersionState::kCommitted, cb = b.state == VersionState::kCommitted;
    if (ca != cb) return ca;
    if (ca) return a.commit_seq < b.commit_seq;
    return a.version < b.version;
  });
}

Json TablesToJson(const std::vector<refit::ShardTable>& tables) {
  refit::Manifest m;
  m.tables = tables;
  return refit::ManifestToJson(m)["tensors"];
}

Json RankRowToJson(const PublishRequest& r) {
  if (r.probes.empty()) return TablesToJson(r.tables);
  return Json{{"tensors", TablesToJson(r.tables)}, {"probes", refit::ProbesToJson(r.probes)}};
}

Result<RankRow> RankRowFromJson(const Json& j) {
  RankRow row;
  if (j.is_array()) {
    RC_ASSIGN_OR_RETURN(row.tables, TablesFromJson(j));
    return row;
  }
  if (!j.is_object()) return InvalidArgument("rank row: expected an array or an object, got " + JsonTypeName(j));
  RC_RETURN_IF_ERROR(CheckKnownKeys(j, {"tensors", "probes"}, ""));
  auto t = j.find("tensors");
  if (t == j.end()) return InvalidArgument("tensors: required field is missing");
  RC_ASSIGN_OR_RETURN(row.tables, TablesFromJson(*t));
  if (auto p = j.find("probes"); p != j.end()) {
    RC_ASSIGN_OR_RETURN(row.probes, refit::ProbesFromJson(*p));
  }
  return row;
}

Result<std::vector<refit::ShardTable>> TablesFromJson(const Json& tensors) {
  if (!tensors.is_array()) return InvalidArgument("tensors: expected an array, got " + JsonTypeName(tensors));
  Json wrapper = Json::object();
  wrapper["tensors"] = tensors;
  RC_ASSIGN_OR_RETURN(refit::Manifest m, refit::ManifestFromJson(wrapper));
  return std::move(m.tables);
}

}  // namespace rc::directory::internal
