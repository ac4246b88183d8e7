// The receiver's reports as JSON (reports.h): the wire format of the refit routes and of the
// embedded adapter's evidence.
#include "rolloutcore/receiver/reports.h"

namespace rc::receiver {

std::string_view StageModeName(StageMode m) { return m == StageMode::kFull ? "full" : "delta"; }

std::string_view DeltaApplyName(DeltaApply a) { return a == DeltaApply::kStaging ? "staging" : "live"; }

std::string_view StagingFromName(StagingFrom f) {
  switch (f) {
    case StagingFrom::kNone:
      return "none";
    case StagingFrom::kReapplyPreviousDelta:
      return "reapply_previous_delta";
    case StagingFrom::kCopyOfLive:
      return "copy_of_live";
  }
  return "unknown";
}

std::string_view InstallModeName(InstallMode m) {
  switch (m) {
    case InstallMode::kSwap:
      return "swap";
    case InstallMode::kCopy:
      return "copy";
    case InstallMode::kInPlace:
      return "in_place";
  }
  return "unknown";
}

std::string_view RelayFromName(RelayFrom f) { return f == RelayFrom::kStaged ? "staged" : "installed"; }

Json FanOutReport::ToJson() const {
  return Json{{"origin_bytes", origin_bytes},     {"relay_bytes", relay_bytes},       {"by_holder", Json(by_holder)},
              {"holder_records", holder_records}, {"failed_holders", failed_holders}, {"failovers", failovers}};
}

Json DeltaRankReport::ToJson() const {
  return Json{{"rank", rank},
              {"changed_in_region", changed_in_region},
              {"region_delta_bytes", region_delta_bytes},
              {"writes", writes},
              {"bytes_pulled", bytes_pulled},
              {"reads", reads},
              {"shards_read", shards_read}};
}

Json StagePreReplay::ToJson() const {
  Json j{{"probes", report.probes}, {"ms", report.ms}, {"ran", report.ran}, {"why", report.why}};
  if (attempted) {
    j["batched"] = report.batched;
    j["forced"] = report.forced;
    j["diverged"] = report.diverged;
    j["forwards"] = report.forwards;
  }
  return j;
}

namespace {

void AddFull(const FullStageReport& f, Json* j) {
  Json& o = *j;
  o["bytes_needed"] = f.bytes_needed;
  o["bytes_planned"] = f.bytes_planned;
  o["reads"] = f.reads;
  o["descriptors"] = f.descriptors;
  o["full_pulls"] = f.full_pulls;
  o["plan_cached"] = f.plan_cached;
  o["plans_built"] = f.plans_built;
  o["shadow_allocated"] = f.shadow_allocated;
  o["transport_cached"] = f.transport_cached;
  o["transports_built"] = f.transports_built;
  o["params_digested_while_landing"] = f.params_digested_while_landing;
  o["params_scanned_while_landing"] = f.params_scanned_while_landing;
  o["wire_gbps"] = f.wire_gbps;
  if (f.sources) o["sources"] = f.sources->ToJson();
}

void AddDelta(const DeltaStageReport& d, Json* j) {
  Json& o = *j;
  o["delta_apply"] = DeltaApplyName(d.delta_apply);
  o["staging_from"] = StagingFromName(d.staging_from);
  o["delta_apply_why"] = d.delta_apply_why;
  o["page_faults"] = Json{{"staging_prepare", d.page_faults_staging_prepare}, {"delta_pass", d.page_faults_delta_pass}};
  o["delta_base"] = d.delta_base;
  o["delta_bytes_published"] = d.delta_bytes_published;
  o["full_bytes_published"] = d.full_bytes_published;
  o["changed_published"] = d.changed_published;
  o["changed_digested"] = d.changed_digested;
  Json ranks = Json::array();
  for (const DeltaRankReport& r : d.ranks) ranks.push_back(r.ToJson());
  o["ranks"] = std::move(ranks);
}

}  // namespace

Json StageReport::ToJson() const {
  Json j{{"version", version},
         {"model", model},
         {"mode", StageModeName(mode())},
         {"mode_reason", mode_reason},
         {"transport", transport},
         {"bytes_pulled", bytes_pulled},
         {"threads", threads},
         {"coverage", "ok"},
         {"digest_check", digest_check},
         {"content_digest", content_digest.ToHex()},
         {"stages_ms", Json(stages_ms)},
         {"prereplay", prereplay.ToJson()},
         {"call_ms", call_ms}};
  if (const FullStageReport* f = full()) AddFull(*f, &j);
  if (const DeltaStageReport* d = delta()) AddDelta(*d, &j);
  if (delta_choice) j["delta_choice"] = delta_choice->ToJson();
  return j;
}

Json AnchorCheckReport::ToJson() const {
  if (!ran) return Json{{"ran", false}, {"deltas_since_anchor", deltas_since_anchor}, {"every", every}};
  Json j{{"ran", true}, {"ok", true}, {"reason", reason}};
  if (ms) j["ms"] = *ms;
  return j;
}

Json InstallReport::ToJson() const {
  Json j = stage.ToJson();
  j["weight_version"] = weight_version;
  j["bytes_installed"] = bytes_installed;
  j["install_mode"] = InstallModeName(install_mode);
  j["cache_reset"] = cache_reset;
  j["live_content_digest"] = live_content_digest.ToHex();
  j["anchor_check"] = anchor_check.ToJson();
  j["stages_ms"] = Json(stages_ms);
  if (prereplay_adopted) j["prereplay_adopted"] = *prereplay_adopted;
  j["install_outcome"] = "installed";
  j["call_ms"] = call_ms;
  return j;
}

Json RelayReport::ToJson() const {
  return Json{{"holder", holder},
              {"relay_model", relay_model},
              {"relay_version", relay_version},
              {"from", RelayFromName(from)},
              {"bytes", bytes},
              {"registrations", registrations},
              {"content_digest", content_digest.ToHex()},
              {"build_ms", build_ms}};
}

Json LiveDigestReport::ToJson() const {
  Json digests = Json::object();
  for (const auto& [name, v] : tensors) digests[name] = ContentDigest(v).ToHex();
  return Json{{"content_digest", content_digest.ToHex()},
              {"weight_version", weight_version},
              {"tensors", std::move(digests)},
              {"digest_ms", digest_ms},
              {"computed", computed}};
}

}  // namespace rc::receiver
