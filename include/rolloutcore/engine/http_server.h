// EngineServer: the vLLM-compatible HTTP API of the embedded engine (see ENGINE_API.md and
// docs/engine.md), on cpp-httplib, plus the completions request parser it uses.
//
// The server owns an EngineLoop that drives the engine. Handlers never throw out: every
// exception is caught at this edge and answered 500; bad input is a 400 whose message names the
// field. Binds 127.0.0.1 unless told otherwise. Server policy (API key on every POST, 405 + Allow,
// UTF-8 checks, TLS, timeouts, worker pool) is rc::net's (rolloutcore/net/http.h).
//
// Thread safety: Start/Stop from the owning thread; handlers run on httplib's worker threads and
// only call the engine's thread-safe API. ParseCompletionRequest is pure.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "rolloutcore/base/json.h"
#include "rolloutcore/base/status.h"
#include "rolloutcore/engine/engine.h"
#include "rolloutcore/engine/tokenizer.h"
#include "rolloutcore/net/security.h"
#include "rolloutcore/receiver/refit_choice.h"

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

// Request ids (completion `request_id`, hence the engine ids "<id>-<k>"): 1..128 characters of
// [A-Za-z0-9._:-], not "." or ".." (an id ends up in URLs, logs and file names; "a/../b" must not).
// Empty means "assign one". InvalidArgument naming `field` and the offending character otherwise.
inline constexpr size_t kMaxRequestIdLength = 128;
Status ValidateRequestId(std::string_view id, std::string_view field);

// Parses a /v1/completions body. InvalidArgument "FIELD: ..." for malformed JSON, wrong types,
// out-of-range values (negative max_tokens, logprobs > 20, empty cache_salt, a request_id outside
// the character set above, best_of other than n, ...). Context-length and vocabulary checks
// happen when the engine admits the request; the model name is checked by the server.
Result<CompletionRequest> ParseCompletionRequest(std::string_view body, const ByteTokenizer& tokenizer);

// The pieces of /v1/completions that do not depend on HTTP, shared by the server and by
// in-process callers (the embedded adapter's completer).
// The engine request for prompt `prompt`, sample `k` of a completion with id `id`.
GenerateRequest CompletionGenerateRequest(const CompletionRequest& cr, const std::string& id, size_t prompt,
                                          int64_t k);
// Every engine request of a completion (prompt-major, n per prompt); their ids into *ids.
std::vector<GenerateRequest> CompletionGenerateRequests(const CompletionRequest& cr, const std::string& id,
                                                        std::vector<std::string>* ids);
// Checks every prompt (Engine::CheckRequest, naming "prompt[i]" when there are several), then
// queues all the requests; if one is refused after others were queued they are aborted.
Result<std::vector<std::shared_ptr<RequestStream>>> AdmitCompletion(Engine* engine, const CompletionRequest& cr,
                                                                    std::vector<GenerateRequest> requests,
                                                                    const std::vector<std::string>& ids);
// One OpenAI choice object for tokens [from, end) of a stream's snapshot. A stream passes
// text_sent (the bytes of text its earlier chunks sent): the text is then what follows them up to
// the last whole character (all of it in the last chunk), and text_sent moves on.
Json CompletionChoiceJson(const ByteTokenizer& tokenizer, const RequestStream& stream,
                          const RequestStream::Snapshot& snap, size_t index, size_t from, const CompletionRequest& cr,
                          bool final_chunk, size_t* text_sent = nullptr);
// A request's version spans as each choice reports them ("version_spans": [{from_token, to_token,
// label, install_generation, kv}], output token indices, the last span ends at the last token).
Json VersionSpansJson(const std::vector<VersionSpan>& spans);
// The engine's identity as a completion reports it (top-level "rolloutcore" object, read when
// the response is built): {"boot_id", "label", "install_generation"}. With each choice's
// weight_version and install_generation (at admission) a controller can tell whether the
// completion ran on the engine, label and weights it bound the rollout to (docs/engine.md).
Json CompletionIdentityJson(const Engine& engine);
// The usage object (prompt, completion, cached tokens) of finished streams, n samples per prompt
// (each prompt counted once).
Json CompletionUsageJson(const std::vector<std::shared_ptr<RequestStream>>& streams, int64_t n);
// Runs a non-streaming completion to the end and returns the response body; errors of admission
// (InvalidArgument naming the field, Unavailable while paused in abort mode...) as statuses.
// on_admitted (optional) sees the engine request ids before any is queued (so aborts by
// completion id can find them as soon as they run).
Result<Json> RunCompletion(Engine* engine, const ByteTokenizer& tokenizer, const CompletionRequest& cr,
                           const std::string& id, const std::string& model,
                           const std::function<void(const std::vector<std::string>&)>& on_admitted = {});

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: any free port
  std::string model_name = "rolloutcore";
  int http_threads = 256;  // most HTTP worker threads (started on demand; a stream or a slow client holds one)
  // API key (every POST needs it when set: completions, pause, stage, install, ...), TLS, and the
  // non-loopback rule (rolloutcore/net/http.h).
  net::ServerSecurity security;
  // The one directory POST /rc/refit/stage may pull from (`--directory`); any other URL is 403.
  // Empty: only a directory on this host (a loopback URL) is accepted.
  std::string directory_url;
  // Test-only fault hooks (`POST /rc/fault`, docs/engine.md "Fault injection (tests only)").
  // Off by default; when off the route does not exist (404).
  bool enable_fault_injection = false;
  // Delta refit: a full anchor digest after every N-th consecutive delta install (0: never).
  int full_verify_every = 16;
  // Full or delta when a version carries deltas this engine could apply (receiver/refit_choice.h).
  receiver::DeltaPolicy delta_policy = receiver::DeltaPolicy::kAuto;
};

class EngineServer {
 public:
  EngineServer(Engine* engine, ServerOptions options);
  ~EngineServer();
  EngineServer(const EngineServer&) = delete;
  EngineServer& operator=(const EngineServer&) = delete;

  // Binds, starts the engine loop and the listener thread. Unavailable when the port is taken;
  // FailedPrecondition for a non-loopback host without an API key.
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
