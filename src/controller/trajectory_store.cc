#include "rolloutcore/controller/trajectory_store.h"

#include <sqlite3.h>

#include <filesystem>

#include "rolloutcore/base/hash.h"
#include "rolloutcore/base/mutex.h"

namespace rc::controller {
namespace {

sqlite3* Db(void* p) { return static_cast<sqlite3*>(p); }

template <typename T>
Json Arr(const std::vector<T>& v) {
  Json a = Json::array();
  for (const auto& x : v) a.push_back(x);
  return a;
}

template <typename T>
std::vector<T> FromArr(const Json& j) {
  std::vector<T> out;
  if (!j.is_array()) return out;
  for (const auto& x : j) {
    if (x.is_number()) out.push_back(x.get<T>());
  }
  return out;
}

// xxHash3-64 over the stored columns, length-prefixed.
std::string RowChecksum(const std::string& rollout_id, const std::string& label, const std::string& body) {
  Hasher h(0x7472616a);  // "traj"
  for (const std::string* f : {&rollout_id, &label, &body}) {
    h.UpdateU64(f->size());
    h.Update(*f);
  }
  return Hex64(h.Digest());
}

}  // namespace

Json ToJson(const Trajectory& t) {
  return Json{{"binding", lifecycle::ToJson(t.binding)},
              {"engine", t.engine},
              {"prompt_token_ids", Arr(t.prompt_token_ids)},
              {"output_token_ids", Arr(t.output_token_ids)},
              {"logprobs", Arr(t.logprobs)},
              {"finish_reason", t.finish_reason},
              {"cached_tokens", t.cached_tokens},
              {"admitted_ms", t.admitted_ms},
              {"finished_ms", t.finished_ms},
              {"engine_weight_version", t.engine_weight_version},
              {"extra", t.extra},
              {"version_spans", t.version_spans},
              {"aborted_at_update", t.aborted_at_update}};
}

Result<std::unique_ptr<TrajectoryStore>> TrajectoryStore::Open(const std::string& path, bool must_exist) {
  std::error_code ec;
  const bool existed = std::filesystem::exists(path, ec);
  if (must_exist) {
    if (!existed) return DataLoss("trajectory store '" + path + "' is missing, but the state dir says it existed");
    if (std::filesystem::file_size(path, ec) == 0 || ec) {
      return DataLoss("trajectory store '" + path + "' is empty (0 bytes), but the state dir says it existed");
    }
  }
  sqlite3* db = nullptr;
  const int flags = SQLITE_OPEN_READWRITE | SQLITE_OPEN_FULLMUTEX | (must_exist ? 0 : SQLITE_OPEN_CREATE);
  if (sqlite3_open_v2(path.c_str(), &db, flags, nullptr) != SQLITE_OK) {
    std::string msg = db ? sqlite3_errmsg(db) : "out of memory";
    sqlite3_close(db);
    return Unavailable("cannot open trajectory store '" + path + "': " + msg);
  }
  std::unique_ptr<TrajectoryStore> s(new TrajectoryStore(db, path));
  if (existed) {
    sqlite3_stmt* st = nullptr;
    std::string problems;
    int rc = sqlite3_prepare_v2(db, "PRAGMA integrity_check", -1, &st, nullptr);
    if (rc == SQLITE_OK) {
      while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        const unsigned char* t = sqlite3_column_text(st, 0);
        std::string line = t ? reinterpret_cast<const char*>(t) : "";
        if (line != "ok") problems += (problems.empty() ? "" : "; ") + line;
      }
      sqlite3_finalize(st);
    }
    if (rc != SQLITE_DONE) problems = sqlite3_errmsg(db);
    if (!problems.empty()) {
      return DataLoss("trajectory store '" + path + "' fails SQLite's integrity check: " + problems.substr(0, 500));
    }
  }
  if (must_exist) {
    sqlite3_stmt* st = nullptr;
    bool has_table = false;
    if (sqlite3_prepare_v2(db, "SELECT 1 FROM sqlite_master WHERE type='table' AND name='trajectories'", -1, &st,
                           nullptr) == SQLITE_OK) {
      has_table = sqlite3_step(st) == SQLITE_ROW;
      sqlite3_finalize(st);
    }
    if (!has_table) {
      return DataLoss("trajectory store '" + path + "' has no trajectories table, but the state dir says it existed");
    }
  }
  const char* ddl =
      "PRAGMA journal_mode=WAL;"
      "CREATE TABLE IF NOT EXISTS trajectories ("
      " id INTEGER PRIMARY KEY, rollout_id TEXT NOT NULL, label TEXT NOT NULL, generation INTEGER NOT NULL,"
      " body TEXT NOT NULL, checksum TEXT);"
      "CREATE INDEX IF NOT EXISTS trajectories_label ON trajectories(label);";
  char* err = nullptr;
  if (sqlite3_exec(db, ddl, nullptr, nullptr, &err) != SQLITE_OK) {
    std::string msg = err ? err : "?";
    sqlite3_free(err);
    return Internal("trajectory store '" + path + "': " + msg);
  }
  // Stores written before rows were checksummed: add the column (their rows stay unchecked).
  bool has_checksum = false;
  sqlite3_stmt* st = nullptr;
  if (sqlite3_prepare_v2(db, "PRAGMA table_info(trajectories)", -1, &st, nullptr) == SQLITE_OK) {
    while (sqlite3_step(st) == SQLITE_ROW) {
      const unsigned char* name = sqlite3_column_text(st, 1);
      if (name && std::string(reinterpret_cast<const char*>(name)) == "checksum") has_checksum = true;
    }
    sqlite3_finalize(st);
  }
  if (!has_checksum && sqlite3_exec(db, "ALTER TABLE trajectories ADD COLUMN checksum TEXT", nullptr, nullptr, &err) !=
                           SQLITE_OK) {
    std::string msg = err ? err : "?";
    sqlite3_free(err);
    return Internal("trajectory store '" + path + "': " + msg);
  }
  return s;
}

TrajectoryStore::~TrajectoryStore() { sqlite3_close(Db(db_)); }

Status TrajectoryStore::Insert(const Trajectory& t) {
  rc::MutexLock lock(mu_);
  sqlite3_stmt* st = nullptr;
  if (sqlite3_prepare_v2(Db(db_),
                         "INSERT INTO trajectories (rollout_id, label, generation, body, checksum) VALUES (?,?,?,?,?)",
                         -1, &st, nullptr) != SQLITE_OK) {
    return Internal("trajectory store: " + std::string(sqlite3_errmsg(Db(db_))));
  }
  std::string body = ToJson(t).dump();
  sqlite3_bind_text(st, 1, t.binding.rollout_id.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_text(st, 2, t.binding.version.label.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_int64(st, 3, t.binding.version.generation);
  sqlite3_bind_text(st, 4, body.c_str(), -1, SQLITE_TRANSIENT);
  const std::string checksum = RowChecksum(t.binding.rollout_id, t.binding.version.label, body);
  sqlite3_bind_text(st, 5, checksum.c_str(), -1, SQLITE_TRANSIENT);
  int rc = sqlite3_step(st);
  sqlite3_finalize(st);
  if (rc != SQLITE_DONE) return Unavailable("trajectory store insert failed: " + std::string(sqlite3_errmsg(Db(db_))));
  return OkStatus();
}

Result<std::vector<Trajectory>> TrajectoryStore::List(const std::string& label, int64_t limit) const {
  rc::MutexLock lock(mu_);
  sqlite3_stmt* st = nullptr;
  std::string sql = "SELECT id, rollout_id, label, body, checksum FROM trajectories";
  if (!label.empty()) sql += " WHERE label = ?";
  sql += " ORDER BY id";
  if (limit >= 0) sql += " LIMIT " + std::to_string(limit);
  if (sqlite3_prepare_v2(Db(db_), sql.c_str(), -1, &st, nullptr) != SQLITE_OK) {
    return Internal("trajectory store: " + std::string(sqlite3_errmsg(Db(db_))));
  }
  if (!label.empty()) sqlite3_bind_text(st, 1, label.c_str(), -1, SQLITE_TRANSIENT);
  std::vector<Trajectory> out;
  auto text = [&](int col) {
    const unsigned char* t = sqlite3_column_text(st, col);
    return t ? std::string(reinterpret_cast<const char*>(t)) : std::string();
  };
  int rc;
  while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
    // A row that does not read back as written is an error for the whole read: never a
    // shorter answer that looks complete.
    const std::string where = "trajectory store '" + path_ + "' row " + std::to_string(sqlite3_column_int64(st, 0));
    const std::string body = text(3);
    if (sqlite3_column_type(st, 4) != SQLITE_NULL && text(4) != RowChecksum(text(1), text(2), body)) {
      sqlite3_finalize(st);
      return DataLoss(where + ": checksum mismatch (the row was changed after it was written)");
    }
    auto j = ParseJson(body, "trajectory row");
    if (!j.ok() || !j->is_object() || !(*j).contains("binding") || !(*j)["binding"].is_object()) {
      sqlite3_finalize(st);
      return DataLoss(where + ": unreadable body" + (j.ok() ? std::string() : ": " + j.status().message()));
    }
    Trajectory t;
    const Json& b = (*j)["binding"];
    t.binding.rollout_id = b.value("rollout_id", "");
    t.binding.version.label = b.value("label", "");
    t.binding.version.generation = b.value("generation", int64_t{0});
    if (auto id = lifecycle::WeightIdentityFromJson(b.value("identity", Json::object()), "identity"); id.ok()) {
      t.binding.identity = *id;
    }
    t.binding.admitted_at_ms = b.value("admitted_at_ms", int64_t{0});
    t.engine = j->value("engine", "");
    t.prompt_token_ids = FromArr<int64_t>((*j)["prompt_token_ids"]);
    t.output_token_ids = FromArr<int64_t>((*j)["output_token_ids"]);
    t.logprobs = FromArr<double>((*j)["logprobs"]);
    t.finish_reason = j->value("finish_reason", "");
    t.cached_tokens = j->value("cached_tokens", int64_t{0});
    t.admitted_ms = j->value("admitted_ms", int64_t{0});
    t.finished_ms = j->value("finished_ms", int64_t{0});
    t.engine_weight_version = j->value("engine_weight_version", "");
    t.extra = j->value("extra", Json::object());
    t.version_spans = j->value("version_spans", Json::array());
    t.aborted_at_update = j->contains("aborted_at_update") ? (*j)["aborted_at_update"] : Json();
    out.push_back(std::move(t));
  }
  if (rc != SQLITE_DONE) {
    std::string msg = sqlite3_errmsg(Db(db_));
    sqlite3_finalize(st);
    return DataLoss("trajectory store '" + path_ + "': read failed after " + std::to_string(out.size()) +
                    " rows: " + msg);
  }
  sqlite3_finalize(st);
  return out;
}

Result<int64_t> TrajectoryStore::Count(const std::string& label) const {
  RC_ASSIGN_OR_RETURN(auto rows, List(label));
  return static_cast<int64_t>(rows.size());
}

}  // namespace rc::controller
