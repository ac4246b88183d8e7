// WriteLock: holds SQLite's write lock on a database from a second connection, so every write of
// another connection fails (SQLITE_BUSY, after its busy timeout) until Release: a store that fails
// or stalls at a point a test chooses. Shared by the controller tests (records, in-flight claims).
#pragma once

#include <gtest/gtest.h>
#include <sqlite3.h>

#include <string>

namespace rc::controller::testing {

class WriteLock {
 public:
  explicit WriteLock(const std::string& path) {
    EXPECT_EQ(sqlite3_open(path.c_str(), &db_), SQLITE_OK);
    EXPECT_EQ(sqlite3_exec(db_, "BEGIN IMMEDIATE", nullptr, nullptr, nullptr), SQLITE_OK);
  }
  ~WriteLock() { Release(); }
  WriteLock(const WriteLock&) = delete;
  WriteLock& operator=(const WriteLock&) = delete;
  void Release() {
    if (db_ == nullptr) return;
    (void)sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
    sqlite3_close(db_);
    db_ = nullptr;
  }

 private:
  sqlite3* db_ = nullptr;
};

}  // namespace rc::controller::testing
