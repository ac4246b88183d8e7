// Value types of the lifecycle: versions, identities, rollout bindings, update targets and the
// typed evidence an engine adapter returns for each operation.
//
// Evidence is what the engine *observably* reports (a label read back, per-cache reset results,
// a content digest of live weights) — never "the HTTP call returned 200". The Controller checks
// each piece against the operation's postcondition before it moves.
//
// Thread safety: plain values.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/json.h"
#include "rolloutcore/base/pending.h"
#include "rolloutcore/lifecycle/replay.h"

namespace rc::lifecycle {

// The committed generation an engine serves. `generation` increases by one with every commit
// (update or recovery) of one engine's lifecycle; `label` is the name the trainer gave it.
struct WeightVersion {
  std::string label;
  int64_t generation = 0;
  friend bool operator==(const WeightVersion&, const WeightVersion&) = default;
};

// What a version contains: the content digest of its weights plus declared provenance.
struct WeightIdentity {
  std::string content_digest;  // hex; empty when unknown
  std::string checkpoint;      // e.g. a path or directory version id
  std::string run;             // trainer run id
  int64_t step = -1;           // training step; -1 when unknown
  friend bool operator==(const WeightIdentity&, const WeightIdentity&) = default;
};

// One rollout admitted under one committed generation.
struct RolloutBinding {
  std::string rollout_id;
  WeightVersion version;
  WeightIdentity identity;
  int64_t admitted_at_ms = 0;
  // A lease (the client generates on the engine itself and reports the output; docs/lifecycle.md,
  // "Leases under each mode"). Journaled with the admission.
  bool lease = false;
};

// The policy mode of one update (docs/lifecycle.md, "Policy modes"). kStrict drains: no rollout
// spans two versions. The others update under running rollouts: kKeep freezes them and lets them
// continue on their old KV, kRecompute re-prefills their tokens under the new weights, kAbort
// ends them (partial trajectories marked aborted_at_update). A rollout that spans an update
// records exact per-token version spans.
enum class PolicyMode { kStrict, kKeep, kRecompute, kAbort };
std::string_view PolicyModeName(PolicyMode m);  // strict | keep | recompute | abort
// InvalidArgument naming the bad value and the allowed ones.
Result<PolicyMode> PolicyModeFromName(std::string_view name, std::string_view field = "mode");
inline constexpr PolicyMode kAllPolicyModes[] = {PolicyMode::kStrict, PolicyMode::kKeep, PolicyMode::kRecompute,
                                                 PolicyMode::kAbort};

// What a version's manifest says beyond its content digest, read while its update starts.
struct VersionFacts {
  std::vector<ReplayProbe> probes{};
  // The FP8 images the trainer published (refit::PublishedFp8Image), by quantization (fp8_per_block,
  // ...) -> the image's combined digest (16 hex digits, as engines report it).
  std::map<std::string, std::string> published_fp8{};
};

// What an update (or a recovery) should install.
struct UpdateTarget {
  std::string label;
  WeightIdentity identity;
  std::string model;    // directory model name (informational for the controller)
  int64_t ordinal = 0;  // 1-based update number, assigned by the Controller
  PolicyMode mode = PolicyMode::kStrict;  // journaled only when not strict
  // The version's replay probes (replay.h), replayed in VALIDATING. Not journaled (the outcome
  // is, with the validation evidence) and not part of ToJson.
  std::vector<ReplayProbe> probes{};
  // The FP8 images the version's trainer published (VersionFacts::published_fp8); validation
  // requires the live image of the quantization the engine serves to equal its entry. Not
  // journaled (the validation evidence is) and not part of ToJson.
  std::map<std::string, std::string> published_fp8{};
  // The facts still being fetched when the target was resolved (DirectoryVersionSource: the
  // manifest is read while the update starts, off the request's path). The Runner takes them into
  // `probes` and `published_fp8` before the drain completes, and rejects the update there (nothing
  // paused, nothing touched) when the fetch failed or did not answer within the stage deadline.
  // Not journaled.
  std::optional<Pending<VersionFacts>> facts_fetch{};
  // The requester's own record of this request, still being synced when the update starts
  // (ControllerService: the update journal's update_requested, synced while the stage runs). The
  // Runner waits for it before the drain can complete, and rejects the update there (nothing
  // paused, nothing touched) when it failed or did not answer within the stage deadline. Not
  // journaled.
  std::optional<Pending<bool>> request_journaled{};
};

enum class PauseMode { kAbort, kWait, kKeep };
std::string_view PauseModeName(PauseMode m);

enum class CacheKind { kPrefix, kEncoder, kMultimodal };
std::string_view CacheKindName(CacheKind k);

// What the engine is and can do.
struct EngineDescription {
  std::string name;
  std::string kind;                      // "embedded", "http", "scripted", ...
  bool offers_content_digest = false;    // can report a content digest of live weights
  bool supports_staging = false;         // Stage() does work; otherwise a no-op
  std::vector<CacheKind> caches;         // caches that exist and must be reset on update
  bool offers_replay = false;            // EngineAdapter::Replay runs probes while paused
  double replay_tolerance = 1e-4;        // the engine's log-probability bound (replay.h)
  // The quantization the engine serves ("" = the weights as installed; the embedded engine's
  // --quantization, docs/fp8.md): replay compares only the probes computed under the same.
  std::string quantization = {};
  // Accept a tie for first place (replay.h): for engines whose kernels round differently from
  // the trainer's reference (vLLM bf16); exact-arithmetic engines (f32) leave it off.
  bool replay_accepts_ties = false;
  std::string version{};  // the engine's release as it reports it (vLLM: GET /version); "" when it reports none
};

// Engine-side work observed at one moment.
struct DrainStatus {
  int64_t running = 0;
  int64_t waiting = 0;
  bool idle() const { return running == 0 && waiting == 0; }
};

struct PauseEvidence {
  bool paused = false;   // read back from the engine after the pause call
  int64_t running = 0;   // requests still running after the pause
  Json detail = nullptr;  // what the adapter observed (pause reply, gauges, canary warm-up); journaled
};

struct StageEvidence {
  std::string label;       // the version staged
  int64_t bytes = 0;
  Json detail;             // plan and timing evidence from the engine
};

// Install evidence. An adapter whose install fails returns an error Status instead; by
// contract it returns FailedPrecondition ONLY when it knows nothing live was mutated (the
// engine refused up front). Every other error is treated as ambiguous: mutation may have begun.
// What an install did to the live weights, as the engine established it at the point where the
// first live byte is (or would have been) written — never inferred from an error code.
enum class InstallOutcome {
  kInstalled,            // every staged byte written and the label set
  kRefusedUntouched,     // refused before the first live byte: the old version is intact
  kFailedAfterMutation,  // failed after the first live byte: live weights may be partial
};
std::string_view InstallOutcomeName(InstallOutcome o);  // installed | refused_untouched | failed_after_mutation
std::optional<InstallOutcome> InstallOutcomeFromName(std::string_view name);

// An install the engine answered. An adapter that cannot tell what happened (the answer was lost,
// the engine did not say) returns an error instead: the outcome is then unknown, and the Runner
// treats it as mutated. Only an explicit kRefusedUntouched lets an update return to READY.
struct InstallEvidence {
  std::string label;       // the label the install path set
  int64_t bytes = 0;       // bytes written into live parameters
  Json detail;
  InstallOutcome outcome = InstallOutcome::kInstalled;
  std::string error{};     // why, when outcome is not kInstalled
};

// One cache reset. `success`: the engine accepted the reset and did not refuse it. `verified`:
// the engine's own reply proves the outcome (a success flag, freed/in-use block counts); an
// engine that answers an empty 200 (vLLM's reset_mm_cache / reset_encoder_cache) gives
// success = true, verified = false. The Controller requires success for every cache and
// verified for the prefix cache (stale prefix KV silently changes outputs, and every supported
// engine reports on it); other caches may pass unverified, and the journal says so
// ("verified": false, "unverified": [...]) — an unverified reset is never recorded as proven.
struct CacheResetResult {
  CacheKind kind = CacheKind::kPrefix;
  bool success = false;
  int64_t freed_blocks = 0;
  int64_t blocks_in_use = 0;
  bool verified = false;
  int64_t attempts = 1;  // reset calls the adapter made for this result (it may retry refusals)
  // Non-empty when the cache could not be cleared (success false) but every request that may read
  // it after the resume is kept apart from what the old weights computed, and how: vLLM in keep
  // mode, whose frozen requests hold their blocks, with every controller rollout's prefix blocks
  // keyed by its version (cache_salt; docs/vllm.md). The lifecycle accepts it as the reset of
  // that cache and journals it as it is (success false, isolation).
  std::string isolation{};
  bool done() const { return success || !isolation.empty(); }
};

struct LabelEvidence {
  std::string label;
  Json detail = nullptr;  // what else the adapter read (e.g. vLLM 0.33's own label); journaled with the validation
};

// An engine that serves a quantization of the weights (FP8, docs/fp8.md) reports the digest of the
// quantized image its kernels read (live) next to the one expected from the weights whose content
// digest it reports (expected); live is empty when the image has none (a replica disagreed: detail).
// When the version's trainer published its own parts of that image (docs/fp8.md, "The expected
// image, from the trainer"), the Runner adds their sum (published): the live image must equal it
// too, so the expected image does not rest on the engine's own computation.
struct QuantizedDigestEvidence {
  std::string quantization;  // e.g. fp8_per_block
  std::string live;
  std::string expected;
  std::string detail;        // the first mismatch, or why there is no live digest
  std::string published = {};  // the trainer's image for `quantization`; "" when the version has none
  bool Match() const { return !live.empty() && live == expected && (published.empty() || live == published); }
  // What does not match, for errors and taints: "the engine's Q image (LIVE) is not the
  // quantization of OF (EXPECTED)[: DETAIL]", "the engine's Q image has no consistent
  // digest[: DETAIL]" when there is no live digest, or, when the engine's own check holds but the
  // trainer's image differs, "the engine's Q image (LIVE) is its own quantization of OF but not the
  // image the trainer published (PUBLISHED): ...".
  std::string Mismatch(std::string_view of) const;
};

struct DigestEvidence {
  std::string content_digest;
  std::optional<QuantizedDigestEvidence> quantized = std::nullopt;
};

// Who the engine is right now, read cheaply (no digest is computed for it): what a controller
// compares with what it verified, to notice an engine that restarted (boot_id), had weights
// installed behind the controller's back (install_generation), or had its label changed.
// install_generation counts the engine's installs into live weights; it is not the controller's
// commit generation (WeightVersion::generation) and the two are never compared with each other.
struct IdentityEvidence {
  std::string boot_id;             // random per engine process; empty: the engine reports none
  std::string label;               // the label the engine reports now
  int64_t install_generation = -1; // -1: the engine reports none
  std::string content_digest;      // the engine's cached digest of the live weights; empty: none cached
  // Whether the engine is paused now (draining included); nullopt: it does not say. A READY
  // engine that is paused hangs every rollout admitted to it.
  std::optional<bool> paused;
};

struct ResumeEvidence {
  bool paused_after = true;  // read back: false means the engine generates again
  Json detail = nullptr;     // what the adapter observed (e.g. vLLM's post-reset canary); journaled
};

struct AbortEvidence {
  int64_t aborted = 0;
};

// Deadlines per operation, in milliseconds.
struct Deadlines {
  int64_t drain_ms = 2000;     // after this, the drain policy applies
  int64_t stage_ms = 60000;
  int64_t pause_ms = 500;
  int64_t install_ms = 1000;
  int64_t reset_ms = 500;
  int64_t validate_ms = 500;
  int64_t resume_ms = 500;
  int64_t poll_ms = 500;       // drain-status polls and other reads
};

enum class DrainPolicy {
  kWait,    // keep waiting for admitted rollouts to finish (never mutate under them)
  kAbort,   // after the drain deadline, abort stragglers on the engine and record them aborted
  kCancel,  // after the drain deadline, give the update up: READY on the old version
};
std::string_view DrainPolicyName(DrainPolicy p);
std::optional<DrainPolicy> DrainPolicyFromName(std::string_view name);

Json ToJson(const WeightVersion& v);
Json ToJson(const WeightIdentity& id);
Json ToJson(const RolloutBinding& b);
Json ToJson(const UpdateTarget& t);
Result<WeightIdentity> WeightIdentityFromJson(const Json& j, std::string_view path);
Result<UpdateTarget> UpdateTargetFromJson(const Json& j, std::string_view path);

}  // namespace rc::lifecycle
