// Issue 36: claims that stay true in the async modes. Each test reproduces one defect a black-box
// probe found (the number in its comment) and fails on the code before the fix: ControllerService
// with real threads and SQLite state over FakeEngine adapters (which accept every policy mode).
#include <gtest/gtest.h>

#include <future>
#include <set>

#include "controller/service_fixture.h"
#include "controller/sqlite_write_lock.h"

namespace rc::controller {
namespace {

using testing::Engines;
using testing::Options;
using testing::StaticVersions;
using testing::TempDir;
using testing::WriteLock;
namespace fs = std::filesystem;

rc::testing::FaultInjectingAdapter* Faulty(EngineHandle& h) {
  return static_cast<rc::testing::FaultInjectingAdapter*>(h.adapter.get());
}

std::map<std::string, Trajectory> RowsById(ControllerService* svc) {
  std::map<std::string, Trajectory> out;
  const std::vector<Trajectory> rows = svc->trajectories()->List("").value();
  for (const auto& t : rows) {
    EXPECT_FALSE(out.count(t.binding.rollout_id)) << "two rows for " << t.binding.rollout_id;
    out[t.binding.rollout_id] = t;
  }
  return out;
}

// Waits (bounded) until the lease's binding is finished: its row was written before that.
void WaitEnded(ControllerService* svc, const std::string& id) {
  for (int i = 0; i < 1000 && svc->controller(0)->Binding(id); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_FALSE(svc->controller(0)->Binding(id)) << id << " is still active";
}

// The value of an unlabelled sample of `name` in a /metrics page; -1 when absent.
int64_t MetricValue(const std::string& metrics, const std::string& name) {
  const std::string key = "\n" + name + " ";
  const size_t at = metrics.find(key);
  if (at == std::string::npos) return -1;
  return std::stoll(metrics.substr(at + key.size()));
}

// Status counters == metrics == rows, for the two outcome counters.
void ExpectCountersAgreeWithRows(ControllerService* svc) {
  int64_t rows_aborted = 0, rows_boundaries = 0;
  for (const auto& [id, t] : RowsById(svc)) {
    if (!t.aborted_at_update.is_null()) ++rows_aborted;
    if (t.version_spans.is_array() && t.version_spans.size() > 1) {
      rows_boundaries += static_cast<int64_t>(t.version_spans.size()) - 1;
    }
  }
  int64_t status_aborted = 0, status_spans = 0;
  const Json status = svc->StatusJson();  // (a range-for over a temporary's member would dangle)
  for (const auto& e : status["engines"]) {
    status_aborted += e["counters"]["aborted_at_update"].get<int64_t>();
    status_spans += e["counters"]["inflight_spans"].get<int64_t>();
  }
  const std::string metrics = svc->Metrics();
  EXPECT_EQ(status_aborted, rows_aborted) << "status aborted_at_update vs rows";
  EXPECT_EQ(MetricValue(metrics, "rolloutcore_rollouts_aborted_at_update_total"), rows_aborted) << metrics;
  EXPECT_EQ(status_spans, rows_boundaries) << "status inflight_spans vs rows";
  EXPECT_EQ(MetricValue(metrics, "rolloutcore_inflight_spans_total"), rows_boundaries) << metrics;
}

// #1: a lease an abort-mode update ended is ended everywhere: its heartbeat and finish answer 409
// naming the update, its one row says aborted_at_update (without the output reported after), and
// it holds no later drain.
TEST(InFlightClaimsTest, ALeaseAnAbortUpdateEndedIsEndedEverywhere) {
  auto dir = TempDir("lease_abort");
  StaticVersions versions;
  Engines e;
  auto svc = std::move(ControllerService::Create(e.Make(1), &versions, Options(dir))).value();
  ASSERT_TRUE(svc->Admit("L-abort").ok());
  auto id = svc->RequestUpdate("m", "v1", lifecycle::PolicyMode::kAbort);
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  auto done = svc->WaitForUpdate(*id, 10000);
  ASSERT_TRUE(done.ok());
  ASSERT_EQ((*done)["outcome"], "committed") << done->dump();

  auto beat = svc->ExtendLease("L-abort");
  ASSERT_EQ(beat.status().code(), StatusCode::kFailedPrecondition)
      << "heartbeat of an ended lease: " << (beat.ok() ? beat->dump() : "");
  EXPECT_NE(beat.status().message().find("ended by update"), std::string::npos) << beat.status().message();
  Status fin = svc->FinishLease("L-abort", Json{{"token_ids", {1, 2, 3}}, {"finish_reason", "stop"}});
  ASSERT_EQ(fin.code(), StatusCode::kFailedPrecondition) << fin.ToString();
  EXPECT_NE(fin.message().find("v1"), std::string::npos) << "names the update's target: " << fin.message();

  auto rows = RowsById(svc.get());
  ASSERT_EQ(rows.count("L-abort"), 1u) << "exactly one row";
  const Trajectory& t = rows["L-abort"];
  EXPECT_EQ(t.finish_reason, "abort");
  ASSERT_TRUE(t.aborted_at_update.is_object()) << t.aborted_at_update.dump();
  EXPECT_EQ(t.aborted_at_update["reason"], "mode_abort");
  EXPECT_EQ(t.aborted_at_update["target"], "v1");
  EXPECT_TRUE(t.output_token_ids.empty()) << "output reported after the end is not stored as bound";
  EXPECT_FALSE(svc->controller(0)->Binding("L-abort")) << "the binding is finished";
  ExpectCountersAgreeWithRows(svc.get());

  // The next (strict) update drains at once: nothing of the ended lease holds it.
  auto next = svc->WaitForUpdate(svc->RequestUpdate("m", "v2").value(), 10000);
  ASSERT_TRUE(next.ok());
  EXPECT_EQ((*next)["outcome"], "committed") << next->dump();
  fs::remove_all(dir);
}

// #1, keep mode with --max-staleness 0: the update ends the lease (reason max_staleness), everywhere.
// Without a staleness bound a lease lives through a keep update; its finish carries the engine's
// version_spans (checked: spans that do not cover the tokens are refused and the lease stays
// open), and a finish without them records the updates it spanned and no spans.
TEST(InFlightClaimsTest, LeasesUnderKeepAreEndedByStalenessOrFinishedWithCheckedSpans) {
  auto dir = TempDir("lease_keep");
  StaticVersions versions;
  Engines e;
  {
    auto o = Options(dir);
    o.runner.max_staleness = 0;
    auto svc = std::move(ControllerService::Create(e.Make(1), &versions, o)).value();
    ASSERT_TRUE(svc->Admit("L-stale").ok());
    auto done = svc->WaitForUpdate(svc->RequestUpdate("m", "v1", lifecycle::PolicyMode::kKeep).value(), 10000);
    ASSERT_TRUE(done.ok());
    ASSERT_EQ((*done)["outcome"], "committed") << done->dump();
    WaitEnded(svc.get(), "L-stale");
    auto rows = RowsById(svc.get());
    ASSERT_EQ(rows.count("L-stale"), 1u);
    EXPECT_EQ(rows["L-stale"].aborted_at_update["reason"], "max_staleness");
    EXPECT_EQ(svc->ExtendLease("L-stale").status().code(), StatusCode::kFailedPrecondition);
    EXPECT_EQ(svc->FinishLease("L-stale", Json{{"token_ids", {4}}}).code(), StatusCode::kFailedPrecondition);
    EXPECT_EQ(RowsById(svc.get()).size(), 1u);
    ExpectCountersAgreeWithRows(svc.get());
  }
  fs::remove_all(dir);
  Engines e2;
  auto svc = std::move(ControllerService::Create(e2.Make(1), &versions, Options(dir))).value();
  ASSERT_TRUE(svc->Admit("L-spans").ok());
  ASSERT_TRUE(svc->Admit("L-quiet").ok());
  auto done = svc->WaitForUpdate(svc->RequestUpdate("m", "v1", lifecycle::PolicyMode::kKeep).value(), 10000);
  ASSERT_EQ((*done)["outcome"], "committed") << done->dump();
  ASSERT_TRUE(svc->ExtendLease("L-spans").ok()) << "it lives through the keep update";
  const Json bad = Json::array({Json{{"from_token", 0}, {"to_token", 2}, {"label", "v0"}, {"kv", "fresh"}}});
  Status refused = svc->FinishLease("L-spans", Json{{"token_ids", {1, 2, 3}}, {"version_spans", bad}});
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.ToString();
  EXPECT_NE(refused.message().find("version_spans"), std::string::npos) << refused.message();
  const Json good = Json::array({Json{{"from_token", 0}, {"to_token", 2}, {"label", "v0"}, {"kv", "fresh"}},
                                 Json{{"from_token", 2}, {"to_token", 3}, {"label", "v1"}, {"kv", "stale"}}});
  ASSERT_TRUE(svc->FinishLease("L-spans", Json{{"token_ids", {1, 2, 3}}, {"version_spans", good}}).ok());
  ASSERT_TRUE(svc->FinishLease("L-quiet", Json{{"token_ids", {1, 2, 3}}}).ok());
  auto rows = RowsById(svc.get());
  ASSERT_EQ(rows["L-spans"].version_spans.size(), 2u) << rows["L-spans"].version_spans.dump();
  EXPECT_EQ(rows["L-spans"].version_spans[1]["label"], "v1");
  EXPECT_EQ(rows["L-spans"].version_spans[1]["content_digest"], "d-v1");
  EXPECT_TRUE(rows["L-quiet"].version_spans.empty()) << "no span is claimed for tokens nobody attributed";
  EXPECT_EQ(rows["L-quiet"].extra["spanned_updates"].size(), 1u) << rows["L-quiet"].extra.dump();
  ExpectCountersAgreeWithRows(svc.get());
  fs::remove_all(dir);
}

// #1, strict with --drain-policy abort: a lease the drain aborted is over too: 409 on heartbeat
// and finish, one row (finish_reason abort), and the update proceeds.
TEST(InFlightClaimsTest, ALeaseTheDrainAbortedIsEndedEverywhere) {
  auto dir = TempDir("lease_drain_abort");
  StaticVersions versions;
  Engines e;
  auto o = Options(dir);
  o.runner.drain_policy = lifecycle::DrainPolicy::kAbort;
  o.runner.deadlines.drain_ms = 100;
  auto svc = std::move(ControllerService::Create(e.Make(1), &versions, o)).value();
  ASSERT_TRUE(svc->Admit("L-drain").ok());
  auto done = svc->WaitForUpdate(svc->RequestUpdate("m", "v1").value(), 10000);
  ASSERT_TRUE(done.ok());
  ASSERT_EQ((*done)["outcome"], "committed") << done->dump();
  WaitEnded(svc.get(), "L-drain");
  auto beat = svc->ExtendLease("L-drain");
  EXPECT_EQ(beat.status().code(), StatusCode::kFailedPrecondition) << (beat.ok() ? beat->dump() : "");
  EXPECT_NE(beat.status().message().find("drain_abort"), std::string::npos) << beat.status().message();
  EXPECT_EQ(svc->FinishLease("L-drain", Json{{"token_ids", {1}}}).code(), StatusCode::kFailedPrecondition);
  auto rows = RowsById(svc.get());
  ASSERT_EQ(rows.count("L-drain"), 1u);
  EXPECT_EQ(rows["L-drain"].finish_reason, "abort");
  EXPECT_EQ(rows["L-drain"].binding.version.label, "v0");
  EXPECT_TRUE(rows["L-drain"].output_token_ids.empty());
  fs::remove_all(dir);
}

// #4: a version whose validation fails on one engine is not rolled to the next; the update says
// why, the version is marked failed (also after a restart), and the untouched engine serves on.
TEST(InFlightClaimsTest, AVersionThatFailedValidationIsNotRolledToTheNextEngine) {
  auto dir = TempDir("bad_version");
  StaticVersions versions;
  Engines e;
  std::string id;
  {
    auto handles = e.Make(2);
    std::vector<rc::testing::FaultInjectingAdapter*> faulty;
    faulty.reserve(handles.size());
    for (auto& h : handles) faulty.push_back(Faulty(h));
    auto svc = std::move(ControllerService::Create(std::move(handles), &versions, Options(dir))).value();
    rc::testing::Fault corrupt;
    corrupt.kind = rc::testing::Fault::Kind::kCorruptDigest;
    for (auto* f : faulty) f->Set("digest", corrupt);  // from now on no engine can prove a new version
    id = svc->RequestUpdate("m", "v1").value();
    auto done = svc->WaitForUpdate(id, 10000);
    ASSERT_TRUE(done.ok());
    ASSERT_TRUE((*done)["done"].get<bool>()) << done->dump();
    int tainted = 0, not_started = 0;
    for (const auto& eng : (*done)["engines"]) {
      if (eng["outcome"] == "tainted") ++tainted;
      if (eng["outcome"] == "not_started") {
        ++not_started;
        EXPECT_NE(eng["reason"].get<std::string>().find("stopped"), std::string::npos) << eng.dump();
        EXPECT_NE(eng["reason"].get<std::string>().find("in validation"), std::string::npos) << eng.dump();
      }
    }
    EXPECT_EQ(tainted, 1) << "one engine tried v1, not the fleet: " << done->dump(2);
    EXPECT_EQ(not_started, 1) << done->dump(2);
    ASSERT_TRUE((*done)["stopped"].is_string()) << done->dump();
    const Json st = svc->StatusJson();
    int ready_on_v0 = 0;
    for (const auto& eng : st["engines"]) ready_on_v0 += eng["state"] == "READY" && eng["label"] == "v0";
    EXPECT_EQ(ready_on_v0, 1) << st.dump(2);
    auto again = svc->RequestUpdate("m", "v1");
    EXPECT_EQ(again.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(again.status().message().find("marked failed"), std::string::npos) << again.status().message();
    EXPECT_TRUE(svc->Rollout(Json{{"prompt", {1}}}).ok()) << "the untouched engine still serves";
  }
  // The update journal keeps the mark; retry_failed clears it (journaled), and that too survives.
  {
    auto svc = std::move(ControllerService::Create(e.Make(2), &versions, Options(dir))).value();
    EXPECT_EQ(svc->RequestUpdate("m", "v1").status().code(), StatusCode::kFailedPrecondition);
    EXPECT_TRUE(svc->UpdateStatus(id).value()["stopped"].is_string());
    auto retried = svc->RequestUpdate("m", "v1", std::nullopt, /*retry_failed=*/true);
    ASSERT_TRUE(retried.ok()) << retried.status().ToString();
    (void)svc->WaitForUpdate(*retried, 10000);
  }
  auto svc = std::move(ControllerService::Create(e.Make(2), &versions, Options(dir))).value();
  auto again = svc->RequestUpdate("m", "v1");
  EXPECT_NE(again.status().code(), StatusCode::kFailedPrecondition) << again.status().ToString();
  fs::remove_all(dir);
}

// #5: a request for a version whose update is in progress in another mode is refused naming both
// modes (the same mode still joins the running update).
TEST(InFlightClaimsTest, AConflictingModeForAPendingUpdateIsRefusedNamingBoth) {
  auto dir = TempDir("mode_conflict");
  StaticVersions versions;
  Engines e;
  auto handles = e.Make(1);
  rc::testing::Fault slow;
  slow.kind = rc::testing::Fault::Kind::kDelay;
  slow.delay = std::chrono::milliseconds(300);
  Faulty(handles[0])->Set("resume", slow);
  auto svc = std::move(ControllerService::Create(std::move(handles), &versions, Options(dir))).value();
  const std::string id = svc->RequestUpdate("m", "v1", lifecycle::PolicyMode::kKeep).value();
  EXPECT_EQ(svc->RequestUpdate("m", "v1", lifecycle::PolicyMode::kKeep).value(), id) << "same mode: same update";
  auto other = svc->RequestUpdate("m", "v1", lifecycle::PolicyMode::kStrict);
  ASSERT_EQ(other.status().code(), StatusCode::kFailedPrecondition) << (other.ok() ? *other : "");
  EXPECT_NE(other.status().message().find("keep"), std::string::npos) << other.status().message();
  EXPECT_NE(other.status().message().find("strict"), std::string::npos) << other.status().message();
  EXPECT_NE(other.status().message().find(id), std::string::npos) << other.status().message();
  auto done = svc->WaitForUpdate(id, 10000);
  ASSERT_TRUE(done.ok());
  EXPECT_EQ((*done)["outcome"], "committed");
  EXPECT_EQ((*done)["mode"], "keep");
  fs::remove_all(dir);
}

// #6: counters count outcomes. A proxied rollout an abort-mode update meant to end, but which
// finished normally first (its completion answers "length"), is no aborted_at_update anywhere:
// not in its row, not in /v1/status, not in /metrics.
TEST(InFlightClaimsTest, CountersCountOutcomesNotIntents) {
  auto dir = TempDir("counters");
  StaticVersions versions;
  Engines e;
  auto handles = e.Make(1);
  auto started = std::make_shared<std::promise<void>>();
  auto release = std::make_shared<std::promise<void>>();
  std::shared_future<void> released = release->get_future().share();
  auto plain = handles[0].complete;
  std::atomic<bool> first{true};
  handles[0].complete = [plain, started, released, &first](const Json& body) -> Result<Json> {
    // Generated under v0 (finish_reason "length"); its answer is still on the way back when the
    // update quiesces: it finished before the abort reached it.
    Result<Json> answer = plain(body);
    if (first.exchange(false)) {
      started->set_value();
      released.wait();
    }
    return answer;
  };
  auto svc = std::move(ControllerService::Create(std::move(handles), &versions, Options(dir))).value();
  auto rollout = std::async(std::launch::async, [&] {
    return svc->Rollout(Json{{"prompt", {1, 2}}, {"rollout_id", "R-1"}});
  });
  started->get_future().wait();
  auto id = svc->RequestUpdate("m", "v1", lifecycle::PolicyMode::kAbort).value();
  // The update quiesced with R-1 in its abort list (the intent) ...
  for (int i = 0; i < 2000 && !svc->controller(0)->InFlight("R-1"); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(svc->controller(0)->InFlight("R-1")) << "the update recorded R-1 as one it ends";
  release->set_value();
  auto r = rollout.get();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE((*r)["aborted_at_update"].is_null()) << "it was not aborted: " << r->dump();
  ASSERT_EQ((*svc->WaitForUpdate(id, 10000))["outcome"], "committed");
  // ... which none of the counters reports as an outcome.
  auto rows = RowsById(svc.get());
  ASSERT_EQ(rows.count("R-1"), 1u);
  EXPECT_TRUE(rows["R-1"].aborted_at_update.is_null());
  ExpectCountersAgreeWithRows(svc.get());
  EXPECT_EQ(svc->controller(0)->counters().aborted_at_update, 0);

  // A lease the next abort update ends is counted once, everywhere (and after a restart).
  ASSERT_TRUE(svc->Admit("L-2").ok());
  ASSERT_EQ(
      (*svc->WaitForUpdate(svc->RequestUpdate("m", "v2", lifecycle::PolicyMode::kAbort).value(), 10000))["outcome"],
      "committed");
  WaitEnded(svc.get(), "L-2");
  ExpectCountersAgreeWithRows(svc.get());
  EXPECT_EQ(svc->controller(0)->counters().aborted_at_update, 1);
  svc.reset();
  svc = std::move(ControllerService::Create(e.Make(1, "v2"), &versions, Options(dir))).value();
  ExpectCountersAgreeWithRows(svc.get());
  EXPECT_EQ(svc->controller(0)->counters().aborted_at_update, 1);
  fs::remove_all(dir);
}

// #8: a finish racing the lease's expiry is answered 409 expired (never 404 "no lease", never a
// stored finish), while the expiry's record is still being written; the record then lands once.
TEST(InFlightClaimsTest, AFinishRacingExpiryIsAnsweredExpired) {
  auto dir = TempDir("expiry_race");
  StaticVersions versions;
  Engines e;
  auto o = Options(dir);
  o.lease_timeout_ms = 50;
  auto svc = std::move(ControllerService::Create(e.Make(1), &versions, o)).value();
  ASSERT_TRUE(svc->Admit("L-race").ok());
  {
    WriteLock lock(dir + "/trajectories.db");  // the expiry's row cannot be written yet
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    Status fin = svc->FinishLease("L-race", Json{{"token_ids", {7}}});
    EXPECT_EQ(fin.code(), StatusCode::kFailedPrecondition) << fin.ToString();
    EXPECT_NE(fin.message().find("expired"), std::string::npos) << fin.message();
    auto beat = svc->ExtendLease("L-race");
    EXPECT_EQ(beat.status().code(), StatusCode::kFailedPrecondition) << beat.status().ToString();
  }
  // The expiry retries its record (row, then finish) once the store is free.
  for (int i = 0; i < 1000 && svc->controller(0)->active_count() != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  auto rows = RowsById(svc.get());
  ASSERT_EQ(rows.count("L-race"), 1u);
  EXPECT_EQ(rows["L-race"].finish_reason, "expired");
  EXPECT_TRUE(rows["L-race"].output_token_ids.empty());
  EXPECT_EQ(svc->FinishLease("L-race", Json{{"token_ids", {7}}}).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(svc->controller(0)->active_count(), 0);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace rc::controller
