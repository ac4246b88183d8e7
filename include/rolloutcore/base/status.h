// Status and Result<T>: the one error style of rolloutcore.
//
// A Status is either OK or carries a code and a message that names the thing and the number
// ("shard table for rank 3 of version rc-7 ..."). Result<T> holds either a value or a non-OK
// Status. Neither throws; the HTTP and Python edges translate them.
//
// Thread safety: values, copyable; no shared state.
// Invariant: Result<T> never holds an OK status without a value.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace rc {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,
  kNotFound,
  kFailedPrecondition,
  kUnavailable,
  kDeadlineExceeded,
  kAborted,
  kDataLoss,
  kInternal,
  kAlreadyExists,
  kUnimplemented,
  kUnauthenticated,  // no or wrong credentials (HTTP 401)
  kPermissionDenied,  // authenticated, but not allowed to do this (HTTP 403)
};

std::string_view StatusCodeName(StatusCode code);
// Parses a name produced by StatusCodeName; nullopt when unknown.
std::optional<StatusCode> StatusCodeFromName(std::string_view name);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "FailedPrecondition: message" (or "OK").
  std::string ToString() const;
  // Returns a copy whose message is "context: message".
  Status WithContext(std::string_view context) const;

  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message_ == b.message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status OkStatus() { return Status(); }
Status InvalidArgument(std::string message);
Status NotFound(std::string message);
Status FailedPrecondition(std::string message);
Status Unavailable(std::string message);
Status DeadlineExceeded(std::string message);
Status Aborted(std::string message);
Status DataLoss(std::string message);
Status Internal(std::string message);
Status AlreadyExists(std::string message);
Status Unimplemented(std::string message);
Status Unauthenticated(std::string message);
Status PermissionDenied(std::string message);

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    if (std::get<Status>(v_).ok()) {
      v_ = Status(StatusCode::kInternal, "Result constructed from an OK status without a value");
    }
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T value_or(T other) const& { return ok() ? value() : std::move(other); }

 private:
  std::variant<T, Status> v_;
};

namespace internal {
inline const Status& AsStatus(const Status& s) { return s; }
template <typename T>
const Status& AsStatus(const Result<T>& r) { return r.status(); }
}  // namespace internal

}  // namespace rc

#define RC_CONCAT_INNER_(a, b) a##b
#define RC_CONCAT_(a, b) RC_CONCAT_INNER_(a, b)

// Returns from the enclosing function when expr (a Status or Result) is not OK.
#define RC_RETURN_IF_ERROR(expr)                                        \
  do {                                                                  \
    const auto& rc_status_or_result_ = (expr);                          \
    if (!::rc::internal::AsStatus(rc_status_or_result_).ok())           \
      return ::rc::internal::AsStatus(rc_status_or_result_);            \
  } while (0)

#define RC_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(tmp).value()

// lhs = value of expr (a Result<T>), or return its Status.
#define RC_ASSIGN_OR_RETURN(lhs, expr) \
  RC_ASSIGN_OR_RETURN_IMPL_(RC_CONCAT_(rc_result_, __LINE__), lhs, expr)
