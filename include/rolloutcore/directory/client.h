// DirectoryClient: the directory's HTTP API (docs/directory.md) as a DirectoryStore, so a trainer
// publisher or an engine receiver written against DirectoryStore works in-process or remote alike.
//
// Every call is one HTTP request with a deadline (request_timeout_ms; long-polls get their wait on
// top). Server-side refusals come back with the server's Status code and message; a directory
// that cannot be reached is Unavailable naming the URL; an answer that is not the documented JSON
// is Internal.
//
// LeaseKeeper renews one lease on a background thread until destroyed, for ranks that publish and
// then wait for the other ranks.
//
// Connections are kept alive and reused (net::ClientPool: a few idle connections, each used by
// one request at a time; a GET on a kept connection the directory closed meanwhile is sent again
// on a new one).
//
// Thread safety: all DirectoryClient methods may be called concurrently from any thread. LeaseKeeper's methods may be called from any thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>

#include "rolloutcore/base/mutex.h"
#include "rolloutcore/directory/store.h"
#include "rolloutcore/net/security.h"

namespace rc::net {
class ClientPool;
}

namespace rc::directory {

struct ClientOptions {
  int64_t connect_timeout_ms = 2'000;
  int64_t request_timeout_ms = 30'000;
  // The API key sent with every request and the CA file for https URLs (rolloutcore/net).
  net::ClientConfig auth = net::ClientConfig::Default();
};

// The start of the message of an Unavailable that DirectoryClient returns when the connection
// could not be made: the request was never sent, so nothing changed in the directory (the
// outcome of a publish is known). Any other Unavailable may have been applied.
inline constexpr std::string_view kNotSentPrefix = "not sent: ";
inline bool NotSent(const Status& s) {
  return s.code() == StatusCode::kUnavailable && s.message().rfind(kNotSentPrefix, 0) == 0;
}

class DirectoryClient final : public DirectoryStore {
 public:
  // base_url: "http://127.0.0.1:PORT" or "https://HOST:PORT".
  explicit DirectoryClient(std::string base_url, ClientOptions options = {});

  Result<PublishResult> Publish(const PublishRequest& request) override;
  Result<LeaseInfo> KeepAlive(int64_t lease_id) override;
  Result<refit::Manifest> Get(std::string_view model, std::string_view version) override;
  Result<VersionInfo> GetInfo(std::string_view model, std::string_view version) override;
  Result<std::vector<VersionInfo>> List(std::string_view model, StateFilter filter = StateFilter::kCommitted) override;
  Result<std::vector<CommitEvent>> WaitForCommits(std::string_view model, uint64_t after_seq,
                                                  int64_t timeout_ms) override;
  Status Release(std::string_view model, std::string_view version) override;
  Status MarkUnavailable(std::string_view model, std::string_view version, std::string_view reason) override;

  // GET /health: OK when the directory answers.
  [[nodiscard]] Status Health();

 private:
  [[nodiscard]] Result<Json> Call(const std::string& method, const std::string& path, const std::string& body,
                                  int64_t extra_wait_ms = 0);

  const std::string base_url_;
  const ClientOptions options_;
  std::shared_ptr<net::ClientPool> pool_;  // kept-alive connections to base_url_
};

class LeaseKeeper {
 public:
  // Calls store->KeepAlive(lease_id) every interval_ms until destroyed. The store must outlive it.
  LeaseKeeper(DirectoryStore* store, int64_t lease_id, int64_t interval_ms);
  ~LeaseKeeper();
  LeaseKeeper(const LeaseKeeper&) = delete;
  LeaseKeeper& operator=(const LeaseKeeper&) = delete;

  // The outcome of the latest renewal (OK before the first one). A NotFound here means the lease
  // expired and whatever it held is gone; the keeper stops trying after it.
  Status last_status() const;

 private:
  void Run();

  DirectoryStore* const store_;
  const int64_t lease_id_;
  const int64_t interval_ms_;
  mutable rc::Mutex mu_;
  rc::CondVar cv_;
  bool stop_ GUARDED_BY(mu_) = false;  // guarded by mu_
  Status last_ GUARDED_BY(mu_);        // guarded by mu_
  std::thread thread_;
};

}  // namespace rc::directory
