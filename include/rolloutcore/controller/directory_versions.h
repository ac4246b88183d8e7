// DirectoryVersionSource: resolves committed directory versions into lifecycle update targets.
//
// A target's identity is what the directory proves about the version: content_digest = the
// manifest's combined content digest (16 hex digits, the format engines report from
// /rc/weights/digest), checkpoint = "model@version", run = the model name, step = the trailing
// integer of the version label when it has one ("v12" → 12), else -1. The target carries the
// version's replay probes (the committed manifest's, converted by ProbesOf).
//
// Thread safety: as the underlying DirectoryStore (the HTTP client is safe from any thread).
#pragma once

#include "rolloutcore/controller/service.h"
#include "rolloutcore/directory/store.h"

namespace rc::controller {

class DirectoryVersionSource final : public VersionSource {
 public:
  explicit DirectoryVersionSource(directory::DirectoryStore* store) : store_(store) {}
  Result<lifecycle::UpdateTarget> Resolve(const std::string& model, const std::string& version) override;
  Result<std::vector<Commit>> WaitForCommits(const std::string& model, uint64_t after_seq, int64_t timeout_ms) override;

 private:
  directory::DirectoryStore* store_;
};

// The replay probes of a committed version, as the Runner replays them.
Result<std::vector<lifecycle::ReplayProbe>> ProbesOf(directory::DirectoryStore* store, const std::string& model,
                                                     const std::string& version);

// The trailing integer of a label ("v12" → 12, "step-7" → 7), or -1.
int64_t StepFromLabel(const std::string& label);

}  // namespace rc::controller
