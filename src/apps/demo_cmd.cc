// `rolloutcore demo`: the whole system on loopback, one command, no arguments.
//
// Starts a directory (SQLite), a 2-rank synthetic trainer (shm), an embedded engine at tp 2
// and the controller as child processes; runs concurrent rollouts through the controller while
// the trainer publishes several versions and the controller updates the engine to each; then
// prints a table and the checks. Exit code 0 only if every check passed. Children are stopped
// on every exit path (normal, error, Ctrl-C), and die with the demo even if it is killed.
#include <fmt/format.h>
#include <httplib.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <iostream>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "apps/cli_checks.h"
#include "apps/child_process.h"
#include "apps/commands.h"
#include "apps/stop_signals.h"
#include "rolloutcore/base/clock.h"
#include "rolloutcore/base/hash.h"
#include "rolloutcore/base/json.h"
#include "rolloutcore/base/mutex.h"
#include "rolloutcore/net/http.h"

namespace rc::apps {
namespace {

struct DemoOptions {
  std::string workdir;
  std::string model = "tiny";
  int versions = 3;
  int clients = 4;
  int tp = 2;
  int ranks = 2;
  std::string transport = "shm";
  int max_tokens = 24;
  int64_t seed = 1234;
  double lr = 0.02;
  bool json = false;
  bool keep = false;
  bool quiet = false;
};

struct Check {
  std::string name;
  bool ok = false;
  std::string detail;
};

class Demo {
 public:
  explicit Demo(DemoOptions o) : o_(std::move(o)) {}

  int Run();

 private:
  void Say(const std::string& s) {
    if (!o_.quiet && !o_.json) std::cout << fmt::format("[{:6.1f}s] {}", Elapsed(), s) << std::endl;
  }
  double Elapsed() const { return static_cast<double>(SystemClock::Default()->NowNs() - start_ns_) / 1e9; }
  void AddCheck(const std::string& name, bool ok, const std::string& detail) { checks_.push_back({name, ok, detail}); }

  Result<std::unique_ptr<ChildProcess>> Start(const std::string& name, const std::vector<std::string>& args) {
    return ChildProcess::Spawn(name, args, o_.workdir + "/" + name + ".log");
  }
  // Waits for GET url/path to answer 200.
  Status WaitHealthy(ChildProcess* child, int port, const std::string& path, int64_t timeout_ms) {
    auto deadline = SystemClock::Default()->NowMs() + timeout_ms;
    httplib::Client c("127.0.0.1", port);
    net::ApplyClientPolicy(c);
    c.set_connection_timeout(1, 0);
    while (SystemClock::Default()->NowMs() < deadline) {
      if (!child->Alive()) {
        return Unavailable(child->name() + " exited during start-up; its log (" + child->log_path() + "):\n" +
                           child->LogTail());
      }
      auto r = c.Get(path.c_str());
      if (r && r->status == 200) return OkStatus();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return DeadlineExceeded(child->name() + " did not become healthy within " + std::to_string(timeout_ms) +
                            " ms; its log:\n" + child->LogTail());
  }
  Result<Json> Http(int port, const std::string& method, const std::string& path, const Json& body = Json(),
                    int64_t timeout_s = 120) {
    httplib::Client c("127.0.0.1", port);
    net::ApplyClientPolicy(c);
    c.set_read_timeout(timeout_s, 0);
    auto r = method == "GET" ? c.Get(path.c_str()) : c.Post(path.c_str(), body.is_null() ? "" : body.dump(), "application/json");
    if (!r) return Unavailable(method + " :" + std::to_string(port) + path + ": " + httplib::to_string(r.error()));
    if (r->status / 100 != 2) {
      return Status(r->status == 503 ? StatusCode::kUnavailable : StatusCode::kInternal,
                    method + " :" + std::to_string(port) + path + " answered " + std::to_string(r->status) + ": " + r->body);
    }
    if (r->body.empty()) return Json::object();
    if (path == "/metrics") return Json(r->body);
    return ParseJson(r->body, path);
  }
  Result<Json> WaitCommitted(const std::string& version, int64_t timeout_ms) {
    auto deadline = SystemClock::Default()->NowMs() + timeout_ms;
    while (SystemClock::Default()->NowMs() < deadline) {
      auto j = Http(dir_port_, "GET", "/v1/models/" + model_name_ + "/versions/" + version);
      if (j.ok() && j->contains("manifest")) return (*j)["manifest"];
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return DeadlineExceeded("version " + version + " was not committed within " + std::to_string(timeout_ms) + " ms");
  }
  double PrefixHits() {
    auto m = Http(engine_port_, "GET", "/metrics");
    if (!m.ok()) return -1;
    std::string text = m->get<std::string>();
    auto pos = text.find("\nvllm:prefix_cache_hits_total");
    if (pos == std::string::npos) return -1;
    auto line_end = text.find('\n', pos + 1);
    auto line = text.substr(pos + 1, line_end - pos - 1);
    return std::stod(line.substr(line.rfind(' ') + 1));
  }
  void Clients();
  Status Setup();
  void LockCheck();
  Status Cycle(int k);
  void Report();

  DemoOptions o_;
  int64_t start_ns_ = SystemClock::Default()->NowNs();
  std::string model_name_ = "demo";
  int dir_port_ = 0, trainer_port_ = 0, engine_port_ = 0, ctl_port_ = 0;
  std::unique_ptr<ChildProcess> directory_, trainer_, engine_, controller_;
  std::vector<Check> checks_;
  Json versions_ = Json::array();
  std::atomic<bool> stop_clients_{false};
  std::atomic<int64_t> rollouts_ok_{0}, rollouts_refused_{0}, rollouts_failed_{0};
  rc::Mutex mu_;
  std::map<std::string, int64_t> per_label_ GUARDED_BY(mu_);          // guarded by mu_
  std::map<std::string, int64_t> label_mismatch_ GUARDED_BY(mu_);     // guarded by mu_
};

Status Demo::Setup() {
  std::filesystem::create_directories(o_.workdir);
  RC_ASSIGN_OR_RETURN(dir_port_, FreePort());
  RC_ASSIGN_OR_RETURN(trainer_port_, FreePort());
  RC_ASSIGN_OR_RETURN(engine_port_, FreePort());
  RC_ASSIGN_OR_RETURN(ctl_port_, FreePort());
  std::string dir_url = "http://127.0.0.1:" + std::to_string(dir_port_);
  // One API key for the whole demo (README "Security"): the children inherit it through the
  // environment and require it on every mutating request; this process sends it (rc::net).
  if (const char* k = ::getenv(net::kApiKeyEnv); k == nullptr || *k == '\0') {
    std::random_device rd;
    std::string key = "rc-demo-";
    for (int i = 0; i < 4; ++i) key += fmt::format("{:08x}", rd());
    ::setenv(net::kApiKeyEnv, key.c_str(), 1);
  }

  Say("starting the directory (SQLite) on :" + std::to_string(dir_port_));
  RC_ASSIGN_OR_RETURN(directory_, Start("directory", {"directory", "serve", "--store",
                                                      "sqlite:" + o_.workdir + "/directory.db", "--port",
                                                      std::to_string(dir_port_)}));
  RC_RETURN_IF_ERROR(WaitHealthy(directory_.get(), dir_port_, "/health", 20000));

  Say("exporting the trainer's v0 as the engine's starting checkpoint");
  std::string v0_dir = o_.workdir + "/v0";
  auto exporter = Start("export-v0", {"trainer", "export", "--model", o_.model, "--seed", std::to_string(o_.seed),
                                      "--lr", fmt::format("{}", o_.lr), "--version", "v0", "--out", v0_dir});
  if (!exporter.ok()) return exporter.status();
  while ((*exporter)->Alive()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  if ((*exporter)->Stop() != 0) return Internal("trainer export failed:\n" + (*exporter)->LogTail());

  Say(fmt::format("starting the engine (tp {}) on :{}", o_.tp, engine_port_));
  RC_ASSIGN_OR_RETURN(engine_, Start("engine", {"engine", "serve", "--model", v0_dir, "--tensor-parallel-size",
                                                std::to_string(o_.tp), "--port", std::to_string(engine_port_),
                                                "--weight-version", "v0", "--served-model-name", model_name_,
                                                "--directory", dir_url}));
  RC_RETURN_IF_ERROR(WaitHealthy(engine_.get(), engine_port_, "/health", 60000));

  Say(fmt::format("starting the synthetic trainer ({} ranks, {} transport) on :{}", o_.ranks, o_.transport,
                  trainer_port_));
  RC_ASSIGN_OR_RETURN(trainer_, Start("trainer", {"trainer", "serve", "--model", o_.model, "--name", model_name_,
                                                  "--layout", "fsdp:" + std::to_string(o_.ranks), "--directory",
                                                  dir_url, "--transport", o_.transport, "--seed",
                                                  std::to_string(o_.seed), "--lr", fmt::format("{}", o_.lr),
                                                  "--port", std::to_string(trainer_port_), "--keep", "3"}));
  RC_RETURN_IF_ERROR(WaitHealthy(trainer_.get(), trainer_port_, "/status", 60000));
  RC_ASSIGN_OR_RETURN(Json v0, WaitCommitted("v0", 60000));

  // The engine's starting weights are exactly the trainer's v0.
  RC_ASSIGN_OR_RETURN(Json digest, Http(engine_port_, "GET", "/rc/weights/digest"));
  std::string want = v0.value("content_digest", "");
  AddCheck("engine starts on v0 (content digest == directory)", digest.value("content_digest", "") == want,
           digest.value("content_digest", "?") + " vs " + want);

  Say("starting the controller on :" + std::to_string(ctl_port_));
  RC_ASSIGN_OR_RETURN(controller_, Start("controller", {"controller", "serve", "--engine",
                                                        "http://127.0.0.1:" + std::to_string(engine_port_),
                                                        "--directory", dir_url, "--model", model_name_, "--state-dir",
                                                        o_.workdir + "/controller", "--port",
                                                        std::to_string(ctl_port_)}));
  RC_RETURN_IF_ERROR(WaitHealthy(controller_.get(), ctl_port_, "/health", 30000));
  LockCheck();
  return OkStatus();
}

// The lock on the door: a mutating request without the key is refused (401) on every server and
// changes nothing; reads stay open.
void Demo::LockCheck() {
  struct Probe {
    const char* server;
    int port;
    const char* path;
  };
  const Probe probes[] = {{"directory", dir_port_, "/v1/models/m/versions/vX/ranks/0"},
                          {"trainer", trainer_port_, "/step"},
                          {"engine", engine_port_, "/pause?mode=abort"},
                          {"controller", ctl_port_, "/v1/updates"}};
  std::string detail;
  bool ok = true;
  for (const Probe& p : probes) {
    httplib::Client c("127.0.0.1", p.port);  // deliberately without the key
    auto r = c.Post(p.path, "{}", "application/json");
    const int code = r ? r->status : 0;
    ok = ok && code == 401;
    detail += fmt::format("{}{} {}", detail.empty() ? "" : ", ", p.server, code);
  }
  auto paused = Http(engine_port_, "GET", "/is_paused");
  ok = ok && paused.ok() && !paused->value("is_paused", true);
  AddCheck("without the API key every server answers 401 and nothing changes", ok, detail);
}

void Demo::Clients() {
  // A small set of prompts, each repeated: repeats hit the prefix cache while a version lasts.
  std::vector<Json> prompts;
  for (int p = 0; p < 6; ++p) {
    Json ids = Json::array();
    for (int i = 0; i < 40 + 8 * p; ++i) ids.push_back((p * 31 + i * 7) % 200 + 3);
    prompts.push_back(ids);
  }
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(o_.clients));
  for (int c = 0; c < o_.clients; ++c) {
    threads.emplace_back([this, c, prompts] {
      httplib::Client cli("127.0.0.1", ctl_port_);
      net::ApplyClientPolicy(cli);
      cli.set_read_timeout(120, 0);
      int n = 0;
      while (!stop_clients_) {
        Json body{{"prompt_token_ids", prompts[(c + n) % prompts.size()]},
                  {"max_tokens", o_.max_tokens},
                  {"temperature", 0.7},
                  {"seed", c * 1000 + n},
                  {"logprobs", 1}};
        ++n;
        auto r = cli.Post("/v1/rollouts", body.dump(), "application/json");
        if (!r) {
          rollouts_failed_++;
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
          continue;
        }
        if (r->status == 503) {
          rollouts_refused_++;
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
          continue;
        }
        if (r->status != 200) {
          rollouts_failed_++;
          continue;
        }
        auto j = ParseJson(r->body, "rollout");
        if (!j.ok()) {
          rollouts_failed_++;
          continue;
        }
        rollouts_ok_++;
        std::string label = (*j)["binding"].value("label", "");
        std::string engine_label = (*j)["choices"][0].value("weight_version", label);
        rc::MutexLock lock(mu_);
        per_label_[label]++;
        if (engine_label != label) label_mismatch_[label]++;
      }
    });
  }
  for (auto& t : threads) t.join();
}

Status Demo::Cycle(int k) {
  std::string version = "v" + std::to_string(k);
  double hits_before = PrefixHits();
  Say("trainer step → " + version);
  RC_ASSIGN_OR_RETURN(Json step, Http(trainer_port_, "POST", "/step", Json::object()));
  (void)step;
  RC_ASSIGN_OR_RETURN(Json committed, WaitCommitted(version, 60000));
  Say(version + " committed by the directory (digest " + committed.value("content_digest", "?") + "); updating");
  RC_ASSIGN_OR_RETURN(Json upd, Http(ctl_port_, "POST", "/v1/updates", Json{{"model", model_name_}, {"version", version}}));
  std::string id = upd.value("id", "");
  RC_ASSIGN_OR_RETURN(Json done, Http(ctl_port_, "GET", "/v1/updates/" + id + "?wait_ms=120000", Json(), 180));
  const Json& e = done["engines"][0];
  std::string outcome = e.value("outcome", "?");
  int64_t pause_ms = 0;
  for (const char* ph : {"QUIESCED", "UPDATING", "INVALIDATING", "VALIDATING", "RESUMING"}) {
    if (e.contains("phases_ms") && e["phases_ms"].contains(ph)) pause_ms += e["phases_ms"][ph].get<int64_t>();
  }
  const Json& ev = e.value("evidence", Json::object());
  Json staged = ev.contains("staged") ? ev["staged"]["engine"] : Json::object();
  double wire_ms = staged.contains("stages_ms") ? staged["stages_ms"].value("wire", 0.0) : 0.0;
  double bytes = staged.value("bytes_pulled", 0.0);
  double gbps = wire_ms > 0 ? bytes / (wire_ms * 1e6) : 0.0;
  std::string live_digest = ev.contains("validated") ? ev["validated"].value("content_digest", "") : "";
  std::string want = committed.value("content_digest", "");
  // Let rollouts run on the new version for a moment before sampling the cache again.
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  double hits_after = PrefixHits();
  Say(fmt::format("{} {}: pause window {} ms, wire {:.2f} GB/s, digest {}", version, outcome, pause_ms, gbps,
                  live_digest == want ? "verified" : "MISMATCH"));
  versions_.push_back(Json{{"version", version},
                           {"outcome", outcome},
                           {"pause_ms", pause_ms},
                           {"phases_ms", e.value("phases_ms", Json::object())},
                           {"wire_gbps", gbps},
                           {"bytes_pulled", bytes},
                           {"prefix_hits_before", hits_before},
                           {"prefix_hits_after", hits_after},
                           {"digest_live", live_digest},
                           {"digest_committed", want}});
  AddCheck("update to " + version + " committed", outcome == "committed", e.value("reason", ""));
  AddCheck("live digest of " + version + " == directory", !want.empty() && live_digest == want,
           live_digest + " vs " + want);
  return OkStatus();
}

void Demo::Report() {
  // Journal: no admission between begin_install and the commit that follows.
  auto journal = Http(ctl_port_, "GET", "/v1/journal?since=0&engine=0");
  bool clean = journal.ok();
  int64_t admits = 0;
  if (journal.ok()) {
    bool mutating = false;
    for (const auto& r : (*journal)["records"]) {
      std::string ev = r.value("event", "");
      if (ev == "begin_install") mutating = true;
      if (ev == "resumed" || ev == "taint" || ev == "reject_before_mutation") mutating = false;
      if (ev == "admit") {
        ++admits;
        if (mutating) clean = false;
      }
    }
  }
  AddCheck("no rollout admitted while weights were mutating (journal)", clean,
           std::to_string(admits) + " admissions journaled");
  int64_t mismatches = 0;
  {
    rc::MutexLock lock(mu_);
    for (auto& [l, n] : label_mismatch_) mismatches += n;
    for (const auto& v : versions_) {
      std::string label = v["version"];
      AddCheck("rollouts ran on " + label, per_label_[label] > 0, std::to_string(per_label_[label]) + " rollouts");
    }
  }
  AddCheck("every rollout's binding == the label the engine generated under", mismatches == 0,
           std::to_string(mismatches) + " mismatches");
  auto traj = Http(ctl_port_, "GET", "/v1/trajectories?limit=1");
  AddCheck("trajectories recorded", traj.ok() && !(*traj)["trajectories"].empty(), "");

  bool all_ok = true;
  for (const auto& c : checks_) all_ok = all_ok && c.ok;
  Json report{{"ok", all_ok},
              {"workdir", o_.workdir},
              {"journal", o_.workdir + "/controller/engine-0.journal.db"},
              {"trajectories", o_.workdir + "/controller/trajectories.db"},
              {"versions", versions_},
              {"rollouts", {{"ok", rollouts_ok_.load()}, {"refused_retryable", rollouts_refused_.load()},
                            {"failed", rollouts_failed_.load()}}}};
  Json per = Json::object();
  {
    rc::MutexLock lock(mu_);
    for (auto& [l, n] : per_label_) per[l] = n;
  }
  report["rollouts_per_version"] = per;
  Json cj = Json::array();
  for (const auto& c : checks_) cj.push_back(Json{{"check", c.name}, {"ok", c.ok}, {"detail", c.detail}});
  report["checks"] = cj;
  if (o_.json) {
    std::cout << report.dump(2) << std::endl;
    return;
  }
  std::cout << "\n"
            << fmt::format("{:<8} {:<10} {:>9} {:>9} {:>10} {:>12} {:>12}  {}\n", "version", "outcome", "rollouts",
                           "pause ms", "wire GB/s", "hits before", "hits after", "digest");
  std::cout << fmt::format("{:<8} {:<10} {:>9} {:>9} {:>10} {:>12} {:>12}  {}\n", "v0", "initial", per.value("v0", 0),
                           "-", "-", "-", "-", "verified at start");
  for (const auto& v : versions_) {
    std::cout << fmt::format("{:<8} {:<10} {:>9} {:>9} {:>10.2f} {:>12.0f} {:>12.0f}  {}\n", v["version"].get<std::string>(),
                             v["outcome"].get<std::string>(), per.value(v["version"].get<std::string>(), 0),
                             v["pause_ms"].get<int64_t>(), v["wire_gbps"].get<double>(),
                             v["prefix_hits_before"].get<double>(), v["prefix_hits_after"].get<double>(),
                             v["digest_live"] == v["digest_committed"] ? "verified" : "MISMATCH");
  }
  std::cout << fmt::format("\nrollouts: {} ok, {} refused while updating (retried), {} failed\n", rollouts_ok_.load(),
                           rollouts_refused_.load(), rollouts_failed_.load());
  std::cout << "journal:      " << report["journal"].get<std::string>() << "\n"
            << "trajectories: " << report["trajectories"].get<std::string>()
            << "  (also GET /v1/trajectories?format=jsonl)\n"
            << "logs:         " << o_.workdir << "/*.log\n\nchecks\n";
  for (const auto& c : checks_) {
    std::cout << fmt::format("  [{}] {}{}\n", c.ok ? "PASS" : "FAIL", c.name, c.detail.empty() ? "" : "  (" + c.detail + ")");
  }
  std::cout << (all_ok ? "\nall checks passed\n" : "\nSOME CHECKS FAILED\n");
}

int Demo::Run() {
  Status s = Setup();
  if (!s.ok()) {
    std::cerr << "demo: " << s.ToString() << "\n";
    StopAllChildren();
    return 1;
  }
  Say(fmt::format("{} clients sending rollouts through the controller", o_.clients));
  std::thread clients([this] { Clients(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  for (int k = 1; k <= o_.versions && s.ok(); ++k) {
    s = Cycle(k);
    if (s.ok()) std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  }
  stop_clients_ = true;
  clients.join();
  if (!s.ok()) {
    std::cerr << "demo: " << s.ToString() << "\n";
    AddCheck("demo ran to the end", false, s.message());
  }
  Report();
  StopAllChildren();
  bool all_ok = true;
  for (const auto& c : checks_) all_ok = all_ok && c.ok;
  if (!o_.keep && all_ok) std::filesystem::remove_all(o_.workdir + "/v0");
  return all_ok ? 0 : 1;
}

std::atomic<bool> g_interrupted{false};

}  // namespace

void RegisterDemoCommand(CLI::App& app, int* exit_code) {
  auto* cmd = app.add_subcommand(
      "demo",
      "Run the whole system on loopback: a directory, a 2-rank synthetic trainer, an embedded engine at tp 2 and the "
      "controller as child processes; concurrent rollouts while the trainer publishes versions and the controller "
      "updates the engine; a table and checks at the end (exit 0 only if every check passed).");
  auto o = std::make_shared<DemoOptions>();
  cmd->add_option("--workdir", o->workdir, "Where logs, journals and trajectories go (default: a new /tmp folder)");
  cmd->add_option("--model", o->model, "Model preset or config.json for the trainer")->capture_default_str();
  cmd->add_option("--versions", o->versions, "Versions the trainer publishes after v0")
      ->check(CLI::Range(1, 10000))
      ->capture_default_str();
  cmd->add_option("--clients", o->clients, "Concurrent rollout clients")->check(CLI::Range(1, 1024))->capture_default_str();
  cmd->add_option("--tensor-parallel-size", o->tp, "Engine tensor-parallel ranks")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  cmd->add_option("--trainer-ranks", o->ranks, "Trainer ranks (fsdp:N)")->check(CLI::Range(1, 65536))->capture_default_str();
  cmd->add_option("--transport", o->transport, "shm or ucx")->check(CLI::IsMember({"shm", "ucx"}))->capture_default_str();
  cmd->add_option("--max-tokens", o->max_tokens, "Tokens per rollout")->check(CLI::Range(1, 1 << 20))->capture_default_str();
  cmd->add_flag("--json", o->json, "Print a machine-readable report instead of the table");
  cmd->add_flag("--keep", o->keep, "Keep everything in the work dir");
  cmd->callback([o, exit_code] {
    if (o->workdir.empty()) {
      char tmpl[] = "/tmp/rolloutcore-demo-XXXXXX";
      char* d = mkdtemp(tmpl);
      if (d == nullptr) {
        std::cerr << "demo: cannot create a work dir in /tmp\n";
        *exit_code = 1;
        return;
      }
      o->workdir = d;
    }
    // Ctrl-C / SIGTERM: stop the children, then exit.
    const StopSignals stop_signals;
    std::thread watcher([stop_signals] {
      stop_signals.Wait();
      if (g_interrupted.exchange(true)) return;
      std::cerr << "\ndemo: interrupted; stopping the child processes\n";
      StopAllChildren();
      _exit(130);
    });
    watcher.detach();
    Demo demo(*o);
    *exit_code = demo.Run();
  });
}

}  // namespace rc::apps
