// DirectoryClient against a DirectoryServer on 127.0.0.1: the whole conformance suite over HTTP,
// plus what only exists at the HTTP edge (status codes, malformed and oversized requests, stop with
// pending long-polls, an unreachable directory, LeaseKeeper).
#include <gtest/gtest.h>
#include <httplib.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "directory/codec.h"
#include "directory/store_conformance.h"
#include "rolloutcore/base/clock.h"
#include "rolloutcore/directory/client.h"
#include "rolloutcore/directory/memory_store.h"
#include "rolloutcore/directory/server.h"

namespace rc::directory::testing {
namespace {

class HttpEnv final : public StoreEnv {
 public:
  explicit HttpEnv(ServerOptions options = {}) : store_(NewMemoryStore(&clock_)), server_(store_.get(), options) {
    Status s = server_.Start();
    EXPECT_TRUE(s.ok()) << s.ToString();
    a_ = std::make_unique<DirectoryClient>(server_.url());
    b_ = std::make_unique<DirectoryClient>(server_.url());
  }
  DirectoryStore& store() override { return *a_; }
  DirectoryStore* second() override { return b_.get(); }
  void PassLeaseTime(int64_t ms) override { clock_.AdvanceMs(ms); }
  DirectoryServer& server() { return server_; }

 private:
  ManualClock clock_{int64_t{1'000'000'000}};
  std::unique_ptr<DirectoryStore> store_;
  DirectoryServer server_;
  std::unique_ptr<DirectoryClient> a_, b_;
};

INSTANTIATE_TEST_SUITE_P(Http, StoreConformanceTest,
                         ::testing::Values(StoreParam{"http_memory",
                                                      [](std::string*) -> std::unique_ptr<StoreEnv> {
                                                        return std::make_unique<HttpEnv>();
                                                      }}),
                         ParamName);

Json BodyOf(const httplib::Result& r) { return Json::parse(r->body); }

TEST(HttpEdgeTest, StatusCodesAndErrorBodies) {
  HttpEnv env;
  httplib::Client c(env.server().url());
  auto health = c.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  EXPECT_EQ(BodyOf(health)["status"], "ok");

  auto bad = c.Post("/v1/models/m/versions/v1/ranks/0", R"({"expected_ranks": "two"})", "application/json");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400);
  EXPECT_EQ(BodyOf(bad)["error"]["code"], "InvalidArgument");
  EXPECT_EQ(BodyOf(bad)["error"]["message"], "expected_ranks: expected an integer, got string");

  auto missing = c.Get("/v1/models/m/versions/nope");
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);
  EXPECT_EQ(BodyOf(missing)["error"]["code"], "NotFound");
  EXPECT_EQ(c.Get("/nowhere")->status, 404);

  const std::string body = internal::PublishBodyToJson(MakePublish("m", "v1", 0, 1)).dump();
  EXPECT_EQ(c.Post("/v1/models/m/versions/v1/ranks/0", body, "application/json")->status, 200);
  auto conflict = c.Post("/v1/models/m/versions/v1/ranks/0", body, "application/json");
  EXPECT_EQ(conflict->status, 409);
  EXPECT_EQ(BodyOf(conflict)["error"]["code"], "FailedPrecondition");
}

TEST(HttpEdgeTest, ClientSeesServerStatusCodesAndMessages) {
  HttpEnv env;
  DirectoryClient client(env.server().url());
  ASSERT_TRUE(client.Health().ok());
  ASSERT_TRUE(client.Publish(MakePublish("m", "v1", 0, 3)).ok());
  auto mismatch = client.Publish(MakePublish("m", "v1", 1, 2));
  EXPECT_EQ(mismatch.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(mismatch.status().message(),
            "version v1 of model m expects 3 ranks (set by its first publish), but rank 1 declared expected_ranks 2");
}

TEST(HttpEdgeTest, OversizedAndGarbageRequestsDoNotHurtTheServer) {
  ServerOptions options;
  options.max_body_bytes = 4096;
  HttpEnv env(options);
  httplib::Client c(env.server().url());
  auto big = c.Post("/v1/models/m/versions/v1/ranks/0", std::string(100'000, 'x'), "application/json");
  ASSERT_TRUE(big);
  EXPECT_EQ(big->status, 413);
  auto deep = c.Post("/v1/models/m/versions/v1/ranks/0", std::string(2000, '[') + std::string(2000, ']'),
                     "application/json");
  ASSERT_TRUE(deep);
  EXPECT_EQ(deep->status, 400);

  // Raw garbage on the socket.
  for (const std::string& garbage : {std::string("\x00\x01\x02 nonsense\r\n\r\n", 18), std::string("GET /health"),
                                    std::string("POST /v1/models/m/versions/v/ranks/0 HTTP/1.1\r\nContent-Length: "
                                                "99999999999999999999\r\n\r\n{")}) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(env.server().port()));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    ASSERT_EQ(::send(fd, garbage.data(), garbage.size(), 0), static_cast<ssize_t>(garbage.size()));
    ::shutdown(fd, SHUT_WR);
    char buf[512];
    while (::recv(fd, buf, sizeof buf, 0) > 0) {
    }
    ::close(fd);
  }
  auto health = c.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
}

TEST(HttpEdgeTest, StopAnswersPendingLongPollsPromptly) {
  auto env = std::make_unique<HttpEnv>();
  DirectoryClient client(env->server().url());
  std::thread watcher([&] {
    auto r = client.WaitForCommits("m", 0, 30'000);
    EXPECT_TRUE(r.ok() || r.status().code() == StatusCode::kUnavailable) << r.status().ToString();
    if (r.ok()) {
      EXPECT_TRUE(r->empty());
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto start = std::chrono::steady_clock::now();
  env->server().Stop();
  watcher.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
}

TEST(HttpEdgeTest, UnreachableDirectoryIsUnavailableNamingTheUrl) {
  const std::string url = "http://127.0.0.1:" + std::to_string(FreeLoopbackPort());
  DirectoryClient client(url, ClientOptions{.connect_timeout_ms = 500, .request_timeout_ms = 500});
  auto r = client.List("m");
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(r.status().message().find(url), std::string::npos) << r.status().message();
  EXPECT_EQ(client.Publish(MakePublish("m", "v", 0, 1)).status().code(), StatusCode::kUnavailable);
}

TEST(LeaseKeeperTest, KeepsAStagingVersionAliveInRealTime) {
  auto store = NewMemoryStore(SystemClock::Default());
  DirectoryServer server(store.get(), ServerOptions{});
  ASSERT_TRUE(server.Start().ok());
  DirectoryClient client(server.url());
  auto r0 = client.Publish(MakePublish("m", "v1", 0, 2, /*lease_ttl_ms=*/300));
  ASSERT_TRUE(r0.ok());
  {
    LeaseKeeper keeper(&client, r0->lease_id, 80);
    std::this_thread::sleep_for(std::chrono::milliseconds(900));
    EXPECT_TRUE(keeper.last_status().ok()) << keeper.last_status().ToString();
    auto r1 = client.Publish(MakePublish("m", "v1", 1, 2));
    ASSERT_TRUE(r1.ok()) << r1.status().ToString();
    EXPECT_EQ(r1->state, VersionState::kCommitted);
  }
  // Without a keeper the lease runs out and an unfinished version is abandoned.
  auto r2 = client.Publish(MakePublish("m", "v2", 0, 2, 100));
  ASSERT_TRUE(r2.ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
  auto info = client.GetInfo("m", "v2");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->state, VersionState::kAbandoned);
  LeaseKeeper late(&client, r2->lease_id, 20);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(late.last_status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace rc::directory::testing
