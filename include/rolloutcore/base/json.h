// JSON helpers over nlohmann::json that return Status instead of throwing.
//
// Parse() never throws; the Get* accessors return InvalidArgument naming the field path and the
// expected type ("events[3].at_ms: expected a non-negative integer, got string"). Used at every
// edge that reads outside input (HTTP bodies, scenario files, config files).
//
// Thread safety: free functions over values.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "rolloutcore/base/status.h"

namespace rc {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

// Parses text; InvalidArgument with the parser's position on malformed input.
Result<Json> ParseJson(std::string_view text, std::string_view what = "JSON");
// Reads and parses a file; NotFound when it cannot be opened, InvalidArgument when it is not a
// regular file (a FIFO would block the read forever).
Result<Json> ReadJsonFile(const std::string& path);

// Name of a JSON value's type for messages ("string", "integer", ...).
std::string JsonTypeName(const Json& j);

// Typed accessors. `path` is the field's name in messages. A missing field yields the default
// when one is given, else InvalidArgument "PATH: required field is missing".
Result<const Json*> GetObject(const Json& obj, std::string_view key, std::string_view path);
Result<std::string> GetString(const Json& obj, std::string_view key, std::string_view path,
                              std::optional<std::string> dflt = std::nullopt);
Result<int64_t> GetInt(const Json& obj, std::string_view key, std::string_view path,
                       std::optional<int64_t> dflt = std::nullopt);
Result<int64_t> GetNonNegativeInt(const Json& obj, std::string_view key, std::string_view path,
                                  std::optional<int64_t> dflt = std::nullopt);
Result<double> GetDouble(const Json& obj, std::string_view key, std::string_view path,
                         std::optional<double> dflt = std::nullopt);
Result<bool> GetBool(const Json& obj, std::string_view key, std::string_view path,
                     std::optional<bool> dflt = std::nullopt);

// Rejects keys of obj that are not in `allowed` (catches typos in scenario/config files).
Status CheckKnownKeys(const Json& obj, std::initializer_list<std::string_view> allowed,
                      std::string_view path);

}  // namespace rc
