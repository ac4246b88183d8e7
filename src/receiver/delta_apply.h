// Delta refit on the receiver side (docs/refit.md "Delta refit"), used by RefitReceiver.
//
// StageDelta: for a manifest whose shards carry deltas against the version the engine serves,
// pulls for each rank only the delta tiles its captured copies touch (header and tile table of
// every shard it reads, then the tiles), and keeps the pulled tile bodies (about 3.3 bytes per
// changed bf16 element; nothing per element is materialized). It cuts the work into pieces (one
// captured copy x one pulled shard it overlaps, with the affine map from the shard's tiles to the
// parameter's elements and to the source tensor's global indices) and jobs (runs of a piece's
// tiles), and runs the jobs over the shared ParallelFor pool. Each job decodes its tiles in bulk
// (DecodeDeltaTileOffsets), refuses non-finite new values, maps the changed elements through the
// piece (a row table per tile, no search and no branch per element) into a batch, and then, in a
// memory pass over the batch with software prefetch, sums per tensor the digest terms of the new
// values and of the live (old) ones, so that
//     D_new(T) = D_live(T) + sum over changed owned elements (DigestTerm(i, new) - DigestTerm(i, old))
// is predicted in the same pass. A prediction that differs from the manifest's per-tensor digest
// refuses the stage (nothing live is touched). Reads the live parameters, never writes them; with
// `apply` (the staging path) it reads and writes the staging image instead, in the same pass, and
// the prediction is the digest of what the image holds after the writes.
// ApplyDelta writes one rank's changes into its live parameters (only inside
// LiveWeights::InstallLive), decoding the kept bodies again. DigestAfterDelta re-reads every changed
// owned element from the live parameters after the install and returns the per-tensor digests
// they give.
//
// Thread safety: pure functions over the caller's data; the caller serializes them with installs.
// Internally each call fans out over ParallelFor (jobs write disjoint results; the install writes
// disjoint destination elements, as the captured copies of one rank do).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "rolloutcore/base/status.h"
#include "rolloutcore/receiver/reports.h"
#include "rolloutcore/receiver/weights.h"
#include "rolloutcore/refit/capture.h"
#include "rolloutcore/refit/delta.h"
#include "rolloutcore/refit/digest.h"
#include "rolloutcore/refit/executor.h"
#include "rolloutcore/refit/manifest.h"

namespace rc::receiver::internal {

// Why `manifest` cannot be applied as a delta on live weights labelled `live_version` whose
// per-tensor digests are `live` (nullptr: none known for the current install generation); ""
// when it can: every shard carries a delta on one base, the base is the live label, and every
// tensor's live digest equals the sum of its shards' base digests. With `loaded_only`, tensors
// absent from `live` are not required (an engine that does not load some tensors, e.g. a tied
// lm_head, has nothing of them to prove; the device receiver's staging digests hold what it loads).
std::string DeltaIneligibility(const refit::Manifest& manifest, const std::string& live_version,
                               const refit::TensorDigests* live, bool loaded_only = false);

// True when every shard of `manifest` carries a delta.
bool CarriesDelta(const refit::Manifest& manifest);

// One destination element a delta install writes (the fault injection of tests names the first).
struct DeltaWrite {
  uint32_t param = 0;  // index into the rank's capture params
  uint32_t bits = 0;   // the new value in the parameter's dtype (at most 4 bytes)
  int64_t offset = 0;  // element offset in the parameter
};

// One pulled shard: its tiling, tile table and the bodies of the tiles the rank needs.
struct DeltaShard {
  uint32_t rank = 0;
  uint32_t table = 0, shard = 0;  // indices into the manifest
  refit::DType dtype = refit::DType::kBF16;
  refit::DeltaTiling tiling;
  std::vector<refit::DeltaTile> entries;  // the whole tile table
  std::vector<std::byte> bodies;          // the needed tiles' bodies, in tile order
};

// A box in shard-local coordinates of the shard-as-matrix: leading dims and a column range.
struct DeltaLocalBox {
  refit::Shape lead_lo, lead_hi;
  int64_t col_lo = 0, col_hi = 0;
};

// One captured copy x one pulled shard it overlaps. For shard-local leading coords l and column j
// (the shard as a matrix; a 0-d shard is one column, a 1-d shard one row):
//   destination element = dest0 + sum_d l_d * lead_dest[d] + j * col_dest
//   global source index = global0 + sum_d l_d * lead_global[d] + j
// for the elements inside `in` (the overlap with the copy's box).
struct DeltaPiece {
  uint32_t rank = 0, copy = 0, param = 0;
  uint32_t tensor = 0;  // index into DeltaStaged::tensors
  uint32_t shard = 0;   // index into DeltaStaged::shards
  refit::DType source = refit::DType::kBF16;  // the copy's source dtype
  refit::DType dest = refit::DType::kF32;     // the parameter's dtype
  refit::Shape lead_shape;                    // shard-local extents of the leading dims
  refit::Shape lead_dest, lead_global;
  int64_t col_dest = 0, dest0 = 0, global0 = 0;
  DeltaLocalBox in;
  bool own_all = false;                // one digest region of the copy holds all of `in`
  std::vector<DeltaLocalBox> owned;    // otherwise: the regions (clipped to `in`) it owns
  std::vector<std::pair<int64_t, uint64_t>> tiles;  // (tile, body offset in the shard's bodies)
};

// A run of one piece's tiles: the unit of parallel work.
struct DeltaJob {
  uint32_t piece = 0;
  uint32_t tile_begin = 0, tile_end = 0;  // indices into the piece's tiles
};

struct DeltaStaged {
  std::string base;
  // Where the install takes the delta from: true when it was applied to the staging image at stage
  // (the install swaps that image in), false when the install writes it into the live weights.
  bool to_staging = false;
  int64_t generation = -1;  // install generation whose live values the prediction read
  std::vector<DeltaShard> shards;
  std::vector<DeltaPiece> pieces;
  std::vector<DeltaJob> jobs;                       // rank-major
  std::vector<std::pair<size_t, size_t>> rank_jobs;  // per rank: [begin, end) of jobs
  std::vector<std::optional<DeltaWrite>> first_write;  // per rank: its first write, if any
  std::vector<uint64_t> bytes_written;                 // per rank: destination bytes the install writes
  std::vector<std::string> tensors;
  std::vector<uint64_t> new_terms;    // per tensor id: sum of DigestTerm of the new values (owned elements)
  refit::TensorDigests base_digests;  // live digests the prediction started from
  refit::TensorDigests predicted;     // equal to the manifest's when staged
  uint64_t bytes_pulled = 0;
  int64_t changed = 0;  // changed source elements digested (each once over all ranks)
  std::vector<DeltaRankReport> ranks;  // per rank: what the pull read and the prediction found
  StepTimings stages_ms;
};

// What the staging image holds after a delta install by swap (docs/refit.md "Delta on the staging
// image"): the live weights the install retired (version `staging_version`, whose per-tensor
// digests were proven when that delta was staged), and the delta `previous` that leads from them
// to the version the install made live. The next delta stage re-applies `previous` to the staging
// image (checking its digest against the live one's) before applying its own delta.
struct DeltaChain {
  DeltaStaged previous;
  refit::Manifest previous_manifest;
  std::string staging_version, live_version;
  refit::TensorDigests staging_digests;
  int64_t live_generation = -1;  // the install generation `previous` made live
};

struct DeltaStageInput {
  const refit::Manifest* manifest = nullptr;
  const refit::TensorDigests* published = nullptr;  // per tensor, from the manifest's shards
  const std::vector<refit::Capture>* captures = nullptr;
  const std::vector<std::vector<refit::DigestRegion>>* regions = nullptr;
  // The image the old values are read from (the live weights, or the staging image when apply),
  // and its per-tensor digests.
  const std::vector<refit::DestinationBuffers>* live = nullptr;
  const refit::TensorDigests* live_digests = nullptr;
  bool apply = false;  // also write the new values into *live (PredictDelta's apply)
  bool corrupt_first_write = false;  // test-only fault (with apply): job 0 stores its first value with bit 0 flipped
  int64_t generation = -1;
  int64_t timeout_ms = 60'000;
  int threads = 1;  // ParallelFor width for the decode/map/digest pass
};

[[nodiscard]] Result<DeltaStaged> StageDelta(const DeltaStageInput& in);
// StageDelta's wire and planning alone (the device path's first half, device_delta.h): every
// rank's needed tiles pulled into host memory, its pieces and jobs planned, and per rank the pull's
// report (bytes_pulled, reads, shards_read); stages_ms wire and planning; `base` the version the
// shards' deltas are on. Nothing is decoded or predicted, and in.live is only checked to name every
// captured parameter.
[[nodiscard]] Result<DeltaStaged> PullDelta(const DeltaStageInput& in);

// The parts of StageDelta after the wire (exposed for unit tests, which build DeltaShards from
// locally encoded payloads). PlanDeltaRank appends rank r's pieces and jobs for the shards
// out->shards[first_shard, first_shard + tile_at.size()) (all pulled for rank r; tile_at[k] maps
// a tile of shard first_shard + k to its body offset, UINT64_MAX when not pulled). PredictDelta
// runs the stage pass over every job: fills predicted (from base_digests), new_terms, changed,
// bytes_written, first_write and ranks (changed_in_region, region_delta_bytes, writes).
[[nodiscard]] Status PlanDeltaRank(const refit::Manifest& m, size_t r, const refit::Capture& cap,
                                   const std::vector<refit::DigestRegion>& regions,
                                   const std::vector<refit::DestinationBuffers>& live, size_t first_shard,
                                   const std::vector<std::vector<uint64_t>>& tile_at, DeltaStaged* out);
// With apply, the pass also writes every changed element's new value into `live` (then the image
// being updated, e.g. the staging image) and takes each new term from what the element holds
// after the write, so `predicted` is the digest of the updated image (given that base_digests was
// the image's digest before).
[[nodiscard]] Status PredictDelta(const refit::Manifest& m, const std::vector<refit::Capture>& captures,
                                  const std::vector<refit::DestinationBuffers>& live, int threads, DeltaStaged* out,
                                  bool apply = false, bool corrupt_first_write = false);
// Calls fn for every changed element job `job` maps (in the copy's box): its destination element
// offset in the piece's parameter, global source index, new value (source-dtype bits) and digest
// ownership.
[[nodiscard]] Status ForEachDeltaElement(
    const DeltaStaged& staged, size_t job,
    const std::function<void(int64_t dest, uint64_t global, uint64_t bits, bool owned)>& fn);

// Writes rank `rank`'s changes (staged.jobs of that rank) into its live parameters (`capture`
// names them), over up to `threads` threads.
[[nodiscard]] Status ApplyDelta(const DeltaStaged& staged, size_t rank, const refit::Capture& capture,
                                const ParameterStore& params, int threads);

// The per-tensor digests of the live weights after the install: the prediction with, for every
// changed owned element, the term of the new value replaced by the term of what live memory holds
// now (so any write that did not land shows), over up to `threads` threads.
[[nodiscard]] Result<refit::TensorDigests> DigestAfterDelta(const DeltaStaged& staged,
                                                            const std::vector<refit::Capture>& captures,
                                                            const std::vector<refit::DestinationBuffers>& live,
                                                            int threads);

// The source-dtype bits refit::InstalledSourceBits gives an installed element, with inline fast
// paths for the same dtype and bf16 installed as f32 (exposed for its equivalence test).
uint64_t InstalledBitsFast(refit::DType source, refit::DType installed, const std::byte* element);

}  // namespace rc::receiver::internal
