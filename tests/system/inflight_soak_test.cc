// Issue 36, the soak: updates in every policy mode (strict, keep, recompute, abort) racing proxied
// rollouts and leases, with the controller killed (-9) at random moments and restarted over its
// state dir. Real processes (system_fixture.h), a seeded random schedule (ROLLOUTCORE_SOAK_SEED;
// ROLLOUTCORE_SOAK_ITERATIONS, default 20), bounded in time.
//
// At the end, over every controller incarnation's journal (one state dir) and the trajectory store:
//  * every admitted rollout and lease has exactly one outcome: a finish record with exactly one
//    trajectory row, or an interrupted record (a kill between admission and finish); never two rows;
//  * each row agrees with its finish record (finish_reason, aborted_at_update) and with what its
//    client was told: a proxied rollout answered 200 has the row of that answer (tokens,
//    aborted_at_update); a lease finish answered 200 stored the client's tokens; one answered 409
//    stored none of them;
//  * /v1/status counters == /metrics == the rows of finished rollouts (aborted_at_update,
//    inflight_spans).
#include <atomic>
#include <future>
#include <mutex>
#include <random>
#include <set>

#include "system/system_fixture.h"

namespace rc::system_test {
namespace {

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v == nullptr || *v == '\0' ? fallback : std::atoll(v);
}

int64_t MetricValue(const std::string& metrics, const std::string& name) {
  const std::string key = "\n" + name + " ";
  const size_t at = metrics.find(key);
  return at == std::string::npos ? -1 : std::stoll(metrics.substr(at + key.size()));
}

// What a client was told.
struct Told {
  bool lease = false;
  int status = 0;                 // proxied: the rollout's answer; lease: the finish's answer (0: none)
  Json answer;                    // proxied 200: the body
  std::vector<int64_t> reported;  // lease: the tokens its finish reported
};

class InFlightSoakTest : public SystemTest {};

TEST_F(InFlightSoakTest, ModesRacingLeasesRolloutsAndKillsKeepEveryRecordTrue) {
  const uint64_t seed = static_cast<uint64_t>(EnvInt("ROLLOUTCORE_SOAK_SEED", 36));
  const int iterations = static_cast<int>(EnvInt("ROLLOUTCORE_SOAK_ITERATIONS", 20));
  std::mt19937_64 rng(seed);
  std::cout << "[ soak ] seed " << seed << ", " << iterations << " iterations" << std::endl;
  StackOptions o;
  o.controller_args = {"--lease-timeout", "3", "--max-staleness", "2"};
  Stack s = StartStack(o);
  ASSERT_NE(s.ctl, 0);
  static constexpr const char* kModes[] = {"strict", "keep", "recompute", "abort"};
  std::mutex told_mu;
  std::map<std::string, Told> told;
  std::string committed = "v0";
  int kills = 0, next_version = 1;
  const int64_t deadline = NowMs() + 240000;  // the whole soak stays within a few minutes
  for (int it = 0; it < iterations && NowMs() < deadline; ++it) {
    SCOPED_TRACE("iteration " + std::to_string(it));
    const std::string version = "v" + std::to_string(next_version++);
    Step(s, version);
    const std::string mode = kModes[rng() % 4];
    const int ctl = s.ctl;
    // Proxied rollouts, long enough to be in flight at the update.
    std::vector<std::future<void>> clients;
    for (int k = 0; k < 3; ++k) {
      const std::string id = "p" + std::to_string(it) + "-" + std::to_string(k);
      const int max_tokens = 40 + static_cast<int>(rng() % 200);
      clients.push_back(std::async(std::launch::async, [&, id, ctl, max_tokens, k] {
        Reply r = Rollout(ctl, Prompt(10, it * 7 + k), max_tokens, id);
        std::lock_guard<std::mutex> lock(told_mu);
        Told& t = told[id];
        t.status = r.status;
        if (r.status == 200) t.answer = r.json;
      }));
    }
    // Leases: one finished quickly, one finished after the update, one abandoned (it expires).
    std::vector<std::string> leases;
    for (int k = 0; k < 3; ++k) {
      const std::string id = "l" + std::to_string(it) + "-" + std::to_string(k);
      Reply a = Http(ctl, "POST", "/v1/rollouts:admit", Json{{"rollout_id", id}});
      std::lock_guard<std::mutex> lock(told_mu);
      told[id].lease = true;
      if (a.status == 200) leases.push_back(id);
    }
    auto finish = [&](const std::string& id, int ctl_port) {
      std::vector<int64_t> tokens{static_cast<int64_t>(rng() % 200) + 3, static_cast<int64_t>(rng() % 200) + 3};
      Reply f = Http(ctl_port, "POST", "/v1/rollouts/" + id + ":finish",
                     Json{{"token_ids", tokens}, {"finish_reason", "stop"}});
      std::lock_guard<std::mutex> lock(told_mu);
      told[id].status = f.status;
      told[id].reported = tokens;
    };
    if (!leases.empty()) finish(leases[0], ctl);
    std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 30));
    Reply req = Http(ctl, "POST", "/v1/updates", Json{{"model", kModelName}, {"version", version}, {"mode", mode}});
    const bool kill = rng() % 3 == 0;
    if (kill) {
      std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 150));
      s.ctl_proc->Kill();
      ++kills;
    }
    for (auto& c : clients) c.wait();
    if (kill) RestartController(s, /*kill_first=*/false);
    if (leases.size() > 1) finish(leases[1], s.ctl);
    // The update ends (or a restart ended it); a tainted engine is recovered to the committed one.
    if (!kill && req.status == 202) {
      Json done = WaitUpdate(s.ctl, req.json.value("id", std::string()));
      if (done.value("outcome", std::string()) == "committed") committed = version;
    }
    // Settled: READY, or TAINTED (a kill mid-mutation); any other state is an update still running.
    std::string state = StateOf(s.ctl);
    for (int64_t end = NowMs() + 60000; state != "READY" && state != "TAINTED" && NowMs() < end;) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      state = StateOf(s.ctl);
    }
    ASSERT_TRUE(state == "READY" || state == "TAINTED") << state;
    Json st = EngineStatus(s.ctl);
    if (st.value("state", std::string()) == "TAINTED") {
      Json rec = WaitUpdate(s.ctl, RequestUpdate(s.ctl, st.value("label", committed), /*recovery=*/true));
      ASSERT_EQ(rec.value("outcome", std::string()), "committed") << rec.dump();
    }
    committed = EngineStatus(s.ctl).value("label", committed);
    std::cout << "[ soak ] " << it << ": " << mode << " to " << version << (kill ? " (controller killed)" : "")
              << " -> serving " << committed << std::endl;
  }
  // Let every abandoned lease expire (lease timeout 3 s), then read everything back.
  std::this_thread::sleep_for(std::chrono::milliseconds(3500));
  ASSERT_TRUE(WaitState(s.ctl, "READY", 30000));
  const std::vector<Json> journal = Journal(s.ctl);
  std::map<std::string, Json> finishes;
  std::set<std::string> admitted, interrupted;
  for (const Json& r : journal) {
    const std::string ev = r.value("event", std::string());
    const std::string id = r["rollout"].is_string() ? r["rollout"].get<std::string>() : "";
    if (ev == "admit") admitted.insert(id);
    if (ev == "finish") {
      EXPECT_FALSE(finishes.count(id)) << id << " finished twice";
      finishes[id] = r["detail"];
    }
    if (ev == "interrupted") interrupted.insert(id);
  }
  std::map<std::string, Json> rows;
  for (const Json& t : Trajectories(s.ctl, "")) {
    const std::string id = t["binding"]["rollout_id"];
    EXPECT_FALSE(rows.count(id)) << id << " has two rows";
    rows[id] = t;
  }
  int64_t rows_aborted = 0, rows_boundaries = 0, checked_told = 0;
  for (const std::string& id : admitted) {
    SCOPED_TRACE("rollout " + id);
    const bool finished = finishes.count(id) > 0;
    EXPECT_TRUE(finished != (interrupted.count(id) > 0)) << "exactly one ending in the journal";
    if (!finished) continue;
    ASSERT_TRUE(rows.count(id)) << "finished without a row: " << finishes[id].dump();
    const Json& row = rows[id];
    const Json& fin = finishes[id];
    if (fin.contains("finish_reason")) {
      EXPECT_EQ(row["finish_reason"], fin["finish_reason"]) << fin.dump();
    }
    const bool row_aborted = row.contains("aborted_at_update") && !row["aborted_at_update"].is_null();
    const bool fin_aborted = fin.contains("aborted_at_update") && !fin["aborted_at_update"].is_null();
    if (!fin.contains("trajectory_error")) {
      EXPECT_EQ(row_aborted, fin_aborted) << "row " << row.dump() << " vs finish " << fin.dump();
      rows_aborted += row_aborted ? 1 : 0;
      const Json spans = row.value("version_spans", Json::array());
      if (spans.is_array() && spans.size() > 1) rows_boundaries += static_cast<int64_t>(spans.size()) - 1;
    }
    std::lock_guard<std::mutex> lock(told_mu);
    auto t = told.find(id);
    if (t == told.end()) continue;
    if (!t->second.lease && t->second.status == 200) {
      ++checked_told;
      EXPECT_EQ(row.value("output_token_ids", Json::array()), t->second.answer["choices"][0]["token_ids"]);
      EXPECT_EQ(row["aborted_at_update"], t->second.answer["aborted_at_update"]);
    }
    if (t->second.lease && t->second.status == 200) {
      ++checked_told;
      EXPECT_EQ(row.value("output_token_ids", std::vector<int64_t>()), t->second.reported)
          << "the finish it was told stored";
      EXPECT_FALSE(row_aborted);
    }
    if (t->second.lease && t->second.status == 409) {
      ++checked_told;
      EXPECT_TRUE(row.value("output_token_ids", Json::array()).empty())
          << "a refused finish stored nothing: " << row.dump();
      EXPECT_TRUE(row_aborted || row["finish_reason"] == "expired") << row.dump();
    }
  }
  // Every proxied rollout answered 200 was admitted and has its row (checked above).
  for (const auto& [id, t] : told) {
    if (!t.lease && t.status == 200) {
      EXPECT_TRUE(admitted.count(id)) << id << " was answered but never admitted";
    }
  }
  Json status = EngineStatus(s.ctl);
  const std::string metrics = Http(s.ctl, "GET", "/metrics").text;
  EXPECT_EQ(status["counters"]["aborted_at_update"].get<int64_t>(), rows_aborted);
  EXPECT_EQ(MetricValue(metrics, "rolloutcore_rollouts_aborted_at_update_total"), rows_aborted);
  EXPECT_EQ(status["counters"]["inflight_spans"].get<int64_t>(), rows_boundaries);
  EXPECT_EQ(MetricValue(metrics, "rolloutcore_inflight_spans_total"), rows_boundaries);
  Figure("soak_admitted", static_cast<int64_t>(admitted.size()), "rollouts");
  Figure("soak_interrupted", static_cast<int64_t>(interrupted.size()), "rollouts");
  Figure("soak_aborted_at_update", rows_aborted, "rows");
  Figure("soak_span_boundaries", rows_boundaries, "boundaries");
  Figure("soak_controller_kills", kills, "kills");
  Figure("soak_client_answers_checked", checked_told, "answers");
}

}  // namespace
}  // namespace rc::system_test
