// The vLLM-compatible routes of the embedded engine (ENGINE_API.md; docs/engine.md "Endpoints"):
// completions, models, health, version, metrics, pause / resume, aborts, cache resets and the
// weight version label.
#include <sstream>

#include "engine/http_requests.h"
#include "engine/http_server_impl.h"
#include "rolloutcore/base/metrics_writer.h"
#include "rolloutcore/base/version.h"

namespace rc::engine {

using http::Dump;
using http::HttpStatus;
using http::SendError;
using http::SendJson;

namespace {
// A prefix-cache reset's evidence as vLLM-shaped JSON (/reset_prefix_cache's body, and the
// cache_reset of /pause and /sleep).
Json KvResetJson(const KvResetEvidence& ev) {
  return {{"success", ev.success}, {"freed_blocks", ev.freed_blocks}, {"blocks_in_use", ev.blocks_in_use}};
}
}  // namespace

void EngineServer::Impl::Completions(const httplib::Request& req, httplib::Response& res) {
  auto parsed = ParseCompletionRequest(req.body, tokenizer_);
  if (!parsed.ok()) return SendError(res, 400, parsed.status().message());
  auto cr = std::make_shared<CompletionRequest>(std::move(parsed).value());
  // vLLM answers 404 for a model it does not serve; an empty or missing model means the served one.
  if (!cr->model.empty() && cr->model != options_.model_name) {
    return SendError(res, 404, "model: '" + cr->model + "' is not served here (this engine serves '" +
                                   options_.model_name + "')");
  }
  std::string id = cr->request_id;
  if (id.empty()) {
    // The server's own ids carry a random part (as vLLM's do) and skip any a client has taken.
    do {
      id = "cmpl-" + id_prefix_ + std::to_string(next_id_++);
    } while (!Claim(id));
  } else if (!Claim(id)) {
    return SendError(res, 409, "request_id: '" + id + "' is already in use by a live completion");
  }
  if (!cr->stream) {
    auto out = RunCompletion(engine_, tokenizer_, *cr, id, options_.model_name,
                             [this, &id](const std::vector<std::string>& ids) { Track(id, ids); });
    Untrack(id);
    if (!out.ok()) return SendError(res, HttpStatus(out.status()), out.status().message());
    return SendJson(res, 200, *out);
  }
  std::vector<std::string> ids;
  std::vector<GenerateRequest> requests = CompletionGenerateRequests(*cr, id, &ids);
  Track(id, ids);  // before admission, so an abort by completion id always finds them
  auto admitted = AdmitCompletion(engine_, *cr, std::move(requests), ids);
  if (!admitted.ok()) {
    Untrack(id);
    return SendError(res, HttpStatus(admitted.status()), admitted.status().message());
  }
  std::vector<std::shared_ptr<RequestStream>> streams = std::move(admitted).value();
  const std::string model = options_.model_name;
  // Server-sent events: one chunk per new output of any choice, then [DONE].
  auto seen = std::make_shared<std::vector<size_t>>(streams.size(), 0);
  auto text_sent = std::make_shared<std::vector<size_t>>(streams.size(), 0);
  auto done = std::make_shared<std::vector<bool>>(streams.size(), false);
  Engine* engine = engine_;
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, cr, streams, seen, text_sent, done, id, model](size_t, httplib::DataSink& sink) -> bool {
        for (;;) {
          bool all_done = true;
          bool wrote = false;
          for (size_t i = 0; i < streams.size(); ++i) {
            if ((*done)[i]) continue;
            auto snap = streams[i]->WaitFrom((*seen)[i], std::chrono::milliseconds(wrote ? 0 : 20));
            if (snap.tokens.size() > (*seen)[i] || snap.finished) {
              Json choice = CompletionChoiceJson(tokenizer_, *streams[i], snap, i, (*seen)[i], *cr, true,
                                                 &(*text_sent)[i]);
              Json chunk = {{"id", id}, {"object", "text_completion"}, {"created", WallTimeMs() / 1000},
                            {"model", model},
                            {"choices", Json::array({std::move(choice)})},
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
                        {"model", model}, {"choices", Json::array()}, {"usage", CompletionUsageJson(streams, cr->n)}};
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
  const MetricLabels labels = {{"model_name", options_.model_name}};
  constexpr MetricType kCounter = MetricType::kCounter;
  constexpr MetricType kGauge = MetricType::kGauge;
  MetricsWriter w;
  auto metric = [&](const char* name, MetricType type, const char* help, auto value) {
    w.Metric(name, type, help, labels, value);
  };
  // A family with one sample per key of `by`, labelled `label`=key (0 for a key not counted yet).
  auto by_label = [&](const char* name, const char* help, const char* label, const auto& keys, const auto& by) {
    w.Family(name, kCounter, help);
    for (const char* key : keys) {
      auto it = by.find(key);
      w.Sample(name, WithLabel(labels, label, key), it == by.end() ? 0 : it->second);
    }
  };
  metric("vllm:prefix_cache_queries_total", kCounter, "Prefix cache queries, in prompt tokens.",
         m.prefix_cache_queries);
  metric("vllm:prefix_cache_hits_total", kCounter, "Prefix cache hits, in prompt tokens.", m.prefix_cache_hits);
  metric("vllm:kv_cache_usage_perc", kGauge, "KV cache usage (1 = 100%).", m.kv_cache_usage);
  metric("vllm:num_requests_running", kGauge, "Requests in the running batch.", m.num_running);
  metric("vllm:num_requests_waiting", kGauge, "Requests waiting to be scheduled.", m.num_waiting);
  metric("vllm:prompt_tokens_total", kCounter, "Prefill tokens admitted.", m.prompt_tokens);
  metric("vllm:generation_tokens_total", kCounter, "Generated tokens.", m.generation_tokens);
  metric("vllm:num_preemptions_total", kCounter, "Preempted requests.", m.num_preemptions);
  by_label("vllm:request_success_total", "Finished requests by finish reason.", "finished_reason",
           std::initializer_list<const char*>{"stop", "length", "abort"}, m.finished_by_reason);
  metric("rolloutcore_cache_resets_total", kCounter, "Prefix cache resets that succeeded.", m.cache_resets);
  metric("rolloutcore_cache_resets_refused_total", kCounter, "Prefix cache resets refused (blocks in use).",
         m.cache_resets_refused);
  metric("rolloutcore_engine_steps_total", kCounter, "Engine steps run.", m.steps);
  by_label("rolloutcore_generation_tokens_by_kv_total", "Generated tokens by the KV state they attended to.", "kv",
           std::initializer_list<const char*>{"fresh", "stale", "recomputed"}, m.generation_tokens_by_kv);
  metric("rolloutcore_inflight_kept_total", kCounter,
         "Running requests kept on their (stale) KV across a weight install.", m.inflight_kept);
  metric("rolloutcore_inflight_recomputed_total", kCounter,
         "Running requests preempted at a weight install to re-prefill under the new weights.", m.inflight_recomputed);
  metric("rolloutcore_kv_blocks_in_use", kGauge, "KV blocks referenced by requests.", s.blocks_in_use);
  metric("rolloutcore_weight_installs_total", kCounter,
         "Installs into the live weights begun since the engine started (its install generation).",
         s.install_generation);
  metric("rolloutcore_engine_paused", kGauge, "1 while the engine is paused.", s.paused ? 1 : 0);
  receiver_.WriteMetrics(&w, labels);
  return w.Text();
}

void EngineServer::Impl::VllmRoutes() {
  auto& svr = server_;
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
    auto p = ParsePauseQuery(q.params);
    if (!p.ok()) return SendError(r, 400, p.status().message());
    Status st = engine_->Pause(p->mode, p->inflight_kv);
    if (!st.ok()) return SendError(r, HttpStatus(st), st.message());
    Delay(faults_.pause_delay_ms);
    Json out = {{"status", "paused"}, {"mode", p->mode_name}, {"inflight_kv", InFlightKvName(p->inflight_kv)}};
    if (p->clear_cache) {
      out["cache_reset"] = KvResetJson(engine_->ResetPrefixCache(false));
    }
    SendJson(r, 200, out);
  }));
  svr.Post("/resume", Guard([this](const httplib::Request&, httplib::Response& r) {
    engine_->Resume();
    Delay(faults_.resume_delay_ms);
    SendJson(r, 200, {{"status", "resumed"}});
  }));
  // vLLM's sleep: level 0 pauses scheduling; level 1 also drops the KV cache (vLLM frees the GPU
  // memory of weights and KV; the embedded engine keeps its weights in host memory, so only the
  // cache goes). wake_up resumes whatever its tags (no weights are asleep to wake one by one).
  svr.Post("/sleep", Guard([this](const httplib::Request& q, httplib::Response& r) {
    auto p = ParseSleepQuery(q.params);
    if (!p.ok()) return SendError(r, 400, p.status().message());
    Status st = engine_->Pause(p->pause.mode, p->pause.inflight_kv);
    if (!st.ok()) return SendError(r, HttpStatus(st), st.message());
    Json out = {{"status", "sleeping"}, {"level", p->level}, {"mode", p->pause.mode_name}};
    if (p->level >= 1 || p->pause.clear_cache) {
      out["cache_reset"] = KvResetJson(engine_->ResetPrefixCache(false));
    }
    SendJson(r, 200, out);
  }));
  svr.Post("/wake_up", Guard([this](const httplib::Request&, httplib::Response& r) {
    engine_->Resume();
    SendJson(r, 200, {{"status", "resumed"}});
  }));
  svr.Get("/is_sleeping", Guard([this](const httplib::Request&, httplib::Response& r) {
    SendJson(r, 200, {{"is_sleeping", engine_->IsPausedOrDraining()}});
  }));
  svr.Get("/is_paused", Guard([this](const httplib::Request&, httplib::Response& r) {
    SendJson(r, 200, {{"is_paused", engine_->IsPausedOrDraining()}});
  }));
  svr.Post("/abort_requests", Guard([this](const httplib::Request& q, httplib::Response& r) {
    auto body = ParseAbortRequestsBody(q.body);
    if (!body.ok()) return SendError(r, 400, body.status().message());
    const std::vector<std::string>& ids = body->request_ids;
    // A completion id stands for all the engine requests it runs as.
    const int64_t n = engine_->Abort(ids.empty() ? ids : Expand(ids));
    SendJson(r, 200, {{"status", "aborted"}, {"aborted", n}});
  }));
  svr.Post("/reset_prefix_cache", Guard([this](const httplib::Request& q, httplib::Response& r) {
    auto running = ParseResetPrefixCacheQuery(q.params);
    if (!running.ok()) return SendError(r, 400, running.status().message());
    KvResetEvidence ev = engine_->ResetPrefixCache(*running);
    Delay(faults_.reset_delay_ms);
    SendJson(r, 200, KvResetJson(ev));
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
    auto body = ParseUpdateWeightVersionBody(q.body);
    if (!body.ok()) return SendError(r, 400, body.status().message());
    engine_->SetWeightVersion(body->new_version);
    SendJson(r, 200, {{"success", true}, {"new_version", body->new_version}});
  }));
}

}  // namespace rc::engine
