// rolloutcore's own HTTP engine (`rolloutcore engine serve`): pause/resume read back through
// /is_paused; cache resets return evidence bodies ({"success", "freed_blocks", "blocks_in_use"});
// staging and install go through /rc/refit/stage and /rc/refit/install; the content digest of live
// weights is GET /rc/weights/digest; drain status and identity are GET /rc/engine/state.
#include <optional>

#include "adapters/engines.h"
#include "adapters/lifecycle_types.h"

namespace rc::adapters::internal {

namespace {

using lifecycle::InstallOutcome;
using lifecycle::PolicyMode;

class RolloutcoreEngine final : public BlockingEngine {
 public:
  RolloutcoreEngine(std::shared_ptr<EngineHttp> http, HttpAdapterOptions o) : http_(std::move(http)), o_(std::move(o)) {}

  Result<EngineDescription> Describe() override {
    RC_ASSIGN_OR_RETURN(HttpReply state, http_->Call("GET", "/rc/engine/state"));
    if (state.status != 200) {
      return FailedPrecondition("engine at " + o_.base_url +
                                " was given as rolloutcore+http:// but does not answer GET /rc/engine/state (" +
                                std::to_string(state.status) + ")");
    }
    EngineDescription d = StagingEngineDescription(o_.base_url, "rolloutcore");
    d.offers_replay = true;
    d.replay_tolerance = 1e-4;  // f32 compute (docs/lifecycle.md "Replay validation")
    if (Result<Json> j = ParseJson(state.body, "GET " + http_->Where("/rc/engine/state")); j.ok() && j->is_object() &&
        j->contains("quantization") && (*j)["quantization"].is_string()) {
      d.quantization = (*j)["quantization"].get<std::string>();  // FP8 serving (docs/fp8.md)
    }
    return d;
  }

  Result<DrainStatus> Drain() override {
    RC_ASSIGN_OR_RETURN(Json j, http_->CallJson("GET", "/rc/engine/state"));
    DrainStatus d;
    RC_ASSIGN_OR_RETURN(d.running, GetNonNegativeInt(j, "num_running", "state"));
    RC_ASSIGN_OR_RETURN(d.waiting, GetNonNegativeInt(j, "num_waiting", "state"));
    return d;
  }

  Result<PauseEvidence> Pause(PauseMode mode) override {
    RC_ASSIGN_OR_RETURN(Json ignored, http_->CallJson("POST", "/pause?mode=" + std::string(lifecycle::PauseModeName(mode))));
    (void)ignored;
    PauseEvidence e;
    RC_ASSIGN_OR_RETURN(e.paused, IsPaused());
    RC_ASSIGN_OR_RETURN(DrainStatus d, Drain());
    // A kept (frozen) request still holds its slot but cannot run: only kWait/kAbort promise idle.
    e.running = d.running;
    return e;
  }

  // The embedded engine reports each request's version spans: every mode.
  Status SupportsPolicyMode(PolicyMode /*mode*/) override { return OkStatus(); }

  Result<PauseEvidence> PauseForUpdate(PolicyMode mode) override {
    if (mode == PolicyMode::kStrict) return InvalidArgument("PauseForUpdate: strict updates drain (Pause)");
    const std::string query = mode == PolicyMode::kAbort  ? "/pause?mode=abort"
                              : mode == PolicyMode::kKeep ? "/pause?mode=keep&inflight_kv=keep"
                                                          : "/pause?mode=keep&inflight_kv=recompute";
    RC_ASSIGN_OR_RETURN(Json reply, http_->CallJson("POST", query));
    PauseEvidence e;
    RC_ASSIGN_OR_RETURN(e.paused, IsPaused());
    RC_ASSIGN_OR_RETURN(DrainStatus d, Drain());
    e.running = d.running;
    e.detail = Json{{"mode", lifecycle::PolicyModeName(mode)}, {"request", query}, {"reply", reply}};
    return e;
  }

  Result<AbortEvidence> AbortRequests(const std::vector<std::string>& rollout_ids) override {
    RC_ASSIGN_OR_RETURN(Json j, http_->CallJson("POST", "/abort_requests", Json{{"request_ids", rollout_ids}}.dump()));
    AbortEvidence e;
    if (j.is_object()) e.aborted = j.value("aborted", int64_t{0});
    return e;
  }

  Result<StageEvidence> Stage(const UpdateTarget& target) override {
    RC_ASSIGN_OR_RETURN(Json j, http_->CallJson("POST", "/rc/refit/stage", StageBody(target).dump()));
    StageEvidence e;
    e.label = target.label;
    e.detail = j;
    if (j.is_object()) e.bytes = j.value("bytes_planned", int64_t{0});
    return e;
  }

  Result<InstallEvidence> Install(const UpdateTarget& target, bool full) override {
    if (full) {
      // Recovery: the Runner stages nothing before a recovery install, and the engine holds a
      // staged copy only if the failed update left one (an engine restarted after a crash holds
      // none, and the engine's install refuses with 409 "nothing is staged"). Stage the target
      // here, inside the install's deadline, so the install rewrites every parameter from the
      // committed version. A failure is not "refused before mutation" in recovery: the engine
      // is TAINTED whatever its weights are, and stays so.
      auto staged = http_->CallJson("POST", "/rc/refit/stage", StageBody(target).dump());
      if (!staged.ok()) return staged.status().WithContext("recovery: staging " + target.label);
    }
    Json body{{"version", target.label}, {"full", full}};
    auto resp = http_->Call("POST", "/rc/refit/install", body.dump());
    if (!resp.ok()) return resp.status();  // connection lost mid-install: outcome unknown
    // The engine names what the install did in install_outcome (docs/engine.md); the status code
    // alone is not evidence. An answer without a known outcome is an error: outcome unknown.
    const std::string where = "install on " + o_.base_url + " (HTTP " + std::to_string(resp->status) + ")";
    auto parsed = ParseJson(resp->body, "install response");
    if (!parsed.ok() || !parsed->is_object()) return Internal(where + ": the answer is not a JSON object: " + resp->body);
    const Json& j = *parsed;
    std::optional<InstallOutcome> outcome;
    if (j.contains("install_outcome") && j["install_outcome"].is_string()) {
      outcome = lifecycle::InstallOutcomeFromName(j["install_outcome"].get<std::string>());
    }
    if (!outcome) return Internal(where + " did not say whether live weights were touched: " + resp->body);
    InstallEvidence e;
    e.label = target.label;
    e.outcome = *outcome;
    e.detail = j;
    if (*outcome != InstallOutcome::kInstalled) {
      e.error = where + ": " + internal::ErrorMessage(resp->body);
      return e;
    }
    if (resp->status != 200) return Internal(where + " says installed but is not a 200: " + resp->body);
    RC_ASSIGN_OR_RETURN(e.label, GetString(j, "weight_version", "install"));
    e.bytes = j.value("bytes_installed", int64_t{0});
    return e;
  }

  Result<CacheResetResult> ResetCache(CacheKind kind) override {
    std::string path = kind == CacheKind::kPrefix    ? "/reset_prefix_cache"
                       : kind == CacheKind::kEncoder ? "/reset_encoder_cache"
                                                     : "/reset_mm_cache";
    // Paused and idle by now: preempting running requests cannot hit anything.
    if (kind == CacheKind::kPrefix) path += "?reset_running_requests=true";
    RC_ASSIGN_OR_RETURN(Json j, http_->CallJson("POST", path));
    CacheResetResult r;
    r.kind = kind;
    if (j.is_object() && j.contains("success")) {
      RC_ASSIGN_OR_RETURN(r.success, GetBool(j, "success", path));
      r.freed_blocks = j.value("freed_blocks", int64_t{0});
      r.blocks_in_use = j.value("blocks_in_use", int64_t{0});
      r.verified = true;  // the engine's own evidence body
      return r;
    }
    return DataLoss("POST " + http_->Where(path) + " returned no evidence body");
  }

  Result<LabelEvidence> ReadLabel() override {
    RC_ASSIGN_OR_RETURN(Json j, http_->CallJson("GET", "/weight_info"));
    LabelEvidence e;
    RC_ASSIGN_OR_RETURN(e.label, GetString(j, "weight_version", "weight_info"));
    return e;
  }

  Result<DigestEvidence> ReadContentDigest() override {
    RC_ASSIGN_OR_RETURN(Json j, http_->CallJson("GET", "/rc/weights/digest"));
    DigestEvidence e;
    RC_ASSIGN_OR_RETURN(e.content_digest, GetString(j, "content_digest", "digest"));
    if (j.contains("fp8")) {
      // FP8 serving (docs/fp8.md): the digest of the image the kernels read and the expected one.
      RC_ASSIGN_OR_RETURN(e.quantized, QuantizedFromJson(j["fp8"], "GET " + http_->Where("/rc/weights/digest")));
    }
    return e;
  }

  Result<ResumeEvidence> Resume() override {
    RC_ASSIGN_OR_RETURN(Json ignored, http_->CallJson("POST", "/resume"));
    (void)ignored;
    ResumeEvidence e;
    RC_ASSIGN_OR_RETURN(e.paused_after, IsPaused());
    return e;
  }

  Result<ReplayEvidence> Replay(const ReplayRequest& request) override {
    RC_ASSIGN_OR_RETURN(Json j, http_->CallJson("POST", "/rc/validate/replay", lifecycle::ToJson(request).dump()));
    return lifecycle::ReplayEvidenceFromJson(j, "replay");
  }

  // GET /rc/engine/state: boot_id, weight_version, install_generation, cached content_digest.
  Result<IdentityEvidence> ProbeIdentity() override {
    RC_ASSIGN_OR_RETURN(HttpReply resp, http_->Call("GET", "/rc/engine/state"));
    const std::string where = "GET " + http_->Where("/rc/engine/state");
    if (resp.status != 200) return Unavailable(where + " answered " + std::to_string(resp.status));
    RC_ASSIGN_OR_RETURN(Json state, ParseJson(resp.body, where));
    return IdentityFromJson(state, "weight_version", "install_generation", where);
  }

  Result<Json> Complete(const Json& body) override {
    return PostCompletion(o_.base_url, body, o_.completion_timeout_ms);
  }

 private:
  Result<bool> IsPaused() {
    RC_ASSIGN_OR_RETURN(Json j, http_->CallJson("GET", "/is_paused"));
    return GetBool(j, "is_paused", "is_paused");
  }
  Json StageBody(const UpdateTarget& target) const {
    return Json{{"model", o_.model.empty() ? target.model : o_.model},
                {"version", target.label},
                {"directory", o_.directory_url}};
  }

  std::shared_ptr<EngineHttp> http_;
  const HttpAdapterOptions o_;
};

}  // namespace

std::shared_ptr<BlockingEngine> MakeRolloutcoreEngine(std::shared_ptr<EngineHttp> http, const HttpAdapterOptions& o) {
  return std::make_shared<RolloutcoreEngine>(std::move(http), o);
}

}  // namespace rc::adapters::internal
