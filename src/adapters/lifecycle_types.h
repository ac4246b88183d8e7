// The lifecycle types both engine adapters (embedded_adapter.cc, http_adapter.cc) take and answer
// with (rolloutcore/lifecycle/engine_adapter.h), named once for the adapters' sources.
//
// Internal to the adapters module; include only from its .cc files.
#pragma once

#include "rolloutcore/lifecycle/engine_adapter.h"

namespace rc::adapters {

using lifecycle::AbortEvidence;
using lifecycle::CacheKind;
using lifecycle::CacheResetResult;
using lifecycle::DigestEvidence;
using lifecycle::DrainStatus;
using lifecycle::EngineDescription;
using lifecycle::IdentityEvidence;
using lifecycle::InstallEvidence;
using lifecycle::LabelEvidence;
using lifecycle::PauseEvidence;
using lifecycle::PauseMode;
using lifecycle::ReplayEvidence;
using lifecycle::ReplayRequest;
using lifecycle::ReplayStep;
using lifecycle::ResumeEvidence;
using lifecycle::StageEvidence;
using lifecycle::UpdateTarget;

}  // namespace rc::adapters
