#include "rolloutcore/lifecycle/journal.h"

#include <sqlite3.h>

#include "rolloutcore/base/clock.h"

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
  std::lock_guard<std::mutex> lock(mu_);
  if (fail_after_ == 0) return Unavailable("journal append failed (injected crash point)");
  if (fail_after_ > 0) --fail_after_;
  rec.seq = static_cast<int64_t>(records_.size()) + 1;
  if (rec.wall_ms == 0) rec.wall_ms = WallTimeMs();
  records_.push_back(rec);
  return OkStatus();
}

Result<std::vector<JournalRecord>> MemoryJournal::ReadSince(int64_t since) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<JournalRecord> out;
  for (const auto& r : records_) {
    if (r.seq > since) out.push_back(r);
  }
  return out;
}

void MemoryJournal::FailAfter(int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  fail_after_ = n;
}

void MemoryJournal::Truncate(int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  if (n >= 0 && static_cast<size_t>(n) < records_.size()) records_.resize(static_cast<size_t>(n));
}

size_t MemoryJournal::size() const {
  std::lock_guard<std::mutex> lock(mu_);
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

}  // namespace

Result<std::unique_ptr<SqliteJournal>> SqliteJournal::Open(const std::string& path) {
  sqlite3* db = nullptr;
  int rc = sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX,
                           nullptr);
  if (rc != SQLITE_OK) {
    std::string msg = db ? sqlite3_errmsg(db) : "out of memory";
    sqlite3_close(db);
    return Unavailable("cannot open journal '" + path + "': " + msg);
  }
  std::unique_ptr<SqliteJournal> j(new SqliteJournal(db, path));
  RC_RETURN_IF_ERROR(Exec(db, "PRAGMA journal_mode=WAL", path));
  RC_RETURN_IF_ERROR(Exec(db, "PRAGMA synchronous=FULL", path));
  RC_RETURN_IF_ERROR(Exec(db,
                          "CREATE TABLE IF NOT EXISTS journal ("
                          " seq INTEGER PRIMARY KEY, t_ms INTEGER NOT NULL, wall_ms INTEGER NOT NULL,"
                          " event TEXT NOT NULL, from_state TEXT, to_state TEXT, update_ordinal INTEGER,"
                          " rollout TEXT, detail TEXT)",
                          path));
  return j;
}

SqliteJournal::~SqliteJournal() { sqlite3_close(Db(db_)); }

Status SqliteJournal::Append(JournalRecord& rec) {
  std::lock_guard<std::mutex> lock(mu_);
  if (rec.wall_ms == 0) rec.wall_ms = WallTimeMs();
  sqlite3_stmt* st = nullptr;
  const char* sql =
      "INSERT INTO journal (t_ms, wall_ms, event, from_state, to_state, update_ordinal, rollout, detail)"
      " VALUES (?, ?, ?, ?, ?, ?, ?, ?)";
  if (sqlite3_prepare_v2(Db(db_), sql, -1, &st, nullptr) != SQLITE_OK) {
    return Internal("journal " + path_ + ": prepare failed: " + sqlite3_errmsg(Db(db_)));
  }
  std::string detail = rec.detail.is_null() ? "{}" : rec.detail.dump();
  sqlite3_bind_int64(st, 1, rec.t_ms);
  sqlite3_bind_int64(st, 2, rec.wall_ms);
  sqlite3_bind_text(st, 3, rec.event.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_text(st, 4, rec.from.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_text(st, 5, rec.to.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_int64(st, 6, rec.update);
  sqlite3_bind_text(st, 7, rec.rollout.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_text(st, 8, detail.c_str(), -1, SQLITE_TRANSIENT);
  int rc = sqlite3_step(st);
  sqlite3_finalize(st);
  if (rc != SQLITE_DONE) {
    return Unavailable("journal " + path_ + ": append failed: " + sqlite3_errmsg(Db(db_)));
  }
  rec.seq = sqlite3_last_insert_rowid(Db(db_));
  return OkStatus();
}

Result<std::vector<JournalRecord>> SqliteJournal::ReadSince(int64_t since) const {
  std::lock_guard<std::mutex> lock(mu_);
  sqlite3_stmt* st = nullptr;
  const char* sql =
      "SELECT seq, t_ms, wall_ms, event, from_state, to_state, update_ordinal, rollout, detail"
      " FROM journal WHERE seq > ? ORDER BY seq";
  if (sqlite3_prepare_v2(Db(db_), sql, -1, &st, nullptr) != SQLITE_OK) {
    return Internal("journal " + path_ + ": prepare failed: " + sqlite3_errmsg(Db(db_)));
  }
  sqlite3_bind_int64(st, 1, since);
  std::vector<JournalRecord> out;
  auto text = [&](int col) {
    const unsigned char* t = sqlite3_column_text(st, col);
    return t ? std::string(reinterpret_cast<const char*>(t)) : std::string();
  };
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
    auto detail = ParseJson(text(8), "journal detail");
    if (!detail.ok()) {
      sqlite3_finalize(st);
      return DataLoss("journal " + path_ + " record " + std::to_string(r.seq) + ": " + detail.status().message());
    }
    r.detail = std::move(detail).value();
    out.push_back(std::move(r));
  }
  sqlite3_finalize(st);
  if (rc != SQLITE_DONE) return Internal("journal " + path_ + ": read failed: " + sqlite3_errmsg(Db(db_)));
  return out;
}

}  // namespace rc::lifecycle
