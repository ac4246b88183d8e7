#include "adapters/vllm_engine.h"

#include "adapters/lifecycle_types.h"

#include <algorithm>
#include <cstdio>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <optional>
#include <thread>
#include <utility>

#include "rolloutcore/adapters/http_adapter.h"
#include "rolloutcore/base/content_digest.h"
#include "rolloutcore/base/hash.h"
#include "rolloutcore/base/log.h"
#include "rolloutcore/base/mutex.h"
#include "rolloutcore/refit/digest.h"

namespace rc::adapters::internal {

using lifecycle::InstallOutcome;

namespace {

constexpr const char* kServeFlags =
    "start vLLM with --worker-extension-cls rolloutcore.vllm.Extension and VLLM_SERVER_DEV_MODE=1 "
    "(plus --enable-prompt-tokens-details --enable-prefix-caching; see docs/vllm.md)";

Result<uint64_t> ParseHex64(const Json& v, const std::string& what) {
  if (!v.is_string()) return DataLoss(what + ": expected a 16-digit hex string, got " + JsonTypeName(v));
  auto d = ContentDigest::ParseHex(v.get_ref<const std::string&>(), what);
  if (!d.ok()) return DataLoss(d.status().message());  // the engine's reply is bad, not our input
  return *d;
}

void SleepMs(int64_t ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

// One HTTP call on a detached thread (the native path's concurrent halves: each blocks on the same
// collective, so neither may wait for the other). The thread owns copies of everything it uses.
struct BackgroundCall {
  std::mutex mu;
  std::condition_variable cv;
  std::optional<Result<HttpReply>> result;  // guarded by mu
  std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
  int64_t ms = -1;  // guarded by mu
};

std::shared_ptr<BackgroundCall> StartBackground(HttpCall call, std::string method, std::string path, std::string body) {
  auto b = std::make_shared<BackgroundCall>();
  std::thread([b, call = std::move(call), method = std::move(method), path = std::move(path),
               body = std::move(body)]() {
    Result<HttpReply> r = call ? call(method, path, body) : Result<HttpReply>(Internal("no trainer call configured"));
    std::lock_guard<std::mutex> lock(b->mu);
    b->ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - b->started).count();
    b->result.emplace(std::move(r));
    b->cv.notify_all();
  }).detach();
  return b;
}

// The call's result, or nullopt when it has not finished by `deadline` (it keeps running).
std::optional<Result<HttpReply>> JoinBackground(BackgroundCall& b, std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(b.mu);
  b.cv.wait_until(lock, deadline, [&] { return b.result.has_value(); });
  return b.result;
}

int64_t MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
}

// The sender's reply: 200 → its JSON; otherwise its {"code", "error"} as a Status naming the URL.
Result<Json> SenderJson(const Result<HttpReply>& r, const std::string& what) {
  if (!r.ok()) return r.status().WithContext(what);
  if (r->status != 200) {
    auto j = ParseJson(r->body, what);
    std::string msg = what + " answered " + std::to_string(r->status) + ": ";
    if (j.ok() && j->is_object() && j->contains("error")) {
      msg += (*j)["error"].is_string() ? (*j)["error"].get<std::string>() : (*j)["error"].dump();
      std::string code = j->value("code", std::string());
      if (auto c = StatusCodeFromName(code); c && *c != StatusCode::kOk) return Status(*c, msg);
    } else {
      msg += r->body.substr(0, 300);
    }
    return r->status == 404 ? NotFound(msg) : Unavailable(msg);
  }
  return ParseJson(r->body, what);
}

}  // namespace

Status WorkerStatus(const Json& result, size_t rank, const std::string& method, const std::string& where) {
  if (!result.is_object()) {
    return Internal("vLLM at " + where + " rank " + std::to_string(rank) + ": " + method + " returned " +
                    JsonTypeName(result) + ", not an object");
  }
  if (result.value("ok", false) == true) return OkStatus();
  std::string code_name =
      result.contains("code") && result["code"].is_string() ? result["code"].get<std::string>() : "";
  std::string error =
      result.contains("error") && result["error"].is_string() ? result["error"].get<std::string>() : result.dump();
  std::optional<StatusCode> code = StatusCodeFromName(code_name);
  std::string msg = "vLLM at " + where + " rank " + std::to_string(rank) + ": " + method + ": " + error;
  if (!code || *code == StatusCode::kOk) return Internal(msg + " (code '" + code_name + "')");
  return Status(*code, msg);
}

Result<InstallEvidence> InstallEvidenceFromOutcomes(const std::vector<Json>& workers, const std::string& version,
                                                    const std::string& where) {
  if (workers.empty()) return Internal("rc_install on vLLM at " + where + " returned no worker results");
  size_t refused = 0, installed = 0;
  for (size_t i = 0; i < workers.size(); ++i) {
    const Json& w = workers[i];
    std::string outcome = w.is_object() && w.contains("outcome") && w["outcome"].is_string()
                              ? w["outcome"].get<std::string>()
                              : std::string();
    if (outcome == "refused_untouched") {
      ++refused;
    } else if (outcome == "installed" && w.value("ok", false) == true) {
      ++installed;
    }
  }
  if (refused == workers.size()) {
    // The typed outcome the extension set where the first live byte would have been written.
    Status first = WorkerStatus(workers[0], 0, "rc_install", where);
    InstallEvidence e;
    e.outcome = InstallOutcome::kRefusedUntouched;
    e.error = "install of " + version + " refused by vLLM at " + where +
              " before any live byte was written: " + (first.ok() ? std::string("refused_untouched") : first.message());
    e.label = workers[0].is_object() ? workers[0].value("label", std::string()) : std::string();
    e.detail = Json{{"outcome", "refused_untouched"}, {"workers", workers}};
    return e;
  }
  if (installed != workers.size()) {
    // Name the first worker that did not install cleanly. Never FailedPrecondition: some live
    // bytes may have been written.
    for (size_t i = 0; i < workers.size(); ++i) {
      const Json& w = workers[i];
      std::string outcome = w.is_object() ? w.value("outcome", std::string("<none>")) : "<none>";
      if (outcome == "installed" && w.value("ok", false) == true) continue;
      Status st = WorkerStatus(w, i, "rc_install", where);
      std::string msg = "install of " + version;
      msg.append(" on vLLM at ").append(where).append(": rank ").append(std::to_string(i));
      msg.append(" reports outcome '").append(outcome).append("'");
      if (!st.ok()) msg.append(" (").append(st.ToString()).append(")");
      msg.append("; ").append(std::to_string(installed)).append(" of ").append(std::to_string(workers.size()));
      msg += " ranks installed: the live weights are in an unknown state";
      return Internal(msg);
    }
  }
  InstallEvidence e;
  RC_ASSIGN_OR_RETURN(e.label, GetString(workers[0], "label", "rc_install rank 0"));
  RC_ASSIGN_OR_RETURN(int64_t generation, GetInt(workers[0], "generation", "rc_install rank 0"));
  int64_t install_ms = 0;
  for (size_t i = 0; i < workers.size(); ++i) {
    std::string where_i = "rc_install rank " + std::to_string(i);
    RC_ASSIGN_OR_RETURN(std::string label, GetString(workers[i], "label", where_i));
    RC_ASSIGN_OR_RETURN(int64_t gen, GetInt(workers[i], "generation", where_i));
    if (label != e.label || gen != generation) {
      std::string msg = "install of " + version;
      msg.append(" on vLLM at ").append(where).append(": rank ").append(std::to_string(i));
      msg.append(" set label '").append(label).append("' generation ").append(std::to_string(gen));
      msg.append(", rank 0 '").append(e.label).append("' generation ").append(std::to_string(generation));
      return DataLoss(msg);
    }
    RC_ASSIGN_OR_RETURN(int64_t bytes, GetNonNegativeInt(workers[i], "bytes_installed", where_i, 0));
    e.bytes += bytes;
    install_ms = std::max<int64_t>(install_ms, workers[i].value("install_ms", int64_t{0}));
  }
  e.detail =
      Json{{"outcome", "installed"}, {"generation", generation}, {"install_ms", install_ms}, {"workers", workers}};
  return e;
}

Result<std::string> CombineWorkerDigests(const std::vector<Json>& workers, const std::string& where) {
  if (workers.empty()) return Internal("rc_digest on vLLM at " + where + " returned no worker results");
  for (size_t i = 0; i < workers.size(); ++i) RC_RETURN_IF_ERROR(WorkerStatus(workers[i], i, "rc_digest", where));
  if (workers.size() == 1) {
    const Json& w = workers[0];
    if (!w.contains("content_digest") || w["content_digest"].is_null()) {
      return DataLoss("rc_digest on vLLM at " + where + ": the only rank reports no content_digest");
    }
    RC_ASSIGN_OR_RETURN(uint64_t d, ParseHex64(w["content_digest"], "rc_digest content_digest"));
    return Hex64(d);
  }
  struct Part {
    size_t rank;
    uint64_t sum;
    int64_t elements;
    bool full;
    std::optional<int64_t> numel;
  };
  std::map<std::string, std::vector<Part>, std::less<>> parts;
  for (size_t i = 0; i < workers.size(); ++i) {
    const Json& w = workers[i];
    std::string rank = "rc_digest rank " + std::to_string(i);
    if (!w.contains("tensor_sums") || !w["tensor_sums"].is_object()) {
      return DataLoss("rc_digest on vLLM at " + where + ": rank " + std::to_string(i) + " of " +
                      std::to_string(workers.size()) + " reports no tensor_sums");
    }
    for (const auto& [name, t] : w["tensor_sums"].items()) {
      std::string what = rank + " tensor_sums[";
      what.append(name).append("]");
      if (!t.is_object()) return DataLoss(what + ": not an object");
      Part p{i, 0, 0, false, std::nullopt};
      RC_ASSIGN_OR_RETURN(p.sum, ParseHex64(t.value("sum", Json()), what + ".sum"));
      RC_ASSIGN_OR_RETURN(p.elements, GetNonNegativeInt(t, "elements", what));
      RC_ASSIGN_OR_RETURN(p.full, GetBool(t, "full", what));
      if (t.contains("numel")) {
        RC_ASSIGN_OR_RETURN(int64_t n, GetNonNegativeInt(t, "numel", what));
        p.numel = n;
      }
      parts[name].push_back(p);
    }
  }
  refit::TensorDigests digests;
  for (const auto& [name, ps] : parts) {
    std::string what = "rc_digest on vLLM at " + where;
    what.append(", tensor ").append(name);
    bool all_full =
        ps.size() == workers.size() && std::all_of(ps.begin(), ps.end(), [](const Part& p) { return p.full; });
    if (all_full) {
      for (const Part& p : ps) {
        if (p.sum != ps[0].sum) {
          return DataLoss(what + ": replicated on every rank, but rank " + std::to_string(p.rank) + " sums to " +
                          Hex64(p.sum) + " and rank " + std::to_string(ps[0].rank) + " to " + Hex64(ps[0].sum));
        }
      }
      digests[name] = ps[0].sum;
      continue;
    }
    std::optional<int64_t> numel;
    for (const Part& p : ps) {
      std::optional<int64_t> n = p.numel ? p.numel : (p.full ? std::optional<int64_t>(p.elements) : std::nullopt);
      if (!n) continue;
      if (numel && *numel != *n) {
        return DataLoss(what + ": ranks disagree on its element count (" + std::to_string(*numel) + " vs " +
                        std::to_string(*n) + ")");
      }
      numel = n;
    }
    if (!numel) {
      return DataLoss(what +
                      ": partial sums without the tensor's element count (numel): the partition cannot be "
                      "checked");
    }
    uint64_t sum = 0;
    int64_t elements = 0;
    for (const Part& p : ps) {
      sum += p.sum;  // mod 2^64
      elements += p.elements;
    }
    if (elements != *numel) {
      return DataLoss(what + ": the ranks' partial sums cover " + std::to_string(elements) + " elements of " +
                      std::to_string(*numel));
    }
    digests[name] = sum;
  }
  return Hex64(refit::CombineTensorDigests(digests));
}

// ---------------------------------------------------------------------------------------------

namespace {

// The options as given, with the default canary (64 fixed tokens) when none was.
HttpAdapterOptions WithDefaults(HttpAdapterOptions o) {
  if (o.vllm.canary_prompt.empty()) {
    for (int i = 0; i < 64; ++i) o.vllm.canary_prompt.push_back(100 + (i * 37) % 200);
  }
  return o;
}

}  // namespace

Result<VllmRelease> VllmReleaseOf(const std::string& version, bool allow_untested, const std::string& where) {
  if (version.rfind("0.26.", 0) == 0) return VllmRelease::k026;
  if (version.rfind("0.33.", 0) == 0) return VllmRelease::k033;
  if (!allow_untested) {
    return FailedPrecondition("vLLM at " + where + " is version '" + version +
                              "'; rolloutcore supports vLLM 0.26.x and 0.33.x (--vllm-allow-untested-version "
                              "starts anyway, with the behaviour of the nearest supported release)");
  }
  // major.minor of "X.Y.Z[...]": below 0.33 behaves as 0.26 (no label, no spans), else as 0.33.
  int major = 0, minor = 0;
  if (std::sscanf(version.c_str(), "%d.%d", &major, &minor) != 2) return VllmRelease::k026;
  return (major > 0 || minor >= 33) ? VllmRelease::k033 : VllmRelease::k026;
}

std::string RolloutIdOfVllmRequest(const std::string& internal) {
  // "cmpl-" R "-0-" + 8 random characters (0.26 input_processor.py:240, 0.33 :371; serving.py builds
  // "cmpl-R-0"); a bare "cmpl-R-0" is accepted too.
  if (internal.rfind("cmpl-", 0) != 0) return "";
  std::string rest = internal.substr(5);
  auto strip_index = [](std::string& r) {
    if (r.size() > 2 && r.compare(r.size() - 2, 2, "-0") == 0) {
      r.resize(r.size() - 2);
      return true;
    }
    return false;
  };
  if (rest.size() > 9 && rest[rest.size() - 9] == '-') {
    std::string without = rest.substr(0, rest.size() - 9);
    if (strip_index(without)) return without;
  }
  if (strip_index(rest)) return rest;
  return "";
}

Result<Json> SpansFromWeightVersions(const Json& weight_versions) {
  if (!weight_versions.is_array()) {
    return InvalidArgument("weight_versions: expected a list of {version, start, end}, got " +
                           JsonTypeName(weight_versions));
  }
  Json out = Json::array();
  for (size_t i = 0; i < weight_versions.size(); ++i) {
    const Json& w = weight_versions[i];
    const std::string at = "weight_versions[" + std::to_string(i) + "]";
    if (!w.is_object()) return InvalidArgument(at + ": expected an object, got " + JsonTypeName(w));
    RC_ASSIGN_OR_RETURN(std::string version, GetString(w, "version", at));
    RC_ASSIGN_OR_RETURN(int64_t start, GetNonNegativeInt(w, "start", at));
    RC_ASSIGN_OR_RETURN(int64_t end, GetNonNegativeInt(w, "end", at));
    out.push_back(Json{{"from_token", start}, {"to_token", end}, {"label", version}, {"reported_by_engine", true}});
  }
  return out;
}

VllmEngine::VllmEngine(HttpAdapterOptions options, HttpCall call, HttpCall trainer_call)
    : options_(WithDefaults(std::move(options))), call_(std::move(call)), trainer_call_(std::move(trainer_call)) {}

bool VllmEngine::Is033() const {
  rc::MutexLock lock(mu_);
  return release_ == VllmRelease::k033;
}

Status VllmEngine::EnsureRelease() {
  {
    rc::MutexLock lock(mu_);
    if (!version_.empty()) return OkStatus();
  }
  // Not described yet (a restarted controller serves and takes update requests before its first
  // update describes the engine): the release and, on 0.33, the label the rollouts are salted by.
  RC_ASSIGN_OR_RETURN(std::string version, ReadVersion());
  RC_ASSIGN_OR_RETURN(VllmRelease release, VllmReleaseOf(version, options_.vllm.allow_untested_version, options_.base_url));
  std::string label;
  if (release == VllmRelease::k033) {
    RC_ASSIGN_OR_RETURN(label, ReadWeightInfo());
  }
  rc::MutexLock lock(mu_);
  if (!version_.empty()) return OkStatus();  // a Describe got there first
  version_ = version;
  release_ = release;
  untested_ = version.rfind("0.26.", 0) != 0 && version.rfind("0.33.", 0) != 0;
  current_label_ = label;
  return OkStatus();
}

Result<Json> VllmEngine::PostJson(const std::string& path, const std::string& body) {
  RC_ASSIGN_OR_RETURN(HttpReply r, call_("POST", path, body));
  if (r.status != 200) {
    std::string msg =
        "POST " + options_.base_url + path + " answered " + std::to_string(r.status) + ": " + ErrorMessage(r.body);
    if (r.status == 404) return FailedPrecondition(msg + " (vLLM's dev endpoints need VLLM_SERVER_DEV_MODE=1)");
    if (r.status == 400 || r.status == 422) return FailedPrecondition(msg);
    return Unavailable(msg);
  }
  if (r.body.empty()) return Json();
  return ParseJson(r.body, "POST " + options_.base_url + path);
}

Result<bool> VllmEngine::IsPaused() {
  RC_ASSIGN_OR_RETURN(HttpReply r, call_("GET", "/is_paused", ""));
  if (r.status != 200) {
    return Unavailable("GET " + options_.base_url + "/is_paused answered " + std::to_string(r.status) + ": " +
                       ErrorMessage(r.body));
  }
  RC_ASSIGN_OR_RETURN(Json j, ParseJson(r.body, "GET /is_paused"));
  return GetBool(j, "is_paused", "is_paused");
}

Result<std::vector<Json>> VllmEngine::CollectiveRpc(const std::string& method, const Json& kwargs, int64_t timeout_ms) {
  Json body{{"method", method}, {"args", Json::array()}, {"kwargs", kwargs.is_null() ? Json::object() : kwargs}};
  body["timeout"] = timeout_ms > 0 ? Json(static_cast<double>(timeout_ms) / 1000.0) : Json();
  RC_ASSIGN_OR_RETURN(HttpReply r, call_("POST", "/collective_rpc", body.dump()));
  const std::string where = "collective_rpc " + method + " on vLLM at " + options_.base_url;
  if (r.status == 404) {
    return FailedPrecondition(where + ": /collective_rpc answered 404 (dev mode is off): " + kServeFlags);
  }
  if (r.status != 200) {
    std::string msg = ErrorMessage(r.body);
    if (r.status == 500 && msg.find("not implemented") != std::string::npos) {
      return FailedPrecondition(where + ": " + msg + " — rolloutcore's worker extension is not loaded: " + kServeFlags);
    }
    if (r.status == 400 || r.status == 422) {
      return FailedPrecondition(where + " was rejected (" + std::to_string(r.status) + "): " + msg);
    }
    return Internal(where + " failed (" + std::to_string(r.status) + "): " + msg);
  }
  if (r.body.empty()) return Internal(where + " returned no results (empty reply)");
  RC_ASSIGN_OR_RETURN(Json j, ParseJson(r.body, where));
  if (!j.is_object() || !j.contains("results") || !j["results"].is_array() || j["results"].empty()) {
    return Internal(where + ": expected {\"results\": [one per worker]}, got " + r.body.substr(0, 200));
  }
  std::vector<Json> out;
  for (size_t i = 0; i < j["results"].size(); ++i) {
    const Json& w = j["results"][i];
    if (!w.is_object()) {
      return Internal(where + ": rank " + std::to_string(i) + " returned " + JsonTypeName(w) + ", not an object");
    }
    out.push_back(w);
  }
  return out;
}

Result<std::string> VllmEngine::ReadVersion() {
  RC_ASSIGN_OR_RETURN(HttpReply r, call_("GET", "/version", ""));
  const std::string where = "GET " + options_.base_url + "/version";
  if (r.status != 200) {
    return FailedPrecondition(where + " answered " + std::to_string(r.status) + ": " + ErrorMessage(r.body) +
                              " (is it vLLM?)");
  }
  RC_ASSIGN_OR_RETURN(Json j, ParseJson(r.body, where));
  return GetString(j, "version", where);
}

Result<EngineDescription> VllmEngine::Describe() {
  {
    rc::MutexLock lock(mu_);
    warmup_.reset();
    prefix_reset_done_ = false;
    install_replies_.reset();
    staged_version_.clear();
    native_preflight_.reset();
    cycle_mode_ = lifecycle::PolicyMode::kStrict;
    cycle_frozen_ = Json();
    folded_.reset();
  }
  // A rolloutcore engine answers GET /rc/engine/state; vLLM does not (404).
  RC_ASSIGN_OR_RETURN(HttpReply state, call_("GET", "/rc/engine/state", ""));
  if (state.status == 200) {
    return FailedPrecondition("engine at " + options_.base_url +
                              " was given as vllm+http:// but answers GET /rc/engine/state: it is a rolloutcore engine");
  }
  RC_ASSIGN_OR_RETURN(HttpReply health, call_("GET", "/health", ""));
  if (health.status != 200) {
    return Unavailable("engine at " + options_.base_url + " is not healthy (GET /health answered " +
                       std::to_string(health.status) + ")");
  }
  RC_ASSIGN_OR_RETURN(std::string version, ReadVersion());
  RC_ASSIGN_OR_RETURN(VllmRelease release, VllmReleaseOf(version, options_.vllm.allow_untested_version, options_.base_url));
  const bool untested = version.rfind("0.26.", 0) != 0 && version.rfind("0.33.", 0) != 0;
  if (release == VllmRelease::k033 && options_.vllm.native_transfer) {
    return FailedPrecondition(
        "vLLM at " + options_.base_url + " is " + version +
        ": --vllm-transfer native-nccl drives vLLM 0.26's NCCL weight-transfer trainer API "
        "(NCCLWeightTransferEngine.trainer_init / trainer_send_weights), which 0.33 no longer has; use the default "
        "transfer (--vllm-transfer rolloutcore) on 0.33");
  }
  {
    rc::MutexLock lock(mu_);
    if (untested && version != version_) {
      RC_LOG_WARN("vLLM at {} is version {}, not 0.26.x or 0.33.x: running anyway (--vllm-allow-untested-version) "
                  "with the behaviour of {}; every validation records it",
                  options_.base_url, version, release == VllmRelease::k033 ? "0.33" : "0.26");
    }
    version_ = version;
    release_ = release;
    untested_ = untested;
  }
  RC_ASSIGN_OR_RETURN(std::vector<Json> workers, CollectiveRpc("rc_describe", Json::object(), 30000));
  {
    rc::MutexLock lock(mu_);
    boot_id_ = workers.empty() ? std::string() : workers[0].value("boot_id", std::string());
    // Whether rc_install can fold the engine's resets and label into its call (one worker: the
    // engine core runs it in its own thread).
    const Json* atomic = nullptr;
    if (workers.size() == 1 && workers[0].is_object() && workers[0].contains("install") &&
        workers[0]["install"].is_object() && workers[0]["install"].contains("atomic")) {
      atomic = &workers[0]["install"]["atomic"];
    }
    engine_side_available_ = atomic != nullptr && atomic->is_object() && atomic->value("available", false) == true;
  }
  for (size_t i = 0; i < workers.size(); ++i) {
    RC_RETURN_IF_ERROR(WorkerStatus(workers[i], i, "rc_describe", options_.base_url));
    int64_t tp_size = workers[i].value("tp_size", int64_t{0});
    if (tp_size != static_cast<int64_t>(workers.size())) {
      return FailedPrecondition("rc_describe on vLLM at " + options_.base_url + ": rank " + std::to_string(i) +
                                " reports tp_size " + std::to_string(tp_size) + " but " +
                                std::to_string(workers.size()) + " workers answered");
    }
  }
  // The label the workers hold; on 0.33 vLLM's own label follows it. A vLLM that was never
  // labelled reports "default" (core.py:147): it is given the workers' label (the same weights;
  // nothing else sets it). Any other disagreement is left for ReadLabel / ProbeIdentity to report.
  if (release == VllmRelease::k033) {
    RC_ASSIGN_OR_RETURN(std::vector<Json> labels, CollectiveRpc("rc_label", Json::object(), 30000));
    std::string label;
    if (!labels.empty() && labels[0].is_object() && labels[0].value("label", Json()).is_string()) {
      label = labels[0]["label"].get<std::string>();
    }
    if (!label.empty()) {
      RC_ASSIGN_OR_RETURN(std::string info, ReadWeightInfo());
      if (info == "default") RC_RETURN_IF_ERROR(SetWeightVersion(label));
    }
    rc::MutexLock lock(mu_);
    current_label_ = label;
  }
  // The served model name for the canary (vLLM refuses a name it does not serve).
  auto models = call_("GET", "/v1/models", "");
  if (models.ok() && models->status == 200) {
    auto j = ParseJson(models->body, "GET /v1/models");
    if (j.ok() && j->contains("data") && (*j)["data"].is_array() && !(*j)["data"].empty() &&
        (*j)["data"][0].contains("id") && (*j)["data"][0]["id"].is_string()) {
      rc::MutexLock lock(mu_);
      served_model_ = (*j)["data"][0]["id"].get<std::string>();
    }
  }
  EngineDescription d = StagingEngineDescription(options_.base_url, "vllm");
  // An extension with rc_replay says so in rc_describe (older ones do not: the replay is skipped
  // and the evidence says why).
  d.offers_replay = !workers.empty();
  for (const Json& w : workers) d.offers_replay = d.offers_replay && w.value("offers_replay", false);
  d.replay_accepts_ties = true;
  d.version = version;
  // The quantization vLLM computes with (the extension reports --quantization when it keeps weights
  // in FP8, docs/fp8.md): the runner replays only probes computed under the same. Workers that
  // disagree are one engine with two answers: refused.
  for (size_t i = 0; i < workers.size(); ++i) {
    const Json& q = workers[i].contains("quantization") ? workers[i]["quantization"] : Json("");
    if (!q.is_string()) return DataLoss("rc_describe of worker " + std::to_string(i) + ": quantization is not a string");
    if (i == 0) {
      d.quantization = q.get<std::string>();
    } else if (q.get<std::string>() != d.quantization) {
      return FailedPrecondition("rc_describe: worker 0 serves quantization '" + d.quantization + "', worker " +
                                std::to_string(i) + " '" + q.get<std::string>() + "'");
    }
  }
  d.replay_tolerance = d.quantization.empty() ? options_.vllm.replay_tolerance : options_.vllm.fp8_replay_tolerance;
  return d;
}

Result<lifecycle::ReplayEvidence> VllmEngine::Replay(const lifecycle::ReplayRequest& request) {
  Json kwargs{{"prompt", request.prompt}, {"steps", request.steps}, {"top_k", request.top_k},
              {"probe", request.probe}};
  RC_ASSIGN_OR_RETURN(std::vector<Json> workers, CollectiveRpc("rc_replay", kwargs, 60000));
  lifecycle::ReplayEvidence first;
  for (size_t i = 0; i < workers.size(); ++i) {
    RC_RETURN_IF_ERROR(WorkerStatus(workers[i], i, "rc_replay", options_.base_url));
    RC_ASSIGN_OR_RETURN(lifecycle::ReplayEvidence e,
                        lifecycle::ReplayEvidenceFromJson(workers[i], "rc_replay rank " + std::to_string(i)));
    if (i == 0) {
      first = std::move(e);
      continue;
    }
    bool same = e.steps.size() == first.steps.size();
    for (size_t k = 0; same && k < e.steps.size(); ++k) same = e.steps[k].token == first.steps[k].token;
    if (!same) {
      return DataLoss("vLLM at " + options_.base_url + ": rc_replay of probe " + request.probe + ": rank " +
                      std::to_string(i) + " sampled other tokens than rank 0");
    }
  }
  if (workers.empty()) return Internal("vLLM at " + options_.base_url + ": rc_replay: no worker answered");
  return first;
}

// The Runner polls this only while no controller rollout is active. vLLM's gauges refresh only on
// engine steps, so a request aborted outside a step (a client that went away) can leave a stale
// non-zero forever. When the same non-zero reading has persisted for gauge_probe_after_ms on an
// unpaused engine, one canary request (max_tokens=1: it finishes in its first step, and a step
// takes its stats after removing finished requests) makes vLLM step, and the gauges are read
// again: a real request keeps the count non-zero, a stale one goes to 0. At most one probe per
// gauge_probe_after_ms. The probe is synchronous on purpose: it has finished inside vLLM before
// this call returns, so it can never wait out a pause and land after the resume (where it would
// warm the canary's blocks under the new weights). Never while paused: it would block.
Result<DrainStatus> VllmEngine::Drain() {
  RC_ASSIGN_OR_RETURN(DrainStatus d, Gauges());
  const auto now = std::chrono::steady_clock::now();
  const auto after = std::chrono::milliseconds(std::max<int64_t>(1, options_.vllm.gauge_probe_after_ms));
  {
    rc::MutexLock lock(mu_);
    if (d.idle() || d.running != last_gauges_.running || d.waiting != last_gauges_.waiting) {
      last_gauges_ = d;
      gauges_since_ = now;
      return d;
    }
    if (now - gauges_since_ < after || now - last_gauge_probe_ < after) return d;
    last_gauge_probe_ = now;
  }
  RC_ASSIGN_OR_RETURN(bool paused, IsPaused());
  if (paused) return d;
  RC_ASSIGN_OR_RETURN(int64_t cached, Canary());
  (void)cached;
  RC_ASSIGN_OR_RETURN(DrainStatus fresh, Gauges());
  rc::MutexLock lock(mu_);
  last_gauges_ = fresh;
  gauges_since_ = std::chrono::steady_clock::now();
  return fresh;
}

Result<DrainStatus> VllmEngine::Gauges() {
  RC_ASSIGN_OR_RETURN(HttpReply r, call_("GET", "/metrics", ""));
  if (r.status != 200) {
    return Unavailable("GET " + options_.base_url + "/metrics answered " + std::to_string(r.status));
  }
  DrainStatus d;
  RC_ASSIGN_OR_RETURN(double running, PrometheusValue(r.body, "vllm:num_requests_running"));
  RC_ASSIGN_OR_RETURN(double waiting, PrometheusValue(r.body, "vllm:num_requests_waiting"));
  d.running = static_cast<int64_t>(running);
  d.waiting = static_cast<int64_t>(waiting);
  return d;
}

Result<int64_t> VllmEngine::Canary() {
  Json body{{"prompt", options_.vllm.canary_prompt}, {"max_tokens", 1}, {"temperature", 0.0}};
  {
    rc::MutexLock lock(mu_);
    if (!served_model_.empty()) body["model"] = served_model_;
  }
  RC_ASSIGN_OR_RETURN(Json j, PostJson("/v1/completions", body.dump()));
  if (!j.is_object() || !j.contains("usage") || !j["usage"].is_object()) {
    return DataLoss("canary response from " + options_.base_url + "/v1/completions has no usage");
  }
  const Json& usage = j["usage"];
  if (!usage.contains("prompt_tokens_details") || !usage["prompt_tokens_details"].is_object()) {
    return FailedPrecondition("vLLM at " + options_.base_url +
                              " does not report cached tokens: start it with --enable-prompt-tokens-details");
  }
  return GetNonNegativeInt(usage["prompt_tokens_details"], "cached_tokens", "usage.prompt_tokens_details", 0);
}

Result<Json> VllmEngine::WarmCanary(const std::string& where) {
  RC_ASSIGN_OR_RETURN(int64_t first, Canary());
  RC_ASSIGN_OR_RETURN(int64_t second, Canary());
  Json ev{{"warmed_in", where},
          {"prompt_tokens", options_.vllm.canary_prompt.size()},
          {"first_cached_tokens", first},
          {"second_cached_tokens", second},
          {"verifiable", second > 0}};
  if (second == 0) {
    ev["why_not"] =
        "the second warm-up reported 0 cached tokens (prefix caching off, or the canary shorter than one "
        "block): a post-resume 0 proves nothing";
  }
  rc::MutexLock lock(mu_);
  warmup_ = ev;
  return ev;
}

// Drain rule. mode=wait returns only once nothing runs (vLLM's own idle callback) and mode=abort
// only after aborting everything, so a 200 from /pause in those modes plus /is_paused true is
// vLLM's statement that nothing runs: running = 0. The gauges are recorded but not used for
// them: they refresh only on engine steps, so a paused engine keeps the last step's values,
// possibly non-zero, forever. mode=keep freezes in-flight requests in place, so there running
// is the gauge (a stale value only errs towards refusing the install, which is safe).
Result<PauseEvidence> VllmEngine::Pause(PauseMode mode) {
  Json detail = Json::object();
  bool warm = false;
  {
    rc::MutexLock lock(mu_);
    warm = warmup_.has_value();
  }
  // Requests sent while paused block until the resume: warm before the pause, unless vLLM is
  // paused already (a recovery after a taint that left it paused, e.g. a failed validation): the
  // canary would wait for a resume that only this operation can send.
  if (!warm) {
    RC_ASSIGN_OR_RETURN(bool already_paused, IsPaused());
    if (already_paused) {
      detail["canary_warmup"] = Json{{"warmed", false},
                                     {"why_not", "vLLM was already paused: a request sent now would wait for the "
                                                 "resume, so the post-resume canary proves nothing this cycle"}};
    } else {
      RC_ASSIGN_OR_RETURN(Json ev, WarmCanary("pause"));
      detail["canary_warmup"] = ev;
    }
  }
  // /sleep?level=0 is EngineCore.sleep: pause_scheduler(mode, clear_cache=false) and nothing else
  // (level 0 touches no memory), without AsyncLLM.pause_generation's trailing 20 ms sleep.
  const std::string path = options_.vllm.pause_via_sleep
                               ? "/sleep?level=0&mode=" + std::string(lifecycle::PauseModeName(mode))
                               : "/pause?mode=" + std::string(lifecycle::PauseModeName(mode)) + "&clear_cache=false";
  RC_ASSIGN_OR_RETURN(Json reply, PostJson(path, ""));
  detail["pause"] = Json{{"request", path}, {"reply", reply}};
  PauseEvidence e;
  RC_ASSIGN_OR_RETURN(e.paused, IsPaused());
  auto gauges = Gauges();
  if (gauges.ok()) {
    detail["gauges"] = Json{{"num_requests_running", gauges->running}, {"num_requests_waiting", gauges->waiting}};
  } else {
    detail["gauges"] = Json{{"error", gauges.status().ToString()}};
  }
  if (mode == PauseMode::kKeep) {
    if (!gauges.ok()) return gauges.status().WithContext("pause mode=keep: the running gauge is the only evidence");
    e.running = gauges->running;
    detail["drain_rule"] = "keep: running from vllm:num_requests_running";
  } else {
    e.running = 0;
    detail["drain_rule"] = std::string(lifecycle::PauseModeName(mode)) +
                           ": /pause answered 200 only once idle (gauges refresh on engine steps only)";
  }
  e.detail = detail;
  return e;
}

Status VllmEngine::SupportsPolicyMode(lifecycle::PolicyMode mode) {
  using lifecycle::PolicyMode;
  if (mode == PolicyMode::kStrict || mode == PolicyMode::kAbort) return OkStatus();
  RC_RETURN_IF_ERROR(EnsureRelease());
  std::string version;
  {
    rc::MutexLock lock(mu_);
    if (release_ == VllmRelease::k033) {
      if (!options_.vllm.native_transfer) return OkStatus();
    }
    version = version_.empty() ? "(not described yet)" : version_;
  }
  if (options_.vllm.native_transfer) {
    return Unimplemented("mode '" + std::string(lifecycle::PolicyModeName(mode)) + "' is not available on vLLM at " +
                         options_.base_url +
                         " with --vllm-transfer native-nccl: vLLM's start_weight_update moves the layers while "
                         "requests are frozen; use strict or abort");
  }
  const std::string why =
      mode == PolicyMode::kRecompute
          ? "vLLM 0.26 cannot re-prefill running requests under the new weights at a reported token index "
            "(pause?mode=keep&clear_cache=true preempts them, but no per-request swap index comes back)"
          : "vLLM 0.26 reports no per-request token index at which the weights changed under a keep pause "
            "(/pause?mode=keep&clear_cache=false), so the version spans could not be exact";
  return Unimplemented("mode '" + std::string(lifecycle::PolicyModeName(mode)) + "' is not available on vLLM at " +
                       options_.base_url + " (version " + version + "): " + why +
                       "; use strict or abort, or vLLM 0.33 for keep and recompute");
}

Result<Json> VllmEngine::Frozen() {
  RC_ASSIGN_OR_RETURN(std::vector<Json> workers, CollectiveRpc("rc_frozen", Json::object(), 30000));
  // Every rank runs every request (tensor parallel): rank 0 speaks for the engine; the others must
  // report the same counts.
  Json out = Json::array();
  std::map<std::string, int64_t> first;
  for (size_t i = 0; i < workers.size(); ++i) {
    RC_RETURN_IF_ERROR(WorkerStatus(workers[i], i, "rc_frozen", options_.base_url));
    const std::string at = "rc_frozen rank " + std::to_string(i);
    if (!workers[i].contains("requests") || !workers[i]["requests"].is_array()) {
      return DataLoss("vLLM at " + options_.base_url + ": " + at + " has no requests list");
    }
    std::map<std::string, int64_t> counts;
    for (const Json& r : workers[i]["requests"]) {
      if (!r.is_object()) return DataLoss("vLLM at " + options_.base_url + ": " + at + ": a request is not an object");
      RC_ASSIGN_OR_RETURN(std::string id, GetString(r, "request_id", at));
      RC_ASSIGN_OR_RETURN(int64_t n, GetNonNegativeInt(r, "output_tokens", at));
      counts[id] = n;
      if (i == 0) {
        const std::string rollout = RolloutIdOfVllmRequest(id);
        out.push_back(Json{{"request_id", id}, {"rollout_id", rollout.empty() ? Json() : Json(rollout)},
                           {"output_tokens", n}});
      }
    }
    if (i == 0) {
      first = std::move(counts);
    } else if (counts != first) {
      return DataLoss("vLLM at " + options_.base_url + ": rc_frozen: rank " + std::to_string(i) +
                      " reports other requests or counts than rank 0");
    }
  }
  return out;
}

Result<PauseEvidence> VllmEngine::PauseForUpdate(lifecycle::PolicyMode mode) {
  using lifecycle::PolicyMode;
  RC_RETURN_IF_ERROR(SupportsPolicyMode(mode));
  if (mode == PolicyMode::kStrict) return InvalidArgument("PauseForUpdate: strict updates drain (Pause)");
  if (mode == PolicyMode::kAbort) {
    // /pause?mode=abort finishes every request with finish_reason "abort"; their tokens all came
    // from the old weights, which is what their single span says.
    RC_ASSIGN_OR_RETURN(PauseEvidence e, Pause(PauseMode::kAbort));
    e.detail["policy_mode"] = "abort";
    {
      rc::MutexLock lock(mu_);
      cycle_mode_ = mode;
    }
    return e;
  }
  // keep and recompute (0.33): freeze the running requests in place (clear_cache=false: their KV
  // stays), then read from the worker how many output tokens each has: the index at which its
  // weights change. keep resumes them on their old KV ("stale"); recompute has the prefix reset
  // preempt them (reset_running_requests), so they re-prefill prompt + output under the new
  // weights after the resume ("recomputed").
  RC_ASSIGN_OR_RETURN(PauseEvidence e, Pause(PauseMode::kKeep));
  RC_ASSIGN_OR_RETURN(Json frozen, Frozen());
  e.detail["policy_mode"] = lifecycle::PolicyModeName(mode);
  e.detail["frozen"] = frozen;
  // e.running stays the gauge: the frozen requests (an in-flight install goes ahead under them).
  rc::MutexLock lock(mu_);
  cycle_mode_ = mode;
  cycle_frozen_ = frozen;
  return e;
}

Result<Json> VllmEngine::StageWorkers(const UpdateTarget& target, int64_t* bytes) {
  if (options_.directory_url.empty()) {
    return InvalidArgument("staging on vLLM at " + options_.base_url + " needs the directory URL (--directory)");
  }
  std::string model = options_.model.empty() ? target.model : options_.model;
  Json kwargs{{"model", model},
              {"version", target.label},
              {"directory", options_.directory_url},
              {"timeout_ms", options_.stage_timeout_ms}};
  if (!options_.vllm.delta_policy.empty()) kwargs["delta_policy"] = options_.vllm.delta_policy;
  RC_ASSIGN_OR_RETURN(std::vector<Json> workers, CollectiveRpc("rc_stage", kwargs, options_.stage_timeout_ms + 5000));
  Json detail{{"workers", workers}};
  int64_t needed = 0, planned = 0, pulled = 0;
  for (size_t i = 0; i < workers.size(); ++i) {
    const Json& w = workers[i];
    RC_RETURN_IF_ERROR(WorkerStatus(w, i, "rc_stage", options_.base_url));
    std::string where = "rc_stage rank " + std::to_string(i);
    RC_ASSIGN_OR_RETURN(std::string version, GetString(w, "version", where));
    if (version != target.label) {
      return DataLoss("vLLM at " + options_.base_url + " rank " + std::to_string(i) + " staged '" + version +
                      "', not '" + target.label + "'");
    }
    RC_ASSIGN_OR_RETURN(int64_t n, GetNonNegativeInt(w, "bytes_needed", where, 0));
    RC_ASSIGN_OR_RETURN(int64_t p, GetNonNegativeInt(w, "bytes_planned", where, 0));
    RC_ASSIGN_OR_RETURN(int64_t u, GetNonNegativeInt(w, "bytes_pulled", where, 0));
    needed += n;
    planned += p;
    pulled += u;
  }
  detail["bytes_needed"] = needed;
  detail["bytes_planned"] = planned;
  detail["bytes_pulled"] = pulled;
  *bytes = planned;
  return detail;
}

Result<StageEvidence> VllmEngine::Stage(const UpdateTarget& target) {
  RC_ASSIGN_OR_RETURN(Json warm, WarmCanary("stage"));
  StageEvidence e;
  e.label = target.label;
  if (options_.vllm.native_transfer) {
    // vLLM's own transfer has nothing to prefetch: the bytes move inside the session, while
    // paused. The stage checks that the sender is alive and offers the version (nothing touched).
    RC_ASSIGN_OR_RETURN(Json pre, NativePreflight(target));
    e.bytes = pre.value("bytes", int64_t{0});
    e.detail = Json{{"transfer", "vllm_native_nccl"}, {"preflight", pre}, {"canary_warmup", warm}};
    rc::MutexLock lock(mu_);
    staged_version_ = target.label;
    native_preflight_ = pre;
    return e;
  }
  RC_ASSIGN_OR_RETURN(e.detail, StageWorkers(target, &e.bytes));
  e.detail["canary_warmup"] = warm;
  rc::MutexLock lock(mu_);
  staged_version_ = target.label;
  return e;
}

Result<InstallEvidence> VllmEngine::Install(const UpdateTarget& target, bool full) {
  RC_ASSIGN_OR_RETURN(InstallEvidence e, options_.vllm.native_transfer ? NativeInstall(target, full)
                                                                  : ExtensionInstall(target, full));
  if (e.outcome != InstallOutcome::kInstalled) return e;
  // The weights are the target's: remember what this update did to the frozen requests (their
  // spans), and on 0.33 set vLLM's own label while still paused (vLLM stamps every step's output
  // with it; relabelling while generating would stamp a step with the wrong one: core.py:658).
  {
    rc::MutexLock lock(mu_);
    if (cycle_mode_ == lifecycle::PolicyMode::kKeep || cycle_mode_ == lifecycle::PolicyMode::kRecompute) {
      LabelChange change;
      change.mode = cycle_mode_;
      if (cycle_frozen_.is_array()) {
        for (const Json& f : cycle_frozen_) {
          if (f.value("rollout_id", Json()).is_string()) {
            change.swap_index[f["rollout_id"].get<std::string>()] = f.value("output_tokens", int64_t{0});
          }
        }
      }
      if (!label_changes_.count(target.label)) label_order_.push_back(target.label);
      label_changes_[target.label] = std::move(change);
      constexpr size_t kMaxLabelChanges = 64;
      while (label_order_.size() > kMaxLabelChanges) {
        label_changes_.erase(label_order_.front());
        label_order_.erase(label_order_.begin());
      }
    }
  }
  {
    rc::MutexLock lock(mu_);
    current_label_ = target.label;
  }
  if (Is033()) {
    std::optional<Json> folded;
    {
      rc::MutexLock lock(mu_);
      folded = folded_;
    }
    if (folded && folded->value("vllm_label", Json()) == Json(target.label)) {
      // Set by rc_install on the engine core's thread (fold_engine_calls); VALIDATING reads it back.
      e.detail["vllm_weight_version_set"] = target.label;
      e.detail["vllm_weight_version_set_by"] = "rc_install (engine side)";
    } else {
      Status set = SetWeightVersion(target.label);
      // Not an install failure (the weights are in): VALIDATING reads /weight_info back and fails
      // the update when vLLM does not report the label.
      e.detail["vllm_weight_version_set"] = set.ok() ? Json(target.label) : Json(set.ToString());
    }
  }
  return e;
}

Status VllmEngine::SetWeightVersion(const std::string& label) {
  RC_ASSIGN_OR_RETURN(Json reply, PostJson("/update_weight_version", Json{{"new_version", label}}.dump()));
  if (!reply.is_object() || !reply.value("success", false)) {
    return DataLoss("POST " + options_.base_url + "/update_weight_version answered " + reply.dump());
  }
  return OkStatus();
}

Result<std::string> VllmEngine::ReadWeightInfo() {
  RC_ASSIGN_OR_RETURN(HttpReply r, call_("GET", "/weight_info", ""));
  const std::string where = "GET " + options_.base_url + "/weight_info";
  if (r.status != 200) return Unavailable(where + " answered " + std::to_string(r.status) + ": " + ErrorMessage(r.body));
  RC_ASSIGN_OR_RETURN(Json j, ParseJson(r.body, where));
  return GetString(j, "weight_version", where);
}

Result<InstallEvidence> VllmEngine::ExtensionInstall(const UpdateTarget& target, bool full) {
  Json staged;
  bool staged_this_cycle = false;
  {
    rc::MutexLock lock(mu_);
    staged_this_cycle = staged_version_ == target.label;
  }
  if (full || !staged_this_cycle) {
    // Recovery (nothing proves what, if anything, is staged) or no prefetch this cycle: stage
    // the target now, inside the install deadline. A stage never touches live weights, so a
    // failed stage in an update is a refusal before mutation; in a recovery any failure leaves
    // the engine TAINTED (the Runner never reads a recovery error as "refused").
    int64_t bytes = 0;
    auto s = StageWorkers(target, &bytes);
    if (!s.ok()) {
      if (full) return s.status().WithContext("recovery: staging " + target.label);
      InstallEvidence e;
      e.outcome = InstallOutcome::kRefusedUntouched;
      e.error = "install of " + target.label + " refused before mutation: staging it (no prefetch this cycle) failed: " +
                s.status().ToString();
      e.detail = Json{{"outcome", "refused_untouched"}, {"stage_error", s.status().ToString()}};
      return e;
    }
    staged = *s;
  }
  // CollectiveRpc answers FailedPrecondition only when the method provably never ran (no
  // extension, dev mode off, request rejected); transport loss (Unavailable) or a raised method
  // (Internal) is ambiguous and taints.
  {
    rc::MutexLock lock(mu_);
    install_replies_.reset();
  }
  // Folded: the engine's cache resets and label in rc_install's own call (fold_engine_calls).
  bool fold = false;
  {
    rc::MutexLock lock(mu_);
    folded_.reset();
    fold = options_.vllm.fold_engine_calls && engine_side_available_ &&
           (cycle_mode_ == lifecycle::PolicyMode::kStrict || cycle_mode_ == lifecycle::PolicyMode::kAbort);
  }
  Json kwargs{{"version", target.label}};
  if (fold) kwargs["atomic"] = true;
  RC_ASSIGN_OR_RETURN(std::vector<Json> workers, CollectiveRpc("rc_install", kwargs, 0));
  Json engine_side;
  if (fold && workers.size() == 1 && workers[0].is_object() &&
      workers[0].value("outcome", std::string()) == "refused_untouched" &&
      workers[0].value("error", std::string()).rfind("atomic install:", 0) == 0) {
    // Nothing was written: the engine core was out of reach or not idle. Install as usual; the
    // separate calls follow.
    engine_side = Json{{"folded", false}, {"why", workers[0]["error"]}};
    RC_ASSIGN_OR_RETURN(workers, CollectiveRpc("rc_install", Json{{"version", target.label}}, 0));
  }
  RC_ASSIGN_OR_RETURN(InstallEvidence e, InstallEvidenceFromOutcomes(workers, target.label, options_.base_url));
  if (!staged.is_null()) e.detail["staged_in_install"] = staged;
  if (fold && engine_side.is_null() && e.outcome == InstallOutcome::kInstalled) {
    const Json a = workers[0].value("atomic", Json());
    if (a.is_object() && a.value("prefix_cache_reset", false) == true) {
      engine_side = a;
      engine_side["folded"] = true;
      rc::MutexLock lock(mu_);
      folded_ = a;
    } else {
      engine_side = Json{{"folded", false}, {"why", "rc_install reported no engine side: " + a.dump()}};
    }
  }
  if (!engine_side.is_null()) e.detail["engine_side"] = engine_side;
  bool complete = !workers.empty();
  for (const Json& w : workers) {
    complete = complete && w.is_object() && w.contains("label") && w.contains("generation") &&
               (w.contains("tensor_sums") || (w.contains("content_digest") && w["content_digest"].is_string()));
  }
  if (complete) {
    rc::MutexLock lock(mu_);
    install_replies_ = workers;
  }
  return e;
}

Result<CacheResetResult> VllmEngine::ResetCache(CacheKind kind) {
  CacheResetResult r;
  r.kind = kind;
  {
    // Folded into this cycle's rc_install (fold_engine_calls): the engine core reset the cache in
    // that call, after the install and before any step; no further call (attempts 0).
    rc::MutexLock lock(mu_);
    if (folded_) {
      const char* key = kind == CacheKind::kPrefix    ? "prefix_cache_reset"
                        : kind == CacheKind::kEncoder ? "reset_encoder_cache"
                                                      : "reset_mm_cache";
      if (folded_->value(key, false) == true) {
        r.success = true;
        r.attempts = 0;
        // The prefix reset's success is vLLM's own answer (reset_prefix_cache returned true); the
        // others report nothing, as their HTTP endpoints do.
        r.verified = kind == CacheKind::kPrefix;
        r.blocks_in_use = kind == CacheKind::kPrefix ? 0 : -1;
        if (kind == CacheKind::kPrefix) prefix_reset_done_ = true;
        return r;
      }
    }
  }
  if (kind != CacheKind::kPrefix) {
    // vLLM answers an empty 200 and reports nothing: sent, accepted, not verified.
    const std::string path = kind == CacheKind::kEncoder ? "/reset_encoder_cache" : "/reset_mm_cache";
    RC_ASSIGN_OR_RETURN(Json ignored, PostJson(path, ""));
    (void)ignored;
    r.success = true;
    r.verified = false;
    r.blocks_in_use = -1;  // unknown
    return r;
  }
  lifecycle::PolicyMode mode;
  int64_t frozen = 0;
  {
    rc::MutexLock lock(mu_);
    mode = cycle_mode_;
    frozen = cycle_frozen_.is_array() ? static_cast<int64_t>(cycle_frozen_.size()) : 0;
  }
  // recompute: reset_running_requests preempts the frozen requests (their blocks are freed, they
  // re-prefill prompt + output under the new weights after the resume) and clears the cache.
  // Otherwise it stays false: preempting would hide a refusal (and drop a frozen request's KV).
  const std::string path = mode == lifecycle::PolicyMode::kRecompute
                               ? "/reset_prefix_cache?reset_running_requests=true"
                               : "/reset_prefix_cache";
  // keep with frozen requests: their blocks are held, so vLLM refuses the reset however often it
  // is asked (block_pool.py: any block in use). One attempt, then isolation (see below).
  const bool keep_frozen = mode == lifecycle::PolicyMode::kKeep && frozen > 0;
  const int attempts = keep_frozen ? 1 : std::max(1, options_.vllm.reset_attempts);
  int64_t backoff = std::max<int64_t>(1, options_.vllm.reset_backoff_ms);
  for (int i = 1; i <= attempts; ++i) {
    RC_ASSIGN_OR_RETURN(Json j, PostJson(path, ""));
    if (!j.is_object() || !j.contains("success") || !j["success"].is_boolean()) {
      return DataLoss("POST " + options_.base_url + path + " answered " + j.dump() + ", not {\"success\": bool}");
    }
    r.attempts = i;
    r.verified = true;  // vLLM's own success flag
    r.success = j["success"].get<bool>();
    if (r.success) {
      r.blocks_in_use = 0;
      rc::MutexLock lock(mu_);
      prefix_reset_done_ = true;
      return r;
    }
    if (i < attempts) {
      SleepMs(backoff);
      backoff *= 2;
    }
  }
  r.blocks_in_use = -1;  // vLLM does not say how many
  if (keep_frozen) {
    // Not cleared, and recorded so. Every rollout through the controller carries cache_salt
    // "rc:<label it was sent under>" (Complete), and vLLM keys a request's prefix blocks by its
    // salt: no rollout sent after this update can reuse a block the old weights computed. The
    // frozen requests go on on their own (stale) KV, which is what keep means and what their
    // version spans say ("kv": "stale"). Requests sent to vLLM directly, without a salt, are not
    // covered until the next reset that succeeds (docs/vllm.md, "Policy modes").
    r.isolation = "keep: vLLM refused the reset while " + std::to_string(frozen) +
                  " requests are frozen; controller rollouts are isolated by cache_salt rc:<version>";
  }
  return r;
}

Result<LabelEvidence> VllmEngine::ReadLabel() {
  std::optional<std::vector<Json>> from_install;
  {
    rc::MutexLock lock(mu_);
    from_install = install_replies_;
  }
  std::vector<Json> workers;
  if (from_install) {
    workers = std::move(*from_install);  // the label rc_install set and reported (see the header)
  } else {
    RC_ASSIGN_OR_RETURN(workers, CollectiveRpc("rc_label", Json::object(), 30000));
  }
  LabelEvidence e;
  int64_t generation = 0;
  for (size_t i = 0; i < workers.size(); ++i) {
    RC_RETURN_IF_ERROR(WorkerStatus(workers[i], i, "rc_label", options_.base_url));
    std::string where = "rc_label rank " + std::to_string(i);
    RC_ASSIGN_OR_RETURN(std::string label, GetString(workers[i], "label", where));
    RC_ASSIGN_OR_RETURN(int64_t gen, GetInt(workers[i], "generation", where));
    if (i == 0) {
      e.label = label;
      generation = gen;
    } else if (label != e.label || gen != generation) {
      return DataLoss("vLLM at " + options_.base_url + ": the ranks disagree on the live weights: rank 0 reports '" +
                      e.label + "' generation " + std::to_string(generation) + ", rank " + std::to_string(i) + " '" +
                      label + "' generation " + std::to_string(gen));
    }
  }
  std::string version;
  bool untested = false;
  {
    rc::MutexLock lock(mu_);
    version = version_;
    untested = untested_;
  }
  e.detail = Json{{"extension_label", e.label}, {"extension_generation", generation}, {"vllm_version", version}};
  if (untested) e.detail["vllm_version_untested"] = true;
  if (Is033()) {
    // vLLM's own label must say the same: it is what vLLM stamps on every output (weight_versions).
    RC_ASSIGN_OR_RETURN(std::string info, ReadWeightInfo());
    e.detail["vllm_weight_version"] = info;
    if (info != e.label) {
      return DataLoss("vLLM at " + options_.base_url + " reports weight_version '" + info +
                      "' (GET /weight_info) but its workers hold '" + e.label +
                      "': vLLM's own label was not set to the installed version");
    }
  }
  return e;
}

Result<DigestEvidence> VllmEngine::ReadContentDigest() {
  // Not fresh: right after an install (VALIDATING, still paused) the extension serves the digest
  // that rc_install computed by reading the live parameters after its copies, so the pause window
  // does not pay for a second pass over the weights (27 ms for 16.4 GB on an H200). Without a
  // cached digest (a restarted controller's claim check) the extension computes one.
  std::optional<std::vector<Json>> from_install;
  {
    rc::MutexLock lock(mu_);
    from_install = std::exchange(install_replies_, std::nullopt);  // used once: a later read asks again
  }
  std::vector<Json> workers;
  if (from_install) {
    workers = std::move(*from_install);
  } else {
    RC_ASSIGN_OR_RETURN(workers, CollectiveRpc("rc_digest", Json{{"per_tensor", false}, {"fresh", false}}, 0));
  }
  DigestEvidence e;
  // vLLM serving FP8 from bf16 (docs/fp8.md): the content digest covers the bf16 the extension
  // installed; each worker adds the proof that the FP8 image vLLM computes with is its quantization.
  for (size_t i = 0; i < workers.size(); ++i) {
    if (!workers[i].contains("fp8")) continue;
    if (workers.size() != 1) {
      return FailedPrecondition("vLLM at " + options_.base_url + " serves FP8 on " + std::to_string(workers.size()) +
                                " tensor-parallel ranks: the FP8 image is proven at tensor-parallel size 1 only");
    }
    RC_ASSIGN_OR_RETURN(e.quantized,
                        QuantizedFromJson(workers[i]["fp8"], "rc_digest on vLLM at " + options_.base_url));
  }
  RC_ASSIGN_OR_RETURN(e.content_digest, CombineWorkerDigests(workers, options_.base_url));
  return e;
}

Result<ResumeEvidence> VllmEngine::Resume() {
  {
    rc::MutexLock lock(mu_);
    install_replies_.reset();
    folded_.reset();
  }
  // /wake_up?tags=scheduling: EngineCore.wake_up with only the scheduling tag resumes the
  // scheduler and wakes no memory (the pair of /sleep?level=0).
  const char* resume_path = options_.vllm.pause_via_sleep ? "/wake_up?tags=scheduling" : "/resume";
  RC_ASSIGN_OR_RETURN(Json reply, PostJson(resume_path, ""));
  ResumeEvidence e;
  RC_ASSIGN_OR_RETURN(e.paused_after, IsPaused());
  Json detail{{"resume", reply}};
  std::optional<Json> warm;
  bool reset_done = false;
  {
    rc::MutexLock lock(mu_);
    warm = warmup_;
    reset_done = prefix_reset_done_;
  }
  if (e.paused_after) {
    e.detail = detail;
    return e;
  }
  if (!reset_done) {
    // A resume after a rejected update (no reset): cached canary blocks are expected and fine.
    detail["canary"] = Json{{"checked", false}, {"why", "no prefix cache reset in this cycle"}};
    e.detail = detail;
    return e;
  }
  RC_ASSIGN_OR_RETURN(int64_t cached, Canary());
  {
    rc::MutexLock lock(mu_);
    warmup_.reset();
    prefix_reset_done_ = false;
  }
  if (cached != 0) {
    return DataLoss("stale prefix cache on vLLM at " + options_.base_url + ": the canary reported " +
                    std::to_string(cached) + " cached prompt tokens after the reset");
  }
  bool verifiable = warm && warm->value("verifiable", false);
  Json canary{{"checked", true}, {"cached_tokens", cached}, {"verified", verifiable}};
  if (!warm) {
    canary["why_not"] = "the canary was not warmed in this cycle";
  } else {
    canary["warmup"] = *warm;
    if (!verifiable) canary["why_not"] = warm->value("why_not", std::string("the warm-up showed no cache hit"));
  }
  detail["canary"] = canary;
  e.detail = detail;
  return e;
}

// ---- vLLM's own transfer (--vllm-transfer native-nccl) ---------------------------------------

Result<Json> VllmEngine::NativePreflight(const UpdateTarget& target) {
  const std::string sender = "native sender at " + options_.vllm.native_trainer_url;
  RC_ASSIGN_OR_RETURN(Json state, SenderJson(trainer_call_ ? trainer_call_("GET", "/rc/native/state", "")
                                                           : Result<HttpReply>(FailedPrecondition("no sender URL")),
                                             "GET " + sender + "/rc/native/state"));
  std::string path = "/rc/native/versions/" + target.label + "/update_info";
  RC_ASSIGN_OR_RETURN(Json info, SenderJson(trainer_call_("GET", path, ""), "GET " + sender + path));
  if (!info.is_object() || !info.contains("update_info") || !info["update_info"].is_object()) {
    return DataLoss("GET " + sender + path + ": no update_info object");
  }
  const Json& u = info["update_info"];
  for (const char* k : {"names", "dtype_names", "shapes"}) {
    if (!u.contains(k) || !u[k].is_array()) {
      std::string msg = "GET " + sender;
      msg.append(path).append(": update_info.").append(k).append(" missing");
      return DataLoss(msg);
    }
  }
  if (u["names"].empty() || u["names"].size() != u["dtype_names"].size() || u["names"].size() != u["shapes"].size()) {
    return DataLoss("GET " + sender + path + ": update_info lists are empty or of different lengths");
  }
  if (info.value("version", std::string()) != target.label) {
    return DataLoss("GET " + sender + path + ": answered for version '" + info.value("version", std::string()) + "'");
  }
  return Json{{"state", state}, {"update_info", u}, {"bytes", info.value("bytes", int64_t{0})}};
}

// Forms vLLM's weight-transfer group: the sender's /rc/native/init (rank 0) on a detached thread
// and vLLM's /init_weight_transfer_engine (rank_offset 1) here, at the same time: each blocks
// until the other side joined. Nothing of the weights is touched, whatever happens.
Result<Json> VllmEngine::NativeInitGroup(const Json& trainer_state, int64_t workers, Json* calls) {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t world = 1 + workers;
  Json init_info{{"master_address", trainer_state.value("master_address", std::string("127.0.0.1"))},
                 {"master_port", trainer_state.value("master_port", int64_t{0})},
                 {"rank_offset", 1},
                 {"world_size", world}};
  auto sender = StartBackground(trainer_call_, "POST", "/rc/native/init", Json{{"world_size", world}}.dump());
  auto vllm = PostJson("/init_weight_transfer_engine", Json{{"init_info", init_info}}.dump());
  calls->push_back(Json{{"call", "POST /init_weight_transfer_engine"},
                        {"ok", vllm.ok()},
                        {"ms", MsSince(t0)},
                        {"error", vllm.ok() ? Json() : Json(vllm.status().ToString())}});
  // vLLM refused its half: the sender's rendezvous waits for a peer that will not come (vLLM's
  // store timeout is 300 s), so it gets a short grace only.
  auto init_deadline = t0 + std::chrono::milliseconds(options_.vllm.native_timeout_ms);
  if (!vllm.ok()) init_deadline = std::min(init_deadline, std::chrono::steady_clock::now() + std::chrono::seconds(1));
  auto joined = JoinBackground(*sender, init_deadline);
  const std::string what = "POST native sender at " + options_.vllm.native_trainer_url + "/rc/native/init";
  if (!joined) {
    calls->push_back(Json{{"call", "sender init"}, {"ok", false}, {"error", "deadline"}});
    if (!vllm.ok()) {
      return vllm.status().WithContext(
          "forming vLLM's weight-transfer group (start vLLM with "
          "--weight-transfer-config '{\"backend\":\"nccl\"}')");
    }
    return DeadlineExceeded(what + " did not finish within " + std::to_string(options_.vllm.native_timeout_ms) + " ms");
  }
  auto s = SenderJson(*joined, what);
  calls->push_back(Json{{"call", "sender init"},
                        {"ok", s.ok()},
                        {"ms", sender->ms},
                        {"error", s.ok() ? Json() : Json(s.status().ToString())}});
  if (!vllm.ok())
    return vllm.status().WithContext(
        "forming vLLM's weight-transfer group (start vLLM with "
        "--weight-transfer-config '{\"backend\":\"nccl\"}')");
  RC_RETURN_IF_ERROR(s.status());
  return Json{{"init_info", init_info}, {"sender", *s}, {"ms", MsSince(t0)}};
}

// The native session (docs/vllm.md, "vLLM's own transfer"), inside the install (paused, drained):
//  1. the sender's update_info for the version (from this cycle's Stage, else fetched now);
//  2. the group, when the adapter forms it (native_init) and it is not formed for this vLLM boot
//     or the sender says it is not joined: NativeInitGroup;
//  3. POST /start_weight_update (vLLM moves the model's layers onto meta tensors);
//  4. concurrently: the sender's POST /rc/native/send on a detached thread and POST
//     /update_weights {update_info} here — each blocks on the same broadcasts, so neither waits
//     for the other — then both joined within native_timeout_ms;
//  5. POST /finish_weight_update (vLLM's layerwise finalize copies into the kernel tensors);
//  6. collective_rpc rc_adopt(version, content_digest = the target's manifest digest, specs =
//     update_info): the label is set only if a fresh live digest equals it.
// Any failure before 3 is a refusal with nothing touched. Any failure from 3 on is
// failed_after_mutation (TAINTED): after the failure, if vLLM answered (nothing hangs in a
// collective), the adapter finishes a session vLLM still holds, has rc_native_state(restore)
// finalize a reload vLLM abandoned, and records a fresh rc_digest, so the evidence says what the
// weights are; the label stays what rc_adopt/rc_install proved, or says unknown.
namespace {
// "POST /start_weight_update ok, sender send ok, ..." — the order of the session's calls, for the
// error message (the Runner journals an install's error, not its detail, when it taints).
std::string CallTrail(const Json& calls) {
  std::string out;
  for (const Json& c : calls) {
    if (!out.empty()) out += ", ";
    out += c.value("call", std::string("?")) + (c.value("ok", false) ? " ok" : " FAILED");
  }
  return "[" + out + "]";
}
}  // namespace

// What one native install records as it goes: its start, the session's calls in order and the
// evidence detail.
struct VllmEngine::NativeInstallLog {
  std::chrono::steady_clock::time_point t0;
  Json calls = Json::array();
  Json detail;
};

Result<InstallEvidence> VllmEngine::NativeInstall(const UpdateTarget& target, bool full) {
  NativeInstallLog log;
  log.t0 = std::chrono::steady_clock::now();
  log.detail = Json{{"transfer", "vllm_native_nccl"}, {"sender", options_.vllm.native_trainer_url}};
  Json update_info;
  if (std::optional<std::string> why = NativePrepare(target, full, &log, &update_info)) {
    return NativeRefused(target, full, &log, *why);
  }
  {
    rc::MutexLock lock(mu_);
    install_replies_.reset();
  }
  // 3. start: from here the model is inside vLLM's layerwise reload.
  auto start = PostJson("/start_weight_update", "");
  log.calls.push_back(Json{{"call", "POST /start_weight_update"},
                           {"ok", start.ok()},
                           {"ms", MsSince(log.t0)},
                           {"error", start.ok() ? Json() : Json(start.status().ToString())}});
  if (!start.ok() && start.status().message().find("Weight transfer not configured") != std::string::npos) {
    // vLLM checks the configuration before anything else (Worker._check_weight_transfer_engine).
    return NativeRefused(target, full, &log,
                         start.status().ToString() + " (start vLLM with --weight-transfer-config '{\"backend\":\"nccl\"}')");
  }
  if (!start.ok()) return NativeFailedAfter(target, &log, /*update_answered=*/true, start.status().ToString());
  return NativeSendAndAdopt(target, update_info, &log);
}

std::optional<std::string> VllmEngine::NativePrepare(const UpdateTarget& target, bool full, NativeInstallLog* log,
                                                     Json* update_info) {
  std::optional<Json> pre;
  std::string boot, group_boot;
  {
    rc::MutexLock lock(mu_);
    if (!full && staged_version_ == target.label) pre = native_preflight_;
    boot = boot_id_;
    group_boot = native_group_boot_;
  }
  if (target.identity.content_digest.size() != 16) {
    return "the target has no 16-digit manifest content digest ('" + target.identity.content_digest +
           "'): nothing could prove the transferred weights";
  }
  if (!pre) {
    auto p = NativePreflight(target);
    log->calls.push_back(
        Json{{"call", "sender update_info"}, {"ok", p.ok()}, {"error", p.ok() ? Json() : Json(p.status().ToString())}});
    if (!p.ok()) return p.status().ToString();
    pre = *p;
  }
  *update_info = (*pre)["update_info"];
  const Json& info = *update_info;
  log->detail["tensors"] = info["names"].size();
  log->detail["bytes"] = pre->value("bytes", int64_t{0});
  if (options_.vllm.native_init) {
    // The sender's state now (not the preflight's): it drops out of the group after a failed send.
    auto st = SenderJson(trainer_call_("GET", "/rc/native/state", ""),
                         "GET native sender at " + options_.vllm.native_trainer_url + "/rc/native/state");
    if (!st.ok()) return st.status().ToString();
    bool joined = st->value("joined", false);
    if (!joined || group_boot.empty() || group_boot != boot) {
      auto workers = CollectiveRpc("rc_describe", Json::object(), 30000);
      if (!workers.ok()) return workers.status().ToString();
      auto g = NativeInitGroup(*st, static_cast<int64_t>(workers->size()), &log->calls);
      if (!g.ok()) return "forming the weight-transfer group failed: " + g.status().ToString();
      log->detail["group"] = *g;
      rc::MutexLock lock(mu_);
      native_group_boot_ = boot;
    } else {
      log->detail["group"] = Json{{"formed", "earlier, same vLLM boot"}, {"boot_id", boot}};
    }
  } else {
    log->detail["group"] = Json{{"formed", "externally (--vllm-native-init external)"}};
  }
  return std::nullopt;
}

Result<InstallEvidence> VllmEngine::NativeRefused(const UpdateTarget& target, bool full, NativeInstallLog* log,
                                                  const std::string& why) {
  if (full) return FailedPrecondition("recovery through vLLM's own transfer: " + why);
  InstallEvidence e;
  e.outcome = InstallOutcome::kRefusedUntouched;
  e.error = "install of " + target.label + " through vLLM's own transfer refused before start_weight_update: " + why +
            " " + CallTrail(log->calls);
  log->detail["outcome"] = "refused_untouched";
  log->detail["calls"] = log->calls;
  e.detail = log->detail;
  return e;
}

Result<InstallEvidence> VllmEngine::NativeFailedAfter(const UpdateTarget& target, NativeInstallLog* log,
                                                      bool update_answered, const std::string& why) {
  Json cleanup = Json::object();
  if (update_answered) {
    // Leave no session behind and no layer on meta tensors, then say what the weights are.
    auto fin = PostJson("/finish_weight_update", "");
    cleanup["finish"] = fin.ok() ? Json("ok") : Json(fin.status().ToString());
    auto restore = CollectiveRpc("rc_native_state", Json{{"restore", true}}, 30000);
    cleanup["native_state"] = restore.ok() ? Json(*restore) : Json(restore.status().ToString());
    auto dig = CollectiveRpc("rc_digest", Json{{"per_tensor", false}, {"fresh", true}}, 30000);
    if (dig.ok()) {
      auto combined = CombineWorkerDigests(*dig, options_.base_url);
      cleanup["live_digest"] = combined.ok() ? Json(*combined) : Json(combined.status().ToString());
      cleanup["label"] = (*dig)[0].value("label", std::string());
    } else {
      cleanup["live_digest"] = dig.status().ToString();
    }
  } else {
    cleanup["skipped"] = "a transfer call has not returned (it may hang in the collective): nothing more is sent";
  }
  InstallEvidence e;
  e.outcome = InstallOutcome::kFailedAfterMutation;
  e.error = "install of " + target.label + " through vLLM's own transfer failed after start_weight_update: " + why +
            " " + CallTrail(log->calls) + "; after the failure: " + cleanup.dump();
  log->detail["outcome"] = "failed_after_mutation";
  log->detail["calls"] = log->calls;
  log->detail["cleanup"] = cleanup;
  log->detail["total_ms"] = MsSince(log->t0);
  e.detail = log->detail;
  e.label = cleanup.value("label", std::string());
  return e;
}

Result<InstallEvidence> VllmEngine::NativeSendAndAdopt(const UpdateTarget& target, const Json& update_info,
                                                       NativeInstallLog* log) {
  const auto t0 = log->t0;
  Json& calls = log->calls;
  Json& detail = log->detail;
  bool update_answered = true;  // false: a call may still hang in the collective
  auto fail_after = [&](const std::string& why) { return NativeFailedAfter(target, log, update_answered, why); };
  // 4. the concurrent pair.
  auto send = StartBackground(trainer_call_, "POST", "/rc/native/send", Json{{"version", target.label}}.dump());
  auto update = PostJson("/update_weights", Json{{"update_info", update_info}}.dump());
  calls.push_back(Json{{"call", "POST /update_weights"},
                       {"ok", update.ok()},
                       {"ms", MsSince(t0)},
                       {"error", update.ok() ? Json() : Json(update.status().ToString())}});
  // A refused /update_weights never entered the broadcasts: the sender's half may wait for a
  // peer forever, so it gets a short grace only.
  auto send_deadline = send->started + std::chrono::milliseconds(options_.vllm.native_timeout_ms);
  if (!update.ok()) send_deadline = std::min(send_deadline, std::chrono::steady_clock::now() + std::chrono::seconds(1));
  auto sent = JoinBackground(*send, send_deadline);
  const std::string what = "POST native sender at " + options_.vllm.native_trainer_url + "/rc/native/send";
  if (!sent) {
    calls.push_back(Json{{"call", "sender send"}, {"ok", false}, {"error", "deadline"}});
    update_answered = update.ok() || update.status().message().find(" answered ") != std::string::npos;
    return fail_after(what + " did not finish in time" +
                      (update.ok() ? "" : "; /update_weights: " + update.status().ToString()));
  }
  auto sent_json = SenderJson(*sent, what);
  calls.push_back(Json{{"call", "sender send"},
                       {"ok", sent_json.ok()},
                       {"ms", send->ms},
                       {"error", sent_json.ok() ? Json() : Json(sent_json.status().ToString())},
                       {"reply", sent_json.ok() ? *sent_json : Json()}});
  if (!update.ok()) {
    update_answered = update.status().code() != StatusCode::kUnavailable ||
                      update.status().message().find(" answered ") != std::string::npos;
    return fail_after("/update_weights: " + update.status().ToString() +
                      (sent_json.ok() ? "" : "; " + sent_json.status().ToString()));
  }
  if (!sent_json.ok()) return fail_after(sent_json.status().ToString());
  // 5. finish.
  auto fin = PostJson("/finish_weight_update", "");
  calls.push_back(Json{{"call", "POST /finish_weight_update"},
                       {"ok", fin.ok()},
                       {"ms", MsSince(t0)},
                       {"error", fin.ok() ? Json() : Json(fin.status().ToString())}});
  if (!fin.ok()) return fail_after("/finish_weight_update: " + fin.status().ToString());
  // 6. proof, then the label.
  Json specs = Json::array();
  for (size_t i = 0; i < update_info["names"].size(); ++i) {
    specs.push_back(Json::array({update_info["names"][i], update_info["dtype_names"][i], update_info["shapes"][i]}));
  }
  auto adopt = CollectiveRpc(
      "rc_adopt", Json{{"version", target.label}, {"content_digest", target.identity.content_digest}, {"specs", specs}},
      0);
  calls.push_back(Json{{"call", "collective_rpc rc_adopt"},
                       {"ok", adopt.ok()},
                       {"ms", MsSince(t0)},
                       {"error", adopt.ok() ? Json() : Json(adopt.status().ToString())}});
  if (!adopt.ok()) return fail_after("rc_adopt: " + adopt.status().ToString());
  detail["adopt"] = *adopt;
  for (size_t i = 0; i < adopt->size(); ++i) {
    Status st = WorkerStatus((*adopt)[i], i, "rc_adopt", options_.base_url);
    if (!st.ok()) {
      auto e = fail_after(st.ToString());
      if (e.ok()) e->label = (*adopt)[i].value("label", e->label);
      return e;
    }
  }
  RC_ASSIGN_OR_RETURN(InstallEvidence e, InstallEvidenceFromOutcomes(*adopt, target.label, options_.base_url));
  if (e.outcome != InstallOutcome::kInstalled) return fail_after("rc_adopt did not adopt: " + e.error);
  detail["calls"] = calls;
  detail["total_ms"] = MsSince(t0);
  detail["outcome"] = "installed";
  for (auto& [k, v] : e.detail.items()) detail[k] = v;
  e.detail = detail;
  bool complete = !adopt->empty();
  for (const Json& w : *adopt) complete = complete && w.contains("content_digest") && w["content_digest"].is_string();
  if (complete) {
    rc::MutexLock lock(mu_);
    install_replies_ = *adopt;
  }
  return e;
}

// ---- Identity, rollouts, aborts -------------------------------------------------------------

// rolloutcore's worker extension inside every vLLM worker answers the collective RPC "rc_label"
// with {label, generation (its install counter), boot_id, content_digest (hex or null)}; every
// worker must agree, or the engine is not one identity. The release (GET /version) is part of the
// boot id, and on 0.33 vLLM's own label must be the extension's.
Result<IdentityEvidence> VllmEngine::ProbeIdentity() {
  const Json body{{"method", "rc_label"}, {"args", Json::array()}, {"kwargs", Json::object()}};
  RC_ASSIGN_OR_RETURN(HttpReply r, call_("POST", "/collective_rpc", body.dump()));
  const std::string where = "POST " + options_.base_url + "/collective_rpc rc_label";
  if (r.status == 404) {
    return Unimplemented("vLLM at " + options_.base_url +
                         " has no /collective_rpc (or no rolloutcore worker extension): it cannot report its identity");
  }
  if (r.status != 200) return Unavailable(where + " answered " + std::to_string(r.status) + ": " + ErrorMessage(r.body));
  RC_ASSIGN_OR_RETURN(Json j, ParseJson(r.body, where));
  if (!j.is_object() || !j.contains("results") || !j["results"].is_array() || j["results"].empty()) {
    return DataLoss(where + ": expected {\"results\": [one object per worker]}, got " + j.dump());
  }
  const Json& results = j["results"];
  IdentityEvidence first;
  for (size_t i = 0; i < results.size(); ++i) {
    const Json& w = results[i];
    const std::string at = where + " results[" + std::to_string(i) + "]";
    if (!w.is_object()) return DataLoss(at + ": expected an object, got " + JsonTypeName(w));
    RC_ASSIGN_OR_RETURN(IdentityEvidence e, IdentityFromJson(w, "label", "generation", at));
    if (i == 0) {
      first = e;
    } else if (e.label != first.label || e.install_generation != first.install_generation ||
               e.content_digest != first.content_digest) {
      return DataLoss(where + ": workers disagree: worker 0 reports label '" + first.label + "' generation " +
                      std::to_string(first.install_generation) + " boot " + first.boot_id + " digest '" +
                      first.content_digest + "', worker " + std::to_string(i) + " reports label '" + e.label +
                      "' generation " + std::to_string(e.install_generation) + " boot " + e.boot_id + " digest '" +
                      e.content_digest + "'");
    } else {
      // Each worker is its own process with its own boot id: the engine's is all of them, so a
      // restart of any worker changes it.
      first.boot_id += "," + e.boot_id;
    }
  }
  // The release: a vLLM restarted on another release is another engine even if its workers'
  // state looked the same.
  RC_ASSIGN_OR_RETURN(std::string version, ReadVersion());
  first.boot_id += ",vllm=" + version;
  auto release = VllmReleaseOf(version, /*allow_untested=*/true, options_.base_url);
  if (release.ok() && *release == VllmRelease::k033) {
    RC_ASSIGN_OR_RETURN(std::string info, ReadWeightInfo());
    if (info != first.label) {
      // Reported as the label the engine holds, so the controller's check names both and taints.
      first.label = first.label + " (vLLM's own label, GET /weight_info: '" + info + "')";
    }
  }
  // Whether it is paused (a READY engine that is hangs every rollout); an engine that cannot say
  // leaves it unknown rather than failing the identity it did report.
  if (auto paused = IsPaused(); paused.ok()) first.paused = *paused;
  return first;
}

Result<lifecycle::AbortEvidence> VllmEngine::AbortRequests(const std::vector<std::string>& rollout_ids) {
  lifecycle::AbortEvidence e;
  if (rollout_ids.empty()) return e;  // vLLM aborts every request on an empty list
  Json ids = Json::array();
  for (const auto& id : rollout_ids) ids.push_back("cmpl-" + id + "-0");
  RC_ASSIGN_OR_RETURN(Json j, PostJson("/abort_requests", Json{{"request_ids", ids}}.dump()));
  e.aborted = j.is_object() ? j.value("aborted", static_cast<int64_t>(rollout_ids.size()))
                            : static_cast<int64_t>(rollout_ids.size());
  return e;
}

Result<Json> VllmEngine::Complete(const Json& request) {
  RC_RETURN_IF_ERROR(EnsureRelease());
  Json body = request;
  std::string label;
  {
    rc::MutexLock lock(mu_);
    label = current_label_;
  }
  const bool v033 = Is033();
  if (v033) {
    body["return_weight_versions"] = true;
    // Prefix blocks keyed by the label the rollout is sent under (see ResetCache: keep mode).
    if (!label.empty()) {
      std::string salt = "rc:" + label;
      if (request.contains("cache_salt") && request["cache_salt"].is_string()) {
        salt += ":" + request["cache_salt"].get<std::string>();
      }
      body["cache_salt"] = salt;
    }
  }
  RC_ASSIGN_OR_RETURN(Json resp, PostCompletion(options_.base_url, body, options_.completion_timeout_ms));
  if (!v033 || !resp.contains("choices") || !resp["choices"].is_array()) return resp;
  const std::string rollout = request.value("request_id", std::string());
  for (Json& c : resp["choices"]) {
    if (!c.is_object()) continue;
    if (!c.contains("weight_versions") || c["weight_versions"].is_null()) {
      // Asked for and not given: the controller cannot check the tokens' versions, so it refuses
      // the rollout (never stores it as bound).
      c["version_spans"] = Json::array({Json{{"from_token", -1}, {"to_token", -1}, {"label", ""},
                                             {"error", "vLLM answered without weight_versions though the request "
                                                       "asked for return_weight_versions"}}});
      continue;
    }
    auto spans = SpansFromWeightVersions(c["weight_versions"]);
    if (!spans.ok()) {
      // Kept as a span the controller refuses (never silently dropped).
      c["version_spans"] = Json::array({Json{{"from_token", -1}, {"to_token", -1}, {"label", ""},
                                             {"error", spans.status().ToString()}}});
      continue;
    }
    rc::MutexLock lock(mu_);
    for (size_t i = 0; i < spans->size(); ++i) {
      Json& span = (*spans)[i];
      // A span whose label an in-flight update set, for a request that update froze: the weights
      // changed under it there (also a first span, for a request frozen before its first token:
      // vLLM opens no span for the old label then, but its prompt's KV is the old weights').
      auto it = label_changes_.find(span["label"].get<std::string>());
      const bool frozen_there = it != label_changes_.end() && it->second.swap_index.count(rollout) > 0;
      if (frozen_there) {
        span["kv"] = it->second.mode == lifecycle::PolicyMode::kRecompute ? "recomputed" : "stale";
        span["swap_index_reported"] = it->second.swap_index.at(rollout);
      } else if (i == 0) {
        span["kv"] = "fresh";
      } else if (it != label_changes_.end()) {
        // A later span of an in-flight update that did not report this request frozen: the
        // controller refuses it (no count to check the boundary against).
        span["kv"] = it->second.mode == lifecycle::PolicyMode::kRecompute ? "recomputed" : "stale";
        span["swap_index_reported"] = nullptr;
      }
      // Otherwise: a label no update of this engine set; the controller names it.
    }
    c["version_spans"] = std::move(*spans);
  }
  return resp;
}

std::shared_ptr<BlockingEngine> MakeVllmEngine(std::shared_ptr<EngineHttp> http, const HttpAdapterOptions& o) {
  HttpCall trainer_call;
  if (!o.vllm.native_trainer_url.empty()) {
    // Runs on detached threads too (the concurrent halves of the native session), so it owns
    // copies of what it needs and never refers to the engine.
    trainer_call = [url = o.vllm.native_trainer_url,
                    timeout_ms = std::max(o.http_timeout_ms, o.vllm.native_timeout_ms + 5000)](
                       const std::string& method, const std::string& path, const std::string& body) {
      return EngineHttpOnce(url, timeout_ms, method, path, body);
    };
  }
  return std::make_shared<VllmEngine>(
      o,
      [http = std::move(http)](const std::string& method, const std::string& path, const std::string& body) {
        return http->Call(method, path, body);
      },
      std::move(trainer_call));
}

}  // namespace rc::adapters::internal
