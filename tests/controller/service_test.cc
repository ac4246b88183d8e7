// ControllerService with real threads and SQLite state, over FakeEngine adapters and a
// completion function that reports the engine's live label, as the embedded engine does.
#include "rolloutcore/controller/service.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <filesystem>
#include <thread>

#include "rolloutcore/controller/http_server.h"
#include "testing/fake_engine.h"

namespace rc::controller {
namespace {

namespace fs = std::filesystem;

class StaticVersions : public VersionSource {
 public:
  Result<lifecycle::UpdateTarget> Resolve(const std::string& model, const std::string& version) override {
    if (version.rfind("v", 0) != 0) return NotFound("version " + version + " of " + model + " is not committed");
    lifecycle::UpdateTarget t;
    t.label = version;
    t.model = model;
    t.identity.content_digest = "d-" + version;
    t.identity.checkpoint = model + "@" + version;
    return t;
  }
  Result<std::vector<Commit>> WaitForCommits(const std::string&, uint64_t after, int64_t timeout_ms) override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return !commits_.empty() && commits_.back().seq > after; });
    std::vector<VersionSource::Commit> out;
    for (const auto& c : commits_) {
      if (c.seq > after) out.push_back(c);
    }
    return out;
  }
  void AddCommit(const std::string& v) {
    std::lock_guard<std::mutex> lock(mu_);
    commits_.push_back({commits_.size() + 1, v});
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<VersionSource::Commit> commits_;
};

struct Engines {
  std::vector<std::unique_ptr<rc::testing::FakeEngine>> fakes;
  std::vector<std::unique_ptr<rc::testing::FaultInjectingAdapter>> faulty;

  std::vector<EngineHandle> Make(int n) {
    std::vector<EngineHandle> out;
    for (int i = 0; i < n; ++i) {
      fakes.push_back(std::make_unique<rc::testing::FakeEngine>("v0", "d-v0"));
      auto shared = fakes.back()->shared();
      auto* fake = fakes.back().get();
      EngineHandle h;
      h.name = "fake-" + std::to_string(i);
      // The handle owns a fault wrapper around the fake (the fake outlives the service).
      auto wrapper = std::make_unique<rc::testing::FaultInjectingAdapter>(fake);
      faulty.push_back(nullptr);
      h.adapter = std::move(wrapper);
      h.complete = [shared, fake](const Json& body) -> Result<Json> {
        fake->StartRequest();
        std::string label;
        {
          std::lock_guard<std::mutex> lock(shared->mu);
          label = shared->label;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        fake->EndRequest();
        Json choice{{"index", 0}, {"text", "x"}, {"finish_reason", "length"}, {"token_ids", {5, 6, 7}},
                    {"prompt_token_ids", body["prompt"]}, {"weight_version", label},
                    {"logprobs", {{"token_logprobs", {-0.5, -0.25, -1.0}}}}};
        return Json{{"choices", {choice}}, {"usage", {{"prompt_tokens", 3}, {"prompt_tokens_details", {{"cached_tokens", 0}}}}}};
      };
      out.push_back(std::move(h));
    }
    return out;
  }
};

std::string TempDir(const std::string& name) {
  auto p = fs::temp_directory_path() / ("rc_ctl_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p.string();
}

ServiceOptions Options(const std::string& dir) {
  ServiceOptions o;
  o.state_dir = dir;
  o.runner.drain_poll_interval_ms = 1;
  return o;
}

TEST(ControllerServiceTest, RolloutsAreBoundAndUpdatesCommit) {
  auto dir = TempDir("basic");
  StaticVersions versions;
  Engines e;
  auto svc = std::move(ControllerService::Create(e.Make(1), &versions, Options(dir))).value();
  auto r1 = svc->Rollout(Json{{"prompt_token_ids", {1, 2, 3}}, {"max_tokens", 3}});
  ASSERT_TRUE(r1.ok()) << r1.status().ToString();
  EXPECT_EQ((*r1)["binding"]["label"], "v0");
  EXPECT_EQ((*r1)["binding"]["generation"], 0);
  EXPECT_EQ((*r1)["binding"]["identity"]["content_digest"], "d-v0");

  auto id = svc->RequestUpdate("m", "v1");
  ASSERT_TRUE(id.ok());
  auto done = svc->WaitForUpdate(*id, 10000);
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  EXPECT_EQ((*done)["outcome"], "committed") << done->dump();
  EXPECT_TRUE((*done)["engines"][0]["evidence"].contains("validated"));

  auto r2 = svc->Rollout(Json{{"prompt", {4, 5}}, {"rollout_id", "mine"}});
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ((*r2)["binding"]["label"], "v1");
  EXPECT_EQ((*r2)["binding"]["rollout_id"], "mine");
  EXPECT_EQ((*r2)["binding"]["identity"]["checkpoint"], "m@v1");

  auto v0 = svc->trajectories()->List("v0").value();
  auto v1 = svc->trajectories()->List("v1").value();
  ASSERT_EQ(v0.size(), 1u);
  ASSERT_EQ(v1.size(), 1u);
  EXPECT_EQ(v1[0].output_token_ids, (std::vector<int64_t>{5, 6, 7}));
  EXPECT_EQ(v1[0].engine_weight_version, "v1");
  EXPECT_EQ(v1[0].logprobs.size(), 3u);

  EXPECT_EQ(svc->RequestUpdate("m", "bogus").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(svc->Rollout(Json{{"max_tokens", 3}}).status().code(), StatusCode::kInvalidArgument);
  std::string metrics = svc->Metrics();
  EXPECT_NE(metrics.find("rolloutcore_updates_total{engine=\"fake-0\",outcome=\"committed\"} 1"), std::string::npos);
  fs::remove_all(dir);
}

// Issue 13 #14: inputs the engine would read differently are refused before admission, naming
// the field, and nothing is recorded for them.
TEST(ControllerServiceTest, RolloutInputsTheEngineWouldMisreadAreRefused) {
  auto dir = TempDir("inputs");
  StaticVersions versions;
  Engines e;
  auto svc = std::move(ControllerService::Create(e.Make(1), &versions, Options(dir))).value();
  struct Case {
    Json body;
    std::string field;
  } cases[] = {
      {Json{{"prompt_token_ids", "abc"}}, "prompt_token_ids:"},
      {Json{{"prompt_token_ids", Json::array()}}, "prompt_token_ids:"},
      {Json{{"prompt_token_ids", {1, "x"}}}, "prompt_token_ids[1]"},
      {Json{{"prompt", {{1, 2}, {3}}}}, "prompt[0]"},
      {Json{{"prompt", {1, 2}}, {"stream", true}}, "stream:"},
  };
  for (const auto& c : cases) {
    auto r = svc->Rollout(c.body);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << c.body.dump() << " -> " << r.status().ToString();
    EXPECT_NE(r.status().message().find(c.field), std::string::npos) << c.body.dump() << " -> " << r.status().message();
  }
  EXPECT_TRUE(svc->trajectories()->List("v0").value().empty()) << "nothing admitted, nothing stored";
  auto ok = svc->Rollout(Json{{"prompt", "text"}, {"stream", false}});
  EXPECT_TRUE(ok.ok()) << ok.status().ToString();
  fs::remove_all(dir);
}

TEST(ControllerServiceTest, LeaseModeAndRestartKeepState) {
  auto dir = TempDir("lease");
  StaticVersions versions;
  Engines e;
  {
    auto svc = std::move(ControllerService::Create(e.Make(1), &versions, Options(dir))).value();
    auto b = svc->Admit("lease-1");
    ASSERT_TRUE(b.ok());
    EXPECT_EQ((*b)["label"], "v0");
    ASSERT_TRUE(svc->FinishLease("lease-1", Json{{"token_ids", {9, 9}}, {"finish_reason", "stop"}}).ok());
    EXPECT_EQ(svc->FinishLease("lease-1", Json::object()).code(), StatusCode::kNotFound);
    ASSERT_TRUE(svc->Admit("lease-2").ok());  // still active at the "crash"
    auto id = svc->RequestUpdate("m", "v1");
    ASSERT_TRUE(id.ok());
    // lease-2 holds the drain; finish it so the update can commit.
    ASSERT_TRUE(svc->FinishLease("lease-2", Json{{"token_ids", {1}}}).ok());
    auto done = svc->WaitForUpdate(*id, 10000);
    ASSERT_TRUE(done.ok());
    EXPECT_EQ((*done)["outcome"], "committed");
    ASSERT_TRUE(svc->Admit("lease-3").ok());
  }
  // Restart on the same state dir: READY on v1, lease-3 interrupted, trajectories kept.
  auto svc = std::move(ControllerService::Create(e.Make(1), &versions, Options(dir))).value();
  auto st = svc->StatusJson();
  EXPECT_EQ(st["engines"][0]["state"], "READY");
  EXPECT_EQ(st["engines"][0]["label"], "v1");
  EXPECT_EQ(st["engines"][0]["counters"]["interrupted"], 1);
  EXPECT_EQ(svc->trajectories()->List("").value().size(), 2u);
  auto journal = svc->Journal(0, 0).value();
  bool interrupted = false;
  for (const auto& r : journal["records"]) interrupted = interrupted || (r["event"] == "interrupted" && r["rollout"] == "lease-3");
  EXPECT_TRUE(interrupted);
  fs::remove_all(dir);
}

TEST(ControllerServiceTest, MaxUpdatingKeepsOtherEnginesServing) {
  auto dir = TempDir("multi");
  StaticVersions versions;
  Engines e;
  auto handles = e.Make(2);
  // Slow resumes so each update takes a while.
  for (auto& h : handles) {
    rc::testing::Fault slow;
    slow.kind = rc::testing::Fault::Kind::kDelay;
    slow.delay = std::chrono::milliseconds(150);
    static_cast<rc::testing::FaultInjectingAdapter*>(h.adapter.get())->Set("resume", slow);
  }
  auto svc = std::move(ControllerService::Create(std::move(handles), &versions, Options(dir))).value();
  auto id = svc->RequestUpdate("m", "v1");
  ASSERT_TRUE(id.ok());
  int served = 0, both_down = 0;
  for (int i = 0; i < 100; ++i) {
    auto st = svc->StatusJson();
    bool any_ready = st["engines"][0]["state"] == "READY" || st["engines"][1]["state"] == "READY";
    if (!any_ready) ++both_down;
    if (svc->Rollout(Json{{"prompt", {1}}}).ok()) ++served;
    std::this_thread::sleep_for(std::chrono::milliseconds(3));
  }
  auto done = svc->WaitForUpdate(*id, 10000);
  ASSERT_TRUE(done.ok());
  EXPECT_EQ((*done)["outcome"], "committed");
  EXPECT_EQ(both_down, 0) << "with --max-updating 1 one engine keeps serving";
  EXPECT_EQ(served, 100);
  fs::remove_all(dir);
}

TEST(ControllerServiceTest, TaintedEngineRefusesRolloutsUntilRecovered) {
  auto dir = TempDir("taint");
  StaticVersions versions;
  Engines e;
  auto handles = e.Make(1);
  auto* faulty = static_cast<rc::testing::FaultInjectingAdapter*>(handles[0].adapter.get());
  rc::testing::Fault fail;
  fail.kind = rc::testing::Fault::Kind::kFailAfter;
  fail.code = StatusCode::kInternal;
  faulty->Set("install", fail);
  auto svc = std::move(ControllerService::Create(std::move(handles), &versions, Options(dir))).value();
  auto done = svc->WaitForUpdate(svc->RequestUpdate("m", "v1").value(), 10000);
  ASSERT_TRUE(done.ok());
  EXPECT_EQ((*done)["outcome"], "tainted");
  auto refused = svc->Rollout(Json{{"prompt", {1}}});
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable);
  faulty->Set("install", rc::testing::Fault{});
  auto rec = svc->WaitForUpdate(svc->RequestRecovery("m", "v0").value(), 10000);
  ASSERT_TRUE(rec.ok());
  EXPECT_EQ((*rec)["outcome"], "committed") << rec->dump();
  auto ok = svc->Rollout(Json{{"prompt", {1}}});
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ((*ok)["binding"]["label"], "v0");
  EXPECT_EQ((*ok)["binding"]["generation"], 1);
  fs::remove_all(dir);
}

TEST(ControllerHttpTest, EndpointsAndErrors) {
  auto dir = TempDir("http");
  StaticVersions versions;
  Engines e;
  auto svc = std::move(ControllerService::Create(e.Make(1), &versions, Options(dir))).value();
  ControllerHttpServer server(svc.get(), "127.0.0.1", 0);
  ASSERT_TRUE(server.Start().ok());
  httplib::Client c("127.0.0.1", server.port());
  auto r = c.Post("/v1/rollouts", R"({"prompt_token_ids":[1,2],"max_tokens":2})", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(Json::parse(r->body)["binding"]["label"], "v0");
  r = c.Post("/v1/rollouts", "{not json", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_NE(r->body.find("malformed"), std::string::npos);
  r = c.Post("/v1/updates", R"({"model":"m"})", "application/json");
  EXPECT_EQ(r->status, 400);
  EXPECT_NE(r->body.find("version"), std::string::npos);
  r = c.Post("/v1/updates", R"({"model":"m","version":"v1"})", "application/json");
  ASSERT_EQ(r->status, 202);
  std::string id = Json::parse(r->body)["id"];
  r = c.Get(("/v1/updates/" + id + "?wait_ms=10000").c_str());
  ASSERT_EQ(r->status, 200);
  EXPECT_EQ(Json::parse(r->body)["outcome"], "committed");
  r = c.Post("/v1/rollouts:admit", R"({"rollout_id":"L1"})", "application/json");
  ASSERT_EQ(r->status, 200);
  EXPECT_EQ(Json::parse(r->body)["label"], "v1");
  r = c.Post("/v1/rollouts/L1:finish", R"({"token_ids":[3]})", "application/json");
  EXPECT_EQ(r->status, 200);
  r = c.Get("/v1/trajectories?label=v1&format=jsonl");
  ASSERT_EQ(r->status, 200);
  EXPECT_NE(r->body.find("\"L1\""), std::string::npos);
  r = c.Get("/v1/journal?since=abc");
  EXPECT_EQ(r->status, 400);
  r = c.Get("/v1/updates/u-999");
  EXPECT_EQ(r->status, 404);
  r = c.Get("/metrics");
  EXPECT_NE(r->body.find("rolloutcore_admissions_total"), std::string::npos);
  server.Stop();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace rc::controller
