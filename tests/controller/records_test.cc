// What the controller records stays true when a store fails, a client vanishes, an id is odd
// or the same update is asked for twice (issue 13, defects 3, 4 and 8): ControllerService with
// real threads and SQLite state over FakeEngine adapters.
#include <gtest/gtest.h>
#include <httplib.h>
#include <sqlite3.h>

#include <fstream>
#include <set>

#include "controller/service_fixture.h"
#include "controller/sqlite_write_lock.h"
#include "rolloutcore/controller/http_server.h"

namespace rc::controller {
namespace {

using testing::Engines;
using testing::Options;
using testing::StaticVersions;
using testing::TempDir;
using testing::WriteLock;
namespace fs = std::filesystem;

bool JournalHas(ControllerService* svc, const std::string& event, const std::string& rollout) {
  auto j = svc->Journal(0, 0).value();
  for (const auto& r : j["records"]) {
    if (r["event"] == event && r["rollout"] == rollout) return true;
  }
  return false;
}

// Defect 3: the trajectory row is written before the finish is journaled. A store that fails
// at the finish must leave the lease open (the client retries), not a rollout finished in the
// journal whose output exists nowhere; and the row records the real admission time.
TEST(ControllerRecordsTest, LeaseFinishWritesTheRowBeforeTheJournalAndKeepsAdmissionTime) {
  auto dir = TempDir("lease_order");
  StaticVersions versions;
  Engines e;
  {
    auto svc = std::move(ControllerService::Create(e.Make(1), &versions, Options(dir))).value();
    ASSERT_TRUE(svc->Admit("L-1").ok());
    ASSERT_TRUE(svc->Admit("L-2").ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    {
      WriteLock lock(dir + "/trajectories.db");
      Status s = svc->FinishLease("L-1", Json{{"token_ids", {4, 2}}, {"finish_reason", "stop"}});
      ASSERT_FALSE(s.ok()) << "the trajectory store refuses writes";
      EXPECT_FALSE(JournalHas(svc.get(), "finish", "L-1"))
          << "a finish journaled without its trajectory row is a lost rollout";
      EXPECT_TRUE(svc->controller(0)->Binding("L-1").has_value()) << "the lease stays open for a retry";
    }
    // The store is back: the retry finishes it, with the row.
    ASSERT_TRUE(svc->FinishLease("L-1", Json{{"token_ids", {4, 2}}, {"finish_reason", "stop"}}).ok());
    EXPECT_TRUE(JournalHas(svc.get(), "finish", "L-1"));
    auto rows = svc->trajectories()->List("").value();
    ASSERT_EQ(rows.size(), 1u);
    EXPECT_EQ(rows[0].binding.rollout_id, "L-1");
    EXPECT_EQ(rows[0].output_token_ids, (std::vector<int64_t>{4, 2}));
    EXPECT_LT(rows[0].admitted_ms + 15, rows[0].finished_ms) << "admitted_ms is when the lease was admitted";
    // L-2 is open at the "crash" (the service goes away without a finish).
  }
  auto svc = std::move(ControllerService::Create(e.Make(1), &versions, Options(dir))).value();
  // Every admitted lease is accounted for: L-1 has its row, L-2 is recorded interrupted.
  EXPECT_EQ(svc->trajectories()->List("").value().size(), 1u);
  EXPECT_TRUE(JournalHas(svc.get(), "interrupted", "L-2"));
  fs::remove_all(dir);
}

// Defect 3, proxy path: a failed completion with a failing store still ends its binding (the
// drain is not held forever) and the journal says the row is missing.
TEST(ControllerRecordsTest, FailedRolloutWithFailedStoreIsRecordedNotDropped) {
  auto dir = TempDir("err_path");
  StaticVersions versions;
  Engines e;
  auto handles = e.Make(1);
  handles[0].complete = [](const Json&) -> Result<Json> { return Unavailable("engine connection reset"); };
  auto svc = std::move(ControllerService::Create(std::move(handles), &versions, Options(dir))).value();
  ASSERT_FALSE(svc->Rollout(Json{{"prompt", {1}}, {"rollout_id", "E-1"}}).ok());
  const auto rows = svc->trajectories()->List("").value();
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].finish_reason, "error");
  {
    WriteLock lock(dir + "/trajectories.db");
    ASSERT_FALSE(svc->Rollout(Json{{"prompt", {1}}, {"rollout_id", "E-2"}}).ok());
  }
  EXPECT_FALSE(svc->controller(0)->Binding("E-2").has_value());
  auto j = svc->Journal(0, 0).value();
  bool recorded = false;
  for (const auto& r : j["records"]) {
    if (r["event"] == "finish" && r["rollout"] == "E-2") recorded = r["detail"].contains("trajectory_error");
  }
  EXPECT_TRUE(recorded) << j.dump();
  fs::remove_all(dir);
}

// Defect 4: ids are checked at admission; one with '/' could never be finished by URL.
TEST(ControllerRecordsTest, RolloutIdsOutsideTheCharacterSetAreRefused) {
  auto dir = TempDir("ids");
  StaticVersions versions;
  Engines e;
  auto svc = std::move(ControllerService::Create(e.Make(1), &versions, Options(dir))).value();
  ControllerHttpServer server(svc.get(), "127.0.0.1", 0);
  ASSERT_TRUE(server.Start().ok());
  httplib::Client c("127.0.0.1", server.port());
  for (const char* body : {R"({"rollout_id":"a/b"})", R"({"rollout_id":".."})", R"({"rollout_id":"x y"})",
                           R"({"rollout_id":"a:finish"})"}) {
    auto r = c.Post("/v1/rollouts:admit", body, "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400) << body;
    EXPECT_NE(r->body.find("rollout_id"), std::string::npos) << r->body;
  }
  std::string long_id(129, 'a');
  auto r = c.Post("/v1/rollouts", Json{{"prompt", {1}}, {"rollout_id", long_id}}.dump(), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_EQ(svc->controller(0)->active_count(), 0);
  // A good id round-trips through the URL.
  r = c.Post("/v1/rollouts:admit", R"({"rollout_id":"run-7.step_3"})", "application/json");
  ASSERT_EQ(r->status, 200);
  r = c.Post("/v1/rollouts/run-7.step_3:heartbeat", "", "application/json");
  EXPECT_EQ(r->status, 200) << r->body;
  r = c.Post("/v1/rollouts/run-7.step_3:finish", R"({"token_ids":[1]})", "application/json");
  EXPECT_EQ(r->status, 200) << r->body;
  server.Stop();
  fs::remove_all(dir);
}

// Defect 4: a lease whose client vanished expires, is recorded so, and the update it held
// proceeds; a lease kept alive by heartbeats does not expire.
TEST(ControllerRecordsTest, AbandonedLeaseExpiresAndThePendingUpdateProceeds) {
  auto dir = TempDir("expiry");
  StaticVersions versions;
  Engines e;
  auto o = Options(dir);
  o.lease_timeout_ms = 300;
  auto svc = std::move(ControllerService::Create(e.Make(1), &versions, o)).value();
  ASSERT_TRUE(svc->Admit("gone").ok());
  ASSERT_TRUE(svc->Admit("alive").ok());
  auto id = svc->RequestUpdate("m", "v1");
  ASSERT_TRUE(id.ok());
  // "alive" heartbeats and finishes after the timeout has passed twice over.
  for (int i = 0; i < 8; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(80));
    ASSERT_TRUE(svc->ExtendLease("alive").ok()) << "heartbeat " << i;
  }
  EXPECT_EQ(svc->StatusJson()["engines"][0]["state"], "DRAINING") << "the live lease still holds the drain";
  ASSERT_TRUE(svc->FinishLease("alive", Json{{"token_ids", {1}}}).ok());
  auto done = svc->WaitForUpdate(*id, 10000);
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  EXPECT_EQ((*done)["outcome"], "committed");
  EXPECT_EQ(svc->FinishLease("gone", Json::object()).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(svc->ExtendLease("gone").status().code(), StatusCode::kFailedPrecondition);
  bool expired_in_journal = false;
  const Json journal = svc->Journal(0, 0).value();
  for (const auto& r : journal["records"]) {
    if (r["event"] == "finish" && r["rollout"] == "gone") expired_in_journal = r["detail"].value("expired", false);
  }
  EXPECT_TRUE(expired_in_journal);
  std::map<std::string, std::string> reasons;
  const auto rows = svc->trajectories()->List("").value();
  for (const auto& t : rows) reasons[t.binding.rollout_id] = t.finish_reason;
  EXPECT_EQ(reasons["gone"], "expired");
  EXPECT_EQ(reasons["alive"], "stop");
  fs::remove_all(dir);
}

// Defect 8: identical concurrent requests are one update (one id, one install); a request for
// the live version returns the update that installed it.
TEST(ControllerRecordsTest, IdenticalUpdateRequestsAreMerged) {
  auto dir = TempDir("merge");
  StaticVersions versions;
  Engines e;
  auto handles = e.Make(1);
  rc::testing::Fault slow;
  slow.kind = rc::testing::Fault::Kind::kDelay;
  slow.delay = std::chrono::milliseconds(200);
  static_cast<rc::testing::FaultInjectingAdapter*>(handles[0].adapter.get())->Set("resume", slow);
  auto svc = std::move(ControllerService::Create(std::move(handles), &versions, Options(dir))).value();
  std::vector<std::string> ids(4);
  std::vector<std::thread> clients;
  clients.reserve(4);
  for (int i = 0; i < 4; ++i) {
    clients.emplace_back([&, i] { ids[i] = svc->RequestUpdate("m", "v1").value(); });
  }
  for (auto& t : clients) t.join();
  EXPECT_EQ(std::set<std::string>(ids.begin(), ids.end()).size(), 1u);
  auto done = svc->WaitForUpdate(ids[0], 10000);
  ASSERT_TRUE(done.ok());
  EXPECT_EQ((*done)["outcome"], "committed");
  EXPECT_EQ(svc->RequestUpdate("m", "v1").value(), ids[0]) << "v1 is live: the update that installed it";
  EXPECT_EQ(e.fakes[0]->shared()->mutations_started.load(), 1) << "one install, one cycle";
  EXPECT_EQ(svc->controller(0)->counters().updates_committed, 1);
  fs::remove_all(dir);
}

// Defect 8: update ids are journaled: they answer after a restart and new ids continue.
TEST(ControllerRecordsTest, UpdateIdsSurviveARestart) {
  auto dir = TempDir("ids_restart");
  StaticVersions versions;
  Engines e;
  std::string first, second;
  {
    auto svc = std::move(ControllerService::Create(e.Make(1), &versions, Options(dir))).value();
    first = svc->RequestUpdate("m", "v1").value();
    ASSERT_TRUE(svc->WaitForUpdate(first, 10000).ok());
    second = svc->RequestUpdate("m", "v2").value();
    ASSERT_EQ((*svc->WaitForUpdate(second, 10000))["outcome"], "committed");
  }
  auto svc = std::move(ControllerService::Create(e.Make(1), &versions, Options(dir))).value();
  ControllerHttpServer server(svc.get(), "127.0.0.1", 0);
  ASSERT_TRUE(server.Start().ok());
  httplib::Client c("127.0.0.1", server.port());
  auto r = c.Get(("/v1/updates/" + second).c_str());
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  auto j = Json::parse(r->body);
  EXPECT_EQ(j["version"], "v2");
  EXPECT_EQ(j["outcome"], "committed");
  EXPECT_EQ(j["engines"][0]["phase"], "READY");
  r = c.Post("/v1/updates", R"({"model":"m","version":"v3"})", "application/json");
  ASSERT_EQ(r->status, 202);
  std::string third = Json::parse(r->body)["id"];
  EXPECT_NE(third, first);
  EXPECT_NE(third, second);
  EXPECT_EQ(third, "u-3");
  server.Stop();
  fs::remove_all(dir);
}

// ---- Defect 7 (storage): damaged state files are never trusted ----

void Exec(const std::string& path, const std::string& sql) {
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
  char* err = nullptr;
  EXPECT_EQ(sqlite3_exec(db, sql.c_str(), nullptr, nullptr, &err), SQLITE_OK) << (err ? err : "");
  sqlite3_free(err);
  sqlite3_close(db);
}

// A controller that ran: v1 committed, a few rollouts stored; then stopped (its SQLite files
// are checkpointed and closed).
void RunOnce(const std::string& dir, StaticVersions* versions, Engines* e, int rollouts) {
  auto svc = std::move(ControllerService::Create(e->Make(1), versions, Options(dir))).value();
  ASSERT_EQ((*svc->WaitForUpdate(svc->RequestUpdate("m", "v1").value(), 10000))["outcome"], "committed");
  for (int i = 0; i < rollouts; ++i) {
    // (Built with append: GCC 12 at -O3 reports a false -Wrestrict for "literal" + std::string, GCC PR 105329.)
    ASSERT_TRUE(
        svc->Rollout(Json{{"prompt", {1, 2, 3, i}}, {"rollout_id", std::string("r").append(std::to_string(i))}}).ok());
  }
}

TEST(ControllerStorageTest, ZeroByteJournalInAnInitializedStateDirRefusesToStart) {
  auto dir = TempDir("zero_journal");
  StaticVersions versions;
  Engines e;
  RunOnce(dir, &versions, &e, 2);
  ASSERT_TRUE(fs::exists(StateMarkerPath(dir))) << "the first start writes the marker";
  for (const char* suffix : {"", "-wal", "-shm"}) {
    const std::string f = dir + "/engine-0.journal.db" + suffix;
    if (fs::exists(f)) fs::resize_file(f, 0);
  }
  auto svc = ControllerService::Create(e.Make(1), &versions, Options(dir));
  ASSERT_FALSE(svc.ok()) << "a zero-byte journal must not start as a fresh generation 0";
  EXPECT_EQ(svc.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(svc.status().message().find("engine-0.journal.db"), std::string::npos) << svc.status().ToString();
  EXPECT_NE(svc.status().message().find("empty"), std::string::npos) << svc.status().ToString();

  // A missing trajectory store is refused the same way.
  auto dir2 = TempDir("missing_store");
  RunOnce(dir2, &versions, &e, 1);
  fs::remove(dir2 + "/trajectories.db");
  auto svc2 = ControllerService::Create(e.Make(1), &versions, Options(dir2));
  ASSERT_FALSE(svc2.ok());
  EXPECT_NE(svc2.status().message().find("trajectories.db"), std::string::npos) << svc2.status().ToString();
  fs::remove_all(dir);
  fs::remove_all(dir2);
}

TEST(ControllerStorageTest, FlippedBytesInTheTrajectoryStoreAreAnErrorNotPartialRows) {
  auto dir = TempDir("flipped");
  StaticVersions versions;
  Engines e;
  RunOnce(dir, &versions, &e, 80);
  const std::string path = dir + "/trajectories.db";
  ASSERT_FALSE(fs::exists(path + "-wal") && fs::file_size(path + "-wal") > 0) << "checkpointed at close";
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    const auto size = static_cast<int64_t>(fs::file_size(path));
    const int64_t page = 4096;
    ASSERT_GT(size, 4 * page) << "80 rows span several pages";
    for (int64_t at = page; at + 16 <= size; at += page) {  // every page after the schema page
      char bytes[16];
      f.seekg(at);
      f.read(bytes, 16);
      for (char& b : bytes) b = static_cast<char>(b ^ 0x5a);
      f.seekp(at);
      f.write(bytes, 16);
    }
  }
  auto svc = ControllerService::Create(e.Make(1), &versions, Options(dir));
  ASSERT_FALSE(svc.ok()) << "a damaged trajectory store must not serve what is left of it";
  EXPECT_EQ(svc.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(svc.status().message().find("trajectories.db"), std::string::npos) << svc.status().ToString();
  EXPECT_NE(svc.status().message().find("integrity"), std::string::npos) << svc.status().ToString();
  // Opened on its own (no marker), the store refuses too.
  EXPECT_EQ(TrajectoryStore::Open(path).status().code(), StatusCode::kDataLoss);
  fs::remove_all(dir);
}

TEST(ControllerStorageTest, ARowThatDoesNotReadBackAsWrittenFailsTheRead) {
  auto dir = TempDir("edited_row");
  StaticVersions versions;
  Engines e;
  RunOnce(dir, &versions, &e, 3);
  // Structurally valid SQLite, but one row's body was changed after it was written.
  Exec(dir + "/trajectories.db",
       "UPDATE trajectories SET body = replace(body, '\"output_token_ids\":[5,6,7]', '\"output_token_ids\":[5,6]')"
       " WHERE rollout_id = 'r1'");
  auto svc = std::move(ControllerService::Create(e.Make(1), &versions, Options(dir))).value();
  auto rows = svc->trajectories()->List("");
  ASSERT_FALSE(rows.ok()) << "answered " << rows->size() << " rows, one of them changed";
  EXPECT_EQ(rows.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(rows.status().message().find("checksum"), std::string::npos) << rows.status().ToString();
  ControllerHttpServer server(svc.get(), "127.0.0.1", 0);
  ASSERT_TRUE(server.Start().ok());
  httplib::Client c("127.0.0.1", server.port());
  auto r = c.Get("/v1/trajectories");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 500) << r->body;
  server.Stop();
  svc.reset();
  fs::remove_all(dir);
}

TEST(ControllerStorageTest, AnEditedJournalRecordIsRefused) {
  auto dir = TempDir("edited_journal");
  StaticVersions versions;
  Engines e;
  RunOnce(dir, &versions, &e, 1);
  // The probe's edit: the committed label becomes vFAKE. The JSON stays valid.
  Exec(dir + "/engine-0.journal.db", "UPDATE journal SET detail = replace(detail, '\"v1\"', '\"vFAKE\"')");
  auto svc = ControllerService::Create(e.Make(1), &versions, Options(dir));
  ASSERT_FALSE(svc.ok()) << "started " << (*svc)->StatusJson()["engines"][0].dump();
  EXPECT_EQ(svc.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(svc.status().message().find("engine-0.journal.db"), std::string::npos) << svc.status().ToString();
  EXPECT_NE(svc.status().message().find("checksum mismatch"), std::string::npos) << svc.status().ToString();

  // A record deleted from the middle breaks the chain too.
  auto dir2 = TempDir("deleted_record");
  RunOnce(dir2, &versions, &e, 1);
  Exec(dir2 + "/engine-0.journal.db", "DELETE FROM journal WHERE seq = 3");
  auto svc2 = ControllerService::Create(e.Make(1), &versions, Options(dir2));
  ASSERT_FALSE(svc2.ok());
  EXPECT_NE(svc2.status().message().find("record"), std::string::npos) << svc2.status().ToString();
  fs::remove_all(dir);
  fs::remove_all(dir2);
}

}  // namespace
}  // namespace rc::controller
