// SqliteStore: a DirectoryStore in one SQLite file, so committed versions survive a directory
// restart. Several stores (in one or several processes) may open the same file: every call runs
// in one `BEGIN IMMEDIATE` transaction (WAL mode, busy timeout), so publishes, lease expiry and
// commits are serialized by SQLite itself and a commit is atomic across all of them.
//
// Leases are timed by the injected Clock and stored as that clock's milliseconds; serving uses the
// wall clock so a restart does not change their meaning. Expiry is applied lazily inside each
// call's transaction, before anything else. WaitForCommits polls the file every poll_interval_ms
// (commits by another process are seen that way) and wakes at once on commits made through this
// instance.
//
// Thread safety: all methods may be called from any thread; one mutex guards the connection.
#pragma once

#include <memory>
#include <string>

#include "rolloutcore/base/clock.h"
#include "rolloutcore/directory/store.h"

namespace rc::directory {

struct SqliteStoreOptions {
  int64_t busy_timeout_ms = 10'000;
  int64_t poll_interval_ms = 50;
};

// Opens (creating when missing) the store in the file at `path`. `clock` must outlive the store.
[[nodiscard]] Result<std::unique_ptr<DirectoryStore>> OpenSqliteStore(const std::string& path, Clock* clock,
                                                                      const SqliteStoreOptions& options = {});

}  // namespace rc::directory
