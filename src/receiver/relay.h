// Engine-to-engine fan-out (docs/refit.md "Fan-out"): an engine that staged or installed version V
// serves V's bytes as a source of V, so the trainer's outbound bytes stay one copy of the model
// however many replicas pull.
//
// Holder records. A relay republishes V's shard tables *unchanged* — same tensors, boxes, dtypes
// and per-shard digests — with handles into its own memory, as a one-rank version of the model
// "<model>@relay" labelled "<V>@<holder>" (RelayModelName, RelayLabel). The directory validates
// and commits it like any version (complete coverage, replicas agreeing on digests), so it records
// every holder of every region of V without a new store operation, in every store (memory, SQLite,
// etcd, HTTP), and without showing relays to watchers of <model> (a controller's --auto-update
// sees only trainer versions).
//
// Materialization. BuildRelayHolding rebuilds each distinct shard box of the manifest, in its
// published dtype, from the engine's parameters (every rank's captured copies, read back through
// their views; bf16/f16 -> f32 widening is exact, so narrowing back restores the published bits),
// into one shm buffer, and checks each shard's DigestBlock against the published digest before
// anything is registered with the transport V's sources use (shm or ucx: host memory, which
// both register; one transport per version): a relay never serves bytes that differ from V. The
// holding is a snapshot: later stages or installs do not change it.
//
// Merging. MergeRelayHolders turns V's manifest plus the holder records a receiver found into the
// manifest it plans against: every box held by at least one usable holder is served by those
// holders only (as replicas on ranks first_relay_rank + holder index, listed from holder
// j mod H for the j-th relayed box, so that the planner's rotation by receiver rank spreads both
// one receiver's boxes and the receivers over all holders), so the trainer serves only boxes no
// relay holds. A record whose table,
// box, dtype or digest differs from V's is not used for that box, and a record whose handles
// name another transport than V's is not used at all. Excluded holders (proved dead)
// are skipped; with every holder of a box excluded the trainer's shards serve it again.
//
// Thread safety: pure functions except BuildRelayHolding, which allocates and registers memory.
#pragma once

#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/status.h"
#include "rolloutcore/refit/capture.h"
#include "rolloutcore/refit/executor.h"
#include "rolloutcore/refit/manifest.h"
#include "rolloutcore/transport/shm.h"
#include "rolloutcore/transport/transport.h"

namespace rc::receiver {

std::string RelayModelName(std::string_view model);                         // "<model>@relay"
std::string RelayLabel(std::string_view version, std::string_view holder);  // "<version>@<holder>"
// The holder of `label` when it names a relay of `version`; empty otherwise.
std::string RelayHolderOf(std::string_view label, std::string_view version);

struct RelayHolding {
  std::string model, version, holder;
  std::unique_ptr<transport::Transport> transport;  // the one V's sources use (shm or ucx)
  transport::ShmBuffer buffer;
  std::vector<uint64_t> registrations;
  std::vector<refit::ShardTable> tables;  // V's tables with one shard per distinct box, rank 0, our handles
  uint64_t bytes = 0;                     // shard bytes held
  ~RelayHolding();
};

// See the header comment. The transport is the one V's manifest names (CreateManifestTransport). `buffers[r]` are rank r's parameters (engine dtype) for `captures[r]`.
[[nodiscard]] Result<std::unique_ptr<RelayHolding>> BuildRelayHolding(
    const refit::Manifest& manifest, const std::vector<refit::Capture>& captures,
    const std::vector<refit::DestinationBuffers>& buffers, std::string model, std::string holder);

struct RelayRecord {
  std::string holder;
  refit::Manifest manifest;  // the committed "<V>@<holder>" version of "<model>@relay"
};

struct MergedSources {
  refit::Manifest manifest;          // what to plan against
  int32_t first_relay_rank = 0;      // ranks >= this are holders (index = rank - first_relay_rank)
  std::vector<std::string> holders;  // usable holders, by index
  uint64_t boxes_relayed = 0, boxes_from_origin = 0;
};

[[nodiscard]] Result<MergedSources> MergeRelayHolders(const refit::Manifest& origin,
                                                      const std::vector<RelayRecord>& records,
                                                      const std::set<std::string>& excluded);

}  // namespace rc::receiver
