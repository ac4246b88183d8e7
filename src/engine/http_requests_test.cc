// The typed request parsers of the engine's HTTP routes (http_requests.h): values, defaults, and
// errors that name the bad field with the texts the routes have always answered.
#include "engine/http_requests.h"

#include <gtest/gtest.h>

namespace rc::engine {
namespace {

template <typename T>
std::string Error(const Result<T>& r) {
  return r.ok() ? "<ok>" : r.status().message();
}

TEST(HttpRequestsTest, PauseQuery) {
  auto d = ParsePauseQuery({});
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->mode, PauseMode::kAbort);
  EXPECT_EQ(d->mode_name, "abort");
  EXPECT_EQ(d->inflight_kv, InFlightKv::kRecompute);
  EXPECT_FALSE(d->clear_cache);
  auto k = ParsePauseQuery({{"mode", "keep"}, {"inflight_kv", "keep"}, {"clear_cache", "true"}});
  ASSERT_TRUE(k.ok());
  EXPECT_EQ(k->mode, PauseMode::kKeep);
  EXPECT_EQ(k->inflight_kv, InFlightKv::kKeep);
  EXPECT_TRUE(k->clear_cache);
  // The deprecated boolean picks the mode only when mode is absent.
  EXPECT_EQ(ParsePauseQuery({{"wait_for_inflight_requests", "true"}})->mode_name, "wait");
  EXPECT_EQ(ParsePauseQuery({{"wait_for_inflight_requests", "false"}})->mode_name, "abort");
  EXPECT_EQ(ParsePauseQuery({{"mode", "keep"}, {"wait_for_inflight_requests", "true"}})->mode_name, "keep");
  EXPECT_EQ(Error(ParsePauseQuery({{"mode", "later"}})), "mode: expected one of abort, wait, keep; got 'later'");
  EXPECT_EQ(Error(ParsePauseQuery({{"clear_cache", "maybe"}})), "clear_cache: expected true or false, got 'maybe'");
  EXPECT_EQ(Error(ParsePauseQuery({{"wait_for_inflight_requests", "2"}})),
            "wait_for_inflight_requests: expected true or false, got '2'");
  EXPECT_EQ(Error(ParsePauseQuery({{"inflight_kv", "stale"}})),
            "inflight_kv: expected one of keep, recompute; got 'stale'");
  EXPECT_EQ(ParsePauseQuery({{"mode", "wait"}, {"mode", "keep"}})->mode, PauseMode::kWait) << "the first value counts";
}

TEST(HttpRequestsTest, BooleanQueries) {
  EXPECT_FALSE(*ParseResetPrefixCacheQuery({}));
  EXPECT_TRUE(*ParseResetPrefixCacheQuery({{"reset_running_requests", "True"}}));
  EXPECT_EQ(Error(ParseResetPrefixCacheQuery({{"reset_running_requests", "yes"}})),
            "reset_running_requests: expected true or false, got 'yes'");
  EXPECT_TRUE(*ParseDigestQuery({{"fresh", "1"}}));
  EXPECT_EQ(Error(ParseDigestQuery({{"fresh", ""}})), "fresh: expected true or false, got ''");
}

TEST(HttpRequestsTest, AbortRequestsBody) {
  EXPECT_TRUE(ParseAbortRequestsBody("")->request_ids.empty());
  EXPECT_TRUE(ParseAbortRequestsBody("{}")->request_ids.empty());
  EXPECT_TRUE(ParseAbortRequestsBody(R"({"request_ids": null})")->request_ids.empty());
  EXPECT_EQ(ParseAbortRequestsBody(R"({"request_ids": ["a", "b"]})")->request_ids,
            (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(Error(ParseAbortRequestsBody("[1]")), "body: expected a JSON object, got array");
  EXPECT_EQ(Error(ParseAbortRequestsBody(R"({"request_ids": "a"})")),
            "request_ids: expected a list of strings, got string");
  EXPECT_EQ(Error(ParseAbortRequestsBody(R"({"request_ids": ["a", 3]})")),
            "request_ids[1]: expected a string, got integer");
  EXPECT_EQ(Error(ParseAbortRequestsBody("{")).rfind("request body", 0), 0u) << Error(ParseAbortRequestsBody("{"));
}

TEST(HttpRequestsTest, UpdateWeightVersionBody) {
  EXPECT_EQ(ParseUpdateWeightVersionBody(R"({"new_version": "v7"})")->new_version, "v7");
  EXPECT_NE(Error(ParseUpdateWeightVersionBody("{}")).find("new_version"), std::string::npos);
  EXPECT_EQ(Error(ParseUpdateWeightVersionBody("3")), "body: expected a JSON object, got integer");
}

TEST(HttpRequestsTest, StageBody) {
  auto s = ParseStageBody(R"({"model": "m", "version": "v1", "directory": "http://127.0.0.1:1"})");
  ASSERT_TRUE(s.ok()) << Error(s);
  EXPECT_EQ(s->model, "m");
  EXPECT_EQ(s->version, "v1");
  EXPECT_EQ(s->directory, "http://127.0.0.1:1");
  EXPECT_EQ(s->timeout_ms, receiver::StageRequest().timeout_ms);
  EXPECT_FALSE(s->use_relays);
  EXPECT_EQ(s->receiver_rank, 0);
  auto full = ParseStageBody(
      R"({"model": "m", "version": "v1", "directory": "http://d:1", "timeout_ms": 5, "use_relays": true, "receiver_rank": 3})");
  ASSERT_TRUE(full.ok()) << Error(full);
  EXPECT_EQ(full->timeout_ms, 5);
  EXPECT_TRUE(full->use_relays);
  EXPECT_EQ(full->receiver_rank, 3);
  EXPECT_NE(Error(ParseStageBody(R"({"version": "v1", "directory": "http://d:1"})")).find("model"), std::string::npos);
  EXPECT_EQ(Error(ParseStageBody(R"({"model": "m", "version": "v1", "directory": "http://d:1", "timeout_ms": 0})")),
            "timeout_ms: must be in [1, 3600000], got 0");
  EXPECT_EQ(Error(ParseStageBody(R"({"model": "m", "version": "v1", "directory": "http://d:1", "receiver_rank": -1})")),
            "receiver_rank: must be in [0, 1000000], got -1");
  EXPECT_NE(Error(ParseStageBody(R"({"model": "m", "version": "v1", "directory": "http://d:1", "use_relays": 1})"))
                .find("use_relays"),
            std::string::npos);
  EXPECT_EQ(Error(ParseStageBody(R"({"model": "m", "version": "v1", "directory": "d"})")),
            "directory: 'd' is not the base URL of a directory (http:// or https://, a host and port, no path)");
  EXPECT_EQ(Error(ParseStageBody(R"({"model": "m", "version": "", "directory": "http://d:1"})")),
            "version: must not be empty");
  EXPECT_EQ(Error(ParseStageBody(R"({"model": "m", "version": "v1", "directory": "http://d:1", "timeout": 5})")),
            "timeout: unknown field");
  EXPECT_TRUE(ParseStageBody(R"({"model": "m", "version": "v1", "directory": "http://d:1/"})").ok());
}

TEST(HttpRequestsTest, RelayAndInstallBodies) {
  auto r = ParseRelayBody(R"({"model": "m", "version": "v", "directory": "d"})", "engine-42");
  ASSERT_TRUE(r.ok()) << Error(r);
  EXPECT_EQ(r->holder, "engine-42");
  EXPECT_EQ(ParseRelayBody(R"({"holder": "h"})", "x")->holder, "h");
  EXPECT_EQ(Error(ParseRelayBody("null", "x")), "body: expected a JSON object, got null");
  EXPECT_NE(Error(ParseRelayBody(R"({"model": 1})", "x")).find("model"), std::string::npos);

  auto i = ParseInstallBody(R"({"version": "v2"})");
  ASSERT_TRUE(i.ok());
  EXPECT_EQ(i->version, "v2");
  EXPECT_FALSE(i->skip_cache_reset);
  EXPECT_TRUE(ParseInstallBody(R"({"version": "v2", "skip_cache_reset": true})")->skip_cache_reset);
  EXPECT_NE(Error(ParseInstallBody("{}")).find("version"), std::string::npos);
}

TEST(HttpRequestsTest, ReplayBody) {
  auto r = ParseReplayBody(R"({"probe": "p1", "prompt": [1, 2, 3], "steps": 4, "top_k": 5})");
  ASSERT_TRUE(r.ok()) << Error(r);
  EXPECT_EQ(r->probe, "p1");
  EXPECT_EQ(r->prompt, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(r->steps, 4);
  EXPECT_EQ(r->top_k, 5);
  EXPECT_EQ(ParseReplayBody(R"({"prompt": [1], "steps": 1})")->top_k, 0);
  EXPECT_EQ(Error(ParseReplayBody("[]")), "request body: expected a JSON object, got array");
  EXPECT_NE(Error(ParseReplayBody(R"({"prompt": [1], "steps": 1, "topk": 2})")).find("topk"), std::string::npos);
  EXPECT_EQ(Error(ParseReplayBody(R"({"steps": 1})")), "prompt: expected an array of token ids");
  EXPECT_EQ(Error(ParseReplayBody(R"({"prompt": [1, -2], "steps": 1})")), "prompt[1]: expected a token id, got -2");
  EXPECT_NE(Error(ParseReplayBody(R"({"prompt": [1]})")).find("steps"), std::string::npos);
}

TEST(HttpRequestsTest, FaultBody) {
  auto none = ParseFaultBody("");
  ASSERT_TRUE(none.ok()) << Error(none);
  EXPECT_EQ(none->pause_delay_ms, 0);
  EXPECT_FALSE(none->refuse_install);
  auto f = ParseFaultBody(R"({"install_delay_ms": 250, "refuse_install": true, "swap_q_heads": true})");
  ASSERT_TRUE(f.ok()) << Error(f);
  EXPECT_EQ(f->install_delay_ms, 250);
  EXPECT_TRUE(f->refuse_install);
  EXPECT_TRUE(f->swap_q_heads);
  EXPECT_FALSE(f->corrupt_live_weight);
  EXPECT_EQ(Error(ParseFaultBody(R"({"resume_delay_ms": 600001})")), "resume_delay_ms: at most 600000, got 600001");
  EXPECT_NE(Error(ParseFaultBody(R"({"digest_delay_ms": -1})")).find("digest_delay_ms"), std::string::npos);
  EXPECT_NE(Error(ParseFaultBody(R"({"refuse_instal": true})")).find("refuse_instal"), std::string::npos);
  EXPECT_NE(Error(ParseFaultBody(R"({"corrupt_live_weight": "yes"})")).find("corrupt_live_weight"),
            std::string::npos);
  EXPECT_EQ(Error(ParseFaultBody("7")), "body: expected a JSON object, got integer");
}

}  // namespace
}  // namespace rc::engine
