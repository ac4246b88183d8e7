// ControllerService: the controller a user runs. One lifecycle (Controller + Runner + durable
// journal) per engine, a rollout proxy that binds every rollout to the committed generation it
// ran under, lease-mode admission for clients that talk to engines themselves, update and
// recovery requests resolved against the directory, a trajectory store and metrics.
//
// Structure: this class is a thin front over three internal components (src/controller):
// UpdateOrchestrator (update_orchestrator.h: op queues, drivers, update journal, update status),
// RolloutAdmission (rollout_admission.h: admission, the rollout proxy, leases, version spans) and
// IdentityMonitor (identity_monitor.h: engine identity checks and taints), sharing one
// ServiceCore (service_core.h: the engines, the options, the one mutex).
//
// Threads: one driver thread per engine owns that engine's Runner (starts queued updates when
// at most `max_updating` engines are updating, polls every millisecond); an optional auto-update
// thread follows the directory's commits. Everything else (HTTP handlers) calls the thread-safe
// Controller API and the queues under the service's one mutex.
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

// The internal components of the service (src/controller).
struct ServiceCore;
class IdentityMonitor;
class RolloutAdmission;
class UpdateOrchestrator;

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
  TrajectoryStore* trajectories();
  std::string Metrics() const;
  lifecycle::Controller* controller(size_t engine);
  // Journal appends so far, the update journal and every engine's journal together (bench cycle).
  lifecycle::JournalAppendStats JournalAppendTotals() const;

 private:
  ControllerService();

  // The three components behind this front (src/controller; service_core.h describes them) and
  // the state they share. Declared in that order: destroyed orchestrator first (its threads are
  // joined in ~ControllerService before anything is destroyed).
  std::unique_ptr<ServiceCore> core_;
  std::unique_ptr<IdentityMonitor> identity_;
  std::unique_ptr<RolloutAdmission> admission_;
  std::unique_ptr<UpdateOrchestrator> updates_;
};

}  // namespace rc::controller
