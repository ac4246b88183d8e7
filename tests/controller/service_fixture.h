// Shared by the controller service tests: a version source that resolves every "v*" version,
// FakeEngine handles behind fault wrappers with a completion function that reports the engine's
// live label and identity (as the embedded engine does), and per-test state dirs.
#pragma once

#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <atomic>
#include <thread>
#include <unistd.h>

#include "rolloutcore/controller/service.h"
#include "testing/fake_engine.h"

namespace rc::controller::testing {

namespace fs = std::filesystem;

class StaticVersions : public VersionSource {
 public:
  // How long each lookup takes (a directory across a network).
  std::atomic<int64_t> resolve_delay_ms{0};
  Result<lifecycle::UpdateTarget> Resolve(const std::string& model, const std::string& version) override {
    if (resolve_delay_ms.load() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(resolve_delay_ms.load()));
    if (version.rfind("v", 0) != 0) return NotFound("version " + version + " of " + model + " is not committed");
    lifecycle::UpdateTarget t;
    t.label = version;
    t.model = model;
    t.identity.content_digest = "d-" + version;
    t.identity.checkpoint = model + "@" + version;
    return t;
  }
  Result<std::vector<Commit>> WaitForCommits(const std::string&, uint64_t after, int64_t timeout_ms) override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return !commits_.empty() && commits_.back().seq > after; });
    std::vector<VersionSource::Commit> out;
    for (const auto& c : commits_) {
      if (c.seq > after) out.push_back(c);
    }
    return out;
  }
  void AddCommit(const std::string& v) {
    std::lock_guard<std::mutex> lock(mu_);
    commits_.push_back({commits_.size() + 1, v});
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<VersionSource::Commit> commits_;
};

struct Engines {
  std::vector<std::unique_ptr<rc::testing::FakeEngine>> fakes;
  std::vector<std::unique_ptr<rc::testing::FaultInjectingAdapter>> faulty;
  std::vector<rc::testing::FaultInjectingAdapter*> wrappers;  // each handle's fault wrapper (owned by the handle)

  // Engines serving `label` with digest "d-<label>" (a restarted controller's engines keep theirs).
  std::vector<EngineHandle> Make(int n, const std::string& start_label = "v0") {
    std::vector<EngineHandle> out;
    for (int i = 0; i < n; ++i) {
      fakes.push_back(std::make_unique<rc::testing::FakeEngine>(start_label, "d-" + start_label));
      auto shared = fakes.back()->shared();
      auto* fake = fakes.back().get();
      EngineHandle h;
      h.name = "fake-" + std::to_string(i);
      // The handle owns a fault wrapper around the fake (the fake outlives the service).
      auto wrapper = std::make_unique<rc::testing::FaultInjectingAdapter>(fake);
      wrappers.push_back(wrapper.get());
      faulty.push_back(nullptr);
      h.adapter = std::move(wrapper);
      h.complete = [shared, fake](const Json& body) -> Result<Json> {
        fake->StartRequest();
        std::string label;
        int64_t generation;
        {
          std::lock_guard<std::mutex> lock(shared->mu);
          label = shared->label;
          generation = shared->install_generation;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        fake->EndRequest();
        // As the embedded engine answers: label and install generation at admission per choice,
        // and the engine's identity when it answered.
        Json choice{{"index", 0}, {"text", "x"}, {"finish_reason", "length"}, {"token_ids", {5, 6, 7}},
                    {"prompt_token_ids", body["prompt"]}, {"weight_version", label},
                    {"install_generation", generation},
                    {"logprobs", {{"token_logprobs", {-0.5, -0.25, -1.0}}}}};
        return Json{{"choices", {choice}},
                    {"usage", {{"prompt_tokens", 3}, {"prompt_tokens_details", {{"cached_tokens", 0}}}}},
                    {"rolloutcore", fake->CompletionIdentity()}};
      };
      out.push_back(std::move(h));
    }
    return out;
  }
};

inline std::string TempDir(const std::string& name) {
  auto p = fs::temp_directory_path() / ("rc_ctl_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p.string();
}

inline ServiceOptions Options(const std::string& dir) {
  ServiceOptions o;
  o.state_dir = dir;
  o.runner.drain_poll_interval_ms = 1;
  return o;
}

}  // namespace rc::controller::testing
