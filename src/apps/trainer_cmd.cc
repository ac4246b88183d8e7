// `rolloutcore trainer ...`: the synthetic trainer. `serve` runs N ranks that publish
// deterministic weight versions to a directory; `export` writes one version as a HF folder.
// See docs/trainer.md.
#include <fmt/format.h>
#include <signal.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <iostream>
#include <memory>
#include <mutex>
#include <thread>

#include "apps/cli_checks.h"
#include "apps/commands.h"
#include "apps/server_flags.h"
#include "apps/stop_signals.h"
#include "rolloutcore/base/hash.h"
#include "rolloutcore/base/mutex.h"
#include "rolloutcore/directory/client.h"
#include "rolloutcore/directory/types.h"
#include "rolloutcore/net/http.h"
#include "rolloutcore/refit/layouts.h"
#include "rolloutcore/refit/model_config.h"
#include "rolloutcore/trainer/export.h"
#include "rolloutcore/trainer/synthetic_trainer.h"
#include "trainer/trainer_server.h"

namespace rc::apps {
namespace {

struct ServeOptions {
  std::string model;
  std::string name;
  std::string layout = "fsdp:2";
  std::string directory_url;
  std::string transport = "shm";
  uint64_t seed = 0;
  double lr = 1e-3;
  double change_fraction = 1.0;
  bool delta = false;
  std::vector<std::string> fp8_parts;
  std::string host = "127.0.0.1";
  int port = 7480;
  int64_t steps = 0;
  int64_t interval_ms = 1000;
  int32_t keep = 0;
  int32_t fail_rank = -1;
  int64_t lease_ttl_ms = 10'000;
  int64_t publish_outcome_timeout_ms = 30'000;
  std::string first_step = "0";
  bool keep_on_exit = false;
  int32_t probes = 0, probe_tokens = 8, probe_top_k = 5;
  std::string probe_quantization;
  net::ServerSecurity security;
};

void PrintStep(const Result<trainer::VersionStatus>& v) {
  if (!v.ok()) {
    fmt::print(stderr, "trainer: step failed: {}\n", v.status().ToString());
    return;
  }
  fmt::print("trainer: published {} ({}, {} ranks published, seq {}, digest {}; {} bytes in {} shards; compute "
             "{:.1f} ms, publish {:.1f} ms)\n",
             v->version, v->state, v->ranks_published, v->commit_seq, Hex64(v->content_digest), v->bytes, v->shards,
             v->compute_ms, v->publish_ms);
  std::fflush(stdout);
}

// One past the highest v<k> the directory knows for the model (any state), so a restarted
// trainer never collides with labels of a trainer that died.
Result<int64_t> NextFreeStep(directory::DirectoryStore& store, const std::string& model) {
  RC_ASSIGN_OR_RETURN(auto versions, store.List(model, directory::StateFilter::kAll));
  int64_t next = 0;
  for (const directory::VersionInfo& v : versions) {
    auto k = trainer::ParseVersionLabel(v.version);
    if (k.ok()) next = std::max(next, *k + 1);
  }
  return next;
}

int Serve(const ServeOptions& o) {
  const StopSignals stop_signals;  // before any thread starts

  auto config = refit::ResolveModelSpec(o.model);
  if (!config.ok()) {
    fmt::print(stderr, "trainer: --model {}: {}\n", o.model, config.status().ToString());
    return 2;
  }
  auto layout = refit::ParseTrainerLayout(o.layout);
  if (!layout.ok()) {
    fmt::print(stderr, "trainer: --layout {}: {}\n", o.layout, layout.status().ToString());
    return 2;
  }
  directory::DirectoryClient client(o.directory_url);
  if (Status h = client.Health(); !h.ok()) {
    fmt::print(stderr, "trainer: directory {} does not answer: {}\n", o.directory_url, h.ToString());
    return 1;
  }
  trainer::SyntheticTrainerOptions options;
  options.config = *config;
  options.layout = *layout;
  options.model_name = o.name;
  options.transport = o.transport;
  options.weights.seed = o.seed;
  options.weights.lr = static_cast<float>(o.lr);
  options.weights.change_fraction = static_cast<float>(o.change_fraction);
  options.publisher.delta = o.delta;
  options.publisher.fp8_quantizations = o.fp8_parts;
  options.publisher.fp8_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  options.fail_rank = o.fail_rank;
  options.keep = o.keep;
  options.probes.count = o.probes;
  options.probes.tokens = o.probe_tokens;
  options.probes.top_k = o.probe_top_k;
  options.probes.quantization = o.probe_quantization;
  options.publisher.lease_ttl_ms = o.lease_ttl_ms;
  options.publisher.outcome_timeout_ms = o.publish_outcome_timeout_ms;
  const bool auto_step = o.first_step == "auto";
  if (auto_step) {
    auto next = NextFreeStep(client, o.name.empty() ? config->name : o.name);
    if (!next.ok()) {
      fmt::print(stderr, "trainer: --first-step auto: {}\n", next.status().ToString());
      return 1;
    }
    options.first_step = *next;
  } else {
    auto k = trainer::ParseVersionLabel("v" + o.first_step);
    if (!k.ok()) {
      fmt::print(stderr, "trainer: --first-step {}: expected a step number or 'auto'\n", o.first_step);
      return 2;
    }
    options.first_step = *k;
  }
  // The first version is published before the control API starts. With --first-step auto a label
  // that turns out to be taken (a released label is invisible to List) is skipped.
  std::unique_ptr<trainer::SyntheticTrainer> owned;
  for (int attempt = 0;; ++attempt) {
    auto created = trainer::SyntheticTrainer::Create(options, &client);
    if (!created.ok()) {
      fmt::print(stderr, "trainer: {}\n", created.status().ToString());
      return 2;
    }
    owned = std::move(created).value();
    auto first = owned->Step();
    const bool taken = !first.ok() && first.status().code() == StatusCode::kFailedPrecondition &&
                       owned->versions().empty();
    if (first.ok() || !(auto_step && taken && attempt < 64)) {
      PrintStep(first);
    } else {
      // Expected with --first-step auto (a released label is invisible to the directory's list):
      // said as what it is, not as a failed step.
      fmt::print("trainer: --first-step auto: label v{} is taken ({}); trying v{}\n", options.first_step,
                 first.status().message(), options.first_step + 1);
    }
    if (first.ok()) break;
    (void)owned->Shutdown(!o.keep_on_exit);
    if (!(auto_step && taken && attempt < 64)) return 1;
    ++options.first_step;
  }
  trainer::SyntheticTrainer& t = *owned;

  trainer::TrainerServer server(&t, trainer::TrainerServerOptions{o.host, o.port, o.security}, &PrintStep);
  if (Status s = server.Start(); !s.ok()) {
    fmt::print(stderr, "trainer: {}\n", s.ToString());
    (void)t.Shutdown(!o.keep_on_exit);
    return 1;
  }
  fmt::print("trainer listening on {} (model {} as {}, layout {}, transport {}, directory {})\n", server.url(), o.model,
             t.model_name(), layout->ToString(), o.transport, o.directory_url);
  std::fflush(stdout);

  // Timed steps: every interval_ms, `steps` times, then keep serving until a signal.
  rc::Mutex mu;
  rc::CondVar cv;
  bool stop = false;  // guarded by mu (a local: the analysis checks fields and globals only)
  std::thread ticker;
  if (o.steps > 0) {
    ticker = std::thread([&] {
      for (int64_t i = 0; i < o.steps; ++i) {
        rc::MutexLock lock(mu);
        if (cv.wait_for(lock, std::chrono::milliseconds(o.interval_ms), [&] { return stop; })) return;
        lock.unlock();
        PrintStep(t.Step());
      }
    });
  }

  const int sig = stop_signals.Wait();
  fmt::print(stderr, "trainer: signal {}, stopping\n", sig);
  {
    rc::MutexLock lock(mu);
    stop = true;
  }
  cv.notify_all();
  if (ticker.joinable()) ticker.join();
  server.Stop();
  Status s = t.Shutdown(!o.keep_on_exit);
  if (!s.ok()) {
    fmt::print(stderr, "trainer: shutdown: {}\n", s.ToString());
    return 1;
  }
  fmt::print(stderr, "trainer: stopped (registrations dropped{})\n",
             o.keep_on_exit ? "" : ", versions released in the directory");
  return 0;
}

struct ExportOptions {
  std::string model;
  uint64_t seed = 0;
  double lr = 1e-3;
  double change_fraction = 1.0;
  std::string version;
  std::string out;
  bool json = false;
};

int Export(const ExportOptions& o) {
  auto config = refit::ResolveModelSpec(o.model);
  if (!config.ok()) {
    fmt::print(stderr, "trainer export: --model {}: {}\n", o.model, config.status().ToString());
    return 2;
  }
  auto step = trainer::ParseVersionLabel(o.version);
  if (!step.ok()) {
    fmt::print(stderr, "trainer export: --version: {}\n", step.status().ToString());
    return 2;
  }
  trainer::SyntheticWeights w{o.seed, static_cast<float>(o.lr), static_cast<float>(o.change_fraction)};
  auto r = trainer::ExportVersion(*config, w, *step, o.out);
  if (!r.ok()) {
    fmt::print(stderr, "trainer export: {}\n", r.status().ToString());
    return 1;
  }
  if (o.json) {
    Json digests = Json::object();
    for (const auto& [name, d] : r->digests) digests[name] = Hex64(d);
    fmt::print("{}\n", Json{{"version", o.version},
                            {"config", r->config_path},
                            {"weights", r->weights_path},
                            {"bytes", r->bytes},
                            {"content_digest", Hex64(r->content_digest)},
                            {"tensor_digests", digests}}
                           .dump(2));
  } else {
    fmt::print("exported {} of {} (seed {}, lr {}) to {}: {} tensors, {} bytes, content digest {}\n", o.version,
               o.model, o.seed, w.lr, o.out, r->digests.size(), r->bytes, Hex64(r->content_digest));
  }
  return 0;
}

}  // namespace

void RegisterTrainerCommand(CLI::App& app, int* exit_code) {
  auto* tr = app.add_subcommand("trainer", "The synthetic trainer: deterministic weight versions published by N ranks.");
  tr->require_subcommand(1);

  auto so = std::make_shared<ServeOptions>();
  auto* serve = tr->add_subcommand("serve", "Run N ranks that publish v0 now and a new version per step (docs/trainer.md).");
  serve->add_option("--model", so->model, "Refit preset (tiny, qwen3-0.6b, ...) or a config.json / model folder")
      ->required();
  serve->add_option("--name", so->name, "Model name in the directory (default: the preset name)")
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            // CLI11 puts "--name: " in front of what this returns.
            Status s = directory::ValidateName(v, "--name");
            return s.ok() ? std::string() : s.message().substr(std::string_view("--name: ").size());
          },
          "NAME"));
  serve->add_option("--layout", so->layout, "fsdp:N | tp:N | replicated[:N]")->capture_default_str();
  serve->add_option("--directory", so->directory_url, "Directory URL, e.g. http://127.0.0.1:7470")
      ->required()
      ->check(HttpUrl());
  serve->add_option("--transport", so->transport, "shm | ucx | local")->capture_default_str();
  serve->add_option("--seed", so->seed, "Seed of the weights")->check(Unsigned())->capture_default_str();
  serve->add_option("--lr", so->lr, "Step size of the synthetic update")->check(FiniteNumber())->capture_default_str();
  serve->add_option("--change-fraction", so->change_fraction,
                    "Fraction of elements a step updates, clustered per tensor (1: all; docs/trainer.md)")
      ->check(FiniteNumber(0, 1))
      ->capture_default_str();
  serve->add_flag("--delta", so->delta,
                  "Publish each version with per-shard sparse deltas against the previous committed one (the full "
                  "shards stay published; docs/refit.md \"Delta refit\")");
  serve->add_option("--host", so->host, "Address of the control API")->capture_default_str();
  serve->add_option("--port", so->port, "Port of the control API (0: any; the URL is printed)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  serve->add_option("--steps", so->steps, "Make this many steps on a timer (0: only on POST /step)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40))
      ->capture_default_str();
  serve->add_option("--interval-ms", so->interval_ms, "Timer period for --steps")
      ->check(CLI::Range(int64_t{1}, int64_t{86'400'000}))
      ->capture_default_str();
  serve->add_option("--keep", so->keep, "Release versions older than the newest V (0: keep all)")
      ->check(CLI::Range(0, 1 << 30))
      ->capture_default_str();
  serve->add_option("--fail-rank", so->fail_rank, "Fault injection: this rank never publishes (-1: none)")
      ->capture_default_str();
  serve->add_option("--publish-outcome-timeout-ms", so->publish_outcome_timeout_ms,
                    "How long a rank whose publish went unanswered asks the directory for the outcome, keeping its "
                    "buffers (then the step fails with the outcome unknown and the buffers stay registered)")
      ->check(CLI::Range(int64_t{0}, int64_t{86'400'000}))
      ->capture_default_str();
  serve->add_option("--lease-ttl-ms", so->lease_ttl_ms, "Lease of each rank's publishes (renewed every third)")
      ->check(CLI::Range(int64_t{100}, int64_t{86'400'000}))
      ->capture_default_str();
  serve->add_option("--first-step", so->first_step,
                    "Step of the first version (N, or 'auto': one past the highest v<k> in the directory)")
      ->capture_default_str();
  serve->add_flag("--keep-on-exit", so->keep_on_exit, "Do not release this trainer's versions when stopping");
  serve->add_option("--probes", so->probes,
                    "Replay probes rank 0 attaches to every version (docs/trainer.md \"Replay probes\"): greedy "
                    "continuations computed with the reference forward; 0: none")
      ->check(CLI::Range(0, 16))
      ->capture_default_str();
  serve->add_option("--probe-tokens", so->probe_tokens, "Greedy tokens per probe")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  serve->add_option("--probe-top-k", so->probe_top_k, "Top-k log-probabilities recorded per probe step")
      ->check(CLI::Range(0, 20))
      ->capture_default_str();
  serve->add_option("--probe-quantization", so->probe_quantization,
                    "Compute the probes under the quantization the engines serve (docs/fp8.md): fp8_per_tensor, "
                    "fp8_per_channel or fp8_per_block; replay compares a probe only with an engine serving the same. "
                    "Default: the weights as published")
      ->check(CLI::IsMember({"fp8_per_tensor", "fp8_per_channel", "fp8_per_block"}));
  serve->add_option("--fp8-parts", so->fp8_parts,
                    "Publish, with every shard of a projection, its part of the FP8 image an engine serving this "
                    "quantization computes (docs/fp8.md \"The expected image, from the trainer\"); the controller "
                    "then holds an FP8 engine's live image to the trainer's. fp8_per_tensor, fp8_per_channel, "
                    "fp8_per_block; repeat or comma-separate for several")
      ->delimiter(',')
      ->check(CLI::IsMember({"fp8_per_tensor", "fp8_per_channel", "fp8_per_block"}));
  AddServerSecurityFlags(serve, &so->security);
  serve->callback([so, exit_code] {
    if (Status s = ResolveServerSecurity(&so->security); !s.ok()) {
      fmt::print(stderr, "trainer serve: {}\n", s.ToString());
      *exit_code = 2;
      return;
    }
    if (Status s = net::CheckBindSecurity("trainer", so->host, so->security); !s.ok()) {
      fmt::print(stderr, "trainer serve: {}\n", s.ToString());
      *exit_code = 2;
      return;
    }
    *exit_code = Serve(*so);
  });

  auto eo = std::make_shared<ExportOptions>();
  auto* ex = tr->add_subcommand("export", "Write version vK of the synthetic trainer as a HF folder.");
  ex->add_option("--model", eo->model, "Refit preset or config.json / model folder")->required();
  ex->add_option("--seed", eo->seed, "Seed of the weights")->check(Unsigned())->capture_default_str();
  ex->add_option("--lr", eo->lr, "Step size of the synthetic update")->check(FiniteNumber())->capture_default_str();
  ex->add_option("--change-fraction", eo->change_fraction, "Fraction of elements a step updates (as in serve)")
      ->check(FiniteNumber(0, 1))
      ->capture_default_str();
  ex->add_option("--version", eo->version, "Version label v<k>")->required();
  ex->add_option("--out", eo->out, "Output folder")->required();
  ex->add_flag("--json", eo->json, "Print the result (paths, digests) as JSON");
  ex->callback([eo, exit_code] { *exit_code = Export(*eo); });
}

}  // namespace rc::apps
