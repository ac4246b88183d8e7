// EtcdStore: a DirectoryStore in etcd (v3 API through its JSON gateway, /v3/... on the client URL).
//
// Key layout under the prefix P (default /rolloutcore), model M, version V:
//   P/M/seq                 last commit sequence number of M (decimal)
//   P/M/meta/V              version record: state, expected_ranks, rank -> lease, commit seq,
//                           content digest, reason (JSON; no lease)
//   P/M/ranks/V/R           shard tables rank R published (JSON; attached to the rank's lease,
//                           so etcd deletes it when the lease expires)
//   P/M/manifest/V          merged manifest of a committed version (JSON; no lease)
//   P/M/commits/SEQ         commit feed entry, SEQ zero-padded to 20 digits (JSON; no lease)
//
// Atomicity: every change is one etcd txn whose compares pin what the decision was based on. A
// publish compares the mod_revision of meta/V (every publish, commit, abandonment and release
// rewrites it); the committing publish also compares the mod_revision of every other rank's key
// (a key deleted by lease expiry fails the compare) and of P/M/seq (so two versions committing
// concurrently get distinct, consecutive sequence numbers). A failed compare re-reads and retries.
// The commit txn has expected_ranks + 2 compares, so more than ~120 ranks need etcd's
// --max-txn-ops raised; the manifest must fit --max-request-bytes (1.5 MiB by default).
//
// Leases are etcd leases with whole-second TTLs (a publish's lease_ttl_ms is rounded up). Expiry is
// observed lazily: any call that reads a STAGING version whose meta lists a rank whose key is gone
// marks it ABANDONED (one txn) before answering.
//
// Watching: WaitForCommits polls the commit feed (a range read from P/M/commits/after+1) every
// poll_interval_ms; it does not use etcd's streaming watch.
//
// Thread safety: all methods may be called from any thread; each etcd request uses its own
// connection and all coordination is done by etcd's txns, so several stores (processes, hosts) may
// share one etcd and prefix.
#pragma once

#include <memory>
#include <string>

#include "rolloutcore/directory/store.h"

namespace rc::directory {

struct EtcdStoreOptions {
  // "http://127.0.0.1:2379", or the members of one cluster comma-separated; requests fail over
  // to the next member when one does not answer (etcd_client.h, docs/directory.md).
  std::string endpoint;
  std::string prefix = "/rolloutcore";
  int64_t request_timeout_ms = 5'000;  // one attempt at one member; failover may take twice that
  int64_t poll_interval_ms = 50;
  int max_txn_attempts = 200;  // optimistic retries under contention before Aborted
};

// Connects (checks /health) and returns the store. Unavailable naming the endpoint when etcd does
// not answer.
[[nodiscard]] Result<std::unique_ptr<DirectoryStore>> OpenEtcdStore(const EtcdStoreOptions& options);

}  // namespace rc::directory
