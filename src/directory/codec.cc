#include "directory/codec.h"

#include <fmt/format.h>

#include <charconv>

#include "directory/version_record.h"
#include "rolloutcore/base/content_digest.h"
#include "rolloutcore/base/hash.h"

namespace rc::directory::internal {
namespace {

std::string Field(std::string_view path, std::string_view key) {
  return path.empty() ? std::string(key) : fmt::format("{}.{}", path, key);
}

Result<uint64_t> GetDigest(const Json& obj, std::string_view key, std::string_view path) {
  RC_ASSIGN_OR_RETURN(std::string hex, GetString(obj, key, path, std::string(kZeroDigestHex)));
  return ContentDigest::ParseHex(hex, Field(path, key));
}

Result<VersionState> GetState(const Json& obj, std::string_view key, std::string_view path) {
  RC_ASSIGN_OR_RETURN(std::string s, GetString(obj, key, path));
  auto st = ParseVersionState(s);
  if (!st.ok()) return st.status().WithContext(Field(path, key));
  return *st;
}

Result<int32_t> GetInt32(const Json& obj, std::string_view key, std::string_view path, int64_t lo, int64_t hi,
                         std::optional<int64_t> dflt = std::nullopt) {
  RC_ASSIGN_OR_RETURN(int64_t v, GetInt(obj, key, path, dflt));
  if (v < lo || v > hi) {
    return InvalidArgument(fmt::format("{}: must be between {} and {}, got {}", Field(path, key), lo, hi, v));
  }
  return static_cast<int32_t>(v);
}

}  // namespace

Result<Json> ParseBoundedJson(std::string_view text, std::string_view what) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxJsonDepth) {
        return InvalidArgument(fmt::format("{} is nested deeper than {} levels", what, kMaxJsonDepth));
      }
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return ParseJson(text, what);
}

Result<int64_t> ParseDecimal(std::string_view text, std::string_view what, bool allow_negative) {
  int64_t v = 0;
  const char* begin = text.data();
  const char* end = text.data() + text.size();
  if (text.empty() || (!allow_negative && text[0] == '-')) {
    return InvalidArgument(fmt::format("{}: expected a non-negative decimal integer, got '{}'", what,
                                       text.substr(0, 64)));
  }
  auto [ptr, ec] = std::from_chars(begin, end, v, 10);
  if (ec != std::errc() || ptr != end) {
    return InvalidArgument(fmt::format("{}: expected a decimal integer, got '{}'", what, text.substr(0, 64)));
  }
  return v;
}

Result<int64_t> GetInt64Flexible(const Json& obj, std::string_view key, std::string_view path,
                                 std::optional<int64_t> dflt) {
  if (!obj.is_object()) return InvalidArgument(fmt::format("{}: expected an object around it", Field(path, key)));
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) {
    if (dflt) return *dflt;
    return InvalidArgument(fmt::format("{}: required field is missing", Field(path, key)));
  }
  if (it->is_string()) return ParseDecimal(it->get_ref<const std::string&>(), Field(path, key), true);
  return GetInt(obj, key, path);
}

Result<PublishRequest> ParsePublishBody(std::string_view body, std::string_view model, std::string_view version,
                                        int32_t rank) {
  RC_ASSIGN_OR_RETURN(Json j, ParseBoundedJson(body, "request body"));
  if (!j.is_object()) return InvalidArgument("request body: expected a JSON object, got " + JsonTypeName(j));
  RC_RETURN_IF_ERROR(
      CheckKnownKeys(j, {"expected_ranks", "lease_ttl_ms", "lease_id", "tensors", "probes", "digest"}, ""));
  PublishRequest r;
  r.model = std::string(model);
  r.version = std::string(version);
  r.rank = rank;
  RC_ASSIGN_OR_RETURN(r.expected_ranks, GetInt32(j, "expected_ranks", "", 1, kMaxExpectedRanks));
  RC_ASSIGN_OR_RETURN(r.lease_id, GetInt64Flexible(j, "lease_id", "", 0));
  RC_ASSIGN_OR_RETURN(r.lease_ttl_ms, GetInt(j, "lease_ttl_ms", "", 0));
  // Missing stays missing (empty): ValidatePublishRequest refuses it by name.
  RC_ASSIGN_OR_RETURN(r.digest_algorithm, GetString(j, "digest", "", std::string()));
  auto it = j.find("tensors");
  if (it == j.end()) return InvalidArgument("tensors: required field is missing");
  RC_ASSIGN_OR_RETURN(r.tables, TablesFromJson(*it));
  if (auto p = j.find("probes"); p != j.end()) {
    RC_ASSIGN_OR_RETURN(r.probes, refit::ProbesFromJson(*p));
  }
  RC_RETURN_IF_ERROR(ValidatePublishRequest(r));
  return r;
}

Result<std::string> ParseMarkUnavailableBody(std::string_view body) {
  RC_ASSIGN_OR_RETURN(Json j, ParseBoundedJson(body, "request body"));
  if (!j.is_object()) return InvalidArgument("request body: expected a JSON object, got " + JsonTypeName(j));
  RC_RETURN_IF_ERROR(CheckKnownKeys(j, {"reason"}, ""));
  auto it = j.find("reason");
  if (it == j.end()) return InvalidArgument("reason: required field is missing");
  if (!it->is_string()) return InvalidArgument("reason: expected a string, got " + JsonTypeName(*it));
  return it->get<std::string>();
}

Json PublishBodyToJson(const PublishRequest& r) {
  Json j{{"expected_ranks", r.expected_ranks}, {"digest", r.digest_algorithm}, {"tensors", TablesToJson(r.tables)}};
  if (!r.probes.empty()) j["probes"] = refit::ProbesToJson(r.probes);
  if (r.lease_id != 0) {
    j["lease_id"] = std::to_string(r.lease_id);
  } else {
    j["lease_ttl_ms"] = r.lease_ttl_ms;
  }
  return j;
}

Json PublishResultToJson(const PublishRequest& request, const PublishResult& r) {
  return Json{{"model", request.model},
              {"version", request.version},
              {"rank", request.rank},
              {"state", VersionStateName(r.state)},
              {"ranks_published", r.ranks_published},
              {"expected_ranks", r.expected_ranks},
              {"lease_id", std::to_string(r.lease_id)},
              {"lease_ttl_ms", r.lease_ttl_ms},
              {"commit_seq", r.commit_seq},
              {"content_digest", DigestHex(r.content_digest)}};
}

Result<PublishResult> PublishResultFromJson(const Json& j) {
  PublishResult r;
  RC_ASSIGN_OR_RETURN(r.state, GetState(j, "state", ""));
  RC_ASSIGN_OR_RETURN(r.ranks_published, GetInt32(j, "ranks_published", "", 0, kMaxExpectedRanks));
  RC_ASSIGN_OR_RETURN(r.expected_ranks, GetInt32(j, "expected_ranks", "", 0, kMaxExpectedRanks));
  RC_ASSIGN_OR_RETURN(r.lease_id, GetInt64Flexible(j, "lease_id", ""));
  RC_ASSIGN_OR_RETURN(r.lease_ttl_ms, GetNonNegativeInt(j, "lease_ttl_ms", ""));
  RC_ASSIGN_OR_RETURN(int64_t seq, GetNonNegativeInt(j, "commit_seq", "", 0));
  r.commit_seq = static_cast<uint64_t>(seq);
  RC_ASSIGN_OR_RETURN(r.content_digest, GetDigest(j, "content_digest", ""));
  return r;
}

Json LeaseInfoToJson(const LeaseInfo& lease) {
  return Json{{"lease_id", std::to_string(lease.lease_id)}, {"ttl_ms", lease.ttl_ms}};
}

Result<LeaseInfo> LeaseInfoFromJson(const Json& j) {
  LeaseInfo l;
  RC_ASSIGN_OR_RETURN(l.lease_id, GetInt64Flexible(j, "lease_id", ""));
  RC_ASSIGN_OR_RETURN(l.ttl_ms, GetNonNegativeInt(j, "ttl_ms", ""));
  return l;
}

Json VersionInfoToJson(const VersionInfo& v) {
  Json j{{"model", v.model},
         {"version", v.version},
         {"state", VersionStateName(v.state)},
         {"expected_ranks", v.expected_ranks},
         {"published_ranks", v.published_ranks},
         {"commit_seq", v.commit_seq},
         {"content_digest", DigestHex(v.content_digest)}};
  if (!v.reason.empty()) j["reason"] = v.reason;
  return j;
}

Result<VersionInfo> VersionInfoFromJson(const Json& j, std::string_view path) {
  VersionInfo v;
  RC_ASSIGN_OR_RETURN(v.model, GetString(j, "model", path));
  RC_ASSIGN_OR_RETURN(v.version, GetString(j, "version", path));
  RC_ASSIGN_OR_RETURN(v.state, GetState(j, "state", path));
  RC_ASSIGN_OR_RETURN(v.expected_ranks, GetInt32(j, "expected_ranks", path, 0, kMaxExpectedRanks));
  auto it = j.find("published_ranks");
  if (it == j.end() || !it->is_array()) {
    return InvalidArgument(Field(path, "published_ranks") + ": expected an array of integers");
  }
  for (const Json& r : *it) {
    if (!r.is_number_integer()) return InvalidArgument(Field(path, "published_ranks") + ": expected integers");
    v.published_ranks.push_back(r.get<int32_t>());
  }
  RC_ASSIGN_OR_RETURN(int64_t seq, GetNonNegativeInt(j, "commit_seq", path, 0));
  v.commit_seq = static_cast<uint64_t>(seq);
  RC_ASSIGN_OR_RETURN(v.content_digest, GetDigest(j, "content_digest", path));
  RC_ASSIGN_OR_RETURN(v.reason, GetString(j, "reason", path, std::string()));
  return v;
}

Json CommitEventToJson(const CommitEvent& e) {
  return Json{{"model", e.model}, {"version", e.version}, {"seq", e.seq}, {"content_digest", DigestHex(e.content_digest)}};
}

Result<CommitEvent> CommitEventFromJson(const Json& j, std::string_view path) {
  CommitEvent e;
  RC_ASSIGN_OR_RETURN(e.model, GetString(j, "model", path));
  RC_ASSIGN_OR_RETURN(e.version, GetString(j, "version", path));
  RC_ASSIGN_OR_RETURN(int64_t seq, GetNonNegativeInt(j, "seq", path));
  e.seq = static_cast<uint64_t>(seq);
  RC_ASSIGN_OR_RETURN(e.content_digest, GetDigest(j, "content_digest", path));
  return e;
}

Json ErrorToJson(const Status& status) {
  return Json{{"error", {{"code", StatusCodeName(status.code())}, {"message", status.message()}}}};
}

Status StatusFromErrorJson(const Json& j, int http_status) {
  if (j.is_object()) {
    auto it = j.find("error");
    if (it != j.end() && it->is_object()) {
      auto code = it->find("code");
      auto msg = it->find("message");
      if (code != it->end() && code->is_string() && msg != it->end() && msg->is_string()) {
        auto c = StatusCodeFromName(code->get_ref<const std::string&>());
        if (c && *c != StatusCode::kOk) return Status(*c, msg->get<std::string>());
      }
    }
  }
  return Internal(fmt::format("directory answered HTTP {} without a well-formed error body", http_status));
}

}  // namespace rc::directory::internal
