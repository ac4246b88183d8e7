// Journal: the durable, append-only record of every lifecycle transition, admission and finish.
//
// The Controller appends a record — and the journal has synced it — BEFORE the effect becomes
// visible (a state change, a binding handed out). A restarted controller rebuilds its state from
// the records alone (Controller::Open).
//
// Implementations: SqliteJournal (SQLite in WAL mode with synchronous=FULL: durable across
// process death and power loss as far as the filesystem honours fsync) and MemoryJournal (tests,
// and the simulator; it survives a simulated controller crash because it outlives the
// Controller object, and can inject a failure after N appends to simulate a crash at any point).
//
// Thread safety: Append and Read* may be called from any thread; appends are serialized and
// seq numbers are dense and increasing from 1.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "rolloutcore/base/json.h"
#include "rolloutcore/base/sqlite.h"
#include "rolloutcore/base/status.h"
#include "rolloutcore/base/mutex.h"

namespace rc::lifecycle {

struct JournalRecord {
  int64_t seq = 0;       // assigned by Append
  int64_t t_ms = 0;      // the controller clock's time (monotonic; virtual in the simulator)
  int64_t wall_ms = 0;   // wall-clock time, for people
  std::string event;     // e.g. "request_update", "admit", "finish", "interrupted", "restart"
  std::string from;      // state before (transitions only)
  std::string to;        // state after (transitions only)
  int64_t update = 0;    // update ordinal, 0 when none
  std::string rollout;   // rollout id, empty when none
  Json detail;           // event-specific evidence (object)
};

Json ToJson(const JournalRecord& r);

// What appending cost so far (bench cycle reports it per cycle): records appended and the wall
// time spent inside Append (for SqliteJournal: statement, commit and the WAL fsync).
struct JournalAppendInterval {
  std::chrono::steady_clock::time_point start, end;  // one commit, from BEGIN to the synced COMMIT
};
struct JournalAppendStats {
  int64_t appends = 0;  // records
  int64_t syncs = 0;    // commits (a batch is one)
  double append_ms = 0;
  // The last kRecentAppendIntervals commits, oldest first (bench cycle: which of them the update's
  // critical path waited for, and which ran while an engine call was in flight anyway).
  std::vector<JournalAppendInterval> recent;
};
inline constexpr size_t kRecentAppendIntervals = 64;

class Journal {
 public:
  virtual ~Journal() = default;
  // Totals since the journal was opened; zeros for an implementation that does not count.
  virtual JournalAppendStats append_stats() const { return {}; }
  // Durably appends; assigns rec.seq. On error nothing was appended.
  virtual Status Append(JournalRecord& rec) = 0;
  // Group commit: durably appends every record of `recs`, in order, as one unit with one sync
  // (SqliteJournal: one transaction); assigns their seqs. After a crash the journal holds all of
  // them or none. On error nothing was appended.
  virtual Status AppendBatch(const std::vector<JournalRecord*>& recs) = 0;
  // Records with seq > since, in order.
  virtual Result<std::vector<JournalRecord>> ReadSince(int64_t since) const = 0;
  Result<std::vector<JournalRecord>> ReadAll() const { return ReadSince(0); }
};

class MemoryJournal final : public Journal {
 public:
  Status Append(JournalRecord& rec) override;
  // All or nothing: a batch that reaches the FailAfter crash point appends none of its records
  // (the crash happened before its one sync), and every later append fails too.
  Status AppendBatch(const std::vector<JournalRecord*>& recs) override;
  // Calls of Append and AppendBatch that appended (a batch counts once: one sync).
  int64_t syncs() const;
  Result<std::vector<JournalRecord>> ReadSince(int64_t since) const override;
  // After `n` more successful appends, every Append fails with Unavailable (a crash point).
  // Negative: never fail.
  void FailAfter(int64_t n);
  // Keeps only the first n records (what a crash after record n leaves behind).
  void Truncate(int64_t n);
  size_t size() const;

 private:
  mutable rc::Mutex mu_;
  std::vector<JournalRecord> records_ GUARDED_BY(mu_);  // guarded by mu_
  int64_t fail_after_ GUARDED_BY(mu_) = -1;             // guarded by mu_
  int64_t syncs_ GUARDED_BY(mu_) = 0;                   // guarded by mu_
};

// Every record carries a checksum chained over all records before it (xxHash3-64 of its
// stored fields seeded with the previous record's): Open and every read verify the whole chain,
// so a record edited, deleted or renumbered after it was written is DataLoss naming the file and
// the record, never a state to restore from. (It detects damage and careless edits; it is not a
// signature — someone who can run this code can rewrite a consistent chain.) Open also runs
// SQLite's integrity check on an existing file.
//
// Cost of an append: one commit, one fdatasync of the WAL (synchronous=FULL); the BEGIN, INSERT
// and COMMIT statements are prepared once at Open, not parsed again per append. Open reserves the
// WAL's first 1 MiB (256 pages written and checkpointed with RESTART; automatic checkpoints at
// 256 pages), so commits overwrite WAL bytes that exist instead of growing the file: the same
// fdatasync, with no file size change for the filesystem to commit as well.
class SqliteJournal final : public Journal {
 public:
  // Opens (creating if needed) the journal database at `path`. must_exist: the state dir says
  // the journal was written before, so a missing, empty (0 bytes or no records) or damaged file
  // is DataLoss, not a fresh journal.
  static Result<std::unique_ptr<SqliteJournal>> Open(const std::string& path, bool must_exist = false);
  ~SqliteJournal() override;
  Status Append(JournalRecord& rec) override;
  Status AppendBatch(const std::vector<JournalRecord*>& recs) override;
  Result<std::vector<JournalRecord>> ReadSince(int64_t since) const override;
  JournalAppendStats append_stats() const override;
  const std::string& path() const { return path_; }

 private:
  SqliteJournal(sqlite::Database db, std::string path) : db_(std::move(db)), path_(std::move(path)) {}
  mutable rc::Mutex mu_;
  sqlite::Database db_ GUARDED_BY(mu_);
  std::string path_;
  // The last record's seq and chain value, learned by the verifying read in Open.
  mutable int64_t last_seq_ GUARDED_BY(mu_) = 0;  // guarded by mu_
  mutable uint64_t head_ GUARDED_BY(mu_) = 0;     // guarded by mu_
  JournalAppendStats stats_ GUARDED_BY(mu_);      // guarded by mu_
  // The append path's statements, prepared once at Open (an append runs these three and nothing
  // else); declared after db_ so they are finalized before it closes.
  std::unique_ptr<sqlite::Statement> begin_ GUARDED_BY(mu_);   // BEGIN IMMEDIATE
  std::unique_ptr<sqlite::Statement> insert_ GUARDED_BY(mu_);  // INSERT INTO journal ...
  std::unique_ptr<sqlite::Statement> commit_ GUARDED_BY(mu_);  // COMMIT
};

}  // namespace rc::lifecycle
