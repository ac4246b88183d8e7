// EngineServer: the server's life, the helpers every route file shares, the completion pieces
// of http_server.h, and the one place the route families are registered. The routes themselves
// live in http_routes_vllm.cc, http_routes_refit.cc and http_routes_fault.cc.
#include "rolloutcore/engine/http_server.h"

#include "engine/http_server_impl.h"
#include "rolloutcore/net/http_status.h"

namespace rc::engine {
namespace http {

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
                     : status == 413 ? "PayloadTooLargeError"
                     : status == 431 ? "RequestHeaderFieldsTooLargeError"
                     : status == 501 ? "NotImplementedError"
                     : status == 503 ? "ServiceUnavailableError"
                     : status == 504 ? "GatewayTimeoutError"
                                     : "InternalServerError";
  // vLLM's ErrorResponse, {"error": {message, type, param, code}}, plus the same three at the top
  // level (what rolloutcore's own clients read).
  return {{"object", "error"},
          {"error", {{"message", message}, {"type", type}, {"param", nullptr}, {"code", status}}},
          {"message", message},
          {"type", type},
          {"code", status}};
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

int HttpStatus(const Status& s) { return net::HttpStatusFor(s); }


}  // namespace http

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

Json CompletionUsageJson(const std::vector<std::shared_ptr<RequestStream>>& ss, int64_t n) {
  // Streams are prompt-major, n samples per prompt: a prompt (and its cached part) counts once, as
  // vLLM counts it, and every sample's output counts.
  int64_t prompt = 0, completion = 0, cached = 0;
  for (size_t i = 0; i < ss.size(); ++i) {
    auto snap = ss[i]->WaitFrom(SIZE_MAX, std::chrono::milliseconds(0));
    if (n <= 1 || i % static_cast<size_t>(n) == 0) {
      prompt += static_cast<int64_t>(ss[i]->prompt().size());
      cached += snap.cached_tokens;
    }
    completion += static_cast<int64_t>(snap.tokens.size());
  }
  return Json{{"prompt_tokens", prompt},
              {"completion_tokens", completion},
              {"total_tokens", prompt + completion},
              {"prompt_tokens_details", {{"cached_tokens", cached}}}};
}

std::vector<GenerateRequest> CompletionGenerateRequests(const CompletionRequest& cr, const std::string& id,
                                                        std::vector<std::string>* ids) {
  std::vector<GenerateRequest> requests;
  for (size_t p = 0; p < cr.prompts.size(); ++p) {
    for (int64_t k = 0; k < cr.n; ++k) {
      requests.push_back(CompletionGenerateRequest(cr, id, p, k));
      ids->push_back(requests.back().request_id);
    }
  }
  return requests;
}

Result<std::vector<std::shared_ptr<RequestStream>>> AdmitCompletion(Engine* engine, const CompletionRequest& cr,
                                                                    std::vector<GenerateRequest> requests,
                                                                    const std::vector<std::string>& ids) {
  // Every prompt is checked before any is queued: a bad one refuses the whole completion with
  // nothing run (no tokens counted, no abort), and the message names it.
  const size_t n = static_cast<size_t>(std::max<int64_t>(1, cr.n));
  for (size_t i = 0; i < requests.size(); i += n) {
    const std::string field = cr.prompts.size() == 1 ? "prompt" : "prompt[" + std::to_string(i / n) + "]";
    RC_RETURN_IF_ERROR(engine->CheckRequest(requests[i], field));
  }
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (auto& g : requests) {
    auto s = engine->AddRequest(std::move(g));
    if (!s.ok()) {  // a request id taken meanwhile, or the engine refusing while paused
      engine->Abort(ids);
      return s.status();
    }
    streams.push_back(*s);
  }
  return streams;
}

Result<Json> RunCompletion(Engine* engine, const ByteTokenizer& tokenizer, const CompletionRequest& cr,
                           const std::string& id, const std::string& model,
                           const std::function<void(const std::vector<std::string>&)>& on_admitted) {
  // The engine request ids are known before admission; publishing them first means an abort by
  // completion id that arrives while requests are being queued (or already run) finds them.
  std::vector<std::string> ids;
  std::vector<GenerateRequest> requests = CompletionGenerateRequests(cr, id, &ids);
  if (on_admitted) on_admitted(ids);
  RC_ASSIGN_OR_RETURN(auto streams, AdmitCompletion(engine, cr, std::move(requests), ids));
  Json choices = Json::array();
  for (size_t i = 0; i < streams.size(); ++i) {
    auto snap = streams[i]->Wait();
    choices.push_back(CompletionChoiceJson(tokenizer, *streams[i], snap, i, 0, cr, true));
  }
  return Json{{"id", id},         {"object", "text_completion"}, {"created", WallTimeMs() / 1000}, {"model", model},
              {"choices", choices}, {"usage", CompletionUsageJson(streams, cr.n)},
              {"rolloutcore", CompletionIdentityJson(*engine)}};
}


Json CompletionChoiceJson(const ByteTokenizer& tokenizer, const RequestStream& stream,
                          const RequestStream::Snapshot& snap, size_t index, size_t from, const CompletionRequest& cr,
                          bool final_chunk, size_t* text_sent) {
  std::vector<int32_t> toks(snap.tokens.begin() + static_cast<long>(from), snap.tokens.end());
  Json c;
  c["index"] = index;
  // Bytes of the output so far; a stream sends what ends on a character boundary and keeps the
  // start of an unfinished character for the next chunk (the last chunk sends everything).
  const std::string all = tokenizer.Decode(snap.tokens);
  if (text_sent == nullptr) {
    c["text"] = tokenizer.Decode(toks);
  } else {
    const bool last = final_chunk && snap.finished;
    const size_t cut = std::max(*text_sent, last ? all.size() : ByteTokenizer::CompleteTextBytes(all));
    c["text"] = all.substr(*text_sent, cut - *text_sent);
    *text_sent = cut;
  }
  if (cr.sampling.num_logprobs >= 0) {
    Json lp;
    Json tokens = Json::array(), token_lp = Json::array(), top = Json::array(), offs = Json::array();
    // text_offset: characters of the output's text before the token (what a stream has shown by
    // then), counted from the first output token in every chunk, as vLLM counts them.
    size_t bytes_before = tokenizer.Decode({snap.tokens.begin(), snap.tokens.begin() + static_cast<long>(from)}).size();
    for (size_t i = from; i < snap.tokens.size() && i < snap.logprobs.size(); ++i) {
      tokens.push_back(tokenizer.TokenString(snap.tokens[i]));
      token_lp.push_back(snap.logprobs[i]);
      Json t = Json::object();
      for (const auto& [id, v] : snap.top_logprobs[i]) t[tokenizer.TokenString(id)] = v;
      t[tokenizer.TokenString(snap.tokens[i])] = snap.logprobs[i];
      top.push_back(t);
      const std::string_view before = std::string_view(all).substr(0, bytes_before);
      offs.push_back(ByteTokenizer::TextLength(before.substr(0, ByteTokenizer::CompleteTextBytes(before))));
      bytes_before += tokenizer.Decode({snap.tokens[i]}).size();
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
  c["stop_reason"] = final_chunk && snap.finished && snap.stop_token ? Json(*snap.stop_token) : Json(nullptr);
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

void EngineServer::Impl::Routes() {
  server_.set_exception_handler([](const httplib::Request&, httplib::Response& res, const std::exception_ptr&) {
    http::SendError(res, 500, "internal error");
  });
  VllmRoutes();
  RefitRoutes();
  if (options_.enable_fault_injection) FaultRoutes();
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
