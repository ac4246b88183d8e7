// Hosts as network namespaces (issue 19). The test creates five namespaces joined by veth pairs
// to one bridge (198.18-19.X.0/24; the bridge's address lets this test, in the root namespace, reach
// them): the two trainer ranks in two of them (two `trainer serve --layout fsdp:2` processes,
// each publishing one rank: --fail-rank names the rank it leaves to the other), two engines in
// two more, the directory and the controller in the fifth. Every server binds its namespace's
// address (beyond loopback: the API key is required, issue 13). Weights move over UCX with
// UCX_TLS=tcp across the veths; the refit must give the same per-tensor digests and the same
// greedy tokens as an engine on loopback that loaded the same version from disk. A second test
// adds `tc netem` delay and loss on one trainer's link: the update still ends (committed or
// failed) within its deadline.
//
// Needs root and a kernel that allows network namespaces, veth and bridges; otherwise skipped,
// saying which command was refused. The netem test is skipped when sch_netem is unavailable.
#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <future>

#include "system/system_fixture.h"

namespace rc::scale_test {
namespace {

using apps::ChildProcess;
using system_test::NowMs;
using system_test::Prompt;
using system_test::Reply;
using system_test::SystemTest;

// Runs a shell command; returns its exit code and captured output (stdout + stderr).
std::pair<int, std::string> Sh(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return {-1, "popen failed"};
  std::array<char, 512> buf{};
  while (std::fgets(buf.data(), buf.size(), p) != nullptr) out += buf.data();
  const int rc = ::pclose(p);
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, out};
}

// The namespaces, the veths and the bridge; removed on destruction (children first: the test's
// TearDown stops them before this object is destroyed).
class NetnsHosts {
 public:
  // Empty on success, else why the kernel or the container refused (the command and its answer).
  std::string Create(int n) {
    const int pid = static_cast<int>(::getpid());
    tag_ = "rc" + std::to_string(pid % 10000000);
    // 198.18.0.0/15 is reserved for network benchmarks (RFC 2544): no real host route to clash with.
    subnet_ = "198." + std::to_string(18 + pid % 2) + "." + std::to_string((pid / 2) % 256);
    bridge_ = tag_ + "b";
    if (::geteuid() != 0) return "not root (ip netns needs CAP_SYS_ADMIN and CAP_NET_ADMIN)";
    auto [found, path] = Sh("command -v ip");
    while (!path.empty() && (path.back() == '\n' || path.back() == ' ')) path.pop_back();
    if (found != 0 || path.empty()) return "the `ip` command (iproute2) is not installed";
    ip_ = path;
    std::vector<std::string> cmds = {"ip link add " + bridge_ + " type bridge",
                                     "ip addr add " + subnet_ + ".254/24 dev " + bridge_,
                                     "ip link set " + bridge_ + " up"};
    for (int i = 0; i < n; ++i) {
      const std::string ns = Ns(i), host = tag_ + "h" + std::to_string(i), inner = tag_ + "n" + std::to_string(i);
      cmds.push_back("ip netns add " + ns);
      cmds.push_back("ip link add " + host + " type veth peer name " + inner);
      cmds.push_back("ip link set " + inner + " netns " + ns);
      cmds.push_back("ip link set " + host + " master " + bridge_);
      cmds.push_back("ip link set " + host + " up");
      cmds.push_back("ip netns exec " + ns + " ip addr add " + Addr(i) + "/24 dev " + inner);
      cmds.push_back("ip netns exec " + ns + " ip link set " + inner + " up");
      cmds.push_back("ip netns exec " + ns + " ip link set lo up");
    }
    created_ = n;
    for (const std::string& c : cmds) {
      auto [rc, out] = Sh(c);
      if (rc != 0) return "`" + c + "` failed (" + std::to_string(rc) + "): " + out;
    }
    return "";
  }
  ~NetnsHosts() {
    for (int i = 0; i < created_; ++i) (void)Sh("ip netns del " + Ns(i));
    if (!bridge_.empty()) (void)Sh("ip link del " + bridge_);
  }
  std::string Ns(int i) const { return tag_ + "ns" + std::to_string(i); }
  std::string Addr(int i) const { return subnet_ + "." + std::to_string(i + 1); }
  std::string HostVeth(int i) const { return tag_ + "h" + std::to_string(i); }
  const std::string& ip() const { return ip_; }
  std::string InnerVeth(int i) const { return tag_ + "n" + std::to_string(i); }
  // Bytes the namespace sent into the bridge (the host side's receive counter).
  int64_t BytesFrom(int i) const {
    std::ifstream f("/sys/class/net/" + HostVeth(i) + "/statistics/rx_bytes");
    int64_t v = -1;
    f >> v;
    return v;
  }

 private:
  std::string tag_, subnet_, bridge_, ip_;
  int created_ = 0;
};

// Namespace roles.
constexpr int kTrainer0 = 0, kTrainer1 = 1, kEngine0 = 2, kEngine1 = 3, kControl = 4;

class NetnsTest : public SystemTest {
 protected:
  void SetUp() override {
    SystemTest::SetUp();
    ::setenv("UCX_TLS", "tcp", 1);  // inherited: UCX over TCP across the veths
  }
  void TearDown() override {
    SystemTest::TearDown();  // children first, then the namespaces (hosts_ below)
    hosts_.reset();
    ::unsetenv("UCX_TLS");
  }
  // Creates the five hosts or says why not.
  std::string MakeHosts() {
    hosts_ = std::make_unique<NetnsHosts>();
    return hosts_->Create(5);
  }
  ChildProcess* StartIn(int ns, const std::string& name, std::vector<std::string> args) {
    std::vector<std::string> full = {"netns", "exec", hosts_->Ns(ns), ROLLOUTCORE_BIN};
    full.insert(full.end(), args.begin(), args.end());
    auto c = ChildProcess::Spawn(name, full, dir_ + "/" + name + ".log", hosts_->ip());
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    if (!c.ok()) return nullptr;
    children_.push_back(std::move(c).value());
    return children_.back().get();
  }
  static Reply At(const std::string& host, int port, const std::string& method, const std::string& path,
                  const Json& body = Json(), int timeout_s = 60) {
    return HttpAt(host, port, method, path, body, timeout_s);
  }
  ::testing::AssertionResult Healthy(ChildProcess* c, const std::string& host, int port, const std::string& path) {
    const int64_t end = NowMs() + 90000;
    while (NowMs() < end) {
      if (c == nullptr || !c->Alive()) return ::testing::AssertionFailure() << "died:\n" << (c ? c->LogTail() : "");
      Reply r = At(host, port, "GET", path, Json(), 2);
      if (r.status == 200) return ::testing::AssertionSuccess();
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
    }
    return ::testing::AssertionFailure() << c->name() << " not healthy at " << host << ":" << port << "\n"
                                         << c->LogTail();
  }
  std::string UrlIn(int ns, int port) const { return "http://" + hosts_->Addr(ns) + ":" + std::to_string(port); }

  struct Deployment {
    int dir = 0, trainer0 = 0, trainer1 = 0, engine0 = 0, engine1 = 0, ctl = 0;
  };
  // Directory, the two trainer ranks (v0 committed), two engines from v0 on disk, controller.
  Deployment Deploy(const std::vector<std::string>& controller_args = {}) {
    Deployment d;
    d.dir = apps::FreePort().value();
    ChildProcess* dp = StartIn(kControl, "directory",
                               {"directory", "serve", "--store", "sqlite:" + dir_ + "/dir.db", "--host",
                                hosts_->Addr(kControl), "--port", std::to_string(d.dir)});
    EXPECT_TRUE(Healthy(dp, hosts_->Addr(kControl), d.dir, "/health"));
    auto trainer = [&](int ns, int leave_rank, int* port) {
      *port = apps::FreePort().value();
      ChildProcess* t =
          StartIn(ns, "trainer-rank" + std::to_string(1 - leave_rank), {"trainer",     "serve",
                                                                        "--model",     system_test::kPreset,
                                                                        "--name",      system_test::kModelName,
                                                                        "--layout",    "fsdp:2",
                                                                        "--directory", UrlIn(kControl, d.dir),
                                                                        "--transport", "ucx",
                                                                        "--seed",      system_test::kSeed,
                                                                        "--lr",        system_test::kLr,
                                                                        "--fail-rank", std::to_string(leave_rank),
                                                                        "--host",      hosts_->Addr(ns),
                                                                        "--port",      std::to_string(*port)});
      EXPECT_TRUE(Healthy(t, hosts_->Addr(ns), *port, "/status"));
    };
    trainer(kTrainer0, 1, &d.trainer0);  // publishes rank 0 of every version
    trainer(kTrainer1, 0, &d.trainer1);  // publishes rank 1: its first publish commits v0
    EXPECT_TRUE(WaitCommittedAt(d.dir, "v0").contains("content_digest"));
    Export("v0", dir_ + "/v0");
    auto engine = [&](int ns, const std::string& name, int* port) {
      *port = apps::FreePort().value();
      ChildProcess* e =
          StartIn(ns, name,
                  {"engine", "serve", "--model", dir_ + "/v0", "--tensor-parallel-size", "1", "--host",
                   hosts_->Addr(ns), "--port", std::to_string(*port), "--weight-version", "v0", "--served-model-name",
                   system_test::kModelName, "--threads", "1", "--directory", UrlIn(kControl, d.dir)});
      EXPECT_TRUE(Healthy(e, hosts_->Addr(ns), *port, "/health"));
    };
    engine(kEngine0, "engine0", &d.engine0);
    engine(kEngine1, "engine1", &d.engine1);
    d.ctl = apps::FreePort().value();
    std::vector<std::string> args = {"controller",
                                     "serve",
                                     "--engine",
                                     UrlIn(kEngine0, d.engine0) + "," + UrlIn(kEngine1, d.engine1),
                                     "--directory",
                                     UrlIn(kControl, d.dir),
                                     "--model",
                                     system_test::kModelName,
                                     "--state-dir",
                                     dir_ + "/controller",
                                     "--host",
                                     hosts_->Addr(kControl),
                                     "--port",
                                     std::to_string(d.ctl),
                                     "--max-updating",
                                     "2",
                                     "--verify-interval-ms",
                                     "0"};
    args.insert(args.end(), controller_args.begin(), controller_args.end());
    ChildProcess* c = StartIn(kControl, "controller", args);
    EXPECT_TRUE(Healthy(c, hosts_->Addr(kControl), d.ctl, "/health"));
    return d;
  }
  Json WaitCommittedAt(int dir_port, const std::string& version) {
    for (int i = 0; i < 1200; ++i) {
      Reply r = At(hosts_->Addr(kControl), dir_port, "GET",
                   std::string("/v1/models/") + system_test::kModelName + "/versions/" + version);
      if (r.status == 200 && r.json.contains("manifest")) return r.json["manifest"];
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ADD_FAILURE() << version << " never committed";
    return Json::object();
  }
  // Both trainer processes step (each publishes its rank); returns the committed manifest.
  Json StepBoth(const Deployment& d, const std::string& version) {
    auto a = std::async(std::launch::async, [&] { return At(hosts_->Addr(kTrainer0), d.trainer0, "POST", "/step"); });
    auto b = std::async(std::launch::async, [&] { return At(hosts_->Addr(kTrainer1), d.trainer1, "POST", "/step"); });
    Reply ra = a.get(), rb = b.get();
    EXPECT_EQ(ra.status, 200) << ra.text;
    EXPECT_EQ(rb.status, 200) << rb.text;
    return WaitCommittedAt(d.dir, version);
  }
  std::vector<int64_t> GreedyAt(const std::string& host, int port, int salt) {
    Reply r = At(host, port, "POST", "/v1/completions",
                 Json{{"prompt", Prompt(10, salt)},
                      {"max_tokens", 8},
                      {"temperature", 0.0},
                      {"ignore_eos", true},
                      {"return_token_ids", true}});
    EXPECT_EQ(r.status, 200) << r.text;
    return Tokens(r.json);
  }
  Json DigestAt(const std::string& host, int port) {
    Reply r = At(host, port, "GET", "/rc/weights/digest?fresh=true");
    EXPECT_EQ(r.status, 200) << r.text;
    return r.json;
  }

  std::unique_ptr<NetnsHosts> hosts_;
};

TEST_F(NetnsTest, RefitOverUcxTcpAcrossNamespacesMatchesLoopback) {
  if (std::string why = MakeHosts(); !why.empty()) GTEST_SKIP() << "network namespaces unavailable here: " << why;
  Deployment d = Deploy();
  ASSERT_FALSE(HasFailure());
  const int64_t from_t0 = hosts_->BytesFrom(kTrainer0), from_t1 = hosts_->BytesFrom(kTrainer1);
  Json v1 = StepBoth(d, "v1");
  Reply req = At(hosts_->Addr(kControl), d.ctl, "POST", "/v1/updates",
                 Json{{"model", system_test::kModelName}, {"version", "v1"}});
  ASSERT_EQ(req.status, 202) << req.text;
  Reply done = At(hosts_->Addr(kControl), d.ctl, "GET", "/v1/updates/" + req.json.value("id", "") + "?wait_ms=60000",
                  Json(), 90);
  ASSERT_EQ(done.status, 200) << done.text;
  ASSERT_EQ(done.json["engines"].size(), 2u) << done.text;
  for (const auto& e : done.json["engines"]) ASSERT_EQ(e.value("outcome", std::string()), "committed") << e.dump();
  // The bytes crossed the links of both trainer namespaces (UCX over TCP; no shared memory).
  const int64_t sent0 = hosts_->BytesFrom(kTrainer0) - from_t0, sent1 = hosts_->BytesFrom(kTrainer1) - from_t1;
  Figure("trainer0_link_bytes", sent0, "bytes");
  Figure("trainer1_link_bytes", sent1, "bytes");

  // The reference on loopback: an engine in this namespace that loaded v1 from disk.
  Export("v1", dir_ + "/v1");
  const int ref = StartEngine("loopback-v1", dir_ + "/v1", "v1", false);
  Json want = DigestAt("127.0.0.1", ref);
  ASSERT_TRUE(want.contains("tensors")) << want.dump();
  EXPECT_EQ(want.value("content_digest", std::string()), v1.value("content_digest", std::string("?")));
  int64_t bytes = 0;
  for (const auto& t : v1["tensors"]) {
    const int64_t elem = t.value("dtype", std::string()).find("32") != std::string::npos ? 4 : 2;
    for (const auto& s : t["shards"]) {
      int64_t n = elem;
      for (const auto& dim : s["shape"]) n *= dim.get<int64_t>();
      bytes += n;
    }
  }
  for (auto [ns, port] : {std::pair{kEngine0, d.engine0}, std::pair{kEngine1, d.engine1}}) {
    Json got = DigestAt(hosts_->Addr(ns), port);
    EXPECT_EQ(got.value("weight_version", std::string()), "v1");
    EXPECT_EQ(got["tensors"], want["tensors"]) << "every tensor's digest equals loopback's (engine in ns " << ns << ")";
    for (int salt = 0; salt < 3; ++salt) {
      EXPECT_EQ(GreedyAt(hosts_->Addr(ns), port, salt), GreedyAt("127.0.0.1", ref, salt)) << "prompt " << salt;
    }
  }
  Figure("model_bytes", bytes, "bytes");
  ASSERT_GT(bytes, 0) << v1.dump();
  // Each engine pulls each rank's half once: 2 engines x half the model out of each trainer link,
  // so the two links carry at least twice the model (plus TCP and UCX overhead).
  EXPECT_GE(sent0 + sent1, 2 * bytes) << "the weights must have crossed the trainer links";
  // And a rollout through the controller, bound to v1.
  Reply r =
      At(hosts_->Addr(kControl), d.ctl, "POST", "/v1/rollouts",
         Json{{"prompt_token_ids", Prompt(10, 0)}, {"max_tokens", 8}, {"temperature", 0.0}, {"ignore_eos", true}});
  ASSERT_EQ(r.status, 200) << r.text;
  EXPECT_EQ(r.json["binding"].value("label", std::string()), "v1");
  EXPECT_EQ(Tokens(r.json), GreedyAt("127.0.0.1", ref, 0));
}

TEST_F(NetnsTest, NetemDelayAndLossOnATrainerLinkEndTheUpdateWithinItsDeadline) {
  if (std::string why = MakeHosts(); !why.empty()) GTEST_SKIP() << "network namespaces unavailable here: " << why;
  // Delay and loss on the link of the trainer that holds rank 1 (both directions of its veth).
  const std::string netem = "tc qdisc add dev " + hosts_->HostVeth(kTrainer1) + " root netem delay 40ms loss 3%";
  if (auto [rc, out] = Sh(netem); rc != 0) {
    GTEST_SKIP() << "tc netem unavailable (sch_netem not in this kernel?): `" << netem << "`: " << out;
  }
  auto [rc_in, out_in] = Sh("ip netns exec " + hosts_->Ns(kTrainer1) + " tc qdisc add dev " +
                            hosts_->InnerVeth(kTrainer1) + " root netem delay 40ms loss 3%");
  ASSERT_EQ(rc_in, 0) << out_in;
  constexpr int64_t kStageDeadline = 20000;
  Deployment d = Deploy({"--stage-deadline-ms", std::to_string(kStageDeadline), "--install-deadline-ms", "20000"});
  ASSERT_FALSE(HasFailure());
  Json v1 = StepBoth(d, "v1");
  const int64_t t0 = NowMs();
  Reply req = At(hosts_->Addr(kControl), d.ctl, "POST", "/v1/updates",
                 Json{{"model", system_test::kModelName}, {"version", "v1"}});
  ASSERT_EQ(req.status, 202) << req.text;
  Reply done = At(hosts_->Addr(kControl), d.ctl, "GET", "/v1/updates/" + req.json.value("id", "") + "?wait_ms=90000",
                  Json(), 120);
  const int64_t took = NowMs() - t0;
  ASSERT_EQ(done.status, 200) << done.text;
  EXPECT_TRUE(done.json.value("done", false)) << done.text;
  Figure("update_under_netem_ms", took);
  EXPECT_LT(took, kStageDeadline + 20000 + 10000) << "ends within its deadlines, never hangs";
  for (const auto& e : done.json["engines"]) {
    const std::string outcome = e.value("outcome", std::string());
    std::cout << "engine " << e.value("index", -1) << ": " << outcome << " " << e.value("reason", std::string())
              << "\n";
    EXPECT_TRUE(outcome == "committed" || outcome == "rejected" || outcome == "tainted") << e.dump();
    if (outcome == "committed") {
      const int ns = e.value("index", -1) == 0 ? kEngine0 : kEngine1;
      const int port = ns == kEngine0 ? d.engine0 : d.engine1;
      EXPECT_EQ(DigestAt(hosts_->Addr(ns), port).value("content_digest", std::string()),
                v1.value("content_digest", std::string("?")));
    }
  }
}

}  // namespace
}  // namespace rc::scale_test
