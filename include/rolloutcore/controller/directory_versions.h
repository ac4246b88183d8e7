// DirectoryVersionSource: resolves committed directory versions into lifecycle update targets.
//
// A target's identity is what the directory proves about the version: content_digest = the
// manifest's combined content digest (16 hex digits, the format engines report from
// /rc/weights/digest), checkpoint = "model@version", run = the model name, step = the trailing
// integer of the version label when it has one ("v12" → 12), else -1. The target carries the
// version's replay probes and the FP8 images its trainer published (the committed manifest's,
// read by FactsOf) as a fetch still in flight (UpdateTarget::facts_fetch): Resolve reads only the
// version's status, so the manifest's round trip overlaps the update's first journal commits and
// its stage (issue 15).
//
// Thread safety: as the underlying DirectoryStore (the HTTP client is safe from any thread). The
// destructor waits for the manifest fetches still running (they read the store), so the store must
// outlive this object, as it does when it was declared first.
#pragma once

#include <memory>

#include "rolloutcore/base/mutex.h"
#include "rolloutcore/controller/service.h"
#include "rolloutcore/directory/store.h"

namespace rc::controller {

class DirectoryVersionSource final : public VersionSource {
 public:
  explicit DirectoryVersionSource(directory::DirectoryStore* store);
  ~DirectoryVersionSource() override;
  DirectoryVersionSource(const DirectoryVersionSource&) = delete;
  DirectoryVersionSource& operator=(const DirectoryVersionSource&) = delete;
  Result<lifecycle::UpdateTarget> Resolve(const std::string& model, const std::string& version) override;
  Result<std::vector<Commit>> WaitForCommits(const std::string& model, uint64_t after_seq, int64_t timeout_ms) override;

 private:
  // Manifest fetches still running (shared with them: they count themselves out).
  struct Fetches {
    rc::Mutex mu;
    rc::CondVar cv;
    int running GUARDED_BY(mu) = 0;  // guarded by mu
  };
  directory::DirectoryStore* store_;
  std::shared_ptr<Fetches> fetches_;
};

// The replay probes of a committed version, as the Runner replays them, and the combined digest of
// each FP8 image its trainer published (refit::PublishedFp8Image, Fp8ImageCombined).
Result<lifecycle::VersionFacts> FactsOf(directory::DirectoryStore* store, const std::string& model,
                                        const std::string& version);

// The trailing integer of a label ("v12" → 12, "step-7" → 7), or -1.
int64_t StepFromLabel(const std::string& label);

}  // namespace rc::controller
