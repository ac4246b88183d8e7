// DirectoryStore: where trainer ranks publish shard tables and engines discover committed versions.
//
// Implementations: MemoryStore (one process), SqliteStore (a file; survives restarts; several
// processes may share one file), EtcdStore (etcd v3; the store for more than one host), and
// DirectoryClient (the same interface over the HTTP API of `rolloutcore directory serve`). Code
// that publishes or discovers takes a DirectoryStore& and works with any of them.
//
// Semantics every implementation keeps (tested by one conformance suite run against all):
// - The first publish of (model, version) creates it STAGING with expected_ranks N. Later
//   publishes must declare the same N (FailedPrecondition naming both numbers otherwise).
// - A rank that publishes again while STAGING replaces its tables. Publishing to a COMMITTED,
//   ABANDONED or released version is FailedPrecondition.
// - The publish that makes ranks 0..N-1 all present commits the version, exactly once and
//   atomically with respect to every other publish, lease expiry and commit of the same model:
//   per tensor the shards of all ranks are merged and must pass
//   refit::ValidateShardTable(require_complete=true) (replicas allowed), and replicas must agree
//   on their digests. If not, that publish is refused (InvalidArgument with refit's message naming
//   the tensor), is not stored, and the version stays STAGING (a rank may republish a fix).
// - A version with fewer than N ranks published is never committed.
// - Each publish lives under a lease. If the lease of any rank of a STAGING version expires, the
//   version becomes ABANDONED and can never commit. Leases do not matter after commit.
// - Commits get sequence numbers 1, 2, ... per model, in commit order, without gaps at commit
//   time. Committed versions are retained until released; released versions vanish from Get,
//   GetInfo, List and the commit feed (NotFound), and their label cannot be published again.
// - Commit is acknowledged only once it is durable in the store: Publish returns a COMMITTED
//   result after the SQLite transaction committed (WAL, synchronous=FULL) or the etcd txn
//   succeeded, never before. A caller whose Publish failed without a refusal (Unavailable,
//   DeadlineExceeded, Internal: the answer was lost) does not know the outcome and must ask
//   (GetInfo / Get) before it drops the memory it published; trainer::Publisher does.
// - A committed version whose sources are gone is marked UNAVAILABLE (MarkUnavailable), so
//   receivers are refused at once instead of failing every pull on dead handles.
//
// Thread safety: every method of every implementation may be called concurrently from any thread.
// WaitForCommits blocks only its caller.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/clock.h"
#include "rolloutcore/base/status.h"
#include "rolloutcore/directory/types.h"
#include "rolloutcore/refit/manifest.h"

namespace rc::directory {

class DirectoryStore {
 public:
  virtual ~DirectoryStore() = default;

  // Stores the rank's tables for (model, version) under a lease and commits the version when
  // this publish completes it (see the header comment).
  [[nodiscard]] virtual Result<PublishResult> Publish(const PublishRequest& request) = 0;

  // Restarts the lease's time to live. NotFound when the lease expired or never existed.
  [[nodiscard]] virtual Result<LeaseInfo> KeepAlive(int64_t lease_id) = 0;

  // The committed manifest: the merged shard tables of all ranks, tensors in name order, shards
  // ordered by rank then offset, content_digest combined from the per-tensor digests.
  // NotFound for unknown or released versions; FailedPrecondition naming the state otherwise.
  [[nodiscard]] virtual Result<refit::Manifest> Get(std::string_view model, std::string_view version) = 0;

  // The summary of a version in any state. NotFound for unknown or released versions.
  [[nodiscard]] virtual Result<VersionInfo> GetInfo(std::string_view model, std::string_view version) = 0;

  // Versions of a model that match `filter`: committed ones first in commit order, then the
  // others in label order. An unknown model has no versions (an empty list, not an error).
  [[nodiscard]] virtual Result<std::vector<VersionInfo>> List(std::string_view model,
                                                              StateFilter filter = StateFilter::kCommitted) = 0;

  // Commits of `model` with seq > after_seq that are still retained, in seq order. Blocks up to
  // timeout_ms of real time for the first one; an empty list means none arrived in time.
  // timeout_ms == 0 returns at once.
  [[nodiscard]] virtual Result<std::vector<CommitEvent>> WaitForCommits(std::string_view model, uint64_t after_seq,
                                                                       int64_t timeout_ms) = 0;

  // Drops a version in any state (a STAGING one is cancelled). NotFound when unknown or released.
  [[nodiscard]] virtual Status Release(std::string_view model, std::string_view version) = 0;

  // Records that the memory a version's shard tables name is gone (`reason` says whose and why,
  // 1..kMaxReasonLength bytes of UTF-8). The rule (docs/directory.md): a publisher that drops the
  // buffers of a version it published without releasing it calls this, and so may a reader that
  // proved the owner dead. COMMITTED becomes UNAVAILABLE (commit seq and digest kept; it leaves
  // the commit feed and the `committed` list; Get answers FailedPrecondition naming the reason);
  // STAGING becomes ABANDONED with the reason (it could only commit with dead handles). A version
  // already ABANDONED or UNAVAILABLE is left as it is (OK: every rank may report). NotFound when
  // unknown or released; InvalidArgument for a bad reason.
  [[nodiscard]] virtual Status MarkUnavailable(std::string_view model, std::string_view version,
                                               std::string_view reason) = 0;
};

// Blocks until (model, version) is COMMITTED and returns its commit event. FailedPrecondition when
// it is or becomes ABANDONED or UNAVAILABLE; DeadlineExceeded after timeout_ms of real time. A version that does
// not exist yet is waited for (its ranks may not have published).
[[nodiscard]] Result<CommitEvent> WaitForVersion(DirectoryStore& store, std::string_view model,
                                                 std::string_view version, int64_t timeout_ms);

// Opens a store from a spec:
//   memory               a MemoryStore
//   sqlite:PATH          a SqliteStore on PATH (created when missing)
//   etcd:URL             an EtcdStore at URL, e.g. etcd:http://127.0.0.1:2379 ; a path in the URL
//                        is the key prefix (default /rolloutcore): etcd:http://127.0.0.1:2379/team-a
// `clock` times leases of the memory and sqlite stores (nullptr: a wall clock, so that leases
// stored in SQLite keep their meaning across restarts); etcd times its own leases.
[[nodiscard]] Result<std::unique_ptr<DirectoryStore>> OpenDirectoryStore(std::string_view spec,
                                                                         Clock* clock = nullptr);

// A Clock that reads the wall clock (system_clock), for leases that must survive restarts.
Clock* WallClock();

}  // namespace rc::directory
