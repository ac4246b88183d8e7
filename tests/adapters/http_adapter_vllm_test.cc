// The HTTP adapter against a vLLM-shaped server on loopback: empty-200 cache resets are not
// taken as evidence; the canary is. The server here models vLLM's documented behaviour: a
// prefix cache that a reset may or may not clear, cached_tokens in usage, /metrics gauges.
#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <thread>

#include "rolloutcore/adapters/http_adapter.h"
#include "rolloutcore/base/json.h"

namespace rc::adapters {
namespace {

class FakeVllm {
 public:
  explicit FakeVllm(bool reset_really_clears) : clears_(reset_really_clears) {
    svr_.Get("/health", [](const httplib::Request&, httplib::Response& r) { r.status = 200; });
    svr_.Get("/rc/engine/state", [](const httplib::Request&, httplib::Response& r) { r.status = 404; });
    svr_.Get("/metrics", [this](const httplib::Request&, httplib::Response& r) {
      r.set_content("# HELP vllm:num_requests_running x\nvllm:num_requests_running{model_name=\"m\"} " +
                        std::to_string(running_.load()) + "\nvllm:num_requests_waiting{model_name=\"m\"} 0\n" +
                        "vllm:num_requests_running_total 99\n",
                    "text/plain");
    });
    svr_.Post("/pause", [this](const httplib::Request&, httplib::Response& r) {
      paused_ = true;
      r.set_content(R"({"status":"paused"})", "application/json");
    });
    svr_.Post("/resume", [this](const httplib::Request&, httplib::Response& r) {
      paused_ = false;
      r.set_content(R"({"status":"resumed"})", "application/json");
    });
    svr_.Get("/is_paused", [this](const httplib::Request&, httplib::Response& r) {
      r.set_content(Json{{"is_paused", paused_.load()}}.dump(), "application/json");
    });
    svr_.Post("/reset_prefix_cache", [this](const httplib::Request& q, httplib::Response& r) {
      reset_query_ = q.get_param_value("reset_running_requests");
      if (clears_) cached_ = false;
      r.status = 200;  // vLLM: empty body whatever happened
    });
    svr_.Get("/weight_info", [](const httplib::Request&, httplib::Response& r) {
      r.set_content(R"({"weight_version":"v7"})", "application/json");
    });
    svr_.Post("/v1/completions", [this](const httplib::Request& q, httplib::Response& r) {
      Json body = Json::parse(q.body);
      int64_t n = static_cast<int64_t>(body["prompt"].size());
      int64_t hit = cached_ ? n : 0;
      cached_ = true;
      r.set_content(Json{{"usage", {{"prompt_tokens", n}, {"prompt_tokens_details", {{"cached_tokens", hit}}}}}}.dump(),
                    "application/json");
    });
    port_ = svr_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { svr_.listen_after_bind(); });
    while (!svr_.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ~FakeVllm() {
    svr_.stop();
    thread_.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  std::atomic<int> running_{0};
  std::string reset_query_;

 private:
  httplib::Server svr_;
  std::thread thread_;
  int port_ = 0;
  bool clears_;
  std::atomic<bool> paused_{false};
  std::atomic<bool> cached_{false};
};

HttpAdapterOptions Options(const std::string& url) {
  HttpAdapterOptions o;
  o.base_url = url;
  return o;
}

template <typename T>
Result<T> Await(Pending<T> p) {
  if (!p.WaitFor(std::chrono::seconds(10))) return DeadlineExceeded("test wait");
  return p.Get();
}

lifecycle::UpdateTarget Target() {
  lifecycle::UpdateTarget t;
  t.label = "v8";
  return t;
}

TEST(HttpAdapterVllmTest, DescribesVllmAndReadsDrainFromMetrics) {
  FakeVllm vllm(true);
  HttpEngineAdapter a(Options(vllm.url()));
  auto d = a.Describe();
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->kind, "vllm");
  EXPECT_FALSE(d->offers_content_digest);
  EXPECT_EQ(a.flavor(), EngineFlavor::kVllm);
  vllm.running_ = 3;
  auto drain = Await(a.GetDrainStatus());
  ASSERT_TRUE(drain.ok()) << drain.status().ToString();
  EXPECT_EQ(drain->running, 3) << "the _total counter with a longer name is not summed in";
  auto label = Await(a.ReadLabel());
  ASSERT_TRUE(label.ok());
  EXPECT_EQ(label->label, "v7");
  EXPECT_EQ(Await(a.ReadContentDigest()).status().code(), StatusCode::kUnimplemented);
  EXPECT_EQ(Await(a.Install(Target(), false)).status().code(), StatusCode::kFailedPrecondition)
      << "refused up front: the runner returns to READY on the old version";
}

TEST(HttpAdapterVllmTest, CanaryAcceptsARealReset) {
  FakeVllm vllm(true);
  HttpEngineAdapter a(Options(vllm.url()));
  ASSERT_TRUE(a.Describe().ok());
  ASSERT_TRUE(Await(a.Stage(Target())).ok());  // warms the canary
  auto pause = Await(a.Pause(lifecycle::PauseMode::kWait));
  ASSERT_TRUE(pause.ok());
  EXPECT_TRUE(pause->paused);
  auto reset = Await(a.ResetCache(lifecycle::CacheKind::kPrefix));
  ASSERT_TRUE(reset.ok());
  EXPECT_EQ(vllm.reset_query_, "true");
  auto resume = Await(a.Resume());
  ASSERT_TRUE(resume.ok()) << resume.status().ToString();
  EXPECT_FALSE(resume->paused_after);
}

TEST(HttpAdapterVllmTest, CanaryCatchesAResetThatDidNothing) {
  FakeVllm vllm(false);  // answers 200 but keeps the blocks, as vLLM may
  HttpEngineAdapter a(Options(vllm.url()));
  ASSERT_TRUE(a.Describe().ok());
  ASSERT_TRUE(Await(a.Stage(Target())).ok());
  ASSERT_TRUE(Await(a.Pause(lifecycle::PauseMode::kWait)).ok());
  ASSERT_TRUE(Await(a.ResetCache(lifecycle::CacheKind::kPrefix)).ok());
  auto resume = Await(a.Resume());
  ASSERT_FALSE(resume.ok());
  EXPECT_EQ(resume.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(resume.status().message().find("64 cached prompt tokens"), std::string::npos);
}

TEST(HttpAdapterVllmTest, UnreachableEngineIsUnavailableNamingTheUrl) {
  HttpEngineAdapter a(Options("http://127.0.0.1:1"));
  auto d = a.Describe();
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(d.status().message().find("127.0.0.1:1"), std::string::npos);
}

TEST(PrometheusTest, ParsesSamples) {
  std::string text = "# TYPE a gauge\na{x=\"1\"} 2\na{x=\"2\"} 3.5\nab 100\n";
  EXPECT_DOUBLE_EQ(PrometheusValue(text, "a").value(), 5.5);
  EXPECT_DOUBLE_EQ(PrometheusValue(text, "ab").value(), 100);
  EXPECT_EQ(PrometheusValue(text, "zz").status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace rc::adapters
