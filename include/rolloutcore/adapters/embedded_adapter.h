// EmbeddedEngineAdapter: drives an engine that lives in the controller's own process (the
// embedded engine of src/engine), with no HTTP in between, and returns the same typed evidence
// as the HTTP adapter does for `rolloutcore engine serve`:
//  * Pause/Resume read the paused flag back from the engine;
//  * GetDrainStatus reads running/waiting counts from EngineState;
//  * Stage pulls the committed version through the engine's RefitReceiver (directory, plan,
//    transport, staged digest check) while the engine keeps serving;
//  * Install goes through RefitReceiver::Install, which refuses before mutation (evidence with
//    InstallOutcome kRefusedUntouched) when the engine is not paused or another version is staged,
//    and otherwise installs, resets the prefix cache in the same critical section and proves the
//    live digest; a failure after the first live byte is kFailedAfterMutation. A recovery
//    install (`full`) stages the target first;
//  * ResetCache returns the engine's own KvResetEvidence; ReadLabel/ReadContentDigest read the
//    live label and the content digest of the live weights; ProbeIdentity reads the engine's
//    boot id, label, install generation and the receiver's cached live digest.
// MakeEmbeddedCompleter runs /v1/completions bodies on the engine in process (same parser and
// response shape as the HTTP server).
//
// Every call runs on a detached thread (base/pending.h) so the Runner's deadlines hold even when
// the engine is slow; the engine, receiver and loop must outlive every call (EmbeddedEngine owns
// them and waits for calls in flight before destroying them).
//
// Thread safety: all methods may be called from any thread.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "rolloutcore/base/json.h"
#include "rolloutcore/lifecycle/engine_adapter.h"

namespace rc::engine {
class Engine;
}  // namespace rc::engine
namespace rc::receiver {
class RefitReceiver;
}  // namespace rc::receiver

namespace rc::adapters {

struct EmbeddedAdapterOptions {
  std::string directory_url;  // for staging
  std::string model;          // directory model name (defaults to the target's)
  int64_t stage_timeout_ms = 120000;
};

// An engine, its refit receiver and its step loop, owned together.
class EmbeddedEngine {
 public:
  // `model`: a preset name or a Hugging Face folder; load_format "auto" | "dummy".
  struct Options {
    std::string model = "tiny";
    std::string load_format = "auto";
    uint64_t seed = 0;
    int tensor_parallel_size = 1;
    int threads = 0;  // engine compute threads (0: default)
    std::string weight_version = "v0";
    std::string quantization;  // "" or an FP8 method (engine::EngineOptions::quantization, docs/fp8.md)
  };
  static Result<std::unique_ptr<EmbeddedEngine>> Create(const Options& options);
  ~EmbeddedEngine();
  EmbeddedEngine(const EmbeddedEngine&) = delete;
  EmbeddedEngine& operator=(const EmbeddedEngine&) = delete;

  engine::Engine* engine();
  receiver::RefitReceiver* receiver();

  std::unique_ptr<lifecycle::EngineAdapter> MakeAdapter(EmbeddedAdapterOptions options);
  // OpenAI completions request body -> response body, in process.
  std::function<Result<Json>(const Json&)> MakeCompleter(const std::string& model_name = "rolloutcore");

  struct State;

 private:
  EmbeddedEngine() = default;
  std::shared_ptr<State> state_;
};

}  // namespace rc::adapters
