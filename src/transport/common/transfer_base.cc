#include "transport/common/transfer_base.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <thread>

namespace rc::transport::internal {
namespace {

// Longest real-time wait between two polls: bounds how late a ManualClock deadline is noticed.
constexpr int64_t kMaxSliceNs = 5'000'000;

}  // namespace

Status PollingTransfer::Wait(int64_t deadline_ns) {
  while (Poll() == TransferState::kPending) {
    const int64_t now = clock_.NowNs();
    if (now >= deadline_ns) return DeadlineExceeded(PendingAtDeadline());
    AwaitProgress(std::min<int64_t>(deadline_ns - now, kMaxSliceNs));
  }
  return status();
}

void PollingTransfer::AwaitProgress(int64_t max_ns) {
  std::this_thread::sleep_for(std::chrono::nanoseconds(std::min<int64_t>(max_ns, 20'000)));
}

TransferState RecordedTransfer::Poll() {
  if (state_ != TransferState::kPending) return state_;
  return PollPending();
}

Status RecordedTransfer::status() const {
  if (state_ == TransferState::kPending) return Unavailable("pending");
  return status_;
}

TransferState RecordedTransfer::Finish(TransferState state, Status status) {
  state_ = state;
  status_ = std::move(status);
  return state_;
}

uint64_t BatchBytes(std::span<const ReadOp> ops) {
  uint64_t bytes = 0;
  for (const ReadOp& op : ops) bytes += op.length;
  return bytes;
}

Status ReadOpError(size_t index, const ReadOp& op, uint64_t region_length, std::string_view region) {
  if (op.source_offset > region_length || op.length > region_length - op.source_offset) {
    return InvalidArgument(fmt::format("read {} of batch: bytes {}..{} outside {} of {} bytes", index, op.source_offset,
                                       op.source_offset + op.length, region, region_length));
  }
  if (op.length > 0 && op.dest == nullptr) {
    return InvalidArgument(fmt::format("read {} of batch: null destination for {} bytes", index, op.length));
  }
  return Internal(fmt::format("read {} of batch: ReadOpError called for a valid read", index));
}

}  // namespace rc::transport::internal
