#include "rolloutcore/controller/directory_versions.h"

#include <fmt/format.h>

#include "rolloutcore/base/hash.h"
#include "rolloutcore/base/pending.h"

namespace rc::controller {

int64_t StepFromLabel(const std::string& label) {
  size_t i = label.size();
  while (i > 0 && label[i - 1] >= '0' && label[i - 1] <= '9') --i;
  if (i == label.size() || label.size() - i > 18) return -1;
  return std::stoll(label.substr(i));
}

Result<lifecycle::VersionFacts> FactsOf(directory::DirectoryStore* store, const std::string& model,
                                        const std::string& version) {
  RC_ASSIGN_OR_RETURN(refit::Manifest m, store->Get(model, version));
  lifecycle::VersionFacts facts;
  for (const std::string& q : refit::PublishedFp8Quantizations(m)) {
    auto image = refit::PublishedFp8Image(m, q);
    if (!image.ok()) return image.status().WithContext(fmt::format("the FP8 parts of {}@{}", model, version));
    facts.published_fp8[q] = refit::Fp8ImageCombined(*image).ToHex();
  }
  std::vector<lifecycle::ReplayProbe>& out = facts.probes;
  for (const refit::Probe& p : m.probes) {
    lifecycle::ReplayProbe r;
    r.name = p.name;
    r.prompt = p.prompt;
    r.top_k = p.top_k;
    r.quantization = p.quantization;
    for (const refit::ProbeStep& s : p.steps) r.expected.push_back(lifecycle::ReplayStep{s.token, s.logprob, s.top});
    out.push_back(std::move(r));
  }
  return facts;
}

DirectoryVersionSource::DirectoryVersionSource(directory::DirectoryStore* store)
    : store_(store), fetches_(std::make_shared<Fetches>()) {}

DirectoryVersionSource::~DirectoryVersionSource() {
  rc::MutexLock lock(fetches_->mu);
  while (fetches_->running > 0) fetches_->cv.wait(lock);
}

Result<lifecycle::UpdateTarget> DirectoryVersionSource::Resolve(const std::string& model, const std::string& version) {
  RC_ASSIGN_OR_RETURN(directory::VersionInfo info, store_->GetInfo(model, version));
  if (info.state != directory::VersionState::kCommitted) {
    return FailedPrecondition("version " + version + " of " + model + " is " +
                              std::string(directory::VersionStateName(info.state)) + ", not COMMITTED" +
                              (info.reason.empty() ? "" : " (" + info.reason + ")"));
  }
  lifecycle::UpdateTarget t;
  t.label = version;
  t.model = model;
  t.identity.content_digest = Hex64(info.content_digest);
  t.identity.checkpoint = model + "@" + version;
  t.identity.run = model;
  t.identity.step = StepFromLabel(version);
  // The manifest (for the probes and the published FP8 images) is read on a pooled worker while
  // the update starts: the Runner takes them before the drain completes (types.h,
  // UpdateTarget::facts_fetch).
  {
    rc::MutexLock lock(fetches_->mu);
    ++fetches_->running;
  }
  t.facts_fetch = RunDetached<lifecycle::VersionFacts>(
      [store = store_, fetches = fetches_, model, version]() -> Result<lifecycle::VersionFacts> {
        auto facts = FactsOf(store, model, version);
        rc::MutexLock lock(fetches->mu);
        --fetches->running;
        fetches->cv.notify_all();
        return facts;
      });
  return t;
}

Result<std::vector<VersionSource::Commit>> DirectoryVersionSource::WaitForCommits(const std::string& model,
                                                                                  uint64_t after_seq,
                                                                                  int64_t timeout_ms) {
  RC_ASSIGN_OR_RETURN(auto events, store_->WaitForCommits(model, after_seq, timeout_ms));
  std::vector<Commit> out;
  out.reserve(events.size());
  for (const auto& e : events) out.push_back(Commit{e.seq, e.version});
  return out;
}

}  // namespace rc::controller
