#include "rolloutcore/base/json.h"

#include <filesystem>
#include <fstream>
#include <sstream>

namespace rc {
namespace {

std::string FieldPath(std::string_view path, std::string_view key) {
  if (path.empty()) return std::string(key);
  return std::string(path) + "." + std::string(key);
}

Status TypeError(std::string_view path, std::string_view key, std::string_view expected,
                 const Json& got) {
  return InvalidArgument(FieldPath(path, key) + ": expected " + std::string(expected) + ", got " +
                         JsonTypeName(got));
}

Status Missing(std::string_view path, std::string_view key) {
  return InvalidArgument(FieldPath(path, key) + ": required field is missing");
}

}  // namespace

Result<Json> ParseJson(std::string_view text, std::string_view what) {
  // nlohmann's allow_exceptions=false still throws for some inputs (a number that overflows a
  // double raises out_of_range 406), so parse with exceptions and translate every one of them.
  try {
    return Json::parse(text.begin(), text.end());
  } catch (const Json::exception& e) {
    return InvalidArgument(std::string(what) + " is malformed: " + e.what());
  }
}

Result<Json> ReadJsonFile(const std::string& path) {
  // A FIFO (or a device) would block the open or the read forever: only regular files are read.
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (!ec && st.type() != std::filesystem::file_type::regular) {
    if (st.type() == std::filesystem::file_type::not_found) return NotFound("cannot open '" + path + "'");
    return InvalidArgument("'" + path + "' is not a regular file (a FIFO, device, socket or directory); refusing to read it");
  }
  std::ifstream in(path);
  if (!in) return NotFound("cannot open '" + path + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseJson(ss.str(), path);
}

std::string JsonTypeName(const Json& j) {
  switch (j.type()) {
    case Json::value_t::null: return "null";
    case Json::value_t::object: return "object";
    case Json::value_t::array: return "array";
    case Json::value_t::string: return "string";
    case Json::value_t::boolean: return "boolean";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned: return "integer";
    case Json::value_t::number_float: return "number";
    case Json::value_t::binary: return "binary";
    case Json::value_t::discarded: return "discarded";
  }
  return "unknown";
}

Result<const Json*> GetObject(const Json& obj, std::string_view key, std::string_view path) {
  if (!obj.is_object()) return TypeError(path, key, "an object around it", obj);
  auto it = obj.find(key);
  if (it == obj.end()) return Missing(path, key);
  if (!it->is_object()) return TypeError(path, key, "an object", *it);
  return &*it;
}

Result<std::string> GetString(const Json& obj, std::string_view key, std::string_view path,
                              std::optional<std::string> dflt) {
  if (!obj.is_object()) return TypeError(path, key, "an object around it", obj);
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) {
    if (dflt) return *dflt;
    return Missing(path, key);
  }
  if (!it->is_string()) return TypeError(path, key, "a string", *it);
  return it->get<std::string>();
}

Result<int64_t> GetInt(const Json& obj, std::string_view key, std::string_view path,
                       std::optional<int64_t> dflt) {
  if (!obj.is_object()) return TypeError(path, key, "an object around it", obj);
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) {
    if (dflt) return *dflt;
    return Missing(path, key);
  }
  if (it->is_number_unsigned()) {
    auto u = it->get<uint64_t>();
    if (u > static_cast<uint64_t>(INT64_MAX)) return TypeError(path, key, "an integer in range", *it);
    return static_cast<int64_t>(u);
  }
  if (!it->is_number_integer()) return TypeError(path, key, "an integer", *it);
  return it->get<int64_t>();
}

Result<int64_t> GetNonNegativeInt(const Json& obj, std::string_view key, std::string_view path,
                                  std::optional<int64_t> dflt) {
  RC_ASSIGN_OR_RETURN(int64_t v, GetInt(obj, key, path, dflt));
  if (v < 0) {
    return InvalidArgument(FieldPath(path, key) + ": expected a non-negative integer, got " +
                           std::to_string(v));
  }
  return v;
}

Result<double> GetDouble(const Json& obj, std::string_view key, std::string_view path,
                         std::optional<double> dflt) {
  if (!obj.is_object()) return TypeError(path, key, "an object around it", obj);
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) {
    if (dflt) return *dflt;
    return Missing(path, key);
  }
  if (!it->is_number()) return TypeError(path, key, "a number", *it);
  return it->get<double>();
}

Result<bool> GetBool(const Json& obj, std::string_view key, std::string_view path,
                     std::optional<bool> dflt) {
  if (!obj.is_object()) return TypeError(path, key, "an object around it", obj);
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) {
    if (dflt) return *dflt;
    return Missing(path, key);
  }
  if (!it->is_boolean()) return TypeError(path, key, "a boolean", *it);
  return it->get<bool>();
}

Status CheckKnownKeys(const Json& obj, std::initializer_list<std::string_view> allowed,
                      std::string_view path) {
  if (!obj.is_object()) {
    return InvalidArgument(std::string(path.empty() ? "value" : path) + ": expected an object, got " +
                           JsonTypeName(obj));
  }
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    bool known = false;
    for (auto a : allowed) known = known || (it.key() == a);
    if (!known) return InvalidArgument(FieldPath(path, it.key()) + ": unknown field");
  }
  return OkStatus();
}

}  // namespace rc
