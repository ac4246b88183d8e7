#include "rolloutcore/base/status.h"

#include <array>

namespace rc {
namespace {
constexpr std::array<std::string_view, 13> kNames = {
    "OK",       "InvalidArgument", "NotFound", "FailedPrecondition", "Unavailable",     "DeadlineExceeded",
    "Aborted",  "DataLoss",        "Internal", "AlreadyExists",      "Unimplemented",   "Unauthenticated",
    "PermissionDenied"};
}  // namespace

std::string_view StatusCodeName(StatusCode code) {
  auto i = static_cast<size_t>(code);
  return i < kNames.size() ? kNames[i] : std::string_view("Unknown");
}

std::optional<StatusCode> StatusCodeFromName(std::string_view name) {
  for (size_t i = 0; i < kNames.size(); ++i) {
    if (kNames[i] == name) return static_cast<StatusCode>(i);
  }
  return std::nullopt;
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string out(StatusCodeName(code_));
  out += ": ";
  out += message_;
  return out;
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  return Status(code_, std::string(context) + ": " + message_);
}

Status InvalidArgument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
Status FailedPrecondition(std::string m) { return {StatusCode::kFailedPrecondition, std::move(m)}; }
Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
Status DeadlineExceeded(std::string m) { return {StatusCode::kDeadlineExceeded, std::move(m)}; }
Status Aborted(std::string m) { return {StatusCode::kAborted, std::move(m)}; }
Status DataLoss(std::string m) { return {StatusCode::kDataLoss, std::move(m)}; }
Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
Status AlreadyExists(std::string m) { return {StatusCode::kAlreadyExists, std::move(m)}; }
Status Unimplemented(std::string m) { return {StatusCode::kUnimplemented, std::move(m)}; }
Status Unauthenticated(std::string m) { return {StatusCode::kUnauthenticated, std::move(m)}; }
Status PermissionDenied(std::string m) { return {StatusCode::kPermissionDenied, std::move(m)}; }

}  // namespace rc
