// The HTTP engine kinds (internal to the adapters module; include only from its .cc files). Each
// is a BlockingEngine (rolloutcore/adapters/blocking_engine.h) over the shared EngineHttp client;
// registry.cc maps URL schemes to them.
#pragma once

#include <memory>

#include "adapters/engine_http.h"
#include "rolloutcore/adapters/blocking_engine.h"
#include "rolloutcore/adapters/http_adapter.h"

namespace rc::adapters::internal {

// rolloutcore's own engine (`rolloutcore engine serve`, ENGINE_API.md).
std::shared_ptr<BlockingEngine> MakeRolloutcoreEngine(std::shared_ptr<EngineHttp> http, const HttpAdapterOptions& o);

// vLLM 0.26.x / 0.33.x with rolloutcore's worker extension (vllm_engine.h, docs/vllm.md).
std::shared_ptr<BlockingEngine> MakeVllmEngine(std::shared_ptr<EngineHttp> http, const HttpAdapterOptions& o);

// The connection settings of an HTTP engine.
std::shared_ptr<EngineHttp> MakeEngineHttp(const HttpAdapterOptions& o);

}  // namespace rc::adapters::internal
