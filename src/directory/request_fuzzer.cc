// libFuzzer target for the directory's handling of outside input: the publish-body parser on its
// own, and the whole HTTP API dispatcher (path, query, body) over a fresh MemoryStore.
//
// Input layout: byte 0 picks the method, bytes up to the first '\n' are the path (with an
// optional ?query), the rest is the body.
#include <cstddef>
#include <cstdint>
#include <string>

#include "directory/api.h"
#include "directory/codec.h"
#include "rolloutcore/base/clock.h"
#include "rolloutcore/directory/memory_store.h"

namespace {

std::multimap<std::string, std::string> ParseQuery(const std::string& q) {
  std::multimap<std::string, std::string> out;
  size_t i = 0;
  while (i <= q.size()) {
    size_t amp = q.find('&', i);
    if (amp == std::string::npos) amp = q.size();
    const std::string part = q.substr(i, amp - i);
    const size_t eq = part.find('=');
    if (!part.empty()) out.emplace(part.substr(0, eq), eq == std::string::npos ? "" : part.substr(eq + 1));
    i = amp + 1;
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string input(reinterpret_cast<const char*>(data) + 1, size - 1);
  static const char* kMethods[] = {"GET", "POST", "DELETE", "PUT"};

  // The body parser alone, with a fixed URL.
  auto parsed = rc::directory::internal::ParsePublishBody(input, "m", "v", static_cast<int32_t>(data[0] % 4));
  (void)parsed;

  // The whole dispatcher, twice on one store so publishes can interact with a second request.
  rc::ManualClock clock;
  auto store = rc::directory::NewMemoryStore(&clock);
  rc::directory::internal::ApiLimits limits{.max_wait_ms = 0, .wait_slice_ms = 0, .store_kind = "memory"};
  rc::directory::internal::ApiRequest req;
  req.method = kMethods[data[0] % 4];
  const size_t nl = input.find('\n');
  std::string target = input.substr(0, nl);
  req.body = nl == std::string::npos ? std::string() : input.substr(nl + 1);
  const size_t qm = target.find('?');
  if (qm != std::string::npos) {
    req.query = ParseQuery(target.substr(qm + 1));
    target.resize(qm);
  }
  req.path = target;
  for (int i = 0; i < 2; ++i) {
    auto res = rc::directory::internal::HandleApiRequest(*store, req, limits);
    if (res.status < 200 || res.status > 599 || res.body.empty()) __builtin_trap();
    clock.AdvanceMs(1000);
  }
  return 0;
}
