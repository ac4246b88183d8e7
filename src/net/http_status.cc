#include "rolloutcore/net/http_status.h"

namespace rc::net {

int HttpStatusFor(const Status& s) {
  switch (s.code()) {
    case StatusCode::kOk: return 200;
    case StatusCode::kInvalidArgument: return 400;
    case StatusCode::kUnauthenticated: return 401;
    case StatusCode::kPermissionDenied: return 403;
    case StatusCode::kNotFound: return 404;
    case StatusCode::kFailedPrecondition:
    case StatusCode::kAlreadyExists:
    case StatusCode::kAborted: return 409;
    case StatusCode::kUnimplemented: return 501;
    case StatusCode::kUnavailable: return 503;
    case StatusCode::kDeadlineExceeded: return 504;
    default: return 500;
  }
}

}  // namespace rc::net
