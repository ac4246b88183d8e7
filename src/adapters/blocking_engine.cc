#include "rolloutcore/adapters/blocking_engine.h"

namespace rc::adapters {

using namespace lifecycle;  // NOLINT(google-build-using-namespace): the evidence types of every call

// Every call owns a shared_ptr to the engine: a call abandoned at its deadline keeps it alive.
Pending<DrainStatus> DetachedAdapter::GetDrainStatus() {
  return RunDetached<DrainStatus>([e = engine_] { return e->Drain(); });
}
Pending<PauseEvidence> DetachedAdapter::Pause(PauseMode mode) {
  return RunDetached<PauseEvidence>([e = engine_, mode] { return e->Pause(mode); });
}
Pending<PauseEvidence> DetachedAdapter::PauseForUpdate(PolicyMode mode) {
  return RunDetached<PauseEvidence>([e = engine_, mode] { return e->PauseForUpdate(mode); });
}
Pending<AbortEvidence> DetachedAdapter::AbortRequests(const std::vector<std::string>& rollout_ids) {
  return RunDetached<AbortEvidence>([e = engine_, rollout_ids] { return e->AbortRequests(rollout_ids); });
}
Pending<StageEvidence> DetachedAdapter::Stage(const UpdateTarget& target) {
  return RunDetached<StageEvidence>([e = engine_, target] { return e->Stage(target); });
}
Pending<InstallEvidence> DetachedAdapter::Install(const UpdateTarget& target, bool full) {
  return RunDetached<InstallEvidence>([e = engine_, target, full] { return e->Install(target, full); });
}
Pending<CacheResetResult> DetachedAdapter::ResetCache(CacheKind kind) {
  return RunDetached<CacheResetResult>([e = engine_, kind] { return e->ResetCache(kind); });
}
Pending<LabelEvidence> DetachedAdapter::ReadLabel() {
  return RunDetached<LabelEvidence>([e = engine_] { return e->ReadLabel(); });
}
Pending<DigestEvidence> DetachedAdapter::ReadContentDigest() {
  return RunDetached<DigestEvidence>([e = engine_] { return e->ReadContentDigest(); });
}
Pending<ResumeEvidence> DetachedAdapter::Resume() {
  return RunDetached<ResumeEvidence>([e = engine_] { return e->Resume(); });
}
Pending<ReplayEvidence> DetachedAdapter::Replay(const ReplayRequest& request) {
  return RunDetached<ReplayEvidence>([e = engine_, request] { return e->Replay(request); });
}
Pending<IdentityEvidence> DetachedAdapter::ProbeIdentity() {
  return RunDetached<IdentityEvidence>([e = engine_] { return e->ProbeIdentity(); });
}

}  // namespace rc::adapters
