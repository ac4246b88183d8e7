// RefitReceiver's delta refit (receiver.h; docs/refit.md "Delta refit"): stage a version published
// as a sparse delta on the version the engine serves, install it, and prove the result in time
// proportional to what changed, with full anchor checks every full_verify_every_ delta installs.
#include <fmt/format.h>
#include <sys/resource.h>

#include <chrono>
#include <cstring>

#include "receiver/delta_apply.h"
#include "rolloutcore/base/mutex.h"
#include "rolloutcore/receiver/receiver.h"

namespace rc::receiver {
namespace {

double MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// Minor page faults of this process so far (the stage evidence reports those taken by the staging
// passes: a first write to a page of the image costs one when the kernel kept it write-protected).
int64_t MinorFaults() {
  rusage u{};
  (void)::getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

}  // namespace

void RefitReceiver::SetDeltaPolicy(DeltaPolicy policy) {
  rc::MutexLock lock(mu_);
  delta_policy_ = policy;
}

void RefitReceiver::SetFullVerifyEvery(int n) {
  rc::MutexLock lock(mu_);
  full_verify_every_ = n < 0 ? 0 : n;
}

Status RefitReceiver::CorruptLiveWeightForTesting() {
  rc::MutexLock lock(mu_);
  // Live weights are read-only outside an install: the fault route unprotects, writes, re-protects.
  return live_->WriteLiveForTesting(0, [](ParameterStore* ps) -> Status {
    const Parameter* p = ps->Find("model.norm.weight");
    if (p == nullptr || p->nbytes() == 0) return NotFound("rank 0 has no model.norm.weight to corrupt");
    p->bytes()[0] ^= std::byte{0x01};
    return OkStatus();
  });
}

AnchorCheckReport RefitReceiver::FullInstallAnchor() {
  // Called with mu_ held, after a full install's live digest matched the manifest.
  deltas_since_anchor_ = 0;
  mutated_unproven_ = false;
  AnchorCheckReport anchor;
  anchor.ran = true;
  anchor.reason = "full install: every live byte was digested";
  return anchor;
}

std::optional<Result<StageReport>> RefitReceiver::TryStageDelta(const StageRequest& req,
                                                                const refit::Manifest& manifest,
                                                                const refit::TensorDigests& published,
                                                                const StepTimings& stages_in, std::string* why_full) {
  const int64_t generation = live_->InstallGeneration();
  const std::string live_version = live_->WeightVersion();
  const bool cached = live_cache_valid_ && live_cache_generation_ == generation;
  // Cheap refusals first, without the live digest.
  *why_full = internal::DeltaIneligibility(manifest, live_version, nullptr);
  const bool only_proof_missing = why_full->find("base cannot be proven") != std::string::npos;
  if (mutated_unproven_ && internal::CarriesDelta(manifest)) {
    *why_full = "the last install failed after it began writing live weights (recovery): only a full install "
                "proves them again";
    return std::nullopt;
  }
  if (!why_full->empty() && !only_proof_missing) return std::nullopt;
  StepTimings stages = stages_in;
  std::string proof = "the digest of the live weights computed at the last install";
  if (!cached) {
    // The engine serves the base label but no digest of its live weights is known for this
    // install (loaded from disk, or a stale cache): one full digest proves (or disproves) the base.
    auto t = std::chrono::steady_clock::now();
    auto live = DigestOf(LiveBuffers());
    if (!live.ok()) return Result<StageReport>(live.status());
    live_cache_ = *live;
    live_cache_generation_ = generation;
    live_cache_valid_ = true;
    stages["base_proof"] = MsSince(t);
    proof = "a full digest of the live weights computed now";
  }
  *why_full = internal::DeltaIneligibility(manifest, live_version, &live_cache_);
  if (!why_full->empty()) return std::nullopt;

  const auto buffers = LiveBuffers();
  auto t = std::chrono::steady_clock::now();
  // Where the delta goes (docs/refit.md "Delta on the staging image"): into the staging image while
  // the old version serves, swapped in at install like a full refit; without a staging image of the
  // live layout, into the live weights inside the pause.
  const bool to_staging = StagingFitsLive();
  StagingFrom staging_from = StagingFrom::kNone;
  std::string apply_why =
      "no staging image of the live layout exists (no full stage since the engine loaded its weights): the delta "
      "is written into the live weights inside the pause";
  const int64_t faults0 = MinorFaults();
  if (to_staging) {
    Status prepared = PrepareStagingForDelta(live_version, generation, &stages, &staging_from, &apply_why);
    if (!prepared.ok()) return Result<StageReport>(prepared.WithContext("delta stage of " + req.version));
  }
  const int64_t faults1 = MinorFaults();
  internal::DeltaStageInput in;
  in.manifest = &manifest;
  in.published = &published;
  in.captures = &captures_;
  in.regions = &digest_regions_;
  // The staging image equals the live weights now (its digest was just checked): the prediction
  // reads the old values from it and writes the new ones in the same pass.
  in.live = to_staging ? &shadow_buffers_ : &buffers;
  in.apply = to_staging;
  // Test-only fault on the staging path: the first value the pass stores is wrong (a write that does
  // not land as the delta says); the read-back digest sees it and the stage is refused.
  in.corrupt_first_write = to_staging && corrupt_delta_install_.load();
  in.live_digests = &live_cache_;
  in.generation = generation;
  in.timeout_ms = req.timeout_ms;
  in.threads = threads_;
  auto staged = internal::StageDelta(in);
  if (!staged.ok()) {
    return Result<StageReport>(staged.status().WithContext("delta stage of " + req.version + " on " + live_version));
  }
  staged->base = live_version;
  staged->to_staging = to_staging;
  const int64_t faults2 = MinorFaults();
  for (const auto& [k, v] : staged->stages_ms) stages[k] = v;
  if (to_staging) {
    // From here until swapped in, the staging image cannot change: its digest stays the proof.
    auto tp = std::chrono::steady_clock::now();
    RC_RETURN_IF_ERROR(SetShadowReadOnly(true));
    stages["protect"] += MsSince(tp);  // 0 when absent
  }
  stages["total"] = MsSince(t);
  const RefitWork work = WorkOf(manifest);
  RC_ASSIGN_OR_RETURN(std::string transport_name, refit::ManifestTransport(manifest));
  DeltaStageReport delta;
  delta.delta_apply = to_staging ? DeltaApply::kStaging : DeltaApply::kLive;
  delta.staging_from = staging_from;
  delta.delta_apply_why = apply_why;
  delta.page_faults_staging_prepare = faults1 - faults0;
  delta.page_faults_delta_pass = faults2 - faults1;
  delta.delta_base = live_version;
  delta.delta_bytes_published = work.delta_bytes;
  delta.full_bytes_published = work.full_bytes;
  delta.changed_published = work.changed;
  delta.changed_digested = staged->changed;
  delta.ranks = staged->ranks;
  StageReport report;
  report.version = req.version;
  report.model = req.model;
  report.mode_reason = "the engine serves the delta's base " + live_version + ", proven by " + proof;
  report.transport = transport_name;
  report.bytes_pulled = staged->bytes_pulled;
  report.threads = threads_;
  report.digest_check = to_staging ? "staging digests updated by the changed elements (read back after the write) "
                                     "match the manifest, tensor by tensor"
                                   : "live digests updated by the changed elements match the manifest, tensor by "
                                     "tensor";
  report.content_digest = ContentDigest(manifest.content_digest);
  report.stages_ms = stages;
  report.by_mode = std::move(delta);
  {
    rc::MutexLock metrics_lock(metrics_mu_);
    last_stage_ms_ = stages;
    bytes_pulled_total_ += staged->bytes_pulled;
  }
  delta_staged_ = std::make_unique<internal::DeltaStaged>(std::move(staged).value());
  return Result<StageReport>(std::move(report));
}

Result<InstallReport> RefitReceiver::InstallDeltaLocked(const std::string& version, bool skip_cache_reset,
                                                        std::atomic<bool>* touched, const StageReport& stage,
                                                        const refit::TensorDigests& published,
                                                        const refit::Manifest& manifest) {
  internal::DeltaStaged& d = *delta_staged_;
  if (live_->InstallGeneration() != d.generation || live_->WeightVersion() != d.base) {
    return FailedPrecondition("install refused: the live weights changed since the delta of " + version +
                              " was staged on " + d.base + " (stage again); nothing was touched");
  }
  if (d.to_staging && !SwapCoversLive()) {
    return FailedPrecondition("install refused: the staging image the delta of " + version +
                              " was applied to is no longer complete and read-only (stage again); nothing was touched");
  }
  delta_chain_.reset();  // set again below once the install is proven
  StepTimings stages = stage.stages_ms;
  auto t = std::chrono::steady_clock::now();
  std::atomic<uint64_t> bytes{0};
  if (d.to_staging) {
    // Install by swap, as a full refit: the staging image holds the new version (its digest
    // checked, read-only since); no live byte is written.
    auto exchange = [this, &bytes, touched](int rank, ParameterStore* params) REQUIRES(mu_)
        -> Status {
      const auto r = static_cast<size_t>(rank);
      auto& shadow = shadow_[r];
      touched->store(true);  // the exchange below is the mutation point
      for (const auto& [name, p] : params->all()) {
        if (!p.alias_of.empty()) continue;
        RC_RETURN_IF_ERROR(params->ExchangeStorage(name, &shadow.at(name)));
        bytes += p.nbytes();
      }
      for (auto& [name, buf] : shadow) shadow_buffers_[r][name] = std::span<std::byte>(buf->data(), buf->size());
      if (rank == 0 && fail_after_first_rank_.load()) {
        return FailedPrecondition("injected fault: install failed after rank 0 swapped in its weights");
      }
      return OkStatus();
    };
    live_cache_valid_ = false;
    Status st = live_->InstallLive(exchange, version, ++generation_, !skip_cache_reset,
                                    InstallWrites::kExchange);
    if (!st.ok()) return st.WithContext("delta install of " + version);
    stages["install"] = MsSince(t);
    return FinishDeltaInstall(version, skip_cache_reset, stage, published, manifest, bytes.load(),
                              std::move(stages));
  }
  // In place (no staging image of the live layout): called by LiveWeights::InstallLive before it
  // returns, while this thread holds mu_ (see InstallLocked).
  auto fill = [this, &d, &bytes, touched](int rank, ParameterStore* params) REQUIRES(mu_) -> Status {
    const auto r = static_cast<size_t>(rank);
    // The first live byte is written below: from here on a failure is after mutation.
    touched->store(true);
    RC_RETURN_IF_ERROR(internal::ApplyDelta(d, r, captures_[r], *params, threads_));
    bytes += d.bytes_written[r];
    if (rank == 0 && corrupt_delta_install_.load() && d.first_write[0]) {
      const internal::DeltaWrite& w = *d.first_write[0];
      const Parameter* p = params->Find(captures_[0].params[w.param].name);
      auto* e = p->bytes() +
                static_cast<size_t>(w.offset) * refit::DTypeSize(captures_[0].params[w.param].dtype);
      *e ^= std::byte{0x01};  // injected fault: the write "did not land"
    }
    if (rank == 0 && fail_after_first_rank_.load()) {
      return FailedPrecondition("injected fault: install failed after rank 0 wrote its weights");
    }
    return OkStatus();
  };
  live_cache_valid_ = false;  // the live weights are about to change
  Status st = live_->InstallLive(fill, version, ++generation_, !skip_cache_reset, InstallWrites::kInPlace);
  if (!st.ok()) return st.WithContext("delta install of " + version);
  stages["install"] = MsSince(t);
  return FinishDeltaInstall(version, skip_cache_reset, stage, published, manifest, bytes.load(),
                            std::move(stages));
}

Result<InstallReport> RefitReceiver::FinishDeltaInstall(const std::string& version, bool skip_cache_reset,
                                                        const StageReport& stage,
                                                        const refit::TensorDigests& published,
                                                        const refit::Manifest& manifest, uint64_t bytes_installed,
                                                        StepTimings stages) {
  internal::DeltaStaged& d = *delta_staged_;
  auto t = std::chrono::steady_clock::now();

  const auto buffers = LiveBuffers();
  refit::TensorDigests after;
  if (d.to_staging) {
    // Swapped in: the live weights are the staging image whose digest the stage computed from the
    // values read back after each write and checked against the manifest, read-only since (the
    // argument of the full install by swap). Nothing to re-read.
    after = d.predicted;
  } else {
    // Written in place: every changed element's term recomputed from live memory, O(changed).
    RC_ASSIGN_OR_RETURN(after, internal::DigestAfterDelta(d, captures_, buffers, threads_));
  }
  stages["post_install"] = MsSince(t);
  std::string mismatch = refit::FirstDigestMismatch(after, published);
  if (!mismatch.empty()) {
    return DataLoss("live weights after the delta install of " + version +
                    " do not match the published digests: " + mismatch);
  }
  // Anchor check: a full digest of the live weights every full_verify_every_ delta installs.
  ++deltas_since_anchor_;
  AnchorCheckReport anchor;
  anchor.deltas_since_anchor = deltas_since_anchor_;
  anchor.every = full_verify_every_;
  if (full_verify_every_ > 0 && deltas_since_anchor_ >= full_verify_every_) {
    t = std::chrono::steady_clock::now();
    RC_ASSIGN_OR_RETURN(refit::TensorDigests full, DigestOf(buffers));
    const double ms = MsSince(t);
    stages["anchor_check"] = ms;
    std::string wrong = refit::FirstDigestMismatch(full, published);
    if (!wrong.empty()) {
      return DataLoss("anchor check after the delta install of " + version + " (" +
                      std::to_string(deltas_since_anchor_) + " delta installs since the last full digest): " + wrong);
    }
    anchor = AnchorCheckReport{};
    anchor.ran = true;
    anchor.reason = "every " + std::to_string(full_verify_every_) + " delta installs";
    anchor.ms = ms;
    deltas_since_anchor_ = 0;
  }
  live_cache_ = after;
  live_cache_generation_ = live_->InstallGeneration();
  live_cache_valid_ = true;
  InstallReport out;
  out.stage = stage;
  out.weight_version = version;
  out.bytes_installed = bytes_installed;
  out.install_mode = d.to_staging ? InstallMode::kSwap : InstallMode::kInPlace;
  out.cache_reset = !skip_cache_reset;
  out.live_content_digest = ContentDigest(refit::CombineTensorDigests(after));
  out.anchor_check = std::move(anchor);
  stages["ready"] = 0.0;
  out.stages_ms = std::move(stages);
  if (d.to_staging) {
    // The retired live weights (the delta's base, proven by its digests at stage) are the staging
    // image now; the next delta stage re-applies this delta to it.
    auto chain = std::make_unique<internal::DeltaChain>();
    chain->staging_version = d.base;
    chain->staging_digests = d.base_digests;
    chain->live_version = version;
    chain->live_generation = live_->InstallGeneration();
    chain->previous_manifest = manifest;
    chain->previous = std::move(d);
    delta_chain_ = std::move(chain);
  }
  delta_staged_.reset();
  return out;
}

bool RefitReceiver::StagingFitsLive(bool require_read_only) {
  if (shadow_.size() != captures_.size() || static_cast<int>(shadow_.size()) != live_->tensor_parallel_size()) {
    return false;
  }
  for (size_t r = 0; r < shadow_.size(); ++r) {
    for (const auto& [name, p] : live_->Parameters(static_cast<int>(r)).all()) {
      if (!p.alias_of.empty()) continue;
      auto it = shadow_[r].find(name);
      if (it == shadow_[r].end() || it->second->size() != p.nbytes()) return false;
      if (require_read_only && !it->second->read_only()) return false;
    }
  }
  return true;
}

Status RefitReceiver::PrepareStagingForDelta(const std::string& live_version, int64_t generation,
                                             StepTimings* stages, StagingFrom* from, std::string* why) {
  // Whatever happens below, the staging image stops being what the chain says it is.
  std::unique_ptr<internal::DeltaChain> chain = std::move(delta_chain_);
  auto t = std::chrono::steady_clock::now();
  RC_RETURN_IF_ERROR(SetShadowReadOnly(false));
  (*stages)["protect"] = MsSince(t);
  t = std::chrono::steady_clock::now();
  if (chain && chain->live_version == live_version && chain->live_generation == generation) {
    // The staging image holds the version before the live one (retired by the last delta install,
    // read-only since): re-apply that install's delta V-1 -> V, digest updated from the old and
    // new values, and check the result against V's digests (the live ones).
    internal::DeltaStaged& prev = chain->previous;
    prev.base_digests = chain->staging_digests;
    if (corrupt_previous_delta_.exchange(false)) {
      for (internal::DeltaShard& sh : prev.shards) {
        const size_t es = refit::DTypeSize(sh.dtype);
        if (sh.bodies.size() < es) continue;
        // A tile body ends with its new values: the lowest byte of the last one (a mantissa bit).
        sh.bodies[sh.bodies.size() - es] ^= std::byte{0x01};
        break;
      }
    }
    Status s = internal::PredictDelta(chain->previous_manifest, captures_, shadow_buffers_, threads_, &prev,
                                      /*apply=*/true);
    const std::string wrong = s.ok() ? refit::FirstDigestMismatch(prev.predicted, live_cache_) : s.ToString();
    (*stages)["staging_reapply"] = MsSince(t);
    if (!wrong.empty()) {
      return DataLoss(fmt::format("re-applying the previous delta {} -> {} to the staging image does not give the "
                                  "live version's digests: {}; refused at stage, nothing live was touched (the next "
                                  "stage copies the live weights into the staging image)",
                                  chain->staging_version, live_version, wrong));
    }
    *from = StagingFrom::kReapplyPreviousDelta;
    *why = fmt::format("the staging image held {} (retired by the last delta install); the delta {} -> {} was "
                       "re-applied to it ({} changed elements, digest checked against {}'s) and the new delta "
                       "applied on top while {} served; the install swaps it in",
                       chain->staging_version, chain->staging_version, live_version, prev.changed, live_version,
                       live_version);
    return OkStatus();
  }
  // No known delta leads from what the staging image holds to the live version (the last install
  // was full, or wrote a delta in place, or this is the first delta since the image was filled):
  // copy the live weights into it, digesting the stored values, and check them against the live
  // digests. O(model), while the engine serves; from the next delta on the chain re-applies.
  const auto live = LiveBuffers();
  refit::TensorDigests got;
  for (size_t r = 0; r < captures_.size(); ++r) {
    RC_ASSIGN_OR_RETURN(refit::TensorDigests d,
                        refit::CopyAndDigestInstalledParallel(captures_[r], live[r], shadow_buffers_[r],
                                                              digest_regions_[r], uncovered_[r], threads_));
    refit::AddDigests(got, d);
  }
  (*stages)["staging_copy"] = MsSince(t);
  const std::string wrong = refit::FirstDigestMismatch(got, live_cache_);
  if (!wrong.empty()) {
    return DataLoss("the live weights copied into the staging image do not give the live digests: " + wrong +
                    "; refused at stage, nothing live was touched");
  }
  *from = StagingFrom::kCopyOfLive;
  *why = chain ? fmt::format("the staging image holds {}, but the live weights are not the ones its delta led to: the "
                             "live weights were copied into it (digest checked) and the delta applied on top while "
                             "{} served; the install swaps it in",
                             chain->staging_version, live_version)
               : fmt::format("no delta is known from what the staging image holds to {} (the last install was not a "
                             "delta by swap): the live weights were copied into it (digest checked) and the delta "
                             "applied on top while {} served; the install swaps it in",
                             live_version, live_version);
  return OkStatus();
}

}  // namespace rc::receiver
