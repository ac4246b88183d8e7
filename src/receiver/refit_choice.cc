#include "rolloutcore/receiver/refit_choice.h"

#include <fmt/format.h>

namespace rc::receiver {

std::string_view DeltaPolicyName(DeltaPolicy p) {
  switch (p) {
    case DeltaPolicy::kAuto:
      return "auto";
    case DeltaPolicy::kAlways:
      return "always";
    case DeltaPolicy::kNever:
      return "never";
  }
  return "auto";
}

Result<DeltaPolicy> ParseDeltaPolicy(std::string_view s) {
  for (DeltaPolicy p : {DeltaPolicy::kAuto, DeltaPolicy::kAlways, DeltaPolicy::kNever}) {
    if (s == DeltaPolicyName(p)) return p;
  }
  return InvalidArgument(fmt::format("delta policy '{}': expected auto, always or never", s));
}

RefitWork WorkOf(const refit::Manifest& manifest) {
  RefitWork w;
  for (const refit::ShardTable& t : manifest.tables) {
    for (const refit::ShardInfo& s : t.shards) {
      w.full_bytes += static_cast<uint64_t>(refit::NumElements(s.shape)) * refit::DTypeSize(t.dtype);
      if (s.delta) {
        w.delta_bytes += s.delta->bytes;
        w.changed += s.delta->changed;
      }
    }
  }
  return w;
}

Json DeltaChoice::ToJson() const {
  Json j = {{"policy", std::string(DeltaPolicyName(policy))},
            {"mode", delta ? "delta" : "full"},
            {"reason", reason},
            {"full_samples", full_samples},
            {"delta_samples", delta_samples}};
  j["estimated_full_ms"] = full_ms < 0 ? Json(nullptr) : Json(full_ms);
  j["estimated_delta_ms"] = delta_ms < 0 ? Json(nullptr) : Json(delta_ms);
  return j;
}

void RefitCostModel::Rate::Add(double ms, double units) {
  if (units <= 0 || ms < 0) return;  // nothing to learn from an empty version
  const double r = ms / units;
  ms_per_unit = samples == 0 ? r : kEwmaWeight * r + (1 - kEwmaWeight) * ms_per_unit;
  ++samples;
}

void RefitCostModel::RecordFull(const std::string& transport, const RefitWork& work, double ms) {
  full_[transport].Add(ms, static_cast<double>(work.full_bytes));
}

void RefitCostModel::RecordDelta(const std::string& transport, const RefitWork& work, double ms) {
  delta_[transport].Add(ms, static_cast<double>(work.changed));
}

DeltaChoice RefitCostModel::Choose(DeltaPolicy policy, const std::string& transport, const RefitWork& work) const {
  DeltaChoice c;
  c.policy = policy;
  const auto f = full_.find(transport);
  const auto d = delta_.find(transport);
  c.full_samples = f == full_.end() ? 0 : f->second.samples;
  c.delta_samples = d == delta_.end() ? 0 : d->second.samples;
  if (c.full_samples > 0) c.full_ms = f->second.ms_per_unit * static_cast<double>(work.full_bytes);
  if (c.delta_samples > 0) c.delta_ms = d->second.ms_per_unit * static_cast<double>(work.changed);
  switch (policy) {
    case DeltaPolicy::kNever:
      c.delta = false;
      c.reason = "delta policy never: staged in full";
      return c;
    case DeltaPolicy::kAlways:
      c.delta = true;
      c.reason = "delta policy always";
      return c;
    case DeltaPolicy::kAuto:
      break;
  }
  if (c.full_samples > 0 && c.delta_samples > 0) {
    c.delta = c.delta_ms <= c.full_ms;
    c.reason = fmt::format("auto on {}: {} estimated {:.3f} ms against {} {:.3f} ms (measured: {} full, {} delta stages)",
                           transport, c.delta ? "delta" : "full", c.delta ? c.delta_ms : c.full_ms,
                           c.delta ? "full" : "delta", c.delta ? c.full_ms : c.delta_ms, c.full_samples,
                           c.delta_samples);
    return c;
  }
  c.delta = work.delta_bytes <= work.full_bytes;
  c.reason = fmt::format("auto on {}: {} not measured yet; {} moves fewer bytes ({} delta, {} full published)",
                         transport,
                         c.full_samples == 0 && c.delta_samples == 0 ? "neither mode"
                         : c.full_samples == 0                       ? "the full stage"
                                                                     : "the delta stage",
                         c.delta ? "the delta" : "the full stage", work.delta_bytes, work.full_bytes);
  return c;
}

}  // namespace rc::receiver
