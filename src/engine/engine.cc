#include "rolloutcore/engine/engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <chrono>
#include <cstdio>
#include <random>
#include <set>

#include "engine/model.h"
#include "engine/thread_pool.h"
#include "rolloutcore/base/cpu_features.h"
#include "rolloutcore/base/encoding.h"
#include "rolloutcore/base/log.h"
#include "rolloutcore/base/mutex.h"
#include "rolloutcore/engine/loader.h"
#include "rolloutcore/engine/parameters.h"

namespace rc::engine {
namespace {

// 64 random bits (the random device mixed with the clock and the pid-dependent address of a
// local, in case the device is deterministic), as 16 hex digits.
std::string NewBootId() {
  std::random_device rd;
  uint64_t x = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  int local = 0;
  x ^= static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count()) * 0x9E3779B97F4A7C15ull;
  x ^= reinterpret_cast<uintptr_t>(&local);
  return Hex64(x);
}

}  // namespace

std::string_view FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kNone: return "";
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kAbort: return "abort";
  }
  return "";
}

RequestStream::Snapshot RequestStream::WaitFrom(size_t seen, std::chrono::milliseconds timeout) {
  rc::MutexLock l(mu_);
  cv_.wait_for(l, timeout, [&]() REQUIRES(mu_) { return data_.finished || (seen != SIZE_MAX && data_.tokens.size() > seen); });
  return data_;
}

struct Engine::Sequence {
  int64_t seq_id = 0;
  std::string request_id;
  std::vector<int32_t> tokens;  // prompt followed by generated tokens
  size_t prompt_len = 0;
  SamplingParams params;
  SamplerRng rng;
  std::string cache_salt;
  std::vector<int32_t> blocks;
  std::vector<uint64_t> block_hashes;  // chained hashes of the full blocks computed so far
  int64_t num_computed = 0;            // positions with KV in `blocks`
  bool counted_prefix = false;         // prefix-cache metrics taken at first admission
  bool kv_stale = false;               // its KV was computed under older weights (kept across a swap)
  std::vector<VersionSpan> spans;      // the last one is open
  std::shared_ptr<RequestStream> stream;
  // Per-step scratch.
  int64_t step_tokens = 0;
  // Outputs not yet published to the stream.
  std::vector<int32_t> out_tokens;
  std::vector<float> out_logprobs;
  std::vector<std::vector<std::pair<int32_t, float>>> out_top;
  int64_t cached_tokens = 0;
  size_t output_len() const { return tokens.size() - prompt_len; }
};

Result<std::unique_ptr<Engine>> Engine::Create(const ModelSpec& spec, const EngineOptions& options,
                                               const WeightFill& fill) {
  RC_RETURN_IF_ERROR(spec.Validate());
  std::unique_ptr<Engine> e(new Engine());
  e->options_ = options;
  EngineOptions& o = e->options_;
  if (o.tensor_parallel_size <= 0) return InvalidArgument("tensor-parallel-size must be positive");
  if (o.block_size <= 0 || o.block_size > 1024) return InvalidArgument("block-size must be in [1, 1024]");
  if (o.max_num_seqs <= 0) return InvalidArgument("max-num-seqs must be positive");
  if (o.max_num_batched_tokens <= 0) return InvalidArgument("max-num-batched-tokens must be positive");
  // Default context: the model's, capped at kDefaultMaxModelLen so a big model does not need a
  // huge KV pool just to start (pass --max-model-len for more).
  constexpr int64_t kDefaultMaxModelLen = 4096;
  e->max_model_len_ = o.max_model_len > 0 ? o.max_model_len
                                          : std::min(spec.max_position_embeddings, kDefaultMaxModelLen);
  if (e->max_model_len_ <= 1) {
    return InvalidArgument(o.max_model_len > 0 ? "max-model-len must be at least 2"
                                               : "the model's max_position_embeddings " +
                                                     std::to_string(spec.max_position_embeddings) +
                                                     " leaves no room for a prompt and a token (at least 2)");
  }
  if (o.max_model_len > spec.max_position_embeddings) {
    // As vLLM: positions past what the model was trained on are not served by default.
    return InvalidArgument("max-model-len " + std::to_string(o.max_model_len) +
                           " exceeds the model's max_position_embeddings " +
                           std::to_string(spec.max_position_embeddings));
  }
  if (o.num_kv_blocks <= 0) {
    // Room for up to 8 full-length sequences, within a 1 GiB KV budget, never less than one.
    constexpr int64_t kKvBudgetBytes = int64_t{1} << 30;
    int64_t kv_heads_total = 0;
    for (int r = 0; r < o.tensor_parallel_size; ++r) {
      auto l = MakeRankLayout(spec, o.tensor_parallel_size, r);
      if (!l.ok()) return l.status();
      kv_heads_total += l->kv_heads;
    }
    const int64_t block_bytes = spec.num_layers * kv_heads_total * spec.head_dim * 2 * 4 * o.block_size;
    const int64_t per_seq = (e->max_model_len_ + o.block_size - 1) / o.block_size;
    o.num_kv_blocks = std::min<int64_t>(per_seq * std::min<int64_t>(o.max_num_seqs, 8), kKvBudgetBytes / block_bytes);
    o.num_kv_blocks = std::max(o.num_kv_blocks, per_seq);
  }
  if (o.num_kv_blocks * o.block_size < e->max_model_len_) {
    return InvalidArgument("num-kv-blocks * block-size (" + std::to_string(o.num_kv_blocks * o.block_size) +
                           ") cannot hold one sequence of max-model-len " + std::to_string(e->max_model_len_));
  }
  // The replay reserve (engine.h, Replay): one max_model_len sequence's blocks outside the pool.
  const int64_t replay_reserve = (e->max_model_len_ + o.block_size - 1) / o.block_size;
  // What the machine can hold: the f32 parameters (NumParameters * 4 bytes is a lower bound over
  // all ranks; replicated tensors come on top) and the KV pool must fit in physical memory, or
  // the allocation below grows until the kernel kills the process.
  {
    int64_t kv_heads_total = 0;
    for (int r = 0; r < o.tensor_parallel_size; ++r) {
      auto l = MakeRankLayout(spec, o.tensor_parallel_size, r);
      if (!l.ok()) return l.status();
      kv_heads_total += l->kv_heads;
    }
    const long double gib = 1024.0L * 1024.0L * 1024.0L;
    // FP8 serving keeps an FP8 image next to the bf16 weights: about one byte per parameter more.
    const long double params = static_cast<long double>(spec.NumParameters()) *
                               static_cast<long double>(DTypeSize(o.weight_dtype) + (o.quantization.empty() ? 0 : 1));
    const long double kv = static_cast<long double>(o.num_kv_blocks + replay_reserve) *
                           static_cast<long double>(o.block_size) *
                           static_cast<long double>(spec.num_layers * kv_heads_total * spec.head_dim) * 2.0L * 4.0L;
    const long double have = PhysicalMemoryBytes();
    if (have > 0 && params + kv > have) {
      return InvalidArgument(fmt::format(
          "model of {} parameters (num_hidden_layers {}, hidden_size {}, vocab_size {}) needs {:.1f} GiB for its {} "
          "parameters and {:.1f} GiB for the KV cache ({} blocks, and {} for replay validation); this machine has "
          "{:.1f} GiB of memory",
          spec.NumParameters(), spec.num_layers, spec.hidden_size, spec.vocab_size, static_cast<double>(params / gib),
          DTypeName(o.weight_dtype),
          static_cast<double>(kv / gib), o.num_kv_blocks, replay_reserve, static_cast<double>(have / gib)));
    }
  }
  e->pool_ = std::make_unique<ThreadPool>(o.num_threads);
  if (o.num_kv_blocks + replay_reserve > std::numeric_limits<int32_t>::max()) {
    return InvalidArgument("num-kv-blocks " + std::to_string(o.num_kv_blocks) + " is too large (block ids are 32-bit)");
  }
  e->replay_reserve_first_ = static_cast<int32_t>(o.num_kv_blocks);
  e->replay_reserve_blocks_ = static_cast<int32_t>(replay_reserve);
  std::optional<formats::Fp8Scheme> fp8;
  if (!o.quantization.empty()) {
    RC_ASSIGN_OR_RETURN(fp8, formats::Fp8SchemeFromVllmQuantization(o.quantization));
  }
  RC_ASSIGN_OR_RETURN(e->model_, Model::Create(spec, o.tensor_parallel_size, o.num_kv_blocks + replay_reserve,
                                               o.block_size, e->pool_.get(), o.weight_dtype, fp8));
  for (int r = 0; r < o.tensor_parallel_size; ++r) {
    RC_RETURN_IF_ERROR(fill(r, e->model_->layout(r), &e->model_->params(r)));
    // Live weights are read-only outside an install (InstallWeights).
    RC_RETURN_IF_ERROR(e->model_->params(r).SetReadOnly(true));
  }
  // FP8 serving: the image of the weights just loaded (Quantize binds it).
  RC_RETURN_IF_ERROR(e->model_->Quantize().WithContext("fp8 quantization of the loaded weights"));
  RC_RETURN_IF_ERROR(e->model_->Bind());
  {
    rc::MutexLock l(e->mu_);  // not shared yet: uncontended, keeps the guarded fields checked
    e->kv_ = std::make_unique<KvCacheManager>(o.num_kv_blocks, o.block_size, o.enable_prefix_caching);
    e->scheduler_ = Scheduler(SchedulerConfig{o.max_num_seqs, o.max_num_batched_tokens, o.block_size});
    e->weight_version_ = o.weight_version;
    e->seed_rng_ = SamplerRng(o.seed);
  }
  e->boot_id_ = NewBootId();
  return e;
}

Engine::~Engine() = default;

const ModelSpec& Engine::spec() const { return model_->spec(); }

const ParameterStore& Engine::Parameters(int rank) const { return model_->params(rank); }

refit::ModelConfig Engine::RefitModelConfig() const { return RefitConfigFromSpec(spec()); }

Result<refit::DType> Engine::RefitWeightDType() const { return RefitDType(weight_dtype()); }

int64_t Engine::InstallGeneration() const {
  rc::MutexLock l(mu_);
  return generation_;
}

Status Engine::InstallLive(const receiver::LiveWrite& write, const std::string& label, int64_t generation,
                           bool reset_prefix_cache, InstallWrites writes) {
  const WeightFill fill = [&write](int rank, const RankLayout&, ParameterStore* params) {
    return write(rank, params);
  };
  return InstallWeights(fill, label, generation, reset_prefix_cache, writes);
}

int64_t Engine::WeightBytes() const { return model_->WeightBytes(); }

DType Engine::weight_dtype() const { return model_->weight_dtype(); }

Status Engine::WriteLiveForTesting(int rank, const std::function<Status(ParameterStore*)>& write) {
  rc::PriorityLock sl(step_mu_, step_turnstile_);
  if (rank < 0 || rank >= options_.tensor_parallel_size) {
    return InvalidArgument("rank " + std::to_string(rank) + " is not a tensor-parallel rank");
  }
  {
    rc::MutexLock l(mu_);
    prereplay_.live_generation = -1;  // the live bytes change without an install
  }
  ParameterStore& ps = model_->params(rank);
  RC_RETURN_IF_ERROR(ps.SetReadOnly(false));
  Status st = write(&ps);
  RC_RETURN_IF_ERROR(ps.SetReadOnly(true));
  RC_RETURN_IF_ERROR(st);
  // FP8 serving computes with the quantization of the bf16 weights: a fault written into them
  // reaches the FP8 image as it would after an install.
  return model_->Quantize();
}

Status Engine::CheckRequest(const GenerateRequest& req, std::string_view prompt_field) const {
  const ModelSpec& s = model_->spec();
  if (req.prompt.empty()) return InvalidArgument(std::string(prompt_field) + ": must contain at least one token");
  for (size_t i = 0; i < req.prompt.size(); ++i) {
    if (req.prompt[i] < 0 || req.prompt[i] >= s.vocab_size) {
      return InvalidArgument(std::string(prompt_field) + "[" + std::to_string(i) + "]: token id " + std::to_string(req.prompt[i]) +
                             " is outside the vocabulary [0, " + std::to_string(s.vocab_size) + ")");
    }
  }
  const auto plen = static_cast<int64_t>(req.prompt.size());
  if (plen >= max_model_len_) {
    return InvalidArgument(std::string(prompt_field) + ": " + std::to_string(plen) + " tokens do not fit max_model_len " +
                           std::to_string(max_model_len_) + " (at least one token must be generated)");
  }
  const SamplingParams& p = req.sampling;
  if (p.max_tokens < 1) return InvalidArgument("max_tokens: must be at least 1, got " + std::to_string(p.max_tokens));
  // Compared as max_tokens > room, never as plen + max_tokens (which overflows near INT64_MAX).
  if (p.max_tokens > max_model_len_ - plen) {
    return InvalidArgument("max_tokens: prompt (" + std::to_string(plen) + " tokens) + max_tokens (" +
                           std::to_string(p.max_tokens) + ") exceeds max_model_len " + std::to_string(max_model_len_));
  }
  if (p.temperature < 0) return InvalidArgument("temperature: must be >= 0");
  if (!(p.top_p > 0 && p.top_p <= 1)) return InvalidArgument("top_p: must be in (0, 1]");
  if (p.num_logprobs > 20) return InvalidArgument("logprobs: at most 20");
  for (size_t i = 0; i < p.stop_token_ids.size(); ++i) {
    if (p.stop_token_ids[i] < 0 || p.stop_token_ids[i] >= s.vocab_size) {
      return InvalidArgument("stop_token_ids[" + std::to_string(i) + "]: token id " +
                             std::to_string(p.stop_token_ids[i]) + " is outside the vocabulary [0, " +
                             std::to_string(s.vocab_size) + ")");
    }
  }
  return OkStatus();
}

Result<std::shared_ptr<RequestStream>> Engine::AddRequest(GenerateRequest req) {
  RC_RETURN_IF_ERROR(CheckRequest(req));
  auto seq = std::make_unique<Sequence>();
  auto stream = std::make_shared<RequestStream>();
  seq->prompt_len = req.prompt.size();
  stream->prompt_ = req.prompt;
  seq->tokens = std::move(req.prompt);
  seq->params = std::move(req.sampling);
  seq->cache_salt = std::move(req.cache_salt);
  seq->stream = stream;
  {
    // The uniqueness check and the queueing are one critical section: two concurrent requests
    // with the same id cannot both get in.
    rc::MutexLock l(mu_);
    if (!req.request_id.empty()) {
      auto same = [&](const std::unique_ptr<Sequence>& q) { return q->request_id == req.request_id; };
      if (std::any_of(running_.begin(), running_.end(), same) || std::any_of(waiting_.begin(), waiting_.end(), same)) {
        return AlreadyExists("request_id: '" + req.request_id + "' is already in use by a live request");
      }
    }
    seq->seq_id = next_seq_id_++;
    seq->request_id = req.request_id.empty() ? "req-" + std::to_string(seq->seq_id) : req.request_id;
    seq->rng = SamplerRng(seq->params.seed ? *seq->params.seed : seed_rng_.Next());
    stream->weight_version_ = weight_version_;
    stream->install_generation_ = generation_;
    seq->spans.push_back(VersionSpan{0, 0, weight_version_, generation_, SpanKv::kFresh});
    stream->request_id_ = seq->request_id;
    waiting_.push_back(std::move(seq));
    notified_ = true;
  }
  work_cv_.notify_all();
  return stream;
}

void Engine::PublishLocked(Sequence* seq) {
  rc::MutexLock l(seq->stream->mu_);
  auto& d = seq->stream->data_;
  d.tokens.insert(d.tokens.end(), seq->out_tokens.begin(), seq->out_tokens.end());
  d.logprobs.insert(d.logprobs.end(), seq->out_logprobs.begin(), seq->out_logprobs.end());
  for (auto& t : seq->out_top) d.top_logprobs.push_back(std::move(t));
  d.cached_tokens = seq->cached_tokens;
  d.spans = seq->spans;
  if (!d.spans.empty()) d.spans.back().to_token = static_cast<int64_t>(seq->output_len());
  seq->out_tokens.clear();
  seq->out_logprobs.clear();
  seq->out_top.clear();
  seq->stream->cv_.notify_all();
}

void Engine::FinishLocked(Sequence* seq, FinishReason reason) {
  kv_->Release(seq->blocks);
  seq->blocks.clear();
  PublishLocked(seq);
  {
    rc::MutexLock l(seq->stream->mu_);
    seq->stream->data_.finish = reason;
    seq->stream->data_.finished = true;
  }
  seq->stream->cv_.notify_all();
  metrics_.finished_by_reason[std::string(FinishReasonName(reason))]++;
}

void Engine::PreemptLocked(Sequence* seq) {
  kv_->Release(seq->blocks);
  ResetForRecomputeLocked(seq);
}

void Engine::ResetForRecomputeLocked(Sequence* seq) {
  if (seq->kv_stale) {
    // It re-prefills under the live weights: from here on its KV is recomputed, not stale.
    seq->kv_stale = false;
    OpenSpanLocked(seq, SpanKv::kRecomputed);
  }
  seq->blocks.clear();
  seq->block_hashes.clear();
  seq->num_computed = 0;
  metrics_.num_preemptions++;
}

int64_t Engine::Abort(const std::vector<std::string>& ids) {
  rc::PriorityLock sl(step_mu_, step_turnstile_);
  rc::MutexLock l(mu_);
  const std::set<std::string> want(ids.begin(), ids.end());
  auto match = [&](const Sequence& s) { return want.empty() || want.count(s.request_id) != 0; };
  int64_t n = 0;
  for (auto it = running_.begin(); it != running_.end();) {
    if (match(**it)) {
      FinishLocked(it->get(), FinishReason::kAbort);
      it = running_.erase(it);
      ++n;
    } else {
      ++it;
    }
  }
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    if (match(**it)) {
      FinishLocked(it->get(), FinishReason::kAbort);
      it = waiting_.erase(it);
      ++n;
    } else {
      ++it;
    }
  }
  drain_cv_.notify_all();
  return n;
}

void Engine::WaitForWork(std::chrono::milliseconds timeout) {
  rc::MutexLock l(mu_);
  work_cv_.wait_for(l, timeout, [&]() REQUIRES(mu_) {
    return notified_ || HasRunnableWork(pause_, static_cast<int64_t>(running_.size()),
                                        static_cast<int64_t>(waiting_.size()));
  });
  notified_ = false;
}

void Engine::Notify() {
  {
    rc::MutexLock l(mu_);
    notified_ = true;
  }
  work_cv_.notify_all();
}

bool Engine::Step() {
  // Abort, reset, pause, install and a pre-replay's forward go first (base/mutex.h, Turnstile):
  // std::mutex would let this loop re-take step_mu_ for seconds while they wait.
  step_turnstile_.YieldToWaiters();
  rc::MutexLock sl(step_mu_);
  std::vector<Sequence*> batch;
  {
    rc::MutexLock l(mu_);
    if (pause_ == PauseState::kPaused) return false;
    // 1. Plan (pure), 2. apply the plan: the only mutation of queues and blocks before the forward.
    batch = ApplyPlanLocked(ScheduleLocked());
    if (batch.empty()) return false;
    metrics_.steps++;
  }

  // 3. Forward outside mu_ (step_mu_ keeps parameters and KV memory stable).
  std::vector<ForwardSeq> fwd;
  fwd.reserve(batch.size());
  for (Sequence* s : batch) {
    ForwardSeq f;
    f.tokens = s->tokens.data() + s->num_computed;
    f.num_tokens = s->step_tokens;
    f.start_pos = s->num_computed;
    f.block_table = &s->blocks;
    f.want_logits = s->num_computed + s->step_tokens == static_cast<int64_t>(s->tokens.size());
    fwd.push_back(f);
  }
  std::vector<float> logits;
  Status st = model_->Forward(fwd, &logits);

  // 4. Apply the outputs.
  rc::MutexLock l(mu_);
  if (!st.ok()) RC_LOG_ERROR("engine step failed: {}", st.ToString());
  ApplyOutputsLocked(batch, logits, st.ok());
  return true;
}

StepPlan Engine::ScheduleLocked() const {
  std::vector<SchedRequest> running;
  running.reserve(running_.size());
  auto view = [](const Sequence& s) {
    SchedRequest r;
    r.seq_id = s.seq_id;
    r.tokens = s.tokens;
    r.cache_salt = s.cache_salt;
    r.num_computed = s.num_computed;
    r.blocks = s.blocks;
    return r;
  };
  for (const auto& s : running_) running.push_back(view(*s));
  // No step admits more than max_num_seqs requests: the head of the queue is all it can see.
  const size_t head = std::min(waiting_.size(), static_cast<size_t>(options_.max_num_seqs));
  std::vector<SchedRequest> waiting;
  waiting.reserve(head);
  for (size_t i = 0; i < head; ++i) waiting.push_back(view(*waiting_[i]));
  return scheduler_.Schedule(pause_, running, waiting, *kv_);
}

std::vector<Engine::Sequence*> Engine::ApplyPlanLocked(const StepPlan& plan) {
  kv_->Apply(plan.kv);  // the preempted requests' releases, then every grant
  // Preempted, newest first, each to the front of the queue: they end up in running order.
  for (int64_t i = 0; i < plan.num_preempted; ++i) {
    std::unique_ptr<Sequence> victim = std::move(running_.back());
    running_.pop_back();
    ResetForRecomputeLocked(victim.get());
    waiting_.push_front(std::move(victim));
  }
  size_t g = 0;
  for (size_t i = 0; i < plan.running_tokens.size(); ++i, ++g) {
    Sequence* s = running_[i].get();
    const KvGrant& grant = plan.kv.grants[g];
    s->step_tokens = plan.running_tokens[i];
    s->blocks.insert(s->blocks.end(), grant.new_blocks.begin(), grant.new_blocks.end());
  }
  for (int64_t a = 0; a < plan.num_admitted; ++a, ++g) {
    Sequence* s = waiting_.front().get();
    const KvGrant& grant = plan.kv.grants[g];
    s->blocks = grant.hit_blocks;
    s->blocks.insert(s->blocks.end(), grant.new_blocks.begin(), grant.new_blocks.end());
    s->block_hashes = grant.hit_hashes;
    s->num_computed = static_cast<int64_t>(grant.hit_blocks.size()) * options_.block_size;
    if (!s->counted_prefix) {
      s->counted_prefix = true;
      s->cached_tokens = s->num_computed;
      metrics_.prefix_cache_queries += static_cast<int64_t>(s->prompt_len);
      metrics_.prefix_cache_hits += std::min<int64_t>(s->num_computed, static_cast<int64_t>(s->prompt_len));
      metrics_.prompt_tokens += static_cast<int64_t>(s->prompt_len);
    }
    s->step_tokens = plan.admitted_tokens[static_cast<size_t>(a)];
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
  }
  std::vector<Sequence*> batch;
  for (auto& s : running_)
    if (s->step_tokens > 0) batch.push_back(s.get());
  return batch;
}

void Engine::ApplyOutputsLocked(const std::vector<Sequence*>& batch, const std::vector<float>& logits,
                                bool forward_ok) {
  const int64_t V = model_->spec().vocab_size;
  const auto& eos = model_->spec().eos_token_ids;
  size_t row = 0;
  std::vector<Sequence*> finished;
  std::vector<FinishReason> reasons;
  for (Sequence* s : batch) {
    if (!forward_ok) {
      finished.push_back(s);
      reasons.push_back(FinishReason::kAbort);
      continue;
    }
    const bool want_logits = s->num_computed + s->step_tokens == static_cast<int64_t>(s->tokens.size());
    s->num_computed += s->step_tokens;
    s->step_tokens = 0;
    if (kv_->prefix_caching() && !s->kv_stale) {
      const int64_t bs = options_.block_size;
      const size_t first = s->block_hashes.size();
      const int64_t full = s->num_computed / bs;
      for (int64_t b = static_cast<int64_t>(first); b < full; ++b) {
        const uint64_t parent = b == 0 ? 0 : s->block_hashes[static_cast<size_t>(b - 1)];
        s->block_hashes.push_back(KvBlockHash(
            parent, std::span<const int32_t>(s->tokens.data() + b * bs, static_cast<size_t>(bs)), s->cache_salt));
      }
      kv_->RegisterFullBlocks(s->blocks, s->block_hashes, first);
    }
    if (!want_logits) continue;
    std::span<const float> row_logits(logits.data() + row * V, static_cast<size_t>(V));
    ++row;
    SampleResult r = Sample(row_logits, s->params, &s->rng);
    s->tokens.push_back(r.token);
    s->out_tokens.push_back(r.token);
    if (s->params.num_logprobs >= 0) {
      s->out_logprobs.push_back(r.logprob);
      s->out_top.push_back(std::move(r.top_logprobs));
    }
    metrics_.generation_tokens++;
    metrics_.generation_tokens_by_kv[std::string(SpanKvName(s->spans.back().kv))]++;
    FinishReason reason = FinishReason::kNone;
    const bool is_eos = std::find(eos.begin(), eos.end(), r.token) != eos.end();
    const auto& stops = s->params.stop_token_ids;
    if (is_eos && !s->params.ignore_eos) {
      reason = FinishReason::kStop;
    } else if (std::find(stops.begin(), stops.end(), r.token) != stops.end()) {
      reason = FinishReason::kStop;
      rc::MutexLock sl(s->stream->mu_);
      s->stream->data_.stop_token = r.token;
    } else if (static_cast<int64_t>(s->output_len()) >= s->params.max_tokens ||
               static_cast<int64_t>(s->tokens.size()) >= max_model_len_) {
      reason = FinishReason::kLength;
    }
    if (reason != FinishReason::kNone) {
      finished.push_back(s);
      reasons.push_back(reason);
    } else {
      PublishLocked(s);
    }
  }
  for (size_t i = 0; i < finished.size(); ++i) {
    FinishLocked(finished[i], reasons[i]);
    for (auto it = running_.begin(); it != running_.end(); ++it) {
      if (it->get() == finished[i]) {
        running_.erase(it);
        break;
      }
    }
  }
  if (!finished.empty()) drain_cv_.notify_all();
}

Status Engine::Pause(PauseMode mode) { return Pause(mode, InFlightKv::kRecompute); }

Status Engine::Pause(PauseMode mode, InFlightKv kv) {
  {
    rc::MutexLock l(mu_);
    pause_kv_ = kv;
    pause_ = PauseStateOnRequest(pause_, mode);
    if (PauseWaitsForDrain(pause_)) {
      // Draining: running requests finish, none is admitted (or another pause pauses at once).
      drain_cv_.wait(l, [&]() REQUIRES(mu_) { return running_.empty() || pause_ != PauseState::kDraining; });
      pause_ = PauseStateOnDrained(pause_);
      if (pause_ == PauseState::kUnpaused) {
        return Aborted("pause (wait): resumed before the running requests finished; the engine is not paused");
      }
    }
  }
  // Wait for an in-flight step; from here on no step runs until Resume.
  rc::PriorityLock sl(step_mu_, step_turnstile_);
  if (PauseAbortsRequests(mode)) {
    rc::MutexLock l(mu_);
    auto by_pause = [](Sequence* s) {
      rc::MutexLock sl2(s->stream->mu_);
      s->stream->data_.aborted_by_pause = true;
    };
    for (auto& s : running_) {
      by_pause(s.get());
      FinishLocked(s.get(), FinishReason::kAbort);
    }
    running_.clear();
    for (auto& s : waiting_) {
      by_pause(s.get());
      FinishLocked(s.get(), FinishReason::kAbort);
    }
    waiting_.clear();
    drain_cv_.notify_all();
  }
  return OkStatus();
}

void Engine::Resume() {
  {
    rc::MutexLock l(mu_);
    pause_ = PauseState::kUnpaused;
    pause_kv_ = InFlightKv::kRecompute;
    notified_ = true;
  }
  work_cv_.notify_all();
  drain_cv_.notify_all();  // a Pause(kWait) still draining ends (Aborted): the Resume wins
}

bool Engine::IsPaused() const {
  rc::MutexLock l(mu_);
  return pause_ == PauseState::kPaused;
}

bool Engine::IsPausedOrDraining() const {
  rc::MutexLock l(mu_);
  return pause_ != PauseState::kUnpaused;
}

KvResetEvidence Engine::ResetPrefixCache(bool reset_running_requests) {
  rc::PriorityLock sl(step_mu_, step_turnstile_);
  rc::MutexLock l(mu_);
  if (reset_running_requests && pause_ == PauseState::kPaused && pause_kv_ == InFlightKv::kKeep) {
    // Paused to keep in-flight KV across an install: the frozen requests keep their blocks, and
    // no hash survives, so nothing that exists now can be hit by a lookup.
    KvResetEvidence ev = kv_->ForgetAllHashes();
    metrics_.cache_resets++;
    return ev;
  }
  if (reset_running_requests) {
    // Preempt (not abort): they recompute from scratch, under whatever weights are live then.
    while (!running_.empty()) {
      std::unique_ptr<Sequence> s = std::move(running_.back());
      running_.pop_back();
      PreemptLocked(s.get());
      waiting_.push_front(std::move(s));
    }
  }
  KvResetEvidence ev = kv_->ResetPrefixCache(prereplay_blocks_);
  if (ev.success) {
    metrics_.cache_resets++;
  } else {
    metrics_.cache_resets_refused++;
  }
  return ev;
}

EngineState Engine::State() const {
  rc::MutexLock l(mu_);
  EngineState s;
  s.paused = pause_ == PauseState::kPaused;
  s.num_running = static_cast<int64_t>(running_.size());
  s.num_waiting = static_cast<int64_t>(waiting_.size());
  s.blocks_in_use = kv_->BlocksInUse();
  s.num_kv_blocks = kv_->num_blocks();
  s.cached_blocks = kv_->NumCachedBlocks();
  s.weight_version = weight_version_;
  s.install_generation = generation_;
  return s;
}

EngineMetrics Engine::Metrics() const {
  rc::MutexLock l(mu_);
  EngineMetrics m = metrics_;
  m.kv_cache_usage = static_cast<double>(kv_->BlocksInUse()) / static_cast<double>(kv_->num_blocks());
  m.num_running = static_cast<int64_t>(running_.size());
  m.num_waiting = static_cast<int64_t>(waiting_.size());
  return m;
}

std::string Engine::WeightVersion() const {
  rc::MutexLock l(mu_);
  return weight_version_;
}

void Engine::SetWeightVersion(const std::string& label) {
  rc::MutexLock l(mu_);
  weight_version_ = label;
}

Status Engine::InstallWeights(const WeightFill& fill, const std::string& label, int64_t generation,
                              bool reset_prefix_cache, InstallWrites writes) {
  rc::PriorityLock sl(step_mu_, step_turnstile_);
  {
    rc::MutexLock l(mu_);
    if (pause_ != PauseState::kPaused) return FailedPrecondition("weights can be installed only while the engine is paused");
    // The live weights may differ from here on, whether or not the install completes.
    // A pre-replay becomes valid again only through AdoptPreReplay, for this generation.
    prereplay_.live_generation = -1;
    generation_ = std::max(generation, generation_ + 1);
    generation = generation_;
  }
  for (int r = 0; r < options_.tensor_parallel_size; ++r) {
    ParameterStore& ps = model_->params(r);
    if (writes == InstallWrites::kInPlace) RC_RETURN_IF_ERROR(ps.SetReadOnly(false));
    Status st = fill(r, model_->layout(r), &ps);
    // Exchanged storage may have moved: re-resolve the pointers before anything else can fail.
    Status bind = model_->Bind();
    Status protect = ps.SetReadOnly(true);
    if (!st.ok()) return st.WithContext("install into rank " + std::to_string(r) + " (weights may be partial)");
    RC_RETURN_IF_ERROR(bind);
    RC_RETURN_IF_ERROR(protect);
  }
  RC_RETURN_IF_ERROR(model_->Bind());
  // FP8 serving: the image of the weights just written, before anything computes with them.
  if (Status q = QuantizeAfterInstall(); !q.ok()) {
    return q.WithContext("install of " + label + " (the bf16 weights are written; the FP8 image may be partial)");
  }
  rc::MutexLock l(mu_);
  if (!reset_prefix_cache) {
    // The stale-cache negative control only: KV computed under the old weights stays reusable.
    weight_version_ = label;
    generation_ = generation;
    return OkStatus();
  }
  // Stale KV must never be reused: drop every cached hash. Requests frozen across the install
  // either re-prefill under the new weights (recompute, the default) or keep their own KV, which
  // is never registered again (keep); each gets a version span boundary at its exact output index.
  KvResetEvidence ev;
  if (!SwapInFlightLocked(pause_kv_, label, generation, &ev)) {
    // Only possible when blocks are referenced outside any request. The weights are written, but
    // KV computed under the old ones could still be reused: fail (after mutation), keep the old
    // label, and count the refusal — never a reset that did not happen.
    metrics_.cache_resets_refused++;
    return Internal("install of " + label + ": the prefix cache could not be reset after preempting every running "
                    "request (" + std::to_string(ev.blocks_in_use) +
                    " KV blocks still in use); weights were written (the install generation moved), the label is "
                    "unchanged");
  }
  metrics_.cache_resets++;
  weight_version_ = label;
  generation_ = generation;
  return OkStatus();
}

// ---- Policy modes: in-flight requests across a weight swap (docs/lifecycle.md) ------------------

std::string_view InFlightKvName(InFlightKv kv) { return kv == InFlightKv::kKeep ? "keep" : "recompute"; }

Result<InFlightKv> InFlightKvFromName(std::string_view name) {
  if (name == "recompute") return InFlightKv::kRecompute;
  if (name == "keep") return InFlightKv::kKeep;
  return InvalidArgument("inflight_kv: expected one of keep, recompute; got '" + std::string(name) + "'");
}

std::string_view SpanKvName(SpanKv kv) {
  switch (kv) {
    case SpanKv::kFresh: return "fresh";
    case SpanKv::kStale: return "stale";
    case SpanKv::kRecomputed: return "recomputed";
  }
  return "";
}

void Engine::OpenSpanLocked(Sequence* seq, SpanKv kv) { OpenSpanAtLocked(seq, kv, weight_version_, generation_); }

void Engine::OpenSpanAtLocked(Sequence* seq, SpanKv kv, const std::string& label, int64_t generation) {
  const auto at = static_cast<int64_t>(seq->output_len());
  if (!seq->spans.empty() && seq->spans.back().from_token == at) seq->spans.pop_back();  // it held no token
  if (!seq->spans.empty()) seq->spans.back().to_token = at;
  seq->spans.push_back(VersionSpan{at, at, label, generation, kv});
}

bool Engine::SwapInFlightLocked(InFlightKv kv, const std::string& label, int64_t generation, KvResetEvidence* ev) {
  // Waiting requests hold no KV: whatever they generated so far is re-prefilled under the new
  // weights when they are admitted again.
  for (auto& s : waiting_) {
    const bool had_output = s->output_len() > 0;
    s->kv_stale = false;
    OpenSpanAtLocked(s.get(), had_output ? SpanKv::kRecomputed : SpanKv::kFresh, label, generation);
  }
  if (kv == InFlightKv::kKeep) {
    for (auto& s : running_) {
      s->kv_stale = s->num_computed > 0;
      OpenSpanAtLocked(s.get(), s->kv_stale ? SpanKv::kStale : SpanKv::kFresh, label, generation);
      if (s->kv_stale) metrics_.inflight_kept++;
    }
    // Their blocks stay theirs, but no hash survives: no new request can hit KV computed under
    // the old weights, and the kept requests never register their (stale) blocks again.
    *ev = kv_->ForgetAllHashes();
    return ev->success;
  }
  // Recompute: every running request goes back to the front of the queue, in its order, with
  // no KV; its next admission prefills prompt + generated tokens under the new weights.
  while (!running_.empty()) {
    std::unique_ptr<Sequence> s = std::move(running_.back());
    running_.pop_back();
    s->kv_stale = false;
    const bool had_kv = s->num_computed > 0 || s->output_len() > 0;
    OpenSpanAtLocked(s.get(), had_kv ? SpanKv::kRecomputed : SpanKv::kFresh, label, generation);
    PreemptLocked(s.get());
    metrics_.inflight_recomputed++;
    waiting_.push_front(std::move(s));
  }
  *ev = kv_->ResetPrefixCache(prereplay_blocks_);
  return ev->success;
}

}  // namespace rc::engine
