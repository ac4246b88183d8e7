// RolloutAdmission: rollout admission and leases in the controller service. It admits a rollout
// on a READY, verified, settled engine (round robin), proxies it (Rollout) and records it — row
// first, then the finish (service.h) — checking the completion against its binding and, for a
// rollout an in-flight update touched, its version spans (rollout_checks.cc). In lease mode it
// keeps the leases (rollout_leases.cc): admission, heartbeat, finish, expiry, and the leases an
// update ended, which the driver sweeps (SweepLeases).
//
// Thread safety: every public method may be called from any thread; SweepLeases from the
// engine's driver. Its maps are guarded by the service's one mutex (ServiceCore::mu).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>

#include "controller/identity_monitor.h"
#include "controller/service_core.h"

namespace rc::controller {

class RolloutAdmission {
 public:
  RolloutAdmission(ServiceCore* core, IdentityMonitor* identity) : core_(core), identity_(identity) {}

  // ControllerService's rollout API (service.h).
  Result<Json> Rollout(const Json& request);
  Result<Json> Admit(const std::string& rollout_id);
  Status FinishLease(const std::string& rollout_id, const Json& body);
  Result<Json> ExtendLease(const std::string& rollout_id) EXCLUDES(core_->mu);

  // The driver's lease sweep of one engine, state kept between its passes.
  struct LeaseSweep {
    int64_t next_expiry_check = 0;
    lifecycle::State last_sweep_state = lifecycle::State::kUninitialized;  // sweep once at start
  };
  // Closes and records the leases of `slot` that an update ended or that expired.
  void SweepLeases(EngineSlot* slot, LeaseSweep* sweep);

  // Proxied rollouts by result, for /v1/status and /metrics.
  struct Counts {
    int64_t ok = 0;
    int64_t refused = 0;
    int64_t failed = 0;
    int64_t identity_mismatch = 0;
  };
  Counts counts() const;
  // Proxied output tokens per span kv (fresh | stale | recomputed).
  std::map<std::string, int64_t> TokensByKv() const EXCLUDES(core_->mu);

 private:
  struct Lease {
    size_t engine = 0;
    int64_t admitted_wall_ms = 0;
    int64_t expires_ms = 0;  // steady clock; 0: never
    bool row_written = false;  // the trajectory row exists; only the finish record is missing
    lifecycle::RolloutBinding binding;  // as admitted (the row of a lease the drain aborted needs it)
    // The engine's taint count (Counters::taints) read before the admission: a finish that finds
    // it moved knows the engine was tainted while the lease was open.
    int64_t taints_at_admission = 0;
  };
  // Leases closed for the client but not yet recorded (row + finish), retried by the driver.
  struct Closing {
    Lease lease;
    Json why;  // aborted_at_update; null: expired
  };

  Result<std::pair<size_t, lifecycle::RolloutBinding>> AdmitSomewhere(const std::string& rollout_id,
                                                                      bool lease = false);
  // "ro-<wall ms>-<n>": the id of a rollout that names none.
  std::string NewRolloutId();
  // The engine's request body for a rollout request (one prompt, no stream, n 1); names the
  // rollout (a new id when the request names none).
  Result<Json> RolloutBody(const Json& request, std::string* rollout_id);
  // A rollout whose completion failed: row, then the finish; returns the error.
  Status RecordFailedRollout(EngineSlot* slot, const std::string& rollout_id, const Status& error, Trajectory t,
                             Json finish_detail);
  // A completion that does not match its binding: recorded failed, the engine tainted; DataLoss.
  Status RecordMismatchedRollout(EngineSlot* slot, const std::string& rollout_id, const Json& resp,
                                 const std::string& mismatch, Trajectory t, Json finish_detail);
  // Row, then the finish of a rollout that completed; the answer is the completion plus binding.
  Result<Json> FinishRollout(EngineSlot* slot, const std::string& rollout_id, const lifecycle::RolloutBinding& binding,
                             Json resp, const Trajectory& t, Json finish_detail);

  // Policy modes (rollout_checks.cc): the trajectory's version spans from the engine's per-choice
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
  void CountSpanTokens(const Json& spans) EXCLUDES(core_->mu);
  // Empty when the completion matches the binding and the verified identity; else why not.
  std::string CompletionMismatch(EngineSlot* slot, const lifecycle::RolloutBinding& binding, const Json& resp) const;

  // Leases of `engine` past their deadline: closed for the client at once (expired_leases_), then
  // recorded (row, then finish; retried while that fails).
  void ExpireLeases(size_t engine) EXCLUDES(core_->mu);
  // Leases of `engine` that an update ended (Controller::LeasesEndedByUpdate): closed for the
  // client at once (ended_leases_), then recorded as EndLeaseForUpdate does.
  void EndLeasesOfUpdates(size_t engine) EXCLUDES(core_->mu);
  // Row (aborted_at_update = why), then the finish. OK when both are recorded.
  Status RecordLeaseEndedByUpdate(EngineSlot* slot, const std::string& rollout_id, const Lease& lease,
                                  const Json& why);
  // The finish of a lease that lived through in-flight updates: its spanned updates and the
  // client's version spans (checked); InvalidArgument when they do not hold.
  Status AddLeaseSpans(EngineSlot* slot, const std::string& rollout_id, const lifecycle::RolloutBinding& binding,
                       const Json& body, Trajectory* t, Json* finish_detail);
  // The 409 a client gets for a lease closed by expiry or by an update; nullopt when it is not.
  std::optional<Status> ClosedLeaseStatusLocked(const std::string& rollout_id) const REQUIRES(core_->mu);
  // open_leases_ and closing_leases_pending_ from the maps.
  void PublishLeaseCountsLocked() REQUIRES(core_->mu);

  ServiceCore* const core_;
  IdentityMonitor* const identity_;

  std::map<std::string, Lease> leases_ GUARDED_BY(core_->mu);       // rollout → lease, guarded by mu
  std::map<std::string, int64_t> expired_leases_ GUARDED_BY(core_->mu);  // rollout → wall ms, guarded by mu
  std::map<std::string, Closing> closing_leases_ GUARDED_BY(core_->mu);  // guarded by mu
  std::map<std::string, Json> ended_leases_ GUARDED_BY(core_->mu);  // rollout → aborted_at_update, guarded by mu
  std::atomic<int64_t> open_leases_{0};  // leases_.size() + closing_leases_.size(), read without mu
  std::atomic<int64_t> closing_leases_pending_{0};  // closing_leases_.size(), read without mu
  std::atomic<int64_t> next_rollout_{1};
  std::atomic<size_t> round_robin_{0};
  std::atomic<int64_t> rollouts_ok_{0};
  std::atomic<int64_t> rollouts_refused_{0};
  std::atomic<int64_t> rollouts_failed_{0};
  std::atomic<int64_t> rollouts_mismatched_{0};
  // guarded by mu: proxied output tokens per span kv
  std::map<std::string, int64_t> tokens_by_kv_ GUARDED_BY(core_->mu);
};

}  // namespace rc::controller
