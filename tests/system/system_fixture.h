// SystemTest: the fixture of the end-to-end experiments of issue #6 (tests/system/).
//
// Every test starts real processes of the `rolloutcore` binary — `directory serve` (SQLite),
// `trainer serve` (2-rank fsdp, shm or ucx), `engine serve` (tp 2, preset tiny, started from the
// trainer's v0 exported to disk) and `controller serve` — on loopback, and talks to them over
// HTTP only. Children are stopped on every exit path (TearDown, and PR_SET_PDEATHSIG if the test
// binary itself dies); logs and state live in a per-test folder under /tmp that is kept when the
// test fails.
//
// Clocks: the controller's journal `t_ms` is std::chrono::steady_clock (CLOCK_MONOTONIC), which
// is shared by every process on the host, so NowMs() here and journal times compare directly.
//
// Thread safety: helpers that only do HTTP (Http, Call, Rollout, ...) may be called from any
// thread; starting and stopping children only from the test's thread.
#pragma once

#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "apps/child_process.h"
#include "rolloutcore/base/json.h"
#include "rolloutcore/net/http.h"

namespace rc::system_test {

namespace fs = std::filesystem;
using apps::ChildProcess;

inline constexpr const char* kPreset = "tiny";
inline constexpr const char* kModelName = "m";  // the model's name in the directory and the engine
inline constexpr const char* kSeed = "7";
// A large learning rate, so consecutive versions differ enough that greedy outputs (and KV) do.
inline constexpr const char* kLr = "0.05";

inline int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A deterministic prompt of n token ids (byte-level vocabulary of tiny: ids < 256).
inline std::vector<int64_t> Prompt(int n, int salt) {
  std::vector<int64_t> p;
  for (int i = 0; i < n; ++i) p.push_back((salt * 53 + i * 29 + (i * i) % 17) % 250 + 3);
  return p;
}

// Writes <dir>/config.json of a model with the tiny preset's architecture, wider and deeper (about
// 16M parameters: a few ms per token at tp 2 on one thread), so 256 tokens take about a second and
// "mid-generation" is a wide window rather than a race. Returns the file's path.
inline std::string WideConfig(const std::string& dir) {
  Json c{{"architectures", {"Qwen3ForCausalLM"}}, {"attention_bias", false}, {"head_dim", 64},
         {"hidden_act", "silu"}, {"hidden_size", 512}, {"intermediate_size", 2048},
         {"max_position_embeddings", 512}, {"model_type", "qwen3"}, {"num_attention_heads", 8},
         {"num_hidden_layers", 4}, {"num_key_value_heads", 4}, {"rms_norm_eps", 1e-6},
         {"rope_scaling", nullptr}, {"rope_theta", 1000000.0}, {"tie_word_embeddings", false},
         {"torch_dtype", "bfloat16"}, {"vocab_size", 256}};
  fs::create_directories(dir);
  std::ofstream(dir + "/config.json") << c.dump(2);
  return dir + "/config.json";
}

struct Reply {
  int status = 0;  // 0: no answer (connection failed)
  std::string text;
  Json json;  // parsed body, or null
};

// Options of StartStack.
struct StackOptions {
  std::string transport = "shm";           // trainer transport
  std::string model;                       // trainer/export --model: "" = kPreset, or a config.json
  bool engine_faults = true;               // --enable-fault-injection on the engine
  std::vector<std::string> controller_args;  // extra `controller serve` flags (deadlines, ...)
  std::vector<std::string> trainer_args;     // extra `trainer serve` flags (--probes, ...)
};

// The processes of one stack. Ports stay fixed for the life of a test; a restarted process
// comes back on the same port (engine) or a new one (controller: see RestartController).
struct Stack {
  int dir = 0, trainer = 0, engine = 0, ctl = 0;
  ChildProcess* trainer_proc = nullptr;
  ChildProcess* engine_proc = nullptr;
  ChildProcess* ctl_proc = nullptr;
  std::string state_dir;
  std::string v0_dir;  // the trainer's v0 exported to disk (the engine's starting checkpoint)
  std::vector<std::string> controller_args;
  int controller_restarts = 0;
};

class SystemTest : public ::testing::Test {
 public:  // helpers are used by free functions of the tests too
  void SetUp() override {
    // A parameterized test's name holds a '/' ("Name/0"): flattened, so the folder removed at
    // TearDown is the one made here (not a subfolder of a leftover parent).
    std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::replace(name.begin(), name.end(), '/', '_');
    dir_ = (fs::temp_directory_path() / ("rc_system_" + std::to_string(::getpid()) + "_" + name)).string();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    // Every process of the stack requires this key for mutating requests (inherited through the
    // environment); Http() sends it, as do the processes' own clients (issue 13, defect 18).
    ::setenv(net::kApiKeyEnv, "rc-system-test-key", 1);
    t0_ = NowMs();
  }
  void TearDown() override {
    children_.clear();  // each ChildProcess stops (SIGTERM, then SIGKILL) in its destructor
    apps::StopAllChildren();
    if (!HasFailure()) {
      fs::remove_all(dir_);
    } else {
      std::cout << "logs and state kept in " << dir_ << std::endl;
    }
    std::cout << "[ figures ] " << ::testing::UnitTest::GetInstance()->current_test_info()->name() << " took "
              << (NowMs() - t0_) << " ms" << std::endl;
  }

  // Prints a figure and records it as a test property (it lands in the gtest XML report).
  void Figure(const std::string& key, int64_t value, const std::string& unit = "ms") {
    RecordProperty(key, std::to_string(value));
    std::cout << "[ figures ] " << key << " = " << value << " " << unit << std::endl;
  }

  ChildProcess* Start(const std::string& name, const std::vector<std::string>& args) {
    auto c = ChildProcess::Spawn(name, args, dir_ + "/" + name + ".log", ROLLOUTCORE_BIN);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    if (!c.ok()) return nullptr;
    children_.push_back(std::move(c).value());
    return children_.back().get();
  }

  // Waits (generously: the machine may be loaded) for GET path to answer 200.
  ::testing::AssertionResult WaitHealthy(ChildProcess* c, int port, const std::string& path,
                                         int64_t timeout_ms = 90000) {
    if (c == nullptr) return ::testing::AssertionFailure() << "no process";
    httplib::Client cli("127.0.0.1", port);
    cli.set_connection_timeout(1, 0);
    const int64_t end = NowMs() + timeout_ms;
    while (NowMs() < end) {
      if (!c->Alive()) return ::testing::AssertionFailure() << c->name() << " died:\n" << c->LogTail();
      auto r = cli.Get(path.c_str());
      if (r && r->status == 200) return ::testing::AssertionSuccess();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return ::testing::AssertionFailure() << c->name() << " not healthy within " << timeout_ms << " ms:\n"
                                         << c->LogTail();
  }

  static Reply Http(int port, const std::string& method, const std::string& path, const Json& body = Json(),
                    int timeout_s = 60) {
    return HttpAt("127.0.0.1", port, method, path, body, timeout_s);
  }
  // Http to `host` (another network namespace's address, say) rather than loopback.
  static Reply HttpAt(const std::string& host, int port, const std::string& method, const std::string& path,
                      const Json& body = Json(), int timeout_s = 60) {
    httplib::Client cli(host, port);
    net::ApplyClientPolicy(cli);
    cli.set_connection_timeout(2, 0);
    cli.set_read_timeout(timeout_s, 0);
    auto r = method == "GET" ? cli.Get(path.c_str())
                             : cli.Post(path.c_str(), body.is_null() ? std::string() : body.dump(), "application/json");
    Reply out;
    if (!r) return out;
    out.status = r->status;
    out.text = r->body;
    auto j = ParseJson(r->body);
    if (j.ok()) out.json = *j;
    return out;
  }

  // Http that expects a status (200 by default) and returns the JSON body.
  Json Call(int port, const std::string& method, const std::string& path, const Json& body = Json::object(),
            int expect = 200) {
    Reply r = Http(port, method, path, body);
    EXPECT_EQ(r.status, expect) << method << " :" << port << path << " answered: " << r.text;
    return r.json;
  }

  void Export(const std::string& version, const std::string& out) {
    ChildProcess* c = Start("export-" + version, {"trainer", "export", "--model", model_, "--seed", kSeed, "--lr",
                                                  kLr, "--version", version, "--out", out});
    ASSERT_NE(c, nullptr);
    while (c->Alive()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ASSERT_EQ(c->Stop(), 0) << c->LogTail();
  }

  static std::string Url(int port) { return "http://127.0.0.1:" + std::to_string(port); }

  int StartDirectory() {
    int port = apps::FreePort().value();
    ChildProcess* d = Start("directory", {"directory", "serve", "--store", "sqlite:" + dir_ + "/dir.db", "--port",
                                          std::to_string(port)});
    EXPECT_TRUE(WaitHealthy(d, port, "/health"));
    return port;
  }

  int StartTrainer(int dir_port, const std::string& transport, ChildProcess** out,
                   const std::vector<std::string>& extra = {}) {
    int port = apps::FreePort().value();
    std::vector<std::string> args = {"trainer", "serve", "--model", model_, "--name", kModelName, "--layout",
                                     "fsdp:2", "--directory", Url(dir_port), "--transport", transport, "--seed",
                                     kSeed, "--lr", kLr, "--port", std::to_string(port)};
    args.insert(args.end(), extra.begin(), extra.end());
    ChildProcess* t = Start("trainer", args);
    EXPECT_TRUE(WaitHealthy(t, port, "/status"));
    if (out) *out = t;
    return port;
  }

  // An engine at tp 2 loading `model_dir`; port 0 picks a new one.
  int StartEngine(const std::string& name, const std::string& model_dir, const std::string& label, bool faults,
                  ChildProcess** out = nullptr, int port = 0) {
    if (port == 0) port = apps::FreePort().value();
    std::vector<std::string> args = {"engine", "serve", "--model", model_dir, "--tensor-parallel-size", "2",
                                     "--port", std::to_string(port), "--weight-version", label,
                                     "--served-model-name", kModelName, "--threads", "1"};
    if (faults) args.push_back("--enable-fault-injection");
    ChildProcess* e = Start(name, args);
    EXPECT_TRUE(WaitHealthy(e, port, "/health"));
    if (out) *out = e;
    return port;
  }

  int StartController(Stack& s) {
    int port = apps::FreePort().value();
    std::vector<std::string> args = {"controller", "serve", "--engine", Url(s.engine), "--directory", Url(s.dir),
                                     "--model", kModelName, "--state-dir", s.state_dir, "--port",
                                     std::to_string(port)};
    args.insert(args.end(), s.controller_args.begin(), s.controller_args.end());
    std::string name = s.controller_restarts == 0 ? "controller" : "controller-" + std::to_string(s.controller_restarts);
    s.ctl_proc = Start(name, args);
    EXPECT_TRUE(WaitHealthy(s.ctl_proc, port, "/health"));
    s.ctl = port;
    return port;
  }

  // kill -9 the controller, then start it again over the same --state-dir.
  void RestartController(Stack& s, bool kill_first = true) {
    if (kill_first) s.ctl_proc->Kill();
    ++s.controller_restarts;
    StartController(s);
  }

  Json WaitCommitted(int dir_port, const std::string& version) {
    for (int i = 0; i < 1200; ++i) {
      Reply r = Http(dir_port, "GET", std::string("/v1/models/") + kModelName + "/versions/" + version);
      if (r.status == 200 && r.json.contains("manifest")) return r.json["manifest"];
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ADD_FAILURE() << version << " never committed";
    return Json::object();
  }

  // A trainer step: the next version, committed. Returns its manifest.
  Json Step(const Stack& s, const std::string& version) {
    Call(s.trainer, "POST", "/step");
    return WaitCommitted(s.dir, version);
  }

  // Directory + trainer (v0 committed) + engine from the exported v0 + controller.
  Stack StartStack(const StackOptions& o = {}) {
    Stack s;
    s.state_dir = dir_ + "/controller";
    s.v0_dir = dir_ + "/v0";
    s.controller_args = o.controller_args;
    if (!o.model.empty()) model_ = o.model;
    s.dir = StartDirectory();
    Export("v0", s.v0_dir);
    s.engine = StartEngine("engine", s.v0_dir, "v0", o.engine_faults, &s.engine_proc);
    s.trainer = StartTrainer(s.dir, o.transport, &s.trainer_proc, o.trainer_args);
    WaitCommitted(s.dir, "v0");
    StartController(s);
    return s;
  }

  // ---- controller ----

  static Json EngineStatus(int ctl) {
    Reply r = Http(ctl, "GET", "/v1/status");
    if (r.status != 200 || !r.json.contains("engines")) return Json::object();
    return r.json["engines"][0];
  }
  static std::string StateOf(int ctl) { return EngineStatus(ctl).value("state", std::string("?")); }

  // Polls /v1/status every `every_ms` until the state is `state`; returns the steady-clock time
  // it was first seen, or nullopt after timeout_ms.
  static std::optional<int64_t> WaitState(int ctl, const std::string& state, int64_t timeout_ms = 30000,
                                          int every_ms = 2) {
    const int64_t end = NowMs() + timeout_ms;
    while (NowMs() < end) {
      if (StateOf(ctl) == state) return NowMs();
      std::this_thread::sleep_for(std::chrono::milliseconds(every_ms));
    }
    return std::nullopt;
  }

  std::string RequestUpdate(int ctl, const std::string& version, bool recovery = false) {
    Json r = Call(ctl, "POST", recovery ? "/v1/recover" : "/v1/updates",
                  Json{{"model", kModelName}, {"version", version}}, 202);
    return r.value("id", std::string());
  }
  Json WaitUpdate(int ctl, const std::string& id, int64_t timeout_ms = 50000) {
    Reply r = Http(ctl, "GET", "/v1/updates/" + id + "?wait_ms=" + std::to_string(timeout_ms),
                   Json(), static_cast<int>(timeout_ms / 1000) + 30);
    EXPECT_EQ(r.status, 200) << r.text;
    EXPECT_TRUE(r.json.value("done", false)) << "update " << id << " not done: " << r.text;
    return r.json;
  }
  // An update (or recovery) from request to its end; returns the engine's entry.
  Json UpdateAndWait(int ctl, const std::string& version, bool recovery = false) {
    Json done = WaitUpdate(ctl, RequestUpdate(ctl, version, recovery));
    if (!done.contains("engines") || done["engines"].empty()) return Json::object();
    return done["engines"][0];
  }

  static std::vector<Json> Journal(int ctl) {
    Reply r = Http(ctl, "GET", "/v1/journal?since=0&engine=0");
    std::vector<Json> out;
    if (r.status == 200 && r.json.contains("records")) {
      for (const auto& x : r.json["records"]) out.push_back(x);
    }
    return out;
  }
  // The first record matching event (and rollout, when given) after seq `after`.
  static std::optional<Json> Find(const std::vector<Json>& journal, const std::string& event,
                                  const std::string& rollout = "", int64_t after = 0) {
    for (const auto& r : journal) {
      if (r.value("seq", int64_t{0}) <= after) continue;
      if (r.value("event", std::string()) != event) continue;
      if (!rollout.empty() && (!r["rollout"].is_string() || r["rollout"].get<std::string>() != rollout)) continue;
      return r;
    }
    return std::nullopt;
  }
  static std::optional<Json> FindLast(const std::vector<Json>& journal, const std::string& event) {
    std::optional<Json> last;
    for (const auto& r : journal) {
      if (r.value("event", std::string()) == event) last = r;
    }
    return last;
  }

  static std::vector<Json> Trajectories(int ctl, const std::string& label) {
    Reply r = Http(ctl, "GET", "/v1/trajectories?format=jsonl" + (label.empty() ? "" : "&label=" + label));
    std::vector<Json> out;
    EXPECT_EQ(r.status, 200) << r.text;
    std::istringstream in(r.text);
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      auto j = ParseJson(line);
      EXPECT_TRUE(j.ok()) << line;
      if (j.ok()) out.push_back(*j);
    }
    return out;
  }

  // A greedy rollout through the controller.
  static Reply Rollout(int ctl, const std::vector<int64_t>& prompt, int max_tokens, const std::string& id = "",
                       bool ignore_eos = true) {
    Json body{{"prompt_token_ids", prompt}, {"max_tokens", max_tokens}, {"temperature", 0.0},
              {"ignore_eos", ignore_eos}};
    if (!id.empty()) body["rollout_id"] = id;
    return Http(ctl, "POST", "/v1/rollouts", body, 120);
  }

  // ---- engine ----

  // A greedy completion straight on an engine (no controller).
  Json Complete(int engine, const std::vector<int64_t>& prompt, int max_tokens) {
    return Call(engine, "POST", "/v1/completions",
                Json{{"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0.0}, {"ignore_eos", true},
                     {"return_token_ids", true}});
  }
  static std::vector<int64_t> Tokens(const Json& completion) {
    if (!completion.contains("choices") || completion["choices"].empty()) return {};
    return completion["choices"][0].value("token_ids", std::vector<int64_t>());
  }
  static int64_t Cached(const Json& completion) {
    if (!completion.contains("usage")) return -1;
    return completion["usage"]["prompt_tokens_details"].value("cached_tokens", int64_t{-1});
  }
  std::string LiveDigest(int engine) {
    return Call(engine, "GET", "/rc/weights/digest?fresh=true").value("content_digest", std::string("?"));
  }
  void SetFaults(int engine, const Json& faults) { Call(engine, "POST", "/rc/fault", faults); }

  std::string dir_;
  std::string model_ = kPreset;  // what the trainer and the exports run
  int64_t t0_ = 0;
  std::vector<std::unique_ptr<ChildProcess>> children_;
};

}  // namespace rc::system_test
