// IdentityMonitor: the engine-identity part of the controller service (docs/controller.md,
// "Engine identity"). It opens each engine's journal and lifecycle Controller (InitEngine),
// keeps the identity it verified per engine (EngineSlot::id), re-reads it when the driver asks
// (VerifyIdentity) and taints an engine whose identity moved behind the controller, queueing a
// recovery through `recover` with auto_recover.
//
// Thread safety: IdentityVerified, TaintForIdentity and IdentityJson may be called from any
// thread; InitEngine before the engine's driver starts, VerifyIdentity from its driver only.
#pragma once

#include <functional>
#include <string>

#include "controller/service_core.h"

namespace rc::controller {

class IdentityMonitor {
 public:
  // Queues a recovery of engine `engine` to (model, version); returns its update id.
  using RecoveryQueue =
      std::function<Result<std::string>(const std::string& model, const std::string& version, size_t engine)>;
  IdentityMonitor(ServiceCore* core, RecoveryQueue recover) : core_(core), recover_(std::move(recover)) {}

  // Opens the engine's journal and Controller (restored, or initialized from what the engine
  // serves) and checks the engine against the journal's claim.
  Status InitEngine(EngineSlot* slot, bool must_exist);
  bool IdentityVerified(const EngineSlot* slot) const;
  // Reads the engine's identity and checks it against the committed version and what was
  // verified before; taints on a mismatch. after_op: right after an operation ended (a committed
  // one may move the install generation; a committed recovery may also change the boot id).
  // claim: the first check of a (re)started controller, reading the digest when none is cached.
  void VerifyIdentity(EngineSlot* slot, bool after_op, bool claim);
  // Taints the engine for `reason` (ready_only: only from READY) or, when the state does not allow
  // it, records the reason as suspect for the check after the operation (not when the only reason
  // was a pause: only_paused); with auto_recover, queues a recovery to the committed version.
  void TaintForIdentity(EngineSlot* slot, const std::string& reason, bool ready_only = false,
                        bool only_paused = false);
  // --auto-recover: a recovery that was refused when queued (rollouts still active) is asked for
  // again once due, while the engine is TAINTED; the driver calls this on every pass.
  void RetryAutoRecovery(EngineSlot* slot);
  static constexpr int64_t kAutoRecoverRetryMs = 50;
  // The verified identity as /v1/status shows it ("engine_identity").
  static Json IdentityJson(const EngineSlot& slot);

 private:
  void QueueAutoRecovery(EngineSlot* slot);
  ServiceCore* const core_;
  const RecoveryQueue recover_;
};

}  // namespace rc::controller
