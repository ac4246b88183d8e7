#include "rolloutcore/engine/http_server.h"
#include "rolloutcore/engine/receiver.h"

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include <unistd.h>

#include "rolloutcore/base/clock.h"
#include "rolloutcore/base/json.h"
#include "rolloutcore/base/log.h"
#include "rolloutcore/base/version.h"
#include "rolloutcore/base/mutex.h"
#include "rolloutcore/engine/engine_loop.h"
#include "rolloutcore/net/http.h"

namespace rc::engine {
namespace {

constexpr const char* kJson = "application/json";

std::string Dump(const Json& j) { return net::DumpJson(j); }

void SendJson(httplib::Response& res, int status, const Json& j) {
  res.status = status;
  res.set_content(Dump(j), kJson);
}

Json ErrorJson(int status, const std::string& message) {
  const char* type = status == 400   ? "BadRequestError"
                     : status == 401 ? "AuthenticationError"
                     : status == 403 ? "PermissionDeniedError"
                     : status == 404 ? "NotFoundError"
                     : status == 405 ? "MethodNotAllowedError"
                     : status == 409 ? "ConflictError"
                                     : "InternalServerError";
  return {{"object", "error"}, {"error", message}, {"message", message}, {"type", type}, {"code", status}};
}

void SendError(httplib::Response& res, int status, const std::string& message) {
  SendJson(res, status, ErrorJson(status, message));
}

net::HttpServerOptions EngineHttpOptions(const ServerOptions& o) {
  net::HttpServerOptions h;
  h.name = "engine";
  h.host = o.host;
  h.port = o.port;
  h.security = o.security;
  h.max_threads = o.http_threads;
  h.max_body_bytes = size_t{64} << 20;
  h.error_body = [](int status, const Status& s) { return Dump(ErrorJson(status, s.message())); };
  return h;
}

// The host of "scheme://host[:port][/path]" ("::1" for "[::1]:p"); empty when there is none.
std::string UrlHost(std::string_view url) {
  auto scheme = url.find("://");
  std::string_view rest = scheme == std::string_view::npos ? url : url.substr(scheme + 3);
  rest = rest.substr(0, rest.find_first_of("/?#"));
  if (auto at = rest.rfind('@'); at != std::string_view::npos) rest = rest.substr(at + 1);
  if (!rest.empty() && rest.front() == '[') return std::string(rest.substr(1, rest.find(']') - 1));
  return std::string(rest.substr(0, rest.find(':')));
}

std::string TrimSlash(std::string s) {
  while (!s.empty() && s.back() == '/') s.pop_back();
  return s;
}

// POST /rc/refit/stage names the directory to pull from; only the engine's own may be used, or
// (without --directory) one on this host. PermissionDenied names both.
Status CheckStageDirectory(const std::string& configured, const std::string& requested) {
  if (!configured.empty()) {
    if (TrimSlash(requested) == TrimSlash(configured)) return OkStatus();
    return PermissionDenied("directory: this engine stages only from the directory it was started with (--directory " +
                            configured + "), not '" + requested + "'");
  }
  if (net::IsLoopbackHost(UrlHost(requested))) return OkStatus();
  return PermissionDenied("directory: '" + requested + "' is not on this host; an engine started without "
                          "--directory stages only from a loopback directory (start it with --directory URL)");
}

int HttpStatus(const Status& s) {
  switch (s.code()) {
    case StatusCode::kInvalidArgument: return 400;
    case StatusCode::kUnauthenticated: return 401;
    case StatusCode::kPermissionDenied: return 403;
    case StatusCode::kNotFound: return 404;
    case StatusCode::kFailedPrecondition: return 409;
    case StatusCode::kAlreadyExists: return 409;
    case StatusCode::kUnavailable: return 503;
    case StatusCode::kDeadlineExceeded: return 504;
    case StatusCode::kUnimplemented: return 501;
    default: return 500;
  }
}

// Optional boolean query parameter; InvalidArgument naming it when it is not true/false.
Result<std::optional<bool>> BoolParam(const httplib::Request& req, const std::string& name) {
  if (!req.has_param(name.c_str())) return std::optional<bool>();
  const std::string v = req.get_param_value(name.c_str());
  if (v == "true" || v == "True" || v == "1") return std::optional<bool>(true);
  if (v == "false" || v == "False" || v == "0") return std::optional<bool>(false);
  return InvalidArgument(name + ": expected true or false, got '" + v + "'");
}

}  // namespace

Json VersionSpansJson(const std::vector<VersionSpan>& spans) {
  Json out = Json::array();
  for (const VersionSpan& v : spans) {
    out.push_back(Json{{"from_token", v.from_token}, {"to_token", v.to_token}, {"label", v.label},
                       {"install_generation", v.install_generation}, {"kv", SpanKvName(v.kv)}});
  }
  return out;
}

GenerateRequest CompletionGenerateRequest(const CompletionRequest& cr, const std::string& id, size_t prompt,
                                          int64_t k) {
  GenerateRequest g;
  g.request_id = id + "-" + std::to_string(prompt * static_cast<size_t>(cr.n) + static_cast<size_t>(k));
  g.prompt = cr.prompts[prompt];
  g.sampling = cr.sampling;
  if (g.sampling.seed && k > 0) g.sampling.seed = *g.sampling.seed + static_cast<uint64_t>(k);
  g.cache_salt = cr.cache_salt;
  return g;
}

Json CompletionIdentityJson(const Engine& engine) {
  const EngineState st = engine.State();
  return Json{{"boot_id", engine.boot_id()},
              {"label", st.weight_version},
              {"install_generation", st.install_generation}};
}

Json CompletionUsageJson(const std::vector<std::shared_ptr<RequestStream>>& ss) {
  int64_t prompt = 0, completion = 0, cached = 0;
  for (const auto& s : ss) {
    auto snap = s->WaitFrom(SIZE_MAX, std::chrono::milliseconds(0));
    prompt += static_cast<int64_t>(s->prompt().size());
    completion += static_cast<int64_t>(snap.tokens.size());
    cached += snap.cached_tokens;
  }
  return Json{{"prompt_tokens", prompt},
              {"completion_tokens", completion},
              {"total_tokens", prompt + completion},
              {"prompt_tokens_details", {{"cached_tokens", cached}}}};
}

Result<Json> RunCompletion(Engine* engine, const ByteTokenizer& tokenizer, const CompletionRequest& cr,
                           const std::string& id, const std::string& model,
                           const std::function<void(const std::vector<std::string>&)>& on_admitted) {
  // The engine request ids are known before admission; publishing them first means an abort by
  // completion id that arrives while requests are being queued (or already run) finds them.
  std::vector<GenerateRequest> requests;
  std::vector<std::string> ids;
  for (size_t p = 0; p < cr.prompts.size(); ++p) {
    for (int64_t k = 0; k < cr.n; ++k) {
      requests.push_back(CompletionGenerateRequest(cr, id, p, k));
      ids.push_back(requests.back().request_id);
    }
  }
  if (on_admitted) on_admitted(ids);
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (auto& g : requests) {
    auto s = engine->AddRequest(std::move(g));
    if (!s.ok()) {
      engine->Abort(ids);
      return s.status();
    }
    streams.push_back(*s);
  }
  Json choices = Json::array();
  for (size_t i = 0; i < streams.size(); ++i) {
    auto snap = streams[i]->Wait();
    choices.push_back(CompletionChoiceJson(tokenizer, *streams[i], snap, i, 0, cr, true));
  }
  return Json{{"id", id},         {"object", "text_completion"}, {"created", WallTimeMs() / 1000}, {"model", model},
              {"choices", choices}, {"usage", CompletionUsageJson(streams)},
              {"rolloutcore", CompletionIdentityJson(*engine)}};
}

class EngineServer::Impl {
 public:
  Impl(Engine* engine, ServerOptions options)
      : engine_(engine),
        options_(std::move(options)),
        tokenizer_(engine->spec().vocab_size),
        loop_(engine),
        receiver_(engine) {
    receiver_.SetFullVerifyEvery(options_.full_verify_every);
  }

  Engine* engine_;
  ServerOptions options_;
  ByteTokenizer tokenizer_;
  EngineLoop loop_;
  RefitReceiver receiver_;
  net::HttpServer server_{EngineHttpOptions(options_)};
  std::atomic<int64_t> next_id_{1};
  // Completion id -> the engine request ids it runs as ("<id>-<k>" for each prompt x n).
  rc::Mutex live_mu_;
  std::map<std::string, std::vector<std::string>> live_ GUARDED_BY(live_mu_);  // guarded by live_mu_
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
  std::vector<std::string> Expand(const std::vector<std::string>& ids) {
    rc::MutexLock l(live_mu_);
    std::vector<std::string> out;
    for (const auto& i : ids) {
      out.push_back(i);
      if (auto it = live_.find(i); it != live_.end()) out.insert(out.end(), it->second.begin(), it->second.end());
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
  static void Delay(const std::atomic<int64_t>& ms) {
    if (int64_t d = ms.load(); d > 0) std::this_thread::sleep_for(std::chrono::milliseconds(d));
  }
  void FaultRoutes();

  void Routes();
  // POST /rc/validate/replay (docs/engine.md, docs/lifecycle.md "Replay validation"): Engine::Replay.
  void Replay(const httplib::Request& req, httplib::Response& res);
  void Completions(const httplib::Request& req, httplib::Response& res);
  Json ChoiceJson(const RequestStream& stream, const RequestStream::Snapshot& snap, size_t index, size_t from,
                  const CompletionRequest& cr, bool final_chunk) const;
  std::string Metrics() const;

  template <typename F>
  httplib::Server::Handler Guard(F f) {
    return [f](const httplib::Request& req, httplib::Response& res) {
      try {
        f(req, res);
      } catch (const std::exception& e) {
        SendError(res, 500, std::string("internal error: ") + e.what());
      } catch (...) {
        SendError(res, 500, "internal error");
      }
    };
  }
};

Json EngineServer::Impl::ChoiceJson(const RequestStream& stream, const RequestStream::Snapshot& snap, size_t index,
                                    size_t from, const CompletionRequest& cr, bool final_chunk) const {
  return CompletionChoiceJson(tokenizer_, stream, snap, index, from, cr, final_chunk);
}

Json CompletionChoiceJson(const ByteTokenizer& tokenizer_, const RequestStream& stream,
                          const RequestStream::Snapshot& snap, size_t index, size_t from, const CompletionRequest& cr,
                          bool final_chunk) {
  std::vector<int32_t> toks(snap.tokens.begin() + static_cast<long>(from), snap.tokens.end());
  Json c;
  c["index"] = index;
  c["text"] = tokenizer_.Decode(toks);
  if (cr.sampling.num_logprobs >= 0) {
    Json lp;
    Json tokens = Json::array(), token_lp = Json::array(), top = Json::array(), offs = Json::array();
    size_t offset = 0;
    for (size_t i = from; i < snap.tokens.size() && i < snap.logprobs.size(); ++i) {
      tokens.push_back(tokenizer_.TokenString(snap.tokens[i]));
      token_lp.push_back(snap.logprobs[i]);
      Json t = Json::object();
      for (const auto& [id, v] : snap.top_logprobs[i]) t[tokenizer_.TokenString(id)] = v;
      t[tokenizer_.TokenString(snap.tokens[i])] = snap.logprobs[i];
      top.push_back(t);
      offs.push_back(offset);
      offset += tokenizer_.Decode({snap.tokens[i]}).size();
    }
    lp["tokens"] = tokens;
    lp["token_logprobs"] = token_lp;
    lp["top_logprobs"] = top;
    lp["text_offset"] = offs;
    c["logprobs"] = lp;
  } else {
    c["logprobs"] = nullptr;
  }
  if (final_chunk && snap.finished) {
    c["finish_reason"] = std::string(FinishReasonName(snap.finish));
  } else {
    c["finish_reason"] = nullptr;
  }
  c["stop_reason"] = nullptr;
  if (cr.return_token_ids) {
    c["token_ids"] = toks;
    if (from == 0) c["prompt_token_ids"] = stream.prompt();
  }
  c["weight_version"] = stream.weight_version();
  c["install_generation"] = stream.install_generation();
  c["version_spans"] = VersionSpansJson(snap.spans);
  if (snap.aborted_by_pause) c["aborted_by_pause"] = true;
  return c;
}

void EngineServer::Impl::Completions(const httplib::Request& req, httplib::Response& res) {
  auto parsed = ParseCompletionRequest(req.body, tokenizer_);
  if (!parsed.ok()) return SendError(res, 400, parsed.status().message());
  auto cr = std::make_shared<CompletionRequest>(std::move(parsed).value());
  // vLLM answers 404 for a model it does not serve; an empty or missing model means the served one.
  if (!cr->model.empty() && cr->model != options_.model_name) {
    return SendError(res, 404, "model: '" + cr->model + "' is not served here (this engine serves '" +
                                   options_.model_name + "')");
  }
  const std::string id = cr->request_id.empty() ? "cmpl-" + std::to_string(next_id_++) : cr->request_id;
  if (!Claim(id)) {
    return SendError(res, 409, "request_id: '" + id + "' is already in use by a live completion");
  }
  if (!cr->stream) {
    auto out = RunCompletion(engine_, tokenizer_, *cr, id, options_.model_name,
                             [this, &id](const std::vector<std::string>& ids) { Track(id, ids); });
    Untrack(id);
    if (!out.ok()) return SendError(res, HttpStatus(out.status()), out.status().message());
    return SendJson(res, 200, *out);
  }
  std::vector<GenerateRequest> requests;
  std::vector<std::string> ids;
  for (size_t p = 0; p < cr->prompts.size(); ++p) {
    for (int64_t k = 0; k < cr->n; ++k) {
      requests.push_back(CompletionGenerateRequest(*cr, id, p, k));
      ids.push_back(requests.back().request_id);
    }
  }
  Track(id, ids);  // before admission, so an abort by completion id always finds them
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (auto& g : requests) {
    auto s = engine_->AddRequest(std::move(g));
    if (!s.ok()) {
      engine_->Abort(ids);
      Untrack(id);
      return SendError(res, HttpStatus(s.status()), s.status().message());
    }
    streams.push_back(*s);
  }
  const std::string model = options_.model_name;
  auto usage_json = [](const std::vector<std::shared_ptr<RequestStream>>& ss) { return CompletionUsageJson(ss); };
  // Server-sent events: one chunk per new output of any choice, then [DONE].
  auto seen = std::make_shared<std::vector<size_t>>(streams.size(), 0);
  auto done = std::make_shared<std::vector<bool>>(streams.size(), false);
  Engine* engine = engine_;
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, cr, streams, seen, done, id, model, usage_json](size_t, httplib::DataSink& sink) -> bool {
        for (;;) {
          bool all_done = true;
          bool wrote = false;
          for (size_t i = 0; i < streams.size(); ++i) {
            if ((*done)[i]) continue;
            auto snap = streams[i]->WaitFrom((*seen)[i], std::chrono::milliseconds(wrote ? 0 : 20));
            if (snap.tokens.size() > (*seen)[i] || snap.finished) {
              Json chunk = {{"id", id}, {"object", "text_completion"}, {"created", WallTimeMs() / 1000},
                            {"model", model},
                            {"choices", Json::array({ChoiceJson(*streams[i], snap, i, (*seen)[i], *cr, true)})},
                            {"rolloutcore", CompletionIdentityJson(*engine_)}};
              (*seen)[i] = snap.tokens.size();
              if (snap.finished) (*done)[i] = true;
              const std::string line = "data: " + Dump(chunk) + "\n\n";
              if (!sink.write(line.data(), line.size())) return false;
              wrote = true;
            }
            if (!(*done)[i]) all_done = false;
          }
          if (all_done) {
            if (cr->include_usage) {
              Json u = {{"id", id}, {"object", "text_completion"}, {"created", WallTimeMs() / 1000},
                        {"model", model}, {"choices", Json::array()}, {"usage", usage_json(streams)}};
              const std::string line = "data: " + Dump(u) + "\n\n";
              if (!sink.write(line.data(), line.size())) return false;
            }
            const std::string end = "data: [DONE]\n\n";
            sink.write(end.data(), end.size());
            sink.done();
            return true;
          }
          if (wrote) return true;
          if (sink.is_writable && !sink.is_writable()) return false;
        }
      },
      [this, engine, id, ids](bool success) {
        Untrack(id);
        // Client went away: abort what is still running.
        if (!success) engine->Abort(ids);
      });
}

std::string EngineServer::Impl::Metrics() const {
  const EngineMetrics m = engine_->Metrics();
  const EngineState s = engine_->State();
  const std::string label = "{model_name=\"" + options_.model_name + "\"}";
  std::ostringstream o;
  auto metric = [&](const char* name, const char* type, const char* help, auto value, const std::string& labels) {
    o << "# HELP " << name << " " << help << "\n# TYPE " << name << " " << type << "\n"
      << name << labels << " " << value << "\n";
  };
  metric("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in prompt tokens.",
         m.prefix_cache_queries, label);
  metric("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in prompt tokens.", m.prefix_cache_hits,
         label);
  metric("vllm:kv_cache_usage_perc", "gauge", "KV cache usage (1 = 100%).", m.kv_cache_usage, label);
  metric("vllm:num_requests_running", "gauge", "Requests in the running batch.", m.num_running, label);
  metric("vllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled.", m.num_waiting, label);
  metric("vllm:prompt_tokens_total", "counter", "Prefill tokens admitted.", m.prompt_tokens, label);
  metric("vllm:generation_tokens_total", "counter", "Generated tokens.", m.generation_tokens, label);
  metric("vllm:num_preemptions_total", "counter", "Preempted requests.", m.num_preemptions, label);
  o << "# HELP vllm:request_success_total Finished requests by finish reason.\n"
       "# TYPE vllm:request_success_total counter\n";
  for (const char* reason : {"stop", "length", "abort"}) {
    auto it = m.finished_by_reason.find(reason);
    o << "vllm:request_success_total{model_name=\"" << options_.model_name << "\",finished_reason=\"" << reason
      << "\"} " << (it == m.finished_by_reason.end() ? 0 : it->second) << "\n";
  }
  metric("rolloutcore_cache_resets_total", "counter", "Prefix cache resets that succeeded.", m.cache_resets, label);
  metric("rolloutcore_cache_resets_refused_total", "counter", "Prefix cache resets refused (blocks in use).",
         m.cache_resets_refused, label);
  metric("rolloutcore_engine_steps_total", "counter", "Engine steps run.", m.steps, label);
  o << "# HELP rolloutcore_generation_tokens_by_kv_total Generated tokens by the KV state they attended to.\n"
       "# TYPE rolloutcore_generation_tokens_by_kv_total counter\n";
  for (const char* kv : {"fresh", "stale", "recomputed"}) {
    auto it = m.generation_tokens_by_kv.find(kv);
    o << "rolloutcore_generation_tokens_by_kv_total{model_name=\"" << options_.model_name << "\",kv=\"" << kv
      << "\"} " << (it == m.generation_tokens_by_kv.end() ? 0 : it->second) << "\n";
  }
  metric("rolloutcore_inflight_kept_total", "counter",
         "Running requests kept on their (stale) KV across a weight install.", m.inflight_kept, label);
  metric("rolloutcore_inflight_recomputed_total", "counter",
         "Running requests preempted at a weight install to re-prefill under the new weights.",
         m.inflight_recomputed, label);
  metric("rolloutcore_kv_blocks_in_use", "gauge", "KV blocks referenced by requests.", s.blocks_in_use, label);
  metric("rolloutcore_weight_installs_total", "counter",
         "Installs into the live weights begun since the engine started (its install generation).",
         s.install_generation, label);
  metric("rolloutcore_engine_paused", "gauge", "1 while the engine is paused.", s.paused ? 1 : 0, label);
  o << receiver_.MetricsText("model_name=\"" + options_.model_name + "\"");
  return o.str();
}

void EngineServer::Impl::Routes() {
  auto& svr = server_;
  svr.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
    SendError(res, 500, "internal error");
  });

  svr.Post("/v1/completions", Guard([this](const httplib::Request& q, httplib::Response& r) { Completions(q, r); }));
  svr.Get("/v1/models", Guard([this](const httplib::Request&, httplib::Response& r) {
    Json m = {{"id", options_.model_name}, {"object", "model"}, {"created", created_}, {"owned_by", "rolloutcore"},
              {"root", options_.model_name}, {"max_model_len", engine_->max_model_len()}};
    SendJson(r, 200, {{"object", "list"}, {"data", Json::array({m})}});
  }));
  svr.Get("/health", Guard([](const httplib::Request&, httplib::Response& r) {
    r.status = 200;
    r.set_content("", "text/plain");
  }));
  svr.Get("/version", Guard([](const httplib::Request&, httplib::Response& r) {
    SendJson(r, 200, {{"version", kVersion}, {"engine", "rolloutcore"}});
  }));
  svr.Get("/metrics", Guard([this](const httplib::Request&, httplib::Response& r) {
    r.status = 200;
    r.set_content(Metrics(), "text/plain; version=0.0.4");
  }));
  svr.Post("/pause", Guard([this](const httplib::Request& q, httplib::Response& r) {
    std::string mode = q.has_param("mode") ? q.get_param_value("mode") : "abort";
    auto wait = BoolParam(q, "wait_for_inflight_requests");
    if (!wait.ok()) return SendError(r, 400, wait.status().message());
    auto clear = BoolParam(q, "clear_cache");
    if (!clear.ok()) return SendError(r, 400, clear.status().message());
    if (!q.has_param("mode") && wait->has_value()) mode = **wait ? "wait" : "abort";
    auto m = PauseModeFromName(mode);
    if (!m.ok()) return SendError(r, 400, m.status().message());
    // rolloutcore extension: what an install before the next resume does with frozen requests'
    // KV (keep it, stale; or recompute it under the new weights, the default).
    auto kv = InFlightKvFromName(q.has_param("inflight_kv") ? q.get_param_value("inflight_kv") : "recompute");
    if (!kv.ok()) return SendError(r, 400, kv.status().message());
    Status st = engine_->Pause(*m, *kv);
    if (!st.ok()) return SendError(r, HttpStatus(st), st.message());
    Delay(faults_.pause_delay_ms);
    Json out = {{"status", "paused"}, {"mode", mode}, {"inflight_kv", InFlightKvName(*kv)}};
    if (clear->value_or(false)) {
      KvResetEvidence ev = engine_->ResetPrefixCache(false);
      out["cache_reset"] = {{"success", ev.success}, {"freed_blocks", ev.freed_blocks},
                            {"blocks_in_use", ev.blocks_in_use}};
    }
    SendJson(r, 200, out);
  }));
  svr.Post("/resume", Guard([this](const httplib::Request&, httplib::Response& r) {
    engine_->Resume();
    Delay(faults_.resume_delay_ms);
    SendJson(r, 200, {{"status", "resumed"}});
  }));
  svr.Get("/is_paused", Guard([this](const httplib::Request&, httplib::Response& r) {
    SendJson(r, 200, {{"is_paused", engine_->IsPaused()}});
  }));
  svr.Post("/abort_requests", Guard([this](const httplib::Request& q, httplib::Response& r) {
    std::vector<std::string> ids;
    if (!q.body.empty()) {
      auto j = ParseJson(q.body, "request body");
      if (!j.ok()) return SendError(r, 400, j.status().message());
      if (!j->is_object()) return SendError(r, 400, "body: expected a JSON object, got " + JsonTypeName(*j));
      if (auto it = j->find("request_ids"); it != j->end() && !it->is_null()) {
        if (!it->is_array()) return SendError(r, 400, "request_ids: expected a list of strings, got " + JsonTypeName(*it));
        for (size_t i = 0; i < it->size(); ++i) {
          if (!(*it)[i].is_string()) {
            return SendError(r, 400, "request_ids[" + std::to_string(i) + "]: expected a string, got " +
                                         JsonTypeName((*it)[i]));
          }
          ids.push_back((*it)[i].get<std::string>());
        }
      }
    }
    // A completion id stands for all the engine requests it runs as.
    const int64_t n = engine_->Abort(ids.empty() ? ids : Expand(ids));
    SendJson(r, 200, {{"status", "aborted"}, {"aborted", n}});
  }));
  svr.Post("/reset_prefix_cache", Guard([this](const httplib::Request& q, httplib::Response& r) {
    auto running = BoolParam(q, "reset_running_requests");
    if (!running.ok()) return SendError(r, 400, running.status().message());
    KvResetEvidence ev = engine_->ResetPrefixCache(running->value_or(false));
    Delay(faults_.reset_delay_ms);
    SendJson(r, 200, {{"success", ev.success}, {"freed_blocks", ev.freed_blocks}, {"blocks_in_use", ev.blocks_in_use}});
  }));
  for (const char* path : {"/reset_mm_cache", "/reset_encoder_cache"}) {
    svr.Post(path, Guard([](const httplib::Request&, httplib::Response& r) { SendJson(r, 200, {{"success", true}}); }));
  }
  svr.Get("/weight_info", Guard([this](const httplib::Request&, httplib::Response& r) {
    const EngineState s = engine_->State();
    SendJson(r, 200, {{"weight_version", s.weight_version}, {"boot_id", engine_->boot_id()},
                      {"install_generation", s.install_generation}});
  }));
  svr.Post("/update_weight_version", Guard([this](const httplib::Request& q, httplib::Response& r) {
    auto j = ParseJson(q.body, "request body");
    if (!j.ok()) return SendError(r, 400, j.status().message());
    if (!j->is_object()) return SendError(r, 400, "body: expected a JSON object, got " + JsonTypeName(*j));
    auto v = GetString(*j, "new_version", "");
    if (!v.ok()) return SendError(r, 400, v.status().message());
    engine_->SetWeightVersion(*v);
    SendJson(r, 200, {{"success", true}, {"new_version", *v}});
  }));
  // Receiver-driven refit (ENGINE_API.md): stage while serving, install only while paused.
  svr.Post("/rc/refit/stage", Guard([this](const httplib::Request& q, httplib::Response& r) {
    auto j = ParseJson(q.body, "request body");
    if (!j.ok()) return SendError(r, 400, j.status().message());
    StageRequest req;
    auto model = GetString(*j, "model", "");
    if (!model.ok()) return SendError(r, 400, model.status().message());
    auto version = GetString(*j, "version", "");
    if (!version.ok()) return SendError(r, 400, version.status().message());
    auto dir = GetString(*j, "directory", "");
    if (!dir.ok()) return SendError(r, 400, dir.status().message());
    req.model = *model;
    req.version = *version;
    req.directory = *dir;
    if (Status allowed = CheckStageDirectory(options_.directory_url, *dir); !allowed.ok()) {
      return SendError(r, 403, allowed.message());
    }
    auto timeout = GetInt(*j, "timeout_ms", "", req.timeout_ms);
    if (!timeout.ok()) return SendError(r, 400, timeout.status().message());
    if (*timeout < 1 || *timeout > kMaxStageTimeoutMs) {
      return SendError(r, 400, "timeout_ms: must be in [1, " + std::to_string(kMaxStageTimeoutMs) + "], got " +
                                   std::to_string(*timeout));
    }
    req.timeout_ms = *timeout;
    auto use_relays = GetBool(*j, "use_relays", "", false);
    if (!use_relays.ok()) return SendError(r, 400, use_relays.status().message());
    req.use_relays = *use_relays;
    auto receiver_rank = GetInt(*j, "receiver_rank", "", 0);
    if (!receiver_rank.ok()) return SendError(r, 400, receiver_rank.status().message());
    if (*receiver_rank < 0 || *receiver_rank > 1'000'000) {
      return SendError(r, 400, "receiver_rank: must be in [0, 1000000], got " + std::to_string(*receiver_rank));
    }
    req.receiver_rank = static_cast<int32_t>(*receiver_rank);
    auto out = receiver_.Stage(req);
    if (!out.ok()) return SendError(r, HttpStatus(out.status()), out.status().message());
    SendJson(r, 200, *out);
  }));
  // Fan-out (docs/refit.md): serve a staged or live version as a source of it.
  svr.Post("/rc/refit/relay", Guard([this](const httplib::Request& q, httplib::Response& r) {
    auto j = ParseJson(q.body, "request body");
    if (!j.ok()) return SendError(r, 400, j.status().message());
    if (!j->is_object()) return SendError(r, 400, "body: expected a JSON object, got " + JsonTypeName(*j));
    RelayRequest req;
    for (auto [field, dest] : {std::pair<const char*, std::string*>{"model", &req.model}, {"version", &req.version},
                               {"directory", &req.directory}, {"holder", &req.holder}}) {
      auto v = GetString(*j, field, "", field == std::string_view("holder") ? "engine-" + std::to_string(::getpid()) : "");
      if (!v.ok()) return SendError(r, 400, v.status().message());
      *dest = *v;
    }
    if (Status allowed = CheckStageDirectory(options_.directory_url, req.directory); !allowed.ok()) {
      return SendError(r, 403, allowed.message());
    }
    auto out = receiver_.Relay(req);
    if (!out.ok()) return SendError(r, HttpStatus(out.status()), out.status().message());
    SendJson(r, 200, *out);
  }));
  svr.Post("/rc/refit/install", Guard([this](const httplib::Request& q, httplib::Response& r) {
    auto j = ParseJson(q.body, "request body");
    if (!j.ok()) return SendError(r, 400, j.status().message());
    auto version = GetString(*j, "version", "");
    if (!version.ok()) return SendError(r, 400, version.status().message());
    auto skip = GetBool(*j, "skip_cache_reset", "", false);
    if (!skip.ok()) return SendError(r, 400, skip.status().message());
    // Every answer names its install_outcome (docs/engine.md): refused_untouched (409) — nothing
    // live was touched; failed_after_mutation (500) — the live weights may be partial;
    // installed (200). The receiver establishes it where the first live byte is written.
    auto error_with_outcome = [&r](int status, InstallOutcome outcome, const std::string& message) {
      Json body = ErrorJson(status, message);
      body["install_outcome"] = InstallOutcomeName(outcome);
      SendJson(r, status, body);
    };
    if (faults_.refuse_install.load()) {
      return error_with_outcome(409, InstallOutcome::kRefusedUntouched,
                                "install of " + *version + " refused (fault injection): nothing was touched");
    }
    InstallResult out = receiver_.Install(*version, *skip);
    Delay(faults_.install_delay_ms);
    switch (out.outcome) {
      case InstallOutcome::kInstalled: return SendJson(r, 200, out.evidence);
      case InstallOutcome::kRefusedUntouched:
        return error_with_outcome(409, out.outcome, out.status.message());
      case InstallOutcome::kFailedAfterMutation:
        return error_with_outcome(500, out.outcome, out.status.message());
    }
  }));
  svr.Get("/rc/weights/digest", Guard([this](const httplib::Request& q, httplib::Response& r) {
    auto fresh = BoolParam(q, "fresh");
    if (!fresh.ok()) return SendError(r, 400, fresh.status().message());
    auto out = receiver_.LiveDigest(fresh->value_or(false));
    Delay(faults_.digest_delay_ms);
    if (!out.ok()) return SendError(r, HttpStatus(out.status()), out.status().message());
    SendJson(r, 200, *out);
  }));
  svr.Post("/rc/validate/replay", Guard([this](const httplib::Request& q, httplib::Response& r) { Replay(q, r); }));
  svr.Get("/rc/engine/state", Guard([this](const httplib::Request&, httplib::Response& r) {
    // The digest first: one computed at the install generation read next is still current.
    const std::optional<std::string> digest = receiver_.CachedLiveDigest();
    const EngineState s = engine_->State();
    SendJson(r, 200, {{"paused", s.paused}, {"num_running", s.num_running}, {"num_waiting", s.num_waiting},
                      {"blocks_in_use", s.blocks_in_use}, {"num_kv_blocks", s.num_kv_blocks},
                      {"cached_blocks", s.cached_blocks}, {"weight_version", s.weight_version},
                      {"boot_id", engine_->boot_id()}, {"install_generation", s.install_generation},
                      {"content_digest", digest ? Json(*digest) : Json()}});
  }));
  if (options_.enable_fault_injection) FaultRoutes();
}

void EngineServer::Impl::Replay(const httplib::Request& q, httplib::Response& r) {
  auto j = ParseJson(q.body, "request body");
  if (!j.ok()) return SendError(r, 400, j.status().message());
  if (!j->is_object()) return SendError(r, 400, "request body: expected a JSON object, got " + JsonTypeName(*j));
  Status known = CheckKnownKeys(*j, {"probe", "prompt", "steps", "top_k"}, "");
  if (!known.ok()) return SendError(r, 400, known.message());
  auto probe = GetString(*j, "probe", "", std::string());
  if (!probe.ok()) return SendError(r, 400, probe.status().message());
  auto pit = j->find("prompt");
  if (pit == j->end() || !pit->is_array()) return SendError(r, 400, "prompt: expected an array of token ids");
  std::vector<int32_t> prompt;
  for (size_t i = 0; i < pit->size(); ++i) {
    const Json& t = (*pit)[i];
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > INT32_MAX) {
      return SendError(r, 400, "prompt[" + std::to_string(i) + "]: expected a token id, got " + t.dump());
    }
    prompt.push_back(static_cast<int32_t>(t.get<int64_t>()));
  }
  auto steps = GetInt(*j, "steps", "");
  if (!steps.ok()) return SendError(r, 400, steps.status().message());
  auto top_k = GetInt(*j, "top_k", "", 0);
  if (!top_k.ok()) return SendError(r, 400, top_k.status().message());
  auto out = engine_->Replay(prompt, *steps, *top_k);
  if (!out.ok()) return SendError(r, HttpStatus(out.status()), out.status().message());
  Json steps_json = Json::array();
  for (const SampleResult& s : out->steps) {
    Json top = Json::array();
    for (const auto& [t, lp] : s.top_logprobs) top.push_back(Json::array({t, lp}));
    steps_json.push_back(Json{{"token", s.token}, {"logprob", s.logprob}, {"top", top}});
  }
  SendJson(r, 200, Json{{"probe", *probe}, {"steps", steps_json}, {"engine_ms", out->elapsed_ms},
                        {"weight_version", engine_->WeightVersion()},
                        {"install_generation", engine_->State().install_generation}});
}

void EngineServer::Impl::FaultRoutes() {
  RC_LOG_WARN("engine: fault injection is enabled (POST /rc/fault); for tests only");
  // The body replaces the whole fault set: a field left out is cleared, {} clears everything.
  server_.Post("/rc/fault", Guard([this](const httplib::Request& q, httplib::Response& r) {
    auto j = ParseJson(q.body.empty() ? "{}" : q.body, "request body");
    if (!j.ok()) return SendError(r, 400, j.status().message());
    if (!j->is_object()) return SendError(r, 400, "body: expected a JSON object, got " + JsonTypeName(*j));
    Status known = CheckKnownKeys(*j, {"pause_delay_ms", "install_delay_ms", "refuse_install", "reset_delay_ms",
                                       "digest_delay_ms", "resume_delay_ms", "fail_install_after_first_rank",
                                       "corrupt_delta_install", "corrupt_live_weight", "swap_q_heads"},
                                  "fault");
    if (!known.ok()) return SendError(r, 400, known.message());
    int64_t v[5];
    const char* names[5] = {"pause_delay_ms", "install_delay_ms", "reset_delay_ms", "digest_delay_ms",
                            "resume_delay_ms"};
    for (int i = 0; i < 5; ++i) {
      auto x = GetNonNegativeInt(*j, names[i], "", 0);
      if (!x.ok()) return SendError(r, 400, x.status().message());
      constexpr int64_t kMaxFaultDelayMs = 600'000;
      if (*x > kMaxFaultDelayMs) {
        return SendError(r, 400, std::string(names[i]) + ": at most " + std::to_string(kMaxFaultDelayMs) + ", got " +
                                     std::to_string(*x));
      }
      v[i] = *x;
    }
    auto refuse = GetBool(*j, "refuse_install", "refuse_install", false);
    if (!refuse.ok()) return SendError(r, 400, refuse.status().message());
    auto fail_after = GetBool(*j, "fail_install_after_first_rank", "fail_install_after_first_rank", false);
    if (!fail_after.ok()) return SendError(r, 400, fail_after.status().message());
    auto corrupt_delta = GetBool(*j, "corrupt_delta_install", "corrupt_delta_install", false);
    if (!corrupt_delta.ok()) return SendError(r, 400, corrupt_delta.status().message());
    auto corrupt_live = GetBool(*j, "corrupt_live_weight", "corrupt_live_weight", false);
    if (!corrupt_live.ok()) return SendError(r, 400, corrupt_live.status().message());
    if (*corrupt_live) {
      // One-shot: memory corrupted between updates (docs/refit.md "Anchor checks").
      if (Status c = receiver_.CorruptLiveWeightForTesting(); !c.ok()) return SendError(r, 404, c.message());
      RC_LOG_WARN("engine: fault injection: flipped bit 0 of rank 0's model.norm.weight[0]");
    }
    auto swap = GetBool(*j, "swap_q_heads", "swap_q_heads", false);
    if (!swap.ok()) return SendError(r, 400, swap.status().message());
    faults_.pause_delay_ms = v[0];
    faults_.install_delay_ms = v[1];
    faults_.reset_delay_ms = v[2];
    faults_.digest_delay_ms = v[3];
    faults_.resume_delay_ms = v[4];
    faults_.refuse_install = *refuse;
    faults_.fail_install_after_first_rank = *fail_after;
    receiver_.SetFailAfterFirstRankForTesting(*fail_after);
    faults_.corrupt_delta_install = *corrupt_delta;
    receiver_.SetCorruptDeltaInstallForTesting(*corrupt_delta);
    faults_.swap_q_heads = *swap;
    receiver_.SetSwapQHeadsForTesting(*swap);
    RC_LOG_WARN("engine: faults set to {}", faults_.ToJson().dump());
    SendJson(r, 200, faults_.ToJson());
  }));
  server_.Get("/rc/fault", Guard([this](const httplib::Request&, httplib::Response& r) {
    SendJson(r, 200, faults_.ToJson());
  }));
}

EngineServer::EngineServer(Engine* engine, ServerOptions options)
    : impl_(std::make_unique<Impl>(engine, std::move(options))) {}

EngineServer::~EngineServer() { Stop(); }

Status EngineServer::Start() {
  impl_->Routes();
  impl_->loop_.Start();
  if (Status s = impl_->server_.Start(); !s.ok()) {
    impl_->loop_.Stop();
    return s;
  }
  port_ = impl_->server_.port();
  return OkStatus();
}

void EngineServer::Stop() {
  if (!impl_) return;
  impl_->server_.Stop();
  impl_->loop_.Stop();
}

void EngineServer::Wait() { impl_->server_.Wait(); }

}  // namespace rc::engine
