// Fp8Weights: the embedded engine's FP8 serving weights (docs/fp8.md, "The embedded engine").
//
// With `--quantization fp8_per_tensor | fp8_per_channel | fp8_per_block` the engine keeps its bf16
// parameters (the bytes the refit receiver stages, installs and proves, exactly as without
// quantization) and computes with an FP8 image of the four projections of every layer: qkv_proj,
// o_proj, gate_up_proj and down_proj. Embeddings, lm_head and norms stay bf16, as vLLM's online
// methods leave them.
//
// The image is what vLLM 0.33 serves from the same bf16 bytes: each vLLM parameter (q, k, v fused
// into qkv_proj, gate and up into gate_up_proj) is quantized as one whole matrix by formats/fp8.h's
// rule. A tensor-parallel rank holds pieces of it (its query heads' rows, its kv heads' rows, its
// columns of o_proj / down_proj): every rank's amax per scale group is merged over the ranks (vLLM
// all-reduces it) and each rank quantizes its pieces with the whole parameter's scales, so its bytes
// are the whole parameter's bytes at its rows. Each local row carries its own copy of its scales
// (kernels.h, WeightRef::Fp8), so one kernel serves every scheme.
//
// Two digests per vLLM parameter, each an Fp8ImageDigest (refit/fp8_digest.h) in the coordinates of
// the whole parameter:
//  - Live(): of the bytes and scales the kernels read. Every replica is checked against the copy
//    that is digested: kv-head rows held by several ranks, and the copies of a scale that the rows
//    of its group hold. A replica that differs is DataLoss naming the parameter, the rank and the
//    row, since the kernels would compute with it while the digest would not show it.
//  - Expected(): computed from the bf16 parameters alone, each whole parameter gathered and
//    quantized at once (formats::QuantizeBf16ToFp8): the digest `rolloutcore model fp8-digest`
//    computes from a checkpoint with these bytes. A wrong, stale or re-laid-out scale, or bytes of
//    another version, make Live() differ from it.
//
// Thread safety: not synchronized; the engine quantizes and digests under its step lock.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/kernels.h"
#include "rolloutcore/base/status.h"
#include "rolloutcore/engine/model_spec.h"
#include "rolloutcore/engine/parameters.h"
#include "rolloutcore/formats/fp8.h"
#include "rolloutcore/refit/fp8_digest.h"

namespace rc::engine {


// The engine parameters that are served in FP8 (per layer, in this order).
inline constexpr const char* kFp8Projections[] = {"self_attn.qkv_proj.weight", "self_attn.o_proj.weight",
                                                  "mlp.gate_up_proj.weight", "mlp.down_proj.weight"};

class Fp8Weights {
 public:
  // One rank's FP8 copy of one engine parameter: rows × cols E4M3 bytes, and per row scale_cols
  // scales, scale k / scale_block_cols covering column k (kernels.h).
  struct Buffer {
    int64_t rows = 0;
    int64_t cols = 0;
    int64_t scale_cols = 1;
    int64_t scale_block_cols = 0;
    std::vector<uint8_t> q;
    std::vector<float> row_scales;
    WeightRef Ref() const { return WeightRef::Fp8(q.data(), row_scales.data(), scale_cols, scale_block_cols); }
  };

  // InvalidArgument when the scheme cannot serve this layout: block scales need every rank's column
  // slice of o_proj and down_proj to start on a block (vLLM requires the same).
  static Result<std::unique_ptr<Fp8Weights>> Create(const ModelSpec& spec, const std::vector<RankLayout>& layouts,
                                                    formats::Fp8Scheme scheme);

  formats::Fp8Scheme scheme() const { return scheme_; }
  // Quantizes every rank's projections from its bf16 parameters (params[rank], the engine layout).
  // A NaN or infinite weight is InvalidArgument naming the parameter, row and column; the image is
  // then partly written, and the caller (an install) fails.
  Status Quantize(const std::vector<const ParameterStore*>& params, int threads);
  // The buffer of rank `rank`'s parameter `name` (an engine parameter name); nullptr when not served in FP8.
  const Buffer* Find(int rank, const std::string& name) const;
  // Test-only write access (the negative controls corrupt scales and bytes through it).
  Buffer* MutableForTesting(int rank, const std::string& name);
  // Every buffer of every rank, in one fixed order (tests: snapshots and faults).
  std::vector<Buffer*> BuffersForTesting();
  int64_t Bytes() const;

  using Digests = refit::Fp8Image;  // vLLM parameter name -> digest
  Result<Digests> Live() const;
  Result<Digests> Expected(const std::vector<const ParameterStore*>& params, int threads) const;

 private:
  // A stretch of a rank's parameter: local rows [local_row0, local_row0 + box.rows) hold the whole
  // parameter's box `box` (all its columns when box.cols == the local cols). `owner`: the rank
  // whose copy is digested (kv heads held by several ranks are owned by the first).
  struct Piece {
    int64_t local_row0 = 0;
    formats::Fp8Box box;
    bool owner = true;
  };
  struct Param {
    std::string name;
    formats::Fp8Layout layout;                 // the whole vLLM parameter
    std::vector<std::vector<Piece>> pieces;    // [rank]
    std::vector<Buffer> buffers;               // [rank]
  };
  Fp8Weights() = default;
  // The bf16 rows of rank `rank`'s piece (contiguous: a piece spans all local columns).
  static Result<const uint16_t*> Bf16Of(const ParameterStore& ps, const Param& p, int rank);

  formats::Fp8Scheme scheme_ = formats::Fp8Scheme::kPerTensor;
  std::vector<Param> params_;
  std::map<std::string, size_t> index_;  // name -> params_ index
};

}  // namespace rc::engine
