// HttpEngineAdapter: drives an engine through the HTTP API of ENGINE_API.md — the embedded
// engine (`rolloutcore engine serve`) or vLLM — and returns typed evidence, never "it said 200".
//
// Flavours, detected by Describe() (GET /rc/engine/state answers only on rolloutcore):
//  * rolloutcore: pause/resume read back through /is_paused; cache resets return evidence
//    bodies ({"success", "freed_blocks", "blocks_in_use"}); staging and install go through
//    /rc/refit/stage and /rc/refit/install; the content digest of live weights is
//    GET /rc/weights/digest; drain status is /rc/engine/state.
//  * vllm: drain status from /metrics (vllm:num_requests_running / _waiting); reset_prefix_cache
//    answers an empty 200 even when it did nothing, so the adapter gets evidence another way:
//    (1) the reset is sent with reset_running_requests=true while the engine is verified paused
//    and idle, so vLLM's one refusal condition (blocks held by running requests) cannot hold, and
//    (2) a canary: before the update a fixed canary prompt is sent once so its blocks are cached;
//    Resume() then sends the canary again (max_tokens=1) and the resume evidence is accepted only
//    if vLLM reports 0 cached prompt tokens for it (usage.prompt_tokens_details.cached_tokens,
//    which needs vLLM's --enable-prompt-tokens-details). A non-zero count means KV computed under
//    the old weights survived: the resume fails and the controller taints the engine before any
//    rollout is admitted. vLLM offers no content digest, and its weights are pushed by the
//    trainer (NCCL path), so Install() here reports Unimplemented for vLLM.
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

struct HttpAdapterOptions {
  std::string base_url;             // "http://127.0.0.1:8000"
  std::string directory_url;        // for /rc/refit/stage (rolloutcore engines)
  std::string model;                // directory model name (defaults to the target's)
  int64_t http_timeout_ms = 120000; // transport timeout of one HTTP call (the Runner's deadlines are shorter)
  std::vector<int32_t> canary_prompt;  // vLLM canary (token ids); default: 64 fixed tokens
};

enum class EngineFlavor { kUnknown, kRolloutcore, kVllm };

class HttpEngineAdapter final : public lifecycle::EngineAdapter {
 public:
  explicit HttpEngineAdapter(HttpAdapterOptions options);
  ~HttpEngineAdapter() override;

  Result<lifecycle::EngineDescription> Describe() override;
  Pending<lifecycle::DrainStatus> GetDrainStatus() override;
  Pending<lifecycle::PauseEvidence> Pause(lifecycle::PauseMode mode) override;
  Pending<lifecycle::AbortEvidence> AbortRequests(const std::vector<std::string>& rollout_ids) override;
  Pending<lifecycle::StageEvidence> Stage(const lifecycle::UpdateTarget& target) override;
  Pending<lifecycle::InstallEvidence> Install(const lifecycle::UpdateTarget& target, bool full) override;
  Pending<lifecycle::CacheResetResult> ResetCache(lifecycle::CacheKind kind) override;
  Pending<lifecycle::LabelEvidence> ReadLabel() override;
  Pending<lifecycle::DigestEvidence> ReadContentDigest() override;
  Pending<lifecycle::ResumeEvidence> Resume() override;
  // rolloutcore: GET /rc/engine/state (boot_id, weight_version, install_generation, cached
  // content_digest). vLLM: POST /collective_rpc {"method": "rc_label"} answered by rolloutcore's
  // worker extension in every worker; the workers must agree (DataLoss otherwise).
  Pending<lifecycle::IdentityEvidence> ProbeIdentity() override;

  EngineFlavor flavor() const;
  // vLLM only: sends the canary once so its blocks are cached (the Runner's Stage does this).
  Status WarmCanary();

  struct Shared;  // connection settings shared with in-flight calls

 private:
  std::shared_ptr<Shared> s_;
};

// A completion function for the controller's rollout proxy: POSTs the body to
// base_url/v1/completions and returns the response JSON; non-2xx answers become errors carrying
// the engine's message (400 → InvalidArgument, 503 → Unavailable, others → Internal).
std::function<Result<Json>(const Json&)> MakeHttpCompleter(std::string base_url, int64_t timeout_ms = 600000);

// Parses one sample value from Prometheus text ("name{labels} value"); NotFound when absent.
// Sums the samples of all label sets of `name`.
Result<double> PrometheusValue(const std::string& text, const std::string& name);

}  // namespace rc::adapters
