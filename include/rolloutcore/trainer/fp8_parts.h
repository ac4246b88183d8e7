// The trainer's side of the FP8 proof (docs/fp8.md, "The expected image, from the trainer"): each
// rank computes, for every shard of a projection it publishes, its part of the FP8 image an engine
// serving --quantization Q computes from the version (refit::ShardInfo::fp8). The directory adds
// the parts of every rank up per FP8 parameter (refit::PublishedFp8Image); the controller requires
// the engine's live image to equal that sum. So the expected image is computed by the trainer, from
// the bytes it published, independently of the engine.
//
// A part is what the rank can compute from its own bytes once it knows the scales of the groups its
// shards touch: the digest of its box's E4M3 bytes (in the coordinates of the fused parameter:
// q, k, v rows one after another in qkv_proj) and of the scales it owns (the groups whose first
// element lies in its box, so that every scale is counted once over the ranks). A scale group
// that spans the shards of several ranks (an FSDP row split inside a 128-row block, a per-tensor
// scale over a sharded parameter) needs every holder's amax: pass an exchange that merges the
// amaxes over the trainer's ranks by max (an all-reduce MAX over its process group), as vLLM
// merges them over its TP group. Without one, such a group is refused, naming it.
//
// Thread safety: pure functions (the exchange is called once per call, on the calling thread).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/mutex.h"
#include "rolloutcore/base/status.h"
#include "rolloutcore/refit/fp8_digest.h"
#include "rolloutcore/refit/tensor.h"

namespace rc::trainer {

// One shard a rank holds: the box of tensor `name` (dtype, global shape), its bytes row-major in
// host memory.
struct Fp8ShardInput {
  std::string name;
  refit::DType dtype = refit::DType::kBF16;
  refit::Shape global_shape;
  refit::Box box;
  const void* data = nullptr;
};

// Per FP8 parameter (vLLM name), the largest magnitude of each scale group over what a rank holds,
// as bf16 magnitude bits (formats::Fp8BoxAmax), row-major over the scale grid.
using Fp8Amax = std::map<std::string, std::vector<uint16_t>, std::less<>>;

// Merges `amax` with every other rank's by max, in place (entries keyed by parameter name; a rank
// may lack a parameter it holds nothing of). Called exactly once per Fp8ShardParts call, on every
// rank, so a collective fits.
using Fp8AmaxExchange = std::function<Status(std::string_view quantization, Fp8Amax* amax)>;

// The part of every shard for `quantization` (fp8_per_tensor, fp8_per_channel, fp8_per_block):
// out[i] is shards[i]'s, nullopt for a tensor served in bf16. `model` (optional) names the global
// dtype and shape of the model's tensors: a rank that holds no shard of some part of a fused
// parameter (fsdp over more ranks than k_proj has rows) needs it to place the parts it holds.
// InvalidArgument naming the tensor for a projection that is not 2-D BF16, a fused parameter one of
// whose parts neither the shards nor `model` describe (its row offset is unknown), a `model` entry
// that disagrees with a shard, a NaN or infinite weight (row and column), or an unknown
// quantization; FailedPrecondition naming the parameter and the group when a group is only partly
// held here and `exchange` is empty.
[[nodiscard]] Result<std::vector<std::optional<refit::Fp8ImageDigest>>> Fp8ShardParts(
    const std::vector<Fp8ShardInput>& shards, std::string_view quantization, const Fp8AmaxExchange& exchange = {},
    int threads = 1, const std::vector<refit::TensorSpec>& model = {});

// The two halves of Fp8ShardParts, for ranks that exchange the amaxes themselves (several ranks in
// one process; a collective outside a callback): the rank's own amaxes, with `partial` (when not
// null) set to the first group the rank holds only part of ("" when it holds every group it
// touches whole) ...
[[nodiscard]] Result<Fp8Amax> Fp8LocalAmax(const std::vector<Fp8ShardInput>& shards, std::string_view quantization,
                                           std::string* partial = nullptr, int threads = 1,
                                           const std::vector<refit::TensorSpec>& model = {});
// ... and the parts, with the amaxes merged over every rank that holds part of a parameter.
// InvalidArgument when `merged` lacks a parameter the shards touch or has the wrong size.
[[nodiscard]] Result<std::vector<std::optional<refit::Fp8ImageDigest>>> Fp8PartsFromAmax(
    const std::vector<Fp8ShardInput>& shards, std::string_view quantization, const Fp8Amax& merged, int threads = 1,
    const std::vector<refit::TensorSpec>& model = {});

// The exchange of ranks that run as threads of one process (the synthetic trainer): each call
// merges its amax into a shared one and waits until `ranks` calls of the same round have arrived;
// every call then gets the merged amax. A round that does not fill within `timeout_ms` fails
// every call of it with DeadlineExceeded naming how many ranks joined (a rank that failed before
// its publish), and the next round starts afresh. Thread-safe; must outlive the exchanges bound.
class Fp8ThreadExchange {
 public:
  Fp8ThreadExchange(int ranks, int64_t timeout_ms) : ranks_(ranks), timeout_ms_(timeout_ms) {}
  Fp8AmaxExchange Bind();

 private:
  Status Exchange(std::string_view quantization, Fp8Amax* amax);
  const int ranks_;
  const int64_t timeout_ms_;
  rc::Mutex mu_;
  rc::CondVar cv_;
  uint64_t round_ GUARDED_BY(mu_) = 0;
  int arrived_ GUARDED_BY(mu_) = 0;
  Fp8Amax merged_ GUARDED_BY(mu_);
  Fp8Amax result_ GUARDED_BY(mu_);
  uint64_t failed_round_ GUARDED_BY(mu_) = UINT64_MAX;
};

}  // namespace rc::trainer
