// HttpStatusFor: the HTTP status every rolloutcore server (directory, trainer, engine, controller)
// answers for an rc::Status, so a client can tell "retry later" from "your request was wrong"
// without parsing the body:
//   OK 200, InvalidArgument 400, Unauthenticated 401, PermissionDenied 403, NotFound 404,
//   FailedPrecondition | AlreadyExists | Aborted 409, Unimplemented 501, Unavailable 503,
//   DeadlineExceeded 504, every other code 500.
//
// Thread safety: a pure function.
#pragma once

#include "rolloutcore/base/status.h"

namespace rc::net {

int HttpStatusFor(const Status& status);

}  // namespace rc::net
