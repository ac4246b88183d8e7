// The non-virtual part of the transport interface (rolloutcore/transport/transport.h).
#include "rolloutcore/transport/transport.h"

namespace rc::transport {

std::string_view TransferStateName(TransferState state) {
  switch (state) {
    case TransferState::kPending: return "pending";
    case TransferState::kDone: return "done";
    case TransferState::kFailed: return "failed";
  }
  return "unknown";
}

}  // namespace rc::transport
