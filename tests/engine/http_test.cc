// End-to-end tests of the engine's HTTP API over real sockets (label e2e).
#include <httplib.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <future>

#include <thread>

#include "rolloutcore/base/json.h"
#include "rolloutcore/engine/http_server.h"
#include "rolloutcore/engine/loader.h"

namespace rc::engine {
namespace {

class HttpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    EngineOptions o;
    o.num_threads = 2;
    o.block_size = 8;
    auto e = CreateEngine({"tiny", "dummy", 3}, o);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    engine_ = std::move(e).value();
    ServerOptions so;
    so.port = 0;
    so.model_name = "tiny";
    server_ = std::make_unique<EngineServer>(engine_.get(), so);
    ASSERT_TRUE(server_->Start().ok());
    client_ = std::make_unique<httplib::Client>("127.0.0.1", server_->port());
    client_->set_read_timeout(60, 0);
  }
  void TearDown() override {
    server_->Stop();
  }
  Json Post(const std::string& path, const std::string& body, int expect = 200) {
    auto res = client_->Post(path.c_str(), body, "application/json");
    EXPECT_TRUE(res) << path;
    if (!res) return Json();
    EXPECT_EQ(res->status, expect) << path << " " << body << " -> " << res->body;
    auto j = ParseJson(res->body);
    return j.ok() ? *j : Json();
  }
  Json Get(const std::string& path) {
    auto res = client_->Get(path.c_str());
    EXPECT_TRUE(res && res->status == 200) << path;
    if (!res) return Json();
    auto j = ParseJson(res->body);
    return j.ok() ? *j : Json();
  }
  std::string Metrics() {
    auto res = client_->Get("/metrics");
    return res ? res->body : "";
  }
  // The JSON chunks of a streamed completion (the [DONE] line left out).
  std::vector<Json> Stream(const std::string& body) {
    std::vector<Json> out;
    auto res = client_->Post("/v1/completions", body, "application/json");
    EXPECT_TRUE(res && res->status == 200) << body;
    if (!res) return out;
    for (size_t pos = 0; (pos = res->body.find("data: ", pos)) != std::string::npos;) {
      const size_t end = res->body.find("\n\n", pos);
      const std::string payload = res->body.substr(pos + 6, end - pos - 6);
      pos = end;
      if (payload == "[DONE]") break;
      auto j = ParseJson(payload);
      EXPECT_TRUE(j.ok()) << payload;
      if (j.ok()) out.push_back(*j);
    }
    return out;
  }
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<EngineServer> server_;
  std::unique_ptr<httplib::Client> client_;
};

constexpr const char* kPrompt = "[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20]";

TEST_F(HttpTest, CompletionsWithPrefixCacheUsageAndMetrics) {
  const std::string body = std::string(R"({"prompt":)") + kPrompt +
                           R"(,"max_tokens":6,"temperature":0,"logprobs":3,"return_token_ids":true})";
  Json a = Post("/v1/completions", body);
  ASSERT_EQ(a["object"], "text_completion");
  ASSERT_EQ(a["choices"].size(), 1u);
  EXPECT_EQ(a["choices"][0]["token_ids"].size(), 6u);
  EXPECT_EQ(a["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(a["choices"][0]["weight_version"], "default");
  EXPECT_EQ(a["choices"][0]["logprobs"]["token_logprobs"].size(), 6u);
  EXPECT_EQ(a["usage"]["prompt_tokens"], 20);
  EXPECT_EQ(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  Json b = Post("/v1/completions", body);
  EXPECT_EQ(b["usage"]["prompt_tokens_details"]["cached_tokens"], 16);
  EXPECT_EQ(a["choices"][0]["token_ids"], b["choices"][0]["token_ids"]);
  const std::string m = Metrics();
  EXPECT_NE(m.find("vllm:prefix_cache_hits_total{model_name=\"tiny\"} 16"), std::string::npos) << m;
  EXPECT_NE(m.find("vllm:prefix_cache_queries_total{model_name=\"tiny\"} 40"), std::string::npos) << m;
  EXPECT_NE(m.find("vllm:num_requests_running"), std::string::npos);
  // Text prompt through the byte-level fallback tokenizer.
  Json t = Post("/v1/completions", R"({"prompt":"hello","max_tokens":2,"temperature":0,"return_token_ids":true})");
  EXPECT_EQ(t["choices"][0]["prompt_token_ids"], Json::array({104, 101, 108, 108, 111}));
}

TEST_F(HttpTest, SeveralPromptsAndNChoices) {
  Json j = Post("/v1/completions",
                R"({"prompt":[[1,2,3],[4,5]],"n":2,"max_tokens":3,"temperature":0,"return_token_ids":true})");
  ASSERT_EQ(j["choices"].size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(j["choices"][i]["index"], i);
  EXPECT_EQ(j["choices"][0]["prompt_token_ids"], Json::array({1, 2, 3}));
  EXPECT_EQ(j["choices"][2]["prompt_token_ids"], Json::array({4, 5}));
  // Greedy: both choices of one prompt agree.
  EXPECT_EQ(j["choices"][0]["token_ids"], j["choices"][1]["token_ids"]);
  // Each prompt counts once, however many samples it has (as vLLM counts it): 3 + 2.
  EXPECT_EQ(j["usage"]["prompt_tokens"], 5);
  EXPECT_EQ(j["usage"]["completion_tokens"], 12);
}

TEST_F(HttpTest, StreamingMatchesNonStreaming) {
  const std::string base = std::string(R"({"prompt":)") + kPrompt + R"(,"max_tokens":5,"temperature":0,"return_token_ids":true)";
  Json full = Post("/v1/completions", base + "}");
  auto res = client_->Post("/v1/completions", base + R"(,"stream":true})", "application/json");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200);
  std::vector<int> ids;
  std::string finish;
  size_t pos = 0;
  bool done = false;
  while ((pos = res->body.find("data: ", pos)) != std::string::npos) {
    const size_t end = res->body.find("\n\n", pos);
    const std::string payload = res->body.substr(pos + 6, end - pos - 6);
    pos = end;
    if (payload == "[DONE]") {
      done = true;
      break;
    }
    auto j = ParseJson(payload);
    ASSERT_TRUE(j.ok()) << payload;
    for (const auto& id : (*j)["choices"][0]["token_ids"]) ids.push_back(id.get<int>());
    if (!(*j)["choices"][0]["finish_reason"].is_null()) finish = (*j)["choices"][0]["finish_reason"];
  }
  EXPECT_TRUE(done);
  EXPECT_EQ(finish, "length");
  EXPECT_EQ(Json(ids), full["choices"][0]["token_ids"]);
}

TEST_F(HttpTest, BadInputGets400NamingTheField) {
  struct Case {
    std::string body;
    std::string field;
  } cases[] = {
      {"{not json", "malformed"},
      {"[1,2]", "body"},
      {R"({"max_tokens":3})", "prompt"},
      {R"({"prompt":[1,2],"max_tokens":-1})", "max_tokens"},
      {R"({"prompt":[1,2],"max_tokens":"7"})", "max_tokens"},
      {R"({"prompt":[1,"x"]})", "prompt[1]"},
      {R"({"prompt":[1,2],"temperature":"hot"})", "temperature"},
      {R"({"prompt":[1,2],"logprobs":99})", "logprobs"},
      {R"({"prompt":[1,2],"cache_salt":""})", "cache_salt"},
      {R"({"prompt":[1,2],"stop_token_ids":[1,-2]})", "stop_token_ids[1]"},
      {R"({"prompt":[1,2],"top_p":0})", "top_p: must be in (0, 1], got 0"},
      {R"({"prompt":[1,2],"temperature":1e300})", "temperature: must be in [0, 1e6], got 1e+300"},
      {R"({"prompt":[1,2],"temperature":-0.5})", "temperature: must be in [0, 1e6], got -0.5"},
      {R"({"prompt":[1,2],"n":0})", "n"},
      {R"({"prompt":[1,99999]})", "prompt[1]"},
  };
  for (const auto& c : cases) {
    auto res = client_->Post("/v1/completions", c.body, "application/json");
    ASSERT_TRUE(res) << c.body;
    EXPECT_EQ(res->status, 400) << c.body << " -> " << res->body;
    EXPECT_NE(res->body.find(c.field), std::string::npos) << c.body << " -> " << res->body;
  }
  // A prompt longer than the context (tiny: 512).
  std::string long_prompt = "[";
  for (int i = 0; i < 600; ++i) long_prompt += (i ? ",1" : "1");
  long_prompt += "]";
  Json j = Post("/v1/completions", R"({"prompt":)" + long_prompt + "}", 400);
  EXPECT_NE(j["message"].get<std::string>().find("prompt"), std::string::npos);
  Post("/pause?mode=sideways", "", 400);
  Post("/update_weight_version", R"({"new_version":5})", 400);
  Post("/abort_requests", R"({"request_ids":"x"})", 400);
  // Still alive.
  EXPECT_EQ(Get("/is_paused")["is_paused"], false);
}

// Identity (issue 13): the boot id and install generation are reported by /rc/engine/state,
// /weight_info and every completion; a label change alone moves neither; an install moves the
// install generation, and /rc/engine/state reports the cached live digest once one exists.
TEST_F(HttpTest, IdentityIsReportedAndALabelChangeIsNotAnInstall) {
  Json st = Get("/rc/engine/state");
  const std::string boot = st.value("boot_id", std::string());
  EXPECT_EQ(boot, engine_->boot_id());
  EXPECT_EQ(boot.size(), 16u);
  EXPECT_EQ(st["install_generation"], 0);
  EXPECT_TRUE(st["content_digest"].is_null()) << "nothing computed yet, and the probe computes nothing";
  EXPECT_FALSE(st.contains("generation")) << "one name, one meaning: install_generation";
  Json info = Get("/weight_info");
  EXPECT_EQ(info["boot_id"], boot);
  EXPECT_EQ(info["install_generation"], 0);

  Post("/update_weight_version", R"({"new_version":"fake"})");
  Json c = Post("/v1/completions", std::string(R"({"prompt":)") + kPrompt + R"(,"max_tokens":2,"temperature":0})");
  EXPECT_EQ(c["rolloutcore"]["boot_id"], boot);
  EXPECT_EQ(c["rolloutcore"]["label"], "fake");
  EXPECT_EQ(c["rolloutcore"]["install_generation"], 0) << "a label change is not an install";
  EXPECT_EQ(c["choices"][0]["weight_version"], "fake");
  EXPECT_EQ(c["choices"][0]["install_generation"], 0);

  // An install (the engine's own path; the refit receiver uses the same) moves it.
  const ModelSpec spec = engine_->spec();
  WeightFill fill = MakeWeightFill(spec, [spec]() -> Result<std::unique_ptr<TensorSource>> {
    return MakeDummySource(spec, 4);
  });
  ASSERT_TRUE(engine_->Pause(PauseMode::kWait).ok());
  ASSERT_TRUE(engine_->InstallWeights(fill, "v1", 1).ok());
  engine_->Resume();
  c = Post("/v1/completions", std::string(R"({"prompt":)") + kPrompt + R"(,"max_tokens":2,"temperature":0})");
  EXPECT_EQ(c["rolloutcore"]["install_generation"], 1);
  EXPECT_EQ(c["choices"][0]["install_generation"], 1);
  EXPECT_EQ(c["choices"][0]["weight_version"], "v1");
  EXPECT_EQ(Get("/rc/engine/state")["install_generation"], 1);
  EXPECT_NE(Metrics().find("rolloutcore_weight_installs_total{model_name=\"tiny\"} 1"), std::string::npos);
  EXPECT_EQ(Metrics().find("rolloutcore_weight_generation"), std::string::npos);

  Json digest = Get("/rc/weights/digest");
  ASSERT_TRUE(digest.contains("content_digest"));
  EXPECT_EQ(Get("/rc/engine/state")["content_digest"], digest["content_digest"]) << "cached at this generation";
}

TEST_F(HttpTest, PauseResumeVersionStateAndReset) {
  EXPECT_EQ(Get("/weight_info")["weight_version"], "default");
  Json u = Post("/update_weight_version", R"({"new_version":"v7"})");
  EXPECT_EQ(u["success"], true);
  EXPECT_EQ(Get("/weight_info")["weight_version"], "v7");
  Post("/v1/completions", std::string(R"({"prompt":)") + kPrompt + R"(,"max_tokens":2,"temperature":0})");
  Json p = Post("/pause?mode=keep", "");
  EXPECT_EQ(p["status"], "paused");
  EXPECT_EQ(Get("/is_paused")["is_paused"], true);
  Json st = Get("/rc/engine/state");
  EXPECT_EQ(st["paused"], true);
  EXPECT_EQ(st["weight_version"], "v7");
  EXPECT_GT(st["cached_blocks"].get<int>(), 0);
  // A request sent while paused waits; reset refuses while it holds blocks? It holds none yet.
  std::thread t([&] {
    httplib::Client c("127.0.0.1", server_->port());
    c.set_read_timeout(60, 0);
    auto r = c.Post("/v1/completions", std::string(R"({"prompt":[3,4,5],"max_tokens":3,"temperature":0})"),
                    "application/json");
    EXPECT_TRUE(r && r->status == 200);
  });
  Json ev = Post("/reset_prefix_cache", "");
  EXPECT_EQ(ev["success"], true);
  EXPECT_GT(ev["freed_blocks"].get<int>(), 0);
  EXPECT_EQ(ev["blocks_in_use"], 0);
  EXPECT_EQ(Post("/resume", "")["status"], "resumed");
  t.join();
  Json ab = Post("/abort_requests", R"({"request_ids":["nope"]})");
  EXPECT_EQ(ab["status"], "aborted");
  EXPECT_EQ(ab["aborted"], 0);
  EXPECT_EQ(Get("/v1/models")["data"][0]["id"], "tiny");
  EXPECT_EQ(Post("/reset_mm_cache", "")["success"], true);
}

TEST_F(HttpTest, PauseAbortFinishesInflightRequestWithAbort) {
  Json result;
  std::thread t([&] {
    httplib::Client c("127.0.0.1", server_->port());
    c.set_read_timeout(60, 0);
    auto r = c.Post("/v1/completions", R"({"prompt":[1,2,3],"max_tokens":400,"temperature":0})", "application/json");
    ASSERT_TRUE(r);
    result = *ParseJson(r->body);
  });
  while (engine_->State().num_running == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  Post("/pause?mode=abort", "");
  t.join();
  EXPECT_EQ(result["choices"][0]["finish_reason"], "abort");
  EXPECT_NE(Metrics().find("finished_reason=\"abort\"} 1"), std::string::npos);
  Post("/resume", "");
}

TEST_F(HttpTest, AbortRequestsByCompletionId) {
  // Frozen engine (pause keep): the request is queued and cannot finish before the abort (the
  // tiny model generates 400 tokens in a few ms, faster than an HTTP round trip on a busy host).
  Post("/pause?mode=keep", "");
  Json result;
  std::thread t([&] {
    httplib::Client c("127.0.0.1", server_->port());
    c.set_read_timeout(60, 0);
    auto r = c.Post("/v1/completions", R"({"prompt":[1,2,3],"max_tokens":400,"temperature":0,"request_id":"mine"})",
                    "application/json");
    ASSERT_TRUE(r);
    result = *ParseJson(r->body);
  });
  while (engine_->State().num_running + engine_->State().num_waiting == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  Json ab = Post("/abort_requests", R"({"request_ids":["mine"]})");
  t.join();
  EXPECT_EQ(ab["aborted"], 1);
  EXPECT_EQ(result["id"], "mine");
  EXPECT_EQ(result["choices"][0]["finish_reason"], "abort");
  Post("/resume", "");
}

TEST_F(HttpTest, ResetRefusedWhileRequestHoldsBlocks) {
  // A request long enough (400 tokens) that it is still running when it has been seen running and
  // the engine is frozen right after; it used to be 50 tokens, which a loaded machine could finish
  // before the poll below saw it (then the loop never ended).
  std::atomic<bool> done{false};
  std::thread t([&] {
    httplib::Client c("127.0.0.1", server_->port());
    c.set_read_timeout(60, 0);
    c.Post("/v1/completions", R"({"prompt":[1,2,3],"max_tokens":400,"temperature":0})", "application/json");
    done = true;
  });
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (engine_->State().num_running == 0 && !done && std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const bool seen_running = !done && engine_->State().num_running > 0;
  Post("/pause?mode=keep", "");
  const bool frozen = engine_->State().num_running > 0;
  if (seen_running && frozen) {
    Json ev = Post("/reset_prefix_cache", "");
    EXPECT_EQ(ev["success"], false);
    EXPECT_EQ(ev["freed_blocks"], 0);
    EXPECT_GT(ev["blocks_in_use"].get<int>(), 0);
    ev = Post("/reset_prefix_cache?reset_running_requests=true", "");
    EXPECT_EQ(ev["success"], true);
  }
  Post("/resume", "");
  t.join();
  EXPECT_TRUE(seen_running) << "the 400-token request was never seen running (finished first, or not started in 30 s)";
  EXPECT_TRUE(frozen) << "the request was no longer running when the engine was frozen";
}

// Issue 13 #12 and #14: integer overflow and inputs that used to be accepted but served wrong
// (or ignored) are refused, naming the field.
TEST_F(HttpTest, OverflowAndSilentlyIgnoredInputsAreRefused) {
  struct Case {
    std::string path;
    std::string body;
    int status;
    std::string field;
  } cases[] = {
      {"/v1/completions", R"({"prompt":[1,2],"max_tokens":9223372036854775807})", 400, "max_tokens"},
      {"/v1/completions", R"({"prompt":[1,2],"max_tokens":9223372036854775806})", 400, "max_tokens"},
      {"/v1/completions", R"({"prompt":[1,2],"max_tokens":18446744073709551615})", 400, "max_tokens"},
      {"/v1/completions", R"({"prompt":[1,2],"logprobs":18446744073709551615})", 400, "logprobs"},
      {"/v1/completions", R"({"prompt":[1,2],"n":9223372036854775807})", 400, "n"},
      {"/v1/completions", R"({"prompt":[1,2],"best_of":4})", 400, "best_of"},
      {"/v1/completions", R"({"prompt":[1,2],"stop_token_ids":[99999]})", 400, "stop_token_ids[0]"},
      {"/v1/completions", R"({"prompt":[1,2],"request_id":"../x"})", 400, "request_id"},
      {"/v1/completions", R"({"prompt":[1,2],"request_id":"a/b"})", 400, "request_id"},
      {"/v1/completions", R"({"prompt":[1,2],"request_id":".."})", 400, "request_id"},
      {"/v1/completions", R"({"prompt":[1,2],"model":"no-such-model"})", 404, "model"},
      {"/rc/refit/stage",
       R"({"model":"m","version":"v1","directory":"http://127.0.0.1:1","timeout_ms":9223372036854775807})", 400,
       "timeout_ms"},
      {"/rc/refit/stage", R"({"model":"m","version":"v1","directory":"http://127.0.0.1:1","timeout_ms":0})", 400,
       "timeout_ms"},
      {"/rc/refit/stage", R"({"model":"","version":"v1","directory":"http://127.0.0.1:1"})", 400,
       "model: must not be empty"},
      {"/rc/refit/stage", R"({"model":"m","version":"","directory":"http://127.0.0.1:1"})", 400,
       "version: must not be empty"},
      {"/rc/refit/stage", R"({"model":"m","version":"v1","directory":"ftp://127.0.0.1:1"})", 400,
       "directory: 'ftp://127.0.0.1:1' is not the base URL of a directory"},
      {"/rc/refit/stage", R"({"model":"m","version":"v1","directory":"http://127.0.0.1:1","timeout":5})", 400,
       "timeout: unknown field"},
      {"/rc/refit/stage", R"([1,2])", 400, "body: expected a JSON object"},
      {"/rc/refit/install", R"({"version":""})", 400, "version: must not be empty"},
      {"/update_weight_version", R"({"new_version":""})", 400, "new_version: must not be empty"},
      {"/update_weight_version", R"({"new_version":"two\nlines"})", 400, "new_version: character 0x0a"},
  };
  for (const auto& c : cases) {
    auto res = client_->Post(c.path.c_str(), c.body, "application/json");
    ASSERT_TRUE(res) << c.body;
    EXPECT_EQ(res->status, c.status) << c.body << " -> " << res->body;
    EXPECT_NE(res->body.find(c.field), std::string::npos) << c.body << " -> " << res->body;
  }
  EXPECT_EQ(engine_->Metrics().generation_tokens, 0) << "nothing was generated for any of them";
  // What is accepted: the served model name, best_of == n, a plain id.
  Json ok = Post("/v1/completions",
                 R"({"prompt":[1,2],"model":"tiny","best_of":1,"max_tokens":2,"request_id":"run-1.a:b_c"})");
  EXPECT_EQ(ok["id"], "run-1.a:b_c");
  EXPECT_EQ(ok["model"], "tiny");
}

// Issue 13 #14: two live completions with one request_id would share engine request ids (an
// abort by id hits both): the second is refused with 409 while the first runs.
TEST_F(HttpTest, DuplicateLiveRequestIdIsAConflict) {
  Post("/pause?mode=keep", "");  // frozen: the first completion cannot finish meanwhile
  int first_status = 0;
  std::thread t([&] {
    httplib::Client c("127.0.0.1", server_->port());
    c.set_read_timeout(60, 0);
    auto r = c.Post("/v1/completions", R"({"prompt":[1,2,3],"max_tokens":4,"temperature":0,"request_id":"dup"})",
                    "application/json");
    first_status = r ? r->status : -1;
  });
  while (engine_->State().num_running + engine_->State().num_waiting == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  Json j = Post("/v1/completions", R"({"prompt":[4,5],"max_tokens":2,"request_id":"dup"})", 409);
  EXPECT_NE(j["message"].get<std::string>().find("request_id"), std::string::npos) << j.dump();
  Json streamed = Post("/v1/completions", R"({"prompt":[4,5],"max_tokens":2,"request_id":"dup","stream":true})", 409);
  EXPECT_EQ(engine_->State().num_running + engine_->State().num_waiting, 1) << "the refused ones never ran";
  Post("/resume", "");
  t.join();
  EXPECT_EQ(first_status, 200);
  // Once finished, the id is free again.
  Post("/v1/completions", R"({"prompt":[4,5],"max_tokens":2,"request_id":"dup"})");
}

// Issue 13 #12: the integer fields of the test-only fault route are range-checked too.
TEST_F(HttpTest, FaultDelaysAreBounded) {
  ServerOptions so;
  so.port = 0;
  so.model_name = "tiny";
  so.enable_fault_injection = true;
  EngineServer faulty(engine_.get(), so);
  ASSERT_TRUE(faulty.Start().ok());
  httplib::Client c("127.0.0.1", faulty.port());
  for (const char* body : {R"({"install_delay_ms":9223372036854775807})", R"({"pause_delay_ms":600001})",
                           R"({"reset_delay_ms":18446744073709551615})"}) {
    auto r = c.Post("/rc/fault", body, "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400) << body << " -> " << r->body;
    EXPECT_NE(r->body.find("_delay_ms"), std::string::npos) << r->body;
  }
  auto ok = c.Post("/rc/fault", R"({"install_delay_ms":600000})", "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
  c.Post("/rc/fault", "{}", "application/json");
  faulty.Stop();
}

// Characters in UTF-8 text (bytes that do not continue a character).
int64_t Chars(const std::string& s) {
  return std::count_if(s.begin(), s.end(), [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; });
}

TEST_F(HttpTest, StreamedTextJoinsToTheNonStreamedTextAndOffsetsRunOn) {
  // 150 greedy tokens of the tiny model's 256-byte vocabulary hold multi-byte characters that
  // chunks split: a stream must not turn each half into U+FFFD.
  const std::string base = R"({"prompt":[1,2,3],"max_tokens":150,"temperature":0,"logprobs":0,"ignore_eos":true)";
  Json full = Post("/v1/completions", base + "}");
  const std::string text = full["choices"][0]["text"];
  std::string joined;
  size_t tokens = 0;
  for (const Json& chunk : Stream(base + R"(,"stream":true})")) {
    const Json& c = chunk["choices"][0];
    for (const Json& off : c["logprobs"]["text_offset"]) {
      // Each token's offset counts the characters sent before it, across chunks.
      EXPECT_LE(off.get<int64_t>(), Chars(joined + c["text"].get<std::string>()));
      EXPECT_GE(off.get<int64_t>(), Chars(joined)) << "chunk offsets restart";
      ++tokens;
    }
    joined += c["text"].get<std::string>();
  }
  EXPECT_EQ(tokens, 150u);
  EXPECT_EQ(joined, text);
  // The non-streamed offsets are the same characters: the last is within the text.
  const Json& offs = full["choices"][0]["logprobs"]["text_offset"];
  ASSERT_EQ(offs.size(), 150u);
  EXPECT_EQ(offs[0], 0);
  EXPECT_LE(offs.back().get<int64_t>(), Chars(text));
  for (size_t i = 1; i < offs.size(); ++i) EXPECT_GE(offs[i].get<int64_t>(), offs[i - 1].get<int64_t>());
}

TEST_F(HttpTest, StopReasonIsTheStopTokenAndSubnormalTemperatureIsGreedy) {
  Json greedy = Post("/v1/completions", R"({"prompt":[1,2,3],"max_tokens":4,"temperature":0,"return_token_ids":true})");
  const int32_t first = greedy["choices"][0]["token_ids"][0];
  EXPECT_TRUE(greedy["choices"][0]["stop_reason"].is_null());
  Json stopped = Post("/v1/completions", R"({"prompt":[1,2,3],"max_tokens":4,"temperature":0,"stop_token_ids":[)" +
                                             std::to_string(first) + "]}");
  EXPECT_EQ(stopped["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(stopped["choices"][0]["stop_reason"], first);
  // 1 / 5e-324 is infinite: below vLLM's 1e-5 a temperature samples greedily.
  for (const char* t : {"5e-324", "1e-6"}) {
    Json tiny_t = Post("/v1/completions", std::string(R"({"prompt":[1,2,3],"max_tokens":4,"return_token_ids":true,"temperature":)") + t + "}");
    EXPECT_EQ(tiny_t["choices"][0]["token_ids"], greedy["choices"][0]["token_ids"]) << t;
  }
}

TEST_F(HttpTest, SamplingFieldsTheEngineDoesNotImplementAreRefusedUnlessNeutral) {
  for (const char* extra : {R"("stop":"x")", R"("stop":["a","b"])", R"("min_tokens":3)", R"("presence_penalty":0.5)",
                            R"("frequency_penalty":-1)", R"("repetition_penalty":1.2)", R"("min_p":0.1)",
                            R"("logit_bias":{"5":10})", R"("prompt_logprobs":1)", R"("response_format":{"type":"json_object"})"}) {
    const std::string body = std::string(R"({"prompt":[1,2],"max_tokens":2,)") + extra + "}";
    Json j = Post("/v1/completions", body, 400);
    const std::string field = std::string(extra).substr(1, std::string(extra).find('"', 1) - 1);
    EXPECT_EQ(j["error"]["message"].get<std::string>().rfind(field + ": not supported", 0), 0u) << j.dump();
  }
  // Their neutral values change nothing and are accepted (TRL and vLLM clients send them).
  Post("/v1/completions", R"({"prompt":[1,2],"max_tokens":2,"stop":[],"min_tokens":0,"presence_penalty":0,)"
                          R"("frequency_penalty":0,"repetition_penalty":1,"min_p":0,"logit_bias":{},"stop":null})");
}

TEST_F(HttpTest, ErrorsHaveVllmsShapeAndABadPromptOfSeveralRunsNothing) {
  const std::string before = Metrics();
  Json j = Post("/v1/completions", R"({"prompt":[[1,2,3],[1,9999,2]],"max_tokens":2})", 400);
  ASSERT_TRUE(j["error"].is_object()) << j.dump();
  EXPECT_EQ(j["error"]["type"], "BadRequestError");
  EXPECT_EQ(j["error"]["code"], 400);
  EXPECT_TRUE(j["error"].contains("param"));
  EXPECT_EQ(j["error"]["message"].get<std::string>().rfind("prompt[1][1]: token id 9999", 0), 0u) << j.dump();
  EXPECT_EQ(j["message"], j["error"]["message"]);
  // Nothing was admitted: no prompt tokens, no abort.
  auto counter = [](const std::string& m, const std::string& name) {
    const size_t at = m.find(name + "{");
    return at == std::string::npos ? std::string() : m.substr(at, m.find('\n', at) - at);
  };
  const std::string after = Metrics();
  EXPECT_EQ(counter(after, "vllm:prompt_tokens_total"), counter(before, "vllm:prompt_tokens_total"));
  EXPECT_EQ(counter(after, "vllm:request_success_total"), counter(before, "vllm:request_success_total"));
}

TEST_F(HttpTest, SleepWakeUpAndIsSleepingAsVllm) {
  EXPECT_EQ(Get("/is_sleeping")["is_sleeping"], false);
  Json s = Post("/sleep?level=0", "");
  EXPECT_EQ(s["status"], "sleeping");
  EXPECT_EQ(s["level"], 0);
  EXPECT_EQ(Get("/is_sleeping")["is_sleeping"], true);
  EXPECT_EQ(Get("/is_paused")["is_paused"], true);
  Post("/wake_up?tags=scheduling", "");
  EXPECT_EQ(Get("/is_sleeping")["is_sleeping"], false);
  // Level 1 (vLLM's default) also drops the prefix cache.
  Post("/v1/completions", R"({"prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17],"max_tokens":2})");
  Json l1 = Post("/sleep", "");
  EXPECT_EQ(l1["level"], 1);
  EXPECT_EQ(l1["cache_reset"]["success"], true) << l1.dump();
  Post("/wake_up", "");
  EXPECT_EQ(Get("/is_paused")["is_paused"], false);
  Json l2 = Post("/sleep?level=2", "", 400);
  EXPECT_NE(l2["message"].get<std::string>().find("level: 2"), std::string::npos) << l2.dump();
  Post("/sleep?level=x", "", 400);
  Post("/sleep?mode=bogus", "", 400);
  EXPECT_EQ(Get("/is_paused")["is_paused"], false);
}

TEST_F(HttpTest, AbortByCompletionIdHitsOnlyThatCompletion) {
  ASSERT_TRUE(engine_->Pause(PauseMode::kKeep).ok());  // both stay queued while the ids are aborted
  auto send = [&](const std::string& id) {
    return std::async(std::launch::async, [this, id] {
      httplib::Client c("127.0.0.1", server_->port());
      c.set_read_timeout(60, 0);
      auto r = c.Post("/v1/completions", R"({"prompt":[1,2],"max_tokens":3,"request_id":")" + id + R"("})",
                      "application/json");
      return r ? ParseJson(r->body).value_or(Json()) : Json();
    });
  };
  auto x = send("x");
  auto x0 = send("x-0");  // also the engine id of completion x's first request
  for (int i = 0; i < 500 && engine_->State().num_waiting < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_EQ(engine_->State().num_waiting, 2);
  Json a = Post("/abort_requests", R"({"request_ids":["x-0"]})");
  EXPECT_EQ(a["aborted"], 1);
  engine_->Resume();
  EXPECT_EQ(x0.get()["choices"][0]["finish_reason"], "abort");
  EXPECT_EQ(x.get()["choices"][0]["finish_reason"], "length");
}

}  // namespace
}  // namespace rc::engine
