// ControllerService: the controller a user runs. One lifecycle (Controller + Runner + durable
// journal) per engine, a rollout proxy that binds every rollout to the committed generation it
// ran under, lease-mode admission for clients that talk to engines themselves, update and
// recovery requests resolved against the directory, a trajectory store and metrics.
//
// Threads: one driver thread per engine owns that engine's Runner (starts queued updates when
// at most `max_updating` engines are updating, polls every millisecond); an optional auto-update
// thread follows the directory's commits. Everything else (HTTP handlers) calls the thread-safe
// Controller API and the queues under mu_.
//
// Invariants: a rollout is sent to an engine only after its Controller admitted it (READY) and the
// engine's identity was verified; an update starts on an engine only from READY; engines update
// independently, at most max_updating at once, so the rest keep serving.
//
// Engine identity (docs/controller.md, "Engine identity"): the service keeps, per engine, the
// identity it verified (boot id, install generation) against the committed version (label,
// content digest). It is verified before anything is admitted (at start, and on a restart the
// journal's claim is checked against the engine), re-read every verify_interval_ms and right
// after every update or recovery, and compared with what every proxied completion reports. An
// engine that restarted (boot id), had weights installed behind the controller (install
// generation), reports another label or another digest is moved READY → TAINTED (then
// RECOVERING with auto_recover); a completion that does not match its binding is answered as an
// error (DataLoss), recorded failed with the reason, and never stored as a bound rollout.
// Invariants:
//  * A rollout is sent to an engine only after its Controller admitted it (READY).
//  * Its trajectory row is written BEFORE its finish is journaled, in both the proxy and the
//    lease path: a crash between the two leaves an admitted rollout without a finish record,
//    which the restart records interrupted (its row is kept); the other order would leave a
//    rollout finished in the journal whose output exists nowhere. A lease whose row could not be
//    written stays admitted (the client may retry the finish; the lease timeout ends it); a
//    proxied rollout whose row could not be written is finished with the failure in its journal
//    record ("trajectory_error").
//  * Rollout and lease ids match kRolloutIdPattern (checked at admission, InvalidArgument
//    naming rollout_id otherwise), so every admitted id can be named in a URL path.
//  * A lease not finished (or extended) within lease_timeout_ms of its admission or last
//    heartbeat is expired: a trajectory row with finish_reason "expired" is written, then its
//    binding is finished with {"expired": true} in the journal, so it stops holding a drain.
//  * An update starts on an engine only from READY; engines update independently, at most
//    max_updating at once, so the rest keep serving.
//  * A request for a version already being installed (an update of the same model and version
//    not yet done, in the same mode) returns that update's id; engines already READY on it are
//    not cycled again. In another mode it is refused (409 naming both modes).
//  * An update tainted on one engine stops: the engines it had not started on are not updated
//    (update_not_started, naming the taint), and a version whose validation failed (tainted from
//    VALIDATING) is marked failed in the update journal: later requests for it are refused.
//  * Leases an update ended (abort mode, max staleness) are ended at once: a row with
//    aborted_at_update, then the finish; their heartbeat and finish answer 409 naming the update,
//    and they hold no drain. A lease that lived through keep/recompute updates is finished with the
//    engine's version_spans the client passes on (checked as a proxied rollout's are; 400 and the
//    lease stays open when they do not hold), or, without them, a row that names the updates it
//    spanned and records no spans. An expired lease answers 409 from the moment it is due, also
//    while its row is written.
//    Update ids are journaled (updates.journal.db) before they are returned, so they survive a
//    restart and new ids continue after the highest.
//
// Thread safety: all public methods may be called from any thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "rolloutcore/base/json.h"
#include "rolloutcore/base/mutex.h"
#include "rolloutcore/controller/trajectory_store.h"
#include "rolloutcore/lifecycle/controller.h"
#include "rolloutcore/lifecycle/engine_adapter.h"
#include "rolloutcore/lifecycle/runner.h"

namespace rc::controller {

// One engine as the service sees it.
struct EngineHandle {
  std::string name;  // its URL, or "embedded"
  std::unique_ptr<lifecycle::EngineAdapter> adapter;
  // Generates one completion (OpenAI completions request body → response body).
  std::function<Result<Json>(const Json& body)> complete;
};

// Where committed versions come from (the directory).
class VersionSource {
 public:
  virtual ~VersionSource() = default;
  // The update target for a committed version: label = version, identity.content_digest = the
  // manifest's combined digest (16 hex digits), checkpoint = "model@version".
  virtual Result<lifecycle::UpdateTarget> Resolve(const std::string& model, const std::string& version) = 0;
  struct Commit {
    uint64_t seq = 0;
    std::string version;
  };
  // Commits after `after_seq`, waiting up to timeout_ms for one (empty on timeout).
  virtual Result<std::vector<Commit>> WaitForCommits(const std::string& model, uint64_t after_seq,
                                                     int64_t timeout_ms) = 0;
};

struct ServiceOptions {
  std::string state_dir;               // journals, the trajectory store and the marker live here
  lifecycle::RunnerOptions runner;
  int max_updating = 1;
  bool auto_update = false;
  std::string model;                   // the directory model followed by auto-update
  int64_t retry_after_s = 1;           // Retry-After for refused rollouts
  int64_t verify_interval_ms = 1000;   // periodic identity check of READY engines; 0: off
  bool auto_recover = false;           // after an identity taint, recover to the committed version
  // A lease not finished or extended within this many ms is expired; 0: leases never expire.
  int64_t lease_timeout_ms = 300000;
  // Policy mode of an update that does not name one (controller serve --update-mode).
  lifecycle::PolicyMode default_mode = lifecycle::PolicyMode::kStrict;
};

// The ids a rollout or lease may have: 1..128 of [A-Za-z0-9._-], not "." or "..", no "/".
inline constexpr const char* kRolloutIdPattern = "[A-Za-z0-9._-]{1,128} (not . or ..)";
// OK, or InvalidArgument naming `field` and the first offending character.
Status ValidateRolloutId(const std::string& id, const std::string& field = "rollout_id");

// The state dir marker (<state_dir>/rolloutcore-state.json), written once a controller has
// started over the dir. While it exists, Create opens the stores it names with must_exist: a
// journal or trajectory store that is missing, empty or fails SQLite's integrity check (or a
// journal whose record chain does not verify) makes Create fail with DataLoss naming the file.
std::string StateMarkerPath(const std::string& state_dir);
// The number of engines the marker records; -1 when there is no marker.
Result<int64_t> ReadStateMarker(const std::string& state_dir);
Status WriteStateMarker(const std::string& state_dir, int64_t engines);

class ControllerService {
 public:
  static Result<std::unique_ptr<ControllerService>> Create(std::vector<EngineHandle> engines, VersionSource* versions,
                                                           const ServiceOptions& options);
  ~ControllerService();
  ControllerService(const ControllerService&) = delete;
  ControllerService& operator=(const ControllerService&) = delete;

  // ---- Rollouts ----
  // Admits, generates on a READY engine and finishes; the answer is the engine's completion
  // plus "binding". Unavailable (retryable) when no engine is READY.
  Result<Json> Rollout(const Json& request);
  // A completion whose reported identity (label, boot id, install generation) does not match
  // the binding is DataLoss naming expected and reported values, and the engine is tainted.
  // Lease mode: a binding on some READY engine; the client generates and calls FinishLease.
  Result<Json> Admit(const std::string& rollout_id);
  // Writes the trajectory row, then journals the finish. NotFound for an unknown lease,
  // FailedPrecondition (409) for an expired one, and for one an update ended (naming the update;
  // its row says aborted_at_update and holds none of the output reported after it ended).
  // body: token_ids, prompt_token_ids, logprobs, finish_reason, cached_tokens, extra, and for a
  // lease that lived through an in-flight update the engine's version_spans (InvalidArgument when
  // they do not cover the tokens or name a version no update installed; the lease stays open).
  Status FinishLease(const std::string& rollout_id, const Json& body);
  // Extends a live lease by lease_timeout_ms from now; returns {rollout_id, expires_in_ms}.
  // FailedPrecondition (409) for an expired lease or one an update ended, as FinishLease.
  Result<Json> ExtendLease(const std::string& rollout_id);

  // ---- Updates ----
  // Queues an update of every engine to the committed (model, version); returns its id. `mode`
  // (default: options.default_mode) must be one every engine supports (FailedPrecondition naming
  // the engine and why otherwise, e.g. recompute on vLLM). FailedPrecondition (409) too for a
  // request that conflicts with an update of the same version still in progress in another mode
  // (naming both), and for a version that failed validation on an engine (naming the update, the
  // engine and why; retry_failed below): an update tainted on one engine is not rolled to the
  // others (docs/controller.md, "A failed update stops"). A recovery may name a failed version
  // (an explicit re-install, proven byte for byte).
  // retry_failed: the caller fixed what made the version fail (e.g. an engine fault) and asks for
  // it again: the mark is cleared (journaled version_retry) and the update proceeds.
  Result<std::string> RequestUpdate(const std::string& model, const std::string& version,
                                    std::optional<lifecycle::PolicyMode> mode = std::nullopt,
                                    bool retry_failed = false);
  // FailedPrecondition (HTTP 409) when no engine is TAINTED: there is nothing to recover.
  Result<std::string> RequestRecovery(const std::string& model, const std::string& version);
  Result<Json> UpdateStatus(const std::string& id) const;
  // Blocks until the update ended on every engine or timeout_ms passed.
  Result<Json> WaitForUpdate(const std::string& id, int64_t timeout_ms) const;

  // ---- Observation ----
  Json StatusJson() const;
  Result<Json> Journal(int64_t since, int engine) const;
  TrajectoryStore* trajectories() { return trajectories_.get(); }
  std::string Metrics() const;
  lifecycle::Controller* controller(size_t engine) { return engines_[engine]->controller.get(); }
  // Journal appends so far, the update journal and every engine's journal together (bench cycle).
  lifecycle::JournalAppendStats JournalAppendTotals() const;

 private:
  struct Op {
    std::string id;
    bool recovery = false;
    lifecycle::UpdateTarget target;
  };
  // The identity the service verified for one engine (guarded by EngineSlot::id_mu).
  struct VerifiedIdentity {
    bool verified = false;           // checked against the committed version; admissions need it
    std::string boot_id;             // empty: the engine reports none
    int64_t install_generation = -1; // -1: the engine reports none
    bool generation_settled = false; // false from the start of an operation to the check after it
    std::string suspect;             // a mismatch seen while the state did not allow tainting
    std::string last_error;          // last failed probe
    int64_t checked_wall_ms = 0;
    int64_t checks = 0;
    int64_t mismatches = 0;
  };
  struct EngineSlot {
    size_t index = 0;
    EngineHandle handle;
    std::unique_ptr<lifecycle::Journal> journal;
    std::unique_ptr<lifecycle::Controller> controller;
    std::unique_ptr<lifecycle::Runner> runner;  // touched only by the driver thread
    // guarded by ControllerService::mu_ (these three: clang's analysis cannot name the enclosing
    // object's mutex from a nested struct reached through a pointer, so they stay unchecked)
    std::deque<Op> queue;
    std::string running_op;                     // guarded by ControllerService::mu_
    // A request being resolved (Enqueue) for this idle engine: the driver stages it ahead
    // (Runner::Prefetch) while the directory answers; its StartUpdate adopts that stage.
    std::optional<std::pair<std::string, std::string>> prefetch;  // {model, version}, guarded by mu_
    bool running_recovery = false;              // driver thread only
    int64_t generation_before_op = 0;           // driver thread only
    int64_t next_verify_ms = 0;                 // driver thread only (steady clock)
    bool after_op_pending = false;              // driver thread only: the post-operation check is due
    // Set when an operation starts, cleared once its post-operation identity check ran: the
    // operation's end makes the engine READY before that check re-reads its identity (a recovery
    // changes the boot id), and nothing may be admitted against the identity verified before it.
    std::atomic<bool> settling{false};
    // The operation's place among --max-updating, held from its start until it settled (the
    // engine admits nothing before that, so it counts as out of service).
    bool holds_update_place = false;            // guarded by ControllerService::mu_
    mutable rc::Mutex id_mu;
    VerifiedIdentity id GUARDED_BY(id_mu);                        // guarded by id_mu
    std::thread driver;
  };
  struct OpRecord {
    std::string id;
    std::string model;
    std::string version;
    bool recovery = false;
    lifecycle::PolicyMode mode = lifecycle::PolicyMode::kStrict;
    std::string stopped;                   // why it stopped rolling (a taint on one engine); "" while not
    std::map<size_t, int64_t> ordinals;  // engine → ordinal once started
    std::map<size_t, std::string> errors;  // engine → why it did not start
    std::set<size_t> already_live;         // engines READY on the version when it was requested
    int64_t requested_wall_ms = 0;
    std::optional<size_t> only;            // the one engine it is for (an auto-recovery); else all
  };
  struct Lease {
    size_t engine = 0;
    int64_t admitted_wall_ms = 0;
    int64_t expires_ms = 0;  // steady clock; 0: never
    bool row_written = false;  // the trajectory row exists; only the finish record is missing
    lifecycle::RolloutBinding binding;  // as admitted (the row of a lease the drain aborted needs it)
  };

  ControllerService() = default;
  Status InitEngine(EngineSlot* slot, bool must_exist);
  void Drive(EngineSlot* slot);
  void FollowDirectory();
  // Queues on every engine, or only on engine `only` when given.
  Result<std::string> Enqueue(const std::string& model, const std::string& version, bool recovery,
                              std::optional<size_t> only = std::nullopt,
                              lifecycle::PolicyMode mode = lifecycle::PolicyMode::kStrict, bool retry_failed = false);
  // Policy modes (service_spans.cc): the trajectory's version spans from the engine's per-choice
  // spans, each mapped to the controller's version (label, generation, digest, update ordinal).
  // Empty `why` when they are consistent with the binding and the in-flight record; else why not.
  // `inflight`: the in-flight record of the rollout (nullptr when no in-flight update touched it:
  // then every span must carry the binding's label). A span with swap_index_reported (the tokens
  // the engine's worker counted when the update paused the request) must start there.
  Json VersionSpans(EngineSlot* slot, const lifecycle::RolloutBinding& binding, const Json& choice,
                    int64_t output_tokens, const lifecycle::InFlightRecord* inflight, std::string* why) const;
  // For a rollout an in-flight update touched: checks the answer-time identity against the
  // labels it may have (CompletionMismatch checks those only for rollouts no update touched) and
  // returns the response with those fields moved under "rolloutcore_inflight" for that check.
  Json InFlightAdjusted(EngineSlot* slot, const Json& resp, int64_t admitted_install_generation,
                        const lifecycle::RolloutBinding& binding, const lifecycle::InFlightRecord& inflight,
                        std::string* why) const;
  void CountSpanTokens(const Json& spans);
  Result<std::pair<size_t, lifecycle::RolloutBinding>> AdmitSomewhere(const std::string& rollout_id,
                                                                      bool lease = false);
  Json OpJson(const OpRecord& rec) const REQUIRES(mu_);
  // Reads the engine's identity and checks it against the committed version and what was
  // verified before; taints on a mismatch. after_op: right after an operation ended (a committed
  // one may move the install generation; a committed recovery may also change the boot id).
  // claim: the first check of a (re)started controller, reading the digest when none is cached.
  void VerifyIdentity(EngineSlot* slot, bool after_op, bool claim);
  // Taints a READY engine for `reason` (or records it as suspect when the state does not allow
  // it) and, with auto_recover, queues a recovery to the committed version.
  void TaintForIdentity(EngineSlot* slot, const std::string& reason);
  // Empty when the completion matches the binding and the verified identity; else why not.
  std::string CompletionMismatch(EngineSlot* slot, const lifecycle::RolloutBinding& binding, const Json& resp) const;
  bool IdentityVerified(const EngineSlot* slot) const;
  // Journals an update-id event (update_requested / update_started / update_not_started).
  Status JournalOpLocked(const std::string& event, Json detail) REQUIRES(mu_);
  // Withdraws the stage-ahead requests for `version` that no driver took yet (its request was
  // refused or answered without a new op).
  void DropPrefetchLocked(const std::string& version) REQUIRES(mu_);
  Status RestoreOps();  // at Create, before the drivers start
  // Leases of `engine` past their deadline: closed for the client at once (expired_leases_), then
  // recorded (row, then finish; retried while that fails).
  void ExpireLeases(size_t engine);
  // Leases of `engine` that an update ended (Controller::LeasesEndedByUpdate): closed for the
  // client at once (ended_leases_), then recorded as EndLeaseForUpdate does.
  void EndLeasesOfUpdates(size_t engine);
  // Row (aborted_at_update = why), then the finish. OK when both are recorded.
  Status RecordLeaseEndedByUpdate(EngineSlot* slot, const std::string& rollout_id, const Lease& lease,
                                  const Json& why);
  // The 409 a client gets for a lease closed by expiry or by an update; nullopt when it is not.
  std::optional<Status> ClosedLeaseStatusLocked(const std::string& rollout_id) const REQUIRES(mu_);
  // After an operation ended on `slot`: a tainted update stops rolling (see the class comment).
  void StopOpIfTaintedLocked(EngineSlot* slot, const std::string& op_id) REQUIRES(mu_);
  static std::string VersionKey(const std::string& model, const std::string& version) {
    return model + '\n' + version;
  }

  VersionSource* versions_ = nullptr;
  ServiceOptions options_;
  std::vector<std::unique_ptr<EngineSlot>> engines_;
  std::unique_ptr<TrajectoryStore> trajectories_;

  mutable rc::Mutex mu_;
  mutable rc::CondVar cv_;
  std::map<std::string, OpRecord> ops_ GUARDED_BY(mu_);                       // guarded by mu_
  std::unique_ptr<lifecycle::Journal> ops_journal_;           // appends under mu_
  std::map<std::string, Lease> leases_ GUARDED_BY(mu_);       // rollout → lease, guarded by mu_
  std::map<std::string, int64_t> expired_leases_ GUARDED_BY(mu_);  // rollout → wall ms, guarded by mu_
  // Leases closed for the client but not yet recorded (row + finish), retried by the driver.
  struct Closing {
    Lease lease;
    Json why;  // aborted_at_update; null: expired
  };
  std::map<std::string, Closing> closing_leases_ GUARDED_BY(mu_);  // guarded by mu_
  std::map<std::string, Json> ended_leases_ GUARDED_BY(mu_);  // rollout → aborted_at_update, guarded by mu_
  std::atomic<int64_t> open_leases_{0};  // leases_.size() + closing_leases_.size(), read without mu_
  std::atomic<int64_t> closing_leases_pending_{0};  // closing_leases_.size(), read without mu_
  // Versions whose validation failed on an engine (VersionKey → why), from the update journal.
  std::map<std::string, std::string> failed_versions_ GUARDED_BY(mu_);  // guarded by mu_
  int updating_ GUARDED_BY(mu_) = 0;                                          // guarded by mu_
  int64_t next_op_ GUARDED_BY(mu_) = 1;                                       // guarded by mu_
  std::atomic<int64_t> next_rollout_{1};
  std::atomic<size_t> round_robin_{0};
  std::atomic<bool> stop_{false};
  std::thread follower_;
  std::atomic<int64_t> rollouts_ok_{0};
  std::atomic<int64_t> rollouts_refused_{0};
  std::atomic<int64_t> rollouts_failed_{0};
  std::atomic<int64_t> rollouts_mismatched_{0};
  std::map<std::string, int64_t> tokens_by_kv_ GUARDED_BY(mu_);   // guarded by mu_: proxied output tokens per span kv
};

}  // namespace rc::controller
