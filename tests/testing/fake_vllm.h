// FakeVllm: a fake vLLM 0.26 or 0.33 (FakeVllmConfig::version) on loopback (cpp-httplib, in the test process) that speaks vLLM's
// endpoints as ../shared/vllm/VLLM_RL_SURFACE.md describes them — /pause?mode&clear_cache,
// /is_paused, /resume, /reset_prefix_cache answering {"success"}, empty-200 mm/encoder resets,
// usage.prompt_tokens_details.cached_tokens, /metrics gauges that nothing refreshes while paused,
// /v1/models, dev routes 404 without dev mode — and rolloutcore's worker-extension protocol over
// POST /collective_rpc (docs/vllm.md): rc_describe, rc_stage, rc_install, rc_label, rc_digest, one
// result per worker; "Method 'x' is not implemented." (500) without the extension. As 0.33
// (../shared/vllm/VLLM_033_NOTES.md, section 6): GET /version, new requests answered 503 while
// paused by /pause in wait/abort mode (queued under keep, and under /sleep?level=0 on both), /update_weight_version + /weight_info (initially
// "default"), choices[i].weight_versions when return_weight_versions is asked, JSON replies of
// /sleep and /wake_up; 0.26 answers 404 to the 0.33-only routes.
//
// Behaviour is scripted through Script() (handlers read it under mu_); observations are read
// under mu_ too. Thread safety: the server's handler threads and the test thread share state only
// under mu_ (running_ is atomic).
#pragma once

#include <httplib.h>

#include <atomic>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "rolloutcore/base/json.h"

namespace rc::testing {

struct FakeVllmConfig {
  int workers = 1;
  bool extension = true;  // rolloutcore.vllm.Extension loaded
  bool dev_mode = true;   // VLLM_SERVER_DEV_MODE=1
  bool prefix_caching = true;
  bool reset_clears = true;  // a successful reset really drops the canary's blocks
  // rc_install's reply also carries the digest fields of rc_digest(fresh=false) (the extension
  // since the fused install); false: the older reply without them.
  bool install_reports_digest = false;
  // vLLM's own weight transfer (--weight-transfer-config): /init_weight_transfer_engine,
  // /start_weight_update, /update_weights, /finish_weight_update with vLLM 0.26's session rules
  // (docs/vllm.md "vLLM's own transfer"), plus the extension's rc_adopt / rc_native_state.
  bool weight_transfer = true;
  std::string version = "0.26.0";  // GET /version; "0.33.x" switches on 0.33's behaviour
  // rc_describe's quantization per worker (empty: the key is left out, as older extensions do).
  std::vector<std::string> quantization = {};
  // rc_install(atomic=True) reaches the engine core (vLLM's uniproc executor, TP=1): it installs,
  // resets the prefix, multimodal and encoder caches and sets 0.33's label in the same call;
  // false: refused untouched ("atomic install: ..."), as from a multiprocessing worker.
  bool engine_side = false;
};

class FakeVllm {
 public:
  using Config = FakeVllmConfig;
  explicit FakeVllm(Config cfg = {}) : cfg_(cfg) {
    labels_.assign(cfg_.workers, "v7");
    generations_.assign(cfg_.workers, 3);
    svr_.Get("/health", [](const httplib::Request&, httplib::Response& r) { r.status = 200; });
    svr_.Get("/version", [this](const httplib::Request&, httplib::Response& r) {
      r.set_content(Json{{"version", cfg_.version}}.dump(), "application/json");
    });
    svr_.Post("/update_weight_version", [this](const httplib::Request& q, httplib::Response& r) {
      if (!Dev(r) || !V033(r)) return;
      Json body = Json::parse(q.body);
      std::lock_guard<std::mutex> lock(mu_);
      weight_version_calls_.push_back(body.value("new_version", std::string()));
      if (!ignore_weight_version_) weight_version_ = body.value("new_version", std::string());
      r.set_content(Json{{"success", true}, {"new_version", body.value("new_version", std::string())}}.dump(),
                    "application/json");
    });
    svr_.Get("/weight_info", [this](const httplib::Request&, httplib::Response& r) {
      if (!Dev(r) || !V033(r)) return;
      std::lock_guard<std::mutex> lock(mu_);
      r.set_content(Json{{"weight_version", weight_version_}}.dump(), "application/json");
    });
    svr_.Get("/rc/engine/state", [](const httplib::Request&, httplib::Response& r) { r.status = 404; });
    svr_.Get("/v1/models", [](const httplib::Request&, httplib::Response& r) {
      r.set_content(R"({"object":"list","data":[{"id":"tiny-qwen3","object":"model"}]})", "application/json");
    });
    svr_.Get("/metrics", [this](const httplib::Request&, httplib::Response& r) {
      r.set_content("# HELP vllm:num_requests_running x\nvllm:num_requests_running{model_name=\"m\"} " +
                        std::to_string(running_.load()) + "\nvllm:num_requests_waiting{model_name=\"m\"} 0\n" +
                        "vllm:num_requests_running_total 99\n",
                    "text/plain");
    });
    svr_.Post("/pause", [this](const httplib::Request& q, httplib::Response& r) {
      if (!Dev(r)) return;
      std::lock_guard<std::mutex> lock(mu_);
      pause_queries_.push_back("mode=" + q.get_param_value("mode") +
                               "&clear_cache=" + q.get_param_value("clear_cache"));
      paused_ = true;
      reject_new_ = is033() && q.get_param_value("mode") != "keep";
      r.set_content(R"({"status":"paused"})", "application/json");
    });
    // /sleep?level=0&mode=M pauses the scheduler like /pause; /wake_up?tags=scheduling resumes it.
    // Both answer an empty 200, as vLLM does.
    svr_.Post("/sleep", [this](const httplib::Request& q, httplib::Response& r) {
      if (!Dev(r)) return;
      std::lock_guard<std::mutex> lock(mu_);
      pause_queries_.push_back("sleep level=" + q.get_param_value("level") + "&mode=" + q.get_param_value("mode"));
      if (q.get_param_value("level") == "0") paused_ = true;  // 0.33 too queues (no reject flag on /sleep)
      if (is033()) {
        r.set_content(Json{{"status", "sleeping"}, {"level", std::stoi("0" + q.get_param_value("level"))}}.dump(),
                      "application/json");
      } else {
        r.status = 200;
      }
    });
    svr_.Post("/wake_up", [this](const httplib::Request& q, httplib::Response& r) {
      if (!Dev(r)) return;
      std::lock_guard<std::mutex> lock(mu_);
      pause_queries_.push_back("wake_up tags=" + q.get_param_value("tags"));
      paused_ = false;
      reject_new_ = false;
      if (is033()) {
        r.set_content(Json{{"status", "awake"}, {"tags", q.get_param_value("tags")}}.dump(), "application/json");
      } else {
        r.status = 200;
      }
    });
    svr_.Post("/resume", [this](const httplib::Request&, httplib::Response& r) {
      if (!Dev(r)) return;
      paused_ = false;
      reject_new_ = false;
      r.set_content(R"({"status":"resumed"})", "application/json");
    });
    svr_.Get("/is_paused", [this](const httplib::Request&, httplib::Response& r) {
      if (!Dev(r)) return;
      r.set_content(Json{{"is_paused", paused_.load()}}.dump(), "application/json");
    });
    svr_.Post("/reset_prefix_cache", [this](const httplib::Request& q, httplib::Response& r) {
      if (!Dev(r)) return;
      std::lock_guard<std::mutex> lock(mu_);
      ++prefix_resets_;
      reset_running_requests_ = q.get_param_value("reset_running_requests");
      bool ok = true;
      if (!reset_answers_.empty()) {
        ok = reset_answers_.front();
        if (reset_answers_.size() > 1) reset_answers_.pop_front();
      }
      if (ok && cfg_.reset_clears) cached_ = false;
      r.set_content(Json{{"success", ok}}.dump(), "application/json");
    });
    for (const char* path : {"/reset_mm_cache", "/reset_encoder_cache"}) {
      svr_.Post(path, [this, path](const httplib::Request&, httplib::Response& r) {
        if (!Dev(r)) return;
        std::lock_guard<std::mutex> lock(mu_);
        ++other_resets_[path];
        r.status = 200;  // vLLM: an empty 200 whatever happened
      });
    }
    svr_.Post("/v1/completions", [this](const httplib::Request& q, httplib::Response& r) {
      Json body = Json::parse(q.body);
      std::lock_guard<std::mutex> lock(mu_);
      completion_bodies_.push_back(body);
      if (reject_new_) {
        // vLLM 0.33 (core.py:1796-1816): paused in wait/abort mode, new requests are turned away.
        ++completions_refused_;
        r.status = 503;
        r.set_content(Json{{"error", {{"message", "The engine is paused: new requests are rejected until resume"},
                                      {"type", "ServiceUnavailableError"},
                                      {"code", 503}}}}.dump(),
                      "application/json");
        return;
      }
      if (stale_gauges_) running_ = 0;  // the step this request causes refreshes the gauges to the truth
      if (paused_) ++completions_while_paused_;
      ++completions_;
      last_model_ = body.value("model", std::string());
      int64_t n = static_cast<int64_t>(body["prompt"].size());
      int64_t hit = cfg_.prefix_caching && cached_ ? n : 0;
      cached_ = true;
      const int64_t max_tokens = body.value("max_tokens", int64_t{16});
      Json choice{{"index", 0}, {"text", ""}, {"finish_reason", "length"},
                  {"token_ids", std::vector<int64_t>(static_cast<size_t>(max_tokens), 7)}};
      if (is033() && body.value("return_weight_versions", false)) {
        choice["weight_versions"] = weight_versions_.is_null()
                                        ? Json::array({Json{{"version", weight_version_}, {"start", 0}, {"end", max_tokens}}})
                                        : weight_versions_;
      }
      r.set_content(Json{{"choices", Json::array({choice})},
                         {"usage", {{"prompt_tokens", n}, {"prompt_tokens_details", {{"cached_tokens", hit}}}}}}
                        .dump(),
                    "application/json");
    });
    svr_.Post("/collective_rpc", [this](const httplib::Request& q, httplib::Response& r) {
      if (!Dev(r)) return;
      Json body = Json::parse(q.body);
      std::string method = body["method"];
      if (!cfg_.extension) {
        r.status = 500;
        r.set_content(Json{{"error",
                            {{"message", "Method '" + method + "' is not implemented."},
                             {"type", "InternalServerError"},
                             {"code", 500}}}}
                          .dump(),
                      "application/json");
        return;
      }
      std::lock_guard<std::mutex> lock(mu_);
      rpc_calls_.push_back(body);
      Json results = Json::array();
      for (int i = 0; i < cfg_.workers; ++i) results.push_back(Rpc(method, body["kwargs"], i));
      r.set_content(Json{{"results", results}}.dump(), "application/json");
    });
    auto wt_error = [](httplib::Response& r, const std::string& msg) {
      r.status = 500;
      r.set_content(
          Json{{"error", {{"message", "Call to collective_rpc method failed: " + msg}, {"code", 500}}}}.dump(),
          "application/json");
    };
    svr_.Post("/init_weight_transfer_engine", [this, wt_error](const httplib::Request& q, httplib::Response& r) {
      if (!Dev(r)) return;
      Json body = Json::parse(q.body);
      {
        std::lock_guard<std::mutex> lock(mu_);
        wt_calls_.push_back("init");
        init_infos_.push_back(body["init_info"]);
        if (!cfg_.weight_transfer) return wt_error(r, "Weight transfer not configured.");
      }
      wt_group_ = true;
      r.set_content(R"({"message":"Weight transfer initialized"})", "application/json");
    });
    svr_.Post("/start_weight_update", [this, wt_error](const httplib::Request&, httplib::Response& r) {
      if (!Dev(r)) return;
      std::lock_guard<std::mutex> lock(mu_);
      wt_calls_.push_back("start");
      if (!cfg_.weight_transfer)
        return wt_error(r, "Weight transfer not configured. Please set weight_transfer_config");
      if (wt_session_) return wt_error(r, "start_weight_update called while a weight update is already active.");
      wt_session_ = true;
      r.set_content(R"({"message":"Weight update started"})", "application/json");
    });
    // Like vLLM's, /update_weights returns only after the broadcast: here it waits (up to 2 s)
    // for the sender's /send to have arrived (sender_sent_, set by the test's fake sender).
    svr_.Post("/update_weights", [this, wt_error](const httplib::Request& q, httplib::Response& r) {
      if (!Dev(r)) return;
      Json body = Json::parse(q.body);
      update_arrived_ = true;
      {
        std::lock_guard<std::mutex> lock(mu_);
        wt_calls_.push_back("update");
        update_infos_.push_back(body["update_info"]);
        if (!wt_session_) return wt_error(r, "start_weight_update must be called before update_weights.");
        if (!wt_group_ || !update_failure_.empty()) {
          wt_session_ = false;  // vLLM resets the session when update_weights raises
          return wt_error(r, wt_group_ ? update_failure_ : "NCCL weight transfer not initialized.");
        }
      }
      for (int i = 0; i < 2000 && !sender_sent_; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      std::lock_guard<std::mutex> lock(mu_);
      if (!sender_sent_) {
        wt_session_ = false;
        return wt_error(r, "broadcast timed out: the trainer never sent");
      }
      r.set_content(R"({"message":"Weights updated"})", "application/json");
    });
    svr_.Post("/finish_weight_update", [this, wt_error](const httplib::Request&, httplib::Response& r) {
      if (!Dev(r)) return;
      std::lock_guard<std::mutex> lock(mu_);
      wt_calls_.push_back("finish");
      if (!wt_session_) return wt_error(r, "finish_weight_update called without a matching start_weight_update.");
      wt_session_ = false;
      r.set_content(R"({"message":"Weight update finished"})", "application/json");
    });
    port_ = svr_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { svr_.listen_after_bind(); });
    while (!svr_.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ~FakeVllm() { Stop(); }
  void Stop() {
    if (thread_.joinable()) {
      svr_.stop();
      thread_.join();
    }
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }

  // Scripted behaviour: set through Script() (the handlers read it under mu_).
  template <typename F>
  void Script(F f) {
    std::lock_guard<std::mutex> lock(mu_);
    f();
  }
  bool paused() const { return paused_.load(); }  // /pause or /sleep?level=0 in force
  std::atomic<int> running_{0};
  std::atomic<bool> stale_gauges_{false};      // running_ is a stale value that the next engine step clears
  std::deque<bool> reset_answers_;             // successive /reset_prefix_cache answers; the last repeats
  std::vector<std::string> install_outcomes_;  // per worker; empty: "installed" everywhere
  Json stage_failure_;                         // a worker's {"ok": false, ...} for rc_stage (rank 0)
  std::vector<Json> digest_results_;           // per worker rc_digest result
  std::vector<std::string> labels_;
  std::vector<int64_t> generations_;
  std::string update_failure_;                    // non-empty: /update_weights raises this (session reset)
  std::string live_digest_ = "0123456789abcdef";  // what rc_adopt's fresh digest reads
  std::atomic<bool> wt_group_{false};             // the weight-transfer group is formed
  std::atomic<bool> sender_sent_{false};          // the trainer's /send arrived (the test's fake sender sets it)
  std::atomic<bool> update_arrived_{false};       // /update_weights arrived (the fake sender waits for it)
  // 0.33: vLLM's own label, whether /update_weight_version is ignored (a fault), the weight_versions
  // a completion reports (null: one span of the current label), rc_frozen's requests.
  std::string weight_version_ = "default";
  bool ignore_weight_version_ = false;
  Json weight_versions_;
  Json frozen_ = Json::array();

  // Observations.
  std::mutex mu_;
  std::vector<std::string> pause_queries_;
  std::vector<Json> rpc_calls_;
  int prefix_resets_ = 0;
  int engine_side_installs_ = 0;  // rc_install(atomic=True) calls that installed and reset
  std::map<std::string, int> other_resets_;
  int completions_ = 0;
  int completions_while_paused_ = 0;
  std::string last_model_;
  std::string reset_running_requests_;
  std::vector<std::string> wt_calls_;  // init, start, update, finish in arrival order
  std::vector<Json> init_infos_;
  std::vector<Json> update_infos_;
  bool wt_session_ = false;
  std::vector<std::string> weight_version_calls_;  // /update_weight_version's new_version, in order
  std::vector<Json> completion_bodies_;             // every /v1/completions body
  int completions_refused_ = 0;                     // answered 503 (0.33 paused in wait/abort)

 private:
  bool is033() const { return cfg_.version.rfind("0.33.", 0) == 0; }
  bool V033(httplib::Response& r) {
    if (is033()) return true;
    r.status = 404;
    r.set_content(R"({"detail":"Not Found"})", "application/json");
    return false;
  }
  bool Dev(httplib::Response& r) {
    if (cfg_.dev_mode) return true;
    r.status = 404;
    r.set_content(R"({"detail":"Not Found"})", "application/json");
    return false;
  }
  Json Rpc(const std::string& method, const Json& kwargs, int rank) {
    if (method == "rc_describe") {
      Json d{{"ok", true},
                  {"extension_version", "0.1"},
                  {"boot_id", "b1"},
                  {"tp_rank", rank},
                  {"tp_size", cfg_.workers},
                  {"device", "cuda:" + std::to_string(rank)},
                  {"label", labels_[rank]},
                  {"generation", generations_[rank]},
                  {"captured", true},
                  {"data_ptrs_stable", true}};
      if (static_cast<size_t>(rank) < cfg_.quantization.size()) d["quantization"] = cfg_.quantization[rank];
      d["install"] = Json{{"mode", "copy"},
                          {"atomic", {{"available", cfg_.engine_side},
                                      {"reason", cfg_.engine_side ? Json() : Json("worker in its own process")}}}};
      return d;
    }
    if (method == "rc_stage") {
      if (rank == 0 && !stage_failure_.is_null()) return stage_failure_;
      return Json{{"ok", true},
                  {"version", kwargs["version"]},
                  {"mode", "full"},
                  {"transport", "cuda_ipc"},
                  {"bytes_needed", 1000},
                  {"bytes_planned", 1000 + rank},
                  {"bytes_pulled", 1000},
                  {"stage_ms", {{"total", 12.5}}},
                  {"staged_digest", "00000000000000aa"}};
    }
    if (method == "rc_install") {
      const bool atomic = kwargs.value("atomic", false);
      if (atomic && (!cfg_.engine_side || running_.load() > 0)) {
        return Json{{"ok", false}, {"outcome", "refused_untouched"}, {"code", "FailedPrecondition"},
                    {"error", cfg_.engine_side ? "atomic install: the engine is not idle (1 request(s) in flight)"
                                               : "atomic install: vLLM's engine core is not on this call's stack"},
                    {"label", labels_[rank]}, {"generation", generations_[rank]}};
      }
      std::string outcome = install_outcomes_.empty() ? "installed" : install_outcomes_[rank];
      Json r{{"ok", outcome == "installed"}, {"outcome", outcome}};
      if (outcome == "installed") {
        labels_[rank] = kwargs["version"];
        generations_[rank] += 1;
        r["bytes_installed"] = 500;
        r["install_ms"] = 3;
      } else {
        r["code"] = outcome == "refused_untouched" ? "FailedPrecondition" : "Internal";
        r["error"] = outcome == "refused_untouched" ? "nothing staged for " + kwargs["version"].get<std::string>()
                                                    : "copy failed on layer 3";
      }
      r["label"] = labels_[rank];
      r["generation"] = generations_[rank];
      if (cfg_.install_reports_digest && outcome == "installed") {
        Json d = rank < static_cast<int>(digest_results_.size())
                     ? digest_results_[rank]
                     : Json{{"ok", true}, {"content_digest", "0123456789abcdef"}};
        for (const char* k : {"content_digest", "tensor_sums", "fp8"}) {
          if (d.contains(k)) r[k] = d[k];
        }
        r["digest_source"] = "fused";
      }
      if (atomic && outcome == "installed") {
        // The engine half, in this call: the caches reset (as a successful /reset_prefix_cache
        // does) and, on 0.33, vLLM's own label.
        ++engine_side_installs_;
        const bool ok = reset_answers_.empty() || reset_answers_.front();
        if (!ok) {
          // The extension: the weights are in, the cache is not reset: failed after mutation.
          return Json{{"ok", false}, {"outcome", "failed_after_mutation"}, {"code", "Internal"},
                      {"error", "rc_install: vLLM's reset_prefix_cache answered false after the install"},
                      {"label", "<unknown after a failed install>"}, {"generation", generations_[rank]}};
        }
        if (cfg_.reset_clears) cached_ = false;
        if (is033() && !ignore_weight_version_) weight_version_ = kwargs["version"].get<std::string>();
        r["atomic"] = Json{{"engine", "EngineCoreProc"}, {"prefix_cache_reset", true}, {"reset_mm_cache", true},
                           {"reset_encoder_cache", true}, {"vllm_label", is033() ? kwargs["version"] : Json()}};
      }
      return r;
    }
    if (method == "rc_adopt") {
      if (rank == 0) wt_calls_.push_back("rc_adopt");
      if (kwargs.value("content_digest", std::string()) != live_digest_) {
        return Json{{"ok", false},
                    {"code", "DataLoss"},
                    {"outcome", "failed_after_mutation"},
                    {"error", "live digest " + live_digest_ + " != the manifest's " +
                                  kwargs.value("content_digest", std::string())},
                    {"label", labels_[rank]},
                    {"generation", generations_[rank]}};
      }
      labels_[rank] = kwargs["version"];
      generations_[rank] += 1;
      return Json{{"ok", true},
                  {"outcome", "installed"},
                  {"label", labels_[rank]},
                  {"generation", generations_[rank]},
                  {"bytes_installed", 500},
                  {"install_ms", 1},
                  {"content_digest", live_digest_},
                  {"digest_source", "reread"}};
    }
    if (method == "rc_native_state") {
      if (rank == 0)
        wt_calls_.push_back(kwargs.value("restore", false) ? "rc_native_state(restore)" : "rc_native_state");
      Json st{{"session_active", wt_session_}, {"layers_in_reload", 0}, {"meta_parameters", 0}};
      return Json{{"ok", true}, {"before", st}, {"restored", false}, {"after", st}};
    }
    if (method == "rc_frozen") return Json{{"ok", true}, {"requests", frozen_}};
    if (method == "rc_label") {
      return Json{{"ok", true},
                  {"label", labels_[rank]},
                  {"generation", generations_[rank]},
                  {"boot_id", "b1"},
                  {"content_digest", nullptr}};
    }
    if (method == "rc_digest") {
      if (rank < static_cast<int>(digest_results_.size())) return digest_results_[rank];
      return Json{{"ok", true}, {"content_digest", "0123456789abcdef"}, {"label", labels_[rank]}};
    }
    return Json{{"ok", false}, {"code", "InvalidArgument"}, {"error", "unknown method " + method}};
  }

  Config cfg_;
  httplib::Server svr_;
  std::thread thread_;
  int port_ = 0;
  std::atomic<bool> paused_{false};
  std::atomic<bool> reject_new_{false};  // 0.33 paused in wait/abort mode
  bool cached_ = false;  // guarded by mu_
};

}  // namespace rc::testing
