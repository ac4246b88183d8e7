// EtcdClient: the few etcd v3 calls the directory needs, over etcd's JSON gateway (POST
// /v3/kv/range, /v3/kv/txn, /v3/lease/grant, /v3/lease/keepalive, /v3/lease/revoke on the client
// URL). Keys and values travel base64-encoded; 64-bit integers arrive as JSON strings.
//
// Errors: a gRPC error from etcd becomes the matching Status (NotFound for "requested lease not
// found", ...); a connection failure is Unavailable naming the endpoint.
//
// Several endpoints (the members of one etcd cluster): every request goes to the member that
// answered last; when it does not answer (connection refused, reset, timed out) or answers
// Unavailable / DeadlineExceeded ("etcdserver: leader changed", "no leader", "request timed out"),
// the request is sent to the next member, round after round, until one answers, or every member
// was tried and the failover budget (2 x timeout_ms) is spent; then Unavailable naming every
// member and its last error.
// A retried request may have been applied by the member that did not answer: callers only send
// txns whose compares make a second application fail (and re-read), lease grants (a leaked lease
// expires at its TTL), keep-alives and reads, so a retry never applies anything twice.
//
// Thread safety: all methods may be called from any thread; every request opens its own
// connection (cheap on loopback, and no connection state is shared); the preferred member is an
// atomic index.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/encoding.h"
#include "rolloutcore/base/json.h"
#include "rolloutcore/base/status.h"

namespace rc::directory::internal {

// Keys and values travel base64-encoded in etcd's JSON gateway (rolloutcore/base/encoding.h).
using ::rc::Base64Decode;
using ::rc::Base64Encode;
// The smallest key greater than every key that starts with `prefix` (etcd's range_end).
std::string PrefixRangeEnd(std::string_view prefix);

struct EtcdKv {
  std::string key;
  std::string value;
  int64_t create_revision = 0;
  int64_t mod_revision = 0;
  int64_t lease = 0;
};

// A transaction under construction: compares, then the operations run on success.
class EtcdTxn {
 public:
  // The key's mod_revision equals `revision` (0: the key does not exist).
  EtcdTxn& ModRevisionIs(std::string_view key, int64_t revision);
  EtcdTxn& Put(std::string_view key, std::string_view value, int64_t lease = 0);
  EtcdTxn& Delete(std::string_view key);
  EtcdTxn& DeletePrefix(std::string_view prefix);
  Json ToJson() const;

 private:
  Json compare_ = Json::array();
  Json success_ = Json::array();
};

class EtcdClient {
 public:
  // endpoints: "http://host:port", or several separated by commas (members of one cluster).
  // timeout_ms bounds one attempt at one member.
  EtcdClient(std::string endpoints, int64_t timeout_ms);

  // The endpoints as given (comma-separated).
  const std::string& endpoint() const { return endpoint_; }
  const std::vector<std::string>& endpoints() const { return endpoints_; }

  [[nodiscard]] Status Health();
  [[nodiscard]] Result<std::optional<EtcdKv>> Get(std::string_view key);
  // Keys in [prefix, PrefixRangeEnd(prefix)) or from `from_key` to that end; sorted by key.
  [[nodiscard]] Result<std::vector<EtcdKv>> RangePrefix(std::string_view prefix, bool keys_only = false,
                                                        std::string_view from_key = {});
  // true when the compares held and the operations were applied.
  [[nodiscard]] Result<bool> Commit(const EtcdTxn& txn);
  // Returns the lease id; ttl_s is what etcd granted.
  [[nodiscard]] Result<int64_t> LeaseGrant(int64_t ttl_s, int64_t* granted_ttl_s);
  // The lease's TTL in seconds, restarted; NotFound when it has expired.
  [[nodiscard]] Result<int64_t> LeaseKeepAlive(int64_t lease_id);
  [[nodiscard]] Status LeaseRevoke(int64_t lease_id);
  // The TTL (seconds) the lease was granted with; NotFound when it has expired. Does not renew it.
  [[nodiscard]] Result<int64_t> LeaseGrantedTtl(int64_t lease_id);

 private:
  [[nodiscard]] Result<Json> Call(std::string_view path, const Json& body);
  [[nodiscard]] Result<Json> CallOne(const std::string& endpoint, std::string_view path, const Json& body);

  std::string endpoint_;
  std::vector<std::string> endpoints_;
  int64_t timeout_ms_;
  std::atomic<size_t> preferred_{0};  // index into endpoints_ of the member that answered last
};

}  // namespace rc::directory::internal
