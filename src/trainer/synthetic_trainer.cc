#include "rolloutcore/trainer/synthetic_trainer.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <map>
#include <thread>
#include <utility>

#include "rolloutcore/base/cpu_features.h"
#include "rolloutcore/base/hash.h"
#include "rolloutcore/base/log.h"
#include "rolloutcore/base/mutex.h"
#include "rolloutcore/directory/types.h"
#include "rolloutcore/refit/manifest.h"
#include "rolloutcore/trainer/probes.h"
#include "rolloutcore/transport/registry.h"
#include "rolloutcore/transport/shm.h"

namespace rc::trainer {
namespace {

constexpr uint64_t kSeedSalt = 0x7261696e65720001ULL;  // "rainer" + 1: separates our streams
constexpr uint64_t kStreamSalt = 0x53545245414d0000ULL;

// The key of stream t of tensor `name`: every element's variate is Mix64(key ^ Mix64(i)).
uint64_t StreamKey(uint64_t seed, std::string_view name, int64_t t) {
  return Mix64(Mix64(seed ^ kSeedSalt) ^ Hash64(name) ^ Mix64(static_cast<uint64_t>(t) ^ kStreamSalt));
}

// Irwin-Hall of four 16-bit uniforms, scaled to unit variance: mean 0, range +-3.46. Only
// adds and multiplies in a fixed order, so every build and every caller gets the same bits.
inline float Normalish(uint64_t key, uint64_t index) {
  const uint64_t h = Mix64(key ^ Mix64(index));
  float s = 0.0f;
  for (int j = 0; j < 4; ++j) {
    const float u = (static_cast<float>((h >> (16 * j)) & 0xFFFF) + 0.5f) * (1.0f / 65536.0f);
    s = s + u;
  }
  return (s - 2.0f) * 1.7320508f;
}

bool IsNormWeight(std::string_view name) {
  constexpr std::string_view kSuffix = "norm.weight";
  return name.size() >= kSuffix.size() && name.substr(name.size() - kSuffix.size()) == kSuffix;
}

// Calls fn(global_linear_index, local_linear_index, count) for every row (run along the last
// dim) of `box` inside a tensor of `shape`.
template <typename Fn>
void ForEachRun(const refit::Shape& shape, const refit::Box& box, Fn fn) {
  const size_t nd = shape.size();
  if (nd == 0) {
    fn(int64_t{0}, int64_t{0}, int64_t{1});
    return;
  }
  if (box.numel() == 0) return;
  const refit::Shape strides = refit::RowMajorStrides(shape);
  const int64_t run = box.extent[nd - 1];
  std::vector<int64_t> pos(nd, 0);  // position inside the box, last dim always 0
  int64_t local = 0;
  for (;;) {
    int64_t global = 0;
    for (size_t d = 0; d < nd; ++d) global += (box.start[d] + pos[d]) * strides[d];
    fn(global, local, run);
    local += run;
    if (nd == 1) return;
    size_t d = nd - 1;
    for (;;) {
      if (d == 0) return;
      --d;
      if (++pos[d] < box.extent[d]) break;
      pos[d] = 0;
    }
  }
}

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

void ComputeMaster(const SyntheticWeights& w, const refit::TensorSpec& spec, const refit::Box& box, int64_t step,
                   float* out) {
  const uint64_t key0 = StreamKey(w.seed, spec.name, 0);
  const float c = IsNormWeight(spec.name) ? 1.0f : 0.0f;
  ForEachRun(spec.shape, box, [&](int64_t g, int64_t l, int64_t n) {
    for (int64_t j = 0; j < n; ++j) {
      const float v = kInitStd * Normalish(key0, static_cast<uint64_t>(g + j));
      out[l + j] = c + v;
    }
  });
  for (int64_t k = 0; k < step; ++k) AdvanceMaster(w, spec, box, k, out);
}

void AdvanceMaster(const SyntheticWeights& w, const refit::TensorSpec& spec, const refit::Box& box, int64_t step,
                   float* master) {
  const uint64_t key = StreamKey(w.seed, spec.name, step + 1);
  const float lr = w.lr;
  if (w.change_fraction < 1.0f) {
    // Sparse steps: a tensor's rate from its name, the elements from a stream of their own.
    constexpr uint64_t kRateSalt = 0x5241544500000000ULL, kPickSalt = 0x5049434b00000000ULL;
    const double u_name = static_cast<double>(Mix64(StreamKey(w.seed, spec.name, 0) ^ kRateSalt) >> 11) * 0x1p-53;
    const double p = std::min(1.0, static_cast<double>(std::max(w.change_fraction, 0.0f)) * (0.25 + 1.5 * u_name));
    const uint64_t threshold = p >= 1.0 ? UINT64_MAX : static_cast<uint64_t>(p * 0x1p64);
    const uint64_t pick = key ^ kPickSalt;
    ForEachRun(spec.shape, box, [&](int64_t g, int64_t l, int64_t n) {
      for (int64_t j = 0; j < n; ++j) {
        if (Mix64(pick ^ Mix64(static_cast<uint64_t>(g + j))) >= threshold) continue;
        const float d = lr * Normalish(key, static_cast<uint64_t>(g + j));
        master[l + j] = master[l + j] + d;
      }
    });
    return;
  }
  ForEachRun(spec.shape, box, [&](int64_t g, int64_t l, int64_t n) {
    for (int64_t j = 0; j < n; ++j) {
      const float d = lr * Normalish(key, static_cast<uint64_t>(g + j));
      master[l + j] = master[l + j] + d;
    }
  });
}

void MasterToBf16(const float* master, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = refit::F32ToBf16Bits(master[i]);
}

std::vector<uint16_t> ComputeBf16(const SyntheticWeights& w, const refit::TensorSpec& spec, const refit::Box& box,
                                  int64_t step) {
  std::vector<float> master(static_cast<size_t>(box.numel()));
  ComputeMaster(w, spec, box, step, master.data());
  std::vector<uint16_t> out(master.size());
  MasterToBf16(master.data(), static_cast<int64_t>(master.size()), out.data());
  return out;
}

std::string VersionLabel(int64_t step) { return fmt::format("v{}", step); }

Result<int64_t> ParseVersionLabel(std::string_view label) {
  int64_t k = -1;
  if (label.size() >= 2 && label[0] == 'v') {
    const char* end = label.data() + label.size();
    auto [p, ec] = std::from_chars(label.data() + 1, end, k);
    if (ec == std::errc() && p == end && k >= 0) return k;
  }
  return InvalidArgument(fmt::format("version '{}': expected v<step>, e.g. v0 or v12", label));
}

Result<std::unique_ptr<transport::Transport>> CreateTrainerTransport(std::string_view name) {
  // The transport registry lists the backends built in (local, shm, and ucx with
  // ROLLOUTCORE_WITH_UCX); trainer memory always lives in ShmBuffers, which every one can register.
  return transport::CreateTransport(name);
}

// ---- SyntheticTrainer ---------------------------------------------------------------------------

struct SyntheticTrainer::Rank {
  struct Shard {
    refit::TensorSpec spec;
    refit::Box box;
    std::vector<float> master;
  };
  int32_t index = 0;
  std::unique_ptr<transport::Transport> transport;
  std::unique_ptr<Publisher> publisher;
  std::vector<Shard> shards;
  int64_t master_step = -1;  // the step `master` holds; -1: none yet
  // Each version's buffer by version, for fault injection (CorruptByte) only: weak, so a released
  // version's memory goes when the publisher lets go of it (a strong reference here kept every
  // version's buffer for the trainer's lifetime, whatever --keep said).
  std::map<std::string, std::weak_ptr<transport::ShmBuffer>> arenas;
};

SyntheticTrainer::SyntheticTrainer(SyntheticTrainerOptions options, directory::DirectoryStore* store)
    : options_(std::move(options)), store_(store) {}

SyntheticTrainer::~SyntheticTrainer() { (void)Shutdown(false); }

Result<std::unique_ptr<SyntheticTrainer>> SyntheticTrainer::Create(SyntheticTrainerOptions options,
                                                                   directory::DirectoryStore* store) {
  RC_RETURN_IF_ERROR(refit::ValidateModelConfig(options.config));
  if (options.model_name.empty()) options.model_name = options.config.name;
  RC_RETURN_IF_ERROR(directory::ValidateName(options.model_name, "trainer model name (--name)"));
  if (options.config.dtype != refit::DType::kBF16) {
    RC_LOG_INFO("model {} declares {}; the synthetic trainer publishes bf16", options.model_name,
                refit::DTypeName(options.config.dtype));
  }
  if (options.first_step < 0) return InvalidArgument(fmt::format("first step must be >= 0, got {}", options.first_step));
  if (options.keep < 0) return InvalidArgument(fmt::format("keep must be >= 0, got {}", options.keep));
  RC_RETURN_IF_ERROR(ValidateProbeOptions(options.probes));
  const int32_t n = options.layout.ranks;
  if (options.fail_rank >= n) {
    return InvalidArgument(fmt::format("fail rank {} is not a rank of layout {}", options.fail_rank,
                                       options.layout.ToString()));
  }
  RC_ASSIGN_OR_RETURN(refit::Manifest plan, refit::MakeTrainerManifest(options.config, options.layout));
  {
    // Each rank keeps an f32 master of its shards and publishes them in bf16: at least 6 bytes per
    // shard element (replicas count once per rank). Refused before anything is allocated when that
    // exceeds the machine's memory, instead of growing until the kernel kills the process.
    long double elements = 0;
    for (const auto& t : plan.tables) {
      for (const auto& sh : t.shards) {
        long double box = 1;
        for (int64_t d : sh.shape) box *= static_cast<long double>(d);
        elements += box;
      }
    }
    const long double need = elements * 6.0L;
    const long double have = PhysicalMemoryBytes();
    constexpr long double kGiB = 1024.0L * 1024.0L * 1024.0L;
    if (have > 0 && need > have) {
      return InvalidArgument(fmt::format(
          "model {} ({} parameters) under layout {} needs at least {:.1f} GiB (an f32 master and a bf16 copy of every "
          "shard); this machine has {:.1f} GiB",
          options.model_name, options.config.num_parameters(), options.layout.ToString(),
          static_cast<double>(need / kGiB), static_cast<double>(have / kGiB)));
    }
  }

  std::unique_ptr<SyntheticTrainer> t(new SyntheticTrainer(std::move(options), store));
  t->model_name_ = t->options_.model_name;
  {
    rc::MutexLock lock(t->mu_);  // not shared yet: uncontended, keeps next_step_ checked
    t->next_step_ = t->options_.first_step;
  }
  if (!t->options_.publisher.fp8_quantizations.empty() && !t->options_.publisher.fp8_exchange) {
    // The ranks are threads of this process: they merge their amaxes here (the rank that never
    // publishes, fail_rank, does not join).
    const int joining = n - (t->options_.fail_rank >= 0 ? 1 : 0);
    t->fp8_exchange_ = std::make_unique<Fp8ThreadExchange>(joining, t->options_.publisher.outcome_timeout_ms);
    t->options_.publisher.fp8_exchange = t->fp8_exchange_->Bind();
  }
  if (!t->options_.publisher.fp8_quantizations.empty() && t->options_.publisher.fp8_model.empty()) {
    // Every rank knows the whole model: a rank without a shard of some k_proj still places the rest.
    for (const refit::ShardTable& table : plan.tables) t->options_.publisher.fp8_model.push_back(table.spec());
  }
  for (int32_t r = 0; r < n; ++r) {
    auto rank = std::make_unique<Rank>();
    rank->index = r;
    auto tr = CreateTrainerTransport(t->options_.transport);
    if (!tr.ok()) return tr.status().WithContext(fmt::format("trainer rank {}", r));
    rank->transport = std::move(tr).value();
    rank->publisher = std::make_unique<Publisher>(rank->transport.get(), store, t->model_name_, r, n,
                                                  t->options_.publisher);
    for (const refit::ShardTable& table : plan.tables) {
      for (const refit::ShardInfo& s : table.shards) {
        if (s.rank != r) continue;
        Rank::Shard shard{refit::TensorSpec{table.name, refit::DType::kBF16, table.shape}, s.box(), {}};
        shard.master.resize(static_cast<size_t>(shard.box.numel()));
        rank->shards.push_back(std::move(shard));
      }
    }
    t->ranks_.push_back(std::move(rank));
  }
  return t;
}

Status SyntheticTrainer::RunRank(Rank& rank, int64_t step, VersionStatus* out) {
  const std::string label = VersionLabel(step);
  const int64_t t0 = NowNs();
  for (Rank::Shard& s : rank.shards) {
    if (rank.master_step >= 0 && rank.master_step == step - 1) {
      AdvanceMaster(options_.weights, s.spec, s.box, step - 1, s.master.data());
    } else if (rank.master_step != step) {
      ComputeMaster(options_.weights, s.spec, s.box, step, s.master.data());
    }
  }
  rank.master_step = step;
  if (rank.index == options_.fail_rank) {
    RC_LOG_WARN("trainer rank {}: --fail-rank: not publishing version {}", rank.index, label);
    out->compute_ms = static_cast<double>(NowNs() - t0) / 1e6;
    return OkStatus();
  }

  // One shared-memory arena per rank and version, shards 64-byte aligned inside it.
  std::vector<uint64_t> offsets;
  uint64_t total = 0;
  for (const Rank::Shard& s : rank.shards) {
    total = (total + 63) / 64 * 64;
    offsets.push_back(total);
    total += static_cast<uint64_t>(s.box.numel()) * sizeof(uint16_t);
  }
  if (total > 0) {
    auto created = transport::ShmBuffer::Create(total);
    if (!created.ok()) {
      return created.status().WithContext(
          fmt::format("trainer rank {} allocating {} bytes for version {}", rank.index, total, label));
    }
    auto arena = std::make_shared<transport::ShmBuffer>(std::move(created).value());
    std::erase_if(rank.arenas, [](const auto& kv) { return kv.second.expired(); });
    rank.arenas[label] = arena;
    for (size_t i = 0; i < rank.shards.size(); ++i) {
      const Rank::Shard& s = rank.shards[i];
      auto* dst = reinterpret_cast<uint16_t*>(arena->data() + offsets[i]);
      MasterToBf16(s.master.data(), s.box.numel(), dst);
      ShardSource src;
      src.name = s.spec.name;
      src.dtype = refit::DType::kBF16;
      src.global_shape = s.spec.shape;
      src.offset = s.box.start;
      src.local_shape = s.box.extent;
      src.data = dst;
      src.keep_alive = std::shared_ptr<const void>(arena, dst);
      Status added = rank.publisher->AddShard(label, std::move(src));
      if (!added.ok()) {
        (void)rank.publisher->Release(label);
        return added;
      }
    }
  }
  if (rank.index == 0 && options_.probes.count > 0) {
    auto probes = ComputeSyntheticProbes(options_.config, options_.weights, step, options_.probes);
    Status attached = probes.ok() ? rank.publisher->AttachProbes(label, std::move(*probes)) : probes.status();
    if (!attached.ok()) {
      (void)rank.publisher->Release(label);
      return attached.WithContext(fmt::format("trainer rank 0 computing the probes of version {}", label));
    }
  }
  const int64_t t1 = NowNs();
  out->compute_ms = static_cast<double>(t1 - t0) / 1e6;
  auto report = total > 0 ? rank.publisher->Publish(label) : rank.publisher->PublishEmpty(label);
  out->publish_ms = static_cast<double>(NowNs() - t1) / 1e6;
  if (!report.ok()) {
    if (rank.publisher->IsUnresolved(label)) {
      // The directory may have committed these buffers before its answer was lost: keep them (the
      // version is tracked, so Release / --keep / Shutdown drop them later).
      out->unresolved = true;
      return report.status();
    }
    (void)rank.publisher->Release(label);  // drop the staged shards; the label is not reused
    return report.status();
  }
  out->bytes = report->bytes;
  out->shards = report->shards;
  out->delta_base = report->delta_base;
  out->delta_bytes = report->delta_bytes;
  out->delta_changed = report->delta_changed;
  out->ranks_published = report->result.ranks_published;
  out->state = std::string(directory::VersionStateName(report->result.state));
  out->commit_seq = report->result.commit_seq;
  out->content_digest = report->result.content_digest;
  return OkStatus();
}

Status SyntheticTrainer::CorruptByte(std::string_view version, int32_t rank, uint64_t byte) {
  rc::MutexLock lock(mu_);
  if (rank < 0 || static_cast<size_t>(rank) >= ranks_.size()) {
    return InvalidArgument(fmt::format("rank {} is not a rank of this trainer (0..{})", rank, ranks_.size() - 1));
  }
  auto& arenas = ranks_[static_cast<size_t>(rank)]->arenas;
  auto it = arenas.find(std::string(version));
  const std::shared_ptr<transport::ShmBuffer> buf = it == arenas.end() ? nullptr : it->second.lock();
  if (buf == nullptr) {
    return NotFound(fmt::format("rank {} holds no buffer of version {} (never published by it, or released)", rank,
                                version));
  }
  if (byte >= buf->size()) {
    return InvalidArgument(fmt::format("byte {} is past the {} bytes of rank {}'s buffer", byte, buf->size(), rank));
  }
  buf->data()[byte] = static_cast<std::byte>(static_cast<uint8_t>(buf->data()[byte]) ^ 0x01);
  RC_LOG_WARN("fault injection: flipped bit 0 of byte {} of rank {}'s buffer of {}", byte, rank, version);
  return OkStatus();
}

Result<std::string> SyntheticTrainer::CorruptDelta(std::string_view version, int32_t rank, std::string_view kind) {
  rc::MutexLock lock(mu_);
  if (rank < 0 || static_cast<size_t>(rank) >= ranks_.size() || ranks_[static_cast<size_t>(rank)]->publisher == nullptr) {
    return InvalidArgument(fmt::format("rank {} is not a live rank of this trainer", rank));
  }
  return ranks_[static_cast<size_t>(rank)]->publisher->CorruptDeltaForTesting(version, kind);
}

Result<VersionStatus> SyntheticTrainer::Step() {
  rc::MutexLock lock(mu_);
  if (shut_down_) return FailedPrecondition(fmt::format("trainer of model {} is shut down", model_name_));
  const int64_t step = next_step_++;
  const std::string label = VersionLabel(step);
  std::vector<VersionStatus> per_rank(ranks_.size());
  std::vector<Status> statuses(ranks_.size());
  {
    std::vector<std::thread> threads;
    for (size_t r = 0; r < ranks_.size(); ++r) {
      threads.emplace_back([&, r] { statuses[r] = RunRank(*ranks_[r], step, &per_rank[r]); });
    }
    for (std::thread& th : threads) th.join();
  }
  VersionStatus v;
  v.version = label;
  v.step = step;
  v.state = "STAGING";
  Status first_error = OkStatus();
  bool any_published = false;
  for (size_t r = 0; r < ranks_.size(); ++r) {
    any_published = any_published || (statuses[r].ok() && per_rank[r].ranks_published > 0) || per_rank[r].unresolved;
    const VersionStatus& p = per_rank[r];
    v.bytes += p.bytes;
    v.shards += p.shards;
    v.delta_bytes += p.delta_bytes;
    v.delta_changed += p.delta_changed;
    if (!p.delta_base.empty()) v.delta_base = p.delta_base;
    v.compute_ms = std::max(v.compute_ms, p.compute_ms);
    v.publish_ms = std::max(v.publish_ms, p.publish_ms);
    v.unresolved = v.unresolved || p.unresolved;
    v.ranks_published = std::max(v.ranks_published, p.ranks_published);
    if (p.state == "COMMITTED") {
      v.state = p.state;
      v.commit_seq = p.commit_seq;
      v.content_digest = p.content_digest;
    }
    if (!statuses[r].ok() && first_error.ok()) first_error = statuses[r];
  }
  // Only a version one of our ranks published is ours to track and release: when every rank was
  // refused (say the label belongs to a trainer that died) the directory's version is left alone.
  if (any_published) versions_.push_back(v);
  if (!first_error.ok()) return first_error;

  if (options_.keep > 0) {
    std::vector<std::string> live;
    for (const VersionStatus& s : versions_) {
      if (s.state != "RELEASED") live.push_back(s.version);
    }
    for (size_t i = 0; i + static_cast<size_t>(options_.keep) < live.size(); ++i) {
      Status s = ReleaseLocked(live[i]);
      if (!s.ok()) RC_LOG_WARN("trainer: --keep {}: releasing {} failed: {}", options_.keep, live[i], s.ToString());
    }
  }
  return v;
}

Status SyntheticTrainer::ReleaseLocked(std::string_view version) {
  auto it = std::find_if(versions_.begin(), versions_.end(), [&](const VersionStatus& s) { return s.version == version; });
  if (it == versions_.end() || it->state == "RELEASED") {
    return NotFound(fmt::format("trainer of model {} holds no version {}", model_name_, version));
  }
  // The directory first, so no reader discovers the version after its memory is gone.
  Status dir = store_->Release(model_name_, version);
  if (dir.code() == StatusCode::kNotFound) dir = OkStatus();
  for (auto& rank : ranks_) {
    if (rank->publisher == nullptr) continue;
    Status s = rank->publisher->Release(version, false);
    if (!s.ok() && s.code() != StatusCode::kNotFound && dir.ok()) dir = s;
  }
  it->state = "RELEASED";
  if (!dir.ok()) return dir.WithContext(fmt::format("releasing version {} of model {}", version, model_name_));
  return OkStatus();
}

Status SyntheticTrainer::Release(std::string_view version) {
  rc::MutexLock lock(mu_);
  return ReleaseLocked(version);
}

Status SyntheticTrainer::Shutdown(bool release_in_directory) {
  rc::MutexLock lock(mu_);
  if (shut_down_) return OkStatus();
  shut_down_ = true;
  Status first = OkStatus();
  for (VersionStatus& v : versions_) {
    if (v.state == "RELEASED") continue;
    if (release_in_directory) {
      Status s = ReleaseLocked(v.version);
      if (!s.ok() && first.ok()) first = s;
    }
  }
  // Destroying a Publisher deregisters what it still holds and stops its lease renewal.
  for (auto& rank : ranks_) rank->publisher.reset();
  return first;
}

std::vector<VersionStatus> SyntheticTrainer::versions() const {
  rc::MutexLock lock(mu_);
  return versions_;
}

Json VersionStatusToJson(const VersionStatus& v) {
  return Json{{"version", v.version},
              {"step", v.step},
              {"state", v.state},
              {"committed", v.state == "COMMITTED"},
              {"ranks_published", v.ranks_published},
              {"commit_seq", v.commit_seq},
              {"content_digest", Hex64(v.content_digest)},
              {"bytes", v.bytes},
              {"shards", v.shards},
              {"compute_ms", v.compute_ms},
              {"publish_ms", v.publish_ms},
              {"unresolved", v.unresolved},
              {"delta_base", v.delta_base},
              {"delta_bytes", v.delta_bytes},
              {"delta_changed", v.delta_changed}};
}

Json SyntheticTrainer::StatusJson() {
  rc::MutexLock lock(mu_);
  Json versions = Json::array();
  for (VersionStatus& v : versions_) {
    if (v.state == "STAGING") {
      auto info = store_->GetInfo(model_name_, v.version);
      if (info.ok()) {
        v.state = std::string(directory::VersionStateName(info->state));
        v.ranks_published = static_cast<int32_t>(info->published_ranks.size());
        v.commit_seq = info->commit_seq;
        v.content_digest = info->content_digest;
      }
    }
    versions.push_back(VersionStatusToJson(v));
  }
  return Json{{"model", model_name_},
              {"model_spec", options_.config.name},
              {"layout", options_.layout.ToString()},
              {"transport", options_.transport},
              {"ranks", options_.layout.ranks},
              {"seed", options_.weights.seed},
              {"lr", options_.weights.lr},
              {"fail_rank", options_.fail_rank},
              {"keep", options_.keep},
              {"next_step", next_step_},
              {"shut_down", shut_down_},
              {"versions", std::move(versions)}};
}

}  // namespace rc::trainer
