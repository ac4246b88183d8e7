// The HTTP API's routing, parsing and error mapping, without sockets (HandleApiRequest over a
// MemoryStore).
#include "directory/api.h"

#include <gtest/gtest.h>

#include "directory/codec.h"
#include "directory/test_util.h"
#include "rolloutcore/directory/memory_store.h"

namespace rc::directory::internal {
namespace {

class ApiTest : public ::testing::Test {
 protected:
  ApiResponse Call(std::string method, std::string path, std::string body = "",
                   std::multimap<std::string, std::string> query = {}) {
    ApiRequest r;
    r.method = std::move(method);
    r.path = std::move(path);
    r.body = std::move(body);
    r.query = std::move(query);
    return HandleApiRequest(*store_, r, limits_);
  }
  static Json Body(const ApiResponse& r) { return Json::parse(r.body); }
  static std::string Message(const ApiResponse& r) { return Body(r)["error"]["message"].get<std::string>(); }
  std::string PublishBody(int32_t rank, int32_t ranks) {
    return PublishBodyToJson(testing::MakePublish("m", "v1", rank, ranks)).dump();
  }

  ManualClock clock_;
  std::unique_ptr<DirectoryStore> store_ = NewMemoryStore(&clock_);
  ApiLimits limits_{.max_wait_ms = 1000, .wait_slice_ms = 50, .store_kind = "memory"};
};

TEST_F(ApiTest, MarkUnavailableAnswersTheVersionAfterTheMarkAndChecksItsBody) {
  ASSERT_EQ(Call("POST", "/v1/models/m/versions/v1/ranks/0", PublishBody(0, 1)).status, 200);
  auto r = Call("POST", "/v1/models/m/versions/v1/unavailable", R"({"reason": "rank 0 released its buffers"})");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Body(r)["state"], "UNAVAILABLE");
  EXPECT_EQ(Body(r)["reason"], "rank 0 released its buffers");
  EXPECT_EQ(Body(r)["commit_seq"], 1);
  auto get = Call("GET", "/v1/models/m/versions/v1");
  EXPECT_EQ(get.status, 409);
  EXPECT_NE(Message(get).find("UNAVAILABLE"), std::string::npos) << Message(get);
  auto list = Call("GET", "/v1/models/m/versions", "", {{"state", "unavailable"}});
  ASSERT_EQ(list.status, 200);
  EXPECT_EQ(Body(list)["versions"].size(), 1u);

  auto unknown_field = Call("POST", "/v1/models/m/versions/v1/unavailable", R"({"reason": "x", "force": true})");
  EXPECT_EQ(unknown_field.status, 400);
  EXPECT_NE(Message(unknown_field).find("force"), std::string::npos) << Message(unknown_field);
  auto not_string = Call("POST", "/v1/models/m/versions/v1/unavailable", R"({"reason": 7})");
  EXPECT_EQ(not_string.status, 400);
  EXPECT_NE(Message(not_string).find("reason"), std::string::npos) << Message(not_string);
  EXPECT_EQ(Call("POST", "/v1/models/m/versions/v1/unavailable", "{}").status, 400);
  EXPECT_EQ(Call("POST", "/v1/models/m/versions/v9/unavailable", R"({"reason": "x"})").status, 404);
  EXPECT_EQ(Call("GET", "/v1/models/m/versions/v1/unavailable").status, 405);
}

TEST_F(ApiTest, HealthReportsTheStore) {
  auto r = Call("GET", "/health");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(Body(r)["store"], "memory");
}

TEST_F(ApiTest, PublishCommitGetListRelease) {
  auto p0 = Call("POST", "/v1/models/m/versions/v1/ranks/0", PublishBody(0, 2));
  ASSERT_EQ(p0.status, 200) << p0.body;
  EXPECT_EQ(Body(p0)["state"], "STAGING");
  EXPECT_TRUE(Body(p0)["lease_id"].is_string());
  auto staged = Call("GET", "/v1/models/m/versions/v1");
  EXPECT_EQ(staged.status, 409);
  EXPECT_EQ(Body(staged)["error"]["code"], "FailedPrecondition");
  auto status = Call("GET", "/v1/models/m/versions/v1/status");
  ASSERT_EQ(status.status, 200);
  EXPECT_EQ(Body(status)["published_ranks"], Json::array({0}));

  auto p1 = Call("POST", "/v1/models/m/versions/v1/ranks/1", PublishBody(1, 2));
  ASSERT_EQ(p1.status, 200) << p1.body;
  EXPECT_EQ(Body(p1)["state"], "COMMITTED");
  EXPECT_EQ(Body(p1)["commit_seq"], 1);

  auto got = Call("GET", "/v1/models/m/versions/v1");
  ASSERT_EQ(got.status, 200) << got.body;
  EXPECT_EQ(Body(got)["commit_seq"], 1);
  auto manifest = refit::ManifestFromJson(Body(got)["manifest"]);
  ASSERT_TRUE(manifest.ok());
  EXPECT_EQ(manifest->tables.size(), 2u);

  auto list = Call("GET", "/v1/models/m/versions");
  ASSERT_EQ(list.status, 200);
  ASSERT_EQ(Body(list)["versions"].size(), 1u);
  EXPECT_EQ(Body(list)["versions"][0]["version"], "v1");
  auto commits = Call("GET", "/v1/models/m/commits", "", {{"after", "0"}});
  ASSERT_EQ(commits.status, 200);
  EXPECT_EQ(Body(commits)["last_seq"], 1);
  EXPECT_EQ(Body(commits)["commits"][0]["version"], "v1");

  auto keep = Call("POST", "/v1/leases/" + Body(p0)["lease_id"].get<std::string>() + ":keepalive");
  EXPECT_EQ(keep.status, 200) << keep.body;

  EXPECT_EQ(Call("DELETE", "/v1/models/m/versions/v1").status, 200);
  EXPECT_EQ(Call("GET", "/v1/models/m/versions/v1").status, 404);
  EXPECT_EQ(Call("DELETE", "/v1/models/m/versions/v1").status, 404);
}

TEST_F(ApiTest, LongPollTimesOutWithAnEmptyList) {
  const auto start = std::chrono::steady_clock::now();
  auto r = Call("GET", "/v1/models/m/commits", "", {{"after", "0"}, {"timeout_ms", "120"}});
  ASSERT_EQ(r.status, 200);
  EXPECT_TRUE(Body(r)["commits"].empty());
  EXPECT_EQ(Body(r)["last_seq"], 0);
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(110));
}

TEST_F(ApiTest, BadInputIs400NamingTheField) {
  auto r = Call("POST", "/v1/models/m/versions/v1/ranks/0", R"({"expected_ranks": 2, "tensors": []})");
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(Message(r).find("lease_ttl_ms"), std::string::npos) << r.body;
  r = Call("POST", "/v1/models/m/versions/v1/ranks/x", PublishBody(0, 2));
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(Message(r).find("rank"), std::string::npos);
  r = Call("POST", "/v1/models/m/versions/v1/ranks/99999999999999999999", PublishBody(0, 2));
  EXPECT_EQ(r.status, 400);
  r = Call("GET", "/v1/models/m/versions", "", {{"state", "bogus"}});
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(Message(r).find("state"), std::string::npos);
  r = Call("GET", "/v1/models/m/commits", "", {{"timeout_ms", "999999"}});
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(Message(r).find("timeout_ms: at most 1000"), std::string::npos);
  r = Call("GET", "/v1/models/m/commits", "", {{"after", "-1"}});
  EXPECT_EQ(r.status, 400);
  r = Call("GET", "/v1/models/bad%model/versions");
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(Message(r).find("model"), std::string::npos);
  r = Call("POST", "/v1/models/m/versions/v1/ranks/0", "not json \xff");
  EXPECT_EQ(r.status, 400);
}

TEST_F(ApiTest, UnknownPathsAre404AndWrongMethods405) {
  EXPECT_EQ(Call("GET", "/").status, 404);
  EXPECT_EQ(Call("GET", "/v1/models/m/bogus").status, 404);
  EXPECT_EQ(Call("GET", "/v2/anything").status, 404);
  EXPECT_EQ(Call("GET", "/v1/models/m/versions/nope").status, 404);
  EXPECT_EQ(Call("POST", "/v1/leases/12:keepalive").status, 404);
  EXPECT_EQ(Call("POST", "/v1/leases/12").status, 404);
  EXPECT_EQ(Call("PUT", "/v1/models/m/versions/v1").status, 405);
  EXPECT_EQ(Call("GET", "/v1/models/m/versions/v1/ranks/0").status, 405);
  EXPECT_EQ(Call("POST", "/health").status, 405);
}

TEST_F(ApiTest, StateConflictsAre409) {
  ASSERT_EQ(Call("POST", "/v1/models/m/versions/v1/ranks/0", PublishBody(0, 1)).status, 200);
  auto again = Call("POST", "/v1/models/m/versions/v1/ranks/0", PublishBody(0, 1));
  EXPECT_EQ(again.status, 409);
  EXPECT_NE(Message(again).find("already COMMITTED"), std::string::npos);
}

}  // namespace
}  // namespace rc::directory::internal
