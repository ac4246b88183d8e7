// ChildProcess: a rolloutcore subcommand run as a child process (the demo and the benchmarks
// start a directory, a trainer, an engine and a controller this way).
//
// Each child runs `/proc/self/exe ARGS...` (an rc::Subprocess, rolloutcore/base/subprocess.h) in
// its own process group with stdout and stderr appended to a log file, and is told to die with
// its parent (PR_SET_PDEATHSIG), so even a SIGKILLed parent leaves nothing behind. Stop() sends
// SIGTERM to the group, waits, then SIGKILL. StopAllChildren() stops every live child; the demo calls it on every exit path and
// from its SIGINT/SIGTERM handler.
//
// Thread safety: Spawn/Stop from one thread; StopAllChildren is async-signal-tolerant only in
// that it uses kill() and waitpid() (it is called from a signal-watching thread, not a handler).
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "rolloutcore/base/status.h"
#include "rolloutcore/base/subprocess.h"

namespace rc::apps {

class ChildProcess {
 public:
  ChildProcess() = default;
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  // Starts `rolloutcore ARGS...` with output to log_path. `exe` defaults to this executable
  // (/proc/self/exe); tests pass the rolloutcore binary.
  static Result<std::unique_ptr<ChildProcess>> Spawn(const std::string& name, const std::vector<std::string>& args,
                                                     const std::string& log_path, const std::string& exe = "");
  // True while the process has not exited (reaps it when it has).
  bool Alive();
  // SIGTERM, up to grace_ms, then SIGKILL; returns the exit status (or -signal).
  int Stop(int grace_ms = 3000);
  // SIGKILL now (fault experiments).
  void Kill();
  // SIGSTOP, then waits (up to timeout_ms) until the kernel reports the process stopped: kill()
  // returns before every thread stopped, and a multi-threaded child (a UCX progress thread) may
  // keep serving for a while on a loaded machine. DeadlineExceeded / FailedPrecondition (exited)
  // otherwise. Freeze leaves the stop report waitable (WNOWAIT); Thaw sends SIGCONT.
  [[nodiscard]] Status Freeze(int timeout_ms = 10000);
  void Thaw();
  pid_t pid() const { return proc_ ? proc_->pid() : -1; }
  const std::string& name() const { return name_; }
  const std::string& log_path() const { return log_path_; }
  // The last lines of the log, for error messages.
  std::string LogTail(size_t lines = 15) const;

 private:
  std::string name_;
  std::string log_path_;
  std::unique_ptr<Subprocess> proc_;
};

void StopAllChildren();
// A free TCP port on 127.0.0.1.
Result<int> FreePort();

}  // namespace rc::apps
