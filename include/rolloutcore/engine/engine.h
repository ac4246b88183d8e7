// Engine: the embedded inference engine. Owns the model (every tensor-parallel rank's
// parameters and KV storage), the KV block pool with prefix cache, the request queues and the
// sampler; Step() runs one continuous-batching iteration.
//
// Scheduling (scheduler.h states the contract): each step asks the pure Scheduler for a plan
// over the queues and the block pool — running sequences first (one decode token each, or the
// next chunk of an unfinished prefill), then FIFO admissions while the batch has room
// (max_num_seqs, max_num_batched_tokens) and the pool has blocks, preempting the most recently
// admitted running sequence when blocks run out — then applies it (the only place a step
// mutates queues and blocks), runs the forward pass and applies its outputs.
//
// Pause (see docs/engine.md and ENGINE_API.md): kAbort finishes running and waiting requests
// with finish_reason "abort"; kWait stops admitting, lets running ones finish, and returns when
// none runs; kKeep freezes running requests (their KV kept) until Resume. Pause returns only
// after any in-flight step finished, so once it returns nothing reads parameters until Resume:
// that is when InstallWeights may write them.
//
// Thread safety: every public method may be called from any thread. Two locks: step_mu_
// serializes Step() with the operations that touch KV memory or parameters (reset, install,
// abort, pause); mu_ guards queues, flags and counters and is held only briefly (never during a
// forward pass). Lock order: step_mu_ before mu_.
// Invariant: parameters change only inside InstallWeights, only while paused, and the version
// label and install generation change in the same critical section.
//
// Identity (what a controller checks to know the engine is still the one it verified): boot_id()
// is random per Engine instance (a restarted process has another one); install_generation counts
// installs into the live weights — it moves when an install begins writing (before the first
// byte), so a failed, partial install moves it too — and is never the controller's commit
// generation. weight_version is only a label: SetWeightVersion changes it without touching a
// weight, which is why a controller checks the install generation and the digest as well.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "rolloutcore/base/content_digest.h"
#include "rolloutcore/base/json.h"
#include "rolloutcore/base/status.h"
#include "rolloutcore/base/mutex.h"
#include "rolloutcore/engine/kv_cache.h"
#include "rolloutcore/engine/model_spec.h"
#include "rolloutcore/engine/parameters.h"
#include "rolloutcore/receiver/live_weights.h"
#include "rolloutcore/refit/fp8_digest.h"
#include "rolloutcore/engine/sampler.h"
#include "rolloutcore/engine/scheduler.h"

namespace rc::engine {

class Model;
class ThreadPool;
struct WeightBinding;

struct EngineOptions {
  int tensor_parallel_size = 1;
  int64_t block_size = 16;
  int64_t num_kv_blocks = 0;   // 0: enough for max_num_seqs sequences of max_model_len, capped
  int64_t max_model_len = 0;   // 0: the model's max_position_embeddings
  int64_t max_num_seqs = 32;
  int64_t max_num_batched_tokens = 2048;
  bool enable_prefix_caching = true;
  int num_threads = 0;         // 0: hardware concurrency
  uint64_t seed = 0;           // seeds requests that do not carry their own seed
  std::string weight_version = "default";
  std::string served_model_name = "rolloutcore";
  // The dtype every parameter is kept in (parameters.h): F32 or BF16. CreateEngine (loader.h)
  // sets it from the weights (BF16 for dummy weights and bf16 checkpoints, F32 otherwise).
  DType weight_dtype = DType::kF32;
  // "" (compute with the weights as kept), or vLLM 0.33's online FP8 method: fp8_per_tensor,
  // fp8_per_channel, fp8_per_block. The projections are then served from an FP8 image of the bf16
  // weights, re-quantized at every install (docs/fp8.md, "The embedded engine"); BF16 weights only.
  std::string quantization;
};

// The FP8 image of an engine serving FP8 (docs/fp8.md): per vLLM parameter, the digest of the bytes
// and scales the kernels read (live) and the one computed from the live bf16 weights alone by
// quantizing each whole parameter (expected). live_error: why the live image has no digest (a
// replica that disagrees with the copy digested), empty otherwise.
struct Fp8ImageReport {
  std::string quantization;                       // fp8_per_tensor | fp8_per_channel | fp8_per_block
  refit::Fp8Image live;
  refit::Fp8Image expected;
  std::string live_error;
  ContentDigest live_digest;                      // combined over the parameters (model fp8-digest's "combined")
  ContentDigest expected_digest;
  double ms = 0;
  bool Match() const { return live_error.empty() && live == expected; }
  // The first parameter whose digests differ ("" when they match).
  std::string FirstMismatch() const;
  Json ToJson() const;
};

// A fault of the FP8 image, applied once after the next install quantized it (tests only: the
// negative controls of docs/fp8.md). kWrongScale: every scale doubled; kStaleScales: the scales of
// the previous version kept with the new bytes; kSwizzledScales: each row's scales re-laid out as
// another kernel lays them out (block: the scale grid transposed within each row's groups;
// per channel: rows' scales exchanged pairwise; refused per tensor, which has one scale);
// kStaleImage: the previous version's FP8 image kept whole (a quantization of the wrong version);
// kSelfConsistentWrongScale: every scale doubled, and until the next install the engine's own
// expected image is read from that live image (an engine whose quantizer and self-check share a
// bug): only an expected image from outside the engine (the trainer's, docs/fp8.md) catches it.
enum class Fp8Fault { kNone, kWrongScale, kStaleScales, kSwizzledScales, kStaleImage, kSelfConsistentWrongScale };
// none, wrong_scale, stale_scales, swizzled_scales, stale_image, self_consistent_wrong_scale
Result<Fp8Fault> Fp8FaultFromName(std::string_view name);
std::string_view Fp8FaultName(Fp8Fault fault);

enum class FinishReason { kNone, kStop, kLength, kAbort };
std::string_view FinishReasonName(FinishReason r);

// What an install does with the KV of requests that live across it (frozen by a keep pause, or
// preempted and waiting): kRecompute (the default, and what every install did before policy
// modes existed) preempts them, so they re-prefill their tokens (prompt + generated so far)
// under the new weights into fresh blocks; kKeep leaves running requests on the KV they hold
// (computed under the old weights: "stale"), which is never registered in the prefix cache again.
enum class InFlightKv { kRecompute, kKeep };
std::string_view InFlightKvName(InFlightKv kv);  // recompute | keep
Result<InFlightKv> InFlightKvFromName(std::string_view name);

// The KV state the tokens of one version span attended to (docs/lifecycle.md, "Policy modes").
enum class SpanKv { kFresh, kStale, kRecomputed };
std::string_view SpanKvName(SpanKv kv);  // fresh | stale | recomputed

// One stretch of a request's output generated under one set of live weights. Output tokens
// [from_token, to_token) (indices into the generated tokens, not the prompt) were sampled under
// the weights labelled `label` at install generation `install_generation`; `kv` says whether
// the KV they attended to was computed under those weights (fresh), under older ones (stale), or
// recomputed under them after a swap (recomputed). The engine records a boundary at the exact
// output index where the live weights changed (or the KV was recomputed), under the step lock.
struct VersionSpan {
  int64_t from_token = 0;
  int64_t to_token = 0;
  std::string label;
  int64_t install_generation = 0;
  SpanKv kv = SpanKv::kFresh;
};

struct GenerateRequest {
  std::string request_id;  // empty: the engine assigns one
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  std::string cache_salt;
};

// Output of one request, shared between the engine (writer) and a client (reader).
class RequestStream {
 public:
  struct Snapshot {
    std::vector<int32_t> tokens;
    std::vector<float> logprobs;  // empty unless logprobs were requested
    std::vector<std::vector<std::pair<int32_t, float>>> top_logprobs;
    FinishReason finish = FinishReason::kNone;
    bool finished = false;
    int64_t cached_tokens = 0;
    // The output's version spans; the last one is open (to_token = tokens.size()).
    std::vector<VersionSpan> spans;
    // Set when a pause in abort mode (not an abort by id) ended the request.
    bool aborted_by_pause = false;
    // The token of stop_token_ids that ended the request (vLLM's stop_reason); not set for an
    // end-of-sequence token or any other finish.
    std::optional<int32_t> stop_token;
  };
  // Returns once more than `seen` tokens exist or the request finished, or at the deadline.
  Snapshot WaitFrom(size_t seen, std::chrono::milliseconds timeout);
  Snapshot Wait() { return WaitFrom(SIZE_MAX, std::chrono::hours(24 * 365)); }
  const std::string& request_id() const { return request_id_; }
  const std::string& weight_version() const { return weight_version_; }
  // The engine's install generation when the request was admitted.
  int64_t install_generation() const { return install_generation_; }
  const std::vector<int32_t>& prompt() const { return prompt_; }

 private:
  friend class Engine;
  std::string request_id_;
  std::string weight_version_;
  int64_t install_generation_ = 0;
  std::vector<int32_t> prompt_;
  rc::Mutex mu_;
  rc::CondVar cv_;
  Snapshot data_ GUARDED_BY(mu_);  // guarded by mu_
};

struct EngineState {
  bool paused = false;
  int64_t num_running = 0;
  int64_t num_waiting = 0;
  int64_t blocks_in_use = 0;
  int64_t num_kv_blocks = 0;
  int64_t cached_blocks = 0;
  std::string weight_version;
  int64_t install_generation = 0;  // installs into the live weights since start (see Engine)
};

struct EngineMetrics {
  int64_t prefix_cache_queries = 0;  // prompt tokens looked up
  int64_t prefix_cache_hits = 0;     // prompt tokens served from the cache
  int64_t prompt_tokens = 0;
  int64_t generation_tokens = 0;
  int64_t num_preemptions = 0;
  int64_t cache_resets = 0;
  int64_t cache_resets_refused = 0;
  int64_t steps = 0;
  // Generated tokens by the KV state they attended to (SpanKvName), and installs by what they
  // did with in-flight requests (requests kept on stale KV, preempted to recompute).
  std::map<std::string, int64_t> generation_tokens_by_kv;
  int64_t inflight_kept = 0;
  int64_t inflight_recomputed = 0;
  std::map<std::string, int64_t> finished_by_reason;
  double kv_cache_usage = 0;
  int64_t num_running = 0;
  int64_t num_waiting = 0;
};

// A replay (Engine::Replay): one SampleResult per generated token (top_logprobs = the top_k).
struct ReplayOutput {
  std::vector<SampleResult> steps;
  double elapsed_ms = 0;  // the time this call took (precomputed: the lookup, ~0)
  // True when the steps were computed before the pause by a pre-replay on the staged image that
  // the last install swapped in (Engine::PreReplay), not now on the live parameters; then
  // computed_on is "staged_image" and staged_ms is that pre-replay's time for the whole batch of
  // probes it ran. Otherwise computed_on is "live".
  bool precomputed = false;
  std::string computed_on = "live";
  double staged_ms = 0;
};

// Pre-replay probes and reports are the receiver's (rolloutcore/receiver/live_weights.h).
using receiver::PreReplayReport;
using receiver::ReplayProbeRequest;
inline constexpr int64_t kMaxReplaySteps = 64;
// Positions one teacher-forced pre-replay forward may hold (step_mu_ is held for a forward: a
// bounded stall for the requests being served beside it).
inline constexpr int64_t kPreReplayForcedTokens = 256;
inline constexpr int64_t kMaxReplayTopK = 20;

// Fills one rank's parameters (all of them) from some source: a model folder, seeded random
// values, a refit install. Called once per rank.
using WeightFill = std::function<Status(int rank, const RankLayout& layout, ParameterStore* params)>;

// The engine is the live weights the refit receiver installs into (receiver::LiveWeights).
class Engine : public receiver::LiveWeights {
 public:
  static Result<std::unique_ptr<Engine>> Create(const ModelSpec& spec, const EngineOptions& options,
                                                const WeightFill& fill);
  ~Engine() override;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const ModelSpec& spec() const;
  const EngineOptions& options() const { return options_; }
  int64_t max_model_len() const { return max_model_len_; }

  // Validates and queues a request (InvalidArgument naming the field: prompt too long for
  // max_model_len, token ids outside the vocabulary (prompt or stop_token_ids), max_tokens < 1
  // or too large for the context, ...). AlreadyExists when a request with the same non-empty
  // request_id is still running or waiting (ids must be unique among live requests, or an
  // abort by id would hit both).
  Result<std::shared_ptr<RequestStream>> AddRequest(GenerateRequest request);
  // What AddRequest checks before it queues anything (InvalidArgument naming the field; the
  // prompt as `prompt_field`, e.g. "prompt[2]" for one prompt of several).
  Status CheckRequest(const GenerateRequest& request, std::string_view prompt_field = "prompt") const;
  // Aborts the named requests (all when empty); returns how many were live.
  int64_t Abort(const std::vector<std::string>& request_ids);

  // One continuous-batching iteration; false when there was nothing to run.
  bool Step();
  // Blocks until there may be runnable work or the timeout passes.
  void WaitForWork(std::chrono::milliseconds timeout);
  // Wakes WaitForWork callers (used to stop a loop).
  void Notify();

  Status Pause(PauseMode mode);
  // Pause plus what the installs made before the next Resume do with in-flight KV (Resume
  // restores kRecompute). Pause(mode) is Pause(mode, InFlightKv::kRecompute).
  // A Pause(kWait) that a Resume overtakes while it waits for running requests ends Aborted
  // (409 over HTTP) with the engine unpaused: the Resume wins, as on vLLM.
  Status Pause(PauseMode mode, InFlightKv kv);
  void Resume();
  // Paused: no step runs and weights may be installed (draining is not paused).
  bool IsPaused() const override;
  // vLLM's /is_paused: any state but unpaused, draining included.
  bool IsPausedOrDraining() const;

  // Drops the prefix cache. Without reset_running_requests it refuses while any block is in
  // use; with it, running requests are preempted first (they recompute after resume).
  // Except while paused with InFlightKv::kKeep: then reset_running_requests drops every hash
  // (ForgetAllHashes) and leaves the frozen requests their KV.
  KvResetEvidence ResetPrefixCache(bool reset_running_requests);

  EngineState State() const;
  // Random per engine instance, fixed for its life (16 hex digits).
  const std::string& boot_id() const { return boot_id_; }
  EngineMetrics Metrics() const;
  std::string WeightVersion() const override;
  void SetWeightVersion(const std::string& label);

  // Refit install path: requires the engine paused (FailedPrecondition otherwise, nothing
  // touched). Moves the install generation to `generation` before fill writes anything, calls
  // fill for every rank, drops the prefix cache (KV computed under old weights is never
  // reused; requests live across the install are preempted to recompute, or keep their stale KV
  // after Pause(kKeep, InFlightKv::kKeep), and each gets a version span boundary at its exact
  // output length), then sets the label. `generation` must exceed the current install generation.
  // If the cache still cannot be dropped after every running request was preempted (blocks held
  // outside any request: a broken invariant) the install fails with Internal after the weights
  // were written and the label stays unchanged, so the caller sees a failure after mutation
  // rather than a clean install. Metrics().cache_resets counts only resets observed to succeed.
  // reset_prefix_cache=false exists only for the stale-cache negative control experiment (an
  // update done outside the controller that skips the reset); every real path resets.
  // Live parameters are read-only (mprotect) outside an install: with writes = kInPlace (the
  // default) InstallWeights makes them writable for `fill` and read-only again after it, whether
  // fill succeeded or not; with kExchange fill only exchanges storage (ParameterStore::
  // ExchangeStorage, buffers it made read-only itself) and writes no live byte, and every live
  // storage is read-only again afterwards.
  using InstallWrites = receiver::InstallWrites;
  Status InstallWeights(const WeightFill& fill, const std::string& label, int64_t generation,
                        bool reset_prefix_cache = true, InstallWrites writes = InstallWrites::kInPlace);
  // Runs `write` on rank `rank`'s live parameters made writable for it (read-only again after):
  // the test-only fault routes that corrupt live memory outside an install. Holds the step lock.
  Status WriteLiveForTesting(int rank, const std::function<Status(ParameterStore*)>& write) override;
  // Bytes of the live parameters of every rank (aliased storage once), in their dtype.
  int64_t WeightBytes() const;
  DType weight_dtype() const;
  // "" or the FP8 method the engine serves with (EngineOptions::quantization).
  const std::string& quantization() const { return options_.quantization; }
  // The FP8 image's digests (Fp8ImageReport); FailedPrecondition when the engine does not serve
  // FP8. Takes the step lock (waits for a running step; the engine is paused when validating).
  Result<Fp8ImageReport> Fp8Digests();
  // Arms `fault` for the next install (tests only; FailedPrecondition without FP8 serving,
  // InvalidArgument for a swizzle of per-tensor scales).
  Status SetFp8FaultForTesting(Fp8Fault fault);
  // Replay validation (docs/lifecycle.md "Replay validation"; docs/engine.md, POST
  // /rc/validate/replay): the greedy continuation of `steps`
  // tokens after `prompt` with the top_k raw log-probabilities of every step, computed on the
  // live weights. Only while paused (FailedPrecondition otherwise, nothing run), so it runs in
  // the controller's VALIDATING window and no user request is admitted; it holds step_mu_ and
  // runs on the replay reserve: KV blocks outside the pool (one max_model_len sequence's worth,
  // allocated with the pool at Create, never granted to a request), so a replay never waits for,
  // evicts or preempts anything and never fails for lack of blocks, however full frozen (pause
  // keep) requests hold the pool (issue 36: a proven install was tainted for "0 blocks free").
  // Nothing is read from or registered in the prefix cache. InvalidArgument naming the field for a bad
  // prompt, steps (1..kMaxReplaySteps, within max_model_len) or top_k (0..kMaxReplayTopK).
  // Defined in replay.cc.
  // When a pre-replay of exactly this request (prompt, steps, top_k) is valid for the current
  // install generation (see PreReplay / AdoptPreReplay), its result is returned instead, marked
  // precomputed (computed_on "staged_image"), after the same argument and pause checks; with
  // allow_precomputed=false it is always computed now.
  Result<ReplayOutput> Replay(const std::vector<int32_t>& prompt, int64_t steps, int64_t top_k,
                              bool allow_precomputed = true);

  // Pre-replay (docs/engine.md "Pre-replay on the staged image"): runs `probes` greedily, as
  // Replay would, on `image` (a staged refit image in the live layout and dtype, WeightImage in
  // parameters.h) while the engine may be serving — not paused. Takes step_mu_ for each forward
  // step only (requests keep running between steps), so it never runs inside a Step; borrows KV
  // blocks from the pool's free list only (never evicting a cached prefix; when the free list
  // cannot spare prompt + steps positions for every probe it does not run) and returns them
  // unhashed: no cached prefix is read and nothing is registered in the prefix cache. Probes with
  // a `forced` hint are scored teacher-forced first: prompt + hint in one forward (grouped so a
  // forward holds at most kPreReplayForcedTokens positions), every step's logits at once; a probe
  // whose greedy token differs from the hint at step k keeps steps 0..k and decodes on from there.
  // Probes still decoding run as one batch per step (Forward is batch-invariant and row-invariant:
  // replay_test.cc checks forced == batched == one-by-one, bit for bit). Best effort: never fails; the report says whether it ran and why not
  // (bad probe, no blocks, `deadline` passed between steps, forward error). When it ran, its results
  // replace the cache, tagged `image_id` and not yet valid for any install generation.
  // The caller keeps every byte of `image` alive and unchanged for the call (the receiver's shadow
  // is read-only from its digest until it is swapped in).
  PreReplayReport PreReplay(const WeightImage& image, uint64_t image_id, const std::vector<ReplayProbeRequest>& probes,
                            std::chrono::steady_clock::time_point deadline) override;
  // Declares that the image tagged `image_id` became the live weights at install generation
  // `generation` (an install that exchanged storage: the live bytes are the image's bytes): the
  // cached results become valid for exactly that generation, if they were computed on that image,
  // `generation` is the current one, every live weight pointer is the image's (the storage the
  // pre-replay read is the live storage now) and they were never adopted before. Returns whether
  // they did. The caller vouches that those bytes did not change in between (the receiver's
  // shadow is read-only from its digest until swapped in). Every install and
  // WriteLiveForTesting invalidates them (InstallWeights before writing anything); a new image's
  // pre-replay replaces them; DropPreReplay forgets them.
  bool AdoptPreReplay(uint64_t image_id, int64_t generation) override;
  void DropPreReplay() override;

  // Read access to a rank's live parameters (for digests). Callers must not race InstallWeights.
  const ParameterStore& Parameters(int rank) const override;
  int tensor_parallel_size() const override { return options_.tensor_parallel_size; }

  // receiver::LiveWeights (the refit receiver's view of the live weights; loader.h's
  // RefitConfigFromSpec / RefitDType of this engine, State().install_generation, and
  // InstallWeights with a fill that ignores the rank layout).
  refit::ModelConfig RefitModelConfig() const override;
  Result<refit::DType> RefitWeightDType() const override;
  int64_t InstallGeneration() const override;
  Status InstallLive(const receiver::LiveWrite& write, const std::string& label, int64_t generation,
                     bool reset_prefix_cache, InstallWrites writes) override;

 private:
  struct Sequence;
  friend class EngineTestPeer;  // engine_test.cc: injects a broken-invariant KV state
  Engine() = default;
  void FinishLocked(Sequence* seq, FinishReason reason) REQUIRES(mu_);
  void PreemptLocked(Sequence* seq) REQUIRES(mu_);
  // The part of a preemption that is not releasing its blocks (Step's plan releases them).
  void ResetForRecomputeLocked(Sequence* seq) REQUIRES(mu_);
  // Step: the scheduler's view of the queues, the plan applied (preemptions, grants,
  // admissions; returns the sequences that compute this step), and the forward pass's outputs.
  StepPlan ScheduleLocked() const REQUIRES(mu_);
  std::vector<Sequence*> ApplyPlanLocked(const StepPlan& plan) REQUIRES(mu_);
  void ApplyOutputsLocked(const std::vector<Sequence*>& batch, const std::vector<float>& logits, bool forward_ok)
      REQUIRES(mu_);
  void PublishLocked(Sequence* seq) REQUIRES(mu_);
  // Starts a new version span for `seq` at its current output length (engine_spans.cc).
  void OpenSpanLocked(Sequence* seq, SpanKv kv) REQUIRES(mu_);
  void OpenSpanAtLocked(Sequence* seq, SpanKv kv, const std::string& label, int64_t generation) REQUIRES(mu_);
  // At an install that changed the live weights: a span boundary for every live request and
  // the prefix cache dropped, with in-flight KV kept or preempted per `kv` (engine_spans.cc).
  // Returns false when the cache could not be dropped (blocks held outside any request).
  bool SwapInFlightLocked(InFlightKv kv, const std::string& label, int64_t generation, KvResetEvidence* ev) REQUIRES(mu_);

  EngineOptions options_;
  std::string boot_id_;
  int64_t max_model_len_ = 0;
  // The replay reserve (Replay): KV block ids [replay_reserve_first_, + replay_reserve_blocks_)
  // exist in the model's KV storage but not in the pool (kv_); only Replay uses them, under
  // step_mu_. Immutable after Create.
  int32_t replay_reserve_first_ = 0;
  int32_t replay_reserve_blocks_ = 0;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<Model> model_;  // touched only under step_mu_
  Scheduler scheduler_{SchedulerConfig{}};  // immutable after Create

  // Quantizes the FP8 image after an install wrote the bf16 weights and applies the armed FP8
  // fault (engine_fp8.cc); OkStatus without FP8 serving.
  Status QuantizeAfterInstall() REQUIRES(step_mu_);

  mutable rc::Mutex step_mu_;
  mutable rc::Turnstile step_turnstile_;  // every step_mu_ holder but Step() takes it through a PriorityLock
  Fp8Fault fp8_fault_ GUARDED_BY(step_mu_) = Fp8Fault::kNone;
  bool fp8_expected_from_live_ GUARDED_BY(step_mu_) = false;  // kSelfConsistentWrongScale, until the next install
  mutable rc::Mutex mu_;
  rc::CondVar work_cv_;   // with mu_: new work or resume
  rc::CondVar drain_cv_;  // with mu_: a running request finished
  // guarded by mu_:
  std::unique_ptr<KvCacheManager> kv_ GUARDED_BY(mu_);
  std::deque<std::unique_ptr<Sequence>> waiting_ GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Sequence>> running_ GUARDED_BY(mu_);
  PauseState pause_ GUARDED_BY(mu_) = PauseState::kUnpaused;
  InFlightKv pause_kv_ GUARDED_BY(mu_) = InFlightKv::kRecompute;
  std::string weight_version_ GUARDED_BY(mu_);
  int64_t generation_ GUARDED_BY(mu_) = 0;
  int64_t next_seq_id_ GUARDED_BY(mu_) = 1;
  SamplerRng seed_rng_ GUARDED_BY(mu_){0};
  EngineMetrics metrics_ GUARDED_BY(mu_);
  bool notified_ GUARDED_BY(mu_) = false;
  // Pre-replay results (replay.cc): computed on image `image_id`, valid for Replay only while
  // live_generation (>= 0) equals generation_.
  struct PreReplayCache {
    uint64_t image_id = 0;
    int64_t live_generation = -1;
    bool adopted = false;  // AdoptPreReplay succeeded once: never again (an invalidation is final)
    double ms = 0;
    std::vector<std::pair<ReplayProbeRequest, ReplayOutput>> entries;
    std::shared_ptr<const WeightBinding> image;  // the pointers it read (compared with the live ones)
  };
  PreReplayCache prereplay_ GUARDED_BY(mu_);
  // KV blocks a pre-replay holds (outside any request, never hashed).
  int64_t prereplay_blocks_ GUARDED_BY(mu_) = 0;
  // The pre-replay's logits buffer, kept between pre-replays (up to kKeepPreReplayLogitsBytes):
  // the stage's pre-replay then maps no memory, so it never waits on the address-space lock the
  // receiver's unmapping thread holds beside it. A pre-replay takes it at its start and gives it
  // back at its end (a concurrent one starts with an empty buffer); the lock is held only for the
  // exchange (a leaf: nothing is taken under it).
  rc::Mutex prereplay_logits_mu_;
  std::vector<float> prereplay_logits_ GUARDED_BY(prereplay_logits_mu_);
  static constexpr size_t kKeepPreReplayLogitsBytes = size_t{64} << 20;
};

}  // namespace rc::engine
