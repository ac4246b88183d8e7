// Helpers shared by the benchmark commands that drive child processes over loopback HTTP.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "apps/child_process.h"
#include "rolloutcore/base/json.h"
#include "rolloutcore/base/status.h"

namespace rc::apps {

// METHOD 127.0.0.1:port/path with a JSON body; the parsed JSON answer of a 200, an error naming
// the call and the answer otherwise.
Result<Json> BenchCall(int port, const std::string& method, const std::string& path, const Json& body = Json::object(),
                       int timeout_s = 600);
// Polls GET path until 200; Unavailable with the child's log tail when it exits first,
// DeadlineExceeded after `seconds`.
Status BenchWaitHealthy(ChildProcess* child, int port, const std::string& path, int seconds);
// A `rolloutcore trainer serve --delta` child for the delta benches: model `model` as fsdp:`ranks`
// named `name`, publishing into the directory at `dir_url` over `transport`, every step changing
// about `fraction` of the elements; healthy within `wait_s` seconds. Its port in *port.
Result<std::unique_ptr<ChildProcess>> SpawnDeltaTrainer(const std::string& name, const std::string& model, int ranks,
                                                       const std::string& dir_url, const std::string& transport,
                                                       double fraction, const std::string& log_path, int wait_s,
                                                       int* port);
// Replaces this process with `$RC_PYTHON -m MODULE ARGS...` (RC_PYTHON defaults to python3): the
// benches written in Python, run as `rolloutcore bench ...`. ROLLOUTCORE_BIN is set to this binary
// unless set, and the package folder beside it (a build tree's <build>/python, a GPU bundle's
// <bundle>/python) is put first on PYTHONPATH, so the package matches the binary. Returns 127, with
// an error naming `what` and `needs` (what that Python must have), only when exec failed.
int ExecPythonModule(const std::string& module, const std::vector<std::string>& args, const std::string& what,
                     const std::string& needs);
// Best of three single-thread memcpy runs over `bytes`, in GB/s.
double MemcpyGbps(uint64_t bytes);
// Best of three memcpy runs over `bytes` split evenly over `threads` threads (threads <= 0: all
// hardware threads), in GB/s: what "all-thread memcpy of the same bytes" means in the reports.
double MemcpyGbpsThreads(uint64_t bytes, int threads);

// One buffer pair of `bytes`, allocated and touched once, so that a memcpy over `threads` threads
// (<= 0: all hardware threads) can be timed right next to each measured run: on a shared machine
// the memory bandwidth moves between seconds, and a ratio is only as good as its pairing.
class MemcpyPairing {
 public:
  MemcpyPairing(uint64_t bytes, int threads);
  // One timed copy, in ms.
  double CopyMs();
  int threads() const { return threads_; }

 private:
  uint64_t bytes_;
  int threads_;
  std::vector<char> a_, b_;
};

}  // namespace rc::apps
