#include "rolloutcore/adapters/registry.h"

#include <string_view>

namespace rc::adapters {

namespace {

using Factory = Result<EngineInstance> (*)(const EngineSpec& spec, EngineFlavor flavor);

Result<EngineInstance> MakeEmbedded(const EngineSpec& spec, EngineFlavor /*flavor*/) {
  RC_ASSIGN_OR_RETURN(std::unique_ptr<EmbeddedEngine> engine, EmbeddedEngine::Create(spec.embedded));
  EngineInstance out;
  out.name = "embedded";
  out.adapter = engine->MakeAdapter({spec.directory_url, spec.model, spec.stage_timeout_ms});
  out.complete = engine->MakeCompleter(spec.embedded.model);
  out.owned = std::shared_ptr<EmbeddedEngine>(std::move(engine));
  return out;
}

// rolloutcore+http, vllm+http and plain http: one HttpEngineAdapter, of the kind the scheme names
// (or detected), whose engine also answers the rollouts.
Result<EngineInstance> MakeHttp(const EngineSpec& spec, EngineFlavor flavor) {
  RC_ASSIGN_OR_RETURN(EngineUrl url, ParseEngineUrl(spec.url));
  HttpAdapterOptions o = spec.http;
  o.base_url = url.base_url;
  o.expected_flavor = flavor;
  o.directory_url = spec.directory_url;
  o.model = spec.model;
  o.stage_timeout_ms = spec.stage_timeout_ms;
  auto adapter = std::make_unique<HttpEngineAdapter>(std::move(o));
  EngineInstance out;
  out.name = spec.url;
  out.complete = adapter->Completer();
  out.adapter = std::move(adapter);
  return out;
}

struct EngineKind {
  std::string_view scheme;  // "embedded" is a whole URL; the others are followed by "://"
  EngineFlavor flavor;
  Factory make;
  std::string_view help;
};

constexpr EngineKind kEngineKinds[] = {
    {"embedded", EngineFlavor::kUnknown, MakeEmbedded, "an engine in this process (--embedded-*)"},
    {"vllm+http", EngineFlavor::kVllm, MakeHttp, "vLLM 0.26.x or 0.33.x with rolloutcore's worker extension"},
    {"vllm+https", EngineFlavor::kVllm, MakeHttp, "the same over TLS"},
    {"rolloutcore+http", EngineFlavor::kRolloutcore, MakeHttp, "rolloutcore's engine (rolloutcore engine serve)"},
    {"rolloutcore+https", EngineFlavor::kRolloutcore, MakeHttp, "the same over TLS"},
    {"http", EngineFlavor::kUnknown, MakeHttp, "either, asked of the server (GET /rc/engine/state)"},
    {"https", EngineFlavor::kUnknown, MakeHttp, "the same over TLS"},
};

}  // namespace

Result<EngineInstance> MakeEngine(const EngineSpec& spec) {
  for (const EngineKind& k : kEngineKinds) {
    const bool whole = k.scheme == "embedded";
    const bool match = whole ? spec.url == k.scheme
                             : spec.url.size() > k.scheme.size() + 3 && spec.url.compare(0, k.scheme.size(), k.scheme) == 0 &&
                                   spec.url.compare(k.scheme.size(), 3, "://") == 0;
    if (match) return k.make(spec, k.flavor);
  }
  return InvalidArgument("engine URL '" + spec.url + "': unknown kind; expected one of:\n" + EngineKindsHelp());
}

std::string EngineKindsHelp() {
  std::string out;
  for (const EngineKind& k : kEngineKinds) {
    out += "  " + std::string(k.scheme) + (k.scheme == "embedded" ? "" : "://HOST:PORT") + ": " + std::string(k.help) + "\n";
  }
  return out;
}

}  // namespace rc::adapters
