#include "rolloutcore/directory/server.h"

#include <fmt/format.h>

#include "directory/api.h"
#include "directory/codec.h"
#include "rolloutcore/base/log.h"
#include "rolloutcore/net/http.h"

namespace rc::directory {

namespace {

net::HttpServerOptions HttpOptions(const ServerOptions& o) {
  net::HttpServerOptions h;
  h.name = "directory";
  h.host = o.host;
  h.port = o.port;
  h.security = o.security;
  h.max_threads = std::max(4, o.threads);
  h.max_body_bytes = o.max_body_bytes;
  // A publish body is one rank's manifest, which grows with the model (docs/directory.md: 256 MiB);
  // it needs the key, and api.cc refuses nesting deeper than 64 before parsing. GET bodies are
  // refused unread by rc::net.
  h.max_json_body_bytes = o.max_body_bytes;
  h.read_timeout_ms = 30'000;
  h.write_timeout_ms = 30'000;
  h.error_body = [](int, const Status& s) { return net::DumpJson(internal::ErrorToJson(s)); };
  return h;
}

}  // namespace

struct DirectoryServer::Impl {
  explicit Impl(const ServerOptions& o) : http(HttpOptions(o)) {}
  net::HttpServer http;
};

DirectoryServer::DirectoryServer(DirectoryStore* store, ServerOptions options)
    : store_(store), options_(std::move(options)), impl_(std::make_unique<Impl>(options_)) {}

DirectoryServer::~DirectoryServer() { Stop(); }

std::string DirectoryServer::url() const { return impl_->http.url(); }

Status DirectoryServer::Start() {
  if (started_) return FailedPrecondition("directory server already started");
  net::HttpServer& http = impl_->http;
  internal::ApiLimits limits;
  limits.max_wait_ms = options_.max_wait_ms;
  limits.store_kind = options_.store_kind;
  auto handler = [this, limits](const httplib::Request& req, httplib::Response& res) {
    internal::ApiRequest api;
    api.method = req.method;
    api.path = req.path;
    for (const auto& [k, v] : req.params) api.query.emplace(k, v);
    api.body = req.body;
    internal::ApiResponse out = internal::HandleApiRequest(*store_, api, limits, &stopping_);
    res.status = out.status;
    if (!out.allow.empty()) res.set_header("Allow", out.allow);
    res.set_content(out.body, "application/json");  // cpp-httplib 0.11 copies either way
  };
  http.Get(".*", handler);
  http.Post(".*", handler);
  http.Delete(".*", handler);
  http.Put(".*", handler);
  http.Patch(".*", handler);
  http.set_exception_handler([](const httplib::Request&, httplib::Response& res, const std::exception_ptr&) {
    res.status = 500;
    res.set_content(R"({"error":{"code":"Internal","message":"directory: unexpected error"}})", "application/json");
  });

  RC_RETURN_IF_ERROR(http.Start());
  port_ = http.port();
  started_ = true;
  return OkStatus();
}

void DirectoryServer::Stop() {
  stopping_.store(true);
  impl_->http.Stop();
}

}  // namespace rc::directory
