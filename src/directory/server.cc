#include "rolloutcore/directory/server.h"

#include <fmt/format.h>
#include <httplib.h>

#include "directory/api.h"
#include "rolloutcore/base/log.h"

namespace rc::directory {

struct DirectoryServer::Impl {
  httplib::Server http;
};

DirectoryServer::DirectoryServer(DirectoryStore* store, ServerOptions options)
    : store_(store), options_(std::move(options)), impl_(std::make_unique<Impl>()) {}

DirectoryServer::~DirectoryServer() { Stop(); }

std::string DirectoryServer::url() const { return fmt::format("http://{}:{}", options_.host, port_); }

Status DirectoryServer::Start() {
  if (thread_.joinable()) return FailedPrecondition("directory server already started");
  httplib::Server& http = impl_->http;
  const int threads = std::max(4, options_.threads);
  http.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  http.set_payload_max_length(options_.max_body_bytes);
  http.set_read_timeout(30, 0);
  http.set_write_timeout(30, 0);
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
    res.set_content(std::move(out.body), "application/json");
  };
  http.Get(".*", handler);
  http.Post(".*", handler);
  http.Delete(".*", handler);
  http.Put(".*", handler);
  http.Patch(".*", handler);
  http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
    res.status = 500;
    res.set_content(R"({"error":{"code":"Internal","message":"directory: unexpected error"}})", "application/json");
  });

  if (options_.port == 0) {
    port_ = http.bind_to_any_port(options_.host);
    if (port_ <= 0) return Unavailable(fmt::format("directory: cannot bind {}:<any port>", options_.host));
  } else {
    if (!http.bind_to_port(options_.host, options_.port)) {
      return Unavailable(fmt::format("directory: cannot bind {}:{}", options_.host, options_.port));
    }
    port_ = options_.port;
  }
  thread_ = std::thread([this] {
    if (!impl_->http.listen_after_bind() && !stopping_.load()) RC_LOG_ERROR("directory: server loop ended early");
  });
  return OkStatus();
}

void DirectoryServer::Stop() {
  stopping_.store(true);
  if (thread_.joinable()) {
    impl_->http.stop();
    thread_.join();
  }
}

}  // namespace rc::directory
