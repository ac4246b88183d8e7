#include "rolloutcore/controller/http_server.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>

#include "rolloutcore/base/log.h"
#include "rolloutcore/net/http.h"

namespace rc::controller {

namespace {

void SendJson(httplib::Response& r, int status, const Json& j) {
  r.status = status;
  r.set_content(net::DumpJson(j), "application/json");
}

void SendError(httplib::Response& r, const Status& s, int64_t retry_after_s = 1) {
  if (s.code() == StatusCode::kUnavailable) r.set_header("Retry-After", std::to_string(retry_after_s));
  SendJson(r, HttpStatusFor(s), Json{{"error", s.message()}, {"code", StatusCodeName(s.code())}});
}

Result<Json> Body(const httplib::Request& q) {
  if (q.body.empty()) return Json::object();
  RC_ASSIGN_OR_RETURN(Json j, ParseJson(q.body, "request body"));
  if (!j.is_object()) return InvalidArgument("request body: expected a JSON object, got " + JsonTypeName(j));
  return j;
}

Result<int64_t> IntParam(const httplib::Request& q, const std::string& name, int64_t dflt) {
  if (!q.has_param(name.c_str())) return dflt;
  std::string v = q.get_param_value(name.c_str());
  try {
    size_t used = 0;
    int64_t x = std::stoll(v, &used);
    if (used != v.size() || x < 0) throw std::invalid_argument(v);
    return x;
  } catch (...) {
    return InvalidArgument(name + ": expected a non-negative integer (at most 9223372036854775807), got '" + v + "'");
  }
}

// A long-poll waits in slices this long, checking between them whether its client is still
// connected and whether the server is stopping.
constexpr int64_t kWaitSliceMs = 100;
// No max_wait_ms beyond a day: now + wait stays far from the clock's range whatever is configured.
constexpr int64_t kLongestWaitMs = 86'400'000;

}  // namespace

class ControllerHttpServer::Impl {
 public:
  Impl(ControllerService* s, const ControllerHttpOptions& o)
      : svc_(s), max_wait_ms_(std::clamp<int64_t>(o.max_wait_ms, 0, kLongestWaitMs)), svr_([&o] {
          net::HttpServerOptions h;
          h.name = "controller";
          h.host = o.host;
          h.port = o.port;
          h.security = o.security;
          h.max_long_polls = o.max_long_polls;
          h.error_body = [](int, const Status& st) {
            return net::DumpJson(Json{{"error", st.message()}, {"code", StatusCodeName(st.code())}});
          };
          return h;
        }()) {}

  template <typename F>
  httplib::Server::Handler Guard(F f) {
    return [f](const httplib::Request& q, httplib::Response& r) {
      try {
        f(q, r);
      } catch (const std::exception& e) {
        SendJson(r, 500, Json{{"error", std::string("internal error: ") + e.what()}, {"code", "Internal"}});
      } catch (...) {
        SendJson(r, 500, Json{{"error", "internal error"}, {"code", "Internal"}});
      }
    };
  }

  void Routes() {
    int64_t retry = 1;
    svr_.Post("/v1/rollouts", Guard([this, retry](const httplib::Request& q, httplib::Response& r) {
      auto body = Body(q);
      if (!body.ok()) return SendError(r, body.status());
      auto out = svc_->Rollout(*body);
      if (!out.ok() && out.status().code() == StatusCode::kDataLoss) {
        // The engine answered under another identity than the binding (service.h): bad gateway.
        return SendJson(r, 502, Json{{"error", out.status().message()}, {"code", StatusCodeName(out.status().code())}});
      }
      if (!out.ok()) return SendError(r, out.status(), retry);
      SendJson(r, 200, *out);
    }));
    svr_.Post("/v1/rollouts:admit", Guard([this, retry](const httplib::Request& q, httplib::Response& r) {
      auto body = Body(q);
      if (!body.ok()) return SendError(r, body.status());
      auto id = GetString(*body, "rollout_id", "", std::string());
      if (!id.ok()) return SendError(r, id.status());
      auto out = svc_->Admit(*id);
      if (!out.ok()) return SendError(r, out.status(), retry);
      SendJson(r, 200, *out);
    }));
    svr_.Post(R"(/v1/rollouts/([^/:]+):finish)", Guard([this](const httplib::Request& q, httplib::Response& r) {
      auto body = Body(q);
      if (!body.ok()) return SendError(r, body.status());
      Status s = svc_->FinishLease(q.matches[1], *body);
      if (!s.ok()) return SendError(r, s);
      SendJson(r, 200, Json{{"status", "finished"}, {"rollout_id", std::string(q.matches[1])}});
    }));
    svr_.Post(R"(/v1/rollouts/([^/:]+):heartbeat)", Guard([this](const httplib::Request& q, httplib::Response& r) {
      auto out = svc_->ExtendLease(q.matches[1]);
      if (!out.ok()) return SendError(r, out.status());
      SendJson(r, 200, *out);
    }));
    auto model_version = [](const Json& body) -> Result<std::pair<std::string, std::string>> {
      RC_ASSIGN_OR_RETURN(std::string model, GetString(body, "model", ""));
      RC_ASSIGN_OR_RETURN(std::string version, GetString(body, "version", ""));
      return std::make_pair(model, version);
    };
    svr_.Post("/v1/updates", Guard([this, model_version](const httplib::Request& q, httplib::Response& r) {
      auto body = Body(q);
      if (!body.ok()) return SendError(r, body.status());
      auto mv = model_version(*body);
      if (!mv.ok()) return SendError(r, mv.status());
      // Optional policy mode (docs/lifecycle.md); absent: the deployment's --update-mode.
      std::optional<lifecycle::PolicyMode> mode;
      if (body->contains("mode") && !(*body)["mode"].is_null()) {
        if (!(*body)["mode"].is_string()) {
          return SendError(r, InvalidArgument("mode: expected one of strict, keep, recompute, abort (a string), got " +
                                              JsonTypeName((*body)["mode"]) + " " + (*body)["mode"].dump()));
        }
        auto m = lifecycle::PolicyModeFromName((*body)["mode"].get<std::string>(), "mode");
        if (!m.ok()) return SendError(r, m.status());
        mode = *m;
      }
      // retry_failed: ask again for a version marked failed (docs/controller.md, "A failed update stops").
      bool retry_failed = false;
      if (body->contains("retry_failed") && !(*body)["retry_failed"].is_null()) {
        if (!(*body)["retry_failed"].is_boolean()) {
          return SendError(r, InvalidArgument("retry_failed: expected true or false, got " +
                                              JsonTypeName((*body)["retry_failed"])));
        }
        retry_failed = (*body)["retry_failed"].get<bool>();
      }
      auto id = svc_->RequestUpdate(mv->first, mv->second, mode, retry_failed);
      if (!id.ok()) return SendError(r, id.status());
      SendJson(r, 202, Json{{"id", *id}});
    }));
    svr_.Post("/v1/recover", Guard([this, model_version](const httplib::Request& q, httplib::Response& r) {
      auto body = Body(q);
      if (!body.ok()) return SendError(r, body.status());
      auto mv = model_version(*body);
      if (!mv.ok()) return SendError(r, mv.status());
      auto id = svc_->RequestRecovery(mv->first, mv->second);
      if (!id.ok()) return SendError(r, id.status());
      SendJson(r, 202, Json{{"id", *id}});
    }));
    svr_.Get(R"(/v1/updates/([^/]+))", Guard([this](const httplib::Request& q, httplib::Response& r) {
      auto wait = IntParam(q, "wait_ms", 0);
      if (!wait.ok()) return SendError(r, wait.status());
      const std::string id = q.matches[1];
      Result<Json> out = *wait > 0 ? LongPoll(id, std::min(*wait, max_wait_ms_)) : svc_->UpdateStatus(id);
      if (!out.ok() && out.status().code() == StatusCode::kDeadlineExceeded) out = svc_->UpdateStatus(id);
      if (!out.ok()) return SendError(r, out.status());
      SendJson(r, 200, *out);
    }));
    svr_.Get("/v1/status", Guard([this](const httplib::Request&, httplib::Response& r) { SendJson(r, 200, svc_->StatusJson()); }));
    svr_.Get("/v1/journal", Guard([this](const httplib::Request& q, httplib::Response& r) {
      auto since = IntParam(q, "since", 0);
      if (!since.ok()) return SendError(r, since.status());
      auto engine = IntParam(q, "engine", 0);
      if (!engine.ok()) return SendError(r, engine.status());
      auto out = svc_->Journal(*since, static_cast<int>(*engine));
      if (!out.ok()) return SendError(r, out.status());
      SendJson(r, 200, *out);
    }));
    svr_.Get("/v1/trajectories", Guard([this](const httplib::Request& q, httplib::Response& r) {
      std::string label = q.has_param("label") ? q.get_param_value("label") : "";
      std::string format = q.has_param("format") ? q.get_param_value("format") : "json";
      if (format != "json" && format != "jsonl") {
        return SendError(r, InvalidArgument("format: expected json or jsonl, got '" + format + "'"));
      }
      auto limit = IntParam(q, "limit", 0);
      if (!limit.ok()) return SendError(r, limit.status());
      auto rows = svc_->trajectories()->List(label, *limit > 0 ? *limit : -1);
      if (!rows.ok()) return SendError(r, rows.status());
      if (format == "jsonl") {
        std::string out;
        for (const auto& t : *rows) out += net::DumpJson(ToJson(t)) + "\n";
        r.set_content(out, "application/x-ndjson");
        return;
      }
      Json arr = Json::array();
      for (const auto& t : *rows) arr.push_back(ToJson(t));
      SendJson(r, 200, Json{{"trajectories", arr}});
    }));
    svr_.Get("/metrics", Guard([this](const httplib::Request&, httplib::Response& r) {
      r.set_content(svc_->Metrics(), "text/plain; version=0.0.4");
    }));
    svr_.Get("/health", Guard([](const httplib::Request&, httplib::Response& r) { SendJson(r, 200, Json{{"status", "ok"}}); }));
  }

  // GET /v1/updates/{id}?wait_ms: WaitForUpdate in slices of kWaitSliceMs up to wait_ms (already
  // capped, so the deadline cannot overflow), returning early when the client closed its
  // connection (its worker is free again at once, not after wait_ms) or the server is stopping.
  // Holds one of the server's long-poll slots; without one it is Unavailable (503 + Retry-After):
  // an unauthenticated wait must not take the workers authenticated writes need.
  Result<Json> LongPoll(const std::string& id, int64_t wait_ms) {
    net::HttpServer::LongPollSlot slot = svr_.TryLongPoll();
    if (!slot) {
      return Unavailable(fmt::format(
          "controller: {} long-polls are waiting already (the most at once); retry after Retry-After, or ask "
          "without wait_ms",
          svr_.max_long_polls()));
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(wait_ms);
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      const int64_t left = std::max<int64_t>(0, std::chrono::ceil<std::chrono::milliseconds>(deadline - start).count());
      const int64_t slice = std::min(left, kWaitSliceMs);
      Result<Json> out = svc_->WaitForUpdate(id, slice);
      // Done is returned at once once the engines settled; a done answer that took the whole
      // slice may still be settling (service.h), so it is asked again while time is left, as
      // one long WaitForUpdate would have waited for the settling.
      const bool used_slice = std::chrono::steady_clock::now() - start >= std::chrono::milliseconds(slice);
      const bool waiting = out.ok() ? used_slice : out.status().code() == StatusCode::kDeadlineExceeded;
      if (!waiting || left <= slice || svr_.stopping() || net::HttpServer::ClientGone()) return out;
    }
  }

  Status Start() {
    Routes();
    return svr_.Start();
  }
  void Stop() { svr_.Stop(); }
  void Wait() { svr_.Wait(); }
  int port() const { return svr_.port(); }

 private:
  ControllerService* svc_;
  const int64_t max_wait_ms_;
  net::HttpServer svr_;
};

ControllerHttpServer::ControllerHttpServer(ControllerService* service, const ControllerHttpOptions& options)
    : impl_(std::make_unique<Impl>(service, options)) {}
ControllerHttpServer::ControllerHttpServer(ControllerService* service, std::string host, int port)
    : ControllerHttpServer(service, [&] {
        ControllerHttpOptions o;
        o.host = std::move(host);
        o.port = port;
        return o;
      }()) {}
ControllerHttpServer::~ControllerHttpServer() { impl_->Stop(); }
Status ControllerHttpServer::Start() { return impl_->Start(); }
int ControllerHttpServer::port() const { return impl_->port(); }
void ControllerHttpServer::Stop() { impl_->Stop(); }
void ControllerHttpServer::Wait() { impl_->Wait(); }

}  // namespace rc::controller
