// The state the controller service's components share (internal to src/controller).
//
// ControllerService (service.h) is a thin front over three components, each owning one concern:
//   UpdateOrchestrator (update_orchestrator.h): the op queues, one driver thread per engine, the
//     update journal, update requests and their status;
//   RolloutAdmission (rollout_admission.h): admission, the rollout proxy, leases, version spans;
//   IdentityMonitor (identity_monitor.h): each engine's verified identity, its checks and taints.
// What they share lives in ServiceCore: the engines (one EngineSlot each), the options, the
// trajectory store and the one mutex `mu` with its condition variable. Each component guards
// its own fields with core->mu (GUARDED_BY(core_->mu)), so one lock orders all of them as the
// single service mutex did before the split.
//
// Thread safety: ServiceCore's fields are set at Create, before any thread starts, and read-only
// after, except `mu`/`cv`/`stop` and the EngineSlot fields marked below.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "rolloutcore/base/json.h"
#include "rolloutcore/base/mutex.h"
#include "rolloutcore/controller/service.h"
#include "rolloutcore/controller/trajectory_store.h"
#include "rolloutcore/lifecycle/controller.h"
#include "rolloutcore/lifecycle/runner.h"

namespace rc::controller {

// Milliseconds of the steady clock.
int64_t SteadyMs();
// "a; b; c".
std::string Join(const std::vector<std::string>& parts);
// The integers of a JSON array (anything else is skipped); empty for a non-array.
std::vector<int64_t> IntArray(const Json& j);

// One update or recovery queued on an engine.
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
  // guarded by ServiceCore::mu (these three: clang's analysis cannot name the owning core's
  // mutex from a struct reached through a pointer, so they stay unchecked)
  std::deque<Op> queue;
  std::string running_op;                     // guarded by ServiceCore::mu
  // A request being resolved (Enqueue) for this idle engine: the driver stages it ahead
  // (Runner::Prefetch) while the directory answers; its StartUpdate adopts that stage.
  std::optional<std::pair<std::string, std::string>> prefetch;  // {model, version}, guarded by mu
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
  bool holds_update_place = false;            // guarded by ServiceCore::mu
  // --auto-recover: when a queued recovery was refused (rollouts still active on the engine), the
  // steady-clock ms at which the driver asks again; -1: none pending.
  std::atomic<int64_t> auto_recover_retry_ms{-1};
  mutable rc::Mutex id_mu;
  VerifiedIdentity id GUARDED_BY(id_mu);                        // guarded by id_mu
  std::thread driver;
};

struct ServiceCore {
  VersionSource* versions = nullptr;
  ServiceOptions options;
  std::vector<std::unique_ptr<EngineSlot>> engines;
  std::unique_ptr<TrajectoryStore> trajectories;
  // The service's one mutex: every component's guarded fields and the slots' queue fields.
  mutable rc::Mutex mu;
  mutable rc::CondVar cv;
  std::atomic<bool> stop{false};
};

}  // namespace rc::controller
