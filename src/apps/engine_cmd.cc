// `rolloutcore engine serve`: the embedded engine behind its vLLM-compatible HTTP API.
#include <pthread.h>

#include <csignal>
#include <iostream>

#include "apps/cli_checks.h"
#include "apps/commands.h"
#include "apps/server_flags.h"
#include "apps/stop_signals.h"
#include "rolloutcore/directory/types.h"
#include "rolloutcore/engine/http_server.h"
#include "rolloutcore/engine/loader.h"
#include "rolloutcore/net/http.h"

namespace rc::apps {
namespace {

struct ServeFlags {
  std::string model = "tiny";
  std::string host = "127.0.0.1";
  int port = 8000;
  int64_t max_model_len = 0;
  int64_t block_size = 16;
  int64_t num_kv_blocks = 0;
  int64_t max_num_seqs = 32;
  int64_t max_num_batched_tokens = 2048;
  bool prefix_caching = true;
  int tp = 1;
  std::string load_format = "auto";
  std::string weight_dtype = "auto";
  std::string quantization;
  uint64_t seed = 0;
  std::string weight_version = "default";
  std::string served_model_name;
  int threads = 0;
  bool enable_fault_injection = false;
  std::string directory;
  int http_threads = 256;
  int full_verify_every = 16;
  std::string delta_policy = "auto";
  net::ServerSecurity security;
};

int Serve(const ServeFlags& f) {
  // SIGINT / SIGTERM are taken by sigwait on this thread; block them before any thread starts so
  // no other thread runs a handler (stopping the server from a handler is not safe).
  const StopSignals stop_signals;
  engine::EngineOptions o;
  o.tensor_parallel_size = f.tp;
  o.block_size = f.block_size;
  o.num_kv_blocks = f.num_kv_blocks;
  o.max_model_len = f.max_model_len;
  o.max_num_seqs = f.max_num_seqs;
  o.max_num_batched_tokens = f.max_num_batched_tokens;
  o.enable_prefix_caching = f.prefix_caching;
  o.seed = f.seed;
  o.weight_version = f.weight_version;
  o.num_threads = f.threads;
  o.served_model_name = f.served_model_name.empty() ? f.model : f.served_model_name;
  o.quantization = f.quantization;
  if (Status label = directory::ValidateName(f.weight_version, "--weight-version"); !label.ok()) {
    std::cerr << "engine serve: " << label.ToString() << "\n";
    return 2;
  }
  auto engine = engine::CreateEngine({f.model, f.load_format, f.seed, f.weight_dtype}, o);
  if (!engine.ok()) {
    std::cerr << "engine serve: " << engine.status().ToString() << "\n";
    return 2;
  }
  engine::ServerOptions so;
  so.host = f.host;
  so.port = f.port;
  so.model_name = o.served_model_name;
  so.enable_fault_injection = f.enable_fault_injection;
  so.directory_url = f.directory;
  so.http_threads = f.http_threads;
  so.full_verify_every = f.full_verify_every;
  auto policy = receiver::ParseDeltaPolicy(f.delta_policy);
  if (!policy.ok()) {
    std::cerr << "engine serve: --delta-policy: " << policy.status().ToString() << "\n";
    return 2;
  }
  so.delta_policy = *policy;
  so.security = f.security;
  engine::EngineServer server(engine->get(), so);
  Status st = server.Start();
  if (!st.ok()) {
    std::cerr << "engine serve: " << st.ToString() << "\n";
    return 2;
  }
  std::cout << "rolloutcore engine serving " << so.model_name << " on "
            << (f.security.tls_cert_file.empty() ? "http" : "https") << "://" << f.host << ":" << server.port()
            << " (tp=" << f.tp << ", max_model_len=" << (*engine)->max_model_len()
            << ", kv blocks=" << (*engine)->options().num_kv_blocks << "x" << f.block_size
            << (f.quantization.empty() ? std::string() : ", quantization=" + f.quantization) << ")" << std::endl;
  stop_signals.Wait();
  server.Stop();
  return 0;
}

}  // namespace

void RegisterEngineCommand(CLI::App& app, int* exit_code) {
  auto* engine = app.add_subcommand("engine", "The embedded CPU inference engine.");
  engine->require_subcommand(1);
  auto flags = std::make_shared<ServeFlags>();
  auto* serve = engine->add_subcommand("serve", "Serve a model over the vLLM-compatible HTTP API.");
  serve->add_option("--model", flags->model, "Preset name (tiny, qwen3-0.6b-like, ...) or Hugging Face folder")
      ->capture_default_str();
  serve->add_option("--host", flags->host, "Address to bind")->capture_default_str();
  serve->add_option("--port", flags->port, "Port (0: any free port)")->check(CLI::Range(0, 65535))->capture_default_str();
  serve->add_option("--max-model-len", flags->max_model_len,
                    "Context length, at most the model's max_position_embeddings (default: the model's, capped at "
                    "4096)")
      ->check(CLI::Range(int64_t{2}, int64_t{1} << 30));
  serve->add_option("--block-size", flags->block_size, "KV block size in tokens")->capture_default_str();
  serve->add_option("--num-kv-blocks", flags->num_kv_blocks, "KV blocks in the pool (default: sized from limits)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  serve->add_option("--max-num-seqs", flags->max_num_seqs, "Max running requests")->capture_default_str();
  serve->add_option("--max-num-batched-tokens", flags->max_num_batched_tokens, "Token budget per step")
      ->capture_default_str();
  serve->add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", flags->prefix_caching,
                  "Prefix caching (on by default)");
  serve->add_option("--tensor-parallel-size", flags->tp, "In-process tensor-parallel ranks")->capture_default_str();
  serve->add_option("--weight-dtype", flags->weight_dtype,
                    "auto (keep the weights' dtype: BF16 for bf16 checkpoints and dummy weights, else F32) or f32")
      ->check(CLI::IsMember({"auto", "f32"}))
      ->capture_default_str();
  serve->add_option("--quantization", flags->quantization,
                    "Serve the projections in FP8, quantized from the bf16 weights at load and at every install as "
                    "vLLM 0.33's online method of that name does (docs/fp8.md): fp8_per_tensor, fp8_per_channel (per "
                    "channel) or fp8_per_block (128 x 128). Default: none")
      ->check(CLI::IsMember({"fp8_per_tensor", "fp8_per_channel", "fp8_per_block"}));
  serve->add_option("--load-format", flags->load_format,
                    "auto (a folder's safetensors; a preset's seeded random weights), safetensors (a folder only) "
                    "or dummy (seeded random)")
      ->check(CLI::IsMember({"auto", "safetensors", "dummy"}))
      ->capture_default_str();
  serve->add_option("--seed", flags->seed, "Seed for dummy weights and unseeded sampling")->check(Unsigned())->capture_default_str();
  serve->add_option("--weight-version", flags->weight_version, "Initial weight version label")->capture_default_str();
  serve->add_option("--served-model-name", flags->served_model_name, "Model name in responses");
  serve->add_option("--threads", flags->threads, "Compute threads (0: all cores)")->check(CLI::Range(0, 4096));
  serve->add_flag("--enable-fault-injection", flags->enable_fault_injection,
                  "Tests only: enable POST /rc/fault (delays and refusals, docs/engine.md); never in production");
  serve->add_option("--directory", flags->directory,
                    "The only directory POST /rc/refit/stage may pull from (default: any directory on this host, "
                    "i.e. a loopback URL)")
      ->check(HttpUrl());
  serve->add_option("--full-verify-every", flags->full_verify_every,
                    "Delta refit anchor check: a full digest of the live weights after every N-th consecutive delta "
                    "install (0: never; full installs always digest everything; docs/refit.md)")
      ->check(CLI::Range(0, 1 << 30))
      ->capture_default_str();
  serve->add_option("--delta-policy", flags->delta_policy,
                    "Full or delta when a version carries deltas this engine could apply: auto (the cheaper by this "
                    "engine's measured stage costs per transport), always, never (docs/refit.md \"Full or delta\")")
      ->check(CLI::IsMember({"auto", "always", "never"}))
      ->capture_default_str();
  serve->add_option("--http-threads", flags->http_threads, "Most HTTP worker threads (started on demand)")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  AddServerSecurityFlags(serve, &flags->security);
  serve->callback([flags, exit_code] {
    if (Status s = ResolveServerSecurity(&flags->security); !s.ok()) {
      std::cerr << "engine serve: " << s.ToString() << "\n";
      *exit_code = 2;
      return;
    }
    if (Status s = net::CheckBindSecurity("engine", flags->host, flags->security); !s.ok()) {
      std::cerr << "engine serve: " << s.ToString() << "\n";
      *exit_code = 2;
      return;
    }
    *exit_code = Serve(*flags);
  });
}

}  // namespace rc::apps
