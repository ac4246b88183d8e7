// libFuzzer target: scenario files (outside input) through the JSON parser, the scenario parser
// and — for scenarios short enough to run quickly — the simulator itself.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "rolloutcore/base/json.h"
#include "rolloutcore/lifecycle/simulator.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto json = rc::ParseJson(std::string_view(reinterpret_cast<const char*>(data), size), "scenario");
  if (!json.ok()) return 0;
  if (!rc::lifecycle::ValidateScenario(*json).ok()) return 0;
  // Keep each run short: only simulate scenarios whose events end within 2 s of virtual time
  // and whose operations are quick.
  std::string text = json->dump();
  if (text.size() > 4096) return 0;
  int64_t horizon = 0;
  if (json->contains("events") && (*json)["events"].is_array()) {
    for (const auto& e : (*json)["events"]) {
      if (e.is_object() && e.contains("at_ms") && e["at_ms"].is_number_integer()) {
        horizon = std::max<int64_t>(horizon, e["at_ms"].get<int64_t>());
      }
      if (e.is_object() && e.contains("duration_ms") && e["duration_ms"].is_number_integer()) {
        horizon = std::max<int64_t>(horizon, e["duration_ms"].get<int64_t>());
      }
    }
  }
  if (horizon > 2000 || json->contains("deadlines_ms") || json->contains("journal")) return 0;
  auto report = rc::lifecycle::RunScenario(*json);
  (void)report;
  return 0;
}
