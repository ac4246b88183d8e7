#include "rolloutcore/lifecycle/types.h"

#include <iterator>
#include <optional>

namespace rc::lifecycle {

namespace {

// One table per enum gives both directions of its wire names (name of a value, value of a name).
template <typename E>
struct NamedValue {
  E value;
  std::string_view name;
};

template <typename E, size_t N>
std::string_view NameIn(const NamedValue<E> (&table)[N], E value) {
  for (const NamedValue<E>& e : table) {
    if (e.value == value) return e.name;
  }
  return "unknown";
}

template <typename E, size_t N>
std::optional<E> ValueIn(const NamedValue<E> (&table)[N], std::string_view name) {
  for (const NamedValue<E>& e : table) {
    if (e.name == name) return e.value;
  }
  return std::nullopt;
}

constexpr NamedValue<PauseMode> kPauseModes[] = {{PauseMode::kAbort, "abort"}, {PauseMode::kWait, "wait"},
                                                 {PauseMode::kKeep, "keep"}};
constexpr NamedValue<CacheKind> kCacheKinds[] = {
    {CacheKind::kPrefix, "prefix"}, {CacheKind::kEncoder, "encoder"}, {CacheKind::kMultimodal, "multimodal"}};
constexpr NamedValue<DrainPolicy> kDrainPolicies[] = {{DrainPolicy::kWait, "wait"}, {DrainPolicy::kAbort, "abort"},
                                                      {DrainPolicy::kCancel, "cancel"}};
constexpr NamedValue<InstallOutcome> kInstallOutcomes[] = {{InstallOutcome::kInstalled, "installed"},
                                                           {InstallOutcome::kRefusedUntouched, "refused_untouched"},
                                                           {InstallOutcome::kFailedAfterMutation, "failed_after_mutation"}};
constexpr NamedValue<PolicyMode> kPolicyModes[] = {{PolicyMode::kStrict, "strict"}, {PolicyMode::kKeep, "keep"},
                                                   {PolicyMode::kRecompute, "recompute"}, {PolicyMode::kAbort, "abort"}};
static_assert(std::size(kPolicyModes) == std::size(kAllPolicyModes), "a policy mode without a name");

}  // namespace

std::string_view PauseModeName(PauseMode m) { return NameIn(kPauseModes, m); }
std::string_view CacheKindName(CacheKind k) { return NameIn(kCacheKinds, k); }
std::string_view DrainPolicyName(DrainPolicy p) { return NameIn(kDrainPolicies, p); }
std::optional<DrainPolicy> DrainPolicyFromName(std::string_view name) { return ValueIn(kDrainPolicies, name); }
std::string_view InstallOutcomeName(InstallOutcome o) { return NameIn(kInstallOutcomes, o); }
std::optional<InstallOutcome> InstallOutcomeFromName(std::string_view name) { return ValueIn(kInstallOutcomes, name); }

Json ToJson(const WeightVersion& v) { return Json{{"label", v.label}, {"generation", v.generation}}; }

Json ToJson(const WeightIdentity& id) {
  return Json{{"content_digest", id.content_digest},
              {"checkpoint", id.checkpoint},
              {"run", id.run},
              {"step", id.step}};
}

Json ToJson(const RolloutBinding& b) {
  Json j{{"rollout_id", b.rollout_id},
         {"label", b.version.label},
         {"generation", b.version.generation},
         {"identity", ToJson(b.identity)},
         {"admitted_at_ms", b.admitted_at_ms}};
  if (b.lease) j["lease"] = true;
  return j;
}

Json ToJson(const UpdateTarget& t) {
  Json j{{"label", t.label}, {"identity", ToJson(t.identity)}, {"model", t.model}, {"ordinal", t.ordinal}};
  if (t.mode != PolicyMode::kStrict) j["mode"] = PolicyModeName(t.mode);
  return j;
}

std::string_view PolicyModeName(PolicyMode m) { return NameIn(kPolicyModes, m); }

Result<PolicyMode> PolicyModeFromName(std::string_view name, std::string_view field) {
  if (auto m = ValueIn(kPolicyModes, name)) return *m;
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

std::string QuantizedDigestEvidence::Mismatch(std::string_view of) const {
  std::string out = "the engine's " + quantization + " image";
  if (live.empty()) {
    out += " has no consistent digest";
  } else if (live == expected && !published.empty() && live != published) {
    out += " (" + live + ") is its own quantization of " + std::string(of) + " but not the image the trainer " +
           "published (" + published + "): the engine's quantizer and the trainer's disagree";
  } else {
    out += " (" + live + ") is not the quantization of " + std::string(of) + " (" + expected + ")";
    if (!published.empty()) out += "; the trainer published " + published;
  }
  if (!detail.empty()) out += ": " + detail;
  return out;
}

}  // namespace rc::lifecycle
