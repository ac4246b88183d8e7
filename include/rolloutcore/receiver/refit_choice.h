// Full or delta, per update (docs/refit.md "Full or delta: the automatic choice"). A version
// published with deltas (PublisherOptions::delta) also carries its full shards, so a receiver that
// holds the delta's base may stage either. Which one is cheaper depends on where the time goes:
// a full stage moves every byte its layout needs (bounded by the wire: a network, a rate-limited or
// cross-process copy), a delta stage moves ~2–4 % of them but decodes and applies every changed
// element, and on a staging image first brings it to the live version (bounded by memory traffic
// and the CPU). The receiver measures both, per transport, and picks the one its measurements say
// is cheaper.
//
// The rule (RefitCostModel::Choose), for a version that carries deltas the engine could apply:
//   * policy `never`: full; `always`: delta (the receiver's behaviour before the choice existed);
//   * policy `auto` (the default):
//     - both costs measured on this transport: the smaller estimate wins (ties: delta);
//       full ≈ full_bytes × (ms per published full byte), delta ≈ changed × (ms per published
//       changed element), each the exponentially weighted mean (weight kEwmaWeight for the newest)
//       of the stages of that mode on that transport — so a model, layout or change fraction that
//       differs from the measured ones scales the estimate;
//     - one side not measured yet: the mode that moves fewer published bytes (the delta, as
//       published), so that the delta is measured the first time one is eligible, and the full
//       at the first full stage (the first stage after a load, or any ineligible version);
//   * the estimates count the stage only: both modes install by swap where a staging image exists
//     (a delta without one is written in place inside the pause, which the choice does not weigh).
// Published totals are the unit on both sides (not this rank's share), so a rank's measured costs
// and its estimates agree whatever its layout.
//
// Thread safety: none; the receiver calls it under its own lock.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "rolloutcore/base/json.h"
#include "rolloutcore/base/status.h"
#include "rolloutcore/refit/manifest.h"

namespace rc::receiver {

enum class DeltaPolicy { kAuto, kAlways, kNever };
std::string_view DeltaPolicyName(DeltaPolicy p);  // auto | always | never
// InvalidArgument naming the value and the accepted ones.
[[nodiscard]] Result<DeltaPolicy> ParseDeltaPolicy(std::string_view s);

// What one version would cost in each mode, in the published totals of its manifest.
struct RefitWork {
  uint64_t full_bytes = 0;   // the full shards' bytes
  uint64_t delta_bytes = 0;  // the delta payloads' bytes
  int64_t changed = 0;       // changed elements
};

// The published totals of a manifest (delta_bytes and changed are 0 for shards without a delta).
RefitWork WorkOf(const refit::Manifest& manifest);

// The choice and what it rested on: the stage report's `delta_choice`.
struct DeltaChoice {
  DeltaPolicy policy = DeltaPolicy::kAuto;
  bool delta = true;
  std::string reason;
  // Estimates in ms (auto only; negative: not measured on this transport yet).
  double full_ms = -1, delta_ms = -1;
  int64_t full_samples = 0, delta_samples = 0;
  [[nodiscard]] Json ToJson() const;
};

class RefitCostModel {
 public:
  static constexpr double kEwmaWeight = 0.5;

  // A stage of that mode on `transport` took `ms` (the stage's own work: planning, pull,
  // landing checks, delta apply; not discovery) for a version of `work`.
  void RecordFull(const std::string& transport, const RefitWork& work, double ms);
  void RecordDelta(const std::string& transport, const RefitWork& work, double ms);
  [[nodiscard]] DeltaChoice Choose(DeltaPolicy policy, const std::string& transport, const RefitWork& work) const;

 private:
  struct Rate {
    double ms_per_unit = 0;
    int64_t samples = 0;
    void Add(double ms, double units);
  };
  std::map<std::string, Rate, std::less<>> full_, delta_;  // by transport
};

}  // namespace rc::receiver
