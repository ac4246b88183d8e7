#include "rolloutcore/lifecycle/journal.h"

#include <sqlite3.h>

#include <filesystem>

#include "rolloutcore/base/clock.h"
#include "rolloutcore/base/hash.h"
#include "rolloutcore/base/mutex.h"

namespace rc::lifecycle {

Json ToJson(const JournalRecord& r) {
  Json j{{"seq", r.seq}, {"t_ms", r.t_ms}, {"event", r.event}};
  j["from"] = r.from.empty() ? Json() : Json(r.from);
  j["to"] = r.to.empty() ? Json() : Json(r.to);
  j["update"] = r.update == 0 ? Json() : Json(r.update);
  j["rollout"] = r.rollout.empty() ? Json() : Json(r.rollout);
  j["detail"] = r.detail.is_null() ? Json::object() : r.detail;
  return j;
}

// ---- MemoryJournal ----

Status MemoryJournal::Append(JournalRecord& rec) {
  rc::MutexLock lock(mu_);
  if (fail_after_ == 0) return Unavailable("journal append failed (injected crash point)");
  if (fail_after_ > 0) --fail_after_;
  rec.seq = static_cast<int64_t>(records_.size()) + 1;
  if (rec.wall_ms == 0) rec.wall_ms = WallTimeMs();
  records_.push_back(rec);
  return OkStatus();
}

Result<std::vector<JournalRecord>> MemoryJournal::ReadSince(int64_t since) const {
  rc::MutexLock lock(mu_);
  std::vector<JournalRecord> out;
  for (const auto& r : records_) {
    if (r.seq > since) out.push_back(r);
  }
  return out;
}

void MemoryJournal::FailAfter(int64_t n) {
  rc::MutexLock lock(mu_);
  fail_after_ = n;
}

void MemoryJournal::Truncate(int64_t n) {
  rc::MutexLock lock(mu_);
  if (n >= 0 && static_cast<size_t>(n) < records_.size()) records_.resize(static_cast<size_t>(n));
}

size_t MemoryJournal::size() const {
  rc::MutexLock lock(mu_);
  return records_.size();
}

// ---- SqliteJournal ----

namespace {

sqlite3* Db(void* p) { return static_cast<sqlite3*>(p); }

Status Exec(sqlite3* db, const char* sql, const std::string& path) {
  char* err = nullptr;
  if (sqlite3_exec(db, sql, nullptr, nullptr, &err) != SQLITE_OK) {
    std::string msg = err ? err : "unknown error";
    sqlite3_free(err);
    return Internal("journal " + path + ": " + msg + " (in: " + sql + ")");
  }
  return OkStatus();
}

// The chain value of a record: xxHash3-64 of its stored fields, seeded with the previous
// record's chain value (0 before the first). Editing, deleting or reordering a record breaks the
// chain at that record and at every later one.
uint64_t ChainOf(uint64_t prev, const JournalRecord& r, const std::string& detail) {
  Hasher h(prev);
  auto add_int = [&](int64_t v) { h.Update(&v, sizeof v); };
  auto add_str = [&](const std::string& v) {
    add_int(static_cast<int64_t>(v.size()));
    h.Update(v.data(), v.size());
  };
  add_int(r.seq);
  add_int(r.t_ms);
  add_int(r.wall_ms);
  add_str(r.event);
  add_str(r.from);
  add_str(r.to);
  add_int(r.update);
  add_str(r.rollout);
  add_str(detail);
  return h.Digest();
}

Result<uint64_t> ParseChain(const std::string& hex, const std::string& where) {
  if (hex.size() != 16) return DataLoss(where + ": checksum '" + hex + "' is not 16 hex digits");
  uint64_t v = 0;
  for (char c : hex) {
    int d = (c >= '0' && c <= '9') ? c - '0' : (c >= 'a' && c <= 'f') ? c - 'a' + 10 : -1;
    if (d < 0) return DataLoss(where + ": checksum '" + hex + "' is not 16 hex digits");
    v = (v << 4) | static_cast<uint64_t>(d);
  }
  return v;
}

Status IntegrityCheck(sqlite3* db, const std::string& what) {
  sqlite3_stmt* st = nullptr;
  if (sqlite3_prepare_v2(db, "PRAGMA integrity_check", -1, &st, nullptr) != SQLITE_OK) {
    return DataLoss(what + " cannot be checked: " + sqlite3_errmsg(db));
  }
  std::string problems;
  int rc;
  while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
    const unsigned char* t = sqlite3_column_text(st, 0);
    std::string line = t ? reinterpret_cast<const char*>(t) : "";
    if (line != "ok") problems += (problems.empty() ? "" : "; ") + line;
  }
  sqlite3_finalize(st);
  if (rc != SQLITE_DONE) return DataLoss(what + " fails SQLite's integrity check: " + sqlite3_errmsg(db));
  if (!problems.empty()) return DataLoss(what + " fails SQLite's integrity check: " + problems.substr(0, 500));
  return OkStatus();
}

}  // namespace

Result<std::unique_ptr<SqliteJournal>> SqliteJournal::Open(const std::string& path, bool must_exist) {
  std::error_code ec;
  const bool existed = std::filesystem::exists(path, ec);
  if (must_exist) {
    if (!existed) return DataLoss("journal '" + path + "' is missing, but the state dir says it existed");
    if (std::filesystem::file_size(path, ec) == 0 || ec) {
      return DataLoss("journal '" + path + "' is empty (0 bytes), but the state dir says it held records");
    }
  }
  sqlite3* db = nullptr;
  const int flags = SQLITE_OPEN_READWRITE | SQLITE_OPEN_FULLMUTEX | (must_exist ? 0 : SQLITE_OPEN_CREATE);
  int rc = sqlite3_open_v2(path.c_str(), &db, flags, nullptr);
  if (rc != SQLITE_OK) {
    std::string msg = db ? sqlite3_errmsg(db) : "out of memory";
    sqlite3_close(db);
    return Unavailable("cannot open journal '" + path + "': " + msg);
  }
  std::unique_ptr<SqliteJournal> j(new SqliteJournal(db, path));
  if (existed) RC_RETURN_IF_ERROR(IntegrityCheck(db, "journal '" + path + "'"));
  RC_RETURN_IF_ERROR(Exec(db, "PRAGMA journal_mode=WAL", path));
  RC_RETURN_IF_ERROR(Exec(db, "PRAGMA synchronous=FULL", path));
  RC_RETURN_IF_ERROR(Exec(db,
                          "CREATE TABLE IF NOT EXISTS journal ("
                          " seq INTEGER PRIMARY KEY, t_ms INTEGER NOT NULL, wall_ms INTEGER NOT NULL,"
                          " event TEXT NOT NULL, from_state TEXT, to_state TEXT, update_ordinal INTEGER,"
                          " rollout TEXT, detail TEXT, chain TEXT)",
                          path));
  // Journals written before records were chained have no chain column: add it (their records
  // stay unchained, and are accepted only before the first chained one).
  bool has_chain = false;
  {
    sqlite3_stmt* st = nullptr;
    if (sqlite3_prepare_v2(db, "PRAGMA table_info(journal)", -1, &st, nullptr) != SQLITE_OK) {
      return Internal("journal " + path + ": " + sqlite3_errmsg(db));
    }
    while (sqlite3_step(st) == SQLITE_ROW) {
      const unsigned char* name = sqlite3_column_text(st, 1);
      if (name && std::string(reinterpret_cast<const char*>(name)) == "chain") has_chain = true;
    }
    sqlite3_finalize(st);
  }
  if (!has_chain) RC_RETURN_IF_ERROR(Exec(db, "ALTER TABLE journal ADD COLUMN chain TEXT", path));
  // Verifies every record's chain and learns the head for the next append.
  RC_ASSIGN_OR_RETURN(auto all, j->ReadSince(0));
  if (must_exist && all.empty()) {
    return DataLoss("journal '" + path + "' has no records, but the state dir says it held records");
  }
  return j;
}

SqliteJournal::~SqliteJournal() { sqlite3_close(Db(db_)); }

Status SqliteJournal::Append(JournalRecord& rec) {
  rc::MutexLock lock(mu_);
  if (rec.wall_ms == 0) rec.wall_ms = WallTimeMs();
  sqlite3_stmt* st = nullptr;
  const char* sql =
      "INSERT INTO journal (seq, t_ms, wall_ms, event, from_state, to_state, update_ordinal, rollout, detail, chain)"
      " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)";
  if (sqlite3_prepare_v2(Db(db_), sql, -1, &st, nullptr) != SQLITE_OK) {
    return Internal("journal " + path_ + ": prepare failed: " + sqlite3_errmsg(Db(db_)));
  }
  std::string detail = rec.detail.is_null() ? "{}" : rec.detail.dump();
  JournalRecord r = rec;
  r.seq = last_seq_ + 1;
  const uint64_t chain = ChainOf(head_, r, detail);
  const std::string chain_hex = Hex64(chain);
  sqlite3_bind_int64(st, 1, r.seq);
  sqlite3_bind_int64(st, 2, rec.t_ms);
  sqlite3_bind_int64(st, 3, rec.wall_ms);
  sqlite3_bind_text(st, 4, rec.event.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_text(st, 5, rec.from.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_text(st, 6, rec.to.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_int64(st, 7, rec.update);
  sqlite3_bind_text(st, 8, rec.rollout.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_text(st, 9, detail.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_text(st, 10, chain_hex.c_str(), -1, SQLITE_TRANSIENT);
  int rc = sqlite3_step(st);
  sqlite3_finalize(st);
  if (rc != SQLITE_DONE) {
    return Unavailable("journal " + path_ + ": append failed: " + sqlite3_errmsg(Db(db_)));
  }
  rec.seq = r.seq;
  last_seq_ = r.seq;
  head_ = chain;
  return OkStatus();
}

Result<std::vector<JournalRecord>> SqliteJournal::ReadSince(int64_t since) const {
  rc::MutexLock lock(mu_);
  sqlite3_stmt* st = nullptr;
  // From record `since` itself (verified when it was read or appended before): its chain value
  // seeds the check of every record returned. since = 0 checks the whole journal.
  const char* sql =
      "SELECT seq, t_ms, wall_ms, event, from_state, to_state, update_ordinal, rollout, detail, chain"
      " FROM journal WHERE seq >= ? ORDER BY seq";
  if (sqlite3_prepare_v2(Db(db_), sql, -1, &st, nullptr) != SQLITE_OK) {
    return Internal("journal " + path_ + ": prepare failed: " + sqlite3_errmsg(Db(db_)));
  }
  const int64_t first = since > 0 ? since : 1;
  sqlite3_bind_int64(st, 1, first);
  std::vector<JournalRecord> out;
  auto text = [&](int col) {
    const unsigned char* t = sqlite3_column_text(st, col);
    return t ? std::string(reinterpret_cast<const char*>(t)) : std::string();
  };
  uint64_t prev = 0;
  int64_t expected_seq = first;
  bool chained = false;
  int rc;
  while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
    JournalRecord r;
    r.seq = sqlite3_column_int64(st, 0);
    r.t_ms = sqlite3_column_int64(st, 1);
    r.wall_ms = sqlite3_column_int64(st, 2);
    r.event = text(3);
    r.from = text(4);
    r.to = text(5);
    r.update = sqlite3_column_int64(st, 6);
    r.rollout = text(7);
    const std::string detail_text = text(8);
    const bool has_chain = sqlite3_column_type(st, 9) != SQLITE_NULL;
    const std::string where = "journal " + path_ + " record " + std::to_string(r.seq);
    auto fail = [&](Status s) {
      sqlite3_finalize(st);
      return s;
    };
    if (r.seq != expected_seq) {
      return fail(DataLoss(where + ": expected record " + std::to_string(expected_seq) +
                           " here (records were deleted or renumbered)"));
    }
    ++expected_seq;
    if (r.seq == since) {  // the seed, not returned
      if (has_chain) {
        auto stored = ParseChain(text(9), where);
        if (!stored.ok()) return fail(stored.status());
        prev = *stored;
        chained = true;
      }
      continue;
    }
    if (has_chain) {
      auto stored = ParseChain(text(9), where);
      if (!stored.ok()) return fail(stored.status());
      const uint64_t want = ChainOf(prev, r, detail_text);
      if (*stored != want) {
        return fail(DataLoss(where + ": checksum mismatch (stored " + text(9) + ", computed " + Hex64(want) +
                             "): the record, or one before it, was changed after it was written"));
      }
      prev = want;
      chained = true;
    } else if (chained) {
      return fail(DataLoss(where + ": has no checksum but follows checksummed records (it was changed)"));
    }
    auto detail = ParseJson(detail_text, "journal detail");
    if (!detail.ok()) return fail(DataLoss(where + ": " + detail.status().message()));
    r.detail = std::move(detail).value();
    out.push_back(std::move(r));
  }
  sqlite3_finalize(st);
  if (rc != SQLITE_DONE) return DataLoss("journal " + path_ + ": read failed: " + sqlite3_errmsg(Db(db_)));
  if (since == 0) {
    head_ = prev;
    last_seq_ = expected_seq - 1;
  }
  return out;
}

}  // namespace rc::lifecycle
