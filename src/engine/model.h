// Model: the decoder forward pass (Llama / Qwen2 / Qwen3) over tensor-parallel ranks held in
// one process, with paged KV.
//
// Each rank owns its ParameterStore (engine layout, see model_spec.h) and its KV storage
// ([num_blocks, block_size, local kv heads, head_dim] per layer for K and for V). Forward runs
// every rank's column-parallel part, then sums the row-parallel partial outputs in rank order
// (the in-process all-reduce), so results depend only on tp, never on scheduling.
//
// Weights are read through a WeightBinding (resolved pointers into one set of parameters of the
// engine layout). Bind() resolves the live ParameterStores; BindImage() resolves another set of
// buffers of the same layout and dtype (a staged refit image), so Forward(binding, ...) computes
// with those bytes through exactly the same kernels, KV storage and code path: the same bytes give
// bit-identical results whether they are live or not (model_test.cc checks it, tp 1 and 2).
//
// Thread safety: not synchronized; the engine calls Forward under its step lock only, and
// mutates parameters only while paused. Forward's scratch (activations, the flattened batch) is
// the model's own and kept from one call to the next, up to kKeepScratchBytes: a forward
// allocates, faults in and zeroes no memory once a batch of its size ran before (no heap growth,
// so a forward never waits on the address-space lock another thread's munmap holds). A binding
// stays valid while the buffers it points into are neither freed nor exchanged (the caller's
// contract; the engine re-binds after installs).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "engine/fp8_weights.h"
#include "engine/kernels.h"
#include "engine/thread_pool.h"
#include "rolloutcore/engine/model_spec.h"
#include "rolloutcore/engine/parameters.h"

namespace rc::engine {

struct ParameterDecl {
  std::string name;
  std::vector<int64_t> shape;
  std::string alias_of;  // tied lm_head
};
// The engine parameters of one rank (names and shapes), in the layout of model_spec.h.
std::vector<ParameterDecl> EngineParameterDecls(const ModelSpec& spec, const RankLayout& layout);

struct ForwardSeq {
  const int32_t* tokens = nullptr;  // new tokens, positions start_pos .. start_pos + n - 1
  int64_t num_tokens = 0;
  int64_t start_pos = 0;
  const std::vector<int32_t>* block_table = nullptr;  // covers positions [0, start_pos + n)
  bool want_logits = false;                           // logits of the last new token(s)
  // With want_logits: how many of the last new tokens get a logits row (1..num_tokens), in
  // position order: a teacher-forced replay scores every step of a recorded continuation in one
  // forward. Each row is bit for bit what a forward ending at that token computes (the kernels
  // are row-invariant and attention reads the KV slots the same way).
  int64_t logit_tokens = 1;
};

// Resolved weight pointers of every rank for one set of parameters (live or a staged image).
struct WeightBinding {
  struct Layer {
    WeightRef in_norm;
    WeightRef post_norm;
    WeightRef qkv;
    WeightRef qkv_bias;
    WeightRef q_norm;
    WeightRef k_norm;
    WeightRef o;
    WeightRef gate_up;
    WeightRef down;
  };
  std::vector<std::vector<Layer>> layers;  // [rank][layer]
  WeightRef embed;
  WeightRef final_norm;
  WeightRef lm_head;
};

class Model {
 public:
  // weight_dtype: the dtype every parameter is kept in (F32 or BF16, parameters.h). fp8: serve the
  // projections from an FP8 image of them (fp8_weights.h; BF16 weights only), quantized by
  // Quantize() after every write of the parameters.
  static Result<std::unique_ptr<Model>> Create(const ModelSpec& spec, int tp, int64_t num_blocks,
                                               int64_t block_size, ThreadPool* pool,
                                               DType weight_dtype = DType::kF32,
                                               std::optional<formats::Fp8Scheme> fp8 = std::nullopt);
  const ModelSpec& spec() const { return spec_; }
  int tp() const { return static_cast<int>(ranks_.size()); }
  ParameterStore& params(int rank) { return ranks_[rank]->params; }
  const ParameterStore& params(int rank) const { return ranks_[rank]->params; }
  const RankLayout& layout(int rank) const { return ranks_[rank]->layout; }
  int64_t KvBytes() const;
  DType weight_dtype() const { return weight_dtype_; }
  // Bytes of every rank's parameters (aliased storage once).
  int64_t WeightBytes() const;

  // Resolves cached parameter pointers; call after (re)loading weights or exchanging storage. With
  // FP8 serving the projections resolve to the FP8 image (call Quantize() first when the bf16
  // parameters changed).
  Status Bind();
  // FP8 serving: quantizes the FP8 image from the live bf16 parameters (fp8_weights.h) and binds
  // it. Without FP8 serving: OkStatus, nothing done.
  Status Quantize();
  // The FP8 image; nullptr without FP8 serving.
  const Fp8Weights* fp8() const { return fp8_.get(); }
  Fp8Weights* mutable_fp8() { return fp8_.get(); }
  // The live bf16 parameters of every rank (what the FP8 image is quantized from).
  std::vector<const ParameterStore*> AllParams() const;
  // Resolves the pointers of `image` (per rank, parameter name -> bytes in weight_dtype(), the
  // engine layout; an alias such as a tied lm_head may be absent and then follows its target).
  // InvalidArgument naming the parameter when one is missing or has the wrong size.
  // FailedPrecondition with FP8 serving: a staged bf16 image is not what the FP8 engine computes
  // with (a pre-replay on it would not predict the live results).
  Result<WeightBinding> BindImage(const WeightImage& image) const;
  // True when `w` points at exactly the live parameters' storage (every reference, same dtype).
  bool IsLive(const WeightBinding& w) const;
  // Runs the batch on the live weights; appends one row of vocab_size logits per seq with
  // want_logits.
  Status Forward(const std::vector<ForwardSeq>& seqs, std::vector<float>* logits) {
    return Forward(live_, seqs, logits);
  }
  // The same on the weights `w` points into (KV storage and kernels shared with the live path).
  Status Forward(const WeightBinding& w, const std::vector<ForwardSeq>& seqs, std::vector<float>* logits);

 private:
  struct Rank {
    RankLayout layout;
    ParameterStore params;
    std::vector<std::vector<float>> k_cache, v_cache;  // per layer
  };
  Model(const ModelSpec& spec, int64_t num_blocks, int64_t block_size, ThreadPool* pool)
      : spec_(spec), num_blocks_(num_blocks), block_size_(block_size), pool_(pool) {}

  // Forward's scratch, reused across calls (Forward runs under the engine's step lock only).
  struct Scratch {
    std::vector<int32_t> tok_id;
    std::vector<int64_t> tok_seq, tok_pos, logit_rows;
    std::vector<float> x, hbuf, qkv, attn, gu, act, normed;
    std::vector<float> pack;  // MatMulNT's packed input
    std::vector<std::vector<float>> partials;  // per rank
    size_t Bytes() const;
  };
  // Scratch beyond this is freed after the forward that needed it (a long prefill), so a model
  // never holds more than this between calls.
  static constexpr size_t kKeepScratchBytes = size_t{64} << 20;

  ModelSpec spec_;
  int64_t num_blocks_;
  int64_t block_size_;
  ThreadPool* pool_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::vector<float> inv_freq_;
  DType weight_dtype_ = DType::kF32;
  std::unique_ptr<Fp8Weights> fp8_;
  // Looks up one parameter of one rank by name with its expected shape.
  using RefLookup = std::function<Result<WeightRef>(size_t rank, const std::string& name,
                                                    const std::vector<int64_t>& shape)>;
  Result<WeightBinding> BindWith(const RefLookup& lookup) const;
  WeightBinding live_;
  Scratch scratch_;
};

}  // namespace rc::engine
