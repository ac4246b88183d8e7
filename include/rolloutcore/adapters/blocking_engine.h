// An engine kind, as a plug-in: a BlockingEngine answers each lifecycle call synchronously, and
// DetachedAdapter turns it into a lifecycle::EngineAdapter by running every call on its own
// detached thread (base/pending.h), so the Runner's deadlines hold however slow the engine is.
//
// Adding an engine kind is one BlockingEngine class plus one line in the registry of
// adapters/registry.h (docs/architecture.md, "Where each change goes"). The kinds today:
//  * rolloutcore's HTTP engine (`rolloutcore engine serve`): src/adapters/rolloutcore_engine.cc;
//  * vLLM with rolloutcore's worker extension, 0.26.x and 0.33.x: src/adapters/vllm_engine.cc;
//  * the engine embedded in the controller's process: src/adapters/embedded_adapter.cc;
//  * a plain http:// URL: DetectingEngine (http_adapter.cc) asks the server what it is and then
//    forwards to one of the first two.
//
// Thread safety: a BlockingEngine's methods may be called from any thread, concurrently (the Runner
// may abandon a call at its deadline and issue the next one while the first still runs), and may
// outlive the adapter (a detached call holds a shared_ptr to its engine).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "rolloutcore/base/json.h"
#include "rolloutcore/lifecycle/engine_adapter.h"

namespace rc::adapters {

class BlockingEngine {
 public:
  virtual ~BlockingEngine() = default;

  virtual Result<lifecycle::EngineDescription> Describe() = 0;
  virtual Result<lifecycle::DrainStatus> Drain() = 0;
  virtual Result<lifecycle::PauseEvidence> Pause(lifecycle::PauseMode mode) = 0;
  virtual Status SupportsPolicyMode(lifecycle::PolicyMode mode) = 0;
  virtual Result<lifecycle::PauseEvidence> PauseForUpdate(lifecycle::PolicyMode mode) = 0;
  virtual Result<lifecycle::AbortEvidence> AbortRequests(const std::vector<std::string>& rollout_ids) = 0;
  virtual Result<lifecycle::StageEvidence> Stage(const lifecycle::UpdateTarget& target) = 0;
  virtual Result<lifecycle::InstallEvidence> Install(const lifecycle::UpdateTarget& target, bool full) = 0;
  virtual Result<lifecycle::CacheResetResult> ResetCache(lifecycle::CacheKind kind) = 0;
  virtual Result<lifecycle::LabelEvidence> ReadLabel() = 0;
  virtual Result<lifecycle::DigestEvidence> ReadContentDigest() = 0;
  virtual Result<lifecycle::ResumeEvidence> Resume() = 0;
  virtual Result<lifecycle::ReplayEvidence> Replay(const lifecycle::ReplayRequest& request) = 0;
  virtual Result<lifecycle::IdentityEvidence> ProbeIdentity() = 0;
  // One rollout: an OpenAI /v1/completions body in, the engine's answer out, with what the engine
  // reported about versions in the fields the controller reads (choices[i].version_spans,
  // weight_version; docs/controller.md). Errors carry the engine's message (400 → InvalidArgument,
  // 503 → Unavailable, others → Internal).
  virtual Result<Json> Complete(const Json& body) = 0;
};

class DetachedAdapter : public lifecycle::EngineAdapter {
 public:
  explicit DetachedAdapter(std::shared_ptr<BlockingEngine> engine) : engine_(std::move(engine)) {}

  Result<lifecycle::EngineDescription> Describe() override { return engine_->Describe(); }
  Pending<lifecycle::DrainStatus> GetDrainStatus() override;
  Pending<lifecycle::PauseEvidence> Pause(lifecycle::PauseMode mode) override;
  Status SupportsPolicyMode(lifecycle::PolicyMode mode) override { return engine_->SupportsPolicyMode(mode); }
  Pending<lifecycle::PauseEvidence> PauseForUpdate(lifecycle::PolicyMode mode) override;
  Pending<lifecycle::AbortEvidence> AbortRequests(const std::vector<std::string>& rollout_ids) override;
  Pending<lifecycle::StageEvidence> Stage(const lifecycle::UpdateTarget& target) override;
  Pending<lifecycle::InstallEvidence> Install(const lifecycle::UpdateTarget& target, bool full) override;
  Pending<lifecycle::CacheResetResult> ResetCache(lifecycle::CacheKind kind) override;
  Pending<lifecycle::LabelEvidence> ReadLabel() override;
  Pending<lifecycle::DigestEvidence> ReadContentDigest() override;
  Pending<lifecycle::ResumeEvidence> Resume() override;
  Pending<lifecycle::ReplayEvidence> Replay(const lifecycle::ReplayRequest& request) override;
  Pending<lifecycle::IdentityEvidence> ProbeIdentity() override;

  const std::shared_ptr<BlockingEngine>& engine() const { return engine_; }

 private:
  std::shared_ptr<BlockingEngine> engine_;
};

}  // namespace rc::adapters
