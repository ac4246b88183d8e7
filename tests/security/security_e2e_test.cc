// The lock on the door (issue 13: defects 11, 15's 405, 16 and 18) against real processes: a
// directory, a 2-rank synthetic trainer, an engine and a controller, each `rolloutcore ... serve`
// on loopback with ROLLOUTCORE_API_KEY set in their environment.
//
// - every mutating endpoint of all four servers answers 401 without the key (and with a wrong
//   one), and the state read back afterwards is unchanged; reads stay open;
// - with the key, a full update runs (trainer publishes, the controller pauses/stages/installs
//   through the engine, the engine pulls from the directory): every client passes the key;
// - a non-loopback bind without a key refuses to start (all four), --insecure-no-auth starts;
// - the engine stages only from its --directory; 405 + Allow; invalid UTF-8 → 400 naming the
//   field; 64 idle sockets do not stall the controller or the engine; TLS on loopback.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "apps/child_process.h"
#include "rolloutcore/base/json.h"
#include "rolloutcore/net/http.h"

namespace rc::security_test {
namespace {

namespace fs = std::filesystem;
using apps::ChildProcess;

constexpr const char* kKey = "rc-e2e-key-7f3a";
constexpr const char* kModel = "m";

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Reply {
  int status = 0;  // 0: no answer
  std::string body;
  std::string allow;
  Json json;
};

// One request. key: nullptr sends no Authorization header.
Reply Send(int port, const std::string& method, const std::string& path, const std::string& body = "",
           const char* key = kKey, int timeout_s = 60) {
  httplib::Client c("127.0.0.1", port);
  c.set_connection_timeout(2, 0);
  c.set_read_timeout(timeout_s, 0);
  if (key != nullptr) c.set_bearer_token_auth(key);
  httplib::Result r = method == "GET"      ? c.Get(path.c_str())
                      : method == "DELETE" ? c.Delete(path.c_str())
                                           : c.Post(path.c_str(), body, "application/json");
  Reply out;
  if (!r) return out;
  out.status = r->status;
  out.body = r->body;
  out.allow = r->get_header_value("Allow");
  auto j = ParseJson(r->body);
  if (j.ok()) out.json = *j;
  return out;
}

std::string Url(int port) { return "http://127.0.0.1:" + std::to_string(port); }

class Processes {
 public:
  explicit Processes(std::string dir) : dir_(std::move(dir)) {}
  ~Processes() {
    children_.clear();
    apps::StopAllChildren();
  }
  ChildProcess* Start(const std::string& name, const std::vector<std::string>& args) {
    auto c = ChildProcess::Spawn(name, args, dir_ + "/" + name + ".log", ROLLOUTCORE_BIN);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    if (!c.ok()) return nullptr;
    children_.push_back(std::move(c).value());
    return children_.back().get();
  }
  // Waits for the process to exit; its exit status (or -1 when it is still running after timeout).
  static int WaitExit(ChildProcess* c, int64_t timeout_ms) {
    const int64_t end = NowMs() + timeout_ms;
    while (c->Alive() && NowMs() < end) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return c->Alive() ? -1 : c->Stop();
  }

 private:
  std::string dir_;
  std::vector<std::unique_ptr<ChildProcess>> children_;
};

::testing::AssertionResult WaitHealthy(ChildProcess* c, int port, const std::string& path, int64_t timeout_ms = 90000) {
  if (c == nullptr) return ::testing::AssertionFailure() << "no process";
  const int64_t end = NowMs() + timeout_ms;
  while (NowMs() < end) {
    if (!c->Alive()) return ::testing::AssertionFailure() << c->name() << " died:\n" << c->LogTail();
    if (Send(port, "GET", path, "", nullptr, 2).status == 200) return ::testing::AssertionSuccess();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return ::testing::AssertionFailure() << c->name() << " not healthy within " << timeout_ms << " ms:\n" << c->LogTail();
}

std::string TestDir(const std::string& name) {
  std::string d = (fs::temp_directory_path() / ("rc_security_" + std::to_string(::getpid()) + "_" + name)).string();
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// The whole stack once for the suite (starting it is most of the time).
class SecurityE2E : public ::testing::Test {
 public:
  static void SetUpTestSuite() {
    ::setenv(net::kApiKeyEnv, kKey, 1);  // inherited by every child: their --api-key
    dir_ = TestDir("stack");
    procs_ = new Processes(dir_);
    dir_port_ = apps::FreePort().value();
    trainer_port_ = apps::FreePort().value();
    engine_port_ = apps::FreePort().value();
    ctl_port_ = apps::FreePort().value();
    ChildProcess* d = procs_->Start("directory", {"directory", "serve", "--port", std::to_string(dir_port_)});
    ASSERT_TRUE(WaitHealthy(d, dir_port_, "/health"));
    ChildProcess* t = procs_->Start(
        "trainer", {"trainer", "serve", "--model", "tiny", "--name", kModel, "--layout", "fsdp:2", "--directory",
                    Url(dir_port_), "--transport", "shm", "--seed", "7", "--port", std::to_string(trainer_port_)});
    ASSERT_TRUE(WaitHealthy(t, trainer_port_, "/status"));
    ChildProcess* e =
        procs_->Start("engine", {"engine", "serve", "--model", "tiny", "--load-format", "dummy", "--seed", "1",
                                 "--port", std::to_string(engine_port_), "--weight-version", "v0",
                                 "--served-model-name", kModel, "--threads", "1", "--directory", Url(dir_port_)});
    ASSERT_TRUE(WaitHealthy(e, engine_port_, "/health"));
    ChildProcess* c = procs_->Start(
        "controller", {"controller", "serve", "--engine", Url(engine_port_), "--directory", Url(dir_port_), "--model",
                       kModel, "--state-dir", dir_ + "/controller", "--port", std::to_string(ctl_port_)});
    ASSERT_TRUE(WaitHealthy(c, ctl_port_, "/health"));
  }
  static void TearDownTestSuite() {
    delete procs_;
    procs_ = nullptr;
    ::unsetenv(net::kApiKeyEnv);
    fs::remove_all(dir_);
  }

 protected:
  static inline std::string dir_;
  static inline Processes* procs_ = nullptr;
  static inline int dir_port_ = 0, trainer_port_ = 0, engine_port_ = 0, ctl_port_ = 0;
};

struct Mutation {
  std::string method, path, body;
};

// Sends each mutation without a key and with a wrong one; each must be 401 with a JSON error.
void ExpectAllRefused(int port, const std::string& server, const std::vector<Mutation>& ms) {
  for (const Mutation& m : ms) {
    for (const char* key : {static_cast<const char*>(nullptr), "not-the-key"}) {
      Reply r = Send(port, m.method, m.path, m.body, key);
      EXPECT_EQ(r.status, 401) << server << " " << m.method << " " << m.path << (key ? " (wrong key)" : " (no key)")
                               << " answered: " << r.body;
      EXPECT_TRUE(r.json.is_object()) << server << " " << m.path << ": 401 without a JSON body: " << r.body;
      EXPECT_EQ(r.body.find(kKey), std::string::npos) << "the key leaked in " << r.body;
    }
  }
}

TEST_F(SecurityE2E, EveryMutatingEndpointNeedsTheKeyAndNothingChanges) {
  // What each server shows of its state, read (without a key: reads are open) before and after.
  auto directory_state = [] { return Send(dir_port_, "GET", "/v1/models/m/versions?state=all", "", nullptr).body; };
  auto trainer_state = [] { return Send(trainer_port_, "GET", "/status", "", nullptr).body; };
  auto engine_state = [] {
    Json s = Send(engine_port_, "GET", "/rc/engine/state", "", nullptr).json;
    s["weight_info"] = Send(engine_port_, "GET", "/weight_info", "", nullptr).json;
    s["digest"] = Send(engine_port_, "GET", "/rc/weights/digest", "", nullptr).json.value("content_digest", "");
    const std::string metrics = Send(engine_port_, "GET", "/metrics", "", nullptr).body;
    for (const char* name : {"vllm:prompt_tokens_total", "rolloutcore_cache_resets_total",
                             "vllm:request_success_total{model_name=\"m\",finished_reason=\"abort\"}"}) {
      auto at = metrics.find(std::string("\n") + name);
      s[name] = at == std::string::npos ? "" : metrics.substr(at + 1, metrics.find('\n', at + 1) - at - 1);
    }
    return s.dump();
  };
  auto controller_state = [] {
    Json s = Send(ctl_port_, "GET", "/v1/status", "", nullptr).json;
    s["journal"] = Send(ctl_port_, "GET", "/v1/journal", "", nullptr).json;
    s["trajectories"] = Send(ctl_port_, "GET", "/v1/trajectories", "", nullptr).json;
    return s.dump();
  };
  const std::string d0 = directory_state(), t0 = trainer_state(), e0 = engine_state(), c0 = controller_state();
  ASSERT_NE(d0.find("\"v0\""), std::string::npos) << d0;
  ASSERT_NE(e0.find("\"paused\":false"), std::string::npos) << e0;

  const std::string publish = R"({"expected_ranks":1,"lease_ttl_ms":10000,"digest":"rc-digest-2","tensors":[]})";
  ExpectAllRefused(dir_port_, "directory",
                   {{"POST", "/v1/models/m/versions/v9/ranks/0", publish},
                    {"DELETE", "/v1/models/m/versions/v0", ""},
                    {"POST", "/v1/leases/1:keepalive", "{}"}});
  ExpectAllRefused(trainer_port_, "trainer",
                   {{"POST", "/step", ""},
                    {"POST", "/release", R"({"version":"v0"})"},
                    {"POST", "/fault/corrupt", R"({"version":"v0","rank":0,"byte":0})"}});
  const std::string stage = "{\"model\":\"m\",\"version\":\"v0\",\"directory\":\"" + Url(dir_port_) + "\"}";
  ExpectAllRefused(engine_port_, "engine",
                   {{"POST", "/v1/completions", R"({"prompt":[1,2,3],"max_tokens":2})"},
                    {"POST", "/pause?mode=abort", ""},
                    {"POST", "/resume", ""},
                    {"POST", "/abort_requests", "{}"},
                    {"POST", "/reset_prefix_cache", ""},
                    {"POST", "/reset_mm_cache", ""},
                    {"POST", "/reset_encoder_cache", ""},
                    {"POST", "/update_weight_version", R"({"new_version":"vFAKE"})"},
                    {"POST", "/rc/refit/stage", stage},
                    {"POST", "/rc/refit/install", R"({"version":"v0"})"},
                    {"POST", "/rc/refit/relay", stage}});
  ExpectAllRefused(ctl_port_, "controller",
                   {{"POST", "/v1/rollouts", R"({"prompt_token_ids":[1,2,3],"max_tokens":2})"},
                    {"POST", "/v1/rollouts:admit", R"({"rollout_id":"r1"})"},
                    {"POST", "/v1/rollouts/r1:finish", R"({"token_ids":[1]})"},
                    {"POST", "/v1/updates", R"({"model":"m","version":"v0"})"},
                    {"POST", "/v1/recover", R"({"model":"m","version":"v0"})"}});

  EXPECT_EQ(directory_state(), d0);
  EXPECT_EQ(trainer_state(), t0);
  EXPECT_EQ(engine_state(), e0);
  EXPECT_EQ(controller_state(), c0);
}

TEST_F(SecurityE2E, WithTheKeyAnUpdateRunsThroughEveryClient) {
  // Trainer → directory (publish), controller → engine (pause, stage, install, digest), engine →
  // directory (manifest): each hop carries the key or the update cannot finish.
  Reply step = Send(trainer_port_, "POST", "/step");
  ASSERT_EQ(step.status, 200) << step.body;
  const std::string version = step.json.value("version", "");
  ASSERT_FALSE(version.empty()) << step.body;
  int64_t end = NowMs() + 60000;
  while (NowMs() < end && Send(dir_port_, "GET", "/v1/models/m/versions/" + version).status != 200) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  Reply up = Send(ctl_port_, "POST", "/v1/updates", Json{{"model", kModel}, {"version", version}}.dump());
  ASSERT_EQ(up.status, 202) << up.body;
  Reply done;
  for (end = NowMs() + 60000; NowMs() < end; std::this_thread::sleep_for(std::chrono::milliseconds(50))) {
    done = Send(ctl_port_, "GET", "/v1/updates/" + up.json.value("id", ""));
    if (done.json.value("done", false)) break;
  }
  ASSERT_EQ(done.status, 200) << done.body;
  EXPECT_EQ(done.json.value("outcome", ""), "committed") << done.body;
  EXPECT_EQ(Send(engine_port_, "GET", "/weight_info").json.value("weight_version", ""), version);
  Reply rollout = Send(ctl_port_, "POST", "/v1/rollouts", R"({"prompt_token_ids":[5,6,7],"max_tokens":3})");
  EXPECT_EQ(rollout.status, 200) << rollout.body;
}

TEST_F(SecurityE2E, TheEngineStagesOnlyFromItsDirectory) {
  const std::string other = "http://127.0.0.1:1";
  Reply r = Send(engine_port_, "POST", "/rc/refit/stage",
                 Json{{"model", kModel}, {"version", "v0"}, {"directory", other}}.dump());
  EXPECT_EQ(r.status, 403) << r.body;
  EXPECT_NE(r.body.find(other), std::string::npos) << r.body;
  EXPECT_NE(r.body.find("--directory " + Url(dir_port_)), std::string::npos) << r.body;
}

TEST_F(SecurityE2E, WrongMethodIs405WithAllow) {
  struct Case {
    int port;
    std::string method, path, allow;
  };
  const std::vector<Case> cases = {
      {ctl_port_, "GET", "/v1/rollouts", "POST"}, {ctl_port_, "POST", "/v1/status", "GET"},
      {engine_port_, "GET", "/pause", "POST"},    {engine_port_, "POST", "/health", "GET"},
      {trainer_port_, "GET", "/step", "POST"},    {dir_port_, "POST", "/v1/models/m/versions", "GET"}};
  for (const Case& c : cases) {
    Reply r = Send(c.port, c.method, c.path);
    EXPECT_EQ(r.status, 405) << c.method << " " << c.path << ": " << r.body;
    EXPECT_EQ(r.allow, c.allow) << c.method << " " << c.path;
    EXPECT_TRUE(r.json.is_object()) << c.path << ": " << r.body;
  }
}

TEST_F(SecurityE2E, InvalidUtf8Is400NamingTheField) {
  struct Case {
    int port;
    std::string method, path, body, expect;
  };
  const std::vector<Case> cases = {
      {ctl_port_, "POST", "/v1/rollouts", "{\"prompt\": \"caf\xe9\", \"max_tokens\": 2}", "prompt: invalid UTF-8"},
      {ctl_port_, "GET", "/v1/updates/u%FF", "", "path: invalid UTF-8"},
      {ctl_port_, "GET", "/v1/trajectories?label=%C3%28", "", "query parameter 'label': invalid UTF-8"},
      {engine_port_, "POST", "/v1/completions", "{\"prompt\": [\"ok\", \"\xff\"], \"max_tokens\": 2}",
       "prompt[1]: invalid UTF-8"},
      {engine_port_, "POST", "/update_weight_version", "{\"new_version\": \"v\xc0\xaf\"}",
       "new_version: invalid UTF-8"},
      {trainer_port_, "POST", "/release", "{\"version\": \"v\xfe\"}", "version: invalid UTF-8"},
      {dir_port_, "GET", "/v1/models/%FF/versions", "", "path: invalid UTF-8"}};
  for (const Case& c : cases) {
    Reply r = Send(c.port, c.method, c.path, c.body);
    EXPECT_EQ(r.status, 400) << c.method << " " << c.path << ": " << r.body;
    EXPECT_NE(r.body.find(c.expect), std::string::npos) << c.path << ": " << r.body;
  }
  EXPECT_EQ(Send(engine_port_, "GET", "/weight_info").json.value("weight_version", "").find('v'), 0u);
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

TEST_F(SecurityE2E, IdleAndTricklingSocketsDoNotStallTheServers) {
  // Before: 8 idle sockets made the controller take 9.7 s for /v1/status, and the engine stalled
  // at 32. Now 64 idle plus 16 trickling sockets per server leave a normal request fast.
  for (int port : {ctl_port_, engine_port_, dir_port_, trainer_port_}) {
    std::vector<int> fds;
    for (int i = 0; i < 64; ++i) fds.push_back(ConnectLoopback(port));
    std::vector<int> trickle;
    for (int i = 0; i < 16; ++i) {
      int fd = ConnectLoopback(port);
      ASSERT_GE(fd, 0);
      ASSERT_EQ(::write(fd, "GET /health HTTP/1.1\r\nX: ", 25), 25);
      trickle.push_back(fd);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    for (int fd : trickle) ASSERT_EQ(::write(fd, "y", 1), 1);
    const std::string path = port == ctl_port_ ? "/v1/status" : port == trainer_port_ ? "/status" : "/health";
    const int64_t t0 = NowMs();
    Reply r = Send(port, "GET", path, "", nullptr, 30);
    const int64_t ms = NowMs() - t0;
    EXPECT_EQ(r.status, 200) << "port " << port;
    EXPECT_LT(ms, 3000) << "GET " << path << " waited behind idle sockets";
    for (int fd : fds) ::close(fd);
    for (int fd : trickle) ::close(fd);
  }
}

// Each server, bound to 0.0.0.0 without a key, must refuse to start; with --insecure-no-auth it
// starts (and warns).
TEST(SecurityStartTest, NonLoopbackWithoutKeyRefusesToStart) {
  ::unsetenv(net::kApiKeyEnv);
  const std::string dir = TestDir("bind");
  Processes procs(dir);
  const std::string port = std::to_string(apps::FreePort().value());
  const std::vector<std::pair<std::string, std::vector<std::string>>> servers = {
      {"directory", {"directory", "serve", "--host", "0.0.0.0", "--port", port}},
      {"trainer",
       {"trainer", "serve", "--model", "tiny", "--directory", "http://127.0.0.1:1", "--host", "0.0.0.0", "--port",
        port}},
      {"engine", {"engine", "serve", "--model", "tiny", "--load-format", "dummy", "--host", "0.0.0.0", "--port", port}},
      {"controller",
       {"controller", "serve", "--engine", "http://127.0.0.1:1", "--state-dir", dir + "/ctl", "--host", "0.0.0.0",
        "--port", port}}};
  for (const auto& [name, args] : servers) {
    ChildProcess* c = procs.Start(name, args);
    ASSERT_NE(c, nullptr);
    const int code = Processes::WaitExit(c, 60000);
    EXPECT_NE(code, 0) << name << " started on 0.0.0.0 without a key";
    EXPECT_NE(c->LogTail().find("without an API key"), std::string::npos) << name << ":\n" << c->LogTail();
  }
  std::vector<std::string> insecure = servers[0].second;
  insecure.push_back("--insecure-no-auth");
  ChildProcess* d = procs.Start("directory-insecure", insecure);
  EXPECT_TRUE(WaitHealthy(d, std::stoi(port), "/health"));
  EXPECT_NE(d->LogTail().find("WITHOUT authentication"), std::string::npos) << d->LogTail();
  fs::remove_all(dir);
}

TEST(SecurityStartTest, TlsOnLoopbackWithASelfSignedCertificate) {
  ::unsetenv(net::kApiKeyEnv);
  const std::string dir = TestDir("tls");
  const std::string cmd =
      "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=127.0.0.1 -addext "
      "subjectAltName=IP:127.0.0.1 -keyout " +
      dir + "/key.pem -out " + dir + "/cert.pem >" + dir + "/openssl.log 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << "openssl failed, see " << dir << "/openssl.log";
  Processes procs(dir);
  const int dport = apps::FreePort().value(), eport = apps::FreePort().value();
  const std::vector<std::string> tls = {"--tls-cert",     dir + "/cert.pem", "--tls-key",
                                        dir + "/key.pem", "--api-key",       "tls-key"};
  std::vector<std::string> dargs = {"directory", "serve", "--port", std::to_string(dport)};
  dargs.insert(dargs.end(), tls.begin(), tls.end());
  std::vector<std::string> eargs = {"engine", "serve",     "--model", "tiny",   "--load-format",
                                    "dummy",  "--threads", "1",       "--port", std::to_string(eport)};
  eargs.insert(eargs.end(), tls.begin(), tls.end());
  ChildProcess* d = procs.Start("directory", dargs);
  ChildProcess* e = procs.Start("engine", eargs);
  const net::ClientConfig trusted{"tls-key", dir + "/cert.pem"};
  for (auto [c, port] : {std::pair{d, dport}, std::pair{e, eport}}) {
    const std::string url = "https://127.0.0.1:" + std::to_string(port);
    auto client = net::MakeClient(url, trusted);
    client->set_connection_timeout(1, 0);
    int status = 0;
    for (int64_t end = NowMs() + 60000; NowMs() < end && status != 200 && c->Alive();) {
      auto r = client->Get("/health");
      status = r ? r->status : 0;
      if (status != 200) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ASSERT_EQ(status, 200) << c->name() << " over TLS:\n" << c->LogTail();
    auto post = client->Post(c == e ? "/resume" : "/v1/leases/1:keepalive", "{}", "application/json");
    ASSERT_TRUE(post);
    EXPECT_NE(post->status, 401) << "the key over TLS was refused: " << post->body;
    auto untrusted = net::MakeClient(url, net::ClientConfig{"tls-key", ""});
    EXPECT_FALSE(untrusted->Get("/health")) << "a certificate no CA signed must not verify";
    httplib::Client plain("127.0.0.1", port);
    auto r = plain.Get("/health");
    EXPECT_TRUE(!r || r->status != 200) << "plain HTTP answered on the TLS port";
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace rc::security_test
