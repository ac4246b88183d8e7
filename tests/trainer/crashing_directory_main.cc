// rc_crashing_directory: a directory server on an SQLite file that kills itself with SIGKILL at one
// point of one version's commit, so the trainer's fault tests can crash the directory exactly
// "around commit" (not at a random moment) and restart the real `directory serve` on the file.
//
//   rc_crashing_directory DB_PATH PORT MODE MODEL VERSION
//
// MODE before-commit: the publish that would commit (MODEL, VERSION) kills the process before the
//                     store sees it (nothing of that publish is written).
// MODE after-commit:  the store commits (MODEL, VERSION) durably (the SQLite transaction is
//                     committed), then the process kills itself before the HTTP answer is sent.
// Prints "directory listening on http://127.0.0.1:PORT (crashing MODE at VERSION)" when serving.
//
// Thread safety: publishes go through one mutex here, so "the publish that would commit" is
// decided on a state no other publish changes meanwhile.
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

#include "rolloutcore/directory/server.h"
#include "rolloutcore/directory/sqlite_store.h"
#include "rolloutcore/directory/store.h"

namespace {

using namespace rc;
using namespace rc::directory;

class CrashingStore final : public DirectoryStore {
 public:
  CrashingStore(DirectoryStore* inner, bool after_commit, std::string model, std::string version)
      : inner_(inner), after_commit_(after_commit), model_(std::move(model)), version_(std::move(version)) {}

  Result<PublishResult> Publish(const PublishRequest& r) override {
    std::lock_guard<std::mutex> lock(mu_);
    const bool target = r.model == model_ && r.version == version_;
    if (target && !after_commit_ && WouldCommit(r)) Die("before the commit");
    auto out = inner_->Publish(r);
    if (target && after_commit_ && out.ok() && out->state == VersionState::kCommitted) Die("after the commit");
    return out;
  }
  Result<LeaseInfo> KeepAlive(int64_t id) override { return inner_->KeepAlive(id); }
  Result<refit::Manifest> Get(std::string_view m, std::string_view v) override { return inner_->Get(m, v); }
  Result<VersionInfo> GetInfo(std::string_view m, std::string_view v) override { return inner_->GetInfo(m, v); }
  Result<std::vector<VersionInfo>> List(std::string_view m, StateFilter f) override { return inner_->List(m, f); }
  Result<std::vector<CommitEvent>> WaitForCommits(std::string_view m, uint64_t after, int64_t t) override {
    return inner_->WaitForCommits(m, after, t);
  }
  Status Release(std::string_view m, std::string_view v) override { return inner_->Release(m, v); }
  Status MarkUnavailable(std::string_view m, std::string_view v, std::string_view reason) override {
    return inner_->MarkUnavailable(m, v, reason);
  }

 private:
  bool WouldCommit(const PublishRequest& r) {
    auto info = inner_->GetInfo(r.model, r.version);
    if (!info.ok()) return r.expected_ranks == 1;
    if (info->state != VersionState::kStaging) return false;
    size_t after = info->published_ranks.size();
    bool present = false;
    for (int32_t rank : info->published_ranks) present = present || rank == r.rank;
    if (!present) ++after;
    return after == static_cast<size_t>(r.expected_ranks);
  }
  [[noreturn]] void Die(const char* when) {
    std::fprintf(stderr, "rc_crashing_directory: SIGKILL %s of %s\n", when, version_.c_str());
    std::fflush(stderr);
    ::raise(SIGKILL);
    std::abort();
  }

  DirectoryStore* const inner_;
  const bool after_commit_;
  const std::string model_, version_;
  std::mutex mu_;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: rc_crashing_directory DB_PATH PORT before-commit|after-commit MODEL VERSION\n");
    return 2;
  }
  const std::string mode = argv[3];
  if (mode != "before-commit" && mode != "after-commit") {
    std::fprintf(stderr, "rc_crashing_directory: unknown mode '%s'\n", mode.c_str());
    return 2;
  }
  auto sqlite = OpenSqliteStore(argv[1], WallClock());
  if (!sqlite.ok()) {
    std::fprintf(stderr, "rc_crashing_directory: %s\n", sqlite.status().ToString().c_str());
    return 2;
  }
  CrashingStore store(sqlite->get(), mode == "after-commit", argv[4], argv[5]);
  ServerOptions options;
  options.port = std::atoi(argv[2]);
  options.store_kind = "sqlite";
  DirectoryServer server(&store, options);
  if (Status s = server.Start(); !s.ok()) {
    std::fprintf(stderr, "rc_crashing_directory: %s\n", s.ToString().c_str());
    return 1;
  }
  std::printf("directory listening on %s (crashing %s at %s)\n", server.url().c_str(), mode.c_str(), argv[5]);
  std::fflush(stdout);
  for (;;) ::pause();
}
