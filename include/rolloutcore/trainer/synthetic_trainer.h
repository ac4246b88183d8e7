// SyntheticTrainer: a deterministic stand-in for a distributed trainer. N ranks (threads of this
// process), each with its own Transport, its own Publisher and its own shared-memory buffers,
// hold a model sharded by a refit trainer layout (fsdp:N, tp:N, replicated:N) and publish one
// weight version per step to a directory.
//
// Determinism (docs/trainer.md). With z(seed, name, t, i) a standard-ish normal variate computed
// from a counter-based hash of (seed, tensor name, stream t, global row-major element index i):
//
//     W_0[i]     = c(name) + 0.02f * z(seed, name, 0, i)       c = 1 for *norm.weight, else 0
//     W_{k+1}[i] = W_k[i] + lr * z(seed, name, k + 1, i)
//
// evaluated in f32 in exactly this order (the module is compiled with -ffp-contract=off), with lr
// rounded to f32 once. The published bytes of version v<k> are bf16(W_k) rounded to nearest even.
// Every element depends only on (seed, lr, name, k, i), so any rank, any layout and `trainer
// export` produce bit-identical bytes for v<k>; a rank keeps an f32 master of its shards and
// advances it step by step, which is the same operation sequence as computing W_k from scratch.
//
// Thread safety: SyntheticTrainer's methods may be called from any thread; Step, Release and
// Shutdown are serialized by one mutex (a step runs its ranks on threads of its own and returns
// when all of them have published). The free functions are pure.
// Invariants: versions are published in step order, labelled v<k>; a released version is never
// published again; after Shutdown nothing stays registered with any transport.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/json.h"
#include "rolloutcore/base/status.h"
#include "rolloutcore/base/mutex.h"
#include "rolloutcore/directory/store.h"
#include "rolloutcore/refit/layouts.h"
#include "rolloutcore/refit/model_config.h"
#include "rolloutcore/refit/tensor.h"
#include "rolloutcore/trainer/fp8_parts.h"
#include "rolloutcore/trainer/publisher.h"
#include "rolloutcore/transport/transport.h"

namespace rc::trainer {

// The parameters of the formula above.
struct SyntheticWeights {
  uint64_t seed = 0;
  float lr = 1e-3f;
  // Fraction F of elements a step updates (--change-fraction). 1: every element (the formula
  // above). Below 1 a step updates element i of tensor `name` only when
  //     u(seed, name, k + 1, i) < p(name),  p(name) = min(1, F * (0.25 + 1.5 * u(seed, name)))
  // (u: uniform [0, 1) from the same counter-based hash), so some tensors change up to 7x more
  // than others, as real updates do; the bf16 bits of an updated element change unless its step
  // is under half a bf16 ulp (norm weights near 1 mostly).
  float change_fraction = 1.0f;
};

inline constexpr float kInitStd = 0.02f;

// The f32 master of W_step over `box` of tensor `spec` (row-major box contents), from scratch.
void ComputeMaster(const SyntheticWeights& w, const refit::TensorSpec& spec, const refit::Box& box, int64_t step,
                   float* out);
// Advances a master of W_step over `box` to W_{step+1} in place.
void AdvanceMaster(const SyntheticWeights& w, const refit::TensorSpec& spec, const refit::Box& box, int64_t step,
                   float* master);
// n bf16 elements (round to nearest even) of the master, written as little-endian 16-bit words.
void MasterToBf16(const float* master, int64_t n, uint16_t* out);
// bf16(W_step) over `box`, from scratch.
std::vector<uint16_t> ComputeBf16(const SyntheticWeights& w, const refit::TensorSpec& spec, const refit::Box& box,
                                  int64_t step);

// "v<k>" <-> k. InvalidArgument naming the text when it is not v followed by a decimal number.
std::string VersionLabel(int64_t step);
[[nodiscard]] Result<int64_t> ParseVersionLabel(std::string_view label);

// A transport by name from the transport registry: "local", "shm", and "ucx" when built with
// ROLLOUTCORE_WITH_UCX (NotFound listing the built-in names otherwise).
[[nodiscard]] Result<std::unique_ptr<transport::Transport>> CreateTrainerTransport(std::string_view name);

// Replay probes per version (probes.h).
struct ProbeOptions {
  int32_t count = 0;          // probes per version; 0: none
  int32_t tokens = 8;         // greedy steps per probe (1..refit::kMaxProbeSteps)
  int32_t top_k = 5;          // alternatives per step (0..refit::kMaxProbeTopK)
  int32_t prompt_tokens = 8;  // prompt length
  // "" (the published weights as they are), or an engine's --quantization (fp8_per_tensor,
  // fp8_per_channel, fp8_per_block): the probes are computed by the embedded engine serving that
  // quantization of the published weights (docs/fp8.md), for engines that serve it.
  std::string quantization = {};
};

struct SyntheticTrainerOptions {
  refit::ModelConfig config;
  refit::TrainerLayout layout;
  std::string model_name;  // the directory's model name; empty: config.name
  std::string transport = "shm";
  SyntheticWeights weights;
  int64_t first_step = 0;  // the first Step publishes v<first_step>
  int32_t fail_rank = -1;  // fault injection: this rank never publishes
  int32_t keep = 0;        // > 0: after each step release versions older than the newest `keep`
  // publisher.fp8_quantizations: every rank publishes its FP8 parts; the ranks' amaxes are merged
  // in process (Fp8ThreadExchange) unless publisher.fp8_exchange is set.
  PublisherOptions publisher;
  // Replay probes rank 0 attaches to every version (probes.h); probes.count == 0: none.
  ProbeOptions probes;
};

struct VersionStatus {
  std::string version;
  int64_t step = 0;
  std::string state;  // STAGING, COMMITTED, ABANDONED, UNAVAILABLE (as last seen), or RELEASED
  int32_t ranks_published = 0;
  uint64_t commit_seq = 0;
  uint64_t content_digest = 0;
  uint64_t bytes = 0;  // over all ranks
  int64_t shards = 0;
  double compute_ms = 0;  // slowest rank
  double publish_ms = 0;  // slowest rank: register + digest + directory
  // Delta publishing (--delta): the base version ("" when published without deltas), the encoded
  // delta payload bytes and the changed elements, over all ranks.
  std::string delta_base;
  uint64_t delta_bytes = 0;
  int64_t delta_changed = 0;
  // A rank's publish went unanswered and the directory did not tell the outcome in time: its
  // buffers stay registered (the version may be committed) until the version is released.
  bool unresolved = false;
};

// {version, step, state, committed, ranks_published, commit_seq, content_digest (hex), bytes,
// shards, compute_ms, publish_ms, unresolved, delta_base, delta_bytes, delta_changed}.
Json VersionStatusToJson(const VersionStatus& v);

class SyntheticTrainer {
 public:
  // Validates the options and prepares every rank (its transport and Publisher). Nothing is
  // published yet. `store` must outlive the trainer.
  [[nodiscard]] static Result<std::unique_ptr<SyntheticTrainer>> Create(SyntheticTrainerOptions options,
                                                                        directory::DirectoryStore* store);
  ~SyntheticTrainer();  // Shutdown(false)
  SyntheticTrainer(const SyntheticTrainer&) = delete;
  SyntheticTrainer& operator=(const SyntheticTrainer&) = delete;

  // Computes and publishes the next version on every rank. The result says whether the version
  // committed (it does not when a rank is failed on purpose). A rank's failure is returned naming
  // the rank and version; the step counter still advances, so the failed label is not reused.
  [[nodiscard]] Result<VersionStatus> Step();
  // Deregisters the version on every rank and releases it in the directory.
  [[nodiscard]] Status Release(std::string_view version);
  // Deregisters everything (and, with release_in_directory, releases every held version in the
  // directory). Idempotent; Step fails afterwards.
  Status Shutdown(bool release_in_directory);

  const std::string& model_name() const { return model_name_; }
  const SyntheticTrainerOptions& options() const { return options_; }
  std::vector<VersionStatus> versions() const;
  // {model, layout, transport, ranks, seed, lr, next_step, versions: [...]}; refreshes the state of
  // versions not yet committed from the directory.
  Json StatusJson();
  // Fault injection (tests, experiments): flips bit 0 of one byte of a rank's published buffer
  // of `version`, after it was published — readers must detect it by its content digest.
  [[nodiscard]] Status CorruptByte(std::string_view version, int32_t rank, uint64_t byte);
  // Fault injection: Publisher::CorruptDeltaForTesting on `rank` (kind value | index | missing);
  // returns the tensor corrupted.
  [[nodiscard]] Result<std::string> CorruptDelta(std::string_view version, int32_t rank, std::string_view kind);

 private:
  struct Rank;
  SyntheticTrainer(SyntheticTrainerOptions options, directory::DirectoryStore* store);
  [[nodiscard]] Status RunRank(Rank& rank, int64_t step, VersionStatus* out);
  [[nodiscard]] Status ReleaseLocked(std::string_view version) REQUIRES(mu_);

  SyntheticTrainerOptions options_;  // fixed after Create
  directory::DirectoryStore* const store_;
  // The ranks' FP8 amax exchange (publisher.fp8_quantizations without an exchange of the caller's).
  std::unique_ptr<Fp8ThreadExchange> fp8_exchange_;
  std::string model_name_;
  std::vector<std::unique_ptr<Rank>> ranks_;  // fixed after Create

  mutable rc::Mutex mu_;                // serializes Step / Release / Shutdown
  int64_t next_step_ GUARDED_BY(mu_) = 0;                // guarded by mu_
  bool shut_down_ GUARDED_BY(mu_) = false;               // guarded by mu_
  std::vector<VersionStatus> versions_ GUARDED_BY(mu_);  // guarded by mu_; in step order
};

}  // namespace rc::trainer
