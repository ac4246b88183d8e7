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
