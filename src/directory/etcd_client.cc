#include "directory/etcd_client.h"

#include <fmt/format.h>
#include <httplib.h>

#include <chrono>
#include <thread>

#include "directory/codec.h"
#include "rolloutcore/base/log.h"

namespace rc::directory::internal {
namespace {

int64_t IntField(const Json& j, std::string_view key) {
  auto it = j.find(key);
  if (it == j.end()) return 0;
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_string()) {
    auto v = ParseDecimal(it->get_ref<const std::string&>(), key, true);
    return v.ok() ? *v : 0;
  }
  return 0;
}

StatusCode FromGrpcCode(int64_t code) {
  switch (code) {
    case 3: return StatusCode::kInvalidArgument;
    case 4: return StatusCode::kDeadlineExceeded;
    case 5: return StatusCode::kNotFound;
    case 6: return StatusCode::kAlreadyExists;
    case 9: return StatusCode::kFailedPrecondition;
    case 10: return StatusCode::kAborted;
    case 12: return StatusCode::kUnimplemented;
    case 14: return StatusCode::kUnavailable;
    default: return StatusCode::kInternal;
  }
}

// A kv field etcd sent: base64 that does not decode is etcd's fault (Internal), not the caller's.
Result<std::string> DecodeField(const Json& field, const char* name) {
  auto bytes = Base64Decode(field.get_ref<const std::string&>());
  if (!bytes.ok()) return Internal(fmt::format("etcd: kv {}: {}", name, bytes.status().message()));
  return bytes;
}

Result<EtcdKv> KvFromJson(const Json& j) {
  EtcdKv kv;
  auto key = j.find("key");
  if (key == j.end() || !key->is_string()) return Internal("etcd: a kv without a key");
  RC_ASSIGN_OR_RETURN(kv.key, DecodeField(*key, "key"));
  auto value = j.find("value");
  if (value != j.end() && value->is_string()) {
    RC_ASSIGN_OR_RETURN(kv.value, DecodeField(*value, "value"));
  }
  kv.create_revision = IntField(j, "create_revision");
  kv.mod_revision = IntField(j, "mod_revision");
  kv.lease = IntField(j, "lease");
  return kv;
}

}  // namespace

std::string PrefixRangeEnd(std::string_view prefix) {
  std::string end(prefix);
  while (!end.empty()) {
    auto& last = reinterpret_cast<unsigned char&>(end.back());
    if (last < 0xFF) {
      ++last;
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key
}

EtcdTxn& EtcdTxn::ModRevisionIs(std::string_view key, int64_t revision) {
  compare_.push_back({{"key", Base64Encode(key)},
                      {"target", "MOD"},
                      {"result", "EQUAL"},
                      {"mod_revision", std::to_string(revision)}});
  return *this;
}

EtcdTxn& EtcdTxn::Put(std::string_view key, std::string_view value, int64_t lease) {
  Json put{{"key", Base64Encode(key)}, {"value", Base64Encode(value)}};
  if (lease != 0) put["lease"] = std::to_string(lease);
  success_.push_back({{"request_put", put}});
  return *this;
}

EtcdTxn& EtcdTxn::Delete(std::string_view key) {
  success_.push_back({{"request_delete_range", {{"key", Base64Encode(key)}}}});
  return *this;
}

EtcdTxn& EtcdTxn::DeletePrefix(std::string_view prefix) {
  success_.push_back(
      {{"request_delete_range", {{"key", Base64Encode(prefix)}, {"range_end", Base64Encode(PrefixRangeEnd(prefix))}}}});
  return *this;
}

Json EtcdTxn::ToJson() const { return Json{{"compare", compare_}, {"success", success_}, {"failure", Json::array()}}; }

EtcdClient::EtcdClient(std::string endpoints, int64_t timeout_ms)
    : endpoint_(std::move(endpoints)), timeout_ms_(timeout_ms) {
  size_t start = 0;
  while (start <= endpoint_.size()) {
    size_t comma = endpoint_.find(',', start);
    if (comma == std::string::npos) comma = endpoint_.size();
    if (comma > start) endpoints_.push_back(endpoint_.substr(start, comma - start));
    start = comma + 1;
  }
  if (endpoints_.empty()) endpoints_.push_back(endpoint_);
}

Result<Json> EtcdClient::CallOne(const std::string& endpoint, std::string_view path, const Json& body) {
  httplib::Client client(endpoint);
  const time_t sec = static_cast<time_t>(timeout_ms_ / 1000);
  const time_t usec = static_cast<time_t>((timeout_ms_ % 1000) * 1000);
  client.set_connection_timeout(sec, usec);
  client.set_read_timeout(sec, usec);
  client.set_write_timeout(sec, usec);
  auto res = client.Post(std::string(path), body.dump(), "application/json");
  if (!res) {
    return Unavailable(fmt::format("etcd at {} did not answer {}: {}", endpoint, path, httplib::to_string(res.error())));
  }
  auto j = ParseJson(res->body, "etcd response");
  if (!j.ok()) {
    // A member that is shutting down or not serving yet may answer with a non-JSON error page.
    const StatusCode code = res->status >= 500 ? StatusCode::kUnavailable : StatusCode::kInternal;
    return Status(code, fmt::format("etcd at {} {} (HTTP {}): {}", endpoint, path, res->status, j.status().message()));
  }
  if (res->status != 200 || j->contains("error")) {
    std::string message = j->value("message", j->value("error", std::string("unknown error")));
    return Status(FromGrpcCode(IntField(*j, "code")), fmt::format("etcd at {} {}: {}", endpoint, path, message));
  }
  return std::move(*j);
}

Result<Json> EtcdClient::Call(std::string_view path, const Json& body) {
  const size_t n = endpoints_.size();
  if (n == 1) return CallOne(endpoints_[0], path, body);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(2 * timeout_ms_);
  std::vector<std::string> last_errors(n);
  size_t first = preferred_.load(std::memory_order_relaxed) % n;
  for (int round = 0;; ++round) {
    for (size_t k = 0; k < n; ++k) {
      const size_t i = (first + k) % n;
      auto r = CallOne(endpoints_[i], path, body);
      // Only "this member cannot serve now" moves on; any other answer (including NotFound,
      // FailedPrecondition) is the cluster's answer.
      if (r.ok() || (r.status().code() != StatusCode::kUnavailable &&
                     r.status().code() != StatusCode::kDeadlineExceeded)) {
        preferred_.store(i, std::memory_order_relaxed);
        return r;
      }
      last_errors[i] = r.status().message();
      // Move every later call (this thread's and the concurrent ones) off this member at once:
      // otherwise each of them would wait out its own timeout on a frozen member first.
      size_t expected = i;
      preferred_.compare_exchange_strong(expected, (i + 1) % n, std::memory_order_relaxed);
      RC_LOG_WARN("etcd: member {} of {} did not serve {} ({}); trying the next one", i + 1, n, path,
                  r.status().message());
      if (std::chrono::steady_clock::now() >= deadline && (round > 0 || k + 1 == n)) {
        std::string all;
        for (size_t e = 0; e < n; ++e) {
          if (!last_errors[e].empty()) all += fmt::format("{}member {}: {}", all.empty() ? "" : "; ", e + 1, last_errors[e]);
        }
        return Unavailable(fmt::format("etcd: none of the {} members answered {} (every member tried, {} ms): {}",
                                       n, path, 2 * timeout_ms_, all));
      }
    }
    // A full round failed: an election is probably running. Wait a little before the next one.
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    first = (first + 1) % n;
  }
}

Status EtcdClient::Health() {
  Status last = OkStatus();
  for (const std::string& endpoint : endpoints_) {
    httplib::Client client(endpoint);
    client.set_connection_timeout(static_cast<time_t>(timeout_ms_ / 1000),
                                  static_cast<time_t>((timeout_ms_ % 1000) * 1000));
    client.set_read_timeout(static_cast<time_t>(timeout_ms_ / 1000), static_cast<time_t>((timeout_ms_ % 1000) * 1000));
    auto res = client.Get("/health");
    if (res && res->status == 200) return OkStatus();  // one healthy member is enough: it reaches a quorum
    last = res ? Unavailable(fmt::format("etcd at {} is unhealthy (HTTP {})", endpoint, res->status))
               : Unavailable(fmt::format("etcd at {} did not answer /health: {}", endpoint,
                                         httplib::to_string(res.error())));
  }
  if (endpoints_.size() == 1) return last;
  return Unavailable(fmt::format("no member of etcd {} is healthy; last: {}", endpoint_, last.message()));
}

Result<std::optional<EtcdKv>> EtcdClient::Get(std::string_view key) {
  RC_ASSIGN_OR_RETURN(Json j, Call("/v3/kv/range", Json{{"key", Base64Encode(key)}}));
  auto kvs = j.find("kvs");
  if (kvs == j.end() || !kvs->is_array() || kvs->empty()) return std::optional<EtcdKv>();
  RC_ASSIGN_OR_RETURN(EtcdKv kv, KvFromJson((*kvs)[0]));
  return std::optional<EtcdKv>(std::move(kv));
}

Result<std::vector<EtcdKv>> EtcdClient::RangePrefix(std::string_view prefix, bool keys_only, std::string_view from_key) {
  Json body{{"key", Base64Encode(from_key.empty() ? prefix : from_key)},
            {"range_end", Base64Encode(PrefixRangeEnd(prefix))}};
  if (keys_only) body["keys_only"] = true;
  RC_ASSIGN_OR_RETURN(Json j, Call("/v3/kv/range", body));
  std::vector<EtcdKv> out;
  auto kvs = j.find("kvs");
  if (kvs == j.end() || !kvs->is_array()) return out;
  for (const Json& e : *kvs) {
    RC_ASSIGN_OR_RETURN(EtcdKv kv, KvFromJson(e));
    out.push_back(std::move(kv));
  }
  return out;
}

Result<bool> EtcdClient::Commit(const EtcdTxn& txn) {
  RC_ASSIGN_OR_RETURN(Json j, Call("/v3/kv/txn", txn.ToJson()));
  auto it = j.find("succeeded");
  return it != j.end() && it->is_boolean() && it->get<bool>();
}

Result<int64_t> EtcdClient::LeaseGrant(int64_t ttl_s, int64_t* granted_ttl_s) {
  RC_ASSIGN_OR_RETURN(Json j, Call("/v3/lease/grant", Json{{"TTL", std::to_string(ttl_s)}}));
  const int64_t id = IntField(j, "ID");
  if (id == 0) return Internal("etcd granted a lease without an ID");
  if (granted_ttl_s) *granted_ttl_s = IntField(j, "TTL");
  return id;
}

Result<int64_t> EtcdClient::LeaseKeepAlive(int64_t lease_id) {
  RC_ASSIGN_OR_RETURN(Json j, Call("/v3/lease/keepalive", Json{{"ID", std::to_string(lease_id)}}));
  auto result = j.find("result");
  const int64_t ttl = result != j.end() && result->is_object() ? IntField(*result, "TTL") : 0;
  if (ttl <= 0) return NotFound(fmt::format("lease {} does not exist (expired, or never granted)", lease_id));
  return ttl;
}

Result<int64_t> EtcdClient::LeaseGrantedTtl(int64_t lease_id) {
  RC_ASSIGN_OR_RETURN(Json j, Call("/v3/lease/timetolive", Json{{"ID", std::to_string(lease_id)}}));
  if (IntField(j, "TTL") <= 0) {
    return NotFound(fmt::format("lease {} does not exist (expired, or never granted)", lease_id));
  }
  return IntField(j, "grantedTTL");
}

Status EtcdClient::LeaseRevoke(int64_t lease_id) {
  return Call("/v3/lease/revoke", Json{{"ID", std::to_string(lease_id)}}).status();
}

}  // namespace rc::directory::internal
