#include "rolloutcore/refit/plan_stats_json.h"

namespace rc::refit {

// to_json / from_json of every PlanStats field under its own name.
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(PlanStats, copies, selected_copies, bytes_needed, bytes_planned, descriptors,
                                   full_pulls, full_pull_bytes, converted_copies, staging_bytes, source_shards,
                                   dest_bytes, dest_bytes_selected, plan_ms)

Json PlanStatsToJson(const PlanStats& s) { return Json(s); }

}  // namespace rc::refit
