// HttpEngineAdapter::ProbeIdentity (issue 13): against a real `engine serve` server (rolloutcore
// flavour, GET /rc/engine/state) and against a vLLM-shaped server whose rolloutcore worker
// extension answers POST /collective_rpc {"method": "rc_label"} once per worker.
#include <gtest/gtest.h>
#include <httplib.h>

#include <mutex>
#include <thread>

#include "rolloutcore/adapters/http_adapter.h"
#include "rolloutcore/base/json.h"
#include "rolloutcore/engine/http_server.h"
#include "rolloutcore/engine/loader.h"

namespace rc::adapters {
namespace {

// vLLM with the worker extension: /collective_rpc answers rc_describe for one worker, and every
// other method with the scripted `results` (one object per worker), or 404 when `results` is null.
class FakeVllmWithExtension {
 public:
  FakeVllmWithExtension() {
    svr_.Get("/health", [](const httplib::Request&, httplib::Response& r) { r.status = 200; });
    svr_.Get("/version", [](const httplib::Request&, httplib::Response& r) {
      r.set_content(R"({"version":"0.26.0"})", "application/json");
    });
    svr_.Get("/rc/engine/state", [](const httplib::Request&, httplib::Response& r) { r.status = 404; });
    svr_.Get("/weight_info", [](const httplib::Request&, httplib::Response& r) {
      r.set_content(R"({"weight_version":"v7"})", "application/json");
    });
    svr_.Post("/collective_rpc", [this](const httplib::Request& q, httplib::Response& r) {
      std::lock_guard<std::mutex> l(mu_);
      if (Json::parse(q.body, nullptr, false).value("method", "") == "rc_describe") {
        // Describe() finds the extension first (one worker); the probe's answers are scripted.
        r.set_content(R"({"results":[{"ok":true,"tp_rank":0,"tp_size":1,"boot_id":"b-1","label":"v7","generation":0}]})",
                      "application/json");
        return;
      }
      last_body_ = q.body;
      if (results_.is_null()) {
        r.status = 404;
        return;
      }
      r.set_content(Json{{"results", results_}}.dump(), "application/json");
    });
    port_ = svr_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { svr_.listen_after_bind(); });
    while (!svr_.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ~FakeVllmWithExtension() {
    svr_.stop();
    thread_.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  void SetResults(Json results) {
    std::lock_guard<std::mutex> l(mu_);
    results_ = std::move(results);
  }
  std::string last_body() {
    std::lock_guard<std::mutex> l(mu_);
    return last_body_;
  }

 private:
  httplib::Server svr_;
  std::thread thread_;
  int port_ = 0;
  std::mutex mu_;
  Json results_;           // guarded by mu_
  std::string last_body_;  // guarded by mu_
};

Json Worker(const std::string& label, int64_t generation, const std::string& boot, Json digest) {
  return Json{{"label", label}, {"generation", generation}, {"boot_id", boot}, {"content_digest", digest}};
}

TEST(HttpAdapterIdentityTest, VllmWorkersThatAgreeAreOneIdentity) {
  FakeVllmWithExtension vllm;
  HttpAdapterOptions o;
  o.base_url = vllm.url();
  HttpEngineAdapter a(o);
  ASSERT_TRUE(a.Describe().ok());
  ASSERT_EQ(a.flavor(), EngineFlavor::kVllm);
  vllm.SetResults(Json::array({Worker("v3", 2, "b-1", "00000000000000aa"), Worker("v3", 2, "b-2", "00000000000000aa")}));
  auto e = AwaitPending(a.ProbeIdentity(), 5000, "probe");
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  EXPECT_EQ(e->label, "v3");
  EXPECT_EQ(e->install_generation, 2);
  EXPECT_EQ(e->boot_id, "b-1,b-2,vllm=0.26.0")
      << "every worker process's boot id (any worker's restart changes it) and vLLM's release";
  EXPECT_EQ(e->content_digest, "00000000000000aa");
  Json sent = Json::parse(vllm.last_body());
  EXPECT_EQ(sent["method"], "rc_label");
  EXPECT_EQ(sent["args"], Json::array());
  EXPECT_EQ(sent["kwargs"], Json::object());

  // A null digest is "none cached", not an error.
  vllm.SetResults(Json::array({Worker("v3", 2, "b-1", nullptr)}));
  e = AwaitPending(a.ProbeIdentity(), 5000, "probe");
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  EXPECT_TRUE(e->content_digest.empty());
}

TEST(HttpAdapterIdentityTest, VllmWorkersThatDisagreeOrAnswerGarbageAreErrors) {
  FakeVllmWithExtension vllm;
  HttpAdapterOptions o;
  o.base_url = vllm.url();
  HttpEngineAdapter a(o);
  ASSERT_TRUE(a.Describe().ok());
  vllm.SetResults(Json::array({Worker("v3", 2, "b-1", nullptr), Worker("v3", 1, "b-1", nullptr)}));
  auto e = AwaitPending(a.ProbeIdentity(), 5000, "probe");
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(e.status().message().find("workers disagree"), std::string::npos) << e.status().message();
  EXPECT_NE(e.status().message().find("worker 1 reports label 'v3' generation 1"), std::string::npos)
      << e.status().message();

  vllm.SetResults(Json::array({Json{{"label", "v3"}, {"boot_id", "b"}}}));  // no generation
  e = AwaitPending(a.ProbeIdentity(), 5000, "probe");
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("generation"), std::string::npos) << e.status().message();

  vllm.SetResults(Json::array());
  e = AwaitPending(a.ProbeIdentity(), 5000, "probe");
  EXPECT_EQ(e.status().code(), StatusCode::kDataLoss) << e.status().ToString();

  vllm.SetResults(Json());  // no /collective_rpc: the engine cannot tell who it is
  e = AwaitPending(a.ProbeIdentity(), 5000, "probe");
  EXPECT_EQ(e.status().code(), StatusCode::kUnimplemented) << e.status().ToString();
}

TEST(HttpAdapterIdentityTest, RolloutcoreEngineReportsBootIdInstallGenerationAndCachedDigest) {
  engine::EngineOptions eo;
  eo.num_threads = 1;
  eo.weight_version = "v0";
  auto eng = engine::CreateEngine({"tiny", "dummy", 3}, eo);
  ASSERT_TRUE(eng.ok()) << eng.status().ToString();
  engine::ServerOptions so;
  so.port = 0;
  engine::EngineServer server(eng->get(), so);
  ASSERT_TRUE(server.Start().ok());
  HttpAdapterOptions o;
  o.base_url = "http://127.0.0.1:" + std::to_string(server.port());
  HttpEngineAdapter a(o);
  // Without Describe() first (a restarted controller): the probe finds the flavour itself.
  auto e = AwaitPending(a.ProbeIdentity(), 5000, "probe");
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  EXPECT_EQ(a.flavor(), EngineFlavor::kRolloutcore);
  EXPECT_EQ(e->boot_id, (*eng)->boot_id());
  EXPECT_EQ(e->label, "v0");
  EXPECT_EQ(e->install_generation, 0);
  EXPECT_TRUE(e->content_digest.empty()) << "nothing cached yet; the probe computes nothing";
  auto d = AwaitPending(a.ReadContentDigest(), 60000, "digest");
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  e = AwaitPending(a.ProbeIdentity(), 5000, "probe");
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->content_digest, d->content_digest) << "cached by the digest read";
  server.Stop();
}

// FP8 serving over HTTP (docs/fp8.md): GET /rc/weights/digest carries the FP8 image's digests, the
// adapter reads them into the digest evidence, and a damaged image reads as a mismatch with detail.
TEST(HttpAdapterIdentityTest, RolloutcoreEngineServingFp8ReportsItsImageDigests) {
  engine::EngineOptions eo;
  eo.num_threads = 1;
  eo.weight_version = "v0";
  eo.quantization = "fp8_per_tensor";
  auto eng = engine::CreateEngine({"tiny", "dummy", 3}, eo);
  ASSERT_TRUE(eng.ok()) << eng.status().ToString();
  engine::ServerOptions so;
  so.port = 0;
  so.enable_fault_injection = true;
  engine::EngineServer server(eng->get(), so);
  ASSERT_TRUE(server.Start().ok());
  const std::string url = "http://127.0.0.1:" + std::to_string(server.port());
  HttpAdapterOptions o;
  o.base_url = url;
  HttpEngineAdapter a(o);
  auto d = AwaitPending(a.ReadContentDigest(), 60000, "digest");
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  ASSERT_TRUE(d->quantized.has_value());
  EXPECT_EQ(d->quantized->quantization, "fp8_per_tensor");
  EXPECT_TRUE(d->quantized->Match()) << d->quantized->detail;
  EXPECT_FALSE(d->quantized->live.empty());

  // The fault route checks its value: per tensor there is nothing to swizzle; unknown names are refused.
  httplib::Client c(url);
  auto bad = c.Post("/rc/fault", R"({"fp8_install": "swizzled_scales"})", "application/json");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400) << bad->body;
  auto unknown = c.Post("/rc/fault", R"({"fp8_install": "bogus"})", "application/json");
  ASSERT_TRUE(unknown);
  EXPECT_EQ(unknown->status, 400);
  EXPECT_NE(unknown->body.find("wrong_scale"), std::string::npos) << unknown->body;
  auto armed = c.Post("/rc/fault", R"({"fp8_install": "wrong_scale"})", "application/json");
  ASSERT_TRUE(armed);
  EXPECT_EQ(armed->status, 200) << armed->body;

  // An install (the engine's own bytes written again) quantizes; the armed fault damages the image.
  engine::Engine* e = eng->get();
  ASSERT_TRUE(e->Pause(engine::PauseMode::kWait).ok());
  ASSERT_TRUE(e->InstallLive([](int, engine::ParameterStore*) { return OkStatus(); }, "v1", 1, true,
                             receiver::InstallWrites::kInPlace)
                  .ok());
  d = AwaitPending(a.ReadContentDigest(), 60000, "digest");
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  ASSERT_TRUE(d->quantized.has_value());
  EXPECT_FALSE(d->quantized->Match());
  EXPECT_NE(d->quantized->live, d->quantized->expected);
  EXPECT_NE(d->quantized->detail.find("scales"), std::string::npos) << d->quantized->detail;
  e->Resume();
  server.Stop();
}

}  // namespace
}  // namespace rc::adapters
