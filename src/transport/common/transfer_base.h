// The Transfer machinery every backend shares (transport.h's Transfer contract, written once).
//
// PollingTransfer implements Wait(deadline) on top of Poll(): poll, give up with DeadlineExceeded
// (the transfer stays pending) once the transport's clock reaches the deadline, otherwise wait for
// progress a short slice and poll again. So no backend can block past a deadline, and a ManualClock
// deadline is noticed within one slice. Backends whose completion is signalled (a condition
// variable: shm, ucx) override AwaitProgress to wait on it; the default sleeps briefly (CUDA events,
// NCCL).
//
// RecordedTransfer is a PollingTransfer that records its own outcome: the backend's PollPending()
// drives the work while pending and calls Finish() once; Poll(), status() and bytes() are then
// answered here (local, cuda_ipc, nccl).
//
// Thread safety: as transport.h says, a Transfer is used by one caller at a time.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "rolloutcore/base/clock.h"
#include "rolloutcore/transport/transport.h"

namespace rc::transport::internal {

class PollingTransfer : public Transfer {
 public:
  // OK when done, the failure when failed, DeadlineExceeded(PendingAtDeadline()) when the
  // deadline passed first.
  [[nodiscard]] Status Wait(int64_t deadline_ns) final;

 protected:
  explicit PollingTransfer(Clock& clock) : clock_(clock) {}
  Clock& clock() const { return clock_; }
  // The message of the DeadlineExceeded that Wait returns (what is still pending).
  virtual std::string PendingAtDeadline() const = 0;
  // Returns after at most `max_ns` (real time), earlier when progress may have happened.
  virtual void AwaitProgress(int64_t max_ns);

 private:
  Clock& clock_;
};

class RecordedTransfer : public PollingTransfer {
 public:
  TransferState Poll() final;
  [[nodiscard]] Status status() const final;
  uint64_t bytes() const final { return bytes_; }

 protected:
  RecordedTransfer(Clock& clock, uint64_t bytes) : PollingTransfer(clock), bytes_(bytes) {}
  // Called by Poll() only while pending: advance, and Finish() when the outcome is known.
  virtual TransferState PollPending() = 0;
  // Records the outcome (kDone with OK, or kFailed with the failure) and returns `state`.
  TransferState Finish(TransferState state, Status status);
  TransferState state() const { return state_; }

 private:
  const uint64_t bytes_;
  TransferState state_ = TransferState::kPending;
  Status status_;
};

// Total bytes of a batch.
uint64_t BatchBytes(std::span<const ReadOp> ops);

// The checks every backend makes on read `index` of a batch before anything moves, with the same
// wording: the region must hold bytes [source_offset, source_offset + length) and a non-empty
// read needs a destination. `region()` names the source region in the message (called only on
// failure, so the check costs nothing on the hot path).
[[nodiscard]] Status ReadOpError(size_t index, const ReadOp& op, uint64_t region_length, std::string_view region);
template <typename RegionName>
[[nodiscard]] Status CheckReadOp(size_t index, const ReadOp& op, uint64_t region_length, RegionName&& region) {
  if (op.source_offset > region_length || op.length > region_length - op.source_offset ||
      (op.length > 0 && op.dest == nullptr)) {
    return ReadOpError(index, op, region_length, region());
  }
  return OkStatus();
}

}  // namespace rc::transport::internal
