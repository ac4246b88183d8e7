// HttpEngineAdapter: drives an engine through the HTTP API of ENGINE_API.md — the embedded
// engine (`rolloutcore engine serve`) or vLLM — and returns typed evidence, never "it said 200".
//
// Flavours, detected by Describe() (GET /rc/engine/state answers only on rolloutcore):
//  * rolloutcore: pause/resume read back through /is_paused; cache resets return evidence
//    bodies ({"success", "freed_blocks", "blocks_in_use"}); staging and install go through
//    /rc/refit/stage and /rc/refit/install; the content digest of live weights is
//    GET /rc/weights/digest; drain status is /rc/engine/state.
//  * vllm: vLLM 0.26 started with rolloutcore's worker extension (docs/vllm.md gives the `vllm
//    serve` flags). Describe() calls rc_describe through POST /collective_rpc (a vLLM without the
//    extension or without VLLM_SERVER_DEV_MODE=1 is a FailedPrecondition naming the flags);
//    staging, install, label and content digest run inside vLLM (rc_stage, rc_install, rc_label,
//    rc_digest, one result per TP rank, combined here); pause is /pause?mode=M&clear_cache=false
//    read back through /is_paused; the prefix reset's {"success"} is checked and refusals retried;
//    mm/encoder resets are recorded unverified; a canary prompt (warmed before the update, checked
//    for 0 cached tokens after the resume) is a second, observed check of the prefix reset. The
//    details and rules are in src/adapters/vllm_flavor.h and docs/vllm.md.
//
// Every call runs on its own detached thread with an HTTP timeout; the Runner enforces the
// deadline and may abandon it (see base/pending.h).
//
// Thread safety: all methods may be called from any thread.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "rolloutcore/lifecycle/engine_adapter.h"

namespace rc::adapters {

enum class EngineFlavor { kUnknown, kRolloutcore, kVllm };

struct HttpAdapterOptions {
  std::string base_url;             // "http://127.0.0.1:8000"
  std::string directory_url;        // for /rc/refit/stage (rolloutcore engines)
  std::string model;                // directory model name (defaults to the target's)
  int64_t http_timeout_ms = 120000; // transport timeout of one HTTP call (the Runner's deadlines are shorter)
  std::vector<int32_t> canary_prompt;  // vLLM canary (token ids); default: 64 fixed tokens
  int64_t stage_timeout_ms = 120000;   // vLLM: rc_stage's timeout_ms (the controller passes its stage deadline)
  int reset_attempts = 5;              // vLLM: /reset_prefix_cache calls per ResetCache while it answers success:false
  int64_t reset_backoff_ms = 10;       // vLLM: delay before the first retry; doubles per retry
  int64_t gauge_probe_after_ms = 1000;  // vLLM: a non-zero drain reading unchanged this long is refreshed by a probe
  // vLLM: how the scheduler is paused and resumed. false: POST /pause?mode=M&clear_cache=false and
  // /resume. true: POST /sleep?level=0&mode=M and /wake_up?tags=scheduling, the same
  // pause_scheduler(M, clear_cache=false) / resume_scheduler utility calls without the fixed 20 ms
  // asyncio.sleep AsyncLLM.pause_generation adds after every pause (docs/vllm.md).
  bool vllm_pause_via_sleep = false;
  // vLLM: --vllm-transfer native-nccl (docs/vllm.md, "vLLM's own transfer"): weights move through
  // vLLM's start/update/finish_weight_update session, the trainer-side sender
  // (rolloutcore.vllm_native.NativeSender) at vllm_native_trainer_url broadcasting; rc_adopt
  // proves them and sets the label.
  bool vllm_native_transfer = false;
  std::string vllm_native_trainer_url;
  bool vllm_native_init = true;                           // false: the group was formed outside the controller
  int64_t vllm_native_timeout_ms = 60000;                 // joins of the concurrent init and send/update halves
  EngineFlavor expected_flavor = EngineFlavor::kUnknown;  // kUnknown: detect; else Describe() checks it
};

class HttpEngineAdapter final : public lifecycle::EngineAdapter {
 public:
  explicit HttpEngineAdapter(HttpAdapterOptions options);
  ~HttpEngineAdapter() override;

  Result<lifecycle::EngineDescription> Describe() override;
  Pending<lifecycle::DrainStatus> GetDrainStatus() override;
  Pending<lifecycle::PauseEvidence> Pause(lifecycle::PauseMode mode) override;
  // Embedded engine: every mode. vLLM: VllmFlavor::SupportsPolicyMode (abort only).
  Status SupportsPolicyMode(lifecycle::PolicyMode mode) override;
  Pending<lifecycle::PauseEvidence> PauseForUpdate(lifecycle::PolicyMode mode) override;
  Pending<lifecycle::AbortEvidence> AbortRequests(const std::vector<std::string>& rollout_ids) override;
  Pending<lifecycle::StageEvidence> Stage(const lifecycle::UpdateTarget& target) override;
  Pending<lifecycle::InstallEvidence> Install(const lifecycle::UpdateTarget& target, bool full) override;
  Pending<lifecycle::CacheResetResult> ResetCache(lifecycle::CacheKind kind) override;
  Pending<lifecycle::LabelEvidence> ReadLabel() override;
  Pending<lifecycle::DigestEvidence> ReadContentDigest() override;
  Pending<lifecycle::ResumeEvidence> Resume() override;
  // rolloutcore engines: POST /rc/validate/replay. vLLM: the worker extension's rc_replay over
  // /collective_rpc (VllmFlavor::Replay; Describe() offers it when every rank's rc_describe does).
  Pending<lifecycle::ReplayEvidence> Replay(const lifecycle::ReplayRequest& request) override;
  // rolloutcore: GET /rc/engine/state (boot_id, weight_version, install_generation, cached
  // content_digest). vLLM: POST /collective_rpc {"method": "rc_label"} answered by rolloutcore's
  // worker extension in every worker; the workers must agree (DataLoss otherwise).
  Pending<lifecycle::IdentityEvidence> ProbeIdentity() override;

  EngineFlavor flavor() const;
  // vLLM only: sends the canary twice so its blocks are cached (Stage, or Pause without a Stage,
  // does this in an update); returns the warm-up evidence.
  Result<Json> WarmCanary();

  struct Shared;  // connection settings shared with in-flight calls

 private:
  std::shared_ptr<Shared> s_;
};

// A completion function for the controller's rollout proxy: POSTs the body to
// base_url/v1/completions and returns the response JSON; non-2xx answers become errors carrying
// the engine's message (400 → InvalidArgument, 503 → Unavailable, others → Internal).
std::function<Result<Json>(const Json&)> MakeHttpCompleter(const std::string& base_url, int64_t timeout_ms = 600000);

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
