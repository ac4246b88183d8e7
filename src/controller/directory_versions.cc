#include "rolloutcore/controller/directory_versions.h"

#include <chrono>

#include "rolloutcore/base/hash.h"
#include "rolloutcore/base/pending.h"

namespace rc::controller {

int64_t StepFromLabel(const std::string& label) {
  size_t i = label.size();
  while (i > 0 && label[i - 1] >= '0' && label[i - 1] <= '9') --i;
  if (i == label.size() || label.size() - i > 18) return -1;
  return std::stoll(label.substr(i));
}

Result<std::vector<lifecycle::ReplayProbe>> ProbesOf(directory::DirectoryStore* store, const std::string& model,
                                                     const std::string& version) {
  RC_ASSIGN_OR_RETURN(refit::Manifest m, store->Get(model, version));
  std::vector<lifecycle::ReplayProbe> out;
  for (const refit::Probe& p : m.probes) {
    lifecycle::ReplayProbe r;
    r.name = p.name;
    r.prompt = p.prompt;
    r.top_k = p.top_k;
    for (const refit::ProbeStep& s : p.steps) r.expected.push_back(lifecycle::ReplayStep{s.token, s.logprob, s.top});
    out.push_back(std::move(r));
  }
  return out;
}

Result<lifecycle::UpdateTarget> DirectoryVersionSource::Resolve(const std::string& model, const std::string& version) {
  // The version's info and its manifest (for the probes) are two directory round trips: the
  // manifest is fetched on a pooled worker while this thread reads the info (issue 15: one round
  // trip less on every update request). Both are awaited before returning, so the worker never
  // outlives the store it reads.
  directory::DirectoryStore* store = store_;
  Pending<std::vector<lifecycle::ReplayProbe>> probes = RunDetached<std::vector<lifecycle::ReplayProbe>>(
      [store, model, version]() { return ProbesOf(store, model, version); });
  auto info = store_->GetInfo(model, version);
  (void)probes.WaitFor(std::chrono::hours(24));
  if (!info.ok()) return info.status();
  if (info->state != directory::VersionState::kCommitted) {
    return FailedPrecondition("version " + version + " of " + model + " is " +
                              std::string(directory::VersionStateName(info->state)) + ", not COMMITTED" +
                              (info->reason.empty() ? "" : " (" + info->reason + ")"));
  }
  lifecycle::UpdateTarget t;
  t.label = version;
  t.model = model;
  t.identity.content_digest = Hex64(info->content_digest);
  t.identity.checkpoint = model + "@" + version;
  t.identity.run = model;
  t.identity.step = StepFromLabel(version);
  RC_ASSIGN_OR_RETURN(t.probes, probes.Get());
  return t;
}

Result<std::vector<VersionSource::Commit>> DirectoryVersionSource::WaitForCommits(const std::string& model,
                                                                                  uint64_t after_seq,
                                                                                  int64_t timeout_ms) {
  RC_ASSIGN_OR_RETURN(auto events, store_->WaitForCommits(model, after_seq, timeout_ms));
  std::vector<Commit> out;
  for (const auto& e : events) out.push_back(Commit{e.seq, e.version});
  return out;
}

}  // namespace rc::controller
