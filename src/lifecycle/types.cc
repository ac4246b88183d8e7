#include "rolloutcore/lifecycle/types.h"

namespace rc::lifecycle {

std::string_view PauseModeName(PauseMode m) {
  switch (m) {
    case PauseMode::kAbort: return "abort";
    case PauseMode::kWait: return "wait";
    case PauseMode::kKeep: return "keep";
  }
  return "unknown";
}

std::string_view CacheKindName(CacheKind k) {
  switch (k) {
    case CacheKind::kPrefix: return "prefix";
    case CacheKind::kEncoder: return "encoder";
    case CacheKind::kMultimodal: return "multimodal";
  }
  return "unknown";
}

std::string_view DrainPolicyName(DrainPolicy p) {
  switch (p) {
    case DrainPolicy::kWait: return "wait";
    case DrainPolicy::kAbort: return "abort";
    case DrainPolicy::kCancel: return "cancel";
  }
  return "unknown";
}

std::optional<DrainPolicy> DrainPolicyFromName(std::string_view name) {
  if (name == "wait") return DrainPolicy::kWait;
  if (name == "abort") return DrainPolicy::kAbort;
  if (name == "cancel") return DrainPolicy::kCancel;
  return std::nullopt;
}

std::string_view InstallOutcomeName(InstallOutcome o) {
  switch (o) {
    case InstallOutcome::kInstalled: return "installed";
    case InstallOutcome::kRefusedUntouched: return "refused_untouched";
    case InstallOutcome::kFailedAfterMutation: return "failed_after_mutation";
  }
  return "unknown";
}

std::optional<InstallOutcome> InstallOutcomeFromName(std::string_view name) {
  if (name == "installed") return InstallOutcome::kInstalled;
  if (name == "refused_untouched") return InstallOutcome::kRefusedUntouched;
  if (name == "failed_after_mutation") return InstallOutcome::kFailedAfterMutation;
  return std::nullopt;
}

Json ToJson(const WeightVersion& v) { return Json{{"label", v.label}, {"generation", v.generation}}; }

Json ToJson(const WeightIdentity& id) {
  return Json{{"content_digest", id.content_digest},
              {"checkpoint", id.checkpoint},
              {"run", id.run},
              {"step", id.step}};
}

Json ToJson(const RolloutBinding& b) {
  return Json{{"rollout_id", b.rollout_id},
              {"label", b.version.label},
              {"generation", b.version.generation},
              {"identity", ToJson(b.identity)},
              {"admitted_at_ms", b.admitted_at_ms}};
}

Json ToJson(const UpdateTarget& t) {
  Json j{{"label", t.label}, {"identity", ToJson(t.identity)}, {"model", t.model}, {"ordinal", t.ordinal}};
  if (t.mode != PolicyMode::kStrict) j["mode"] = PolicyModeName(t.mode);
  return j;
}

std::string_view PolicyModeName(PolicyMode m) {
  switch (m) {
    case PolicyMode::kStrict: return "strict";
    case PolicyMode::kKeep: return "keep";
    case PolicyMode::kRecompute: return "recompute";
    case PolicyMode::kAbort: return "abort";
  }
  return "unknown";
}

Result<PolicyMode> PolicyModeFromName(std::string_view name, std::string_view field) {
  for (PolicyMode m : kAllPolicyModes) {
    if (PolicyModeName(m) == name) return m;
  }
  return InvalidArgument(std::string(field) + ": '" + std::string(name) +
                         "' is not a policy mode (expected one of strict, keep, recompute, abort)");
}

Result<WeightIdentity> WeightIdentityFromJson(const Json& j, std::string_view path) {
  WeightIdentity id;
  RC_ASSIGN_OR_RETURN(id.content_digest, GetString(j, "content_digest", path, std::string()));
  RC_ASSIGN_OR_RETURN(id.checkpoint, GetString(j, "checkpoint", path, std::string()));
  RC_ASSIGN_OR_RETURN(id.run, GetString(j, "run", path, std::string()));
  RC_ASSIGN_OR_RETURN(id.step, GetInt(j, "step", path, -1));
  return id;
}

Result<UpdateTarget> UpdateTargetFromJson(const Json& j, std::string_view path) {
  UpdateTarget t;
  RC_ASSIGN_OR_RETURN(t.label, GetString(j, "label", path));
  RC_ASSIGN_OR_RETURN(t.model, GetString(j, "model", path, std::string()));
  RC_ASSIGN_OR_RETURN(t.ordinal, GetInt(j, "ordinal", path, 0));
  if (j.contains("identity")) {
    std::string sub = std::string(path) + ".identity";
    RC_ASSIGN_OR_RETURN(t.identity, WeightIdentityFromJson(j["identity"], sub));
  }
  if (j.contains("mode")) {
    RC_ASSIGN_OR_RETURN(std::string mode, GetString(j, "mode", path));
    RC_ASSIGN_OR_RETURN(t.mode, PolicyModeFromName(mode, std::string(path) + ".mode"));
  }
  return t;
}

}  // namespace rc::lifecycle
