#include "rolloutcore/trainer/publisher.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <utility>

#include "rolloutcore/base/log.h"
#include "rolloutcore/base/mutex.h"
#include "rolloutcore/directory/types.h"
#include "rolloutcore/refit/digest.h"

namespace rc::trainer {
namespace {

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A failed directory call that does not say whether it took effect: the answer was lost
// (Unavailable: no connection or no answer; DeadlineExceeded) or garbled (Internal). Every other
// code is the directory's definite refusal, made before it changed anything.
bool OutcomeUnknown(const Status& s) {
  return s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kDeadlineExceeded ||
         s.code() == StatusCode::kInternal;
}

// The outcome inquiry was ended by PublisherOptions::interrupted: still unknown.
constexpr std::string_view kInterruptedPrefix = "interrupted while asking the directory";
bool Interrupted(const Status& s) {
  return s.code() == StatusCode::kAborted && std::string_view(s.message()).starts_with(kInterruptedPrefix);
}

}  // namespace

uint64_t ShardSource::bytes() const {
  return static_cast<uint64_t>(refit::NumElements(local_shape)) * refit::DTypeSize(dtype);
}

Publisher::Publisher(transport::Transport* transport, directory::DirectoryStore* store, std::string model,
                     int32_t rank, int32_t expected_ranks, PublisherOptions options)
    : transport_(transport),
      store_(store),
      model_(std::move(model)),
      rank_(rank),
      expected_ranks_(expected_ranks),
      options_(std::move(options)) {}

Publisher::~Publisher() {
  std::unique_ptr<directory::LeaseKeeper> keeper;
  {
    rc::MutexLock lock(mu_);
    for (auto& [label, entry] : versions_) {
      // Their memory is about to go: say so in the directory before the handles die.
      if (entry.state == VersionEntry::State::kPublished || entry.state == VersionEntry::State::kUnresolved) {
        (void)MarkSourcesGone(label);
      }
      DeregisterAll(entry.shards);
    }
    versions_.clear();
    keeper = std::move(keeper_);
  }
  keeper.reset();  // joins the renewal thread outside the lock
}

std::string_view Publisher::StateWord(VersionEntry::State state) {
  switch (state) {
    case VersionEntry::State::kStaged: return "staged";
    case VersionEntry::State::kPublishing: return "being published";
    case VersionEntry::State::kPublished: return "published";
    case VersionEntry::State::kUnresolved: return "published with its outcome unknown (publish again or release it)";
  }
  return "in an unknown state";
}

Status Publisher::CheckNewShard(std::string_view version, const VersionEntry& entry, const ShardSource& s) const {
  const std::string what = fmt::format("shard of tensor {} on rank {} for version {}", s.name, rank_, version);
  if (s.name.empty()) return InvalidArgument(fmt::format("shard on rank {} for version {}: empty tensor name", rank_, version));
  if (s.name.size() > directory::kMaxTensorNameLength) {
    return InvalidArgument(fmt::format("shard on rank {} for version {}: tensor name of {} characters (at most {})",
                                       rank_, version, s.name.size(), directory::kMaxTensorNameLength));
  }
  RC_RETURN_IF_ERROR(refit::ValidateShape(s.global_shape, what + ": global shape"));
  RC_RETURN_IF_ERROR(refit::ValidateShape(s.local_shape, what + ": local shape"));
  if (s.offset.size() != s.global_shape.size() || s.local_shape.size() != s.global_shape.size()) {
    return InvalidArgument(fmt::format("{}: offset has {} dims and local shape {} dims, but the tensor {} has {}", what,
                                       s.offset.size(), s.local_shape.size(), refit::ShapeToString(s.global_shape),
                                       s.global_shape.size()));
  }
  const refit::Box box{s.offset, s.local_shape};
  for (size_t d = 0; d < s.offset.size(); ++d) {
    if (s.offset[d] < 0 || s.offset[d] + s.local_shape[d] > s.global_shape[d]) {
      return InvalidArgument(fmt::format("{}: box {} lies outside the tensor's shape {}", what, refit::BoxToString(box),
                                         refit::ShapeToString(s.global_shape)));
    }
  }
  if (refit::NumElements(s.local_shape) == 0) return InvalidArgument(what + ": the box is empty");
  if (s.data == nullptr) return InvalidArgument(what + ": data is null");
  for (const StagedShard& other : entry.shards) {
    if (other.source.name != s.name) continue;
    if (other.source.dtype != s.dtype || other.source.global_shape != s.global_shape) {
      return InvalidArgument(fmt::format("{}: declared as {} {} but an earlier shard says {} {}", what,
                                         refit::DTypeName(s.dtype), refit::ShapeToString(s.global_shape),
                                         refit::DTypeName(other.source.dtype),
                                         refit::ShapeToString(other.source.global_shape)));
    }
    refit::Box overlap;
    if (refit::Intersect(box, refit::Box{other.source.offset, other.source.local_shape}, &overlap)) {
      return InvalidArgument(fmt::format("{}: box {} overlaps the earlier shard {} at {}", what, refit::BoxToString(box),
                                         refit::BoxToString(refit::Box{other.source.offset, other.source.local_shape}),
                                         refit::BoxToString(overlap)));
    }
  }
  return OkStatus();
}

Status Publisher::AddShard(std::string_view version, ShardSource shard) {
  rc::MutexLock lock(mu_);
  auto it = versions_.find(version);
  if (it != versions_.end() && it->second.state != VersionEntry::State::kStaged) {
    return FailedPrecondition(fmt::format("rank {} cannot add tensor {} to version {} of model {}: it is already {}",
                                          rank_, shard.name, version, model_, StateWord(it->second.state)));
  }
  if (it == versions_.end()) {
    // The first shard of a version: the labels the directory would refuse at publish are refused
    // now, before anything of it is staged (once per version, not per shard).
    RC_RETURN_IF_ERROR(directory::ValidateName(model_, fmt::format("rank {}: model", rank_)));
    RC_RETURN_IF_ERROR(directory::ValidateName(version, fmt::format("rank {}: version", rank_)));
  }
  static const VersionEntry kEmpty;
  RC_RETURN_IF_ERROR(CheckNewShard(version, it == versions_.end() ? kEmpty : it->second, shard));
  if (it == versions_.end()) it = versions_.emplace(std::string(version), VersionEntry{}).first;
  it->second.shards.push_back(StagedShard{std::move(shard), 0, "", 0});
  return OkStatus();
}

Status Publisher::AttachProbes(std::string_view version, std::vector<refit::Probe> probes) {
  if (rank_ != 0 && !probes.empty()) {
    return InvalidArgument(fmt::format("probes: only rank 0 attaches probes to a version; this is rank {} of version {}",
                                       rank_, version));
  }
  RC_RETURN_IF_ERROR(refit::ValidateProbes(probes));
  rc::MutexLock lock(mu_);
  auto it = versions_.find(version);
  if (it != versions_.end() && it->second.state != VersionEntry::State::kStaged) {
    return FailedPrecondition(fmt::format("rank {} cannot attach probes to version {} of model {}: it is already {}",
                                          rank_, version, model_, StateWord(it->second.state)));
  }
  if (it == versions_.end()) it = versions_.emplace(std::string(version), VersionEntry{}).first;
  it->second.probes = std::move(probes);
  return OkStatus();
}

Status Publisher::AttachFp8Parts(std::string_view version, const std::vector<Fp8ShardPart>& parts) {
  for (const Fp8ShardPart& p : parts) {
    if (!refit::IsFp8Quantization(p.quantization)) {
      return InvalidArgument(fmt::format("fp8 part of tensor {}: '{}' is not an FP8 quantization (fp8_per_tensor, "
                                         "fp8_per_channel, fp8_per_block)",
                                         p.tensor, p.quantization));
    }
    if (!refit::Fp8ParameterOf(p.tensor)) {
      return InvalidArgument(fmt::format("fp8 part of tensor {}: the tensor is served in bf16; only the projections "
                                         "(q/k/v/o/gate/up/down_proj) have FP8 parts",
                                         p.tensor));
    }
  }
  rc::MutexLock lock(mu_);
  auto it = versions_.find(version);
  if (it == versions_.end()) {
    return NotFound(fmt::format("rank {} has no shards staged for version {} of model {}", rank_, version, model_));
  }
  if (it->second.state != VersionEntry::State::kStaged) {
    return FailedPrecondition(fmt::format("rank {} cannot attach FP8 parts to version {} of model {}: it is already {}",
                                          rank_, version, model_, StateWord(it->second.state)));
  }
  std::vector<std::pair<StagedShard*, const Fp8ShardPart*>> found;
  for (const Fp8ShardPart& p : parts) {
    StagedShard* shard = nullptr;
    for (StagedShard& s : it->second.shards) {
      if (s.source.name == p.tensor && s.source.offset == p.offset) shard = &s;
    }
    if (shard == nullptr) {
      return NotFound(fmt::format("rank {} version {}: no staged shard of tensor {} at offset {}", rank_, version,
                                  p.tensor, refit::ShapeToString(p.offset)));
    }
    found.emplace_back(shard, &p);
  }
  for (auto& [shard, p] : found) shard->source.fp8[p->quantization] = p->part;
  return OkStatus();
}

Status Publisher::ComputeFp8Parts(std::string_view version, std::vector<StagedShard>& shards) {
  for (const std::string& q : options_.fp8_quantizations) {
    std::vector<Fp8ShardInput> inputs;
    std::vector<StagedShard*> of;
    for (StagedShard& s : shards) {
      const ShardSource& src = s.source;
      if (src.memory_kind != transport::MemoryKind::kHost) {
        if (refit::Fp8ParameterOf(src.name) && !src.fp8.count(q)) {
          return InvalidArgument(fmt::format("rank {} tensor {} of version {}: a shard in device memory needs its {} "
                                             "part computed by the caller (ShardSource::fp8, AttachFp8Parts); the "
                                             "Publisher reads host memory only",
                                             rank_, src.name, version, q));
        }
        continue;
      }
      inputs.push_back(Fp8ShardInput{src.name, src.dtype, src.global_shape, refit::Box{src.offset, src.local_shape},
                                     src.data});
      of.push_back(&s);
    }
    auto parts = Fp8ShardParts(inputs, q, options_.fp8_exchange, options_.fp8_threads, options_.fp8_model);
    if (!parts.ok()) {
      return parts.status().WithContext(fmt::format("rank {} computing the {} parts of version {}", rank_, q, version));
    }
    for (size_t i = 0; i < of.size(); ++i) {
      if ((*parts)[i]) of[i]->source.fp8[q] = *(*parts)[i];
    }
  }
  return OkStatus();
}

Result<PublishReport> Publisher::Publish(std::string_view version) { return PublishImpl(version, false); }
Result<PublishReport> Publisher::PublishEmpty(std::string_view version) { return PublishImpl(version, true); }

int64_t Publisher::CurrentLease() {
  // Called with mu_ held.
  if (lease_id_ != 0 && keeper_ != nullptr && keeper_->last_status().code() == StatusCode::kNotFound) {
    RC_LOG_WARN("rank {} of model {}: lease {} expired; the next publish takes a new one", rank_, model_, lease_id_);
    lease_id_ = 0;
  }
  return lease_id_;
}

void Publisher::AdoptLease(int64_t lease_id, int64_t ttl_ms) {
  // Called with mu_ held.
  if (lease_id == lease_id_ && keeper_ != nullptr) return;
  lease_id_ = lease_id;
  const int64_t interval =
      options_.keepalive_interval_ms > 0 ? options_.keepalive_interval_ms : std::max<int64_t>(ttl_ms / 3, 1);
  keeper_ = std::make_unique<directory::LeaseKeeper>(store_, lease_id, interval);
}

void Publisher::DeregisterAll(std::vector<StagedShard>& shards) {
  for (StagedShard& s : shards) {
    if (s.delta_registration_id != 0) {
      Status st = transport_->Deregister(s.delta_registration_id);
      if (!st.ok()) RC_LOG_WARN("rank {}: deregistering the delta region failed: {}", rank_, st.ToString());
      s.delta_registration_id = 0;
      s.delta_keep_alive.reset();
      s.delta.reset();
    }
    if (s.registration_id == 0) continue;
    Status st = transport_->Deregister(s.registration_id);
    if (!st.ok()) {
      RC_LOG_WARN("rank {}: deregistering tensor {} failed: {}", rank_, s.source.name, st.ToString());
    }
    s.registration_id = 0;
    s.descriptor.clear();
  }
}

Status Publisher::MarkSourcesGone(std::string_view version) {
  Status s = store_->MarkUnavailable(
      model_, version, fmt::format("rank {} of model {} released its buffers of version {}", rank_, model_, version));
  if (s.code() == StatusCode::kNotFound) return OkStatus();  // released (or never stored): nothing names the memory
  if (!s.ok()) {
    RC_LOG_WARN("rank {}: could not mark version {} of model {} unavailable before dropping its buffers: {}", rank_,
                version, model_, s.ToString());
  }
  return s;
}

bool Publisher::ManifestHoldsOurShards(const refit::Manifest& manifest,
                                       const std::vector<refit::ShardTable>& tables) const {
  auto key = [](const std::string& name, const refit::ShardInfo& s) {
    return fmt::format("{}|{}|{}|{:016x}", name, refit::BoxToString(s.box()), s.handle, s.digest);
  };
  std::vector<std::string> ours, theirs;
  for (const refit::ShardTable& t : tables) {
    for (const refit::ShardInfo& s : t.shards) ours.push_back(key(t.name, s));
  }
  for (const refit::ShardTable& t : manifest.tables) {
    for (const refit::ShardInfo& s : t.shards) {
      if (s.rank == rank_) theirs.push_back(key(t.name, s));
    }
  }
  std::sort(ours.begin(), ours.end());
  std::sort(theirs.begin(), theirs.end());
  return ours == theirs;
}

Result<directory::PublishResult> Publisher::SendPublish(directory::PublishRequest& request, bool resume) {
  if (resume) return ResolveOutcome(request, Unavailable("an earlier publish of this version was not answered"));
  Result<directory::PublishResult> published = store_->Publish(request);
  if (!published.ok() && request.lease_id != 0 && published.status().code() == StatusCode::kNotFound) {
    // The lease expired between our check and the publish: take a fresh one once.
    RC_LOG_WARN("rank {}: lease {} is gone; publishing version {} under a new lease", rank_, request.lease_id,
                request.version);
    request.lease_id = 0;
    published = store_->Publish(request);
  }
  // Answered, refused, or never sent: the outcome is known.
  if (published.ok() || directory::NotSent(published.status()) || !OutcomeUnknown(published.status())) {
    return published;
  }
  // The directory may have applied it (even committed the version) before the answer was lost:
  // the buffers stay registered until it says.
  RC_LOG_WARN("rank {}: publishing version {} of model {}: {}; asking the directory for the outcome", rank_,
              request.version, model_, published.status().ToString());
  return ResolveOutcome(request, published.status());
}

Result<directory::PublishResult> Publisher::ResolveOutcome(directory::PublishRequest& request, const Status& lost) {
  using Steady = std::chrono::steady_clock;
  const std::string what = fmt::format("version {} of model {}", request.version, model_);
  const auto deadline = Steady::now() + std::chrono::milliseconds(std::max<int64_t>(options_.outcome_timeout_ms, 0));
  int64_t pause_ms = std::max<int64_t>(options_.outcome_retry_ms, 1);
  Status last = lost;
  bool republish_refused = false;  // our re-publish got FailedPrecondition: look once more, then believe it
  auto interrupted = [&]() -> Status {
    if (!options_.interrupted || !options_.interrupted()) return OkStatus();
    return Aborted(fmt::format("{} whether the publish of {} by rank {} took effect (last answer: {}); its "
                               "buffers stay registered: publish again to ask again, or release it",
                               kInterruptedPrefix, what, rank_, last.ToString()));
  };
  for (int attempt = 0;; ++attempt) {
    if (attempt > 0) {
      if (Steady::now() + std::chrono::milliseconds(pause_ms) > deadline) break;
      // The pause in slices, so that an interruption is seen within 100 ms.
      for (const auto until = Steady::now() + std::chrono::milliseconds(pause_ms); Steady::now() < until;) {
        RC_RETURN_IF_ERROR(interrupted());
        std::this_thread::sleep_for(std::min<Steady::duration>(std::chrono::milliseconds(100), until - Steady::now()));
      }
      pause_ms = std::min<int64_t>(pause_ms * 2, 1000);
    }
    RC_RETURN_IF_ERROR(interrupted());
    auto info = store_->GetInfo(model_, request.version);
    if (!info.ok()) {
      if (OutcomeUnknown(info.status())) {
        last = info.status();
        continue;
      }
      if (info.status().code() != StatusCode::kNotFound) return info.status();
      // NotFound: the lost publish stored nothing (it created no version), or the label was
      // released meanwhile (then the re-publish below is refused).
      if (republish_refused) return last;
    } else {
      switch (info->state) {
        case directory::VersionState::kCommitted: {
          auto manifest = store_->Get(model_, request.version);
          if (!manifest.ok()) {
            if (OutcomeUnknown(manifest.status())) {
              last = manifest.status();
              continue;
            }
            return manifest.status();
          }
          if (!ManifestHoldsOurShards(*manifest, request.tables)) {
            return FailedPrecondition(fmt::format(
                "{} is COMMITTED (commit seq {}) with shards of rank {} other than the ones this publish sent", what,
                info->commit_seq, rank_));
          }
          RC_LOG_INFO("rank {}: the lost answer to publishing {} was a commit (seq {}); keeping its buffers", rank_,
                      what, info->commit_seq);
          directory::PublishResult r;
          r.state = directory::VersionState::kCommitted;
          r.ranks_published = info->expected_ranks;
          r.expected_ranks = info->expected_ranks;
          r.lease_id = request.lease_id;
          r.commit_seq = info->commit_seq;
          r.content_digest = info->content_digest;
          return r;
        }
        case directory::VersionState::kAbandoned:
        case directory::VersionState::kUnavailable:
          return FailedPrecondition(fmt::format("{} is {} ({})", what, directory::VersionStateName(info->state),
                                                info->reason));
        case directory::VersionState::kStaging:
          if (republish_refused) return last;
          break;
      }
    }
    // Not committed: send the same tables again (a STAGING version takes a rank's republish as a
    // replacement, so this is idempotent).
    auto again = store_->Publish(request);
    if (!again.ok() && request.lease_id != 0 && again.status().code() == StatusCode::kNotFound) {
      request.lease_id = 0;  // the lease ran out meanwhile: take a fresh one
      again = store_->Publish(request);
    }
    if (again.ok()) return again;
    last = again.status();
    if (OutcomeUnknown(last)) continue;
    if (last.code() != StatusCode::kFailedPrecondition) return last;
    republish_refused = true;  // e.g. committed meanwhile (by our lost publish completing it, or the last rank)
  }
  return Unavailable(fmt::format(
      "outcome unknown: the directory did not tell within {} ms whether the publish of {} by rank {} took effect "
      "(last answer: {}); its buffers stay registered: publish again to ask again, or release it",
      options_.outcome_timeout_ms, what, rank_, last.ToString()));
}

// Device shards added without a digest: all of them digested in one call (where they live), at
// Publish (PublisherOptions::device_digester).
Status Publisher::DigestDeviceShards(std::string_view version, std::vector<StagedShard>& shards,
                                     PublishReport* report) {
  if (!options_.device_digester) return OkStatus();
  std::vector<StagedShard*> pending;
  for (StagedShard& s : shards) {
    if (s.registration_id == 0 && s.source.memory_kind != transport::MemoryKind::kHost && !s.source.digest) {
      pending.push_back(&s);
    }
  }
  if (pending.empty()) return OkStatus();
  const int64_t t0 = NowNs();
  std::vector<const ShardSource*> sources;
  sources.reserve(pending.size());
  for (const StagedShard* s : pending) sources.push_back(&s->source);
  auto sums = options_.device_digester(sources);
  if (!sums.ok()) {
    return sums.status().WithContext(
        fmt::format("rank {} digesting {} device shards of version {}", rank_, pending.size(), version));
  }
  if (sums->size() != pending.size()) {
    return Internal(fmt::format("rank {} version {}: the device digester answered {} digests for {} shards", rank_,
                                version, sums->size(), pending.size()));
  }
  for (size_t i = 0; i < pending.size(); ++i) pending[i]->source.digest = (*sums)[i];
  report->digest_ns += NowNs() - t0;
  return OkStatus();
}

Result<PublishReport> Publisher::PublishImpl(std::string_view version, bool allow_create) {
  std::vector<StagedShard> shards;
  std::vector<refit::Probe> probes;
  int64_t lease = 0;
  bool resume = false;  // an earlier publish of this version was not answered
  {
    rc::MutexLock lock(mu_);
    auto it = versions_.find(version);
    if (it == versions_.end()) {
      if (!allow_create) {
        return NotFound(fmt::format("rank {} has no shards staged for version {} of model {}", rank_, version, model_));
      }
      it = versions_.emplace(std::string(version), VersionEntry{}).first;
    }
    if (it->second.state == VersionEntry::State::kUnresolved) {
      resume = true;
    } else if (it->second.state != VersionEntry::State::kStaged) {
      return FailedPrecondition(fmt::format("rank {}: version {} of model {} is already {}", rank_, version, model_,
                                            StateWord(it->second.state)));
    }
    it->second.state = VersionEntry::State::kPublishing;
    shards = std::move(it->second.shards);
    probes = it->second.probes;
    lease = CurrentLease();
  }

  PublishReport report;
  report.version = std::string(version);
  auto put_back = [&](VersionEntry::State state) {
    rc::MutexLock lock(mu_);
    auto it = versions_.find(version);
    if (it != versions_.end()) {
      it->second.state = state;
      it->second.shards = std::move(shards);
    }
  };
  // A definite refusal: nothing of ours is named by the directory; drop the registrations.
  auto fail = [&](Status s) -> Status {
    DeregisterAll(shards);
    put_back(VersionEntry::State::kStaged);
    return s;
  };

  if (!resume && !options_.fp8_quantizations.empty()) {
    const int64_t t0 = NowNs();
    Status f = ComputeFp8Parts(version, shards);
    if (!f.ok()) return fail(f);
    report.fp8_ns = NowNs() - t0;
  }
  if (Status d = DigestDeviceShards(version, shards, &report); !d.ok()) return fail(d);
  // Register and digest (shards of an unresolved version are registered already, and must keep
  // their handles). Shards of one tensor share a table; tables keep first-seen order.
  std::map<std::string, size_t, std::less<>> table_index;
  for (StagedShard& s : shards) {
    const ShardSource& src = s.source;
    if (s.registration_id == 0) {
      if (src.memory_kind != transport::MemoryKind::kHost && !src.digest.has_value()) {
        return fail(InvalidArgument(fmt::format("rank {} tensor {} of version {}: a shard in device memory needs its "
                                                "digest computed where it lives (ShardSource::digest); the Publisher "
                                                "reads host memory only",
                                                rank_, src.name, version)));
      }
      int64_t t0 = NowNs();
      transport::MemoryRegion region{src.data, src.bytes(), src.memory_kind, src.device};
      auto reg = transport_->RegisterMemory(region);
      if (!reg.ok()) {
        return fail(reg.status().WithContext(fmt::format("rank {} registering tensor {} box {} of version {} ({} bytes)",
                                                         rank_, src.name,
                                                         refit::BoxToString(refit::Box{src.offset, src.local_shape}),
                                                         version, src.bytes())));
      }
      s.registration_id = reg->id;
      s.descriptor = reg->descriptor;
      const int64_t t1 = NowNs();
      report.register_ns += t1 - t0;
      s.digest = src.memory_kind == transport::MemoryKind::kHost
                     ? refit::DigestBlock(src.dtype, src.global_shape, refit::Box{src.offset, src.local_shape}, src.data)
                     : *src.digest;
      report.digest_ns += NowNs() - t1;
    }

    auto [ti, inserted] = table_index.emplace(src.name, report.tables.size());
    if (inserted) report.tables.push_back(refit::ShardTable{src.name, src.dtype, src.global_shape, {}});
    report.tables[ti->second].shards.push_back(refit::ShardInfo{rank_, src.offset, src.local_shape, s.descriptor, s.digest});
    report.tables[ti->second].shards.back().fp8 = src.fp8;
    report.bytes += src.bytes();
    ++report.shards;
  }
  if (options_.delta) {
    Status d = AttachDeltas(version, shards, &report);
    if (!d.ok()) return fail(d);
  }

  directory::PublishRequest request;
  request.model = model_;
  request.version = std::string(version);
  request.rank = rank_;
  request.expected_ranks = expected_ranks_;
  request.lease_id = lease;
  request.lease_ttl_ms = options_.lease_ttl_ms;
  request.tables = report.tables;
  request.probes = std::move(probes);
  const int64_t t2 = NowNs();
  Result<directory::PublishResult> published = SendPublish(request, resume);
  report.publish_ns = NowNs() - t2;
  if (!published.ok()) {
    // Never sent (the connection was not made): nothing was applied, the version stays staged.
    const bool not_sent = directory::NotSent(published.status());
    Status s = published.status().WithContext(
        fmt::format("rank {} of {} publishing version {} of model {}{}", rank_, expected_ranks_, version, model_,
                    not_sent ? " (nothing was published; publish again once the directory is up)" : ""));
    if (!not_sent && (OutcomeUnknown(published.status()) || Interrupted(published.status()))) {
      put_back(VersionEntry::State::kUnresolved);
      return s;
    }
    return fail(s);
  }
  report.result = *published;

  rc::MutexLock lock(mu_);
  if (published->lease_id != 0) AdoptLease(published->lease_id, published->lease_ttl_ms);
  auto it = versions_.find(version);
  if (it == versions_.end()) {
    // Unreachable by contract (Release refuses a version being published); keep nothing dangling.
    DeregisterAll(shards);
    return Internal(fmt::format("rank {}: version {} vanished while it was being published", rank_, version));
  }
  it->second.state = VersionEntry::State::kPublished;
  it->second.shards = std::move(shards);
  if (options_.delta) RememberPublished(version, it->second.shards);
  return report;
}

Status Publisher::Release(std::string_view version, bool release_in_directory) {
  std::vector<StagedShard> shards;
  bool named = false;  // the directory may name this version's memory
  {
    rc::MutexLock lock(mu_);
    auto it = versions_.find(version);
    if (it == versions_.end()) {
      return NotFound(fmt::format("rank {} holds no version {} of model {}", rank_, version, model_));
    }
    if (it->second.state == VersionEntry::State::kPublishing) {
      return FailedPrecondition(
          fmt::format("rank {}: version {} of model {} is being published; release it afterwards", rank_, version, model_));
    }
    named = it->second.state == VersionEntry::State::kPublished || it->second.state == VersionEntry::State::kUnresolved;
    shards = std::move(it->second.shards);
    versions_.erase(it);
  }
  // Leave the directory first, so no reader discovers the version after its memory is gone: release
  // it there, or at least mark it unavailable.
  Status dir = OkStatus();
  if (release_in_directory) {
    dir = store_->Release(model_, version);
    if (dir.code() == StatusCode::kNotFound) dir = OkStatus();
  } else if (named) {
    dir = MarkSourcesGone(version);
  }
  DeregisterAll(shards);
  shards.clear();  // drops keep_alive owners
  if (!dir.ok()) return dir.WithContext(fmt::format("rank {} releasing version {} of model {}", rank_, version, model_));
  return OkStatus();
}

std::vector<std::string> Publisher::versions() const {
  rc::MutexLock lock(mu_);
  std::vector<std::string> out;
  for (const auto& [label, entry] : versions_) out.push_back(label);
  return out;
}

bool Publisher::IsPublished(std::string_view version) const {
  rc::MutexLock lock(mu_);
  auto it = versions_.find(version);
  return it != versions_.end() && it->second.state == VersionEntry::State::kPublished;
}

bool Publisher::IsUnresolved(std::string_view version) const {
  rc::MutexLock lock(mu_);
  auto it = versions_.find(version);
  return it != versions_.end() && it->second.state == VersionEntry::State::kUnresolved;
}

int64_t Publisher::lease_id() const {
  rc::MutexLock lock(mu_);
  return lease_id_;
}

}  // namespace rc::trainer
