// Test helpers for refit: a small in-process "trainer" whose tensors have known contents, sharded
// and registered with the local transport, plus plan-and-execute in one call.
//
// Contents: element i of the k-th tensor added (tag k, from 1) holds the value k * 65536 + i,
// stored in the tensor's dtype (exact for f32 / i32 / i64 while i < 65536 and k < 256), so a test
// can compute by hand which source element every destination element must hold.
//
// Thread safety: test-only, single-threaded.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "rolloutcore/refit/capture.h"
#include "rolloutcore/refit/executor.h"
#include "rolloutcore/refit/manifest.h"
#include "rolloutcore/refit/planner.h"
#include "rolloutcore/transport/transport.h"

namespace rc::refit::testing {

std::vector<ShardInfo> SplitShards(const Shape& shape, size_t dim, int32_t n);  // torch.chunk pieces
std::vector<ShardInfo> ReplicaShards(const Shape& shape, int32_t n);
ShardInfo Shard(int32_t rank, Shape offset, Shape shape);

class World {
 public:
  World();
  ~World();
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  // Adds a tensor with the known contents and publishes `shards` of it.
  void AddTensor(const std::string& name, DType dtype, const Shape& shape, std::vector<ShardInfo> shards);
  int64_t Tag(const std::string& name) const { return tags_.at(name); }
  // The value element `linear` of tensor `name` holds.
  double Value(const std::string& name, int64_t linear) const { return Tag(name) * 65536.0 + linear; }
  const std::vector<std::byte>& Full(const std::string& name) const { return full_.at(name); }
  std::vector<TensorSpec> Sources() const;
  const Manifest& manifest() const { return manifest_; }
  Manifest& mutable_manifest() { return manifest_; }
  transport::Transport& transport() { return *transport_; }

 private:
  std::unique_ptr<transport::Transport> transport_;
  Manifest manifest_;
  std::map<std::string, int64_t> tags_;
  std::map<std::string, std::vector<std::byte>> full_;
  std::vector<std::unique_ptr<std::vector<std::byte>>> shard_bytes_;
  std::vector<uint64_t> registrations_;
};

using Loader = std::function<Status(LoadContext&)>;

struct RunResult {
  Capture capture;
  TransferPlan plan;
  std::map<std::string, std::vector<std::byte>> params;  // installed bytes by parameter
};

// Captures `loader`, plans against the world's manifest, executes through the local transport
// into zero-filled parameter buffers.
Result<RunResult> PlanAndRun(World& world, const std::vector<TensorSpec>& params, const Loader& loader,
                             const PlanOptions& options = {}, const ExecuteOptions& exec = {});

// Element i of a parameter buffer as a double (f32, bf16, f16, i32, i64).
double ElementAt(DType dtype, const std::vector<std::byte>& bytes, int64_t i);

}  // namespace rc::refit::testing
