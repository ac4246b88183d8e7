// `rolloutcore controller serve`: the controller service over HTTP engines and a directory.
#include <algorithm>
#include <cmath>
#include <csignal>
#include <iostream>
#include <optional>
#include <sstream>

#include "apps/cli_checks.h"
#include "apps/commands.h"
#include "apps/server_flags.h"
#include "apps/stop_signals.h"
#include "rolloutcore/adapters/registry.h"
#include "rolloutcore/controller/directory_versions.h"
#include "rolloutcore/controller/http_server.h"
#include "rolloutcore/directory/client.h"
#include "rolloutcore/net/http.h"

namespace rc::apps {
namespace {

std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop = true; }

std::vector<std::string> SplitCommas(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

// The flags of `controller serve` (defaults as shown in --help).
struct ServeOptions {
  std::string engines;
  std::string directory;
  std::string state_dir;
  std::string host = "127.0.0.1";
  int port = 8100;
  bool auto_update = false;
  std::string model;
  int max_updating = 1;
  std::string embedded_model = "tiny", embedded_load_format = "auto", embedded_label = "v0";
  int embedded_tp = 1;
  uint64_t embedded_seed = 0;
  std::string drain_policy = "wait";
  int64_t verify_interval_ms = 1000;
  bool auto_recover = false;
  double lease_timeout_s = 300;
  int64_t max_wait_ms = 120'000;
  std::string pause_mode = "wait";
  std::string update_mode = "strict";
  int64_t max_staleness = -1;
  bool no_prefetch = false;
  double replay_tolerance = -1;
  std::string vllm_transfer = "rolloutcore";
  std::string vllm_native_trainer;
  std::string vllm_native_init = "controller";
  std::string vllm_pause_call = "sleep";
  std::string vllm_delta_policy;  // empty: the worker's default
  bool vllm_fold_engine_calls = false;
  int vllm_reset_attempts = 5;
  bool vllm_allow_untested_version = false;
  int64_t drain_ms = 30000, stage_ms = 120000, pause_ms = 10000, install_ms = 60000, reset_ms = 5000,
          validate_ms = 60000, resume_ms = 5000;
  net::ServerSecurity security;
};

// --engine and the embedded engine's flags.
void AddEngineFlags(CLI::App* serve, ServeOptions* o) {
  serve
      ->add_option("--engine", o->engines,
                   "Engine URL(s), comma-separated, one kind each (docs/architecture.md, \"a new engine\"):\n" +
                       adapters::EngineKindsHelp())
      ->required();
  serve->add_option("--embedded-model", o->embedded_model, "Embedded engine: preset name or Hugging Face folder")
      ->capture_default_str();
  serve->add_option("--embedded-load-format", o->embedded_load_format,
                    "Embedded engine: auto (a folder's safetensors; a preset's seeded random weights) or dummy "
                    "(seeded random)")
      ->check(CLI::IsMember({"auto", "dummy"}))
      ->capture_default_str();
  serve->add_option("--embedded-tp", o->embedded_tp, "Embedded engine: tensor-parallel size")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  serve->add_option("--embedded-seed", o->embedded_seed, "Embedded engine: seed for dummy weights")
      ->capture_default_str();
  serve->add_option("--embedded-weight-version", o->embedded_label, "Embedded engine: label of the loaded weights")
      ->capture_default_str();
}

// The directory, the state, the address and the service's update flags.
void AddServiceFlags(CLI::App* serve, ServeOptions* o) {
  serve->add_option("--directory", o->directory, "Directory base URL (http://127.0.0.1:8200)")->check(HttpUrl());
  serve->add_option("--state-dir", o->state_dir, "Where the journals and the trajectory store live")->required();
  serve->add_option("--host", o->host, "Address to bind (default 127.0.0.1)");
  serve->add_option("--port", o->port, "Port to listen on (0: any free port)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  serve->add_flag("--auto-update", o->auto_update, "Follow new committed versions of --model in the directory");
  serve->add_option("--model", o->model, "Directory model name (for --auto-update and the engines' staging)");
  serve->add_option("--max-updating", o->max_updating, "How many engines may update at once")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
}

// The lifecycle policy: drain, identity checks, recovery, leases, pause and update modes, staleness,
// replay tolerance, prefetch.
void AddPolicyFlags(CLI::App* serve, ServeOptions* o) {
  serve->add_option("--drain-policy", o->drain_policy, "After the drain deadline: wait | abort | cancel")
      ->check(CLI::IsMember({"wait", "abort", "cancel"}))
      ->capture_default_str();
  serve->add_option("--verify-interval-ms", o->verify_interval_ms,
                    "Identity check of every READY engine every N ms (boot id, label, install generation, cached "
                    "digest vs what was verified and committed; a mismatch taints the engine); 0: only after "
                    "updates and on every completion")
      ->check(CLI::Range(int64_t{0}, int64_t{86'400'000}))
      ->capture_default_str();
  serve->add_flag("--auto-recover", o->auto_recover,
                  "After an identity mismatch taints an engine, recover it to the committed version right away "
                  "(needs --directory and --model)");
  serve
      ->add_option("--max-wait-ms", o->max_wait_ms,
                   "Longest long-poll GET /v1/updates/{id}?wait_ms= may ask for; a larger wait_ms is clamped to it")
      ->check(CLI::Range(int64_t{0}, int64_t{3'600'000}))
      ->capture_default_str();
  serve->add_option("--lease-timeout", o->lease_timeout_s,
                    "Seconds a lease (POST /v1/rollouts:admit) may stay open without a finish or a heartbeat "
                    "(POST /v1/rollouts/{id}:heartbeat) before it is recorded expired and stops holding a drain; "
                    "0: never")
      ->check(FiniteNumber(0, 1e9))
      ->capture_default_str();
  serve
      ->add_option("--pause-mode", o->pause_mode,
                   "How the engine pauses once drained: wait (in-flight requests finish; vLLM's /pause?mode=wait) | "
                   "abort | keep (frozen in place; an install is refused while any is frozen)")
      ->check(CLI::IsMember({"wait", "abort", "keep"}))
      ->capture_default_str();
  serve
      ->add_option("--update-mode", o->update_mode,
                   "Policy mode of updates that do not name one (POST /v1/updates \"mode\"): strict (drain: no "
                   "rollout spans two versions) | keep (running rollouts continue on their old KV) | recompute "
                   "(their tokens are re-prefilled under the new weights) | abort (they end, recorded "
                   "aborted_at_update); docs/lifecycle.md, \"Policy modes\"")
      ->check(CLI::IsMember({"strict", "keep", "recompute", "abort"}))
      ->capture_default_str();
  serve
      ->add_option("--max-staleness", o->max_staleness,
                   "keep/recompute updates: a rollout may live through at most K updates; the update that would "
                   "make it more aborts it (its trajectory says aborted_at_update, reason max_staleness); -1: no "
                   "limit")
      ->check(CLI::Range(int64_t{-1}, int64_t{1} << 40))
      ->capture_default_str();
  serve
      ->add_option("--replay-tolerance", o->replay_tolerance,
                   "Replay validation (docs/lifecycle.md): the largest |engine - trainer| log-probability difference "
                   "accepted on a version's probes; < 0 (default): the engine's own bound (rolloutcore engines, "
                   "f32: 1e-4)")
      ->check(FiniteNumber())
      ->capture_default_str();
  serve->add_flag("--no-prefetch", o->no_prefetch,
                  "Do not stage the new version while the engine still serves. vLLM engines then stage inside the "
                  "install, while paused, and warm the canary just before the pause; rolloutcore engines refuse "
                  "the install (nothing staged), so the update is rejected");
}

// How vLLM engines move weights, pause and reset, and which releases they accept.
void AddVllmFlags(CLI::App* serve, ServeOptions* o) {
  serve
      ->add_option(
          "--vllm-transfer", o->vllm_transfer,
          "vLLM engines: how weights move. rolloutcore: rc_stage/rc_install in rolloutcore's worker extension. "
          "native-nccl: vLLM's own start/update/finish_weight_update session (vLLM started with "
          "--weight-transfer-config '{\"backend\":\"nccl\"}'), the trainer's rolloutcore.vllm_native.NativeSender "
          "(--vllm-native-trainer) broadcasting, then rc_adopt proves the digest and sets the label (docs/vllm.md)")
      ->check(CLI::IsMember({"rolloutcore", "native-nccl"}))
      ->capture_default_str();
  serve->add_option("--vllm-native-trainer", o->vllm_native_trainer,
                    "--vllm-transfer native-nccl: URL of the trainer's NativeSender (http://127.0.0.1:PORT)");
  serve
      ->add_option("--vllm-native-init", o->vllm_native_init,
                   "--vllm-transfer native-nccl: controller (default): the controller forms vLLM's weight-transfer "
                   "group (/init_weight_transfer_engine with the sender's /rc/native/init, concurrently) before the "
                   "first update of every vLLM boot and whenever the sender is not joined; external: it was formed "
                   "outside the controller, which never calls init")
      ->check(CLI::IsMember({"controller", "external"}))
      ->capture_default_str();
  serve
      ->add_option("--vllm-pause-call", o->vllm_pause_call,
                   "vLLM engines: sleep (default): POST /sleep?level=0&mode=M and /wake_up?tags=scheduling (the "
                   "scheduler pause without the 20 ms sleep vLLM 0.26 adds to every /pause: 29.7 vs 53.6 ms pause "
                   "window for 16 GB); pause: POST /pause?mode=M&clear_cache=false and /resume (docs/vllm.md)")
      ->check(CLI::IsMember({"pause", "sleep"}))
      ->capture_default_str();
  serve
      ->add_option("--vllm-delta-policy", o->vllm_delta_policy,
                   "vLLM engines: full or delta per stage for versions published with deltas on the version the "
                   "worker's staging image holds (docs/refit.md \"Delta on the GPU\"): auto (the cheaper by the "
                   "worker's measurements), always or never. Unset: the worker's ROLLOUTCORE_VLLM_DELTA_POLICY, else "
                   "never")
      ->check(CLI::IsMember({"auto", "always", "never"}));
  serve->add_flag("--vllm-fold-engine-calls", o->vllm_fold_engine_calls,
                  "vLLM engines (TP=1, strict and abort modes): inside the pause, rc_install also resets vLLM's "
                  "prefix, multimodal and encoder caches and sets vLLM 0.33's label in the same call, on the "
                  "engine core's thread, instead of four more HTTP round trips (docs/vllm.md \"Closing the pause "
                  "window\"); falls back to the separate calls where the engine core is out of reach");
  serve
      ->add_option("--vllm-reset-attempts", o->vllm_reset_attempts,
                   "vLLM engines: /reset_prefix_cache calls per reset while it answers success:false (backoff 10 ms, "
                   "doubling); the controller retries refused resets within --reset-deadline-ms on top")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  serve->add_flag("--vllm-allow-untested-version", o->vllm_allow_untested_version,
                  "vLLM engines: start even when GET /version names a release other than 0.26.x or 0.33.x (refused "
                  "otherwise); it runs with the behaviour of the nearest supported release and every validation "
                  "journals vllm_version_untested");
}

// The Runner's deadline of each lifecycle step: 1 ms to a day (a deadline of 0 or less would fail
// every update at once).
void AddDeadlineFlags(CLI::App* serve, ServeOptions* o) {
  const CLI::Range deadline_ms(int64_t{1}, int64_t{86'400'000});
  serve->add_option("--drain-deadline-ms", o->drain_ms, "Drain deadline (ms)")->check(deadline_ms)->capture_default_str();
  serve->add_option("--stage-deadline-ms", o->stage_ms, "Staging (prefetch) deadline (ms)")->check(deadline_ms)->capture_default_str();
  serve->add_option("--pause-deadline-ms", o->pause_ms, "Pause deadline (ms)")->check(deadline_ms)->capture_default_str();
  serve->add_option("--install-deadline-ms", o->install_ms, "Install deadline (ms)")->check(deadline_ms)->capture_default_str();
  serve->add_option("--reset-deadline-ms", o->reset_ms, "Cache-reset deadline (ms)")->check(deadline_ms)->capture_default_str();
  serve->add_option("--validate-deadline-ms", o->validate_ms, "Validation (label + digest) deadline (ms)")->check(deadline_ms)->capture_default_str();
  serve->add_option("--resume-deadline-ms", o->resume_ms, "Resume deadline (ms)")->check(deadline_ms)->capture_default_str();
}

// The checks of the flags that need no engine: the server's key and bind address, and the vLLM
// native transfer's trainer URL. The message of the first that fails (printed after
// "controller serve: "), or none when all pass. Resolves o->security (the key is read here).
std::optional<std::string> CheckServeFlags(ServeOptions* o) {
  // The key is checked first (before engines start) and is also the key of every call the
  // controller makes (engines, directory).
  if (Status s = ResolveServerSecurity(&o->security); !s.ok()) return s.ToString();
  if (Status s = net::CheckBindSecurity("controller", o->host, o->security); !s.ok()) return s.ToString();
  if (o->vllm_transfer == "native-nccl" && o->vllm_native_trainer.empty()) {
    return "--vllm-transfer native-nccl needs --vllm-native-trainer URL (the trainer's "
           "rolloutcore.vllm_native.NativeSender; docs/vllm.md, 'vLLM's own transfer')";
  }
  if (o->vllm_transfer != "native-nccl" && !o->vllm_native_trainer.empty()) {
    return "--vllm-native-trainer is only used with --vllm-transfer native-nccl";
  }
  return std::nullopt;
}

// The engine spec of one --engine URL.
adapters::EngineSpec EngineSpecFor(const ServeOptions& o, const std::string& url) {
  adapters::EngineSpec spec;
  spec.url = url;
  spec.directory_url = o.directory;
  spec.model = o.model;
  spec.stage_timeout_ms = o.stage_ms;
  spec.embedded.model = o.embedded_model;
  spec.embedded.load_format = o.embedded_load_format;
  spec.embedded.seed = o.embedded_seed;
  spec.embedded.tensor_parallel_size = o.embedded_tp;
  spec.embedded.weight_version = o.embedded_label;
  adapters::VllmOptions& vo = spec.http.vllm;
  vo.reset_attempts = o.vllm_reset_attempts;
  vo.pause_via_sleep = o.vllm_pause_call == "sleep";
  vo.delta_policy = o.vllm_delta_policy;
  vo.fold_engine_calls = o.vllm_fold_engine_calls;
  vo.native_transfer = o.vllm_transfer == "native-nccl";
  vo.native_trainer_url = o.vllm_native_trainer;
  vo.native_init = o.vllm_native_init == "controller";
  // Each join (group init, send/update) gets half the install deadline, so a refusal before
  // the start still lands inside it (the Runner taints an install that overruns).
  vo.native_timeout_ms = std::max<int64_t>(1, o.install_ms / 2);
  vo.allow_untested_version = o.vllm_allow_untested_version;
  return spec;
}

// The service's options from the flags.
controller::ServiceOptions ServiceOptionsFor(const ServeOptions& o) {
  controller::ServiceOptions so;
  so.state_dir = o.state_dir;
  so.max_updating = o.max_updating;
  so.auto_update = o.auto_update;
  so.model = o.model;
  so.verify_interval_ms = o.verify_interval_ms;
  so.auto_recover = o.auto_recover;
  // Rounded up to whole ms: 0.0009 s is 1 ms, never 0 (which means "never expire").
  so.lease_timeout_ms = o.lease_timeout_s > 0 ? static_cast<int64_t>(std::ceil(o.lease_timeout_s * 1000.0)) : 0;
  so.runner.drain_policy = *lifecycle::DrainPolicyFromName(o.drain_policy);
  so.runner.pause_mode = o.pause_mode == "abort"  ? lifecycle::PauseMode::kAbort
                         : o.pause_mode == "keep" ? lifecycle::PauseMode::kKeep
                                                  : lifecycle::PauseMode::kWait;
  so.runner.prefetch = !o.no_prefetch;
  so.default_mode = *lifecycle::PolicyModeFromName(o.update_mode, "--update-mode");
  so.runner.max_staleness = o.max_staleness;
  so.runner.replay_tolerance = o.replay_tolerance;
  so.runner.deadlines.drain_ms = o.drain_ms;
  so.runner.deadlines.stage_ms = o.stage_ms;
  so.runner.deadlines.pause_ms = o.pause_ms;
  so.runner.deadlines.install_ms = o.install_ms;
  so.runner.deadlines.reset_ms = o.reset_ms;
  so.runner.deadlines.validate_ms = o.validate_ms;
  so.runner.deadlines.resume_ms = o.resume_ms;
  return so;
}

// `controller serve`'s run: checks the flags, makes the engines, starts the service and its HTTP
// server, and serves until SIGINT / SIGTERM. Sets *exit_code (2: bad flags or engine, 1: the
// service or the server did not start, 0: stopped by a signal).
void RunControllerServe(ServeOptions* o, int* exit_code) {
  if (std::optional<std::string> bad = CheckServeFlags(o)) {
    std::cerr << "controller serve: " << *bad << "\n";
    *exit_code = 2;
    return;
  }
  std::unique_ptr<directory::DirectoryClient> dir;
  std::unique_ptr<controller::DirectoryVersionSource> versions;
  if (!o->directory.empty()) {
    dir = std::make_unique<directory::DirectoryClient>(o->directory);
    versions = std::make_unique<controller::DirectoryVersionSource>(dir.get());
  }
  std::vector<controller::EngineHandle> engines;
  std::vector<std::shared_ptr<void>> owned;  // outlive the service (embedded engines)
  for (const auto& url : SplitCommas(o->engines)) {
    auto made = adapters::MakeEngine(EngineSpecFor(*o, url));
    if (!made.ok()) {
      std::cerr << "controller serve: --engine " << url << ": " << made.status().message() << "\n";
      *exit_code = 2;
      return;
    }
    controller::EngineHandle h;
    h.name = made->name;
    h.adapter = std::move(made->adapter);
    h.complete = std::move(made->complete);
    engines.push_back(std::move(h));
    if (made->owned) owned.push_back(std::move(made->owned));
  }
  const controller::ServiceOptions so = ServiceOptionsFor(*o);
  auto svc = controller::ControllerService::Create(std::move(engines), versions.get(), so);
  if (!svc.ok()) {
    std::cerr << "controller serve: " << svc.status().ToString() << "\n";
    *exit_code = 1;
    return;
  }
  controller::ControllerHttpOptions http_options;
  http_options.host = o->host;
  http_options.port = o->port;
  http_options.security = o->security;
  http_options.max_wait_ms = o->max_wait_ms;
  controller::ControllerHttpServer server(svc->get(), http_options);
  Status s = server.Start();
  if (!s.ok()) {
    std::cerr << "controller serve: " << s.ToString() << "\n";
    *exit_code = 1;
    return;
  }
  std::cout << "controller listening on " << (o->security.tls_cert_file.empty() ? "http" : "https") << "://"
            << o->host << ":" << server.port() << " (state in " << o->state_dir << ")" << std::endl;
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  StopWithParentFromEnv();
  while (!g_stop) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  server.Stop();
  *exit_code = 0;
}

}  // namespace

void RegisterControllerCommand(CLI::App& app, int* exit_code) {
  auto* ctl = app.add_subcommand("controller", "The rolloutcore controller (lifecycle per engine, rollout proxy)");
  ctl->require_subcommand(1);
  auto* serve = ctl->add_subcommand(
      "serve",
      "Serve the controller HTTP API (docs/controller.md): rollouts bound to committed versions, updates and "
      "recoveries through the lifecycle, journal, trajectories, metrics.");
  auto o = std::make_shared<ServeOptions>();
  // Registered in this order: --help lists the flags so.
  AddEngineFlags(serve, o.get());
  AddServiceFlags(serve, o.get());
  AddPolicyFlags(serve, o.get());
  AddVllmFlags(serve, o.get());
  AddDeadlineFlags(serve, o.get());
  AddServerSecurityFlags(serve, &o->security);
  serve->callback([o, exit_code] { RunControllerServe(o.get(), exit_code); });
}

}  // namespace rc::apps
