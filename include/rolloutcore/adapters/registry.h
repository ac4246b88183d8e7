// The engine kinds the controller can drive, by the scheme of their --engine URL, the way
// transport.cc's kBackends maps transport names to backends. Adding an engine kind is one
// BlockingEngine class (adapters/blocking_engine.h) and one row of kEngineKinds in registry.cc.
//
//   embedded              an engine in the controller's own process (embedded_adapter.h)
//   vllm+http(s)://H:P    vLLM 0.26.x / 0.33.x with rolloutcore's worker extension (docs/vllm.md)
//   rolloutcore+http(s)://H:P   rolloutcore's engine (`rolloutcore engine serve`)
//   http(s)://H:P         either of the two above, asked of the server (http_adapter.h)
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "rolloutcore/adapters/embedded_adapter.h"
#include "rolloutcore/adapters/http_adapter.h"
#include "rolloutcore/lifecycle/engine_adapter.h"

namespace rc::adapters {

// What an engine kind may need, from `controller serve`'s flags.
struct EngineSpec {
  std::string url;          // as given: "embedded", "vllm+http://127.0.0.1:8000", ...
  HttpAdapterOptions http;  // HTTP kinds (base_url and expected_flavor are set from the URL)
  EmbeddedEngine::Options embedded;  // the embedded kind
  std::string directory_url;         // where staging pulls from
  std::string model;                 // directory model name
  int64_t stage_timeout_ms = 120000;
};

struct EngineInstance {
  std::string name;  // the URL, or "embedded"
  std::unique_ptr<lifecycle::EngineAdapter> adapter;
  std::function<Result<Json>(const Json&)> complete;  // one rollout (the controller's proxy)
  std::shared_ptr<void> owned;  // what must outlive the adapter and the completer (an embedded engine)
};

// The engine of spec.url; InvalidArgument naming the URL and the known schemes when no kind
// matches, the kind's own error when it cannot start.
Result<EngineInstance> MakeEngine(const EngineSpec& spec);

// One line per kind ("SCHEME: what it is"), for --help.
std::string EngineKindsHelp();

}  // namespace rc::adapters
