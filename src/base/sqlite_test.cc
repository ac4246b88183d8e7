#include "rolloutcore/base/sqlite.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace rc::sqlite {
namespace {

class SqliteTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("rc_sqlite_test_" + std::to_string(::getpid()) + "_" +
                                                     ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  std::filesystem::path dir_;
};

TEST_F(SqliteTest, RowsRoundTripThroughBindAndColumns) {
  auto db = Database::Open(Path("a.db"), "test db");
  ASSERT_TRUE(db.ok()) << db.status().ToString();
  ASSERT_TRUE(db->Exec("CREATE TABLE t(id INTEGER PRIMARY KEY, name TEXT, note TEXT)").ok());
  const std::string with_nul("a\0b", 3);
  ASSERT_TRUE(Statement(*db, "INSERT INTO t(id, name, note) VALUES(?, ?, NULL)").Bind(1, int64_t{7}).Bind(2, with_nul).Run().ok());
  Statement q(*db, "SELECT id, name, note FROM t WHERE id = ?");
  q.Bind(1, int64_t{7});
  ASSERT_TRUE(q.Step());
  EXPECT_EQ(q.Int(0), 7);
  EXPECT_EQ(q.Text(1), with_nul);
  EXPECT_TRUE(q.IsNull(2));
  EXPECT_FALSE(q.IsNull(1));
  EXPECT_FALSE(q.Step());
  EXPECT_TRUE(q.status().ok());
  EXPECT_EQ(db->HasTable("t").value(), true);
  EXPECT_EQ(db->HasTable("u").value(), false);
  EXPECT_EQ(db->HasColumn("t", "note").value(), true);
  EXPECT_EQ(db->HasColumn("t", "nope").value(), false);
}

TEST_F(SqliteTest, ErrorsNameTheDatabaseAndTheStatement) {
  auto db = Database::Open(Path("b.db"), "test db");
  ASSERT_TRUE(db.ok());
  Statement bad(*db, "SELECT x FROM missing_table");
  EXPECT_FALSE(bad.Step());
  const Status s = bad.status();
  EXPECT_EQ(s.code(), StatusCode::kInternal);
  EXPECT_NE(s.message().find("sqlite '" + Path("b.db") + "'"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("no such table: missing_table"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("(in: SELECT x FROM missing_table)"), std::string::npos) << s.message();
  // The first error sticks: binding and stepping again change nothing.
  bad.Bind(1, int64_t{1});
  EXPECT_FALSE(bad.Step());
  EXPECT_EQ(bad.status().message(), s.message());

  const Status exec = db->Exec("CREATE TABLE t(a); INSERT INTO nowhere VALUES(1)");
  EXPECT_EQ(exec.code(), StatusCode::kInternal);
  EXPECT_NE(exec.message().find("no such table: nowhere"), std::string::npos) << exec.message();
  EXPECT_NE(exec.message().find("(in: CREATE TABLE t(a); INSERT INTO nowhere VALUES(1))"), std::string::npos)
      << exec.message();

  ASSERT_TRUE(db->Exec("CREATE TABLE u(id INTEGER PRIMARY KEY)").ok());
  ASSERT_TRUE(Statement(*db, "INSERT INTO u(id) VALUES(1)").Run().ok());
  const Status dup = Statement(*db, "INSERT INTO u(id) VALUES(1)").Run();
  EXPECT_NE(dup.message().find("UNIQUE constraint failed: u.id"), std::string::npos) << dup.message();
  EXPECT_NE(dup.message().find("(in: INSERT INTO u(id) VALUES(1))"), std::string::npos) << dup.message();
}

TEST_F(SqliteTest, OpenNamesWhatAndPathAndHonoursCreate) {
  const std::string path = Path("absent.db");
  auto db = Database::Open(path, "journal", {.create = false});
  ASSERT_FALSE(db.ok());
  EXPECT_EQ(db.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(db.status().message().find("cannot open journal '" + path + "'"), std::string::npos)
      << db.status().message();
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST_F(SqliteTest, ALockedDatabaseIsUnavailable) {
  auto a = Database::Open(Path("c.db"), "a", {.busy_timeout_ms = 0});
  auto b = Database::Open(Path("c.db"), "b", {.busy_timeout_ms = 0});
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(a->Exec("CREATE TABLE t(x)").ok());
  ASSERT_TRUE(a->Exec("BEGIN EXCLUSIVE").ok());
  const Status s = b->Exec("INSERT INTO t VALUES(1)");
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_NE(s.message().find("(in: INSERT INTO t VALUES(1))"), std::string::npos) << s.message();
  ASSERT_TRUE(a->Exec("COMMIT").ok());
  EXPECT_TRUE(b->Exec("INSERT INTO t VALUES(1)").ok());
}

TEST_F(SqliteTest, IntegrityCheckReportsAFileThatIsNotADatabase) {
  const std::string path = Path("garbage.db");
  std::ofstream(path) << std::string(4096, 'x');
  auto db = Database::Open(path, "store");
  ASSERT_TRUE(db.ok());  // SQLite reads the file lazily
  const Status s = db->IntegrityCheck();
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("integrity check"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("not a database"), std::string::npos) << s.message();
  auto good = Database::Open(Path("good.db"), "store");
  ASSERT_TRUE(good.ok());
  EXPECT_TRUE(good->IntegrityCheck().ok());
}

TEST_F(SqliteTest, OpenStateFileRefusesAMissingEmptyOrDamagedFileTheStateDirVouchesFor) {
  const std::string path = Path("state.db");
  auto missing = Database::OpenStateFile(path, "journal", /*must_exist=*/true);
  EXPECT_EQ(missing.status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(missing.status().message(), "journal '" + path + "' is missing, but the state dir says it existed");
  EXPECT_FALSE(std::filesystem::exists(path)) << "nothing is created";

  std::ofstream(path).close();
  auto empty = Database::OpenStateFile(path, "journal", true);
  EXPECT_EQ(empty.status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(empty.status().message(), "journal '" + path + "' is empty (0 bytes), but the state dir says it existed");

  std::ofstream(path) << std::string(4096, 'x');
  auto damaged = Database::OpenStateFile(path, "journal", true);
  EXPECT_EQ(damaged.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(damaged.status().message().find("journal '" + path + "' fails SQLite's integrity check"), std::string::npos)
      << damaged.status().message();

  std::filesystem::remove(path);
  auto fresh = Database::OpenStateFile(path, "journal", false);
  ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
  ASSERT_TRUE(fresh->Exec("CREATE TABLE t(x)").ok());
  *fresh = Database();  // closed
  auto reopened = Database::OpenStateFile(path, "journal", true);
  EXPECT_TRUE(reopened.ok()) << reopened.status().ToString();
}

TEST_F(SqliteTest, MovedFromDatabaseIsClosedOnce) {
  auto db = Database::Open(Path("d.db"), "store");
  ASSERT_TRUE(db.ok());
  Database moved = std::move(db).value();
  EXPECT_TRUE(moved.is_open());
  Database other;
  EXPECT_FALSE(other.is_open());
  other = std::move(moved);
  EXPECT_TRUE(other.is_open());
  EXPECT_FALSE(moved.is_open());  // NOLINT(bugprone-use-after-move): the move empties it
  EXPECT_EQ(other.path(), Path("d.db"));
  EXPECT_TRUE(other.Exec("CREATE TABLE t(x)").ok());
}

// A prepared statement runs again after Reset with new bindings; a bind error is cleared by it,
// a prepare error is not.
TEST_F(SqliteTest, ResetStatementRunsAgainWithNewBindings) {
  auto db = Database::Open(Path("r.db"), "store");
  ASSERT_TRUE(db.ok());
  ASSERT_TRUE(db->Exec("CREATE TABLE t(x INTEGER, y TEXT)").ok());
  Statement insert(*db, "INSERT INTO t VALUES (?, ?)");
  for (int64_t i = 1; i <= 3; ++i) {
    insert.Reset();
    // (Built with append: GCC 12 at -O3 reports a false -Wrestrict for "literal" + std::string, GCC PR 105329.)
    insert.Bind(1, i).Bind(2, std::string("v").append(std::to_string(i)));
    ASSERT_TRUE(insert.Run().ok()) << insert.status().ToString();
  }
  insert.Reset();
  insert.Bind(3, int64_t{9});  // no parameter 3
  EXPECT_FALSE(insert.status().ok());
  insert.Reset();
  EXPECT_TRUE(insert.status().ok());
  insert.Bind(1, int64_t{4});  // y left unbound: Reset cleared the old bindings, so it is NULL
  ASSERT_TRUE(insert.Run().ok());
  Statement read(*db, "SELECT x, y FROM t ORDER BY x");
  std::vector<std::pair<int64_t, std::string>> rows;
  std::vector<bool> nulls;
  while (read.Step()) {
    rows.emplace_back(read.Int(0), read.Text(1));
    nulls.push_back(read.IsNull(1));
  }
  ASSERT_TRUE(read.status().ok());
  ASSERT_EQ(rows.size(), 4u);
  EXPECT_EQ(rows[2], (std::pair<int64_t, std::string>{3, "v3"}));
  EXPECT_EQ(rows[3].first, 4);
  EXPECT_TRUE(nulls[3]);
  EXPECT_FALSE(nulls[0]);

  Statement broken(*db, "INSERT INTO no_such_table VALUES (1)");
  EXPECT_FALSE(broken.status().ok());
  broken.Reset();
  EXPECT_FALSE(broken.status().ok()) << "a prepare error survives Reset";
  EXPECT_FALSE(broken.Run().ok());
}

}  // namespace
}  // namespace rc::sqlite
