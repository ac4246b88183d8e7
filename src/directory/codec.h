// JSON forms of the directory's HTTP API (docs/directory.md), shared by the server and the client.
//
// Parsers take outside input and never throw or crash: they refuse bodies nested deeper than
// kMaxJsonDepth before parsing, and return InvalidArgument naming the field. 64-bit values that
// JSON readers commonly round (lease ids, digests) travel as strings: lease ids in decimal,
// digests as 16 hex digits; lease ids are also accepted as JSON integers.
//
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/json.h"
#include "rolloutcore/base/status.h"
#include "rolloutcore/directory/types.h"
#include "rolloutcore/net/http_status.h"

namespace rc::directory::internal {

inline constexpr int kMaxJsonDepth = 64;

// Parses text as JSON after checking its nesting depth; `what` names it in messages.
[[nodiscard]] Result<Json> ParseBoundedJson(std::string_view text, std::string_view what);

// Publish body: {"expected_ranks": N, "lease_ttl_ms": T, "lease_id": "ID", "tensors": [...]}.
// model, version and rank come from the URL. The request is validated (ValidatePublishRequest).
[[nodiscard]] Result<PublishRequest> ParsePublishBody(std::string_view body, std::string_view model,
                                                      std::string_view version, int32_t rank);
Json PublishBodyToJson(const PublishRequest& request);

// Mark-unavailable body: {"reason": "..."}; the reason's rules are checked by the store.
[[nodiscard]] Result<std::string> ParseMarkUnavailableBody(std::string_view body);

Json PublishResultToJson(const PublishRequest& request, const PublishResult& result);
[[nodiscard]] Result<PublishResult> PublishResultFromJson(const Json& j);

Json LeaseInfoToJson(const LeaseInfo& lease);
[[nodiscard]] Result<LeaseInfo> LeaseInfoFromJson(const Json& j);

Json VersionInfoToJson(const VersionInfo& info);
[[nodiscard]] Result<VersionInfo> VersionInfoFromJson(const Json& j, std::string_view path);

Json CommitEventToJson(const CommitEvent& event);
[[nodiscard]] Result<CommitEvent> CommitEventFromJson(const Json& j, std::string_view path);

// {"error": {"code": "NotFound", "message": "..."}}, and the Status it carries.
Json ErrorToJson(const Status& status);
Status StatusFromErrorJson(const Json& j, int http_status);
// The HTTP status of a Status, as every rolloutcore server maps it (rolloutcore/net/http_status.h).
using net::HttpStatusFor;

// Decimal int64 from a string or an integer field; `dflt` when missing.
[[nodiscard]] Result<int64_t> GetInt64Flexible(const Json& obj, std::string_view key, std::string_view path,
                                               std::optional<int64_t> dflt = std::nullopt);
// Parses a whole decimal int64 (no sign unless allow_negative); InvalidArgument naming `what`.
[[nodiscard]] Result<int64_t> ParseDecimal(std::string_view text, std::string_view what, bool allow_negative = false);

}  // namespace rc::directory::internal
