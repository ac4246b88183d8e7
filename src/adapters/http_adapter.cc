#include "rolloutcore/adapters/http_adapter.h"

#include <mutex>
#include <sstream>

#include "adapters/engines.h"
#include "adapters/lifecycle_types.h"
#include "adapters/vllm_engine.h"
#include "rolloutcore/base/mutex.h"

namespace rc::adapters {

namespace internal {

std::shared_ptr<EngineHttp> MakeEngineHttp(const HttpAdapterOptions& o) {
  return std::make_shared<EngineHttp>(o.base_url, o.http_timeout_ms);
}

namespace {

// A plain http:// engine: which kind it is, asked of the server (GET /rc/engine/state answers
// only on a rolloutcore engine; anything else healthy is taken for vLLM, whose Describe then
// checks its release and the extension). Decided once; every call is forwarded to that kind. A
// call that needs the kind before Describe (a restarted controller's identity probe) detects first.
class DetectingEngine final : public BlockingEngine {
 public:
  explicit DetectingEngine(HttpAdapterOptions o) : o_(std::move(o)), http_(MakeEngineHttp(o_)) {
    if (o_.expected_flavor != EngineFlavor::kUnknown) Choose(o_.expected_flavor);
  }

  EngineFlavor flavor() const {
    rc::MutexLock lock(mu_);
    return flavor_;
  }
  std::shared_ptr<VllmEngine> vllm() const {
    rc::MutexLock lock(mu_);
    return std::dynamic_pointer_cast<VllmEngine>(engine_);
  }

  Result<EngineDescription> Describe() override {
    if (flavor() == EngineFlavor::kUnknown) RC_RETURN_IF_ERROR(Detect());
    return Engine()->Describe();
  }
  Result<DrainStatus> Drain() override {
    RC_ASSIGN_OR_RETURN(auto e, Known());
    return e->Drain();
  }
  Result<PauseEvidence> Pause(PauseMode mode) override {
    RC_ASSIGN_OR_RETURN(auto e, Known());
    return e->Pause(mode);
  }
  Status SupportsPolicyMode(lifecycle::PolicyMode mode) override {
    RC_ASSIGN_OR_RETURN(auto e, Known());
    return e->SupportsPolicyMode(mode);
  }
  Result<PauseEvidence> PauseForUpdate(lifecycle::PolicyMode mode) override {
    RC_ASSIGN_OR_RETURN(auto e, Known());
    return e->PauseForUpdate(mode);
  }
  Result<AbortEvidence> AbortRequests(const std::vector<std::string>& ids) override {
    RC_ASSIGN_OR_RETURN(auto e, Known());
    return e->AbortRequests(ids);
  }
  Result<StageEvidence> Stage(const UpdateTarget& target) override {
    RC_ASSIGN_OR_RETURN(auto e, Known());
    return e->Stage(target);
  }
  Result<InstallEvidence> Install(const UpdateTarget& target, bool full) override {
    RC_ASSIGN_OR_RETURN(auto e, Known());
    return e->Install(target, full);
  }
  Result<CacheResetResult> ResetCache(CacheKind kind) override {
    RC_ASSIGN_OR_RETURN(auto e, Known());
    return e->ResetCache(kind);
  }
  Result<LabelEvidence> ReadLabel() override {
    RC_ASSIGN_OR_RETURN(auto e, Known());
    return e->ReadLabel();
  }
  Result<DigestEvidence> ReadContentDigest() override {
    RC_ASSIGN_OR_RETURN(auto e, Known());
    return e->ReadContentDigest();
  }
  Result<ResumeEvidence> Resume() override {
    RC_ASSIGN_OR_RETURN(auto e, Known());
    return e->Resume();
  }
  Result<ReplayEvidence> Replay(const ReplayRequest& request) override {
    RC_ASSIGN_OR_RETURN(auto e, Known());
    return e->Replay(request);
  }
  Result<IdentityEvidence> ProbeIdentity() override {
    RC_ASSIGN_OR_RETURN(auto e, Known());
    return e->ProbeIdentity();
  }
  Result<Json> Complete(const Json& body) override {
    RC_ASSIGN_OR_RETURN(auto e, Known());
    return e->Complete(body);
  }

 private:
  void Choose(EngineFlavor f) {
    auto engine = f == EngineFlavor::kRolloutcore ? MakeRolloutcoreEngine(http_, o_) : MakeVllmEngine(http_, o_);
    rc::MutexLock lock(mu_);
    if (flavor_ != EngineFlavor::kUnknown) return;  // another call decided first
    flavor_ = f;
    engine_ = std::move(engine);
  }
  Status Detect() {
    RC_ASSIGN_OR_RETURN(HttpReply state, http_->Call("GET", "/rc/engine/state"));
    if (state.status == 200) {
      Choose(EngineFlavor::kRolloutcore);
      return OkStatus();
    }
    RC_ASSIGN_OR_RETURN(HttpReply health, http_->Call("GET", "/health"));
    if (health.status != 200) {
      return Unavailable("engine at " + o_.base_url + " is not healthy (GET /health answered " +
                         std::to_string(health.status) + ")");
    }
    Choose(EngineFlavor::kVllm);
    return OkStatus();
  }
  std::shared_ptr<BlockingEngine> Engine() const {
    rc::MutexLock lock(mu_);
    return engine_;
  }
  Result<std::shared_ptr<BlockingEngine>> Known() {
    if (flavor() == EngineFlavor::kUnknown) RC_RETURN_IF_ERROR(Detect());
    return Engine();
  }

  const HttpAdapterOptions o_;
  const std::shared_ptr<EngineHttp> http_;
  mutable rc::Mutex mu_;
  EngineFlavor flavor_ GUARDED_BY(mu_) = EngineFlavor::kUnknown;
  std::shared_ptr<BlockingEngine> engine_ GUARDED_BY(mu_);
};

}  // namespace
}  // namespace internal

HttpEngineAdapter::HttpEngineAdapter(HttpAdapterOptions options)
    : DetachedAdapter(std::make_shared<internal::DetectingEngine>(std::move(options))) {}

HttpEngineAdapter::~HttpEngineAdapter() = default;

EngineFlavor HttpEngineAdapter::flavor() const {
  return static_cast<internal::DetectingEngine&>(*engine()).flavor();
}

Result<Json> HttpEngineAdapter::WarmCanary() {
  auto vllm = static_cast<internal::DetectingEngine&>(*engine()).vllm();
  if (!vllm) return FailedPrecondition("the canary is a vLLM check; this engine is not vLLM");
  return vllm->WarmCanary("manual");
}

std::function<Result<Json>(const Json&)> HttpEngineAdapter::Completer() const {
  return [e = engine()](const Json& body) { return e->Complete(body); };
}

Result<double> PrometheusValue(const std::string& text, const std::string& name) {
  std::istringstream in(text);
  std::string line;
  bool found = false;
  double sum = 0;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    if (line.rfind(name, 0) != 0) continue;
    size_t after = name.size();
    if (after < line.size() && line[after] != '{' && line[after] != ' ') continue;  // a longer name
    size_t sp = line.rfind(' ');
    if (sp == std::string::npos) continue;
    try {
      sum += std::stod(line.substr(sp + 1));
      found = true;
    } catch (...) {
      std::string msg = "metric " + name;
      msg += ": unparsable sample '";
      msg += line;
      msg += "'";
      return InvalidArgument(msg);
    }
  }
  if (!found) return NotFound("metric " + name + " not found");
  return sum;
}

Result<EngineUrl> ParseEngineUrl(const std::string& url) {
  EngineUrl out;
  std::string rest = url;
  for (const auto& [prefix, flavor] :
       {std::pair<std::string, EngineFlavor>{"vllm+", EngineFlavor::kVllm},
        std::pair<std::string, EngineFlavor>{"rolloutcore+", EngineFlavor::kRolloutcore}}) {
    if (rest.rfind(prefix, 0) == 0) {
      out.flavor = flavor;
      rest = rest.substr(prefix.size());
      break;
    }
  }
  const bool http = rest.rfind("http://", 0) == 0, https = rest.rfind("https://", 0) == 0;
  const size_t host_at = http ? 7 : https ? 8 : 0;
  if ((!http && !https) || rest.size() == host_at || rest[host_at] == '/' || rest[host_at] == ':') {
    return InvalidArgument("engine URL '" + url +
                           "': expected http://HOST:PORT, vllm+http://HOST:PORT or rolloutcore+http://HOST:PORT");
  }
  while (rest.size() > host_at && rest.back() == '/') rest.pop_back();
  out.base_url = rest;
  return out;
}

}  // namespace rc::adapters
