#include "rolloutcore/directory/store.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "rolloutcore/directory/etcd_store.h"
#include "rolloutcore/directory/memory_store.h"
#include "rolloutcore/directory/sqlite_store.h"

namespace rc::directory {
namespace {

class WallClockImpl final : public Clock {
 public:
  int64_t NowNs() const override {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
  void SleepForNs(int64_t duration_ns) override {
    std::this_thread::sleep_for(std::chrono::nanoseconds(duration_ns));
  }
};

}  // namespace

Clock* WallClock() {
  static WallClockImpl clock;
  return &clock;
}

Result<CommitEvent> WaitForVersion(DirectoryStore& store, std::string_view model, std::string_view version,
                                   int64_t timeout_ms) {
  RC_RETURN_IF_ERROR(ValidateName(model, "model"));
  RC_RETURN_IF_ERROR(ValidateName(version, "version"));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max<int64_t>(timeout_ms, 0));
  uint64_t after = 0;
  while (true) {
    auto info = store.GetInfo(model, version);
    if (info.ok()) {
      if (info->state == VersionState::kCommitted) {
        return CommitEvent{info->model, info->version, info->commit_seq, info->content_digest};
      }
      if (info->state == VersionState::kAbandoned) {
        return FailedPrecondition(fmt::format("version {} of model {} was ABANDONED ({})", version, model, info->reason));
      }
      if (info->state == VersionState::kUnavailable) {
        return FailedPrecondition(
            fmt::format("version {} of model {} is UNAVAILABLE ({})", version, model, info->reason));
      }
    } else if (info.status().code() != StatusCode::kNotFound) {
      return info.status();
    }
    const int64_t left_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (left_ms <= 0) {
      return DeadlineExceeded(fmt::format("version {} of model {} was not committed within {} ms ({})", version, model,
                                          timeout_ms,
                                          info.ok() ? std::string(VersionStateName(info->state)) : "not published"));
    }
    // Commits wake us at once; a short slice bounds how late an abandonment is noticed.
    RC_ASSIGN_OR_RETURN(std::vector<CommitEvent> events, store.WaitForCommits(model, after, std::min<int64_t>(left_ms, 200)));
    for (const CommitEvent& e : events) after = std::max(after, e.seq);
  }
}

Result<std::unique_ptr<DirectoryStore>> OpenDirectoryStore(std::string_view spec, Clock* clock) {
  if (clock == nullptr) clock = WallClock();
  if (spec == "memory") return NewMemoryStore(clock);
  if (spec.starts_with("sqlite:")) {
    std::string path(spec.substr(7));
    if (path.empty()) return InvalidArgument("store: 'sqlite:' needs a file path, e.g. sqlite:/var/lib/rc/dir.db");
    return OpenSqliteStore(path, clock);
  }
  if (spec.starts_with("etcd:")) {
    // etcd:URL[,URL...][/PREFIX]: the members of one cluster; the prefix follows the last URL.
    std::string list(spec.substr(5));
    EtcdStoreOptions options;
    std::vector<std::string> urls;
    size_t start = 0;
    while (start <= list.size()) {
      size_t comma = list.find(',', start);
      if (comma == std::string::npos) comma = list.size();
      urls.push_back(list.substr(start, comma - start));
      start = comma + 1;
    }
    std::string endpoints;
    for (size_t i = 0; i < urls.size(); ++i) {
      std::string url = urls[i];
      if (!url.starts_with("http://")) {
        return InvalidArgument(fmt::format("store: etcd URL {} of {} must start with http://, got '{}'", i + 1,
                                           urls.size(), url));
      }
      const size_t slash = url.find('/', 7);
      if (slash != std::string::npos) {
        if (i + 1 != urls.size()) {
          return InvalidArgument(fmt::format(
              "store: etcd URL {} of {} ('{}') has a path; the key prefix goes after the last URL only", i + 1,
              urls.size(), url));
        }
        std::string prefix = url.substr(slash);
        while (prefix.size() > 1 && prefix.back() == '/') prefix.pop_back();
        if (prefix != "/") options.prefix = prefix;
        url.resize(slash);
      }
      if (url.size() <= 7) return InvalidArgument(fmt::format("store: etcd URL {} of {} has no host", i + 1, urls.size()));
      endpoints += (i ? "," : "") + url;
    }
    options.endpoint = endpoints;
    return OpenEtcdStore(options);
  }
  return InvalidArgument(fmt::format("store: unknown store '{}' (expected memory, sqlite:PATH or etcd:URL)", spec));
}

}  // namespace rc::directory
