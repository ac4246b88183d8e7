// TrajectoryStore: every finished rollout with the binding it ran under, in SQLite.
//
// One row per rollout: binding (rollout id, engine, label, generation, content digest,
// checkpoint, run, step), prompt and output token ids, logprobs, finish reason, cached prompt
// tokens, and timings. Rows are written once, when the rollout finishes (or is recorded
// interrupted), and never changed; each carries a checksum of what was written.
//
// Damage is an error, never a shorter answer: Open runs SQLite's integrity check on an existing
// file (must_exist: a missing or empty file is DataLoss too, not a fresh store), and List fails
// with DataLoss naming the row when a row does not read back as written or the read stops early.
//
// Thread safety: all methods may be called from any thread (one connection, one mutex).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "rolloutcore/base/json.h"
#include "rolloutcore/base/sqlite.h"
#include "rolloutcore/base/mutex.h"
#include "rolloutcore/lifecycle/types.h"

namespace rc::controller {

struct Trajectory {
  lifecycle::RolloutBinding binding;
  std::string engine;
  std::vector<int64_t> prompt_token_ids;
  std::vector<int64_t> output_token_ids;
  std::vector<double> logprobs;
  std::string finish_reason;  // stop | length | abort | interrupted | error
  int64_t cached_tokens = 0;
  int64_t admitted_ms = 0;    // wall clock
  int64_t finished_ms = 0;    // wall clock
  std::string engine_weight_version;  // what the engine reported per choice, when it did
  Json extra = Json::object();        // client-supplied fields (lease mode)
  // Which policy produced each output token (docs/lifecycle.md, "Policy modes"):
  // [{from_token, to_token, label, generation, content_digest, kv, ...}]; empty for rows that do
  // not record them (lease mode, rows written before policy modes existed).
  Json version_spans = Json::array();
  // Set when an in-flight update ended the rollout: {update, target, reason, ...}; else null.
  Json aborted_at_update = nullptr;
};

Json ToJson(const Trajectory& t);

class TrajectoryStore {
 public:
  static Result<std::unique_ptr<TrajectoryStore>> Open(const std::string& path, bool must_exist = false);
  ~TrajectoryStore();
  Status Insert(const Trajectory& t);
  // Rows in insertion order; label empty = all.
  Result<std::vector<Trajectory>> List(const std::string& label, int64_t limit = -1) const;
  Result<int64_t> Count(const std::string& label) const;
  const std::string& path() const { return path_; }

 private:
  TrajectoryStore(sqlite::Database db, std::string path) : db_(std::move(db)), path_(std::move(path)) {}
  mutable rc::Mutex mu_;
  sqlite::Database db_ GUARDED_BY(mu_);
  std::string path_;
};

}  // namespace rc::controller
