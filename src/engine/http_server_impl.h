// EngineServer::Impl, shared by the files that register the engine's routes: http_server.cc
// (the server's life, the shared helpers, the completion pieces of http_server.h),
// http_routes_vllm.cc (the vLLM-compatible API), http_routes_refit.cc (/rc/refit, /rc/weights,
// /rc/validate, /rc/engine) and http_routes_fault.cc (/rc/fault, tests only). Request bodies are
// parsed by the typed Parse… functions of http_requests.h; a handler answers a parse error 400
// with its message (which names the field).
//
// Thread safety: as EngineServer (http_server.h): routes are registered once, from Start; the
// handlers run on httplib's worker threads and use only the engine's and the receiver's
// thread-safe APIs, the atomics of Faults, and live_ under live_mu_.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "rolloutcore/base/clock.h"
#include "rolloutcore/base/json.h"
#include "rolloutcore/base/mutex.h"
#include "rolloutcore/base/status.h"
#include "rolloutcore/engine/engine_loop.h"
#include "rolloutcore/engine/http_server.h"
#include "rolloutcore/receiver/receiver.h"
#include "rolloutcore/net/http.h"

namespace rc::engine {
namespace http {

inline constexpr const char* kJson = "application/json";
std::string Dump(const Json& j);
void SendJson(httplib::Response& res, int status, const Json& j);
// The error body: {"object":"error","error","message","type","code"} (vLLM's shape).
Json ErrorJson(int status, const std::string& message);
void SendError(httplib::Response& res, int status, const std::string& message);
// The HTTP status a Status maps to (InvalidArgument 400, PermissionDenied 403, NotFound 404,
// FailedPrecondition / AlreadyExists 409, Unavailable 503, DeadlineExceeded 504, ...).
int HttpStatus(const Status& s);
net::HttpServerOptions EngineHttpOptions(const ServerOptions& o);

}  // namespace http

class EngineServer::Impl {
 public:
  Impl(Engine* engine, ServerOptions options)
      : engine_(engine),
        options_(std::move(options)),
        tokenizer_(engine->spec().vocab_size),
        loop_(engine),
        receiver_(engine) {
    receiver_.SetFullVerifyEvery(options_.full_verify_every);
    receiver_.SetDeltaPolicy(options_.delta_policy);
  }

  // The server's state, public to the route files (http_routes_*.cc) that are its member
  // functions' definitions; named as members (trailing underscore) although the class is open.
  // NOLINTBEGIN(readability-identifier-naming)
  Engine* engine_;
  ServerOptions options_;
  ByteTokenizer tokenizer_;
  EngineLoop loop_;
  receiver::RefitReceiver receiver_;
  net::HttpServer server_{http::EngineHttpOptions(options_)};
  std::atomic<int64_t> next_id_{1};
  const std::string id_prefix_ = engine_->boot_id().substr(0, 8) + "-";  // server-made completion ids
  // Completion id -> the engine request ids it runs as ("<id>-<k>" for each prompt x n).
  rc::Mutex live_mu_;
  std::map<std::string, std::vector<std::string>> live_ GUARDED_BY(live_mu_);
  void Track(const std::string& id, const std::vector<std::string>& ids) {
    rc::MutexLock l(live_mu_);
    live_[id] = ids;
  }
  // Reserves a completion id for one request; false when a live completion already has it.
  bool Claim(const std::string& id) {
    rc::MutexLock l(live_mu_);
    return live_.emplace(id, std::vector<std::string>{}).second;
  }
  void Untrack(const std::string& id) {
    rc::MutexLock l(live_mu_);
    live_.erase(id);
  }
  // The engine requests that /abort_requests ids name: a live completion's id stands for its own
  // requests only (so aborting completion "x-0" never hits request 0 of completion "x"); any
  // other id is taken as an engine request id.
  std::vector<std::string> Expand(const std::vector<std::string>& ids) {
    rc::MutexLock l(live_mu_);
    std::vector<std::string> out;
    for (const auto& i : ids) {
      if (auto it = live_.find(i); it != live_.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
      } else {
        out.push_back(i);
      }
    }
    return out;
  }
  const int64_t created_ = WallTimeMs() / 1000;

  // Test-only fault hooks (ServerOptions::enable_fault_injection). Every delay is applied after
  // the operation took effect and before its answer (a late or lost acknowledgement: the
  // ambiguous case a controller has to classify); refuse_install answers 409 before anything is
  // touched. Zero / false everywhere unless a test set them through POST /rc/fault.
  struct Faults {
    std::atomic<int64_t> pause_delay_ms{0};
    std::atomic<int64_t> install_delay_ms{0};
    std::atomic<bool> refuse_install{false};
    std::atomic<bool> fail_install_after_first_rank{false};
    std::atomic<bool> corrupt_delta_install{false};
    std::atomic<int64_t> reset_delay_ms{0};
    std::atomic<int64_t> digest_delay_ms{0};
    std::atomic<int64_t> resume_delay_ms{0};
    std::atomic<bool> swap_q_heads{false};
    Json ToJson() const {
      return Json{{"pause_delay_ms", pause_delay_ms.load()},   {"install_delay_ms", install_delay_ms.load()},
                  {"refuse_install", refuse_install.load()},   {"reset_delay_ms", reset_delay_ms.load()},
                  {"fail_install_after_first_rank", fail_install_after_first_rank.load()},
                  {"corrupt_delta_install", corrupt_delta_install.load()},
                  {"digest_delay_ms", digest_delay_ms.load()}, {"resume_delay_ms", resume_delay_ms.load()},
                  {"swap_q_heads", swap_q_heads.load()}};
    }
  };
  Faults faults_;
  // NOLINTEND(readability-identifier-naming)
  static void Delay(const std::atomic<int64_t>& ms) {
    if (int64_t d = ms.load(); d > 0) std::this_thread::sleep_for(std::chrono::milliseconds(d));
  }

  // Every route, by family (each family in its own file).
  void Routes();                 // http_server.cc: the exception handler, then the families
  void VllmRoutes();             // http_routes_vllm.cc: the vLLM-compatible API
  void RefitRoutes();            // http_routes_refit.cc: /rc/refit/*, /rc/weights, /rc/validate, /rc/engine
  void FaultRoutes();            // http_routes_fault.cc: /rc/fault (only with enable_fault_injection)

  // POST /rc/validate/replay (docs/engine.md, docs/lifecycle.md "Replay validation"): Engine::Replay.
  void Replay(const httplib::Request& req, httplib::Response& res);
  void Completions(const httplib::Request& req, httplib::Response& res);
  std::string Metrics() const;

  template <typename F>
  httplib::Server::Handler Guard(F f) {
    return [f](const httplib::Request& req, httplib::Response& res) {
      try {
        f(req, res);
      } catch (const std::exception& e) {
        http::SendError(res, 500, std::string("internal error: ") + e.what());
      } catch (...) {
        http::SendError(res, 500, "internal error");
      }
    };
  }
};

}  // namespace rc::engine
