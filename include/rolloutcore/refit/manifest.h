// Shard tables and manifests: what a trainer publishes for one weight version.
//
// A ShardTable describes one tensor (name, dtype, global shape) and the shards that hold it: per
// shard the owning rank, the global offset and local shape of its box, an opaque memory handle
// (a transport descriptor a peer can import) and the shard's content digest (see digest.h).
// Shards with identical boxes on different ranks are replicas (data parallel): a reader needs
// only one of them. Shards with different boxes must not overlap.
// A Manifest is the set of shard tables of one version plus the model name, version label, the
// number of ranks expected to publish, the content digest algorithm the digests were computed
// with, and the combined content digest.
//
// Thread safety: values and pure functions.
// Invariants kept by ValidateShardTable: every shard box has the tensor's rank, lies inside the
// global shape, and non-identical boxes are disjoint; with require_complete the distinct boxes
// also cover the whole tensor.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/json.h"
#include "rolloutcore/base/status.h"
#include "rolloutcore/refit/fp8_digest.h"
#include "rolloutcore/refit/probes.h"
#include "rolloutcore/refit/tensor.h"

namespace rc::refit {

// The content digest algorithm this build computes (digest.h). A manifest names its algorithm
// (JSON field "digest"); a manifest naming another, or none (written before the field existed),
// cannot be checked against what this build computes and is refused (TensorDigestsFromShards).
inline constexpr std::string_view kDigestAlgorithm = "rc-digest-2";

// A shard's sparse delta against an earlier committed version (docs/refit.md "Delta refit"): the
// elements of the box whose bits differ from the base version's, encoded by EncodeShardDelta
// (delta.h) in a registered region of their own. The full shard stays published beside it.
struct ShardDelta {
  std::string base;          // the base version label
  uint64_t base_digest = 0;  // the shard box's content digest in the base version
  std::string handle;        // transport descriptor of the region holding the payload
  uint64_t offset = 0;       // the payload's first byte inside that region
  uint64_t bytes = 0;        // the payload's length
  int64_t changed = 0;       // elements whose bits changed

  bool operator==(const ShardDelta&) const = default;
};

struct ShardInfo {
  int32_t rank = 0;
  Shape offset;  // global start of the shard's box
  Shape shape;   // local (box) extent; the shard's bytes are this box, row-major
  std::string handle;  // transport descriptor, opaque to refit
  uint64_t digest = 0;  // content digest of the box (DigestBlock)
  std::optional<ShardDelta> delta = std::nullopt;  // set when the version was published as a delta
  // The trainer's part of the FP8 image an engine serving quantization Q (a kFp8Quantizations name)
  // computes from this version (docs/fp8.md, "The expected image, from the trainer"): the digests
  // of this box's E4M3 bytes and of the scales it owns, in the coordinates of its FP8 parameter
  // (fp8_digest.h). Only projections carry parts; empty when the trainer published none.
  std::map<std::string, Fp8ImageDigest, std::less<>> fp8 = {};

  Box box() const { return Box{offset, shape}; }
};

struct ShardTable {
  std::string name;
  DType dtype = DType::kBF16;
  Shape shape;  // global shape
  std::vector<ShardInfo> shards;

  TensorSpec spec() const { return TensorSpec{name, dtype, shape}; }
};

struct Manifest {
  std::string model;
  std::string version;
  int32_t expected_ranks = 0;
  std::vector<ShardTable> tables;
  uint64_t content_digest = 0;  // CombineTensorDigests over the per-tensor digests
  // The algorithm of every digest above (JSON "digest"); empty when a parsed manifest had none.
  std::string digest_algorithm = std::string(kDigestAlgorithm);
  // Replay probes the trainer attached (probes.h); not part of the content digest or the source
  // topology. Serialized as "probes" only when non-empty.
  std::vector<Probe> probes;
};

// Checks the shard table as described in the header comment. Errors name the tensor, the ranks
// and the boxes: "tensor X: shards of rank 1 [0:8, 0:4] and rank 2 [4:12, 0:4] overlap at
// [4:8, 0:4]"; "tensor X: rows 1024..1280 missing from the published shards".
[[nodiscard]] Status ValidateShardTable(const ShardTable& table, bool require_complete);

// The FP8 image the trainer published for `quantization` (ShardInfo::fp8): per FP8 parameter, the
// sum of the parts of its tensors' shards over distinct boxes (a replica counted once). Empty when
// no shard carries `quantization`. InvalidArgument naming the tensor and rank when a tensor served
// in bf16 carries a part, when a projection's shard lacks the part that others carry, or when a
// quantization name is not one of kFp8Quantizations; DataLoss when two replicas of a box publish
// different parts. The engine's live image digest must equal Fp8ImageCombined of the result.
[[nodiscard]] Result<Fp8Image> PublishedFp8Image(const Manifest& manifest, std::string_view quantization);
// The quantizations any shard of `manifest` carries FP8 parts for, in name order.
std::vector<std::string> PublishedFp8Quantizations(const Manifest& manifest);

// Per-tensor digests in name order (std::map orders by name).
using TensorDigests = std::map<std::string, uint64_t, std::less<>>;

// Per-tensor digest = sum of the shard digests over distinct boxes (a replica is counted once).
// DataLoss when two replicas of one box publish different digests. FailedPrecondition naming the
// field and its value when the manifest's digest algorithm is not kDigestAlgorithm (or missing):
// every receiver, verifier and the directory's commit read published digests through here.
[[nodiscard]] Status CheckDigestAlgorithm(const Manifest& manifest);
[[nodiscard]] Result<TensorDigests> TensorDigestsFromShards(const Manifest& manifest);

// The transport every shard handle of `manifest` names (a descriptor's prefix: "shm:v1:..." ->
// "shm"). InvalidArgument when a handle has no prefix, when the version mixes transports (one
// transport per version), or when it has no shards.
[[nodiscard]] Result<std::string> ManifestTransport(const Manifest& manifest);

// Identifies the source topology (tensors, dtypes, shapes, and every shard's rank, box and handle):
// a receiver may keep plans and imports while it is unchanged.
uint64_t SourceTopologyDigest(const Manifest& manifest);

// The first difference between per-tensor digests `got` and `want`, for messages ("tensor X:
// digest a != published b", "tensor X was not installed", "tensor X is not in the manifest");
// empty when they are equal.
std::string FirstDigestMismatch(const TensorDigests& got, const TensorDigests& want);

// JSON form of a manifest (digests as 16-hex-digit strings, since JSON numbers lose 64-bit
// precision in many readers).
Json ManifestToJson(const Manifest& manifest);
[[nodiscard]] Result<Manifest> ManifestFromJson(const Json& json);

}  // namespace rc::refit
