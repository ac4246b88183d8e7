#include "directory/api.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <vector>

#include "directory/codec.h"

namespace rc::directory::internal {
namespace {

// Messages may quote outside input that is not UTF-8; replace such bytes rather than throw.
std::string Dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

ApiResponse Ok(const Json& j) { return ApiResponse{200, Dump(j), {}}; }

ApiResponse Error(const Status& s) { return ApiResponse{HttpStatusFor(s), Dump(ErrorToJson(s)), {}}; }

std::vector<std::string_view> SplitPath(std::string_view path) {
  std::vector<std::string_view> parts;
  size_t i = 0;
  while (i < path.size()) {
    if (path[i] == '/') {
      ++i;
      continue;
    }
    const size_t j = path.find('/', i);
    const size_t end = j == std::string_view::npos ? path.size() : j;
    parts.push_back(path.substr(i, end - i));
    i = end;
  }
  return parts;
}

Result<std::string> QueryParam(const ApiRequest& r, const std::string& key, std::string dflt) {
  auto range = r.query.equal_range(key);
  if (range.first == range.second) return dflt;
  if (std::next(range.first) != range.second) return InvalidArgument(fmt::format("{}: given more than once", key));
  return range.first->second;
}

ApiResponse MethodNotAllowed(const ApiRequest& r, std::string_view allowed) {
  return ApiResponse{405,
                     Dump(ErrorToJson(Status(StatusCode::kInvalidArgument,
                                             fmt::format("method {} is not allowed on {} (allowed: {})",
                                                         r.method.substr(0, 16), r.path.substr(0, 256), allowed)))),
                     std::string(allowed)};
}

Result<Json> HandleCommits(DirectoryStore& store, std::string_view model, const ApiRequest& r,
                           const ApiLimits& limits, const std::atomic<bool>* stopping) {
  RC_RETURN_IF_ERROR(ValidateName(model, "model"));
  RC_ASSIGN_OR_RETURN(std::string after_text, QueryParam(r, "after", "0"));
  RC_ASSIGN_OR_RETURN(int64_t after, ParseDecimal(after_text, "after"));
  RC_ASSIGN_OR_RETURN(std::string timeout_text, QueryParam(r, "timeout_ms", "0"));
  RC_ASSIGN_OR_RETURN(int64_t timeout_ms, ParseDecimal(timeout_text, "timeout_ms"));
  if (timeout_ms > limits.max_wait_ms) {
    return InvalidArgument(fmt::format("timeout_ms: at most {} allowed, got {}", limits.max_wait_ms, timeout_ms));
  }
  // Wait in slices so that a stopping server answers its long-polls promptly.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  std::vector<CommitEvent> events;
  while (true) {
    const int64_t left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    RC_ASSIGN_OR_RETURN(events, store.WaitForCommits(model, static_cast<uint64_t>(after),
                                                     std::clamp<int64_t>(left, 0, limits.wait_slice_ms)));
    if (!events.empty() || left <= limits.wait_slice_ms || (stopping && stopping->load())) break;
  }
  Json list = Json::array();
  uint64_t last = static_cast<uint64_t>(after);
  for (const CommitEvent& e : events) {
    list.push_back(CommitEventToJson(e));
    last = std::max(last, e.seq);
  }
  return Json{{"model", model}, {"commits", list}, {"last_seq", last}};
}

Result<Json> Dispatch(DirectoryStore& store, const ApiRequest& r, const ApiLimits& limits,
                      const std::atomic<bool>* stopping, bool* method_ok, std::string* allowed) {
  *method_ok = true;
  const std::vector<std::string_view> p = SplitPath(r.path);
  auto expect = [&](std::string_view method) {
    if (r.method == method) return true;
    *method_ok = false;
    *allowed = std::string(method);
    return false;
  };
  if (p.size() == 1 && p[0] == "health") {
    if (!expect("GET")) return Json();
    return Json{{"status", "ok"}, {"store", limits.store_kind}};
  }
  if (p.size() == 3 && p[0] == "v1" && p[1] == "leases") {
    constexpr std::string_view kSuffix = ":keepalive";
    if (!p[2].ends_with(kSuffix)) return NotFound(fmt::format("no such endpoint: {}", r.path.substr(0, 256)));
    if (!expect("POST")) return Json();
    RC_ASSIGN_OR_RETURN(int64_t id, ParseDecimal(p[2].substr(0, p[2].size() - kSuffix.size()), "lease id"));
    RC_ASSIGN_OR_RETURN(LeaseInfo lease, store.KeepAlive(id));
    return LeaseInfoToJson(lease);
  }
  if (p.size() >= 4 && p[0] == "v1" && p[1] == "models") {
    const std::string_view model = p[2];
    RC_RETURN_IF_ERROR(ValidateName(model, "model"));
    if (p.size() == 4 && p[3] == "commits") {
      if (!expect("GET")) return Json();
      return HandleCommits(store, model, r, limits, stopping);
    }
    if (p[3] != "versions") return NotFound(fmt::format("no such endpoint: {}", r.path.substr(0, 256)));
    if (p.size() == 4) {
      if (!expect("GET")) return Json();
      RC_ASSIGN_OR_RETURN(std::string state, QueryParam(r, "state", "committed"));
      RC_ASSIGN_OR_RETURN(StateFilter filter, ParseStateFilter(state));
      RC_ASSIGN_OR_RETURN(std::vector<VersionInfo> infos, store.List(model, filter));
      Json list = Json::array();
      for (const VersionInfo& v : infos) list.push_back(VersionInfoToJson(v));
      return Json{{"model", model}, {"versions", list}};
    }
    const std::string_view version = p[4];
    RC_RETURN_IF_ERROR(ValidateName(version, "version"));
    if (p.size() == 5) {
      if (r.method == "GET") {
        RC_ASSIGN_OR_RETURN(refit::Manifest m, store.Get(model, version));
        RC_ASSIGN_OR_RETURN(VersionInfo info, store.GetInfo(model, version));
        return Json{{"commit_seq", info.commit_seq}, {"manifest", refit::ManifestToJson(m)}};
      }
      if (r.method == "DELETE") {
        RC_RETURN_IF_ERROR(store.Release(model, version));
        return Json{{"model", model}, {"version", version}, {"released", true}};
      }
      *method_ok = false;
      *allowed = "GET, DELETE";
      return Json();
    }
    if (p.size() == 6 && p[5] == "unavailable") {
      if (!expect("POST")) return Json();
      RC_ASSIGN_OR_RETURN(std::string reason, ParseMarkUnavailableBody(r.body));
      RC_RETURN_IF_ERROR(store.MarkUnavailable(model, version, reason));
      RC_ASSIGN_OR_RETURN(VersionInfo info, store.GetInfo(model, version));
      return VersionInfoToJson(info);
    }
    if (p.size() == 6 && p[5] == "status") {
      if (!expect("GET")) return Json();
      RC_ASSIGN_OR_RETURN(VersionInfo info, store.GetInfo(model, version));
      return VersionInfoToJson(info);
    }
    if (p.size() == 7 && p[5] == "ranks") {
      if (!expect("POST")) return Json();
      RC_ASSIGN_OR_RETURN(int64_t rank, ParseDecimal(p[6], "rank"));
      if (rank >= kMaxExpectedRanks) {
        return InvalidArgument(fmt::format("rank: {} is out of range (at most {} ranks)", rank, kMaxExpectedRanks));
      }
      RC_ASSIGN_OR_RETURN(PublishRequest req, ParsePublishBody(r.body, model, version, static_cast<int32_t>(rank)));
      RC_ASSIGN_OR_RETURN(PublishResult res, store.Publish(req));
      return PublishResultToJson(req, res);
    }
  }
  return NotFound(fmt::format("no such endpoint: {} {}", r.method.substr(0, 16), r.path.substr(0, 256)));
}

}  // namespace

ApiResponse HandleApiRequest(DirectoryStore& store, const ApiRequest& request, const ApiLimits& limits,
                             const std::atomic<bool>* stopping) {
  try {
    bool method_ok = true;
    std::string allowed;
    Result<Json> out = Dispatch(store, request, limits, stopping, &method_ok, &allowed);
    if (!method_ok) return MethodNotAllowed(request, allowed);
    if (!out.ok()) return Error(out.status());
    return Ok(*out);
  } catch (const std::exception& e) {
    return Error(Internal(fmt::format("directory: unexpected error: {}", e.what())));
  } catch (...) {
    return Error(Internal("directory: unexpected error"));
  }
}

}  // namespace rc::directory::internal
