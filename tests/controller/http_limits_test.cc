// Issue 36, defect 7, on the controller's HTTP front: GET /v1/updates/{id}?wait_ms= is open (no
// key), so its waits are bounded — wait_ms is clamped to max_wait_ms (never overflowing), at most
// max_long_polls wait at once (the rest get 503 + Retry-After), and a wait whose client closed
// its connection ends within one slice — so unauthenticated long-polls cannot take the workers
// that authenticated writes (a lease's heartbeat or finish) need.
//
// An update is kept running by an open lease (the drain waits for it), so every long-poll waits.
// Everything talks to 127.0.0.1 only; no test takes more than a few seconds.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "testing/loopback_socket.h"
#include "controller/service_fixture.h"
#include "rolloutcore/controller/http_server.h"
#include "rolloutcore/controller/service.h"

namespace rc::controller {
namespace {

using testing::Engines;
using testing::Options;
using testing::StaticVersions;
using testing::TempDir;
using Clock = std::chrono::steady_clock;

int64_t MsSince(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
}

using rc::testing::ConnectLoopback;

// A raw connection that sent an (unauthenticated) long-poll and is waiting for its answer.
int OpenLongPoll(int port, const std::string& id, int64_t wait_ms) {
  const int fd = ConnectLoopback(port);
  if (fd < 0) return -1;
  const std::string req =
      "GET /v1/updates/" + id + "?wait_ms=" + std::to_string(wait_ms) + " HTTP/1.1\r\nHost: x\r\n\r\n";
  if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(req.size())) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// How many of `fds` have an answer (or were closed) within timeout_ms, once `want` have.
size_t CountAnswered(const std::vector<int>& fds, size_t want, int timeout_ms) {
  const auto end = Clock::now() + std::chrono::milliseconds(timeout_ms);
  size_t n = 0;
  for (;;) {
    std::vector<pollfd> p;
    p.reserve(fds.size());
    for (int fd : fds) p.push_back(pollfd{fd, POLLIN, 0});
    ::poll(p.data(), p.size(), 0);
    n = 0;
    for (const pollfd& q : p) n += (q.revents & (POLLIN | POLLHUP | POLLERR)) != 0 ? 1 : 0;
    if (n >= want || Clock::now() >= end) return n;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

std::string ReadSome(int fd) {
  char buf[4096];
  const ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

struct Fixture {
  Fixture(const std::string& name, const ControllerHttpOptions& o) : dir(TempDir(name)) {
    svc = std::move(ControllerService::Create(engines.Make(1), &versions, Options(dir))).value();
    server = std::make_unique<ControllerHttpServer>(svc.get(), o);
  }
  ~Fixture() {
    server.reset();
    svc.reset();
    std::filesystem::remove_all(dir);
  }
  // An open lease (L1) holds the drain, so the update to v1 stays running until L1 finishes.
  std::string StartHeldUpdate(httplib::Client& c) {
    auto r = c.Post("/v1/rollouts:admit", R"({"rollout_id":"L1"})", "application/json");
    EXPECT_TRUE(r && r->status == 200);
    r = c.Post("/v1/updates", R"({"model":"m","version":"v1"})", "application/json");
    EXPECT_TRUE(r && r->status == 202);
    return r && r->status == 202 ? Json::parse(r->body)["id"].get<std::string>() : "";
  }

  std::string dir;
  StaticVersions versions;
  Engines engines;
  std::unique_ptr<ControllerService> svc;
  std::unique_ptr<ControllerHttpServer> server;
};

// 300 unauthenticated long-polls (the defect: a few hundred held all 256 workers until wait_ms,
// and an authenticated heartbeat waited behind them; a lease could expire). Now 64 wait (a
// quarter of the workers), the rest are answered 503 + Retry-After at once, the heartbeat answers
// at once, and when the 300 clients hang up their slots come back within a slice: 64 new
// long-polls wait again and the 65th is refused. Stop() does not wait for long-polls.
TEST(ControllerHttpLimitsTest, UnauthenticatedLongPollsCannotStarveWrites) {
  ControllerHttpOptions o;
  o.security.api_key = "k";
  Fixture f("limits_starve", o);
  ASSERT_TRUE(f.server->Start().ok());
  const int port = f.server->port();
  httplib::Client c("127.0.0.1", port);
  c.set_bearer_token_auth("k");
  c.set_read_timeout(3, 0);
  const std::string id = f.StartHeldUpdate(c);
  ASSERT_FALSE(id.empty());

  std::vector<int> polls;
  polls.reserve(300);
  for (int i = 0; i < 300; ++i) {
    polls.push_back(OpenLongPoll(port, id, 20'000));
    ASSERT_GE(polls.back(), 0);
  }
  EXPECT_EQ(CountAnswered(polls, 236, 3000), 236u) << "all but 64 long-polls are answered at once";
  const auto t0 = Clock::now();
  auto r = c.Post("/v1/rollouts/L1:heartbeat", "", "application/json");
  ASSERT_TRUE(r) << "the authenticated heartbeat got no answer: " << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_LT(MsSince(t0), 1000) << "the heartbeat waited behind long-polls";
  size_t refused = 0;
  for (int fd : polls) {
    const std::string a = ReadSome(fd);
    if (a.empty()) continue;
    EXPECT_EQ(a.rfind("HTTP/1.1 503", 0), 0u) << a.substr(0, 200);
    EXPECT_NE(a.find("Retry-After: 1"), std::string::npos) << a.substr(0, 400);
    EXPECT_NE(a.find("64 long-polls are waiting already"), std::string::npos) << a;
    ++refused;
  }
  EXPECT_EQ(refused, 236u);

  for (int fd : polls) ::close(fd);                             // the clients leave
  std::this_thread::sleep_for(std::chrono::milliseconds(400));  // > the 100 ms slice
  std::vector<int> again;
  again.reserve(65);
  for (int i = 0; i < 65; ++i) again.push_back(OpenLongPoll(port, id, 20'000));
  EXPECT_EQ(CountAnswered(again, 1, 2000), 1u) << "64 slots were free again, and only 64";
  for (int fd : again) ::close(fd);
  std::this_thread::sleep_for(std::chrono::milliseconds(400));

  // Once the lease finishes, the update commits and a long-poll sees it.
  r = c.Post("/v1/rollouts/L1:finish", R"({"token_ids":[3]})", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  httplib::Client open("127.0.0.1", port);  // no key: GETs stay open
  open.set_read_timeout(5, 0);
  r = open.Get(("/v1/updates/" + id + "?wait_ms=4000").c_str());
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(Json::parse(r->body)["outcome"], "committed") << r->body;

  // A server stopping while a long-poll waits (on a second held update) answers it within a slice.
  r = c.Post("/v1/rollouts:admit", R"({"rollout_id":"L2"})", "application/json");
  ASSERT_TRUE(r && r->status == 200);
  r = c.Post("/v1/updates", R"({"model":"m","version":"v2"})", "application/json");
  ASSERT_TRUE(r && r->status == 202);
  const int last = OpenLongPoll(port, Json::parse(r->body)["id"].get<std::string>(), 20'000);
  ASSERT_GE(last, 0);
  EXPECT_EQ(CountAnswered({last}, 1, 300), 0u) << "it waits";
  const auto t1 = Clock::now();
  f.server->Stop();
  EXPECT_LT(MsSince(t1), 1000) << "Stop() waited for a long-poll";
  ::close(last);
}

// wait_ms is clamped to max_wait_ms: 10^11 and INT64_MAX both wait max_wait_ms and answer the
// running update's status (an overflowing deadline would answer at once, 10^11 would hold the
// worker for years); beyond int64 or negative is 400 naming wait_ms.
TEST(ControllerHttpLimitsTest, WaitMsIsClampedAndNeverOverflows) {
  ControllerHttpOptions o;
  o.max_wait_ms = 300;
  Fixture f("limits_clamp", o);
  ASSERT_TRUE(f.server->Start().ok());
  httplib::Client c("127.0.0.1", f.server->port());
  c.set_read_timeout(3, 0);
  const std::string id = f.StartHeldUpdate(c);
  ASSERT_FALSE(id.empty());
  for (const char* wait : {"100000000000", "9223372036854775807"}) {
    const auto t0 = Clock::now();
    auto r = c.Get(("/v1/updates/" + id + "?wait_ms=" + wait).c_str());
    const int64_t ms = MsSince(t0);
    ASSERT_TRUE(r) << wait << ": " << httplib::to_string(r.error());
    EXPECT_EQ(r->status, 200) << r->body;
    EXPECT_EQ(Json::parse(r->body)["done"], false) << r->body;
    EXPECT_GE(ms, 250) << wait << ": answered before max_wait_ms";
    EXPECT_LT(ms, 1500) << wait << ": waited past max_wait_ms";
  }
  for (const char* wait : {"9223372036854775808", "-1", "1e3"}) {
    auto r = c.Get(("/v1/updates/" + id + "?wait_ms=" + wait).c_str());
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400) << wait;
    EXPECT_NE(r->body.find("wait_ms: expected a non-negative integer"), std::string::npos) << r->body;
  }
}

}  // namespace
}  // namespace rc::controller
