#include <fmt/format.h>

#include <cstdio>

#include "rolloutcore/base/json.h"
#include "rolloutcore/engine/http_server.h"

namespace rc::engine {
namespace {

Status TypeError(std::string_view field, std::string_view expected, const Json& got) {
  return InvalidArgument(std::string(field) + ": expected " + std::string(expected) + ", got " + JsonTypeName(got));
}

// Token id list; `field` for messages.
Result<std::vector<int32_t>> TokenList(const Json& j, const std::string& field) {
  std::vector<int32_t> out;
  for (size_t i = 0; i < j.size(); ++i) {
    const Json& v = j[i];
    if (!v.is_number_integer()) return TypeError(field + "[" + std::to_string(i) + "]", "a token id (integer)", v);
    const int64_t id = v.get<int64_t>();
    if (id < 0 || id > INT32_MAX) {
      return InvalidArgument(field + "[" + std::to_string(i) + "]: token id " + std::to_string(id) + " is out of range");
    }
    out.push_back(static_cast<int32_t>(id));
  }
  return out;
}

// vLLM sampling fields the embedded engine does not implement. Each is accepted only at its
// neutral value (what leaves sampling unchanged), so a request that asks for one is refused
// rather than silently answered as if it had not.
Status RefuseUnsupportedSampling(const Json& j) {
  auto unsupported = [](std::string_view field, const Json& got, std::string_view neutral) {
    return InvalidArgument(fmt::format("{}: not supported by the embedded engine (got {}; only {} is accepted)", field,
                                       got.dump(-1, ' ', false, Json::error_handler_t::replace), neutral));
  };
  auto present = [&](const char* field) -> const Json* {
    auto it = j.find(field);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  };
  if (const Json* v = present("stop"); v != nullptr && !((v->is_string() && v->get<std::string>().empty()) ||
                                                         (v->is_array() && v->empty()))) {
    return unsupported("stop", *v, "an empty stop list; use stop_token_ids");
  }
  const struct {
    const char* field;
    double neutral;
  } numbers[] = {{"min_tokens", 0}, {"presence_penalty", 0}, {"frequency_penalty", 0}, {"repetition_penalty", 1},
                 {"min_p", 0}};
  for (const auto& f : numbers) {
    const Json* v = present(f.field);
    if (v != nullptr && !(v->is_number() && v->get<double>() == f.neutral)) {
      return unsupported(f.field, *v, fmt::format("{}", f.neutral));
    }
  }
  for (const char* field : {"logit_bias", "allowed_token_ids", "bad_words", "structured_outputs", "guided_json",
                            "guided_regex", "guided_choice", "guided_grammar", "response_format"}) {
    const Json* v = present(field);
    if (v != nullptr && !((v->is_object() || v->is_array()) && v->empty())) return unsupported(field, *v, "an empty value");
  }
  if (const Json* v = present("prompt_logprobs")) return unsupported("prompt_logprobs", *v, "null");
  return OkStatus();
}

}  // namespace

Status ValidateRequestId(std::string_view id, std::string_view field) {
  if (id.empty()) return OkStatus();  // the engine assigns one
  if (id.size() > kMaxRequestIdLength) {
    return InvalidArgument(std::string(field) + ": at most " + std::to_string(kMaxRequestIdLength) +
                           " characters, got " + std::to_string(id.size()));
  }
  for (size_t i = 0; i < id.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(id[i]);
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
                    c == '_' || c == '.' || c == ':';
    if (!ok) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "0x%02x", c);
      return InvalidArgument(std::string(field) + ": character " + hex + " at position " + std::to_string(i) +
                             " is not allowed (letters, digits and - _ . : only)");
    }
  }
  if (id == "." || id == "..") return InvalidArgument(std::string(field) + ": '" + std::string(id) + "' is not an id");
  return OkStatus();
}

Result<CompletionRequest> ParseCompletionRequest(std::string_view body, const ByteTokenizer& tokenizer) {
  RC_ASSIGN_OR_RETURN(Json j, ParseJson(body, "request body"));
  if (!j.is_object()) return TypeError("body", "a JSON object", j);
  CompletionRequest r;
  // prompt: string | [string] | [int] | [[int]]
  auto p = j.find("prompt");
  if (p == j.end() || p->is_null()) return InvalidArgument("prompt: required field is missing");
  if (p->is_string()) {
    RC_ASSIGN_OR_RETURN(auto ids, tokenizer.Encode(p->get<std::string>(), "prompt"));
    r.prompts.push_back(std::move(ids));
  } else if (p->is_array()) {
    if (p->empty()) return InvalidArgument("prompt: must not be empty");
    if ((*p)[0].is_number_integer()) {
      RC_ASSIGN_OR_RETURN(auto ids, TokenList(*p, "prompt"));
      r.prompts.push_back(std::move(ids));
    } else {
      for (size_t i = 0; i < p->size(); ++i) {
        const Json& e = (*p)[i];
        const std::string field = "prompt[" + std::to_string(i) + "]";
        if (e.is_string()) {
          RC_ASSIGN_OR_RETURN(auto ids, tokenizer.Encode(e.get<std::string>(), field));
          r.prompts.push_back(std::move(ids));
        } else if (e.is_array()) {
          RC_ASSIGN_OR_RETURN(auto ids, TokenList(e, field));
          r.prompts.push_back(std::move(ids));
        } else {
          return TypeError(field, "a string or a list of token ids", e);
        }
      }
    }
  } else {
    return TypeError("prompt", "a string, a list of strings, a list of token ids or a list of lists", *p);
  }
  for (size_t i = 0; i < r.prompts.size(); ++i) {
    if (r.prompts[i].empty()) {
      return InvalidArgument(r.prompts.size() == 1 ? "prompt: must not be empty"
                                                   : "prompt[" + std::to_string(i) + "]: must not be empty");
    }
  }
  if (r.prompts.size() > 256) return InvalidArgument("prompt: at most 256 prompts per request");

  SamplingParams& s = r.sampling;
  RC_ASSIGN_OR_RETURN(s.max_tokens, GetInt(j, "max_tokens", "", 16));
  if (s.max_tokens < 1) return InvalidArgument("max_tokens: must be at least 1, got " + std::to_string(s.max_tokens));
  RC_ASSIGN_OR_RETURN(s.temperature, GetDouble(j, "temperature", "", 1.0));
  if (!(s.temperature >= 0) || s.temperature > 1e6) {
    return InvalidArgument(fmt::format("temperature: must be in [0, 1e6], got {}", s.temperature));
  }
  RC_ASSIGN_OR_RETURN(s.top_p, GetDouble(j, "top_p", "", 1.0));
  if (!(s.top_p > 0 && s.top_p <= 1)) return InvalidArgument(fmt::format("top_p: must be in (0, 1], got {}", s.top_p));
  RC_ASSIGN_OR_RETURN(s.top_k, GetInt(j, "top_k", "", -1));
  if (s.top_k < -1) return InvalidArgument("top_k: must be -1 (disabled), 0 (disabled) or positive");
  if (auto it = j.find("seed"); it != j.end() && !it->is_null()) {
    if (!it->is_number_integer()) return TypeError("seed", "an integer", *it);
    s.seed = it->is_number_unsigned() ? it->get<uint64_t>() : static_cast<uint64_t>(it->get<int64_t>());
  }
  RC_ASSIGN_OR_RETURN(r.n, GetInt(j, "n", "", 1));
  if (r.n < 1 || r.n > 16) return InvalidArgument("n: must be in [1, 16]");
  if (auto it = j.find("logprobs"); it != j.end() && !it->is_null()) {
    RC_ASSIGN_OR_RETURN(const int64_t k, GetInt(j, "logprobs", ""));
    if (k < 0 || k > 20) return InvalidArgument("logprobs: must be in [0, 20], got " + std::to_string(k));
    s.num_logprobs = k;
  }
  // best_of (vLLM V1 refuses it too): sampling best_of candidates and returning the n best is
  // not implemented, so anything but best_of == n is refused rather than silently ignored.
  if (auto it = j.find("best_of"); it != j.end() && !it->is_null()) {
    RC_ASSIGN_OR_RETURN(const int64_t b, GetInt(j, "best_of", ""));
    if (b != r.n) {
      return InvalidArgument("best_of: not supported by the embedded engine (got " + std::to_string(b) +
                             "; only best_of == n, " + std::to_string(r.n) + ", is accepted)");
    }
  }
  RC_ASSIGN_OR_RETURN(r.return_token_ids, GetBool(j, "return_token_ids", "", false));
  RC_ASSIGN_OR_RETURN(s.ignore_eos, GetBool(j, "ignore_eos", "", false));
  RC_ASSIGN_OR_RETURN(r.stream, GetBool(j, "stream", "", false));
  if (auto it = j.find("stream_options"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) return TypeError("stream_options", "an object", *it);
    RC_ASSIGN_OR_RETURN(r.include_usage, GetBool(*it, "include_usage", "stream_options", false));
  }
  if (auto it = j.find("cache_salt"); it != j.end() && !it->is_null()) {
    if (!it->is_string()) return TypeError("cache_salt", "a string", *it);
    r.cache_salt = it->get<std::string>();
    if (r.cache_salt.empty()) return InvalidArgument("cache_salt: must be a non-empty string");
  }
  RC_ASSIGN_OR_RETURN(r.request_id, GetString(j, "request_id", "", ""));
  RC_RETURN_IF_ERROR(ValidateRequestId(r.request_id, "request_id"));
  RC_ASSIGN_OR_RETURN(r.model, GetString(j, "model", "", ""));
  if (auto it = j.find("stop_token_ids"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) return TypeError("stop_token_ids", "a list of token ids", *it);
    RC_ASSIGN_OR_RETURN(s.stop_token_ids, TokenList(*it, "stop_token_ids"));
  }
  if (auto it = j.find("echo"); it != j.end() && it->is_boolean() && it->get<bool>()) {
    return InvalidArgument("echo: not supported by the embedded engine");
  }
  RC_RETURN_IF_ERROR(RefuseUnsupportedSampling(j));
  return r;
}

}  // namespace rc::engine
