#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "rolloutcore/net/http.h"
#include "rolloutcore/net/http_status.h"

namespace rc::net {
namespace {

TEST(Utf8Test, FindsTheFirstBadByte) {
  EXPECT_EQ(FirstInvalidUtf8("plain ascii"), std::nullopt);
  EXPECT_EQ(FirstInvalidUtf8("h\xc3\xa9llo \xe2\x82\xac \xf0\x9f\x98\x80"), std::nullopt);
  EXPECT_EQ(FirstInvalidUtf8("ab\xff"), 2u);
  EXPECT_EQ(FirstInvalidUtf8("a\xc3"), 1u);             // truncated
  EXPECT_EQ(FirstInvalidUtf8("\xc0\xaf"), 0u);          // overlong
  EXPECT_EQ(FirstInvalidUtf8("x\xed\xa0\x80"), 1u);     // surrogate
  EXPECT_EQ(FirstInvalidUtf8("\xf4\x90\x80\x80"), 0u);  // above U+10FFFF
  EXPECT_EQ(FirstInvalidUtf8("\xe2\x82z"), 0u);         // bad continuation
}

TEST(Utf8Test, NamesTheJsonField) {
  EXPECT_TRUE(CheckJsonUtf8(R"({"prompt": "fine"})", "request body").ok());
  Status s = CheckJsonUtf8("{\"model\": \"m\", \"prompt\": \"a\xff\"}", "request body");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("request body: prompt: invalid UTF-8 (byte 0xff at offset 27)"), std::string::npos)
      << s.message();
  s = CheckJsonUtf8("{\"prompt\": [\"ok\", \"b\xfe\"], \"n\": 1}", "body");
  EXPECT_NE(s.message().find("body: prompt[1]: invalid UTF-8"), std::string::npos) << s.message();
  s = CheckJsonUtf8("{\"a\": {\"x\": 1, \"b\": {\"c\": \"\xc3(\"}}}", "body");
  EXPECT_NE(s.message().find("body: a.b.c: invalid UTF-8"), std::string::npos) << s.message();
  s = CheckJsonUtf8("{\"ok\": 1, \"k\xff\": 2}", "body");
  EXPECT_NE(s.message().find("body: an object key: invalid UTF-8"), std::string::npos) << s.message();
  EXPECT_EQ(DumpJson(Json{{"e", std::string("a\xff")}}), "{\"e\":\"a\xef\xbf\xbd\"}");
}

TEST(PolicyTest, LoopbackAndConstantTimeCompare) {
  for (const char* h : {"127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"}) EXPECT_TRUE(IsLoopbackHost(h)) << h;
  for (const char* h : {"0.0.0.0", "::", "10.0.0.1", "example.com", ""}) EXPECT_FALSE(IsLoopbackHost(h)) << h;
  EXPECT_TRUE(ConstantTimeEquals("secret", "secret"));
  EXPECT_FALSE(ConstantTimeEquals("secret", "secreT"));
  EXPECT_FALSE(ConstantTimeEquals("secret", "secret2"));
  EXPECT_FALSE(ConstantTimeEquals("", "x"));
}

// A server with GET/POST /thing and a counter of POSTs that ran.
struct TestServer {
  explicit TestServer(HttpServerOptions o) : http(std::move(o)) {
    http.Get("/thing", [this](const httplib::Request&, httplib::Response& r) {
      r.set_content(std::to_string(posts.load()), "text/plain");
    });
    http.Post("/thing", [this](const httplib::Request&, httplib::Response& r) {
      ++posts;
      r.set_content("{}", "application/json");
    });
    http.Delete(R"(/items/([^/]+))",
                [](const httplib::Request&, httplib::Response& r) { r.set_content("{}", "application/json"); });
  }
  HttpServer http;
  std::atomic<int> posts{0};
};

HttpServerOptions Options(std::string key = "") {
  HttpServerOptions o;
  o.name = "test";
  o.security.api_key = std::move(key);
  return o;
}

// ClientPool: one kept-alive connection serves consecutive requests (the server sees the same
// peer port); an idle client older than max_idle_ms is not reused; a connection the server
// closed (its keep-alive timeout) is replaced without failing the request; the key is sent;
// concurrent callers each get a client of their own.
TEST(ClientPoolTest, ReusesKeptConnectionsAndSurvivesTheirClosing) {
  HttpServerOptions o = Options("k3y");
  o.keep_alive_timeout_ms = 1000;
  TestServer s(o);
  std::mutex mu;
  std::set<int> peers;
  s.http.Get("/peer", [&](const httplib::Request& q, httplib::Response& r) {
    std::lock_guard<std::mutex> l(mu);
    peers.insert(q.remote_port);
    r.set_content("{}", "application/json");
  });
  s.http.Get("/fail", [](const httplib::Request&, httplib::Response& r) {
    r.status = 500;
    r.set_content("{}", "application/json");
  });
  ASSERT_TRUE(s.http.Start().ok());
  const std::string url = "http://127.0.0.1:" + std::to_string(s.http.port());
  ClientConfig key;
  key.api_key = "k3y";
  ClientPool pool(url, key, /*max_idle_ms=*/5000);
  ASSERT_TRUE(pool.valid());
  EXPECT_FALSE(ClientPool("ftp://127.0.0.1:1").valid());
  auto get = [&](const std::string& path) { return pool.Request("GET", path, "", "", nullptr); };
  for (int i = 0; i < 5; ++i) {
    auto r = get("/peer");
    ASSERT_TRUE(r) << httplib::to_string(r.error());
    EXPECT_EQ(r->status, 200);
  }
  EXPECT_EQ(pool.clients_made(), 1);
  EXPECT_EQ(pool.reused(), 4);
  EXPECT_EQ(peers.size(), 1u) << "five requests, one connection";
  auto post = pool.Request("POST", "/thing", "{}", "application/json", nullptr);
  ASSERT_TRUE(post);
  EXPECT_EQ(post->status, 200) << "the key went with the POST on the kept connection";
  EXPECT_EQ(s.posts.load(), 1);

  // The server closes the idle connection after 1 s; the pool still holds it (5 s): the next
  // GET and POST answer, the POST runs once.
  std::this_thread::sleep_for(std::chrono::milliseconds(1600));
  auto again = get("/peer");
  ASSERT_TRUE(again) << httplib::to_string(again.error());
  EXPECT_EQ(again->status, 200);
  EXPECT_EQ(peers.size(), 2u) << "a new connection";
  std::this_thread::sleep_for(std::chrono::milliseconds(1600));
  auto post2 = pool.Request("POST", "/thing", "{}", "application/json", nullptr);
  ASSERT_TRUE(post2) << httplib::to_string(post2.error());
  EXPECT_EQ(s.posts.load(), 2) << "the POST ran exactly once";

  // A connection that answered 5xx is not kept (servers may close it after an error).
  const int64_t made = pool.clients_made();
  auto failed = get("/fail");
  ASSERT_TRUE(failed);
  EXPECT_EQ(failed->status, 500);
  ASSERT_TRUE(get("/peer"));
  EXPECT_EQ(pool.clients_made(), made + 1) << "the request after the 500 went on a new connection";

  // A pool that drops clients idle for more than 50 ms makes a new one after 100 ms.
  ClientPool brief(url, key, /*max_idle_ms=*/50);
  ASSERT_TRUE(brief.Request("GET", "/thing", "", "", nullptr));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_TRUE(brief.Request("GET", "/thing", "", "", nullptr));
  EXPECT_EQ(brief.clients_made(), 2);
  EXPECT_EQ(brief.reused(), 0);

  // Concurrent callers: every request answers; at most one client per caller at a time.
  ClientPool shared(url, key, 5000, /*max_idle=*/4);
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  threads.reserve(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 25; ++i) {
        auto r = shared.Request("GET", "/thing", "", "", nullptr);
        if (r && r->status == 200) ++ok;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 100);
  EXPECT_LE(shared.clients_made(), 4);
  EXPECT_GE(shared.reused(), 96);

  // A server that is gone: the error comes back (no retry loop on a new connection).
  s.http.Stop();
  auto gone = get("/peer");
  EXPECT_FALSE(gone);
}

TEST(HttpServerTest, MutatingRequestsNeedTheKeyReadsDoNot) {
  TestServer s(Options("k-123"));
  ASSERT_TRUE(s.http.Start().ok());
  httplib::Client c("127.0.0.1", s.http.port());
  auto r = c.Post("/thing", "{}", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 401);
  EXPECT_EQ(r->get_header_value("WWW-Authenticate"), "Bearer");
  EXPECT_NE(r->body.find("Unauthenticated"), std::string::npos) << r->body;
  EXPECT_EQ(r->body.find("k-123"), std::string::npos) << "the key must never be echoed";
  httplib::Client wrong("127.0.0.1", s.http.port());
  wrong.set_bearer_token_auth("k-124");
  r = wrong.Post("/thing", "{}", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 401);
  r = wrong.Delete("/items/a");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 401);
  EXPECT_EQ(s.posts.load(), 0) << "a refused request must not run";
  r = c.Get("/thing");  // reads stay open
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->body, "0");
  auto good = MakeClient(s.http.url(), ClientConfig{"k-123", ""});
  r = good->Post("/thing", "{}", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(s.posts.load(), 1);
}

TEST(HttpServerTest, NonLoopbackWithoutKeyRefusesUnlessInsecure) {
  HttpServerOptions o = Options();
  o.host = "0.0.0.0";
  TestServer refused(o);
  Status st = refused.http.Start();
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("without an API key"), std::string::npos) << st.message();
  o.security.insecure_no_auth = true;
  TestServer insecure(o);
  EXPECT_TRUE(insecure.http.Start().ok());
  o.security.insecure_no_auth = false;
  o.security.api_key = "k";
  TestServer keyed(o);
  EXPECT_TRUE(keyed.http.Start().ok());
}

TEST(HttpServerTest, WrongMethodIs405WithAllow) {
  TestServer s(Options());
  ASSERT_TRUE(s.http.Start().ok());
  httplib::Client c("127.0.0.1", s.http.port());
  auto r = c.Delete("/thing");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 405);
  EXPECT_EQ(r->get_header_value("Allow"), "GET, POST");
  EXPECT_NE(r->body.find("not allowed"), std::string::npos);
  r = c.Get("/items/x");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 405);
  EXPECT_EQ(r->get_header_value("Allow"), "DELETE");
  r = c.Get("/nothing");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 404);
  EXPECT_NE(r->body.find("no route for GET /nothing"), std::string::npos) << r->body;
}

TEST(HttpServerTest, InvalidUtf8Is400NamingTheField) {
  TestServer s(Options());
  ASSERT_TRUE(s.http.Start().ok());
  httplib::Client c("127.0.0.1", s.http.port());
  auto r = c.Post("/thing", "{\"prompt\": \"\xff\xfe\"}", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_NE(r->body.find("request body: prompt: invalid UTF-8"), std::string::npos) << r->body;
  r = c.Get("/thing?label=%FF");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_NE(r->body.find("query parameter 'label': invalid UTF-8"), std::string::npos) << r->body;
  r = c.Get("/items/%C3%28");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_NE(r->body.find("path: invalid UTF-8"), std::string::npos) << r->body;
  EXPECT_EQ(s.posts.load(), 0);
}

int ConnectLoopback(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// 64 idle sockets and 32 that trickle a header byte at a time: a normal request still answers
// at once. With cpp-httplib's fixed pool of max(8, cores - 1) workers it waits for the read
// timeouts (seconds) or, while the headers trickle, for ever.
TEST(HttpServerTest, SlowClientsDoNotStarveOthers) {
  TestServer s(Options());
  ASSERT_TRUE(s.http.Start().ok());
  std::vector<int> idle, trickle;
  for (int i = 0; i < 64; ++i) idle.push_back(ConnectLoopback(s.http.port()));
  for (int i = 0; i < 32; ++i) {
    int fd = ConnectLoopback(s.http.port());
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::write(fd, "GET /thing HTTP/1.1\r\n", 21), 21);
    trickle.push_back(fd);
  }
  std::atomic<bool> stop{false};
  std::thread trickler([&] {
    while (!stop.load()) {
      for (int fd : trickle) (void)!::write(fd, "X", 1);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  });
  struct Join {  // also when an assertion returns early
    std::atomic<bool>& stop;
    std::thread& t;
    ~Join() {
      stop = true;
      if (t.joinable()) t.join();
    }
  } join{stop, trickler};
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // let them all be accepted
  for (int k = 0; k < 3; ++k) {
    httplib::Client c("127.0.0.1", s.http.port());
    c.set_read_timeout(20, 0);
    const auto t0 = std::chrono::steady_clock::now();
    auto r = c.Get("/thing");
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200);
    EXPECT_LT(ms, 2000) << "a normal request waited behind slow clients";
  }
  stop = true;
  trickler.join();
  for (int fd : idle) ::close(fd);
  for (int fd : trickle) ::close(fd);
}

// The listen backlog is ours (1024 by default), not cpp-httplib's compiled-in 5: `ss -ltn` shows
// a listening socket's backlog in its Send-Q column.
TEST(HttpServerTest, ListenBacklogIsRaised) {
  if (std::system("command -v ss >/dev/null 2>&1") != 0) GTEST_SKIP() << "ss (iproute2) is not installed";
  HttpServerOptions o = Options();
  o.listen_backlog = 777;
  TestServer s(o);
  ASSERT_TRUE(s.http.Start().ok());
  const std::string cmd = "ss -ltnH 'sport = :" + std::to_string(s.http.port()) + "'";
  FILE* p = ::popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  char line[512] = {0};
  const bool got = std::fgets(line, sizeof(line), p) != nullptr;
  ::pclose(p);
  ASSERT_TRUE(got) << cmd << " printed nothing";
  char state[32] = {0};
  int recv_q = -1, send_q = -1;
  ASSERT_EQ(std::sscanf(line, "%31s %d %d", state, &recv_q, &send_q), 3) << line;
  EXPECT_EQ(send_q, 777) << line;
}

namespace fs = std::filesystem;

// A self-signed certificate for 127.0.0.1 made with the openssl tool.
bool MakeCert(const std::string& dir) {
  const std::string cmd =
      "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=127.0.0.1 "
      "-addext subjectAltName=IP:127.0.0.1,DNS:localhost -keyout " +
      dir + "/key.pem -out " + dir + "/cert.pem >" + dir + "/openssl.log 2>&1";
  return std::system(cmd.c_str()) == 0;
}

TEST(HttpServerTest, TlsWithASelfSignedCertificate) {
  const std::string dir = (fs::temp_directory_path() / ("rc_net_tls_" + std::to_string(::getpid()))).string();
  fs::create_directories(dir);
  ASSERT_TRUE(MakeCert(dir)) << "openssl failed; see " << dir << "/openssl.log";
  HttpServerOptions o = Options("k");
  o.security.tls_cert_file = dir + "/cert.pem";
  o.security.tls_key_file = dir + "/key.pem";
  TestServer s(o);
  ASSERT_TRUE(s.http.Start().ok());
  EXPECT_EQ(s.http.url().rfind("https://127.0.0.1:", 0), 0u) << s.http.url();
  auto trusted = MakeClient(s.http.url(), ClientConfig{"k", dir + "/cert.pem"});
  auto r = trusted->Post("/thing", "{}", "application/json");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(s.posts.load(), 1);
  auto untrusted = MakeClient(s.http.url(), ClientConfig{"k", ""});  // the system CAs do not know it
  r = untrusted->Get("/thing");
  EXPECT_FALSE(r) << "a certificate no CA signed must not be accepted";
  httplib::Client plain("127.0.0.1", s.http.port());  // plain HTTP to a TLS port
  r = plain.Get("/thing");
  EXPECT_TRUE(!r || r->status != 200);

  HttpServerOptions half = Options();
  half.security.tls_cert_file = dir + "/cert.pem";
  TestServer h(half);
  EXPECT_EQ(h.http.Start().code(), StatusCode::kInvalidArgument);
  HttpServerOptions bad = Options();
  bad.security.tls_cert_file = dir + "/openssl.log";
  bad.security.tls_key_file = dir + "/key.pem";
  TestServer b(bad);
  Status st = b.http.Start();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("do not load"), std::string::npos) << st.message();
  fs::remove_all(dir);
}

TEST(HttpStatusTest, EveryServerMapsStatusCodesTheSameWay) {
  const std::pair<Status, int> cases[] = {
      {OkStatus(), 200},           {InvalidArgument("x"), 400},    {Unauthenticated("x"), 401},
      {PermissionDenied("x"), 403}, {NotFound("x"), 404},          {FailedPrecondition("x"), 409},
      {AlreadyExists("x"), 409},   {Aborted("x"), 409},            {Unimplemented("x"), 501},
      {Unavailable("x"), 503},     {DeadlineExceeded("x"), 504},   {Internal("x"), 500},
      {DataLoss("x"), 500}};
  for (const auto& [status, http] : cases) EXPECT_EQ(HttpStatusFor(status), http) << status.ToString();
}

}  // namespace
}  // namespace rc::net
