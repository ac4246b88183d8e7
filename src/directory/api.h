// The directory's HTTP API as a pure function from request to response, so the routing, parsing and
// error mapping can be unit-tested and fuzzed without sockets. DirectoryServer feeds it requests
// from cpp-httplib. Endpoints and JSON: docs/directory.md.
//
// Thread safety: HandleApiRequest may run concurrently on many threads (the store is thread-safe).
// It never throws: anything thrown below it becomes a 500 with the exception's text.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <string>

#include "rolloutcore/directory/store.h"

namespace rc::directory::internal {

struct ApiRequest {
  std::string method;  // GET, POST, DELETE, ...
  std::string path;    // decoded path, no query
  std::multimap<std::string, std::string> query;
  std::string body;
};

struct ApiResponse {
  int status = 200;
  std::string body;  // JSON
  std::string allow;  // 405: the methods the path serves (the Allow header)
};

struct ApiLimits {
  int64_t max_wait_ms = 60'000;  // cap on timeout_ms of a long-poll
  int64_t wait_slice_ms = 200;   // a long-poll re-checks `stopping` this often
  std::string store_kind;        // reported by /health
};

ApiResponse HandleApiRequest(DirectoryStore& store, const ApiRequest& request, const ApiLimits& limits,
                             const std::atomic<bool>* stopping = nullptr);

}  // namespace rc::directory::internal
