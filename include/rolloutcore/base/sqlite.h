// SQLite RAII: one owner of a connection (Database) and of a prepared statement (Statement), the
// one wrapper the SQLite-backed stores use (directory store, lifecycle journal, trajectory store).
//
// Errors name the database and the statement: "sqlite 'path': no such table: t (in: SELECT ...)".
// Busy or locked databases answer Unavailable (retry later); everything else Internal; the
// callers re-code where a failure means more (a failed read of a checksummed row is DataLoss).
//
// A Statement keeps the first error it met (prepare, bind or step): Bind calls chain, Step()
// answers false once an error happened, and status() reports it, so a caller checks once.
//
// Thread safety: a Database is opened with SQLITE_OPEN_FULLMUTEX or _NOMUTEX as the caller asks
// (OpenOptions::serialized); a Statement belongs to one thread and must not outlive its Database.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "rolloutcore/base/status.h"

struct sqlite3;
struct sqlite3_stmt;

namespace rc::sqlite {

struct OpenOptions {
  bool create = true;            // SQLITE_OPEN_CREATE
  bool serialized = true;        // SQLITE_OPEN_FULLMUTEX (else _NOMUTEX: the caller serializes)
  int64_t busy_timeout_ms = -1;  // sqlite3_busy_timeout when >= 0
};

class Database {
 public:
  // Opens (and with create, creates) the database file at `path`; Unavailable naming `what`
  // ("journal", "trajectory store") and the path when it cannot be opened.
  [[nodiscard]] static Result<Database> Open(const std::string& path, std::string_view what, OpenOptions options = {});
  // Opens a state file (a journal, a trajectory store) that the caller's state dir says was
  // written before (must_exist) or not. With must_exist a missing or empty (0 bytes) file is
  // DataLoss and nothing is created; a file that existed must pass SQLite's integrity check
  // (DataLoss otherwise). Messages name `what` and the path: "journal '/s/j.db' is empty (0
  // bytes), but the state dir says it existed".
  [[nodiscard]] static Result<Database> OpenStateFile(const std::string& path, std::string_view what, bool must_exist);

  // Move-only: the declared moves delete the copies, so one Database closes each connection.
  Database() = default;
  ~Database();
  Database(Database&& other) noexcept;
  Database& operator=(Database&& other) noexcept;

  // Runs one or more statements that return no rows.
  [[nodiscard]] Status Exec(std::string_view sql) const;
  // PRAGMA integrity_check: DataLoss listing what SQLite found (the first 500 characters).
  [[nodiscard]] Status IntegrityCheck() const;
  // Whether `table` exists / has a column named `column`.
  [[nodiscard]] Result<bool> HasTable(std::string_view table) const;
  [[nodiscard]] Result<bool> HasColumn(std::string_view table, std::string_view column) const;
  // sqlite3_errmsg of the connection.
  std::string ErrorMessage() const;

  sqlite3* handle() const { return db_; }
  const std::string& path() const { return path_; }
  bool is_open() const { return db_ != nullptr; }

 private:
  sqlite3* db_ = nullptr;
  std::string path_;
};

class Statement {
 public:
  Statement(const Database& db, std::string_view sql) : Statement(db.handle(), sql, db.path()) {}
  Statement(sqlite3* db, std::string_view sql, std::string path = "");
  ~Statement();
  Statement(const Statement&) = delete;
  Statement& operator=(const Statement&) = delete;

  // Parameters are 1-based; text is copied.
  Statement& Bind(int i, std::string_view text);
  Statement& Bind(int i, int64_t v);
  // Steps once: true with a row, false when done or after an error (see status()).
  bool Step();
  // Steps until done; the statement's status.
  [[nodiscard]] Status Run();
  // Makes a prepared statement ready to run again (sqlite3_reset, bindings cleared), so a caller
  // that runs the same SQL often prepares it once. Clears a bind or step error; a prepare error
  // stays (the statement cannot run).
  void Reset();
  // OK, or the first error: "sqlite 'path': message (in: sql)"; Unavailable when busy or locked.
  [[nodiscard]] Status status() const;

  // Columns of the current row (0-based).
  int64_t Int(int col) const;
  std::string Text(int col) const;
  bool IsNull(int col) const;

 private:
  sqlite3* db_;
  sqlite3_stmt* stmt_ = nullptr;
  std::string sql_;
  std::string path_;
  int rc_;
  std::string error_;  // sqlite3_errmsg when rc_ turned into an error
};

// Exec on a raw connection (for code that does not own its connection through Database).
[[nodiscard]] Status Exec(sqlite3* db, std::string_view sql, std::string_view path = "");

}  // namespace rc::sqlite
