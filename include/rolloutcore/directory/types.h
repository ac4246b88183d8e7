// Vocabulary of the directory: version states, publish requests and results, leases, version
// summaries and commit events.
//
// A *version* (model, version label) is created by the first rank that publishes to it and moves
// through states:
//
//   STAGING ──(every rank 0..N-1 published, merged shards valid)──► COMMITTED ──(sources gone)──► UNAVAILABLE
//      └──(a publishing rank's lease expired, or its sources are gone)──► ABANDONED
//   any state ──(release)──► released (a tombstone: gone from get/list, refuses publishes)
//
// UNAVAILABLE: the version was committed (it keeps its commit seq and digest, so records naming it
// stay meaningful) but the memory its shard tables name is gone (a publisher released it, or a
// reader proved its owner dead): Get refuses it, it left the commit feed and the `committed` list,
// and it never becomes COMMITTED again (see MarkUnavailable in store.h).
//
// N (`expected_ranks`) is fixed by the first publish. Each committed version gets a commit
// sequence number, 1, 2, 3, ... per model, in commit order; watchers wait for sequence numbers.
//
// Names: model names and version labels are 1..128 characters from [A-Za-z0-9._+@:=-], starting
// with a letter or digit. They appear verbatim in URLs and etcd keys, so no escaping is needed
// anywhere ("Qwen/Qwen3-8B" must be spelled e.g. "Qwen--Qwen3-8B").
//
// Thread safety: values and pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/status.h"
#include "rolloutcore/refit/manifest.h"

namespace rc::directory {

enum class VersionState {
  kStaging,
  kCommitted,
  kAbandoned,
  kUnavailable,
};

// "STAGING", "COMMITTED", "ABANDONED", "UNAVAILABLE".
std::string_view VersionStateName(VersionState state);
// Accepts the names above case-insensitively; InvalidArgument naming the text otherwise.
[[nodiscard]] Result<VersionState> ParseVersionState(std::string_view text);

inline constexpr size_t kMaxNameLength = 128;
// Longest tensor name a publish may carry (Hugging Face names are well under 200 characters).
inline constexpr size_t kMaxTensorNameLength = 1024;
// Longest lease a publish may ask for (one day); leases are meant to be kept alive.
inline constexpr int64_t kMaxLeaseTtlMs = int64_t{24} * 3600 * 1000;
// Most ranks one version may expect.
inline constexpr int32_t kMaxExpectedRanks = 65536;
// Longest reason MarkUnavailable records.
inline constexpr size_t kMaxReasonLength = 1024;

// InvalidArgument "WHAT: ..." unless `name` follows the naming rule in the header comment.
[[nodiscard]] Status ValidateName(std::string_view name, std::string_view what);

// What one trainer rank publishes for one version: the shard tables of the tensors it owns.
// Every shard in `tables` must carry rank == `rank`.
struct PublishRequest {
  std::string model;
  std::string version;
  int32_t rank = 0;
  int32_t expected_ranks = 0;  // N; ranks are 0..N-1
  // 0: grant a new lease of lease_ttl_ms. Otherwise attach the publish to this live lease (a rank
  // may keep one lease alive across versions); lease_ttl_ms is then ignored.
  int64_t lease_id = 0;
  int64_t lease_ttl_ms = 0;
  std::vector<refit::ShardTable> tables;
  // Replay probes of the version (refit/probes.h). Only rank 0 may attach them; the committed
  // manifest carries rank 0's. Empty: the version has none.
  std::vector<refit::Probe> probes;
  // The content digest algorithm the shard digests were computed with (the body's "digest"
  // field). Only refit::kDigestAlgorithm is accepted: a publisher built against another algorithm
  // (or one that does not say) is refused before its tables are stored, instead of committing
  // digests no receiver can match.
  std::string digest_algorithm = std::string(refit::kDigestAlgorithm);
};

struct PublishResult {
  VersionState state = VersionState::kStaging;  // after this publish
  int32_t ranks_published = 0;
  int32_t expected_ranks = 0;
  int64_t lease_id = 0;      // the lease this rank's table lives under
  int64_t lease_ttl_ms = 0;  // its time to live (as granted: etcd rounds up to whole seconds)
  uint64_t commit_seq = 0;   // when this publish committed the version
  uint64_t content_digest = 0;  // when committed
};

struct LeaseInfo {
  int64_t lease_id = 0;
  int64_t ttl_ms = 0;  // the lease's full time to live, restarted by the keepalive
};

// A summary of one version in any state (no shard tables).
struct VersionInfo {
  std::string model;
  std::string version;
  VersionState state = VersionState::kStaging;
  int32_t expected_ranks = 0;
  std::vector<int32_t> published_ranks;  // ascending; all 0..N-1 once committed
  uint64_t commit_seq = 0;               // 0 unless committed
  uint64_t content_digest = 0;           // 0 unless committed
  std::string reason;                    // why it was abandoned or made unavailable
};

// A commit, as seen by a watcher.
struct CommitEvent {
  std::string model;
  std::string version;
  uint64_t seq = 0;
  uint64_t content_digest = 0;
};

// Which versions List returns.
enum class StateFilter {
  kCommitted,
  kStaging,
  kAbandoned,
  kUnavailable,
  kAll,
};
// "committed", "staging", "abandoned", "unavailable", "all".
std::string_view StateFilterName(StateFilter filter);
[[nodiscard]] Result<StateFilter> ParseStateFilter(std::string_view text);
bool FilterMatches(StateFilter filter, VersionState state);

}  // namespace rc::directory
