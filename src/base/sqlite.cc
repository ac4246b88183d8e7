#include "rolloutcore/base/sqlite.h"

#include <fmt/format.h>
#include <sqlite3.h>

#include <filesystem>
#include <utility>

namespace rc::sqlite {
namespace {

std::string Where(std::string_view path) { return path.empty() ? "sqlite" : fmt::format("sqlite '{}'", path); }

Status Error(int rc, std::string_view path, std::string_view message, std::string_view sql) {
  std::string msg = fmt::format("{}: {} (in: {})", Where(path), message, sql);
  const int primary = rc & 0xff;
  if (primary == SQLITE_BUSY || primary == SQLITE_LOCKED) return Unavailable(std::move(msg));
  return Internal(std::move(msg));
}

bool IsError(int rc) { return rc != SQLITE_OK && rc != SQLITE_ROW && rc != SQLITE_DONE; }

}  // namespace

Result<Database> Database::Open(const std::string& path, std::string_view what, OpenOptions options) {
  sqlite3* db = nullptr;
  const int flags = SQLITE_OPEN_READWRITE | (options.create ? SQLITE_OPEN_CREATE : 0) |
                    (options.serialized ? SQLITE_OPEN_FULLMUTEX : SQLITE_OPEN_NOMUTEX);
  const int rc = sqlite3_open_v2(path.c_str(), &db, flags, nullptr);
  if (rc != SQLITE_OK) {
    std::string msg = fmt::format("cannot open {} '{}': {}", what, path, db ? sqlite3_errmsg(db) : sqlite3_errstr(rc));
    sqlite3_close(db);
    return Unavailable(std::move(msg));
  }
  if (options.busy_timeout_ms >= 0) sqlite3_busy_timeout(db, static_cast<int>(options.busy_timeout_ms));
  Database d;
  d.db_ = db;
  d.path_ = path;
  return d;
}

Result<Database> Database::OpenStateFile(const std::string& path, std::string_view what, bool must_exist) {
  std::error_code ec;
  const bool existed = std::filesystem::exists(path, ec);
  if (must_exist) {
    if (!existed) return DataLoss(fmt::format("{} '{}' is missing, but the state dir says it existed", what, path));
    if (std::filesystem::file_size(path, ec) == 0 || ec) {
      return DataLoss(fmt::format("{} '{}' is empty (0 bytes), but the state dir says it existed", what, path));
    }
  }
  RC_ASSIGN_OR_RETURN(Database db, Open(path, what, {.create = !must_exist}));
  if (existed) {
    Status check = db.IntegrityCheck();
    if (!check.ok()) return DataLoss(fmt::format("{} '{}' {}", what, path, check.message()));
  }
  return db;
}

Database::~Database() {
  if (db_ != nullptr) sqlite3_close(db_);
}

Database::Database(Database&& other) noexcept
    : db_(std::exchange(other.db_, nullptr)), path_(std::move(other.path_)) {}

Database& Database::operator=(Database&& other) noexcept {
  if (this != &other) {
    if (db_ != nullptr) sqlite3_close(db_);
    db_ = std::exchange(other.db_, nullptr);
    path_ = std::move(other.path_);
  }
  return *this;
}

Status Database::Exec(std::string_view sql) const { return sqlite::Exec(db_, sql, path_); }

std::string Database::ErrorMessage() const { return db_ ? sqlite3_errmsg(db_) : "database not open"; }

Status Database::IntegrityCheck() const {
  Statement st(*this, "PRAGMA integrity_check");
  std::string problems;
  while (st.Step()) {
    const std::string line = st.Text(0);
    if (line != "ok") problems += (problems.empty() ? "" : "; ") + line;
  }
  if (!st.status().ok()) return DataLoss("fails SQLite's integrity check: " + st.status().message());
  if (!problems.empty()) return DataLoss("fails SQLite's integrity check: " + problems.substr(0, 500));
  return OkStatus();
}

Result<bool> Database::HasTable(std::string_view table) const {
  Statement st(*this, "SELECT 1 FROM sqlite_master WHERE type='table' AND name=?");
  st.Bind(1, table);
  const bool found = st.Step();
  RC_RETURN_IF_ERROR(st.status());
  return found;
}

Result<bool> Database::HasColumn(std::string_view table, std::string_view column) const {
  Statement st(*this, fmt::format("PRAGMA table_info({})", table));
  bool found = false;
  while (st.Step()) found |= st.Text(1) == column;
  RC_RETURN_IF_ERROR(st.status());
  return found;
}

Statement::Statement(sqlite3* db, std::string_view sql, std::string path)
    : db_(db), sql_(sql), path_(std::move(path)) {
  rc_ = sqlite3_prepare_v2(db, sql_.c_str(), static_cast<int>(sql_.size()), &stmt_, nullptr);
  if (rc_ != SQLITE_OK) error_ = sqlite3_errmsg(db);
}

Statement::~Statement() { sqlite3_finalize(stmt_); }

Statement& Statement::Bind(int i, std::string_view text) {
  if (!IsError(rc_)) {
    rc_ = sqlite3_bind_text(stmt_, i, text.data(), static_cast<int>(text.size()), SQLITE_TRANSIENT);
    if (rc_ != SQLITE_OK) error_ = fmt::format("binding parameter {}: {}", i, sqlite3_errmsg(db_));
  }
  return *this;
}

Statement& Statement::Bind(int i, int64_t v) {
  if (!IsError(rc_)) {
    rc_ = sqlite3_bind_int64(stmt_, i, v);
    if (rc_ != SQLITE_OK) error_ = fmt::format("binding parameter {}: {}", i, sqlite3_errmsg(db_));
  }
  return *this;
}

bool Statement::Step() {
  if (IsError(rc_)) return false;
  rc_ = sqlite3_step(stmt_);
  if (IsError(rc_)) error_ = sqlite3_errmsg(db_);
  return rc_ == SQLITE_ROW;
}

Status Statement::Run() {
  while (Step()) {
  }
  return status();
}

void Statement::Reset() {
  if (stmt_ == nullptr) return;  // the prepare failed: keep its error
  sqlite3_reset(stmt_);
  sqlite3_clear_bindings(stmt_);
  rc_ = SQLITE_OK;
  error_.clear();
}

Status Statement::status() const {
  if (!IsError(rc_)) return OkStatus();
  return Error(rc_, path_, error_, sql_);
}

int64_t Statement::Int(int col) const { return sqlite3_column_int64(stmt_, col); }

std::string Statement::Text(int col) const {
  const auto* p = reinterpret_cast<const char*>(sqlite3_column_text(stmt_, col));
  return p ? std::string(p, static_cast<size_t>(sqlite3_column_bytes(stmt_, col))) : std::string();
}

bool Statement::IsNull(int col) const { return sqlite3_column_type(stmt_, col) == SQLITE_NULL; }

Status Exec(sqlite3* db, std::string_view sql, std::string_view path) {
  char* err = nullptr;
  const std::string text(sql);
  const int rc = sqlite3_exec(db, text.c_str(), nullptr, nullptr, &err);
  if (rc == SQLITE_OK) return OkStatus();
  const std::string message = err ? err : sqlite3_errstr(rc);
  sqlite3_free(err);
  return Error(rc, path, message, sql);
}

}  // namespace rc::sqlite
