// Publisher: one trainer rank's side of a weight refit. The rank hands it the shards it already
// owns for a version (tensor name, dtype, global shape, the box's global offset and local shape,
// a pointer to the box's row-major bytes); Publish then registers each shard's memory with the
// rank's Transport, computes each shard's content digest (refit::DigestBlock), builds the shard
// tables (handle = the registration's descriptor) and publishes them to the directory under the
// rank's lease. The directory commits the version once every expected rank has published.
//
// Memory contract. The bytes must stay valid, unmoved and unchanged from AddShard until
// Release(version): readers pull them one-sidedly at any time after the publish, and the digest
// published is the digest of the bytes at Publish time. The memory must be registrable by the
// transport (for `shm`: inside a live transport::ShmBuffer; `local` and `ucx` take any host
// memory). A shard may carry `keep_alive`, any shared object owning its memory (a ShmBuffer, a
// vector): the Publisher holds it until the version is released, so callers can hand buffers
// over instead of tracking their lifetime.
//
// Leases. The first publish grants a lease of `lease_ttl_ms`; a directory::LeaseKeeper renews it
// every `keepalive_interval_ms` until the Publisher is destroyed, and later publishes attach to
// the same lease. If the lease is found expired (the keeper saw NotFound, or a publish is
// answered NotFound for it) the next publish grants a fresh one. When the process dies the keeper
// dies with it, the lease expires, and a version this rank left STAGING becomes ABANDONED: a
// killed trainer leaves nothing that blocks a new one.
//
// Outcome of a publish. A directory call can fail without saying whether it took effect (the
// directory died after its commit was durable but before it answered; a timeout): then the
// outcome is unknown, and the memory may already be named by a COMMITTED version. The Publisher
// never drops registrations on such an answer. It asks the directory, retrying with backoff for
// up to `outcome_timeout_ms`: GetInfo, and for a COMMITTED version Get, checking that the
// manifest names exactly this rank's shards with these handles and digests (then the publish is
// reported as the commit it was); for a STAGING or unknown version it publishes the same tables
// again (idempotent while STAGING; the handles are unchanged because nothing was deregistered).
// ABANDONED, UNAVAILABLE or a manifest naming other handles is a definite refusal. When the
// directory stays silent past the deadline, Publish returns Unavailable ("outcome unknown") and
// the version stays registered in the state *unresolved*: readers of a commit it may have made
// are still served; Publish(version) resumes the inquiry with the same registrations; Release
// drops it (and marks it in the directory, see below).
//
// Sources gone. When the Publisher drops the registrations of a version that is published or
// unresolved without release_in_directory (Release(version, false), or the destructor), it first
// marks the version in the directory with MarkUnavailable ("rank R of model M released its
// buffers"): a COMMITTED version becomes UNAVAILABLE, a STAGING one ABANDONED, so receivers are
// refused at once instead of failing every pull on dead handles. A directory that cannot be
// reached then is logged and the registrations are dropped anyway (a killed process cannot mark
// either; docs/directory.md states the rule for readers).
//
// Thread safety: every method may be called from any thread. One mutex guards the version table;
// the expensive part of Publish (registration, digests, the directory call) runs without it.
// Publish and Release of the same version must not race: a version being published refuses
// AddShard, a second Publish and Release with FailedPrecondition.
// Invariants: a version is in one of the states staged (shards added, nothing registered),
// published (every shard registered, tables accepted by the directory), unresolved (every shard
// registered, the directory's answer unknown) or gone (released, or never added). A Publish the
// directory definitely refused deregisters what it registered and leaves the version staged, so
// it can be retried. The destructor deregisters every registration it still holds (marking
// published and unresolved versions unavailable first); it does not release versions in the
// directory.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/status.h"
#include "rolloutcore/base/mutex.h"
#include "rolloutcore/directory/client.h"
#include "rolloutcore/directory/store.h"
#include "rolloutcore/refit/manifest.h"
#include "rolloutcore/refit/tensor.h"
#include "rolloutcore/trainer/fp8_parts.h"
#include "rolloutcore/transport/transport.h"

namespace rc::trainer {

// One shard a rank owns: the box [offset, offset + local_shape) of tensor `name`.
struct ShardSource {
  std::string name;
  refit::DType dtype = refit::DType::kBF16;
  refit::Shape global_shape;
  refit::Shape offset;       // global start of the box
  refit::Shape local_shape;  // the box's extent; `data` holds it row-major, dense
  const void* data = nullptr;
  transport::MemoryKind memory_kind = transport::MemoryKind::kHost;
  int32_t device = -1;
  // Held (not read) by the Publisher until the version is released.
  std::shared_ptr<const void> keep_alive;
  // The box's content digest (refit::DigestBlock), computed by the caller where the bytes live.
  // Required for device memory (the Publisher reads only host memory; e.g. rc::cuda::DeviceDigest
  // computes it on the GPU) unless PublisherOptions::device_digester computes it at Publish;
  // ignored for host memory, whose digest the Publisher computes itself.
  std::optional<uint64_t> digest;
  // The shard's parts of the FP8 images engines compute from it (refit::ShardInfo::fp8, keyed by
  // quantization; fp8_parts.h computes them). Set by the caller for device memory, or attached
  // later (AttachFp8Parts); for host memory PublisherOptions::fp8_quantizations has the Publisher
  // compute them. Published as given.
  std::map<std::string, refit::Fp8ImageDigest, std::less<>> fp8 = {};

  uint64_t bytes() const;
};

// Digests (refit::DigestBlock) of device shards, one per shard in order (PublisherOptions::device_digester).
using DeviceDigester = std::function<Result<std::vector<uint64_t>>(const std::vector<const ShardSource*>& shards)>;

struct PublisherOptions {
  int64_t lease_ttl_ms = 30'000;
  int64_t keepalive_interval_ms = 0;  // 0: a third of lease_ttl_ms
  // How long a Publish whose directory answer was lost keeps asking for the outcome (real time).
  int64_t outcome_timeout_ms = 30'000;
  // First pause between those inquiries; doubles up to 1 s.
  int64_t outcome_retry_ms = 50;
  // Asked before every outcome inquiry and every 100 ms of the pauses between them: true ends the
  // inquiry with Aborted ("interrupted"), the version staged and its buffers registered as after
  // the timeout (publish again to ask again, or release). The Python binding asks whether Ctrl-C
  // is pending. Called on the thread that called Publish.
  std::function<bool()> interrupted = nullptr;
  // Delta publishing (docs/refit.md "Delta refit"): keep a copy of each host shard's bytes as last
  // published (memory: one copy of every shard), and publish each later version's shards with a
  // sparse delta against that version when the directory reports it COMMITTED and the shard
  // existed there with the same dtype and box. The full shards are published as before.
  bool delta = false;
  // Threads that compute those deltas and keep the copies, shards in parallel (0: every hardware
  // thread; the work is bound by memory bandwidth).
  int delta_threads = 0;
  // FP8 expected images (docs/fp8.md, "The expected image, from the trainer"): for each of these
  // quantizations (fp8_per_tensor, fp8_per_channel, fp8_per_block) Publish computes every host
  // shard's part (trainer::Fp8ShardParts over the version's shards on this rank) and publishes it
  // with the shard, so the controller can hold an FP8 engine to the trainer's own image. A scale
  // group split over ranks needs `fp8_exchange` (an all-reduce MAX of the amaxes over the trainer's
  // ranks; every rank's Publish then calls it, so they must publish together); without one such a
  // group fails the publish, naming it. Device shards must carry their parts (ShardSource::fp8).
  std::vector<std::string> fp8_quantizations = {};
  Fp8AmaxExchange fp8_exchange = nullptr;
  int fp8_threads = 1;
  // The model's tensors (name, dtype, global shape), for a rank that holds no shard of some part of
  // a fused parameter (fsdp over more ranks than a k_proj has rows): fp8_parts.h's `model`.
  std::vector<refit::TensorSpec> fp8_model = {};
  // Computes, in one call at Publish, the digest of every device shard of the version added
  // without one (ShardSource::digest unset), over the bytes as they are at Publish: one GPU launch
  // for the whole version instead of one per shard (a model has hundreds). Without it such a shard
  // fails the publish (InvalidArgument naming it).
  DeviceDigester device_digester = nullptr;
};

// One FP8 part a caller computed for a staged shard (Publisher::AttachFp8Parts).
struct Fp8ShardPart {
  std::string tensor;
  refit::Shape offset;  // the shard's global start, as given to AddShard
  std::string quantization;
  refit::Fp8ImageDigest part;
};

// A delta the caller computed for a staged shard in device memory (Publisher::AttachDeltaPayload):
// the encoded payload (refit/delta.h; e.g. refit::EncodeShardDeltaFromChanges of the change list
// rolloutcore.refit.changed_elements computes on the GPU) of the shard's changes since the version
// this Publisher published last, in memory the caller owns (device memory for cuda_ipc), held (not
// read) until the version is released.
struct DeltaPayloadSource {
  std::string tensor;
  refit::Shape offset;  // the shard's global start, as given to AddShard
  const void* data = nullptr;
  uint64_t bytes = 0;
  transport::MemoryKind memory_kind = transport::MemoryKind::kDevice;
  int32_t device = -1;
  int64_t changed = 0;  // changed elements the payload holds
  std::shared_ptr<const void> keep_alive;
};

// What one Publish did.
struct PublishReport {
  std::string version;
  directory::PublishResult result;  // the directory's answer (state, ranks published, commit seq)
  int64_t shards = 0;
  uint64_t bytes = 0;
  int64_t register_ns = 0;
  int64_t digest_ns = 0;
  int64_t publish_ns = 0;
  // Delta publishing: the base version ("" when this publish carries no delta), the shards with a
  // delta, the elements changed in them, and the encoded payload bytes.
  std::string delta_base;
  int64_t delta_shards = 0;
  int64_t delta_changed = 0;
  uint64_t delta_bytes = 0;
  int64_t delta_ns = 0;
  int64_t fp8_ns = 0;  // computing FP8 parts (PublisherOptions::fp8_quantizations)
  std::vector<refit::ShardTable> tables;  // what was published, handles and digests filled in
};

class Publisher {
 public:
  // `transport` and `store` must outlive the Publisher. rank is in [0, expected_ranks).
  Publisher(transport::Transport* transport, directory::DirectoryStore* store, std::string model, int32_t rank,
            int32_t expected_ranks, PublisherOptions options = {});
  ~Publisher();
  Publisher(const Publisher&) = delete;
  Publisher& operator=(const Publisher&) = delete;

  const std::string& model() const { return model_; }
  int32_t rank() const { return rank_; }
  int32_t expected_ranks() const { return expected_ranks_; }

  // Stages a shard of `version`. Checks the geometry right away (InvalidArgument naming tensor,
  // rank and version: bad shape, box outside the tensor, null data, a tensor staged twice with a
  // different dtype/shape, two shards of one tensor overlapping on this rank).
  // FailedPrecondition when the version is being published or already published.
  [[nodiscard]] Status AddShard(std::string_view version, ShardSource shard);
  // Attaches replay probes (refit/probes.h) to `version`, published with this rank's tables; only
  // rank 0 may (InvalidArgument otherwise, and for probes refit::ValidateProbes refuses).
  // Replaces earlier ones; FailedPrecondition once the version is being published or published.
  [[nodiscard]] Status AttachProbes(std::string_view version, std::vector<refit::Probe> probes);

  // Attaches FP8 parts the caller computed (fp8_parts.h; e.g. from device shards copied to the
  // host) to staged shards of `version`, replacing earlier parts of the same quantization.
  // InvalidArgument naming a quantization that is not one of refit::kFp8Quantizations or a tensor
  // served in bf16; NotFound naming a part whose shard (tensor, offset) is not staged;
  // FailedPrecondition once the version is being published or published.
  [[nodiscard]] Status AttachFp8Parts(std::string_view version, const std::vector<Fp8ShardPart>& parts);
  // Attaches a delta payload the caller computed for a staged shard of `version` that lives in
  // device memory (the Publisher keeps no copy of device shards to diff against). Published with
  // the version when this Publisher was made with PublisherOptions::delta and its previous publish
  // (the delta's base) is committed and held the same shard; otherwise the version is published in
  // full, as ever. InvalidArgument for a payload shorter than the shard's tile table or a shard in
  // host memory (the Publisher computes those itself); NotFound naming a shard that is not
  // staged; FailedPrecondition once the version is being published or published.
  [[nodiscard]] Status AttachDeltaPayload(std::string_view version, DeltaPayloadSource payload);
  // Registers, digests and publishes every staged shard of `version` (see the header comment).
  // A rank that owns nothing of the model may publish with no shards (its empty table set still
  // counts as its publish). NotFound when the version was never staged; FailedPrecondition when it
  // is already published or being published; the directory's refusal (named with rank and
  // version) otherwise; Unavailable "outcome unknown" when the directory's answer was lost and it
  // did not tell the outcome within outcome_timeout_ms (the version stays registered: call
  // Publish again to resume the inquiry, or Release). A version left unresolved by an earlier
  // call is resumed, not re-registered.
  [[nodiscard]] Result<PublishReport> Publish(std::string_view version);
  // Stages nothing new: publishes `version` with whatever was added (creating it empty if needed).
  [[nodiscard]] Result<PublishReport> PublishEmpty(std::string_view version);

  // Deregisters the version's memory and drops its shards (and their keep_alive objects). With
  // release_in_directory, also releases the version in the directory (NotFound there is ignored:
  // another rank may have released it first); without, a published or unresolved version is
  // first marked unavailable there (see the header comment; NotFound ignored). NotFound when this
  // Publisher holds no such version.
  [[nodiscard]] Status Release(std::string_view version, bool release_in_directory = false);

  // Test-only fault (the delta e2e tests): corrupts the delta payload of the first shard of
  // `version` with at least two changes, after the publish, in one of three ways — "value" flips
  // bit 0 of one new value, "index" moves one changed element to a neighbouring unchanged
  // position, "missing" drops one changed element — rewriting the payload in place so that it
  // still parses. Returns the tensor it corrupted. NotFound when the version has no such shard.
  [[nodiscard]] Result<std::string> CorruptDeltaForTesting(std::string_view version, std::string_view kind);

  // Versions held (staged or published), in label order.
  std::vector<std::string> versions() const;
  bool IsPublished(std::string_view version) const;
  // True while `version` is unresolved: registered, the directory's answer to its publish unknown.
  bool IsUnresolved(std::string_view version) const;
  // The lease of the latest publish (0 before the first).
  int64_t lease_id() const;

 private:
  struct StagedShard {
    ShardSource source;
    uint64_t registration_id = 0;  // valid when registered
    std::string descriptor;
    uint64_t digest = 0;
    std::optional<refit::ShardDelta> delta = std::nullopt;  // this version's delta of the shard, once computed
    // The first shard of a version with deltas owns the registration of the region holding every
    // payload of the version (0 otherwise) and keeps that region alive.
    uint64_t delta_registration_id = 0;
    std::shared_ptr<const void> delta_keep_alive = nullptr;
    std::optional<DeltaPayloadSource> attached_delta = std::nullopt;  // AttachDeltaPayload
  };
  // Fills ShardSource::fp8 of host shards for every PublisherOptions::fp8_quantizations entry.
  Status ComputeFp8Parts(std::string_view version, std::vector<StagedShard>& shards);
  // PublisherOptions::device_digester over the version's unregistered device shards without a digest.
  [[nodiscard]] Status DigestDeviceShards(std::string_view version, std::vector<StagedShard>& shards,
                                          PublishReport* report);
  // A shard's bytes as last published (delta publishing).
  struct PreviousShard {
    refit::DType dtype = refit::DType::kBF16;
    std::vector<std::byte> bytes;
    uint64_t digest = 0;
  };
  struct VersionEntry {
    enum class State { kStaged, kPublishing, kPublished, kUnresolved } state = State::kStaged;
    std::vector<StagedShard> shards;
    std::vector<refit::Probe> probes;
  };

  static std::string_view StateWord(VersionEntry::State state);
  [[nodiscard]] Result<PublishReport> PublishImpl(std::string_view version, bool allow_create);
  [[nodiscard]] Status CheckNewShard(std::string_view version, const VersionEntry& entry,
                                     const ShardSource& shard) const;
  // The lease to attach to (0: grant a new one).
  int64_t CurrentLease() REQUIRES(mu_);
  void AdoptLease(int64_t lease_id, int64_t ttl_ms) REQUIRES(mu_);
  void DeregisterAll(std::vector<StagedShard>& shards);
  // Asks the directory what became of a publish whose answer was lost (see the header comment).
  // OK with the directory's result; a definite refusal; or Unavailable "outcome unknown".
  // Sends the publish (or, resuming, asks for the outcome of the earlier one): a lease that ran
  // out is replaced once; an answer that was lost starts ResolveOutcome.
  [[nodiscard]] Result<directory::PublishResult> SendPublish(directory::PublishRequest& request, bool resume);
  [[nodiscard]] Result<directory::PublishResult> ResolveOutcome(directory::PublishRequest& request,
                                                                const Status& lost);
  // True when `manifest` names exactly `tables`' shards of this rank (boxes, handles, digests).
  bool ManifestHoldsOurShards(const refit::Manifest& manifest, const std::vector<refit::ShardTable>& tables) const;
  // Delta publishing (publisher_delta.cc): encodes, registers and records each shard's delta
  // against the previous published version when that one is COMMITTED; then the remembered copy.
  // PublisherOptions::delta_threads, with 0 as every hardware thread.
  int DeltaThreads() const;
  [[nodiscard]] Status AttachDeltas(std::string_view version, std::vector<StagedShard>& shards, PublishReport* report);
  static Status FillDeltaReport(const std::vector<StagedShard>& shards, PublishReport* report, int64_t t0);
  void RememberPublished(std::string_view version, const std::vector<StagedShard>& shards) REQUIRES(mu_);
  // MarkUnavailable for a version whose registrations are about to be dropped; logs failures.
  Status MarkSourcesGone(std::string_view version);

  transport::Transport* const transport_;
  directory::DirectoryStore* const store_;
  const std::string model_;
  const int32_t rank_;
  const int32_t expected_ranks_;
  const PublisherOptions options_;

  mutable rc::Mutex mu_;
  std::map<std::string, VersionEntry, std::less<>> versions_ GUARDED_BY(mu_);  // guarded by mu_
  int64_t lease_id_ GUARDED_BY(mu_) = 0;                                       // guarded by mu_
  std::unique_ptr<directory::LeaseKeeper> keeper_ GUARDED_BY(mu_);             // guarded by mu_
  std::string previous_version_ GUARDED_BY(mu_);                               // guarded by mu_ (delta publishing)
  std::map<std::string, PreviousShard, std::less<>> previous_ GUARDED_BY(mu_);  // guarded by mu_; by "name|box"
};

}  // namespace rc::trainer
