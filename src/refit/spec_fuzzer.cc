// libFuzzer target for the `plan --spec` path: parse arbitrary bytes as a plan spec, capture,
// plan, and (for small specs) execute through `local` and compare with the direct reference load.
// Any crash, sanitizer report or leak is a bug; refusals are fine.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "rolloutcore/refit/planner.h"
#include "rolloutcore/refit/spec.h"
#include "rolloutcore/refit/verify.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace rc::refit;
  auto spec = ParsePlanSpecText(std::string_view(reinterpret_cast<const char*>(data), size));
  if (!spec.ok()) return 0;
  auto capture = CaptureSpec(*spec);
  if (!capture.ok()) return 0;
  PlanOptions options;
  options.max_descriptors = int64_t{1} << 16;
  options.descriptor_budget = size % 2 == 0 ? 64 : 1;
  auto plan = BuildPlan(*capture, SpecManifest(*spec), options);
  if (!plan.ok()) return 0;
  VerifyOptions v;
  v.max_bytes = uint64_t{1} << 20;
  v.plan = options;
  auto report = Verify(SpecVerifyProblem(*spec), v);
  if (report.ok() && !report->verified()) __builtin_trap();  // a plan that passed the gate must be exact
  return 0;
}
