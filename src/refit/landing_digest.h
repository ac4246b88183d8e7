// LandingDigest: the staged content digest computed while the bytes land, instead of a second
// pass over the staged buffers after the wire.
//
// A transport that lands reads with the CPU (shm) reports each chunk of a read's destination right
// after writing it (transport::LandingObserver), while it is in the copying core's cache. For the
// parameters where that is enough -- "landing-digested" parameters, chosen once per capture -- the
// observer digests the chunk from the destination (the staged bytes themselves, not the source)
// and scans it for NaN/Inf. A parameter qualifies when its bytes are tiled exactly by whole source
// tensors (one, or several side by side as in a fused qkv or gate_up projection), each in the
// parameter's dtype (bf16 or f32), row-major and contiguous, each owned whole by one digest region,
// and no install step of the plan writes it (only direct runs land in it). Then byte offset o of
// the parameter lies in exactly one tensor's segment [b, e) and is that tensor's global element
// (o - b) / elem_size, and the digest of the parameter is the sum of the chunks' digests.
//
// When the transport offers the copy (CopyLanded), the observer copies the chunk itself in
// L1-sized pieces: the digest mixes the very registers it stores (CopyAndDigestContiguous), and the
// finite check reads the piece back from L1, so the staged bytes are read from memory once instead
// of copied and read back. A chunk outside every eligible parameter is declined (the transport
// copies it and calls Landed).
//
// Replica parameters -- bytes no digest region owns (BytesOutsideRegions), e.g. a tied lm_head
// whose source tensor is digested through the embedding -- have no digest to compute, only the
// finite check. A parameter whose every byte is a replica byte, in bf16 or f32, that no install
// step writes, is "landing-scanned": its chunks are scanned for NaN/Inf as they land (and copied,
// when offered), and Finish accepts it under the same tiling rule, so the caller's separate
// finite scan skips it.
//
// Finish() accepts a parameter only when the chunks it was told about tile the parameter exactly
// (sorted, disjoint, from 0 to its size, element-aligned): a backend that never calls the
// observer, a read split at an odd byte, or overlapping writes leave the parameter to the caller's
// ordinary digest pass (Result::fallback says which), so nothing that was not digested is ever
// counted as digested. The caller must keep the staged bytes unchanged from the pull until the
// digest is compared and the buffers are made read-only (the receiver does; install steps, which
// write later, never target a landing-digested parameter).
//
// Thread safety: Landed() may be called concurrently from any threads (the per-parameter sums are
// atomics, the chunk lists are under a mutex); Reset() and Finish() by the one owner while no
// transfer that carries this observer is in flight.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "rolloutcore/base/mutex.h"
#include "rolloutcore/refit/capture.h"
#include "rolloutcore/refit/digest.h"
#include "rolloutcore/refit/planner.h"
#include "rolloutcore/transport/transport.h"

namespace rc::refit {

class LandingDigest final : public transport::LandingObserver {
 public:
  // Per rank: the capture, its digest regions (AssignDigestOwnership), the bytes no region covers
  // (BytesOutsideRegions), the staged buffers the plan writes, and the plan. All must outlive this.
  LandingDigest(std::span<const Capture> captures, std::span<const std::vector<DigestRegion>> regions,
                std::span<const UncoveredBytes> uncovered, std::span<const DestinationBuffers> buffers,
                std::span<const TransferPlan> plans);

  // Forgets what landed (before a new pull into the same buffers).
  void Reset();
  void Landed(std::byte* dest, uint64_t length) override;
  bool CopyLanded(std::byte* dest, const std::byte* src, uint64_t length) override;

  struct Outcome {
    TensorDigests digests;  // of the landing-digested parameters that landed whole
    bool nonfinite = false;  // a NaN or Inf among the bytes digested on landing
    // (rank, parameter) left to the caller's digest pass: every other parameter.
    std::set<std::pair<size_t, std::string>> fallback;
    // Of the accepted parameters, the landing-scanned replicas (finite check only, no digest).
    size_t scanned_only = 0;
  };
  Outcome Finish();

  // How many parameters qualify (for tests and the stage evidence), landing-scanned replicas
  // included; scan_only_eligible() counts those alone.
  size_t eligible() const { return params_.size(); }
  size_t scan_only_eligible() const;

 private:
  // One source tensor's bytes [begin, end) of the parameter.
  struct Segment {
    std::string tensor;  // the digest's key
    uint64_t begin = 0, end = 0;
    std::atomic<uint64_t> sum{0};
  };
  struct Param {
    size_t rank = 0;
    std::string name;  // parameter
    DType dtype = DType::kF32;
    const std::byte* begin = nullptr;
    uint64_t bytes = 0;
    std::vector<std::unique_ptr<Segment>> segments;  // sorted, tiling [0, bytes); empty: a replica (scan only)
    std::atomic<bool> nonfinite{false};
    std::atomic<bool> misaligned{false};
    rc::Mutex mu;
    std::vector<std::pair<uint64_t, uint64_t>> chunks GUARDED_BY(mu);  // [begin, end) byte offsets
  };
  // The parameter that holds [dest, dest + length) wholly, or null (then nothing is recorded).
  Param* Find(const std::byte* dest, uint64_t length) const;
  // Landed (src null: the bytes are at dest already) and CopyLanded (copies src to dest first).
  bool Observe(std::byte* dest, const std::byte* src, uint64_t length);

  std::span<const Capture> captures_;
  std::vector<std::unique_ptr<Param>> params_;  // sorted by begin; fixed after construction
};

}  // namespace rc::refit
