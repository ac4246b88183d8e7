// EngineServer: the vLLM-compatible HTTP API of the embedded engine (see ENGINE_API.md and
// docs/engine.md), on cpp-httplib, plus the completions request parser it uses.
//
// The server owns an EngineLoop that drives the engine. Handlers never throw out: every
// exception is caught at this edge and answered 500; bad input is a 400 whose message names the
// field. Binds 127.0.0.1 unless told otherwise.
//
// Thread safety: Start/Stop from the owning thread; handlers run on httplib's worker threads and
// only call the engine's thread-safe API. ParseCompletionRequest is pure.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "rolloutcore/base/status.h"
#include "rolloutcore/engine/engine.h"
#include "rolloutcore/engine/tokenizer.h"

namespace rc::engine {

struct CompletionRequest {
  std::vector<std::vector<int32_t>> prompts;  // one per prompt (text prompts already encoded)
  SamplingParams sampling;
  int64_t n = 1;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  bool return_token_ids = false;
  std::string cache_salt;
  std::string request_id;
  std::string model;
};

// Parses a /v1/completions body. InvalidArgument "FIELD: ..." for malformed JSON, wrong types,
// out-of-range values (negative max_tokens, logprobs > 20, empty cache_salt, ...). Context-length
// checks happen when the engine admits the request.
Result<CompletionRequest> ParseCompletionRequest(std::string_view body, const ByteTokenizer& tokenizer);

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: any free port
  std::string model_name = "rolloutcore";
  int http_threads = 32;
  // Test-only fault hooks (`POST /rc/fault`, docs/engine.md "Fault injection (tests only)").
  // Off by default; when off the route does not exist (404).
  bool enable_fault_injection = false;
};

class EngineServer {
 public:
  EngineServer(Engine* engine, ServerOptions options);
  ~EngineServer();
  EngineServer(const EngineServer&) = delete;
  EngineServer& operator=(const EngineServer&) = delete;

  // Binds, starts the engine loop and the listener thread. Unavailable when the port is taken.
  Status Start();
  int port() const { return port_; }
  // Stops listening and the engine loop.
  void Stop();
  // Blocks until Stop (or a fatal listener error).
  void Wait();

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace rc::engine
