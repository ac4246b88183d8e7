// Test doubles for the lifecycle in real time (threads, not virtual time):
//
//  * FakeEngine: a thread-safe engine model behind the EngineAdapter interface. Every call
//    completes on its own detached thread after `latency`, like an HTTP adapter's would. It
//    counts weight mutations so tests can prove no rollout ever spanned one. Its identity (boot
//    id, install generation) can be changed behind the controller's back: Restart() (a new
//    process on the starting label and digest) and InstallBehindTheBack().
//  * FaultInjectingAdapter: wraps any EngineAdapter and injects per-operation faults — delay,
//    hang (never answers), fail before the inner call, fail after it (the inner call's effect
//    happened: "fail after mutation" for installs), or a corrupted digest.
//
// Thread safety: both are safe to call from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "rolloutcore/lifecycle/engine_adapter.h"

namespace rc::testing {

using namespace rc::lifecycle;  // NOLINT(google-build-using-namespace): test helpers

// Released at destruction so that detached "hung" calls finish before the process exits.
class Gate {
 public:
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return open_; });
  }
  void Open() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

class FakeEngine final : public EngineAdapter {
 public:
  struct Shared {
    std::mutex mu;
    std::string label;
    std::string digest;
    bool paused = false;
    int64_t running = 0;
    std::string boot_id = "boot-0";
    int64_t install_generation = 0;
    std::string start_label, start_digest;
    int boots = 0;
    std::atomic<int64_t> mutations_started{0};
    std::atomic<int64_t> mutations_finished{0};
    std::atomic<bool> mutating{false};
    std::atomic<int64_t> stages{0};  // Stage calls
    // Policy modes: every mode is accepted; PauseForUpdate(abort) reports the running requests
    // ended (the engine aborted them; a completion still in progress answers as it likes, as one
    // that finished just before the abort reached it would). Counted per mode.
    std::atomic<int64_t> pauses_for_update{0};
    std::atomic<int64_t> aborts{0};  // AbortRequests calls
  };

  FakeEngine(std::string label, std::string digest, std::chrono::microseconds latency = std::chrono::microseconds(200))
      : s_(std::make_shared<Shared>()), latency_(latency) {
    s_->label = std::move(label);
    s_->digest = std::move(digest);
    s_->start_label = s_->label;
    s_->start_digest = s_->digest;
    static std::atomic<int> instances{0};
    s_->boot_id = "fake-" + std::to_string(instances.fetch_add(1)) + "-boot-0";
  }

  // The engine process restarted: a new boot id, its starting label and digest, no installs.
  void Restart() {
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->boot_id = s_->boot_id.substr(0, s_->boot_id.rfind('-') + 1) + std::to_string(++s_->boots);
    s_->label = s_->start_label;
    s_->digest = s_->start_digest;
    s_->install_generation = 0;
    s_->paused = false;
  }
  // Someone installed other weights (and maybe set another label) without the controller.
  void InstallBehindTheBack(const std::string& digest, const std::string& label) {
    std::lock_guard<std::mutex> lock(s_->mu);
    ++s_->install_generation;
    s_->digest = digest;
    s_->label = label;
  }
  // The identity a completion reports (the embedded engine's "rolloutcore" object).
  Json CompletionIdentity() const {
    std::lock_guard<std::mutex> lock(s_->mu);
    return Json{{"boot_id", s_->boot_id}, {"label", s_->label}, {"install_generation", s_->install_generation}};
  }

  std::shared_ptr<Shared> shared() const { return s_; }
  void StartRequest() {
    std::lock_guard<std::mutex> lock(s_->mu);
    ++s_->running;
  }
  void EndRequest() {
    std::lock_guard<std::mutex> lock(s_->mu);
    --s_->running;
  }

  Result<EngineDescription> Describe() override {
    EngineDescription d;
    d.name = "fake";
    d.kind = "fake";
    d.offers_content_digest = true;
    d.supports_staging = true;
    d.caches = {CacheKind::kPrefix};
    return d;
  }
  Pending<DrainStatus> GetDrainStatus() override {
    return Async<DrainStatus>([s = s_]() -> Result<DrainStatus> {
      std::lock_guard<std::mutex> lock(s->mu);
      return DrainStatus{s->running, 0};
    });
  }
  Pending<PauseEvidence> Pause(PauseMode) override {
    return Async<PauseEvidence>([s = s_]() -> Result<PauseEvidence> {
      std::lock_guard<std::mutex> lock(s->mu);
      s->paused = true;
      return PauseEvidence{true, s->running};
    });
  }
  Pending<AbortEvidence> AbortRequests(const std::vector<std::string>& ids) override {
    s_->aborts.fetch_add(1);
    return Async<AbortEvidence>([n = ids.size()]() -> Result<AbortEvidence> { return AbortEvidence{static_cast<int64_t>(n)}; });
  }
  Status SupportsPolicyMode(PolicyMode) override { return OkStatus(); }
  Pending<PauseEvidence> PauseForUpdate(PolicyMode mode) override {
    s_->pauses_for_update.fetch_add(1);
    return Async<PauseEvidence>([s = s_, mode]() -> Result<PauseEvidence> {
      std::lock_guard<std::mutex> lock(s->mu);
      s->paused = true;
      return PauseEvidence{true, mode == PolicyMode::kAbort ? 0 : s->running};
    });
  }
  Pending<StageEvidence> Stage(const UpdateTarget& t) override {
    s_->stages.fetch_add(1);
    return Async<StageEvidence>([t]() -> Result<StageEvidence> { return StageEvidence{t.label, 0, Json::object()}; });
  }
  Pending<InstallEvidence> Install(const UpdateTarget& t, bool) override {
    return Async<InstallEvidence>([s = s_, t]() -> Result<InstallEvidence> {
      {
        std::lock_guard<std::mutex> lock(s->mu);
        if (!s->paused) {
          InstallEvidence refused{t.label, 0, Json::object()};
          refused.outcome = InstallOutcome::kRefusedUntouched;
          refused.error = "install refused: engine is not paused";
          return refused;
        }
      }
      s->mutating = true;
      s->mutations_started.fetch_add(1);
      {
        std::lock_guard<std::mutex> lock(s->mu);
        ++s->install_generation;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(300));
      {
        std::lock_guard<std::mutex> lock(s->mu);
        s->label = t.label;
        s->digest = t.identity.content_digest;
      }
      s->mutations_finished.fetch_add(1);
      s->mutating = false;
      return InstallEvidence{t.label, 1, Json::object()};
    });
  }
  Pending<CacheResetResult> ResetCache(CacheKind kind) override {
    return Async<CacheResetResult>([kind]() -> Result<CacheResetResult> {
      return CacheResetResult{kind, true, 1, 0, true};
    });
  }
  Pending<LabelEvidence> ReadLabel() override {
    return Async<LabelEvidence>([s = s_]() -> Result<LabelEvidence> {
      std::lock_guard<std::mutex> lock(s->mu);
      return LabelEvidence{s->label};
    });
  }
  Pending<DigestEvidence> ReadContentDigest() override {
    return Async<DigestEvidence>([s = s_]() -> Result<DigestEvidence> {
      std::lock_guard<std::mutex> lock(s->mu);
      return DigestEvidence{s->digest};
    });
  }
  Pending<ResumeEvidence> Resume() override {
    return Async<ResumeEvidence>([s = s_]() -> Result<ResumeEvidence> {
      std::lock_guard<std::mutex> lock(s->mu);
      s->paused = false;
      return ResumeEvidence{false};
    });
  }
  Pending<IdentityEvidence> ProbeIdentity() override {
    return Async<IdentityEvidence>([s = s_]() -> Result<IdentityEvidence> {
      std::lock_guard<std::mutex> lock(s->mu);
      return IdentityEvidence{s->boot_id, s->label, s->install_generation, s->digest, s->paused};
    });
  }

 private:
  template <typename T>
  Pending<T> Async(std::function<Result<T>()> fn) {
    auto latency = latency_;
    return RunDetached<T>([fn = std::move(fn), latency]() {
      std::this_thread::sleep_for(latency);
      return fn();
    });
  }
  std::shared_ptr<Shared> s_;
  std::chrono::microseconds latency_;
};

// Per-operation faults around any adapter.
struct Fault {
  enum class Kind { kNone, kDelay, kHang, kFailBefore, kFailAfter, kCorruptDigest };
  Kind kind = Kind::kNone;
  std::chrono::milliseconds delay{0};
  StatusCode code = StatusCode::kUnavailable;
};

class FaultInjectingAdapter final : public EngineAdapter {
 public:
  explicit FaultInjectingAdapter(EngineAdapter* inner) : inner_(inner), gate_(std::make_shared<Gate>()) {}
  ~FaultInjectingAdapter() override { gate_->Open(); }

  // ops: describe-less names as in the scripted engine: "install", "pause", "resume", ...
  void Set(const std::string& op, Fault f) {
    std::lock_guard<std::mutex> lock(mu_);
    faults_[op] = f;
  }

  Result<EngineDescription> Describe() override { return inner_->Describe(); }
  Pending<DrainStatus> GetDrainStatus() override { return Wrap("drain_status", [&] { return inner_->GetDrainStatus(); }); }
  Pending<PauseEvidence> Pause(PauseMode m) override { return Wrap("pause", [&] { return inner_->Pause(m); }); }
  Pending<AbortEvidence> AbortRequests(const std::vector<std::string>& ids) override {
    return Wrap("abort", [&] { return inner_->AbortRequests(ids); });
  }
  Status SupportsPolicyMode(PolicyMode mode) override { return inner_->SupportsPolicyMode(mode); }
  Pending<PauseEvidence> PauseForUpdate(PolicyMode mode) override {
    return Wrap("pause_for_update", [&] { return inner_->PauseForUpdate(mode); });
  }
  Pending<ReplayEvidence> Replay(const ReplayRequest& request) override {
    return Wrap("replay", [&] { return inner_->Replay(request); });
  }
  Pending<StageEvidence> Stage(const UpdateTarget& t) override { return Wrap("stage", [&] { return inner_->Stage(t); }); }
  Pending<InstallEvidence> Install(const UpdateTarget& t, bool full) override {
    Fault f = Get("install");
    if (f.kind == Fault::Kind::kFailBefore) {
      // The inner install was never called: this wrapper knows nothing was touched, and says so
      // the way an engine does (an error would mean "outcome unknown").
      InstallEvidence refused{t.label, 0, Json::object()};
      refused.outcome = InstallOutcome::kRefusedUntouched;
      refused.error = "injected failure before install (" + std::string(StatusCodeName(f.code)) + ")";
      return Pending<InstallEvidence>::Completed(refused);
    }
    return Wrap("install", [&] { return inner_->Install(t, full); });
  }
  Pending<CacheResetResult> ResetCache(CacheKind k) override { return Wrap("reset", [&] { return inner_->ResetCache(k); }); }
  Pending<LabelEvidence> ReadLabel() override { return Wrap("label", [&] { return inner_->ReadLabel(); }); }
  Pending<DigestEvidence> ReadContentDigest() override {
    Fault f = Get("digest");
    if (f.kind == Fault::Kind::kCorruptDigest) {
      Pending<DigestEvidence> inner = inner_->ReadContentDigest();
      return RunDetached<DigestEvidence>([inner]() -> Result<DigestEvidence> {
        while (!inner.WaitFor(std::chrono::milliseconds(50))) {
        }
        auto r = inner.Get();
        if (!r.ok()) return r;
        return DigestEvidence{"corrupt-" + r->content_digest};
      });
    }
    return Wrap("digest", [&] { return inner_->ReadContentDigest(); });
  }
  Pending<ResumeEvidence> Resume() override { return Wrap("resume", [&] { return inner_->Resume(); }); }
  Pending<IdentityEvidence> ProbeIdentity() override {
    return Wrap("identity", [&] { return inner_->ProbeIdentity(); });
  }

 private:
  Fault Get(const std::string& op) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = faults_.find(op);
    return it == faults_.end() ? Fault{} : it->second;
  }

  template <typename F>
  auto Wrap(const std::string& op, F call) -> decltype(call()) {
    using P = decltype(call());
    using T = std::decay_t<decltype(*std::declval<P>().Get())>;
    Fault f = Get(op);
    switch (f.kind) {
      case Fault::Kind::kNone:
      case Fault::Kind::kCorruptDigest: return call();
      case Fault::Kind::kFailBefore:
        return P::Completed(Status(f.code, "injected failure before " + op));
      case Fault::Kind::kHang: {
        // The call never answers; the worker parks until the adapter is destroyed.
        auto gate = gate_;
        return RunDetached<T>([gate, op]() -> Result<T> {
          gate->Wait();
          return Aborted("hung " + op + " released at teardown");
        });
      }
      case Fault::Kind::kDelay: {
        P inner = call();
        auto delay = f.delay;
        return RunDetached<T>([inner, delay]() -> Result<T> {
          std::this_thread::sleep_for(delay);
          while (!inner.WaitFor(std::chrono::milliseconds(50))) {
          }
          return inner.Get();
        });
      }
      case Fault::Kind::kFailAfter: {
        P inner = call();
        auto code = f.code;
        return RunDetached<T>([inner, code, op]() -> Result<T> {
          while (!inner.WaitFor(std::chrono::milliseconds(50))) {
          }
          return Status(code, "injected failure after " + op + " took effect");
        });
      }
    }
    return call();
  }

  EngineAdapter* inner_;
  std::shared_ptr<Gate> gate_;
  std::mutex mu_;
  std::map<std::string, Fault> faults_;  // guarded by mu_
};

}  // namespace rc::testing
