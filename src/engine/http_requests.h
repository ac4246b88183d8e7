// The typed requests of the engine's HTTP routes (ENGINE_API.md, docs/engine.md "Endpoints"): one
// Parse… function per request body (and per query string that carries options), so a handler
// only acts on a value that is already checked. /v1/completions has its own parser
// (ParseCompletionRequest, http_server.h).
//
// Every function is pure (no engine, no I/O) and returns InvalidArgument whose message starts with
// the bad field ("timeout_ms: must be in [1, 3600000], got 0"; "request body: ..." for JSON that
// does not parse; "body: expected a JSON object, ..."); the handlers answer it as a 400 with that
// message. Policy checks that are not about the shape of the request (which directory an engine
// may stage from: 403) stay in the handlers.
//
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/status.h"
#include "rolloutcore/engine/engine.h"
#include "rolloutcore/receiver/receiver.h"

namespace rc::engine {

// Query parameters as cpp-httplib keeps them (httplib::Params): the first value of a name counts.
using QueryParams = std::multimap<std::string, std::string>;

// POST /pause?mode=abort|wait|keep (default abort; without mode, the deprecated
// wait_for_inflight_requests=true|false picks wait|abort) &clear_cache=bool
// &inflight_kv=recompute|keep (default recompute).
struct PauseQuery {
  PauseMode mode = PauseMode::kAbort;
  std::string mode_name = "abort";  // as the answer echoes it
  InFlightKv inflight_kv = InFlightKv::kRecompute;
  bool clear_cache = false;
};
Result<PauseQuery> ParsePauseQuery(const QueryParams& params);

// POST /sleep?level=0|1|2&mode=abort|wait|keep (vLLM's defaults: level 1, mode abort; the
// pause's own parameters, inflight_kv included, as for /pause). Level 2 (vLLM discards the
// weights) is refused: the embedded engine would not reload them on wake_up.
struct SleepQuery {
  int level = 1;
  PauseQuery pause;
};
Result<SleepQuery> ParseSleepQuery(const QueryParams& params);

// POST /reset_prefix_cache?reset_running_requests=bool (default false).
Result<bool> ParseResetPrefixCacheQuery(const QueryParams& params);
// GET /rc/weights/digest?fresh=bool (default false).
Result<bool> ParseDigestQuery(const QueryParams& params);

// POST /abort_requests {"request_ids": [str]}; an empty body, a missing or null list: all.
struct AbortRequestsBody {
  std::vector<std::string> request_ids;
};
Result<AbortRequestsBody> ParseAbortRequestsBody(std::string_view body);

// POST /update_weight_version {"new_version": str}.
struct UpdateWeightVersionBody {
  std::string new_version;
};
Result<UpdateWeightVersionBody> ParseUpdateWeightVersionBody(std::string_view body);

// POST /rc/refit/stage {"model", "version", "directory": str, "timeout_ms" (1..kMaxStageTimeoutMs,
// default StageRequest's), "use_relays": bool, "receiver_rank" (0..1000000)}.
Result<receiver::StageRequest> ParseStageBody(std::string_view body);

// POST /rc/refit/relay {"model", "version", "directory", "holder" (default: default_holder)}.
Result<receiver::RelayRequest> ParseRelayBody(std::string_view body, const std::string& default_holder);

// POST /rc/refit/install {"version": str, "skip_cache_reset": bool (default false)}.
struct InstallBody {
  std::string version;
  bool skip_cache_reset = false;
};
Result<InstallBody> ParseInstallBody(std::string_view body);

// POST /rc/validate/replay {"probe": str (optional), "prompt": [token id], "steps": int,
// "top_k": int (default 0)}; no other key. Ranges of steps and top_k are Engine::Replay's.
struct ReplayBody {
  std::string probe;
  std::vector<int32_t> prompt;
  int64_t steps = 0;
  int64_t top_k = 0;
};
Result<ReplayBody> ParseReplayBody(std::string_view body);

// POST /rc/fault (tests only): the whole fault set; a field left out is cleared, an empty body is {}.
inline constexpr int64_t kMaxFaultDelayMs = 600'000;
struct FaultBody {
  int64_t pause_delay_ms = 0;  // each delay 0..kMaxFaultDelayMs
  int64_t install_delay_ms = 0;
  int64_t reset_delay_ms = 0;
  int64_t digest_delay_ms = 0;
  int64_t resume_delay_ms = 0;
  bool refuse_install = false;
  bool fail_install_after_first_rank = false;
  bool corrupt_delta_install = false;
  bool corrupt_live_weight = false;  // one-shot action, not a lasting fault
  bool corrupt_previous_delta = false;  // one-shot: arms the next re-apply of the previous delta
  bool swap_q_heads = false;
  // One-shot: a fault of the FP8 image after the next install (Fp8Fault; "" = leave it as armed).
  std::string fp8_install = {};
};
Result<FaultBody> ParseFaultBody(std::string_view body);

}  // namespace rc::engine
