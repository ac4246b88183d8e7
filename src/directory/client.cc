#include "rolloutcore/directory/client.h"

#include <fmt/format.h>
#include <httplib.h>

#include "directory/codec.h"
#include "rolloutcore/net/http.h"
#include "rolloutcore/base/mutex.h"

namespace rc::directory {
namespace {

Status CheckNames(std::string_view model, std::string_view version) {
  RC_RETURN_IF_ERROR(ValidateName(model, "model"));
  return ValidateName(version, "version");
}

std::string VersionPath(std::string_view model, std::string_view version) {
  return fmt::format("/v1/models/{}/versions/{}", model, version);
}

}  // namespace

DirectoryClient::DirectoryClient(std::string base_url, ClientOptions options)
    : base_url_(std::move(base_url)),
      options_(std::move(options)),
      pool_(std::make_shared<net::ClientPool>(base_url_, options_.auth)) {}

Result<Json> DirectoryClient::Call(const std::string& method, const std::string& path, const std::string& body,
                                   int64_t extra_wait_ms) {
  if (!pool_->valid()) return InvalidArgument(fmt::format("directory URL '{}' is not valid", base_url_));
  httplib::Result res = pool_->Request(method, path, body, "application/json", [&](httplib::Client& client) {
    net::SetClientTimeouts(client, options_.connect_timeout_ms, options_.request_timeout_ms + extra_wait_ms);
  });
  if (!res) {
    if (res.error() == httplib::Error::Connection || res.error() == httplib::Error::ConnectionTimeout) {
      // connect() failed: nothing was written, so nothing was applied.
      return Unavailable(fmt::format("{}directory at {} could not be reached for {} {} (connection refused or no route)",
                                     kNotSentPrefix, base_url_, method, path));
    }
    return Unavailable(fmt::format("directory at {} did not answer {} {}: {}", base_url_, method, path,
                                   httplib::to_string(res.error())));
  }
  auto j = internal::ParseBoundedJson(res->body, "directory response");
  if (res->status != 200) {
    if (!j.ok()) {
      return Internal(fmt::format("directory {} {} answered HTTP {} with a body that is not JSON", method, path,
                                  res->status));
    }
    return internal::StatusFromErrorJson(*j, res->status);
  }
  if (!j.ok()) return Internal(fmt::format("directory {} {}: {}", method, path, j.status().message()));
  return std::move(*j);
}

Status DirectoryClient::Health() { return Call("GET", "/health", "").status(); }

Result<PublishResult> DirectoryClient::Publish(const PublishRequest& r) {
  RC_RETURN_IF_ERROR(CheckNames(r.model, r.version));
  if (r.rank < 0) return InvalidArgument(fmt::format("rank: must not be negative, got {}", r.rank));
  RC_ASSIGN_OR_RETURN(Json j, Call("POST", fmt::format("{}/ranks/{}", VersionPath(r.model, r.version), r.rank),
                                   internal::PublishBodyToJson(r).dump()));
  auto out = internal::PublishResultFromJson(j);
  if (!out.ok()) return Internal("directory publish answer: " + out.status().message());
  return out;
}

Result<LeaseInfo> DirectoryClient::KeepAlive(int64_t lease_id) {
  if (lease_id <= 0) return NotFound(fmt::format("lease {} does not exist (expired, or never granted)", lease_id));
  RC_ASSIGN_OR_RETURN(Json j, Call("POST", fmt::format("/v1/leases/{}:keepalive", lease_id), "{}"));
  auto out = internal::LeaseInfoFromJson(j);
  if (!out.ok()) return Internal("directory keepalive answer: " + out.status().message());
  return out;
}

Result<refit::Manifest> DirectoryClient::Get(std::string_view model, std::string_view version) {
  RC_RETURN_IF_ERROR(CheckNames(model, version));
  RC_ASSIGN_OR_RETURN(Json j, Call("GET", VersionPath(model, version), ""));
  auto it = j.find("manifest");
  if (it == j.end()) return Internal("directory get answer: manifest is missing");
  auto m = refit::ManifestFromJson(*it);
  if (!m.ok()) return Internal("directory get answer: " + m.status().message());
  return m;
}

Result<VersionInfo> DirectoryClient::GetInfo(std::string_view model, std::string_view version) {
  RC_RETURN_IF_ERROR(CheckNames(model, version));
  RC_ASSIGN_OR_RETURN(Json j, Call("GET", VersionPath(model, version) + "/status", ""));
  auto out = internal::VersionInfoFromJson(j, "");
  if (!out.ok()) return Internal("directory status answer: " + out.status().message());
  return out;
}

Result<std::vector<VersionInfo>> DirectoryClient::List(std::string_view model, StateFilter filter) {
  RC_RETURN_IF_ERROR(ValidateName(model, "model"));
  RC_ASSIGN_OR_RETURN(Json j, Call("GET", fmt::format("/v1/models/{}/versions?state={}", model, StateFilterName(filter)), ""));
  auto it = j.find("versions");
  if (it == j.end() || !it->is_array()) return Internal("directory list answer: versions is missing");
  std::vector<VersionInfo> out;
  for (size_t i = 0; i < it->size(); ++i) {
    auto v = internal::VersionInfoFromJson((*it)[i], fmt::format("versions[{}]", i));
    if (!v.ok()) return Internal("directory list answer: " + v.status().message());
    out.push_back(std::move(*v));
  }
  return out;
}

Result<std::vector<CommitEvent>> DirectoryClient::WaitForCommits(std::string_view model, uint64_t after_seq,
                                                                 int64_t timeout_ms) {
  RC_RETURN_IF_ERROR(ValidateName(model, "model"));
  timeout_ms = std::max<int64_t>(timeout_ms, 0);
  RC_ASSIGN_OR_RETURN(Json j, Call("GET", fmt::format("/v1/models/{}/commits?after={}&timeout_ms={}", model, after_seq,
                                                      timeout_ms),
                                   "", timeout_ms));
  auto it = j.find("commits");
  if (it == j.end() || !it->is_array()) return Internal("directory commits answer: commits is missing");
  std::vector<CommitEvent> out;
  for (size_t i = 0; i < it->size(); ++i) {
    auto e = internal::CommitEventFromJson((*it)[i], fmt::format("commits[{}]", i));
    if (!e.ok()) return Internal("directory commits answer: " + e.status().message());
    out.push_back(std::move(*e));
  }
  return out;
}

Status DirectoryClient::Release(std::string_view model, std::string_view version) {
  RC_RETURN_IF_ERROR(CheckNames(model, version));
  return Call("DELETE", VersionPath(model, version), "").status();
}

Status DirectoryClient::MarkUnavailable(std::string_view model, std::string_view version, std::string_view reason) {
  RC_RETURN_IF_ERROR(CheckNames(model, version));
  // The server checks the reason; a JSON string must be UTF-8, so refuse other bytes here.
  Json body;
  try {
    body = Json{{"reason", std::string(reason)}};
    return Call("POST", VersionPath(model, version) + "/unavailable", body.dump()).status();
  } catch (const std::exception&) {
    return InvalidArgument("reason: must be UTF-8");
  }
}

LeaseKeeper::LeaseKeeper(DirectoryStore* store, int64_t lease_id, int64_t interval_ms)
    : store_(store), lease_id_(lease_id), interval_ms_(std::max<int64_t>(interval_ms, 1)) {
  thread_ = std::thread([this] { Run(); });
}

LeaseKeeper::~LeaseKeeper() {
  {
    rc::MutexLock lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

Status LeaseKeeper::last_status() const {
  rc::MutexLock lock(mu_);
  return last_;
}

void LeaseKeeper::Run() {
  rc::MutexLock lock(mu_);
  while (!stop_) {
    if (cv_.wait_for(lock, std::chrono::milliseconds(interval_ms_), [this]() REQUIRES(mu_) { return stop_; })) break;
    lock.unlock();
    Status s = store_->KeepAlive(lease_id_).status();
    lock.lock();
    last_ = s;
    if (s.code() == StatusCode::kNotFound) break;  // the lease is gone; renewing cannot bring it back
  }
}

}  // namespace rc::directory
