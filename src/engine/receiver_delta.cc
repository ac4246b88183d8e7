// RefitReceiver's delta refit (receiver.h; docs/refit.md "Delta refit"): stage a version published
// as a sparse delta on the version the engine serves, install it, and prove the result in time
// proportional to what changed, with full anchor checks every full_verify_every_ delta installs.
#include <chrono>
#include <cstring>

#include "engine/delta_apply.h"
#include "rolloutcore/base/hash.h"
#include "rolloutcore/base/mutex.h"
#include "rolloutcore/engine/receiver.h"

namespace rc::engine {
namespace {

double MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

void RefitReceiver::SetFullVerifyEvery(int n) {
  rc::MutexLock lock(mu_);
  full_verify_every_ = n < 0 ? 0 : n;
}

Status RefitReceiver::CorruptLiveWeightForTesting() {
  rc::MutexLock lock(mu_);
  // Live weights are read-only outside an install: the fault route unprotects, writes, re-protects.
  return engine_->WriteLiveForTesting(0, [](ParameterStore* ps) -> Status {
    const Parameter* p = ps->Find("model.norm.weight");
    if (p == nullptr || p->nbytes() == 0) return NotFound("rank 0 has no model.norm.weight to corrupt");
    p->bytes()[0] ^= std::byte{0x01};
    return OkStatus();
  });
}

Json RefitReceiver::FullInstallAnchor() {
  // Called with mu_ held, after a full install's live digest matched the manifest.
  deltas_since_anchor_ = 0;
  mutated_unproven_ = false;
  return Json{{"ran", true}, {"ok", true}, {"reason", "full install: every live byte was digested"}};
}

std::optional<Result<Json>> RefitReceiver::TryStageDelta(const StageRequest& req, const refit::Manifest& manifest,
                                                         const refit::TensorDigests& published, const Json& stages_in,
                                                         std::string* why_full) {
  const int64_t generation = engine_->State().install_generation;
  const std::string live_version = engine_->WeightVersion();
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
  Json stages = stages_in;
  std::string proof = "the digest of the live weights computed at the last install";
  if (!cached) {
    // The engine serves the base label but no digest of its live weights is known for this
    // install (loaded from disk, or a stale cache): one full digest proves (or disproves) the base.
    auto t = std::chrono::steady_clock::now();
    auto live = DigestOf(LiveBuffers());
    if (!live.ok()) return Result<Json>(live.status());
    live_cache_ = *live;
    live_cache_generation_ = generation;
    live_cache_valid_ = true;
    stages["base_proof"] = MsSince(t);
    proof = "a full digest of the live weights computed now";
  }
  *why_full = internal::DeltaIneligibility(manifest, live_version, &live_cache_);
  if (!why_full->empty()) return std::nullopt;

  const auto buffers = LiveBuffers();
  internal::DeltaStageInput in;
  in.manifest = &manifest;
  in.published = &published;
  in.captures = &captures_;
  in.regions = &digest_regions_;
  in.live = &buffers;
  in.live_digests = &live_cache_;
  in.generation = generation;
  in.timeout_ms = req.timeout_ms;
  in.threads = threads_;
  auto t = std::chrono::steady_clock::now();
  auto staged = internal::StageDelta(in);
  if (!staged.ok()) {
    return Result<Json>(staged.status().WithContext("delta stage of " + req.version + " on " + live_version));
  }
  staged->base = live_version;
  for (const auto& [k, v] : staged->stages_ms.items()) stages[k] = v;
  stages["total"] = MsSince(t);
  uint64_t delta_bytes = 0, full_bytes = 0;
  int64_t changed_published = 0;
  for (const refit::ShardTable& tb : manifest.tables) {
    for (const refit::ShardInfo& s : tb.shards) {
      delta_bytes += s.delta->bytes;
      changed_published += s.delta->changed;
      full_bytes += static_cast<uint64_t>(refit::NumElements(s.shape)) * refit::DTypeSize(tb.dtype);
    }
  }
  RC_ASSIGN_OR_RETURN(std::string transport_name, refit::ManifestTransport(manifest));
  Json evidence{{"version", req.version},
                {"model", req.model},
                {"mode", "delta"},
                {"mode_reason", "the engine serves the delta's base " + live_version + ", proven by " + proof},
                {"delta_base", live_version},
                {"transport", transport_name},
                {"bytes_pulled", staged->bytes_pulled},
                {"delta_bytes_published", delta_bytes},
                {"full_bytes_published", full_bytes},
                {"changed_published", changed_published},
                {"changed_digested", staged->changed},
                {"ranks", staged->ranks},
                {"threads", threads_},
                {"coverage", "ok"},
                {"digest_check", "live digests updated by the changed elements match the manifest, tensor by tensor"},
                {"content_digest", Hex64(manifest.content_digest)},
                {"stages_ms", stages}};
  {
    rc::MutexLock metrics_lock(metrics_mu_);
    last_stage_ms_ = stages;
    bytes_pulled_total_ += staged->bytes_pulled;
  }
  delta_staged_ = std::make_unique<internal::DeltaStaged>(std::move(staged).value());
  return Result<Json>(std::move(evidence));
}

Result<Json> RefitReceiver::InstallDeltaLocked(const std::string& version, bool skip_cache_reset,
                                               std::atomic<bool>* touched, const Json& stage_evidence,
                                               const refit::TensorDigests& published) {
  internal::DeltaStaged& d = *delta_staged_;
  if (engine_->State().install_generation != d.generation || engine_->WeightVersion() != d.base) {
    return FailedPrecondition("install refused: the live weights changed since the delta of " + version +
                              " was staged on " + d.base + " (stage again); nothing was touched");
  }
  Json stages = stage_evidence["stages_ms"];
  auto t = std::chrono::steady_clock::now();
  std::atomic<uint64_t> bytes{0};
  // Called by Engine::Install before it returns, while this thread holds mu_ (see InstallLocked).
  auto fill = [this, &d, &bytes, touched](int rank, const RankLayout&, ParameterStore* params) REQUIRES(mu_) -> Status {
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
  Status st = engine_->InstallWeights(fill, version, ++generation_, !skip_cache_reset);
  if (!st.ok()) return st.WithContext("delta install of " + version);
  stages["install"] = MsSince(t);

  // Post-install proof in O(changed): every changed element's term recomputed from live memory.
  t = std::chrono::steady_clock::now();
  const auto buffers = LiveBuffers();
  RC_ASSIGN_OR_RETURN(refit::TensorDigests after, internal::DigestAfterDelta(d, captures_, buffers, threads_));
  stages["post_install"] = MsSince(t);
  std::string mismatch = refit::FirstDigestMismatch(after, published);
  if (!mismatch.empty()) {
    return DataLoss("live weights after the delta install of " + version +
                    " do not match the published digests: " + mismatch);
  }
  // Anchor check: a full digest of the live weights every full_verify_every_ delta installs.
  ++deltas_since_anchor_;
  Json anchor{{"ran", false}, {"deltas_since_anchor", deltas_since_anchor_}, {"every", full_verify_every_}};
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
    anchor = Json{{"ran", true},
                  {"ok", true},
                  {"reason", "every " + std::to_string(full_verify_every_) + " delta installs"},
                  {"ms", ms}};
    deltas_since_anchor_ = 0;
  }
  live_cache_ = after;
  live_cache_generation_ = engine_->State().install_generation;
  live_cache_valid_ = true;
  Json out = stage_evidence;
  out["weight_version"] = version;
  out["bytes_installed"] = bytes.load();
  out["cache_reset"] = !skip_cache_reset;
  out["live_content_digest"] = Hex64(refit::CombineTensorDigests(after));
  out["anchor_check"] = anchor;
  stages["ready"] = 0.0;
  out["stages_ms"] = stages;
  delta_staged_.reset();
  return out;
}

}  // namespace rc::engine
