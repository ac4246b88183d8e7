// PlanStatsToJson: every PlanStats field under its own name, the one JSON form of a plan's
// statistics (what `rolloutcore plan --json` and the Python binding's plan() report per rank).
//
// Thread safety: a pure function.
#pragma once

#include "rolloutcore/base/json.h"
#include "rolloutcore/refit/planner.h"

namespace rc::refit {

Json PlanStatsToJson(const PlanStats& s);

}  // namespace rc::refit
