#include "receiver/pipeline.h"

#include <algorithm>
#include <utility>

#include <fmt/format.h>

#include "rolloutcore/refit/digest.h"

namespace rc::receiver::internal {

int64_t MsLeft(std::chrono::steady_clock::time_point deadline) {
  return std::max<int64_t>(
      1, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count());
}

Status ResolveInDirectory(const std::string& directory, const std::string& model, const std::string& version,
                          std::chrono::steady_clock::time_point deadline, ResolvedVersion* out) {
  directory::ClientOptions client_options;
  const int64_t left_ms = MsLeft(deadline);
  client_options.connect_timeout_ms = std::min(client_options.connect_timeout_ms, left_ms);
  client_options.request_timeout_ms = std::min(client_options.request_timeout_ms, left_ms);
  out->dir.emplace(directory, client_options);
  RC_ASSIGN_OR_RETURN(out->manifest, out->dir->Get(model, version));
  RC_ASSIGN_OR_RETURN(out->published, refit::TensorDigestsFromShards(out->manifest));
  return OkStatus();
}

uint64_t StageTopology(const refit::Manifest& sources, int32_t receiver_rank) {
  return refit::SourceTopologyDigest(sources) ^ (static_cast<uint64_t>(receiver_rank) * 0x9E3779B97F4A7C15ull);
}

Result<bool> RankPlans::Ensure(std::span<const refit::Capture> captures, const refit::Manifest& sources,
                               uint64_t topology, int32_t receiver_rank) {
  if (topology == topology_ && !plans_.empty() && plans_.size() == captures.size()) return true;
  Reset();
  std::vector<refit::TransferPlan> plans;
  for (size_t r = 0; r < captures.size(); ++r) {
    refit::PlanOptions po;
    po.dest_rank = static_cast<int32_t>(static_cast<int64_t>(receiver_rank) * static_cast<int64_t>(captures.size()) +
                                        static_cast<int64_t>(r));
    RC_ASSIGN_OR_RETURN(refit::TransferPlan p, refit::BuildPlan(captures[r], sources, po));
    plans.push_back(std::move(p));
  }
  plans_ = std::move(plans);
  topology_ = topology;
  ++built_;
  return false;
}

void RankPlans::Reset() {
  plans_.clear();
  topology_ = 0;
}

refit::PlanStats RankPlans::TotalStats() const {
  refit::PlanStats total;
  for (const refit::TransferPlan& p : plans_) {
    total.bytes_planned += p.stats.bytes_planned;
    total.bytes_needed += p.stats.bytes_needed;
    total.descriptors += p.stats.descriptors;
    total.full_pulls += p.stats.full_pulls;
  }
  return total;
}

Status CheckStagedDigests(const refit::TensorDigests& staged, const refit::TensorDigests& published,
                          std::string_view model, std::string_view version, bool subset) {
  refit::TensorDigests want;
  if (subset) {
    for (const auto& [name, v] : staged) {
      auto it = published.find(name);
      if (it == published.end()) {
        return DataLoss(fmt::format("staged tensor {} is not in {} of {}", name, version, model));
      }
      want.emplace(name, it->second);
    }
  }
  const std::string mismatch = refit::FirstDigestMismatch(staged, subset ? want : published);
  if (!mismatch.empty()) {
    return DataLoss(fmt::format("staged bytes of {} do not match the published digests: {}", version, mismatch));
  }
  return OkStatus();
}

}  // namespace rc::receiver::internal
