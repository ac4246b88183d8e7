#include "rolloutcore/controller/trajectory_store.h"

#include "rolloutcore/base/hash.h"
#include "rolloutcore/base/sqlite.h"
#include "rolloutcore/base/mutex.h"

namespace rc::controller {
namespace {

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
  RC_ASSIGN_OR_RETURN(sqlite::Database db, sqlite::Database::OpenStateFile(path, "trajectory store", must_exist));
  std::unique_ptr<TrajectoryStore> s(new TrajectoryStore(std::move(db), path));
  TrajectoryStore* sp = s.get();
  rc::MutexLock lock(sp->mu_);  // not shared yet: uncontended, keeps db_ checked
  if (must_exist) {
    auto has_table = sp->db_.HasTable("trajectories");
    if (!has_table.ok() || !*has_table) {
      return DataLoss("trajectory store '" + path + "' has no trajectories table, but the state dir says it existed");
    }
  }
  auto fail = [&](const Status& e) { return Internal("trajectory store '" + path + "': " + e.message()); };
  Status ddl = sp->db_.Exec(
      "PRAGMA journal_mode=WAL;"
      "CREATE TABLE IF NOT EXISTS trajectories ("
      " id INTEGER PRIMARY KEY, rollout_id TEXT NOT NULL, label TEXT NOT NULL, generation INTEGER NOT NULL,"
      " body TEXT NOT NULL, checksum TEXT);"
      "CREATE INDEX IF NOT EXISTS trajectories_label ON trajectories(label);");
  if (!ddl.ok()) return fail(ddl);
  // Stores written before rows were checksummed: add the column (their rows stay unchecked).
  auto has_checksum = sp->db_.HasColumn("trajectories", "checksum");
  if (!has_checksum.ok()) return fail(has_checksum.status());
  if (!*has_checksum) {
    Status alter = sp->db_.Exec("ALTER TABLE trajectories ADD COLUMN checksum TEXT");
    if (!alter.ok()) return fail(alter);
  }
  return s;
}

TrajectoryStore::~TrajectoryStore() = default;

Status TrajectoryStore::Insert(const Trajectory& t) {
  rc::MutexLock lock(mu_);
  sqlite::Statement st(db_,
                       "INSERT INTO trajectories (rollout_id, label, generation, body, checksum) VALUES (?,?,?,?,?)");
  const std::string body = ToJson(t).dump();
  st.Bind(1, t.binding.rollout_id).Bind(2, t.binding.version.label).Bind(3, t.binding.version.generation);
  st.Bind(4, body).Bind(5, RowChecksum(t.binding.rollout_id, t.binding.version.label, body));
  if (Status s = st.Run(); !s.ok()) return Unavailable("trajectory store insert failed: " + s.message());
  return OkStatus();
}

Result<std::vector<Trajectory>> TrajectoryStore::List(const std::string& label, int64_t limit) const {
  rc::MutexLock lock(mu_);
  std::string sql = "SELECT id, rollout_id, label, body, checksum FROM trajectories";
  if (!label.empty()) sql += " WHERE label = ?";
  sql += " ORDER BY id";
  if (limit >= 0) sql += " LIMIT " + std::to_string(limit);
  sqlite::Statement st(db_, sql);
  if (!label.empty()) st.Bind(1, label);
  std::vector<Trajectory> out;
  auto text = [&](int col) { return st.Text(col); };
  while (st.Step()) {
    // A row that does not read back as written is an error for the whole read: never a
    // shorter answer that looks complete.
    const std::string where = "trajectory store '" + path_ + "' row " + std::to_string(st.Int(0));
    const std::string body = text(3);
    if (!st.IsNull(4) && text(4) != RowChecksum(text(1), text(2), body)) {
      return DataLoss(where + ": checksum mismatch (the row was changed after it was written)");
    }
    auto j = ParseJson(body, "trajectory row");
    if (!j.ok() || !j->is_object() || !(*j).contains("binding") || !(*j)["binding"].is_object()) {
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
  if (Status s = st.status(); !s.ok()) {
    return DataLoss("trajectory store '" + path_ + "': read failed after " + std::to_string(out.size()) +
                    " rows: " + s.message());
  }
  return out;
}

Result<int64_t> TrajectoryStore::Count(const std::string& label) const {
  RC_ASSIGN_OR_RETURN(auto rows, List(label));
  return static_cast<int64_t>(rows.size());
}

}  // namespace rc::controller
