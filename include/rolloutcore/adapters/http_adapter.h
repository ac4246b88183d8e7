// Engines reached over HTTP, as engine kinds of the adapter registry (adapters/registry.h):
//  * rolloutcore's own engine (`rolloutcore engine serve`, ENGINE_API.md; rolloutcore+http://);
//  * vLLM 0.26.x or 0.33.x started with rolloutcore's worker extension (vllm+http://; docs/vllm.md
//    gives the `vllm serve` flags). Describe() reads GET /version and picks that release's
//    behaviour; any other release is refused (VllmOptions::allow_untested_version starts anyway).
//    Staging, install, label and content digest run inside vLLM (rc_stage, rc_install, rc_label,
//    rc_digest over POST /collective_rpc, one result per TP rank, combined here); on 0.33 vLLM's own
//    label (/update_weight_version, /weight_info) is set while paused and checked, and its
//    per-token weight_versions are the rollouts' version spans. src/adapters/vllm_engine.h holds
//    the rules.
//  * plain http://HOST:PORT: HttpEngineAdapter asks the server what it is (GET /rc/engine/state
//    answers only on rolloutcore) at Describe (or at the first call that needs to know) and then
//    forwards every call to that kind.
// Every adapter returns typed evidence, never "it said 200". Every call runs on its own detached
// thread with an HTTP timeout; the Runner enforces the deadline and may abandon it.
//
// Thread safety: all methods may be called from any thread.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "rolloutcore/adapters/blocking_engine.h"

namespace rc::adapters {

enum class EngineFlavor { kUnknown, kRolloutcore, kVllm };

// What only vLLM engines use.
struct VllmOptions {
  std::vector<int32_t> canary_prompt;  // token ids; default: 64 fixed tokens
  int reset_attempts = 5;              // /reset_prefix_cache calls per ResetCache while it answers success:false
  int64_t reset_backoff_ms = 10;       // delay before the first retry; doubles per retry
  int64_t gauge_probe_after_ms = 1000;  // a non-zero drain reading unchanged this long is refreshed by a probe
  // How the scheduler is paused and resumed. false: POST /pause?mode=M&clear_cache=false and
  // /resume. true: POST /sleep?level=0&mode=M and /wake_up?tags=scheduling, the same
  // pause_scheduler(M, clear_cache=false) / resume_scheduler utility calls without the fixed 20 ms
  // asyncio.sleep AsyncLLM.pause_generation adds after every pause (docs/vllm.md).
  bool pause_via_sleep = false;
  // --vllm-transfer native-nccl (docs/vllm.md, "vLLM's own transfer"): weights move through
  // vLLM's start/update/finish_weight_update session, the trainer-side sender
  // (rolloutcore.vllm_native.NativeSender) at native_trainer_url broadcasting; rc_adopt proves
  // them and sets the label.
  bool native_transfer = false;
  std::string native_trainer_url;
  bool native_init = true;            // false: the group was formed outside the controller
  int64_t native_timeout_ms = 60000;  // joins of the concurrent init and send/update halves
  // A vLLM release other than 0.26.x / 0.33.x is refused at Describe unless this is set; it then
  // runs with the behaviour of the nearest supported release and the description says so (the
  // controller journals it).
  bool allow_untested_version = false;
  // Full or delta per stage (docs/refit.md "Delta on the GPU"): sent as rc_stage's delta_policy
  // ("auto", "always" or "never"); empty: not sent, the worker's ROLLOUTCORE_VLLM_DELTA_POLICY or
  // never decides. `controller serve --vllm-delta-policy`.
  std::string delta_policy;
  // `controller serve --vllm-fold-engine-calls` (docs/vllm.md "Closing the pause window"): inside
  // the pause, rc_install(atomic=True) also resets vLLM's prefix, multimodal and encoder caches and
  // sets vLLM 0.33's label in the same call (on the engine core's thread), instead of the adapter's
  // /reset_prefix_cache, /reset_mm_cache, /reset_encoder_cache and /update_weight_version round
  // trips. Only where rc_describe says the engine core is reachable (TP=1) and in the strict and
  // abort modes (keep and recompute reset around frozen requests); otherwise, or when rc_install
  // refuses it untouched, the separate calls as before.
  bool fold_engine_calls = false;
  // Replay validation (docs/lifecycle.md): the log-probability bound proposed for vLLM's bf16
  // kernels against the trainer's torch f32 reference. Measured on the H200 (vLLM 0.26, TP=1,
  // tiny Qwen3, 3 versions x 4 probes x 16 steps, top-5: worst 0.060, p99 0.035, median 0.0076;
  // docs/vllm.md "Replay validation"): 2.5x the worst measured difference.
  // `controller serve --replay-tolerance` overrides it.
  double replay_tolerance = 0.15;
  // The bound proposed when vLLM computes with FP8 weights (rc_describe reports a quantization):
  // its FP8 GEMMs also quantize the activations (W8A8), so the trainer's f32 reference on the
  // dequantized FP8 weights is further away. Measured on the H200 (vLLM 0.33, TP=1, tiny Qwen3, 3
  // versions x 4 probes x 16 steps, top-5; docs/fp8.md "Replay validation"): fp8_per_block worst
  // 0.249 (p99 0.213), fp8_per_tensor worst 0.451 (p99 0.231): 2.5x the worst of both.
  double fp8_replay_tolerance = 1.15;
};

struct HttpAdapterOptions {
  std::string base_url;              // "http://127.0.0.1:8000"
  std::string directory_url;         // where staging pulls from (--directory)
  std::string model;                 // directory model name (defaults to the target's)
  int64_t http_timeout_ms = 120000;  // transport timeout of one lifecycle call (the Runner's deadlines are shorter)
  int64_t stage_timeout_ms = 120000;  // vLLM: rc_stage's timeout_ms (the controller passes its stage deadline)
  int64_t completion_timeout_ms = 600000;  // one rollout's /v1/completions
  EngineFlavor expected_flavor = EngineFlavor::kUnknown;  // kUnknown: detect; else that kind from the start
  VllmOptions vllm;
};

// The adapter of an http:// engine: the kind the URL names (expected_flavor) from the start, or
// the one Describe() finds.
class HttpEngineAdapter final : public DetachedAdapter {
 public:
  explicit HttpEngineAdapter(HttpAdapterOptions options);
  ~HttpEngineAdapter() override;

  EngineFlavor flavor() const;
  // vLLM only: sends the canary twice so its blocks are cached (Stage, or Pause without a Stage,
  // does this in an update); returns the warm-up evidence.
  Result<Json> WarmCanary();
  // The rollout function of this engine (BlockingEngine::Complete), for the controller's proxy.
  std::function<Result<Json>(const Json&)> Completer() const;
};

// Parses a controller --engine URL: "vllm+http://H:P" (vLLM, checked at Describe),
// "rolloutcore+http://H:P" (a rolloutcore engine, checked), "http://H:P" / "https://H:P"
// (flavour detected). InvalidArgument naming the URL otherwise.
struct EngineUrl {
  std::string base_url;  // without the flavour prefix
  EngineFlavor flavor = EngineFlavor::kUnknown;
};
Result<EngineUrl> ParseEngineUrl(const std::string& url);

// Parses one sample value from Prometheus text ("name{labels} value"); NotFound when absent.
// Sums the samples of all label sets of `name`.
Result<double> PrometheusValue(const std::string& text, const std::string& name);

}  // namespace rc::adapters
