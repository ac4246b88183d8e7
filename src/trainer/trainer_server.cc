#include "trainer/trainer_server.h"

#include <fmt/format.h>

#include "rolloutcore/base/json.h"
#include "rolloutcore/base/log.h"
#include "rolloutcore/net/http.h"

namespace rc::trainer {
namespace {

void Reply(httplib::Response& res, int status, const Json& body) {
  res.status = status;
  res.set_content(net::DumpJson(body) + "\n", "application/json");
}

void ReplyError(httplib::Response& res, const Status& s) {
  Reply(res, HttpStatusFor(s),
        Json{{"error", Json{{"code", std::string(StatusCodeName(s.code()))}, {"message", s.message()}}}});
}

}  // namespace

struct TrainerServer::Impl {
  explicit Impl(const TrainerServerOptions& o) : http([&o] {
    net::HttpServerOptions h;
    h.name = "trainer";
    h.host = o.host;
    h.port = o.port;
    h.security = o.security;
    h.max_body_bytes = size_t{1} << 20;
    h.read_timeout_ms = 30'000;
    h.write_timeout_ms = 30'000;
    return h;
  }()) {}
  net::HttpServer http;
};

TrainerServer::TrainerServer(SyntheticTrainer* trainer, TrainerServerOptions options,
                             std::function<void(const Result<VersionStatus>&)> on_step)
    : trainer_(trainer),
      options_(std::move(options)),
      on_step_(std::move(on_step)),
      impl_(std::make_unique<Impl>(options_)) {}

TrainerServer::~TrainerServer() { Stop(); }

std::string TrainerServer::url() const { return impl_->http.url(); }

Status TrainerServer::Start() {
  if (port_ != 0) return FailedPrecondition("trainer server already started");
  net::HttpServer& http = impl_->http;
  http.set_exception_handler([](const httplib::Request&, httplib::Response& res, const std::exception_ptr&) {
    ReplyError(res, Internal("the trainer failed while answering this request"));
  });
  http.Get("/health", [](const httplib::Request&, httplib::Response& res) { Reply(res, 200, Json{{"ok", true}}); });
  http.Get("/status", [this](const httplib::Request&, httplib::Response& res) {
    Reply(res, 200, trainer_->StatusJson());
  });
  http.Post("/step", [this](const httplib::Request& req, httplib::Response& res) {
    // /step takes no parameters: an empty body or {}. Anything else is a caller expecting an
    // option that does not exist (it would otherwise step without a word).
    if (req.body.find_first_not_of(" \t\r\n") != std::string::npos) {
      auto body = ParseJson(req.body, "step body");
      if (!body.ok()) return ReplyError(res, body.status());
      if (!body->is_null() && (!body->is_object() || !body->empty())) {
        return ReplyError(res, InvalidArgument("step body: /step takes no parameters (send no body or {}), got " +
                                               body->dump().substr(0, 200)));
      }
    }
    Result<VersionStatus> v = trainer_->Step();
    if (on_step_) on_step_(v);
    if (!v.ok()) return ReplyError(res, v.status());
    Reply(res, 200, VersionStatusToJson(*v));
  });
  http.Post("/release", [this](const httplib::Request& req, httplib::Response& res) {
    auto body = ParseJson(req.body, "release body");
    if (!body.ok()) return ReplyError(res, body.status());
    if (!body->is_object()) return ReplyError(res, InvalidArgument("release body: expected {\"version\": \"v<k>\"}"));
    auto version = GetString(*body, "version", "");
    if (!version.ok()) return ReplyError(res, version.status());
    Status s = trainer_->Release(*version);
    if (!s.ok()) return ReplyError(res, s);
    Reply(res, 200, Json{{"version", *version}, {"released", true}});
  });

  // Fault injection: flip a bit of a published buffer (docs/trainer.md).
  http.Post("/fault/corrupt", [this](const httplib::Request& req, httplib::Response& res) {
    auto body = ParseJson(req.body, "corrupt body");
    if (!body.ok()) return ReplyError(res, body.status());
    auto version = GetString(*body, "version", "");
    if (!version.ok()) return ReplyError(res, version.status());
    auto rank = GetNonNegativeInt(*body, "rank", "", 0);
    if (!rank.ok()) return ReplyError(res, rank.status());
    auto byte = GetNonNegativeInt(*body, "byte", "", 0);
    if (!byte.ok()) return ReplyError(res, byte.status());
    Status s = trainer_->CorruptByte(*version, static_cast<int32_t>(*rank), static_cast<uint64_t>(*byte));
    if (!s.ok()) return ReplyError(res, s);
    Reply(res, 200, Json{{"version", *version}, {"rank", *rank}, {"byte", *byte}, {"corrupted", true}});
  });

  http.Post("/fault/corrupt_delta", [this](const httplib::Request& req, httplib::Response& res) {
    auto body = ParseJson(req.body, "corrupt_delta body");
    if (!body.ok()) return ReplyError(res, body.status());
    auto version = GetString(*body, "version", "");
    if (!version.ok()) return ReplyError(res, version.status());
    auto rank = GetNonNegativeInt(*body, "rank", "", 0);
    if (!rank.ok()) return ReplyError(res, rank.status());
    auto kind = GetString(*body, "kind", "");
    if (!kind.ok()) return ReplyError(res, kind.status());
    auto tensor = trainer_->CorruptDelta(*version, static_cast<int32_t>(*rank), *kind);
    if (!tensor.ok()) return ReplyError(res, tensor.status());
    Reply(res, 200, Json{{"version", *version}, {"rank", *rank}, {"kind", *kind}, {"tensor", *tensor}});
  });

  RC_RETURN_IF_ERROR(http.Start());
  port_ = http.port();
  return OkStatus();
}

void TrainerServer::Stop() { impl_->http.Stop(); }

}  // namespace rc::trainer
