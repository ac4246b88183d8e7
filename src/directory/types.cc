#include "rolloutcore/directory/types.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>

namespace rc::directory {
namespace {

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
         });
}

bool IsNameChar(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-' || c == '+' || c == '@' ||
         c == ':' || c == '=';
}

}  // namespace

std::string_view VersionStateName(VersionState state) {
  switch (state) {
    case VersionState::kStaging: return "STAGING";
    case VersionState::kCommitted: return "COMMITTED";
    case VersionState::kAbandoned: return "ABANDONED";
    case VersionState::kUnavailable: return "UNAVAILABLE";
  }
  return "UNKNOWN";
}

Result<VersionState> ParseVersionState(std::string_view text) {
  for (VersionState s : {VersionState::kStaging, VersionState::kCommitted, VersionState::kAbandoned,
                         VersionState::kUnavailable}) {
    if (EqualsIgnoreCase(text, VersionStateName(s))) return s;
  }
  return InvalidArgument(fmt::format("unknown version state '{}' (expected STAGING, COMMITTED, ABANDONED or UNAVAILABLE)",
                                     text.substr(0, 64)));
}

Status ValidateName(std::string_view name, std::string_view what) {
  if (name.empty()) return InvalidArgument(fmt::format("{}: must not be empty", what));
  if (name.size() > kMaxNameLength) {
    return InvalidArgument(fmt::format("{}: {} characters, at most {} allowed", what, name.size(), kMaxNameLength));
  }
  if (!std::isalnum(static_cast<unsigned char>(name[0]))) {
    return InvalidArgument(fmt::format("{}: '{}' must start with a letter or digit", what, name));
  }
  for (char c : name) {
    if (!IsNameChar(c)) {
      return InvalidArgument(fmt::format("{}: character 0x{:02x} is not allowed (use A-Z a-z 0-9 . _ - + @ : =)",
                                         what, static_cast<unsigned char>(c)));
    }
  }
  return OkStatus();
}

std::string_view StateFilterName(StateFilter filter) {
  switch (filter) {
    case StateFilter::kCommitted: return "committed";
    case StateFilter::kStaging: return "staging";
    case StateFilter::kAbandoned: return "abandoned";
    case StateFilter::kUnavailable: return "unavailable";
    case StateFilter::kAll: return "all";
  }
  return "unknown";
}

Result<StateFilter> ParseStateFilter(std::string_view text) {
  for (StateFilter f : {StateFilter::kCommitted, StateFilter::kStaging, StateFilter::kAbandoned,
                        StateFilter::kUnavailable, StateFilter::kAll}) {
    if (EqualsIgnoreCase(text, StateFilterName(f))) return f;
  }
  return InvalidArgument(fmt::format(
      "state: unknown filter '{}' (expected committed, staging, abandoned, unavailable or all)",
                                     text.substr(0, 64)));
}

bool FilterMatches(StateFilter filter, VersionState state) {
  switch (filter) {
    case StateFilter::kCommitted: return state == VersionState::kCommitted;
    case StateFilter::kStaging: return state == VersionState::kStaging;
    case StateFilter::kAbandoned: return state == VersionState::kAbandoned;
    case StateFilter::kUnavailable: return state == VersionState::kUnavailable;
    case StateFilter::kAll: return true;
  }
  return false;
}

}  // namespace rc::directory
