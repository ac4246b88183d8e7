// The refit receiver's reports (receiver.h): what a stage, an install, a relay and a live digest
// established, as typed values. The receiver builds and passes them between its steps as structs;
// they become JSON only at the edges that send them on — the engine's HTTP routes
// (/rc/refit/stage, /rc/refit/install, /rc/refit/relay, /rc/weights/digest; ENGINE_API.md,
// docs/engine.md "Receiver-driven refit" and "Fan-out", docs/refit.md "Delta refit") and the
// embedded adapter's lifecycle evidence (`detail`, journaled) — through ToJson(), whose keys,
// value types and optional keys are the wire format documented there.
//
// Every digest is an rc::ContentDigest (16 hex digits on the wire), per-tensor digests are
// refit::TensorDigests, milliseconds are doubles. No report holds free-form JSON.
//
// Thread safety: plain values.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "rolloutcore/base/content_digest.h"
#include "rolloutcore/base/json.h"
#include "rolloutcore/receiver/live_weights.h"
#include "rolloutcore/receiver/refit_choice.h"
#include "rolloutcore/refit/digest.h"

namespace rc::receiver {

// Milliseconds per step of a stage or an install, by step name (receiver.h, "Timing"): the
// `stages_ms` object, and the rolloutcore_refit_stage_ms series.
using StepTimings = std::map<std::string, double>;

enum class StageMode { kFull, kDelta };
std::string_view StageModeName(StageMode m);  // full | delta

// Where a delta stage applied the delta (docs/refit.md "Delta on the staging image").
enum class DeltaApply { kStaging, kLive };
std::string_view DeltaApplyName(DeltaApply a);  // staging | live

// What the staging image was brought to the live version from before the delta was applied.
enum class StagingFrom { kNone, kReapplyPreviousDelta, kCopyOfLive };
std::string_view StagingFromName(StagingFrom f);  // none | reapply_previous_delta | copy_of_live

// How an install made the staged version live (docs/engine.md "Install by swap").
enum class InstallMode { kSwap, kCopy, kInPlace };
std::string_view InstallModeName(InstallMode m);  // swap | copy | in_place

// Fan-out (`sources`, only when the stage was asked to use relays): who served the planned bytes.
struct FanOutReport {
  uint64_t origin_bytes = 0;  // read from the trainer
  uint64_t relay_bytes = 0;   // read from relay holders
  std::map<std::string, uint64_t> by_holder;
  uint64_t holder_records = 0;              // found in the directory
  std::vector<std::string> failed_holders;  // excluded (their memory could not be reached), sorted
  int64_t failovers = 0;
  [[nodiscard]] Json ToJson() const;
};

// What only a full stage reports: the plan, the caches it reused, the landing digest.
struct FullStageReport {
  uint64_t bytes_needed = 0;
  uint64_t bytes_planned = 0;
  uint64_t reads = 0;
  uint64_t descriptors = 0;
  uint64_t full_pulls = 0;
  bool plan_cached = false;
  int64_t plans_built = 0;
  bool shadow_allocated = false;
  bool transport_cached = false;
  int64_t transports_built = 0;
  uint64_t params_digested_while_landing = 0;
  uint64_t params_scanned_while_landing = 0;
  double wire_gbps = 0;
  std::optional<FanOutReport> sources;  // present exactly when the request set use_relays
};

// One rank of a delta stage (the `ranks` array).
struct DeltaRankReport {
  uint64_t rank = 0;
  // From the prediction pass (delta_apply.h PredictDelta).
  int64_t changed_in_region = 0;
  uint64_t region_delta_bytes = 0;  // what an encoding of only the rank's own changes would take
  int64_t writes = 0;
  // From the pull.
  uint64_t bytes_pulled = 0;
  uint64_t reads = 0;
  uint64_t shards_read = 0;
  [[nodiscard]] Json ToJson() const;
};

// What only a delta stage reports (docs/refit.md "Delta refit").
struct DeltaStageReport {
  DeltaApply delta_apply = DeltaApply::kLive;
  StagingFrom staging_from = StagingFrom::kNone;
  std::string delta_apply_why;
  // Minor page faults taken by the staging preparation and by the delta pass (`page_faults`).
  int64_t page_faults_staging_prepare = 0;
  int64_t page_faults_delta_pass = 0;
  std::string delta_base;
  uint64_t delta_bytes_published = 0;
  uint64_t full_bytes_published = 0;
  int64_t changed_published = 0;
  int64_t changed_digested = 0;
  std::vector<DeltaRankReport> ranks;
};

// The stage's pre-replay (`prereplay`; receiver.h "Pre-replay").
struct StagePreReplay {
  // probes, ms, ran and why always; the rest only when `attempted`. When it ran, `why` says so.
  PreReplayReport report;
  bool attempted = false;  // LiveWeights::PreReplay was called (batched, forced, diverged, forwards)
  [[nodiscard]] Json ToJson() const;
};

// What a successful stage established (the answer of /rc/refit/stage).
struct StageReport {
  std::string version;
  std::string model;
  std::string mode_reason;  // why full or delta
  std::string transport;
  uint64_t bytes_pulled = 0;
  int64_t threads = 0;
  std::string digest_check;      // what was compared with the manifest (`coverage` is always "ok")
  ContentDigest content_digest;  // the manifest's combined digest
  StepTimings stages_ms;
  std::variant<FullStageReport, DeltaStageReport> by_mode;  // `mode` follows the alternative
  StagePreReplay prereplay;                                 // set by Stage after the stage succeeded
  // `delta_choice`: only when the version carries deltas and the choice decided the mode (a delta
  // the engine could not apply is full for the reason in mode_reason; refit_choice.h).
  std::optional<DeltaChoice> delta_choice;
  double call_ms = 0;                                       // the whole Stage call on the engine's side

  [[nodiscard]] StageMode mode() const { return by_mode.index() == 0 ? StageMode::kFull : StageMode::kDelta; }
  const FullStageReport* full() const { return std::get_if<FullStageReport>(&by_mode); }
  const DeltaStageReport* delta() const { return std::get_if<DeltaStageReport>(&by_mode); }
  [[nodiscard]] Json ToJson() const;
};

// The install's anchor check (`anchor_check`; docs/refit.md "anchor checks"). A check that ran and
// did not match fails the install, so a report that says ran says ok.
struct AnchorCheckReport {
  bool ran = false;
  std::string reason;               // when ran
  std::optional<double> ms;         // when a delta install ran it (a full install digests anyway)
  int64_t deltas_since_anchor = 0;  // when not ran
  int64_t every = 0;                // when not ran: full_verify_every
  [[nodiscard]] Json ToJson() const;
};

// What a successful install established (the answer of /rc/refit/install with install_outcome
// "installed"): the stage's report, then what the install adds. Its stages_ms and call_ms replace
// the stage's on the wire.
struct InstallReport {
  StageReport stage;
  std::string weight_version;
  uint64_t bytes_installed = 0;
  InstallMode install_mode = InstallMode::kCopy;
  bool cache_reset = true;
  ContentDigest live_content_digest;
  AnchorCheckReport anchor_check;
  StepTimings stages_ms;                  // the stage's steps plus install, post_install, ready, ...
  std::optional<bool> prereplay_adopted;  // only when the installed image had been pre-replayed
  double call_ms = 0;                     // the whole Install call on the engine's side
  [[nodiscard]] Json ToJson() const;      // with install_outcome "installed"
};

// What serving a version as a source established (the answer of /rc/refit/relay).
enum class RelayFrom { kStaged, kInstalled };
std::string_view RelayFromName(RelayFrom f);  // staged | installed

struct RelayReport {
  std::string holder;
  std::string relay_model;
  std::string relay_version;
  RelayFrom from = RelayFrom::kStaged;
  uint64_t bytes = 0;
  uint64_t registrations = 0;
  ContentDigest content_digest;  // the holder record's, equal to the version's
  double build_ms = 0;
  [[nodiscard]] Json ToJson() const;
};

// The live weights' digests (the answer of /rc/weights/digest).
struct LiveDigestReport {
  ContentDigest content_digest;  // CombineTensorDigests(tensors)
  std::string weight_version;
  refit::TensorDigests tensors;  // per tensor, in global source coordinates
  double digest_ms = 0;
  std::string computed;  // "now", or "at install, ..." when served from the install's digest
  [[nodiscard]] Json ToJson() const;
};

}  // namespace rc::receiver
