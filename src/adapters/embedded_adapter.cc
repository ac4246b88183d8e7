#include "rolloutcore/adapters/embedded_adapter.h"

#include <atomic>
#include <map>
#include <mutex>

#include "adapters/lifecycle_types.h"
#include "rolloutcore/engine/engine.h"
#include "rolloutcore/engine/engine_loop.h"
#include "rolloutcore/engine/http_server.h"
#include "rolloutcore/engine/loader.h"
#include "rolloutcore/receiver/receiver.h"
#include "rolloutcore/engine/tokenizer.h"
#include "rolloutcore/base/mutex.h"

namespace rc::adapters {

// Members are destroyed in reverse order: the loop stops before the receiver and the engine go.
struct EmbeddedEngine::State {
  std::unique_ptr<engine::Engine> engine;
  std::unique_ptr<receiver::RefitReceiver> receiver;
  std::unique_ptr<engine::EngineLoop> loop;
  std::unique_ptr<engine::ByteTokenizer> tokenizer;
  std::atomic<int64_t> next_id{1};
  // Completion id -> the engine request ids it runs as ("<id>-<k>"), for aborts by rollout id.
  rc::Mutex live_mu;
  std::map<std::string, std::vector<std::string>> live GUARDED_BY(live_mu);  // guarded by live_mu
  std::vector<std::string> Expand(const std::vector<std::string>& ids) {
    rc::MutexLock l(live_mu);
    std::vector<std::string> out;
    for (const auto& i : ids) {
      out.push_back(i);
      if (auto it = live.find(i); it != live.end()) out.insert(out.end(), it->second.begin(), it->second.end());
    }
    return out;
  }
};

Result<std::unique_ptr<EmbeddedEngine>> EmbeddedEngine::Create(const Options& options) {
  engine::EngineOptions o;
  o.tensor_parallel_size = options.tensor_parallel_size;
  o.weight_version = options.weight_version;
  o.num_threads = options.threads;
  o.seed = options.seed;
  o.served_model_name = options.model;
  o.quantization = options.quantization;
  RC_ASSIGN_OR_RETURN(std::unique_ptr<engine::Engine> e,
                      engine::CreateEngine({options.model, options.load_format, options.seed}, o));
  auto s = std::make_shared<State>();
  s->tokenizer = std::make_unique<engine::ByteTokenizer>(e->spec().vocab_size);
  s->receiver = std::make_unique<receiver::RefitReceiver>(e.get());
  s->loop = std::make_unique<engine::EngineLoop>(e.get());
  s->engine = std::move(e);
  s->loop->Start();
  std::unique_ptr<EmbeddedEngine> out(new EmbeddedEngine());
  out->state_ = std::move(s);
  return out;
}

EmbeddedEngine::~EmbeddedEngine() = default;

engine::Engine* EmbeddedEngine::engine() { return state_->engine.get(); }
receiver::RefitReceiver* EmbeddedEngine::receiver() { return state_->receiver.get(); }

namespace {

engine::PauseMode ToEngine(PauseMode m) {
  switch (m) {
    case PauseMode::kAbort: return engine::PauseMode::kAbort;
    case PauseMode::kWait: return engine::PauseMode::kWait;
    case PauseMode::kKeep: return engine::PauseMode::kKeep;
  }
  return engine::PauseMode::kAbort;
}

class EmbeddedEngineAdapter final : public lifecycle::EngineAdapter {
 public:
  EmbeddedEngineAdapter(std::shared_ptr<EmbeddedEngine::State> s, EmbeddedAdapterOptions o)
      : s_(std::move(s)), o_(std::make_shared<const EmbeddedAdapterOptions>(std::move(o))) {}

  Result<EngineDescription> Describe() override {
    EngineDescription d;
    d.name = "embedded";
    d.kind = "embedded";
    d.offers_content_digest = true;
    d.supports_staging = true;
    // The embedded engine has a prefix cache only; encoder and multimodal caches do not exist.
    d.caches = {CacheKind::kPrefix};
    d.offers_replay = true;
    d.replay_tolerance = 1e-4;  // f32 compute (docs/lifecycle.md "Replay validation")
    d.quantization = s_->engine->quantization();
    return d;
  }

  Pending<ReplayEvidence> Replay(const ReplayRequest& request) override {
    return RunDetached<ReplayEvidence>([s = s_, request]() -> Result<ReplayEvidence> {
      RC_ASSIGN_OR_RETURN(engine::ReplayOutput out, s->engine->Replay(request.prompt, request.steps, request.top_k));
      ReplayEvidence e;
      e.engine_ms = out.elapsed_ms;
      e.precomputed = out.precomputed;
      e.computed_on = out.computed_on;
      e.staged_ms = out.staged_ms;
      for (auto& st : out.steps) e.steps.push_back(ReplayStep{st.token, st.logprob, std::move(st.top_logprobs)});
      return e;
    });
  }

  Pending<DrainStatus> GetDrainStatus() override {
    return RunDetached<DrainStatus>([s = s_]() -> Result<DrainStatus> {
      const engine::EngineState st = s->engine->State();
      return DrainStatus{st.num_running, st.num_waiting};
    });
  }

  Pending<PauseEvidence> Pause(PauseMode mode) override {
    return RunDetached<PauseEvidence>([s = s_, mode]() -> Result<PauseEvidence> {
      RC_RETURN_IF_ERROR(s->engine->Pause(ToEngine(mode)));
      PauseEvidence e;
      e.paused = s->engine->IsPaused();
      e.running = s->engine->State().num_running;
      return e;
    });
  }

  // Every policy mode: the engine records each request's span boundary at its exact token index.
  Status SupportsPolicyMode(lifecycle::PolicyMode) override { return OkStatus(); }

  Pending<PauseEvidence> PauseForUpdate(lifecycle::PolicyMode mode) override {
    return RunDetached<PauseEvidence>([s = s_, mode]() -> Result<PauseEvidence> {
      using lifecycle::PolicyMode;
      if (mode == PolicyMode::kStrict) return InvalidArgument("PauseForUpdate: strict updates drain (Pause)");
      const engine::PauseMode pm = mode == PolicyMode::kAbort ? engine::PauseMode::kAbort : engine::PauseMode::kKeep;
      const engine::InFlightKv kv = mode == PolicyMode::kKeep ? engine::InFlightKv::kKeep : engine::InFlightKv::kRecompute;
      RC_RETURN_IF_ERROR(s->engine->Pause(pm, kv));
      PauseEvidence e;
      e.paused = s->engine->IsPaused();
      e.running = s->engine->State().num_running;
      e.detail = Json{{"mode", lifecycle::PolicyModeName(mode)}, {"inflight_kv", engine::InFlightKvName(kv)}};
      return e;
    });
  }

  Pending<AbortEvidence> AbortRequests(const std::vector<std::string>& ids) override {
    return RunDetached<AbortEvidence>([s = s_, ids]() -> Result<AbortEvidence> {
      // Rollout ids name completions; abort the engine requests each one runs as.
      return AbortEvidence{s->engine->Abort(s->Expand(ids))};
    });
  }

  Pending<StageEvidence> Stage(const UpdateTarget& target) override {
    return RunDetached<StageEvidence>([s = s_, o = o_, target]() -> Result<StageEvidence> {
      RC_ASSIGN_OR_RETURN(receiver::StageReport report, s->receiver->Stage(Request(*o, target)));
      StageEvidence e;
      e.label = target.label;
      // The bytes planned by a full stage; a delta stage plans none (its pull is in detail).
      const receiver::FullStageReport* full = report.full();
      e.bytes = full != nullptr ? static_cast<int64_t>(full->bytes_planned) : 0;
      e.detail = report.ToJson();  // the lifecycle evidence edge: journaled as JSON
      return e;
    });
  }

  Pending<InstallEvidence> Install(const UpdateTarget& target, bool full) override {
    return RunDetached<InstallEvidence>([s = s_, o = o_, target, full]() -> Result<InstallEvidence> {
      if (full) {
        // Recovery: nothing is staged by the Runner first; stage the committed version here so
        // every parameter is rewritten from it.
        auto staged = s->receiver->Stage(Request(*o, target));
        if (!staged.ok()) return staged.status().WithContext("recovery: staging " + target.label);
      }
      // The receiver says what the install did (established at its first live byte).
      receiver::InstallResult r = s->receiver->Install(target.label);
      InstallEvidence e;
      e.label = target.label;
      if (r.outcome == receiver::InstallOutcome::kInstalled) {
        e.outcome = lifecycle::InstallOutcome::kInstalled;
        e.label = r.report.weight_version;
        e.bytes = static_cast<int64_t>(r.report.bytes_installed);
        e.detail = r.report.ToJson();  // the lifecycle evidence edge: journaled as JSON
        return e;
      }
      const bool untouched = r.outcome == receiver::InstallOutcome::kRefusedUntouched;
      e.outcome = untouched ? lifecycle::InstallOutcome::kRefusedUntouched
                            : lifecycle::InstallOutcome::kFailedAfterMutation;
      e.error = r.status.ToString();
      return e;
    });
  }

  Pending<CacheResetResult> ResetCache(CacheKind kind) override {
    return RunDetached<CacheResetResult>([s = s_, kind]() -> Result<CacheResetResult> {
      if (kind != CacheKind::kPrefix) {
        return InvalidArgument("the embedded engine has no " + std::string(lifecycle::CacheKindName(kind)) + " cache");
      }
      const engine::KvResetEvidence ev = s->engine->ResetPrefixCache(/*reset_running_requests=*/true);
      CacheResetResult r;
      r.kind = kind;
      r.success = ev.success;
      r.freed_blocks = ev.freed_blocks;
      r.blocks_in_use = ev.blocks_in_use;
      r.verified = true;  // the engine's own evidence
      return r;
    });
  }

  Pending<LabelEvidence> ReadLabel() override {
    return RunDetached<LabelEvidence>([s = s_]() -> Result<LabelEvidence> { return LabelEvidence{s->engine->WeightVersion()}; });
  }

  Pending<DigestEvidence> ReadContentDigest() override {
    return RunDetached<DigestEvidence>([s = s_]() -> Result<DigestEvidence> {
      RC_ASSIGN_OR_RETURN(receiver::LiveDigestReport digest, s->receiver->LiveDigest());
      DigestEvidence e;
      e.content_digest = digest.content_digest.ToHex();
      if (!s->engine->quantization().empty()) {
        // FP8 serving: what the kernels read must be the quantization of the weights digested above.
        RC_ASSIGN_OR_RETURN(engine::Fp8ImageReport fp8, s->engine->Fp8Digests());
        e.quantized = lifecycle::QuantizedDigestEvidence{fp8.quantization, fp8.live_error.empty() ? fp8.live_digest.ToHex() : "",
                                              fp8.expected_digest.ToHex(), fp8.FirstMismatch()};
      }
      return e;
    });
  }

  Pending<ResumeEvidence> Resume() override {
    return RunDetached<ResumeEvidence>([s = s_]() -> Result<ResumeEvidence> {
      s->engine->Resume();
      return ResumeEvidence{s->engine->IsPaused()};
    });
  }

  Pending<IdentityEvidence> ProbeIdentity() override {
    return RunDetached<IdentityEvidence>([s = s_]() -> Result<IdentityEvidence> {
      IdentityEvidence e;
      e.content_digest = s->receiver->CachedLiveDigest().value_or("");  // before the generation
      const engine::EngineState st = s->engine->State();
      e.boot_id = s->engine->boot_id();
      e.label = st.weight_version;
      e.install_generation = st.install_generation;
      e.paused = s->engine->IsPausedOrDraining();
      return e;
    });
  }

 private:
  static receiver::StageRequest Request(const EmbeddedAdapterOptions& o, const UpdateTarget& target) {
    receiver::StageRequest r;
    r.model = o.model.empty() ? target.model : o.model;
    r.version = target.label;
    r.directory = o.directory_url;
    r.timeout_ms = o.stage_timeout_ms;
    return r;
  }

  std::shared_ptr<EmbeddedEngine::State> s_;
  std::shared_ptr<const EmbeddedAdapterOptions> o_;
};

}  // namespace

std::unique_ptr<lifecycle::EngineAdapter> EmbeddedEngine::MakeAdapter(EmbeddedAdapterOptions options) {
  return std::make_unique<EmbeddedEngineAdapter>(state_, std::move(options));
}

std::function<Result<Json>(const Json&)> EmbeddedEngine::MakeCompleter(const std::string& model_name) {
  return [s = state_, model_name](const Json& body) -> Result<Json> {
    RC_ASSIGN_OR_RETURN(engine::CompletionRequest cr, engine::ParseCompletionRequest(body.dump(), *s->tokenizer));
    if (cr.stream) return InvalidArgument("stream: the embedded completer returns whole completions only");
    const std::string id =
        cr.request_id.empty() ? "emb-" + std::to_string(s->next_id.fetch_add(1)) : cr.request_id;
    auto out = engine::RunCompletion(s->engine.get(), *s->tokenizer, cr, id, model_name,
                                     [&s, &id](const std::vector<std::string>& ids) {
                                       rc::MutexLock l(s->live_mu);
                                       s->live[id] = ids;
                                     });
    rc::MutexLock l(s->live_mu);
    s->live.erase(id);
    return out;
  };
}

}  // namespace rc::adapters
