// Helpers for the directory's tests: shard tables that split tensors over ranks, child processes
// (a real etcd on loopback, the directory server binary), free loopback ports, temp dirs.
//
// Thread safety: ChildProcess and EtcdProcess are owned by one test thread; the table helpers are
// pure.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "rolloutcore/base/status.h"
#include "rolloutcore/base/subprocess.h"
#include "rolloutcore/directory/types.h"
#include "rolloutcore/refit/manifest.h"

namespace rc::directory::testing {

// Tensors w0..w{n-1}, each [rows, cols] bf16, split by rows over `ranks` ranks; the tables that
// `rank` owns. Digests are a deterministic function of (tensor, box), so all ranks agree.
std::vector<refit::ShardTable> RowShardTables(int32_t rank, int32_t ranks, int tensors = 2, int64_t rows = 8,
                                              int64_t cols = 4);
// A full replica of every tensor on `rank` (data parallel).
std::vector<refit::ShardTable> ReplicaTables(int32_t rank, int tensors = 2, int64_t rows = 8, int64_t cols = 4);
PublishRequest MakePublish(const std::string& model, const std::string& version, int32_t rank, int32_t ranks,
                           int64_t lease_ttl_ms = 60'000);

// A port that was free on 127.0.0.1 a moment ago.
int FreeLoopbackPort();
// A fresh directory under $TMPDIR (or /tmp); removed by RemoveTree.
std::string MakeTempDir(const std::string& prefix);
void RemoveTree(const std::string& path);
// Absolute path of `name` on $PATH, or "" when it is not installed.
std::string FindOnPath(const std::string& name);

// A child process (an rc::Subprocess) that dies with the test (PR_SET_PDEATHSIG) and is killed on
// destruction.
class ChildProcess {
 public:
  ChildProcess() = default;
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  // Starts argv[0] with argv; stdout goes to a pipe read by ReadLineContaining, stderr to
  // `stderr_path` (or is inherited when empty).
  [[nodiscard]] Status Start(const std::vector<std::string>& argv, const std::string& stderr_path = "");
  // Reads stdout lines until one contains `needle`; DeadlineExceeded after `timeout`.
  [[nodiscard]] Result<std::string> ReadLineContaining(const std::string& needle, std::chrono::milliseconds timeout);
  // Sends `sig` and reaps the child. Returns its wait status.
  int Kill(int sig);
  bool running() const { return proc_ != nullptr; }
  pid_t pid() const { return proc_ ? proc_->pid() : -1; }

 private:
  std::unique_ptr<Subprocess> proc_;
};

// A real single-member etcd on loopback: random free ports, a temp data dir, fast heartbeats so
// one-second leases work; killed and cleaned up on destruction.
class EtcdProcess {
 public:
  // Unavailable when the etcd binary is missing (message names it) or it does not come up.
  [[nodiscard]] static Result<std::unique_ptr<EtcdProcess>> Start();
  ~EtcdProcess();
  const std::string& endpoint() const { return endpoint_; }

 private:
  EtcdProcess() = default;
  ChildProcess process_;
  std::string data_dir_;
  std::string endpoint_;
};

}  // namespace rc::directory::testing
