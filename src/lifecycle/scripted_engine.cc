#include "rolloutcore/lifecycle/scripted_engine.h"

#include <algorithm>

namespace rc::lifecycle {
namespace {

const std::map<std::string, std::set<std::string>>& KnownOps() {
  static const std::map<std::string, std::set<std::string>> kOps = {
      {"install", {"ok", "hang", "fail_before_mutation", "fail_after_mutation", "wrong_digest"}},
      {"reset_prefix_cache", {"ok", "refuse", "hang", "fail"}},
      {"reset_encoder_cache", {"ok", "refuse", "hang", "fail"}},
      {"reset_mm_cache", {"ok", "refuse", "hang", "fail"}},
      {"report_label", {"ok", "stale", "hang", "fail"}},
      {"content_digest", {"ok", "wrong", "hang", "fail"}},
      {"pause", {"ok", "hang", "fail"}},
      {"resume", {"ok", "hang", "fail"}},
      {"stage", {"ok", "hang", "fail"}},
      {"drain_status", {"ok", "hang", "fail"}},
      {"abort", {"ok", "hang", "fail"}},
      {"identity", {"ok", "hang", "fail"}},
  };
  return kOps;
}

std::string ResetOpName(CacheKind k) {
  switch (k) {
    case CacheKind::kPrefix: return "reset_prefix_cache";
    case CacheKind::kEncoder: return "reset_encoder_cache";
    case CacheKind::kMultimodal: return "reset_mm_cache";
  }
  return "reset_prefix_cache";
}

Result<CacheKind> CacheKindFromName(const std::string& name, const std::string& path) {
  if (name == "prefix") return CacheKind::kPrefix;
  if (name == "encoder") return CacheKind::kEncoder;
  if (name == "multimodal" || name == "mm") return CacheKind::kMultimodal;
  return InvalidArgument(path + ": unknown cache '" + name + "' (expected prefix|encoder|multimodal)");
}

Result<OpScript> ParseOp(const std::string& op, const Json& j, const std::string& path) {
  RC_RETURN_IF_ERROR(CheckKnownKeys(j, {"latency_ms", "behavior", "on_update"}, path));
  OpScript s;
  RC_ASSIGN_OR_RETURN(s.latency_ms, GetNonNegativeInt(j, "latency_ms", path, 0));
  RC_ASSIGN_OR_RETURN(s.behavior, GetString(j, "behavior", path, std::string("ok")));
  RC_ASSIGN_OR_RETURN(s.on_update, GetNonNegativeInt(j, "on_update", path, 0));
  const auto& allowed = KnownOps().at(op);
  if (!allowed.count(s.behavior)) {
    std::string list;
    for (const auto& b : allowed) list += (list.empty() ? "" : "|") + b;
    return InvalidArgument(path + ".behavior: '" + s.behavior + "' is not a behaviour of " + op + " (" + list + ")");
  }
  return s;
}

}  // namespace

Result<ScriptedEngineConfig> ParseScriptedEngineConfig(const Json& j, std::string_view path_view) {
  std::string path(path_view);
  ScriptedEngineConfig c;
  if (j.is_null()) return c;
  RC_RETURN_IF_ERROR(CheckKnownKeys(j, {"ops", "offers_digest", "caches"}, path));
  RC_ASSIGN_OR_RETURN(c.offers_content_digest, GetBool(j, "offers_digest", path, true));
  if (j.contains("caches")) {
    if (!j["caches"].is_array()) return InvalidArgument(path + ".caches: expected an array");
    c.caches.clear();
    for (size_t i = 0; i < j["caches"].size(); ++i) {
      std::string p = path + ".caches[" + std::to_string(i) + "]";
      if (!j["caches"][i].is_string()) return InvalidArgument(p + ": expected a string");
      RC_ASSIGN_OR_RETURN(CacheKind k, CacheKindFromName(j["caches"][i].get<std::string>(), p));
      c.caches.push_back(k);
    }
  }
  if (j.contains("ops")) {
    const Json& ops = j["ops"];
    if (!ops.is_object()) return InvalidArgument(path + ".ops: expected an object");
    for (auto it = ops.begin(); it != ops.end(); ++it) {
      std::string p = path + ".ops." + it.key();
      if (!KnownOps().count(it.key())) return InvalidArgument(p + ": unknown operation");
      std::vector<OpScript> list;
      if (it->is_array()) {
        for (size_t i = 0; i < it->size(); ++i) {
          RC_ASSIGN_OR_RETURN(OpScript s, ParseOp(it.key(), (*it)[i], p + "[" + std::to_string(i) + "]"));
          list.push_back(s);
        }
      } else {
        RC_ASSIGN_OR_RETURN(OpScript s, ParseOp(it.key(), *it, p));
        list.push_back(s);
      }
      c.ops[it.key()] = list;
    }
  }
  return c;
}

ScriptedEngine::ScriptedEngine(const Clock* clock, ScriptedEngineConfig config)
    : clock_(clock), config_(std::move(config)), label_(config_.label), digest_(config_.digest) {
  last_tick_ms_ = clock_->NowMs();
}

const OpScript& ScriptedEngine::ScriptFor(const std::string& op) const {
  static const OpScript kOk;
  auto it = config_.ops.find(op);
  if (it == config_.ops.end()) return kOk;
  // A script for this update ordinal wins over one for every update.
  const OpScript* any = nullptr;
  for (const auto& s : it->second) {
    if (s.on_update == current_update_ && current_update_ != 0) return s;
    if (s.on_update == 0) any = &s;
  }
  return any ? *any : kOk;
}

template <typename T>
Pending<T> ScriptedEngine::Schedule(const OpScript& script, std::function<Result<T>()> effect) {
  Pending<T> p;
  if (script.behavior == "hang") return p;  // never completes
  due_.push_back(Due{clock_->NowMs() + script.latency_ms, [p, effect = std::move(effect)] { p.Fulfill(effect()); }});
  return p;
}

std::vector<std::string> ScriptedEngine::Tick() {
  const int64_t now = clock_->NowMs();
  // Advance generation of running requests by the elapsed time (frozen while paused).
  std::vector<std::string> finished;
  int64_t elapsed = now - last_tick_ms_;
  last_tick_ms_ = now;
  if (!paused_ && elapsed > 0) {
    for (auto it = running_.begin(); it != running_.end();) {
      it->second -= elapsed;
      if (it->second <= 0) {
        finished.push_back(it->first);
        it = running_.erase(it);
      } else {
        ++it;
      }
    }
  }
  // Complete due calls in order of due time (stable for equal times).
  std::stable_sort(due_.begin(), due_.end(), [](const Due& a, const Due& b) { return a.at_ms < b.at_ms; });
  while (!due_.empty() && due_.front().at_ms <= now) {
    Due d = std::move(due_.front());
    due_.erase(due_.begin());
    d.complete();
  }
  return finished;
}

void ScriptedEngine::StartRequest(const std::string& id, int64_t duration_ms) { running_[id] = std::max<int64_t>(duration_ms, 1); }

Result<EngineDescription> ScriptedEngine::Describe() {
  EngineDescription d;
  d.name = "scripted";
  d.kind = "scripted";
  d.offers_content_digest = config_.offers_content_digest;
  d.supports_staging = true;
  d.caches = config_.caches;
  return d;
}

Pending<DrainStatus> ScriptedEngine::GetDrainStatus() {
  const OpScript& s = ScriptFor("drain_status");
  return Schedule<DrainStatus>(s, [this, b = s.behavior]() -> Result<DrainStatus> {
    if (b == "fail") return Unavailable("drain status: connection refused");
    return DrainStatus{static_cast<int64_t>(running_.size()), 0};
  });
}

Pending<PauseEvidence> ScriptedEngine::Pause(PauseMode mode) {
  const OpScript& s = ScriptFor("pause");
  return Schedule<PauseEvidence>(s, [this, mode, b = s.behavior]() -> Result<PauseEvidence> {
    if (b == "fail") return Unavailable("pause: connection reset");
    if (mode == PauseMode::kAbort) {
      for (const auto& [id, left] : running_) aborted_.insert(id);
      running_.clear();
    }
    paused_ = true;
    // kWait would wait for running requests; the scripted engine reports what is still running
    // and the Runner refuses to install over it.
    return PauseEvidence{paused_, mode == PauseMode::kKeep ? 0 : static_cast<int64_t>(running_.size())};
  });
}

Pending<AbortEvidence> ScriptedEngine::AbortRequests(const std::vector<std::string>& rollout_ids) {
  const OpScript& s = ScriptFor("abort");
  return Schedule<AbortEvidence>(s, [this, rollout_ids, b = s.behavior]() -> Result<AbortEvidence> {
    if (b == "fail") return Unavailable("abort_requests: connection refused");
    int64_t n = 0;
    for (const auto& id : rollout_ids) {
      if (running_.erase(id)) {
        aborted_.insert(id);
        ++n;
      }
    }
    return AbortEvidence{n};
  });
}

Pending<StageEvidence> ScriptedEngine::Stage(const UpdateTarget& target) {
  current_update_ = target.ordinal;
  stage_calls_.push_back(target.label);
  const OpScript& s = ScriptFor("stage");
  return Schedule<StageEvidence>(s, [target, b = s.behavior]() -> Result<StageEvidence> {
    if (b == "fail") return Unavailable("stage: trainer rank 0 unreachable");
    return StageEvidence{target.label, 0, Json::object()};
  });
}

Pending<InstallEvidence> ScriptedEngine::Install(const UpdateTarget& target, bool full) {
  current_update_ = target.ordinal;
  const OpScript& s = full ? OpScript() : ScriptFor("install");
  const int64_t start = clock_->NowMs();
  auto refused = [&target](std::string why) {
    InstallEvidence e;
    e.label = target.label;
    e.outcome = InstallOutcome::kRefusedUntouched;
    e.error = std::move(why);
    return e;
  };
  if (!paused_) {
    // A real engine refuses to install while serving; so does this one.
    return Pending<InstallEvidence>::Completed(refused("install refused: engine is not paused"));
  }
  if (s.behavior == "fail_before_mutation") {
    return Schedule<InstallEvidence>(s, [e = refused("install refused: staged version does not match the layout")]()
                                            -> Result<InstallEvidence> { return e; });
  }
  size_t window = mutations_.size();
  mutations_.push_back({start, -1});
  ++install_generation_;
  return Schedule<InstallEvidence>(s, [this, target, window, b = s.behavior]() -> Result<InstallEvidence> {
    mutations_[window].second = clock_->NowMs();
    if (b == "fail_after_mutation") {
      digest_ = "partial-" + target.identity.content_digest;
      InstallEvidence e;
      e.label = target.label;
      e.outcome = InstallOutcome::kFailedAfterMutation;
      e.error = "install failed after writing 3 of 7 tensors";
      return e;
    }
    previous_label_ = label_;
    label_ = target.label;
    digest_ = b == "wrong_digest" ? "corrupt-" + target.identity.content_digest : target.identity.content_digest;
    return InstallEvidence{target.label, 1, Json::object()};
  });
}

Pending<CacheResetResult> ScriptedEngine::ResetCache(CacheKind kind) {
  const OpScript& s = ScriptFor(ResetOpName(kind));
  return Schedule<CacheResetResult>(s, [kind, b = s.behavior]() -> Result<CacheResetResult> {
    if (b == "fail") return Unavailable("reset: connection reset");
    CacheResetResult r;
    r.kind = kind;
    r.success = b != "refuse";
    r.freed_blocks = r.success ? 12 : 0;
    r.blocks_in_use = r.success ? 0 : 4;
    r.verified = true;  // scripted: models an engine that reports evidence
    return r;
  });
}

Pending<LabelEvidence> ScriptedEngine::ReadLabel() {
  const OpScript& s = ScriptFor("report_label");
  return Schedule<LabelEvidence>(s, [this, b = s.behavior]() -> Result<LabelEvidence> {
    if (b == "fail") return Unavailable("weight_info: connection refused");
    // "stale": the engine keeps reporting the label from before the update.
    if (b == "stale") return LabelEvidence{previous_label_};
    return LabelEvidence{label_};
  });
}

Pending<DigestEvidence> ScriptedEngine::ReadContentDigest() {
  if (!config_.offers_content_digest) {
    return Pending<DigestEvidence>::Completed(Unimplemented("this engine offers no content digest"));
  }
  const OpScript& s = ScriptFor("content_digest");
  return Schedule<DigestEvidence>(s, [this, b = s.behavior]() -> Result<DigestEvidence> {
    if (b == "fail") return Unavailable("digest: connection refused");
    if (b == "wrong") return DigestEvidence{"wrong-" + digest_};
    return DigestEvidence{digest_};
  });
}

Pending<ResumeEvidence> ScriptedEngine::Resume() {
  const OpScript& s = ScriptFor("resume");
  return Schedule<ResumeEvidence>(s, [this, b = s.behavior]() -> Result<ResumeEvidence> {
    if (b == "fail") return Unavailable("resume: connection refused");
    paused_ = false;
    return ResumeEvidence{paused_};
  });
}

Pending<IdentityEvidence> ScriptedEngine::ProbeIdentity() {
  const OpScript& s = ScriptFor("identity");
  return Schedule<IdentityEvidence>(s, [this, b = s.behavior]() -> Result<IdentityEvidence> {
    if (b == "fail") return Unavailable("engine state: connection refused");
    return IdentityEvidence{"boot-" + std::to_string(boots_), label_, install_generation_, digest_, paused_};
  });
}

void ScriptedEngine::Restart() {
  ++boots_;
  label_ = config_.label;
  digest_ = config_.digest;
  previous_label_.clear();
  paused_ = false;
  install_generation_ = 0;
  for (const auto& [id, remaining] : running_) aborted_.insert(id);
  running_.clear();
}

}  // namespace rc::lifecycle
